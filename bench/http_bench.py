"""Benchmark the service over HTTP: concurrency levels x speculation on/off, in one run.

    python bench/http_bench.py                       # starts the demo pair on a local Ray cluster
    python bench/http_bench.py --url http://127.0.0.1:8000 --model SmolLM2-135M-Instruct

Streaming chat requests (greedy, fixed max_tokens, ignore_eos) at each concurrency level, once
with the server's adaptive speculation and once with `num_speculative_tokens: 0`. Prints tokens/s,
time to first token, inter-token latency (p50), the acceptance rate from the router's /stats, and
the in-process engine's tokens/s on the same prompts at batch 1 (service / engine ratio).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

import httpx
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

QUESTIONS = ["What is the capital of France?", "Explain what a hash table is.",
             "Write a Python function that reverses a string.", "What does the zip builtin do?",
             "Give three tips for writing readable code.", "How do I read a file line by line in Python?",
             "What is the difference between a list and a tuple?", "Summarize what recursion is."]


async def one(client, url, model, q, max_tokens, spec: bool):
    body = {"model": model, "messages": [{"role": "user", "content": q}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}
    if not spec:
        body["num_speculative_tokens"] = 0
    t0 = time.perf_counter()
    times, text = [], []
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                times.append(time.perf_counter())
                text.append(chunk["choices"][0]["delta"]["content"])
    return t0, times, max_tokens


async def level(url, model, concurrency, requests, max_tokens, spec, bar):
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        async def task(i):
            async with sem:
                res = await one(client, url, model, QUESTIONS[i % len(QUESTIONS)], max_tokens, spec)
                bar.update()
                return res
        t0 = time.perf_counter()
        results = await asyncio.gather(*[task(i) for i in range(requests)])
        wall = time.perf_counter() - t0
    tokens = sum(n for _, _, n in results)
    ttft = [ts[0] - t for t, ts, _ in results if ts]
    itl = [(ts[-1] - ts[0]) / (n - 1) for t, ts, n in results if len(ts) > 1]
    return {"tps": tokens / wall, "ttft": statistics.median(ttft), "itl": statistics.median(itl)}


def engine_baseline(target, dtype, max_tokens, proposer="ngram", draft=None, n_prompts=4) -> float:
    """In-process engine tokens/s at batch 1 (adaptive, the service's proposer), same prompts."""
    from specdec.engine import EngineConfig, LLMEngine
    from specdec.loader import load_model, load_tokenizer, parse_dtype
    from specdec.prompts import encode_chat
    from specdec.proposers import build_proposer
    from specdec.sampling import SamplingParams
    from specdec.target import TargetWorker
    tok = load_tokenizer(target)
    model = load_model(target, dtype=parse_dtype(dtype))
    prop = build_proposer(proposer, draft=draft, target=target, target_model=model, dtype=parse_dtype(dtype),
                          num_slots=1, max_model_len=2048)
    eng = LLMEngine(TargetWorker(model, 1, 2048), prop, tok, EngineConfig(max_batch_size=1))
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    prompts = [encode_chat(tok, [{"role": "user", "content": q}]) for q in QUESTIONS[:n_prompts]]
    eng.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0))
    t0 = time.perf_counter()
    eng.generate(prompts, sp)
    return n_prompts * max_tokens / (time.perf_counter() - t0)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="a running service; default: start the demo pair locally")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--proposer", default=None, help="default: the app's default (AppArgs)")
    ap.add_argument("--draft", default=None, help="draft checkpoint for proposer draft/eagle/hybrid")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests", type=int, default=0, help="per level (default: 2 x concurrency, >= 4)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--no-engine", action="store_true")
    a = ap.parse_args(argv)
    levels = [int(c) for c in a.concurrency.split(",")]
    url = a.url
    if url is None:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        import ray
        from ray import serve
        from serve_app import build_app
        ray.init(include_dashboard=False, logging_level="WARNING", log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": 8765})
        args = {"target": a.target, "dtype": a.dtype, "max_batch_size": max(levels)}
        args.update({k: v for k, v in (("proposer", a.proposer), ("draft", a.draft)) if v is not None})
        serve.run(build_app(args), name="bench", route_prefix="/")
        url = "http://127.0.0.1:8765"
    n_req = {c: a.requests or max(4, 2 * c) for c in levels}
    bar = tqdm(total=2 * sum(n_req.values()), desc="http bench")
    rows = []
    for c in levels:
        for spec in (False, True):
            before = httpx.get(f"{url}/stats", timeout=30).json()
            r = asyncio.run(level(url, a.model, c, n_req[c], a.max_tokens, spec, bar))
            after = httpx.get(f"{url}/stats", timeout=30).json()
            prop = after["proposed"] - before["proposed"]
            acc = (after["accepted"] - before["accepted"]) / prop if prop else 0.0
            rounds = after["rounds"] - before["rounds"]
            split = {k: (after[k] - before[k]) / max(1, rounds) * 1e3 for k in ("draft_time", "target_time", "round_time")}
            rows.append((c, spec, r, acc, split))
    bar.close()
    from serve_app.args import AppArgs
    app = AppArgs(**{k: v for k, v in (("target", a.target), ("proposer", a.proposer), ("draft", a.draft))
                     if v is not None})
    base = None if a.no_engine else engine_baseline(a.target, a.dtype, a.max_tokens, app.proposer, app.draft)
    print(f"\n{a.model} via {url} (proposer {app.proposer}), greedy streaming chat, {a.max_tokens} tokens, {a.dtype}")
    print("| concurrency | speculation | tokens/s | TTFT p50 ms | ITL p50 ms | acceptance | round ms (draft / target / other) | spec/off |")
    print("|---|---|---|---|---|---|---|---|")
    off = {}
    for c, spec, r, acc, sp in rows:
        if not spec:
            off[c] = r["tps"]
        other = sp["round_time"] - sp["draft_time"] - sp["target_time"]
        print(f"| {c} | {'adaptive' if spec else 'off'} | {r['tps']:.1f} | {r['ttft'] * 1e3:.0f} | {r['itl'] * 1e3:.1f} | "
              f"{acc:.2f} | {sp['round_time']:.1f} ({sp['draft_time']:.1f} / {sp['target_time']:.1f} / {other:.1f}) | "
              f"{r['tps'] / off[c]:.2f}x |")
    if base:
        c1 = next(r for c, s, r, _, _ in rows if c == 1 and s) if 1 in levels else None
        print(f"\nin-process engine, batch 1, adaptive {app.proposer}: {base:.1f} tokens/s"
              + (f"; service at concurrency 1 keeps {c1['tps'] / base:.0%}" if c1 else ""))


if __name__ == "__main__":
    main()
