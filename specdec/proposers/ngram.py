"""Prompt lookup decoding (Saxena 2023; vLLM's `NgramProposer`): no model, just the context.

Match the last n tokens of the sequence (n from `max_n` down to `min_n`) against earlier
positions of the same sequence, most recent match first, and propose the tokens that followed.
The draft is deterministic, so its q is one-hot and the rejection sampler accepts token x with
probability p(x). Rows without a match propose nothing this round.
"""
from __future__ import annotations

import time

import torch

from specdec.metadata import DraftOutput, SpecBatch
from specdec.proposers.base import Proposer


def ngram_lookup(tokens: list[int], k: int, min_n: int = 1, max_n: int = 3) -> list[int]:
    """Up to k tokens that followed the most recent earlier match of the longest suffix n-gram."""
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        pattern = tokens[L - n:]
        first = pattern[0]
        for i in range(L - n - 1, -1, -1):  # most recent match first
            if tokens[i] == first and tokens[i:i + n] == pattern:
                return tokens[i + n:i + n + k]
    return []


IDLE_EVICT_S = 300.0  # a sequence no proposal touched for this long is forgotten (its release was lost)


class NgramProposer(Proposer):
    def __init__(self, min_n: int = 1, max_n: int = 3, clock=time.monotonic, **_):
        self.min_n, self.max_n = min_n, max_n
        self.history: dict[int, list[int]] = {}
        # seq id -> when a proposal last touched it: a crashed router's sequences, or a lost
        # release's, are never released; forgetting an idle one only costs a resend of its context
        # (the row comes back unknown) should it return
        self.last_used: dict[int, float] = {}
        self.clock, self._swept = clock, clock()

    @property
    def num_active(self) -> int:
        return len(self.history)

    def release(self, seq_ids) -> None:
        for s in seq_ids:
            self.history.pop(s, None)
            self.last_used.pop(s, None)

    def _evict_idle(self, now: float) -> None:
        if now - self._swept >= IDLE_EVICT_S / 10:
            self._swept = now
            self.release([s for s, t in self.last_used.items() if now - t > IDLE_EVICT_S])

    def propose(self, batch: SpecBatch) -> DraftOutput:
        t0 = time.perf_counter()
        self.release(batch.release)
        now = self.clock()
        self._evict_idle(now)
        self.last_used.update((sid, now) for sid in batch.seq_ids)
        K = batch.max_draft
        out = torch.zeros(len(batch), K, dtype=torch.long)
        num, unknown = [], []
        for i, (sid, off, new, k) in enumerate(zip(batch.seq_ids, batch.offsets, batch.new_tokens,
                                                   batch.num_draft)):
            hist = self.history.get(sid)
            if off == 0:
                hist = self.history[sid] = list(new)
            elif hist is None or len(hist) < off:
                unknown.append(i)
                num.append(0)
                continue
            else:
                del hist[off:]
                hist.extend(new)
            draft = ngram_lookup(hist, k, self.min_n, self.max_n) if k > 0 else []
            out[i, : len(draft)] = torch.tensor(draft, dtype=torch.long)
            num.append(len(draft))
        return DraftOutput(out, num, None, unknown, time.perf_counter() - t0, 0)
