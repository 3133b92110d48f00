"""Does a CPU matmul give a row the same result however many rows share the call?

    python bench/linear_rows.py [--dtype bfloat16] [--threads 1,2] [--max-rows 64]

Position-invariant speculation (specdec/model.py) needs a row's logits to be bit-identical whether
the row is computed in a plain step (a few rows per linear call) or in a verification (batch x
(k + 1) rows). For each linear shape of the demo target and its draft, oneDNN's prepacked matmul
(`PackedWeight`'s kernel) runs 96 random rows in calls of m rows, m = 1 .. --max-rows, and the
table lists the call sizes whose rows differ from rows computed one call each, as the raw kernel
does and through `PackedWeight.linear` on a batch of one-position rows (which it splits into calls of
at most `LINEAR_ROWS` rows).
"""
from __future__ import annotations

import argparse

import torch

from specdec.model import LINEAR_ROWS, PackedWeight

SHAPES = {"q/k/v": (960, 576), "o": (576, 576), "gate/up": (3072, 576), "down": (576, 1536),
          "head": (49152, 576), "draft head": (8192, 576), "draft fc": (576, 1152), "draft fuse": (576, 1728)}


def differing(linear, x: torch.Tensor, max_rows: int) -> list[int]:
    """Call sizes m whose rows differ from the rows computed alone."""
    ref = torch.cat([linear(x[i: i + 1]) for i in range(len(x))])
    return [m for m in range(2, max_rows + 1)
            if not torch.equal(torch.cat([linear(x[i: i + m]) for i in range(0, len(x), m)]), ref)]


def spans(ms: list[int]) -> str:
    if not ms:
        return "none"
    out, start = [], ms[0]
    for a, b in zip(ms, ms[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}-{a}" if a > start else f"{a}")
            start = b
    return ", ".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--max-rows", type=int, default=64)
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    print(f"{a.dtype}, LINEAR_ROWS = {LINEAR_ROWS}")
    print("| threads | layer | shape | raw kernel: call sizes that differ | PackedWeight.linear |")
    print("|---|---|---|---|---|")
    torch.manual_seed(0)
    with torch.inference_mode():
        for threads in (int(t) for t in a.threads.split(",")):
            torch.set_num_threads(threads)
            for name, (n, k) in SHAPES.items():
                w = (torch.randn(n, k) * 0.05).to(dtype)
                x = torch.randn(96, k).to(dtype)
                packed = torch.ops.mkldnn._reorder_linear_weight(w, 2)
                raw = differing(lambda r: torch.ops.mkldnn._linear_pointwise(r, packed, None, "none", [], ""), x,
                                a.max_rows)
                pw = PackedWeight()
                ours = differing(lambda r: pw.linear(r[:, None], w, None)[:, 0], x, a.max_rows)  # a batch of rows
                print(f"| {threads} | {name} | {n}x{k} | {spans(raw)} | {spans(ours)} |")


if __name__ == "__main__":
    main()
