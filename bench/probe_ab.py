"""Aligned vs per-row probes of adaptive k at batch 8, in process, alternated run by run.

    python bench/probe_ab.py [--repeats 3] [--prompts 8] [--max-tokens 64]

Adaptive rows whose speculation is off probe every `probe_interval` rounds. The scheduler now
aligns the probes of a batch's rows (`Scheduler._choose_ks`); "per-row" reproduces the earlier
policy (every row probes on its own clock) by letting every row probe whenever it is due. Both run
the hybrid and EAGLE alone at batch 8 on `specdec-bench`'s chat and code prompts, beside plain
decoding, the three alternating run by run; every output is checked against plain decoding.
"""
from __future__ import annotations

import argparse
from collections import defaultdict

from tqdm import tqdm

from specdec.scheduler import Scheduler
from specdec_tools.bench import add_target_args, draft_factories, load_demo_target, prompt_kinds, run_engine

ALIGNED = Scheduler._choose_ks


def per_row(self, seqs, calibrate, throttle):
    """The earlier policy: each row probes when its own clock says so."""
    return [self.choose_k(s, len(seqs), calibrate, throttle) for s in seqs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    add_target_args(ap)
    a = ap.parse_args()
    tok, model, dtype = load_demo_target(a)
    makers = dict(draft_factories("smollm2-eagle", model, dtype))
    kinds = prompt_kinds(tok, a.prompts)
    confs = [(f"{name} adaptive, {policy}", make, fn) for name, make in makers.items()
             for policy, fn in (("aligned", ALIGNED), ("per-row", per_row))]
    bar = tqdm(total=a.repeats * len(kinds) * (len(confs) + 1), desc="probes")
    lines = []
    for kind, prompts in kinds.items():
        tot, ref = defaultdict(lambda: [0, 0.0]), None
        for r in range(a.repeats):
            order = [("plain", None, ALIGNED)] + (confs if r % 2 == 0 else confs[::-1])
            for name, make, fn in order:
                Scheduler._choose_ks = fn
                out, dt, _ = run_engine(model, tok, prompts, make(len(prompts)) if make else None,
                                        3 if make else 0, len(prompts), a.max_tokens, adaptive=make is not None)
                ref = ref or out  # plain runs first
                if out != ref:
                    raise AssertionError(f"{name}: output differs from plain decoding ({kind})")
                tot[name][0] += sum(map(len, out))
                tot[name][1] += dt
                bar.update()
        Scheduler._choose_ks = ALIGNED
        plain = tot["plain"][0] / tot["plain"][1]
        for name, (n, s) in tot.items():
            lines.append(f"| {kind} ({len(prompts)}) | {name} | {n / s:.1f} | {n / s / plain:.2f}x |")
    bar.close()
    print(f"\nbatch {a.prompts}, {str(dtype).removeprefix('torch.')}, k_max 3, {a.max_tokens} tokens, "
          f"{a.repeats} runs per configuration, alternated\n")
    print("| prompts | config | tokens/s | vs plain |\n|---|---|---|---|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
