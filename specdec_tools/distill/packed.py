"""Target answers packed into one small file, so that distillation data outlives the machine.

Generating the target's answers is the expensive part of making a draft (~100-170 tokens/s on a
2-core CPU, so several million tokens are CPU-hours), and a work directory does not survive the
machine. A run can pack what it generated (`specdec-distill --pack-data FILE`) and later runs
train on every packed file beside their own answers (`--data FILE ...`): the data set grows from
run to run instead of being regenerated. One record per answer: its kind, temperature, prompt
tokens and output tokens (uint16 when the vocabulary allows, npz-compressed: 0.85 bytes a token for SmolLM2's answers).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

def pack(path: Path, records: list[dict], meta: str = "") -> Path:
    """Write `records` (dicts with "kind", "temperature", "prompt" and "output" token ids) to `path`
    (.npz); `meta` says how they were made."""
    lens = np.array([[len(r["prompt"]), len(r["output"])] for r in records], dtype=np.int64).reshape(-1, 2)
    flat = [t for r in records for t in (*r["prompt"], *r["output"])]
    dtype = np.uint16 if max(flat, default=0) < 2 ** 16 else np.int32
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, tokens=np.array(flat, dtype=dtype), lens=lens,
                        kind=np.array([r["kind"] for r in records], dtype=str),
                        temperature=np.array([r["temperature"] for r in records], dtype=np.float32),
                        meta=np.array(meta))
    return path


def unpack(path: Path) -> list[dict]:
    """The records of a packed file, in the order they were packed. A lookup corpus
    (specdec.corpus.NgramCorpus.save: the target's answers, each after its prompt's last tokens) reads
    as records of kind "corpus" with the whole segment as output and temperature -1 (unknown)."""
    with np.load(Path(path)) as z:
        if "lens" not in z.files:
            return _corpus_records(z["tokens"])
        tokens, lens, kinds, temps = z["tokens"].astype(np.int64), z["lens"], z["kind"], z["temperature"]
    out, at = [], 0
    for (p, o), kind, t in zip(lens.tolist(), kinds.tolist(), temps.tolist()):
        out.append({"kind": kind, "temperature": round(t, 4), "prompt": tokens[at: at + p].tolist(),
                    "output": tokens[at + p: at + p + o].tolist()})
        at += p + o
    return out


def _corpus_records(tokens: np.ndarray) -> list[dict]:
    from specdec.corpus import SEP
    ends = np.flatnonzero(tokens == SEP).tolist()
    starts = [0] + [e + 1 for e in ends[:-1]]
    return [{"kind": "corpus", "temperature": -1.0, "prompt": [], "output": tokens[a:b].astype(np.int64).tolist()}
            for a, b in zip(starts, ends) if b > a]
