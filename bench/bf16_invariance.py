"""bfloat16: does speculation change greedy output, and what does position invariance cost?

    python bench/bf16_invariance.py                 # 32 prompts x 128 tokens, batch 8
    python bench/bf16_invariance.py --prompts 8 --max-tokens 64

For the demo target in bfloat16, with `Transformer.position_invariant` off (SDPA, one-row
matmuls: the engine before) and on (specdec/model.py's module docstring):

1. rows: the logits of 16 positions computed 1, 2, 4 and 8 positions per forward; the largest
   difference between any two ways and how many argmaxes flip;
2. divergence: greedy output of plain decoding against speculative decoding (n-gram proposer,
   k = 3, and the shipped EAGLE draft in the hybrid) on everyday questions: prompts whose output
   differs, and the first differing position;
3. speed: plain tokens/s at batch 1 and at batch 8, and the verification forward (k + 1 = 4
   positions) against a plain step at batch 1, in milliseconds.
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(__file__))
from http_bench import QUESTIONS  # noqa: E402

from specdec.engine import EngineConfig, LLMEngine  # noqa: E402
from specdec.loader import load_model, load_tokenizer  # noqa: E402
from specdec.prompts import encode_chat  # noqa: E402
from specdec.proposers import EagleProposer, HybridProposer, NgramProposer  # noqa: E402
from specdec.sampling import SamplingParams  # noqa: E402
from specdec.target_worker import TargetWorker  # noqa: E402
from specdec_tools.distill.chat import seed_prompts, split_topics  # noqa: E402


def prompts(tok, n: int) -> list[list[int]]:
    """Everyday questions of the HTTP benchmark, then held-out-topic chat prompts (never trained on)."""
    texts = QUESTIONS + [it.messages[0]["content"] for it in seed_prompts(split_topics()[1], seed=2)]
    return [encode_chat(tok, [{"role": "user", "content": t}]) for t in texts[:n]]


@torch.inference_mode()
def rows_check(model, ctx: list[int], n: int = 16) -> tuple[float, int]:
    """Max |logit difference| and argmax flips between 1/2/4/8 positions per forward."""
    P = len(ctx) - n
    model.setup_cache(1, len(ctx) + 8)
    out = {}
    for chunk in (1, 2, 4, 8):
        model(torch.tensor([ctx[:P]]), torch.tensor([0]), torch.tensor([0]))
        parts = []
        for c in range(0, n, chunk):
            toks = ctx[P + c: P + c + chunk]
            lg, _ = model(torch.tensor([toks]), torch.tensor([0]), torch.tensor([P + c]), n_logits=len(toks))
            parts.append(lg[0])
        out[chunk] = torch.cat(parts)
    diff = max((out[a] - out[b]).abs().max().item() for a, b in itertools.combinations(out, 2))
    flips = max(int((out[a].argmax(-1) != out[b].argmax(-1)).sum()) for a, b in itertools.combinations(out, 2))
    return diff, flips


def generate(model, tok, ps, proposer, k: int, max_tokens: int, batch: int):
    max_len = max(len(p) for p in ps) + max_tokens + 8
    eng = LLMEngine(TargetWorker(model, batch, max_len), proposer, tok,
                    EngineConfig(max_batch_size=batch, max_model_len=max_len, num_speculative_tokens=k,
                                 adaptive=False, speculate=proposer is not None))
    t0 = time.perf_counter()
    seqs = eng.generate(ps, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return [s.output_ids for s in seqs], sum(len(s.output_ids) for s in seqs) / (time.perf_counter() - t0)


@torch.inference_mode()
def step_ms(model, T: int, ctx: int = 128, reps: int = 15) -> float:
    model.setup_cache(1, ctx + 16)
    model(torch.ones(1, ctx, dtype=torch.long), torch.tensor([0]), torch.tensor([0]))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        model(torch.ones(1, T, dtype=torch.long), torch.tensor([0]), torch.tensor([ctx]), n_logits=T)
        ts.append(1000 * (time.perf_counter() - t0))
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--draft", default="smollm2-eagle", help="EAGLE draft for the hybrid row ('' = skip)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--k", type=int, default=3, help="draft tokens per round (batch x (k + 1) rows per verify)")
    ap.add_argument("--invariant-only", action="store_true", help="skip position_invariant off")
    ap.add_argument("--linear-rows", type=int, help="specdec.model.LINEAR_ROWS for this run (e.g. 4096: one "
                    "call for every row, as before the chunking)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.linear_rows:
        import specdec.model
        specdec.model.LINEAR_ROWS = a.linear_rows
    tok = load_tokenizer("smollm2")
    model = load_model("smollm2", dtype=torch.bfloat16)
    ps = prompts(tok, a.prompts)
    rows = []
    for exact in (True,) if a.invariant_only else (False, True):
        model.exact_positions = exact
        diff, flips = rows_check(model, ps[0] + tok(" The water cycle moves water between the sea, the air "
                                                    "and the land, again and again.").input_ids)
        ref, plain_tps = generate(model, tok, ps, None, 0, a.max_tokens, a.batch)
        _, plain1_tps = generate(model, tok, ps[:2], None, 0, a.max_tokens // 2, 1)
        proposers = [(f"ngram k={a.k}", lambda: NgramProposer())]
        if a.draft:
            from specdec.eagle_draft import load_eagle
            draft = load_eagle(a.draft, model, torch.bfloat16)
            proposers.append((f"hybrid k={a.k}", lambda: HybridProposer(NgramProposer(min_n=3, max_n=5),
                                                                   EagleProposer(draft, a.batch, 1024))))
        for name, make in tqdm(proposers, desc=f"exact={exact}", leave=False):
            out, spec_tps = generate(model, tok, ps, make(), a.k, a.max_tokens, a.batch)
            differ = [next(j for j, (x, y) in enumerate(zip(r, o)) if x != y) for r, o in zip(ref, out) if r != o]
            rows.append((exact, name, diff, flips, len(differ), len(ps), sorted(differ)[:6], plain1_tps, plain_tps,
                         spec_tps, step_ms(model, 1), step_ms(model, 4)))
    print(f"\n## bfloat16 position invariance ({a.prompts} prompts x {a.max_tokens} tokens, batch {a.batch}, "
          f"{a.threads} threads)\n")
    print("| position_invariant | proposer | rows: max dlogit / flips | prompts diverging | first divergences "
          f"| plain tok/s b1 | plain tok/s b{a.batch} | spec tok/s b{a.batch} | step ms T=1 | verify ms T=4 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {'on' if r[0] else 'off'} | {r[1]} | {r[2]:.3f} / {r[3]} | {r[4]} of {r[5]} | {r[6]} | "
              f"{r[7]:.1f} | {r[8]:.1f} | {r[9]:.1f} | {r[10]:.1f} | {r[11]:.1f} |")


if __name__ == "__main__":
    main()
