"""Two (or more) EAGLE drafts side by side in the engine, at batch 1: which one makes decoding faster?

    python bench/draft_ab.py --drafts smollm2-eagle,/work/distill/eagle6 [--k 3] [--temperatures 0,1.0]

Each draft runs in the hybrid (prompt lookup where the text repeats, the draft elsewhere, as the
default app does) at fixed k with `ngram_k` 8 (no siblings: they are off by default), beside plain decoding, on
four prompt sets: `specdec-bench`'s chat questions and held-out code prefixes, and the HTTP
benchmark's everyday and coding questions (no distillation run trained on any of them).
Configurations alternate prompt by prompt (this machine's speed drifts within minutes). Greedy
outputs are checked against plain decoding. Sampled rows (temperature > 0) are sent without a
seed, as most clients send them (rejection sampling; a seeded row's drafts would be checked against
plain decoding's own draws instead, accepted less often), so their texts differ from run to run
and from plain decoding's. The table gives tokens/s, the
ratio to plain decoding in the same run, acceptance (accepted / proposed) and tokens per round.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from http_bench import PROMPT_SETS  # noqa: E402
from specdec.prompts import encode_chat  # noqa: E402
from specdec_tools.bench import add_target_args, draft_factories, load_demo_target, prompt_kinds, run_engine  # noqa: E402


def prompt_sets(tok, n: int) -> dict[str, list[list[int]]]:
    http = {f"http {name}": [encode_chat(tok, [{"role": "user", "content": q}]) for q in qs[:n]]
            for name, qs in PROMPT_SETS.items()}
    return {f"bench {kind}": ids for kind, ids in prompt_kinds(tok, n).items()} | http


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafts", default="smollm2-eagle", help="comma-separated EAGLE draft directories")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per set (at most)")
    ap.add_argument("--sets", default="", help="comma-separated prompt sets (default: all)")
    ap.add_argument("--temperatures", default="0", help="comma-separated; 0 = greedy")
    ap.add_argument("--max-tokens", type=int, default=64)
    add_target_args(ap)
    a = ap.parse_args()
    tok, model, dtype = load_demo_target(a)
    drafts = a.drafts.split(",")
    hybrids = {d: dict(draft_factories(d, model, dtype))["hybrid (ngram>=3 + eagle)"] for d in drafts}
    sets = prompt_sets(tok, a.prompts)
    if a.sets:
        sets = {name: sets[name] for name in a.sets.split(",")}
    temps = [float(t) for t in a.temperatures.split(",")]
    confs = [("plain", None)] + [(d, hybrids[d]) for d in drafts]
    bar = tqdm(total=len(temps) * sum(map(len, sets.values())) * len(confs), desc="drafts")
    lines = []
    for temp in temps:
        for kind, prompts in sets.items():
            tot = defaultdict(lambda: [0, 0.0, 0, 0, 0])  # tokens, seconds, rounds, proposed, accepted
            for i, p in enumerate(prompts):
                for name, make in confs if i % 2 == 0 else confs[:1] + confs[:0:-1]:  # plain first
                    out, dt, st = run_engine(model, tok, [p], make(1) if make else None, a.k if make else 0, 1,
                                             a.max_tokens, ngram_k=8, temperature=temp, seed=None)
                    if name == "plain":
                        ref = out
                    elif temp == 0 and out != ref:
                        raise AssertionError(f"{name}: output differs from plain decoding on {kind} prompt {i}")
                    t = tot[name]
                    for j, v in enumerate((len(out[0]), dt, st.rounds, st.proposed, st.accepted)):
                        t[j] += v
                    bar.update()
            plain = tot["plain"][0] / tot["plain"][1]
            for name, (n, s, r, prop, acc) in tot.items():
                lines.append(f"| {kind} ({len(prompts)}) | {temp:g} | {name} | {n / s:.1f} | {n / s / plain:.2f}x | "
                             f"{acc / prop if prop else 0:.3f} | {n / max(r, 1):.2f} |")
    bar.close()
    dname = str(dtype).removeprefix("torch.")
    print(f"\nbatch 1, {dname}, hybrid k = {a.k} (ngram_k 8), {a.max_tokens} tokens, alternated per prompt\n")
    print("| prompts | temperature | config | tokens/s | vs plain | acceptance | tokens per round |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
