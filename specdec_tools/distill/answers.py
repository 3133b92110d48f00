"""The target's own greedy answers to training prompts: the sequence-level half of distillation.

DistillSpec (Zhou et al. 2023) finds a draft aligns best on text the *target* writes, since that is
what it predicts at serving time. Held-out evaluation runs the target on chat prompts and code
prefixes, so training gets the same two kinds from the training split: chat prompts through the
chat template, and raw code prefixes (a function's header and docstring) to continue.

Answers come from the engine's plain decoding with continuous batching and are appended to a jsonl
file ({"i", "kind", "prompt", "output"} per line), so generation is resumable and a later run (or
the EAGLE trainer's feature pass) reuses them. A record counts once its line ends: a last line an
interruption cut short is skipped by the readers (`iter_jsonl`) and cut off by the next writer
(`append_jsonl`), so its record is generated again.
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from specdec.engine import EngineConfig, LLMEngine
from specdec.sampling import SamplingParams
from specdec.target_worker import TargetWorker
from specdec_tools.distill.data import Corpus, chat_ids, chat_prompts, code_prompts


def training_prompts(corpus: Corpus, tokenizer, max_prompt: int = 256) -> list[tuple[str, list[int]]]:
    """Chat and code prompts of the training split, interleaved 1:1, each at most max_prompt tokens."""
    chat = [p for p in chat_ids(tokenizer, chat_prompts(corpus.train)) if len(p) <= max_prompt]
    code = [tokenizer(c, add_special_tokens=False).input_ids for c in code_prompts(corpus.train)]
    code = [p for p in code if 0 < len(p) <= max_prompt]
    out = []
    for i in range(max(len(chat), len(code))):
        out += [("chat", chat[i])] if i < len(chat) else []
        out += [("code", code[i])] if i < len(code) else []
    return out


def iter_jsonl(path: Path) -> Iterator[dict]:
    """The records of a jsonl cache file, read line by line (none if it does not exist yet). Only
    lines ending in a newline count: a partial last line, left by an interrupted write, is skipped."""
    path = Path(path)
    if not path.is_file():
        return
    with path.open() as f:
        for line in f:
            if line.endswith("\n") and line.strip():
                yield json.loads(line)


def read_jsonl(path: Path) -> list[dict]:
    """All records of a jsonl cache file (`iter_jsonl`)."""
    return list(iter_jsonl(path))


def _complete_size(f, block: int = 1 << 16) -> int:
    """Bytes of the binary file `f` up to and including its last newline (0 if it has none)."""
    pos = f.seek(0, 2)
    while pos > 0:
        n = min(block, pos)
        pos -= n
        f.seek(pos)
        i = f.read(n).rfind(b"\n")
        if i >= 0:
            return pos + i + 1
    return 0


def append_jsonl(path: Path) -> TextIO:
    """`path` opened to append records, after cutting it back to its last newline: a partial last
    line (an interrupted write, which `iter_jsonl` skipped) is dropped, not glued to the next record."""
    path = Path(path)
    if path.is_file():
        with path.open("rb+") as f:
            f.truncate(_complete_size(f))
    return path.open("a")


def _seconds_file(path: Path) -> Path:
    return Path(str(path) + ".seconds")


def spent_seconds(path: Path) -> float:
    """Generation seconds already spent on the cache `path` by earlier runs (0 while it does not exist):
    a time budget counts them, so it is total across resumes, as the training budget is."""
    path, f = Path(path), _seconds_file(path)
    return float(f.read_text()) if path.is_file() and f.is_file() else 0.0


def record_seconds(path: Path, seconds: float) -> None:
    """Store the generation seconds spent on the cache `path` (beside it, `<path>.seconds`)."""
    tmp = Path(str(_seconds_file(path)) + ".tmp")
    tmp.write_text(f"{seconds:.3f}\n")
    tmp.replace(_seconds_file(path))


def plain_engine(model, tokenizer, batch: int, max_len: int) -> LLMEngine:
    """The target alone (no proposer) under continuous batching: how the target's own outputs are generated."""
    return LLMEngine(TargetWorker(model, batch, max_len), None, tokenizer,
                     EngineConfig(max_batch_size=batch, max_model_len=max_len, speculate=False))


def generate_answers(model, tokenizer, prompts: list[tuple[str, list[int]]], path: Path, batch: int = 16,
                     max_new: int = 128, minutes: float | None = None, max_answers: int | None = None,
                     temperatures: list[float] | None = None, desc: str = "target answers", seed_offset: int = 0) -> int:
    """Append answers for prompts not yet in `path` (greedy, or at `temperatures[i]` with a seed
    derived from seed_offset + i, so a resumed run writes what an uninterrupted one would); stops at the time
    or count budget. The time budget `minutes` is total across runs: the seconds spent on `path` are
    recorded beside it (`spent_seconds`). Returns the number of answers in the file."""
    from tqdm import tqdm

    path = Path(path)
    done = {r["i"] for r in read_jsonl(path)}
    todo = [i for i in range(len(prompts)) if i not in done]
    if max_answers is not None:
        todo = todo[: max(0, max_answers - len(done))]
    engine = plain_engine(model, tokenizer, batch, max((len(prompts[i][1]) for i in todo), default=0) + max_new + 8)
    temps = temperatures or [0.0] * len(prompts)
    t0, n, spent = time.perf_counter(), len(done), spent_seconds(path)
    bar = tqdm(total=len(todo), desc=desc, unit="answer", dynamic_ncols=True)
    chunk = 4 * batch
    with append_jsonl(path) as f:
        for c in range(0, len(todo), chunk):
            if minutes is not None and spent + time.perf_counter() - t0 > 60 * minutes:
                break
            ids = todo[c: c + chunk]
            params = [SamplingParams(max_tokens=max_new, temperature=temps[i], seed=seed_offset + i) for i in ids]
            seqs = engine.generate([prompts[i][1] for i in ids], params)
            for i, s in zip(ids, seqs):
                f.write(json.dumps({"i": i, "kind": prompts[i][0], "prompt": prompts[i][1], "temperature": temps[i],
                                    "output": list(s.output_ids)}) + "\n")
            f.flush()
            record_seconds(path, spent + time.perf_counter() - t0)
            n += len(ids)
            bar.update(len(ids))
            bar.set_postfix(tok_s=f"{engine.stats.emitted / (time.perf_counter() - t0):.0f}")
    bar.close()
    return n
