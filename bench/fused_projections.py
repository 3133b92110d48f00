"""Fused projections (`specdec.model.FusedLinear`) on and off, in process, at batch 1.

    python bench/fused_projections.py [--questions 8] [--temperature 0]

The demo target in bf16 with its lookup corpus and the shipped EAGLE draft; answers of 64 tokens
(EOS ignored) to the HTTP benchmark's everyday-task questions, one request at a time, through the
service's two paths at concurrency 1: plain decoding (speculation off) and the default app's
multi-step rounds with lookups and the in-target draft (`bench/draft_in_target.py`'s "draft k2").
Each runs with the q/k/v and gate/up projections fused (one matmul each, as `setup_cache` leaves
them) and separate (the fused weights removed, for this comparison only), configurations
alternated question by question. Prints tokens/s, the ratio over unfused plain decoding and over
plain decoding with the same setting, and whether all four outputs are the same tokens (they must
be: fused and separate projections give bit-identical logits).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from draft_in_target import make_engine  # noqa: E402
from http_bench import PROMPT_SETS  # noqa: E402
from lookup_gate import demo_target  # noqa: E402

from specdec.eagle_draft import load_eagle  # noqa: E402
from specdec.prompts import encode_chat  # noqa: E402
from specdec.sampling import SamplingParams  # noqa: E402


def fused_modules(*models) -> list[tuple]:
    """Every FusedLinear of `models` with its fused weight and bias (set up by setup_cache)."""
    return [(f, f.weight, f.bias) for m in models for layer in m.layers
            for f in (layer.self_attn.qkv, layer.mlp.gate_up)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    tok, model, corpus = demo_target(a.threads)
    eagle = load_eagle("smollm2-eagle", model, torch.bfloat16)
    prompts = [encode_chat(tok, [{"role": "user", "content": q}]) for q in PROMPT_SETS["tasks"][: a.questions]]
    engines = {m: make_engine(model, tok, corpus, eagle, m) for m in ("plain", "draft k2")}  # set up (fused) here
    fused = fused_modules(model, eagle)
    configs = [(m, on) for m in engines for on in (True, False)]
    spent = {c: [0, 0.0] for c in configs}
    same = True
    for i, p in enumerate(tqdm(prompts, desc="questions")):
        outs = []
        for m, on in (configs if i % 2 == 0 else configs[::-1]):
            for f, w, b in fused:
                f.weight, f.bias = (w, b) if on else (None, None)
            t0 = time.perf_counter()
            seq = engines[m].generate([p], SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature,
                                                          seed=i, ignore_eos=True))[0]
            spent[(m, on)][1] += time.perf_counter() - t0
            spent[(m, on)][0] += len(seq.output_ids)
            outs.append(seq.output_ids)
        same &= all(o == outs[0] for o in outs)
    for f, w, b in fused:
        f.weight, f.bias = w, b
    tps = {c: n / t for c, (n, t) in spent.items()}
    print(f"\nbatch 1, bf16, {a.questions} task questions x {a.max_tokens} tokens, T = {a.temperature}")
    print("| path | projections | tokens/s | vs unfused plain | vs plain, same projections |")
    print("|---|---|---|---|---|")
    for m, on in configs:
        print(f"| {m} | {'fused' if on else 'separate'} | {tps[(m, on)]:.1f} | {tps[(m, on)] / tps[('plain', False)]:.2f}x "
              f"| {tps[(m, on)] / tps[('plain', on)]:.2f}x |")
    print(f"all outputs the same tokens: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
