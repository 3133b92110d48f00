"""How long prompt-lookup drafts should run, in process at batch 1: the hybrid's n-gram rows in
speculative rounds (`ngram_k`) and the lookups inside multi-step plain rounds (`lookup_k`).

    python bench/ngram_k.py [--ngram-ks 0,8] [--lookups 4,8] [--k 3] [--prompts 8] [--max-tokens 64]

The engine with the hybrid proposer (n-gram matches of >= 3 tokens, the shipped EAGLE draft
otherwise) at fixed k, and plain 8-step rounds with `lookup_k` prompt-lookup tokens per step,
plain decoding beside them, on the chat and code prompts of `specdec-bench`.
Configurations alternate prompt by prompt (this machine's speed drifts within minutes), every
output is checked against plain decoding, and the table gives tokens/s, the ratio to plain
decoding in the same run, and tokens per round.
"""
from __future__ import annotations

import argparse
from collections import defaultdict

from tqdm import tqdm

from specdec.proposers import NgramProposer
from specdec_tools.bench import add_target_args, draft_factories, load_demo_target, prompt_kinds, run_engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ngram-ks", default="0,8", help="ngram_k values (0: the n-gram rows draft k)")
    ap.add_argument("--lookups", default="", help="lookup_k values of plain 8-step rounds (none: not measured)")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per kind")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    add_target_args(ap)
    a = ap.parse_args()
    tok, model, dtype = load_demo_target(a)
    hybrid = dict(draft_factories("smollm2-eagle", model, dtype))["hybrid (ngram>=3 + eagle)"]
    kinds = prompt_kinds(tok, a.prompts)
    confs = [("plain", None, 0, 0, 0)] + [(f"hybrid k{a.k} ngram_k {n}", hybrid, a.k, n, 0)
                                          for n in map(int, a.ngram_ks.split(",") if a.ngram_ks else [])]
    confs += [(f"plain + lookup_k {n}", lambda b: NgramProposer(), 0, 0, n)
              for n in map(int, a.lookups.split(",") if a.lookups else [])]
    bar = tqdm(total=a.repeats * sum(map(len, kinds.values())) * len(confs), desc="lookup lengths")
    for kind, prompts in kinds.items():
        tot, ref = defaultdict(lambda: [0, 0.0, 0]), {}
        for _ in range(a.repeats):
            for i, p in enumerate(prompts):
                for name, make, k, n, lookup in confs:
                    out, dt, st = run_engine(model, tok, [p], make(1) if make else None, k, 1, a.max_tokens,
                                             ngram_k=n, lookup=lookup)
                    ref.setdefault(i, out)
                    if out != ref[i]:
                        raise AssertionError(f"{name}: output differs from plain decoding on {kind} prompt {i}")
                    t = tot[name]
                    t[0], t[1], t[2] = t[0] + len(out[0]), t[1] + dt, t[2] + st.rounds
                    bar.update()
        plain = tot["plain"][0] / tot["plain"][1]
        dname = str(dtype).removeprefix("torch.")
        tqdm.write(f"\n### {kind} prompts ({len(prompts)}), greedy, {a.max_tokens} tokens, {dname}, batch 1\n"
                   "| config | tokens/s | vs plain | tokens per round |\n|---|---|---|---|")
        for name, (n, s, r) in tot.items():
            tqdm.write(f"| {name} | {n / s:.1f} | {n / s / plain:.2f}x | {n / max(r, 1):.2f} |")
    bar.close()


if __name__ == "__main__":
    main()
