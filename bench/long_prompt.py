"""A long prompt beside a running stream, over HTTP: how long the stream stalls, and the long
request's time to first token, with chunked prefill across rounds (`max_prefill_tokens`) and
without it.

    python bench/long_prompt.py [--tokens 1500] [--repeats 2] [--modes 0,256]
    SPECDEC_PREFILL_CHUNK=1000000 python bench/long_prompt.py --modes 0   # one call per prompt (no chunks)

Starts the demo app on a local Ray cluster once per mode (`max_prefill_tokens` = the mode). A
"short" client streams a greedy answer (`--short-tokens`, ignore_eos); when its first tokens have
arrived a "long" client sends a chat request whose prompt is about `--tokens` tokens of notes
and asks for 16 tokens. Prints one markdown table: the short stream's longest gap between two
chunks and its inter-chunk p50 while the long prompt entered, the long request's time to first
token (medians over repeats, each repeat with other notes), and in how many repeats the short
stream was still running when the long prompt's first token came (else its gaps cover only part
of the prefill: raise --short-tokens).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

import httpx
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(__file__))
from http_bench import QUESTIONS, TASKS, sse_chunks, start_local  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"


def notes(tokens: int, seed: int) -> str:
    """About `tokens` tokens of numbered notes (~12 tokens a line), different per seed."""
    lines = QUESTIONS + TASKS
    out = [f"{i + 1}. {lines[(i * 7 + seed) % len(lines)]}" for i in range(tokens // 12)]
    return "Here are my notes:\n" + "\n".join(out) + "\n\nWhich three of these notes are about food?"


async def stream(client: httpx.AsyncClient, url: str, content: str, max_tokens: int, started=None):
    """(request start, arrival times of content chunks, prompt tokens)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0, times, prompt_tokens = time.perf_counter(), [], 0
    async for chunk in sse_chunks(client, url, "/v1/chat/completions", body):
        if "error" in chunk:  # the request failed after its stream began
            raise RuntimeError(f"stream error: {chunk['error']}")
        if chunk.get("usage"):
            prompt_tokens = chunk["usage"]["prompt_tokens"]
        if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
            times.append(time.perf_counter())
            if started is not None and len(times) == 4:
                started.set()
    return t0, times, prompt_tokens


async def pair(url: str, tokens: int, seed: int, short_tokens: int) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        started = asyncio.Event()
        short = asyncio.create_task(stream(client, url, QUESTIONS[seed % len(QUESTIONS)], short_tokens, started))
        await started.wait()
        (lt0, ltimes, ltok), (_, stimes, _) = await asyncio.gather(stream(client, url, notes(tokens, seed), 16), short)
    during = [b - a for a, b in zip(stimes, stimes[1:]) if b > lt0 and a < ltimes[0]] or [0.0]
    return {"gap": max(during), "p50": statistics.median(during), "ttft": ltimes[0] - lt0, "prompt": ltok,
            "covered": stimes[-1] >= ltimes[0]}  # the short stream ran until the long prompt was in


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--short-tokens", type=int, default=256, help="the streaming answer's length")
    ap.add_argument("--modes", default="0,256", help="max_prefill_tokens values (0: a prompt in one round)")
    a = ap.parse_args(argv)
    chunk = os.environ.get("SPECDEC_PREFILL_CHUNK", "128")
    rows = []
    modes = [int(m) for m in a.modes.split(",")]
    bar = tqdm(total=len(modes) * (a.repeats + 1), desc="long prompt")
    for mode in modes:
        url = start_local({"max_prefill_tokens": mode})
        asyncio.run(pair(url, 200, 99, 32))  # warm-up (the first prefill of a length class is slower)
        bar.update()
        runs = []
        for r in range(a.repeats):
            runs.append(asyncio.run(pair(url, a.tokens, r, a.short_tokens)))
            bar.update()
        rows.append((mode, runs))
        import ray
        ray.shutdown()
    bar.close()
    print(f"\n### A ~{a.tokens}-token prompt beside a streaming answer (runner chunk {chunk}; medians of {a.repeats})\n")
    print("| max_prefill_tokens | prompt tokens | short stream: longest gap (s) | its p50 gap meanwhile (s) "
          "| long request TTFT (s) | stream outlasted the prefill |")
    print("|---|---|---|---|---|---|")
    for mode, runs in rows:
        med = {k: statistics.median(r[k] for r in runs) for k in ("gap", "p50", "ttft")}
        covered = sum(r["covered"] for r in runs)
        print(f"| {mode} | {runs[0]['prompt']} | {med['gap']:.2f} | {med['p50']:.3f} | {med['ttft']:.2f} "
              f"| {covered} of {len(runs)} |")


if __name__ == "__main__":
    main()
