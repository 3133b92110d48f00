"""What a verify costs by positions per row: the target's forward over T new positions per row,
against one position (a plain step), per dtype and batch size.

    python bench/verify_cost.py [--dtypes float32,bfloat16] [--batches 1,3,8] [--positions 1,2,3,4,5,8]

The cost model (specdec/adaptive.py) measures these per k at run time instead of assuming them:
they are not linear (GEMM kernels change with the row count), e.g. float32 on a 2-core EPYC
verified 4 positions for no more than 2. Each row holds 200 tokens of context; median of 15 forwards
after 3 warm-up ones.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from tqdm import tqdm

from specdec.loader import load_model, parse_dtype

CONTEXT = 200


def forward_ms(model, batch: int, positions: int, repeats: int = 15) -> float:
    slots, starts = torch.arange(batch), torch.full((batch,), CONTEXT)
    x = torch.randint(0, 1000, (batch, positions))
    times = []
    with torch.inference_mode():
        for i in range(3 + repeats):
            t0 = time.perf_counter()
            model(x, slots, starts)
            if i >= 3:
                times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batches", default="1,3,8")
    ap.add_argument("--positions", default="1,2,3,4,5,8")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dtypes, batches = a.dtypes.split(","), [int(b) for b in a.batches.split(",")]
    positions = [int(p) for p in a.positions.split(",")]
    rows = []
    bar = tqdm(total=len(dtypes) * len(batches) * len(positions), desc="verify cost")
    for dt in dtypes:
        model = load_model("smollm2", dtype=parse_dtype(dt))
        for b in batches:
            model.setup_cache(b, CONTEXT + 64)
            with torch.inference_mode():  # the rows' context
                model(torch.randint(0, 1000, (b, CONTEXT)), torch.arange(b), torch.zeros(b, dtype=torch.long))
            ms = []
            for p in positions:
                ms.append(forward_ms(model, b, p))
                bar.update()
            rows.append((dt, b, ms))
    bar.close()
    print(f"\nmodel forward, ms, median of 15 ({a.threads} threads); in brackets: relative to 1 position")
    print("| dtype | batch | " + " | ".join(f"{p}" for p in positions) + " positions |")
    print("|---|---" + "|---" * len(positions) + "|")
    for dt, b, ms in rows:
        print(f"| {dt} | {b} | " + " | ".join(f"{m:.1f} ({m / ms[0]:.2f})" for m in ms) + " |")


if __name__ == "__main__":
    main()
