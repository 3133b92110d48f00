"""Sequence-level distillation data: the target's own greedy answers to training chat prompts.

DistillSpec (Zhou et al. 2023) finds that the draft aligns best when trained on text the *target*
writes, since that is what it must predict at serving time. Answers are generated with the
engine's plain decoding (`LLMEngine`, no proposer, batch 8), on demand as training asks for rows,
and appended to `seqgen.jsonl` in the output directory, so a resumed run reuses them. Generation
is ~15x dearer per token than prefill, so the pool only grows while generation has taken less
than `gen_share` of the training time; otherwise its rows are reused in order.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from specdec.prompts import encode_chat
from specdec.sampling import SamplingParams
from specdec_tools.distill.answers import append_jsonl, plain_engine, read_jsonl
from specdec_tools.distill.data import ChatPrompt

GEN_BATCH = 8


class SeqPool:
    def __init__(self, path: Path, prompts: list[ChatPrompt], model, tokenizer, max_new: int, seq_len: int,
                 gen_share: float = 0.3, state: dict | None = None):
        self.path, self.prompts, self.model, self.tok = Path(path), prompts, model, tokenizer
        self.max_new, self.seq_len, self.gen_share = max_new, seq_len, gen_share
        self.records: list[dict] = read_jsonl(self.path)  # {"i": prompt index, "prompt": ids, "output": ids}
        self.next_prompt = 1 + max((r["i"] for r in self.records), default=-1)
        st = state or {}
        # records the checkpoint counted can be missing (a write cut short, then dropped): go on from the last one
        self.cursor = min(st.get("cursor", 0), len(self.records))
        self.gen_seconds = st.get("gen_seconds", 0.0)
        self.gen_tokens = st.get("gen_tokens", 0)

    @property
    def state(self) -> dict:
        return {"cursor": self.cursor, "gen_seconds": self.gen_seconds, "gen_tokens": self.gen_tokens}

    def generate_batch(self) -> int:
        """Generate answers for the next GEN_BATCH prompts that fit; returns how many were added."""
        batch, ids = [], []
        limit = self.seq_len - min(self.max_new, self.seq_len // 2)
        while len(batch) < GEN_BATCH and self.next_prompt < len(self.prompts):
            p = encode_chat(self.tok, [{"role": "user", "content": self.prompts[self.next_prompt].text}])
            if len(p) <= limit:
                batch.append(self.next_prompt)
                ids.append(p)
            self.next_prompt += 1
        if not batch:
            return 0
        t0 = time.perf_counter()
        engine = plain_engine(self.model, self.tok, GEN_BATCH, self.seq_len + self.max_new)
        seqs = engine.generate(ids, SamplingParams(max_tokens=self.max_new, temperature=0.0))
        self.gen_seconds += time.perf_counter() - t0
        with append_jsonl(self.path) as f:
            for i, p, s in zip(batch, ids, seqs):
                rec = {"i": i, "prompt": p, "output": list(s.output_ids)}
                self.records.append(rec)
                self.gen_tokens += len(rec["output"])
                f.write(json.dumps(rec) + "\n")
        return len(batch)

    def take(self, train_seconds: float) -> tuple[list[int], int]:
        """The next row (prompt + answer, cut to seq_len) and the index where the answer starts."""
        if self.cursor >= len(self.records):
            may_generate = not self.records or self.gen_seconds <= self.gen_share * train_seconds
            if not (may_generate and self.generate_batch()):
                self.cursor = 0
        if not self.records:
            raise RuntimeError("no chat prompt fits in --seq-len for sequence-level data; lower --mix to 0")
        rec = self.records[self.cursor]
        self.cursor += 1
        return (rec["prompt"] + rec["output"])[: self.seq_len], len(rec["prompt"])
