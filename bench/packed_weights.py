"""oneDNN-prepacked linear weights (`specdec.model.PackedWeight`) on and off, in process.

    python bench/packed_weights.py [--questions 8] [--temperature 0] [--dtype bfloat16]

The demo target with its lookup corpus and the shipped EAGLE draft; answers of 64 tokens (EOS
ignored) to the HTTP benchmark's fresh questions through the service's paths: plain decoding at
batch 1 (speculation off at concurrency 1), the default app's multi-step rounds with lookups and
the in-target draft at batch 1 (`bench/draft_in_target.py`'s "draft k2"), and plain decoding of
all questions as one batch (a lane of several rows: more rows per matmul). Each runs with packed
weights and with plain F.linear (packing switched off for this comparison only), alternated
question by question. Prints tokens/s, the speedup of packing, the in-target path's ratio over
plain decoding with the same setting, and whether the outputs are the same tokens with and without
packing (they must be: both give bit-identical logits on this CPU).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from draft_in_target import make_engine  # noqa: E402
from http_bench import PROMPT_SETS  # noqa: E402
from lookup_gate import make_engine as lookup_engine  # noqa: E402

from specdec import model as model_mod  # noqa: E402
from specdec.corpus import NgramCorpus  # noqa: E402
from specdec.eagle_draft import load_eagle  # noqa: E402
from specdec.loader import bundled_corpus_for, load_model, load_tokenizer, resolve_corpus  # noqa: E402
from specdec.prompts import encode_chat  # noqa: E402
from specdec.sampling import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", default="fresh", choices=sorted(PROMPT_SETS))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    tok, model = load_tokenizer("smollm2"), load_model("smollm2", dtype=dtype)
    corpus = NgramCorpus.load(resolve_corpus(bundled_corpus_for("smollm2")))
    eagle = load_eagle("smollm2-eagle", model, dtype)
    prompts = [encode_chat(tok, [{"role": "user", "content": q}]) for q in PROMPT_SETS[a.prompts][: a.questions]]
    engines = {m: make_engine(model, tok, corpus, eagle, m) for m in ("plain", "draft k2")}
    batched = lookup_engine(model, tok, corpus, len(prompts), "plain", 0)  # last: the shared cache holds its rows
    packable = dict(model_mod._PACKABLE)
    if not packable.get(dtype):
        sys.exit(f"this build of torch cannot prepack {a.dtype} weights")
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, ignore_eos=True)
    configs = [(m, on) for m in engines for on in (True, False)]
    spent = {c: [0, 0.0] for c in configs}
    outs = {c: [] for c in configs}

    def use(on: bool) -> None:
        model_mod._PACKABLE.clear()
        model_mod._PACKABLE.update(packable if on else {})

    for i, p in enumerate(tqdm(prompts, desc="questions")):
        for m, on in (configs if i % 2 == 0 else configs[::-1]):
            use(on)
            t0 = time.perf_counter()
            seq = engines[m].generate([p], dataclasses.replace(params, seed=i))[0]
            spent[(m, on)][1] += time.perf_counter() - t0
            spent[(m, on)][0] += len(seq.output_ids)
            outs[(m, on)].append(seq.output_ids)
    print(f"\n{a.dtype}, {a.questions} {a.prompts} questions x {a.max_tokens} tokens, T = {a.temperature}")
    print("| path | packed tok/s | F.linear tok/s | packing | vs plain (packed / F.linear) | same output |")
    print("|---|---|---|---|---|---|")
    tps = {c: n / s for c, (n, s) in spent.items()}
    for m in engines:
        on, off = tps[(m, True)], tps[(m, False)]
        vs = f"{on / tps[('plain', True)]:.2f}x / {off / tps[('plain', False)]:.2f}x"
        print(f"| batch 1, {m} | {on:.1f} | {off:.1f} | {on / off:.2f}x | {vs} | "
              f"{'yes' if outs[(m, True)] == outs[(m, False)] else 'NO'} |")
    b8 = {True: [0, 0.0], False: [0, 0.0]}
    b8_outs = {}
    for r in tqdm(range(4), desc=f"batch {len(prompts)}"):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            use(on)
            t0 = time.perf_counter()
            seqs = batched.generate(prompts, params)
            b8[on][1] += time.perf_counter() - t0
            b8[on][0] += sum(len(s.output_ids) for s in seqs)
            b8_outs[on] = [s.output_ids for s in seqs]
    on, off = (b8[x][0] / b8[x][1] for x in (True, False))
    print(f"| batch {len(prompts)}, plain | {on:.1f} | {off:.1f} | {on / off:.2f}x | - | "
          f"{'yes' if b8_outs[True] == b8_outs[False] else 'NO'} |")
    use(True)


if __name__ == "__main__":
    main()
