"""The draft inside the Target replica (`TargetWorker.drafter`), in process, at batch 1.

    python bench/draft_in_target.py [--temperatures 0,0.7,1.0] [--ks 2,3] [--questions 8]

The demo target in bf16 with its lookup corpus; answers of 64 tokens (EOS ignored) to the HTTP
benchmark's fresh questions, one request at a time, through engines configured as the service's
multi-step plain rounds at concurrency 1 (8 steps per call, the adaptive LookupGate on):

- plain: no lookups (the service with speculation off);
- lookup: prompt lookup continued from the corpus (the service before the in-target draft);
- draft kK: lookups, and rows that prompt lookup finds nothing for drafted K tokens per step by the
  shipped EAGLE draft in the same process, K for every row (the service's default: 3 for greedy
  rows, `draft_in_target_greedy_k`, and 2 for sampled ones, `draft_in_target_k`).

Configurations alternate question by question (order reversed every other question); tokens/s,
ratio over plain in the same run, the in-target draft's accepted/proposed tokens, and whether
every output equals plain decoding's (it must: drafts are checked against plain decoding's draws).
Requests are seeded by default (sampled rows then keep the draft's greedy chain where it equals
their draw); `--seeding unseeded` sends the in-target draft's requests without a seed, as most
clients do: sampled rows then race their chains with the noise of their own draws
(TargetWorker._step_drafts), and their outputs are samples, not comparable token for token;
`--seeding both` runs the draft modes both ways, alternated with the rest.
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

from http_bench import PROMPT_SETS  # noqa: E402
from lookup_gate import demo_target  # noqa: E402

from specdec.eagle_draft import load_eagle  # noqa: E402
from specdec.engine import EngineConfig, LLMEngine  # noqa: E402
from specdec.prompts import encode_chat  # noqa: E402
from specdec.proposers import EagleProposer, NgramProposer  # noqa: E402
from specdec.sampling import SamplingParams  # noqa: E402
from specdec.target_worker import TargetWorker  # noqa: E402


def make_engine(model, tok, corpus, eagle, mode: str) -> LLMEngine:
    lookups = mode != "plain"
    drafter, k = (EagleProposer(eagle, 1, 2048), int(mode.split("k")[-1])) if mode.startswith("draft") else (None, 2)
    return LLMEngine(TargetWorker(model, 1, 2048, corpus=corpus, drafter=drafter, draft_k=k), NgramProposer(), tok,
                     EngineConfig(max_batch_size=1, num_speculative_tokens=0, adaptive=True, speculate=lookups,
                                  plain_steps=8, lookup_k=2 if lookups else 0, lookup_max_batch=8,
                                  ngram_k=8 if lookups else 0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--temperatures", default="0,1.0")
    ap.add_argument("--ks", default="2", help="draft lengths of the in-target draft to compare")
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seeding", choices=("seeded", "unseeded", "both"), default="seeded",
                    help="the draft modes' requests: with a seed, without one (the race for sampled rows), or both")
    ap.add_argument("--prompts", default="fresh", choices=sorted(PROMPT_SETS))
    a = ap.parse_args()
    tok, model, corpus = demo_target(a.threads)
    eagle = load_eagle("smollm2-eagle", model, torch.bfloat16)
    prompts = [encode_chat(tok, [{"role": "user", "content": q}]) for q in PROMPT_SETS[a.prompts][: a.questions]]
    drafts = [f"draft k{k}" for k in a.ks.split(",")]
    modes = ["plain", "lookup"] + {"seeded": drafts, "unseeded": [f"{d} unseeded" for d in drafts],
                                   "both": [f"{d}{u}" for d in drafts for u in ("", " unseeded")]}[a.seeding]
    rows = []
    for t in (float(v) for v in a.temperatures.split(",")):
        engines = {m: make_engine(model, tok, corpus, eagle, m.removesuffix(" unseeded")) for m in modes}
        spent = {m: [0, 0.0] for m in modes}
        same = {m: True for m in modes}
        for i, p in enumerate(tqdm(prompts, desc=f"T={t}")):
            outs = {}
            for m in (modes if i % 2 == 0 else modes[::-1]):
                t0 = time.perf_counter()
                seq = engines[m].generate([p], SamplingParams(max_tokens=a.max_tokens, temperature=t,
                                                              seed=None if m.endswith("unseeded") else i,
                                                              ignore_eos=True))[0]
                spent[m][1] += time.perf_counter() - t0
                spent[m][0] += len(seq.output_ids)
                outs[m] = seq.output_ids
            for m in modes:
                same[m] &= outs[m] == outs["plain"]
        base = spent["plain"][0] / spent["plain"][1]
        for m in modes:
            st = engines[m].stats
            tps = spent[m][0] / spent[m][1]
            rows.append((t, m, tps, tps / base, f"{st.target_draft_accepted}/{st.target_drafted}",
                         f"{st.lookup_accepted}/{st.lookup_proposed}",
                         "n/a (unseeded)" if m.endswith("unseeded") and t > 0 else "yes" if same[m] else "NO"))
    print(f"\nbatch 1, bf16, {a.questions} {a.prompts} questions x {a.max_tokens} tokens, 8 steps per call")
    print("| T | mode | tokens/s | vs plain | in-target draft accepted/proposed | all lookups accepted/proposed | same output |")
    print("|---|---|---|---|---|---|---|")
    for t, m, tps, ratio, drafted, looked, same in rows:
        print(f"| {t} | {m} | {tps:.1f} | {ratio:.2f}x | {drafted} | {looked} | {same} |")


if __name__ == "__main__":
    main()
