"""The adaptive policy against plain decoding and fixed k, in process, alternated run by run.

    python bench/adaptive_ab.py [--dtype float32] [--batches 1,6] [--repeats 3] [--prompts 3]

Runs the hybrid (prompt lookup + the shipped EAGLE draft, as the default app) on `specdec-bench`'s
chat and code prompts together (one batch of all of them, or one at a time at batch 1), 64 tokens,
greedy, in five configurations whose order rotates with each repetition (this machine's speed
drifts within minutes): plain decoding; the adaptive policy as it was before this benchmark was
written ("previous": unmeasured verify lengths extrapolated linearly from the nearest measured
one, the throughput safeguard's tokens averaged over ~3 rounds (its plain mean of a bucket's
first rounds is not reproduced), four plain calibration rounds in
a row at every batch-size bucket, the safeguard judging after 4 rounds whatever their rows, rows
drafting only their own k); the current cost model alone
("cost model", rows still drafting their own k); the current policy ("current": rows also draft
along to the round's K); and fixed k = 3. Every output is checked against plain decoding.
"""
from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

from tqdm import tqdm

import specdec.scheduler as scheduler
from specdec.adaptive import CostModel
from specdec_tools.bench import add_target_args, draft_factories, load_demo_target, prompt_kinds, run_engine

RIDE_ALONG = scheduler.Scheduler._rides_along


class PreviousCostModel(CostModel):
    """The cost model before the changes this benchmark measures (see the module docstring)."""

    def __init__(self, **kw):
        super().__init__(**{"tokens_ema": 0.3, **kw})

    def verify_cost(self, k: int, batch: int = 1) -> float:
        b = self.bucket(batch)
        base = self.target.get((b, 0))
        known = {kk: t for (bb, kk), t in self.target.items() if bb == b and kk > 0}
        if k == 0:
            return 1.0
        if base and known:
            if k in known:
                return max(1.0, known[k] / base)
            kk = min(known, key=lambda x: abs(x - k))
            return max(1.0, 1.0 + (known[kk] / base - 1.0) * k / kk)
        return 1.0 + self.prior_slope * k

    def _throughput_rows(self, bucket: int, speculative: bool) -> int:
        """Rounds, whatever their rows, as the safeguard counted its evidence then."""
        return int(self.throughput.get((bucket, speculative), (0, 0, 0, 0))[2])

    def needs_plain_round(self, batch: int) -> bool:
        b = self.bucket(batch)
        if self._throughput_rows(b, False) < self.throughput_min_rows:
            return True  # calibration rounds in a row
        seen = self.plain_seen.get(b)
        return seen is None or self.rounds - seen >= self.recalibrate_every


CONFIGS = {  # name -> (adaptive, k, cost model class, rows draft along)
    "plain": (False, 0, CostModel, True),
    "previous": (True, 3, PreviousCostModel, False),
    "cost model": (True, 3, CostModel, False),
    "current": (True, 3, CostModel, True),
    "fixed k=3": (False, 3, CostModel, True),
}


def run(name: str, model, tok, prompts, make, batch: int, max_tokens: int):
    adaptive, k, cost_cls, ride = CONFIGS[name]
    scheduler.CostModel = cost_cls
    scheduler.Scheduler._rides_along = RIDE_ALONG if ride else (lambda self, seq: False)
    try:
        return run_engine(model, tok, prompts, make(batch) if k else None, k, batch, max_tokens, adaptive=adaptive)
    finally:
        scheduler.CostModel, scheduler.Scheduler._rides_along = CostModel, RIDE_ALONG


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,6", help="batch sizes (a batch larger than the prompts runs them all at once)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=3, help="chat and code prompts each")
    ap.add_argument("--max-tokens", type=int, default=64)
    add_target_args(ap)
    a = ap.parse_args()
    tok, model, dtype = load_demo_target(a)
    make = dict(draft_factories("smollm2-eagle", model, dtype))
    hybrid = next(m for n, m in make.items() if n.startswith("hybrid"))
    kinds = prompt_kinds(tok, a.prompts)
    prompts = kinds["chat"] + kinds["code"]
    run_engine(model, tok, prompts[:2], None, 0, 1, 16)  # warm the kernels: a cold first run is an outlier
    names = list(CONFIGS)
    batches = [int(b) for b in a.batches.split(",")]
    tps, bar = defaultdict(list), tqdm(total=len(batches) * a.repeats * len(names), desc="adaptive A/B")
    for batch in batches:
        ref = None
        for r in range(a.repeats):
            for name in names[r % len(names):] + names[:r % len(names)]:
                out, dt, _ = run(name, model, tok, prompts, hybrid, batch, a.max_tokens)
                ref = ref if ref is not None or name != "plain" else out
                if ref is not None and out != ref:
                    raise AssertionError(f"{name} at batch {batch}: output differs from plain decoding")
                tps[batch, name].append(sum(map(len, out)) / dt)
                bar.update()
    bar.close()
    print(f"\n{len(prompts)} prompts (chat + code), {a.max_tokens} tokens, greedy, {dtype}, mean of {a.repeats} runs, tokens/s")
    print("| batch | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for batch in batches:
        plain = statistics.mean(tps[batch, "plain"])
        print(f"| {batch} | " + " | ".join(f"{statistics.mean(tps[batch, n]):.1f} ({statistics.mean(tps[batch, n]) / plain:.2f}x)"
                                          for n in names) + " |")


if __name__ == "__main__":
    main()
