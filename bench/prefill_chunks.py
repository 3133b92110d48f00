"""Prefill time by prompt length: one call for the whole prompt against chunks of N positions
(chunked prefill, specdec.runner.PREFILL_CHUNK), the demo target through `run_ragged`, with the
model's position-invariant attention in every chunk and (last column, chunks of the default size)
with SDPA in the prompt's chunks before its last, as a target replica runs a prompt.

    python bench/prefill_chunks.py [--dtype bfloat16] [--lengths 200,512,1024,2048] [--chunks 64,128,192,256]

A chunk attends to the cache and to itself, so chunks skip the masked half of a whole prompt's
T x T scores, and no call holds a T x T score matrix. Prints one markdown table: seconds per
prefill (best of `--repeats`) and the speedup over one call.
"""
from __future__ import annotations

import argparse
import time

import torch
from tqdm import tqdm

from specdec import runner
from specdec.loader import load_model, parse_dtype


def prefill_s(model, ids: list[int], chunk: int, repeats: int, prompt_sdpa: bool = False) -> float:
    best = float("inf")
    for _ in range(repeats):
        runner.PREFILL_CHUNK = chunk
        t0 = time.perf_counter()
        with torch.inference_mode():
            runner.run_ragged(model, [ids], [0], [0], [1], prompt_lens=[len(ids)] if prompt_sdpa else None)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--lengths", default="200,512,1024,2048")
    ap.add_argument("--chunks", default="64,128,192,256")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    lengths, chunks = [int(x) for x in a.lengths.split(",")], [int(x) for x in a.chunks.split(",")]
    model = load_model("smollm2", dtype=parse_dtype(a.dtype))
    model.setup_cache(1, max(lengths) + 64)
    gen = torch.Generator().manual_seed(0)
    rows = []
    bar = tqdm(total=len(lengths) * (len(chunks) + 2), desc="prefill")
    default = runner.PREFILL_CHUNK
    for n in lengths:
        ids = torch.randint(100, 40000, (n,), generator=gen).tolist()
        row = [n]
        for c in [10**9, *chunks]:  # 10**9: the whole prompt in one call
            row.append(prefill_s(model, ids, c, a.repeats))
            bar.update()
        row.append(prefill_s(model, ids, default, a.repeats, prompt_sdpa=True))
        bar.update()
        rows.append(row)
    bar.close()
    print(f"\n### Prefill seconds, {a.dtype}, {a.threads} threads (best of {a.repeats})\n")
    print("| prompt tokens | whole | " + " | ".join(f"chunks of {c}" for c in chunks)
          + f" | chunks of {default}, SDPA before the last |")
    print("|---|---|" + "---|" * (len(chunks) + 1))
    for n, whole, *rest in rows:
        print(f"| {n} | {whole:.2f} | " + " | ".join(f"{t:.2f} ({whole / t:.1f}x)" for t in rest) + " |")


if __name__ == "__main__":
    main()
