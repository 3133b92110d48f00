"""Where a round's wall time goes in the service, next to the same forward in process.

    python bench/round_profile.py                      # starts the default app on a local Ray cluster
    python bench/round_profile.py --concurrency 1,4 --requests 8 --max-tokens 48

For each concurrency level and for speculation off and on (the server's adaptive policy), it sends
streaming chat requests (greedy, or sampled with --temperature; questions from bench/http_bench.py,
not the distillation data) and reads the router's round profile (`/stats` -> `profile`, deltas over the level). One
row per (level, mode, round kind): per round, in milliseconds,

- plan: the router's bookkeeping before the calls (scheduler plan, batch building);
- draft call = the client-side wait for `Draft.propose`; of it, `compute` is the proposer's own
  work in the replica, `to` the way there (routing, serialization, transfer, queueing in the
  replica until the method starts), `back` the way back (the result's serialization, transfer,
  the router's event loop), and the rest the replica's overhead around the work (lock, span);
- target call, split the same way (`compute`: the replica's forward + rejection sampler);
- commit: applying the results (append, detokenize, stops, adaptive k) and waking clients;
- round: all of it; tok/round: tokens emitted per round;
- http ms/tok: the client's wall time per token minus the router's round time per token (the
  proxy, SSE framing, the client's own parsing: everything outside the rounds).

Then the in-process reference: the same prompts decoded plain by `LLMEngine` at the same batch
size in this process (same threads), its target forward ms per round.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys

import httpx
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from http_bench import PROMPT_SETS, level, run_engine, start_local  # noqa: E402

FIELDS = ("rounds", "rows", "tokens", "plan_s", "draft_call_s", "draft_compute_s", "draft_to_s", "draft_back_s",
          "target_call_s", "target_compute_s", "target_to_s", "target_back_s", "commit_s", "round_s")


def profile_delta(before: dict, after: dict) -> dict[str, dict[str, float]]:
    out = {}
    for kind, a in after.get("profile", {}).items():
        b = before.get("profile", {}).get(kind, {})
        d = {f: a.get(f, 0.0) - b.get(f, 0.0) for f in FIELDS}
        if d["rounds"] > 0:
            out[kind] = d
    return out


def in_process(target: str, dtype: str, batch: int, max_tokens: int, threads: int) -> dict:
    """Plain decoding in this process: target forward ms and round ms per round at `batch`, with
    the target replica's own cache shape (slots, max_model_len) and feature output."""
    import torch

    from serve_app.args import AppArgs
    from specdec.loader import load_model, load_tokenizer, parse_dtype
    from specdec.target_worker import TargetWorker
    torch.set_num_threads(threads)
    app = AppArgs(target=target, dtype=dtype)
    app.validate_models()
    tok, model = load_tokenizer(target), load_model(target, dtype=parse_dtype(dtype))
    worker = TargetWorker(model, app.target_slots, app.max_model_len, return_hidden=app.uses_features)
    return run_engine(tok, worker, None, batch, batch, max_tokens)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="a running service; default: start the default app locally")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--dtype", default="auto", help="auto: the app's default (specdec.loader.fast_dtype)")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--requests", type=int, default=0, help="per level and mode (default: 2 x concurrency, >= 4)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="in-process reference threads")
    ap.add_argument("--app-args", default="{}", help="JSON: extra AppArgs for the local app")
    ap.add_argument("--no-engine", action="store_true", help="skip the in-process reference")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sampled requests (unseeded)")
    ap.add_argument("--prompts", default="everyday", choices=sorted(PROMPT_SETS), help="which questions")
    ap.add_argument("--modes", default="off,adaptive", help="off, adaptive, or kN (N drafts per round, pinned)")
    a = ap.parse_args(argv)
    if a.dtype == "auto":
        from specdec.loader import fast_dtype
        a.dtype = fast_dtype()
    import json
    levels = [int(c) for c in a.concurrency.split(",")]
    url = a.url or start_local({"target": a.target, "dtype": a.dtype, **json.loads(a.app_args)})
    n_req = {c: a.requests or max(4, 2 * c) for c in levels}
    modes = {"off": False, "adaptive": True, **{m: int(m[1:]) for m in a.modes.split(",") if m.startswith("k")}}
    modes = {m: modes[m] for m in a.modes.split(",")}
    bar = tqdm(total=len(modes) * sum(n_req.values()), desc="round profile")
    rows = []
    for c in levels:
        for mode, spec in modes.items():
            before = httpx.get(f"{url}/stats", timeout=30).json()
            r = asyncio.run(level(url, a.model, c, n_req[c], a.max_tokens, spec, bar, a.temperature,
                                  PROMPT_SETS[a.prompts]))
            after = httpx.get(f"{url}/stats", timeout=30).json()
            rows.append((c, mode, r, profile_delta(before, after)))
    bar.close()
    ref = {} if a.no_engine else {c: in_process(a.target, a.dtype, c, a.max_tokens, a.threads) for c in levels}

    how = "greedy" if a.temperature == 0 else f"temperature {a.temperature:g}"
    print(f"\nround profile: {a.model} via {url}, {how} streaming chat ({a.prompts} questions), "
          f"{a.max_tokens} tokens, {a.dtype}")
    print("| conc. | speculation | round kind | rounds | tok/round | plan | draft call (compute / to / back) | "
          "target call (compute / to / back) | commit | round | http ms/tok | client tok/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for c, mode, r, prof in rows:
        all_round = sum(d["round_s"] for d in prof.values())
        all_tokens = sum(d["tokens"] for d in prof.values()) or 1
        http = 1e3 / r["tps"] * c - all_round / all_tokens * 1e3 * c if r["tps"] else 0.0
        for kind, d in sorted(prof.items()):
            n = d["rounds"]
            ms = {f: d[f] / n * 1e3 for f in FIELDS if f.endswith("_s")}
            print(f"| {c} | {mode} | {kind} | {int(n)} | {d['tokens'] / n:.2f} | "
                  f"{ms['plan_s']:.1f} | {ms['draft_call_s']:.1f} ({ms['draft_compute_s']:.1f} / "
                  f"{ms['draft_to_s']:.1f} / {ms['draft_back_s']:.1f}) | {ms['target_call_s']:.1f} "
                  f"({ms['target_compute_s']:.1f} / {ms['target_to_s']:.1f} / {ms['target_back_s']:.1f}) | "
                  f"{ms['commit_s']:.1f} | {ms['round_s']:.1f} | {http:.1f} | {r['tps']:.1f} |")
    if ref:
        print("\n| batch | in-process plain: target forward ms | round ms | tok/s |")
        print("|---|---|---|---|")
        for c, v in ref.items():
            print(f"| {c} | {v['target_ms']:.1f} | {v['round_ms']:.1f} | {v['tps']:.1f} |")


if __name__ == "__main__":
    main()
