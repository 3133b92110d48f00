"""Lookup in a corpus of the target's own answers: drafts with no model, from beyond the context.

Prompt lookup (Saxena 2023) finds drafts only where a sequence repeats itself. A small chat model
also repeats itself *across* answers ("Here are some tips to help you ...", "I hope this helps!"),
so a table built from its own answers to other questions predicts many of its next tokens before
a sequence has anything to repeat. This is retrieval-based speculative decoding (REST, He et al.
2023) in the n-gram form of llama.cpp's static lookup cache: for every context of 1 to `max_n`
tokens in the corpus, the most frequent next token, its count and the context's count. A draft
continues the longest context of the sequence's tail that the corpus holds, token by token,
while that context's next token is frequent enough (`min_count`, `min_ratio`); the longest
context decides and a weak one stops the draft (no backing off to a shorter, vaguer one).

The verifier keeps a draft token only where it equals the target's own token, so the corpus
changes how many tokens a forward yields, never which tokens (see `coupled_verify`). The corpus
is an `.npz` file: `tokens`, answers as int32 token ids separated by -1, and `vocab_size`.
Contexts are keyed by a 64-bit polynomial hash (order-salted); a collision can only cost a
rejected draft.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

SEP = -1  # separates answers in a corpus: no context or next token crosses it
_MULT = 1_000_003
_MASK = (1 << 64) - 1


def _context_keys(tokens: np.ndarray, max_n: int) -> tuple[np.ndarray, np.ndarray]:
    """Keys of every context of 1..max_n tokens in `tokens` (int64, SEP-separated) that a next
    token follows, and those next tokens."""
    L = len(tokens)
    h = np.zeros(L, dtype=np.uint64)  # h[i]: hash of the n tokens ending at position i
    valid = np.ones(L, dtype=bool)  # no SEP inside the context
    keys, nexts = [], []
    for n in range(1, min(max_n, L) + 1):  # (no context is longer than the tokens)
        back = np.zeros(L, dtype=np.uint64)  # back[i] = tokens[i-n+1]
        back[n - 1:] = (tokens[: L - n + 1] + 2).astype(np.uint64)
        h = h * np.uint64(_MULT) + back  # wraps mod 2**64, as `_query_keys` does
        valid[: n - 1] = False
        valid[n - 1:] &= tokens[: L - n + 1] != SEP
        ok = valid[:-1] & (tokens[1:] != SEP)
        keys.append(h[:-1][ok] ^ np.uint64(n))
        nexts.append(tokens[1:][ok])
    if not keys:  # no tokens at all
        return np.zeros(0, np.uint64), tokens[:0]
    return np.concatenate(keys), np.concatenate(nexts)


def _query_keys(context: list[int], max_n: int) -> list[int]:
    """Keys of the last 1..max_n tokens of `context` (as `_context_keys` makes them)."""
    h, out = 0, []
    for n in range(1, min(max_n, len(context)) + 1):
        h = (h * _MULT + context[-n] + 2) & _MASK
        out.append(h ^ n)
    return out


def corpus_vocab_size(path: str | os.PathLike) -> int:
    """The vocabulary size a corpus file was made for (without building its table)."""
    with np.load(Path(path)) as f:
        return int(f["vocab_size"])


def _table(keys: np.ndarray, nexts: np.ndarray):
    """Per distinct key (sorted): its most frequent next token, that token's count, the key's count."""
    if not len(keys):
        return keys, np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32)
    order = np.lexsort((nexts, keys))
    keys, nexts = keys[order], nexts[order]
    pair = np.flatnonzero(np.r_[True, (keys[1:] != keys[:-1]) | (nexts[1:] != nexts[:-1])])
    pair_count = np.diff(np.r_[pair, len(keys)])
    pk, pn = keys[pair], nexts[pair]
    by = np.lexsort((-pair_count, pk))  # per key, its most frequent next token first
    pk, pn, pc = pk[by], pn[by], pair_count[by]
    first = np.flatnonzero(np.r_[True, pk[1:] != pk[:-1]])
    return pk[first], pn[first].astype(np.int32), pc[first].astype(np.int32), np.add.reduceat(pc, first).astype(np.int32)


class NgramCorpus:
    def __init__(self, tokens, vocab_size: int, max_n: int = 6, min_count: int = 1, min_ratio: float = 0.4):
        self.vocab_size, self.max_n = int(vocab_size), max_n
        self.min_count, self.min_ratio = min_count, min_ratio
        t = np.asarray(tokens, dtype=np.int64)
        if len(t) and (t.max() >= vocab_size or t.min() < SEP):
            raise ValueError(f"corpus tokens must lie in [0, {vocab_size}) or be {SEP} (separator)")
        keys, nexts = _context_keys(t, max_n) if len(t) > 1 else (np.zeros(0, np.uint64), np.zeros(0, np.int64))
        self.keys, self.next, self.count, self.total = _table(keys, nexts)
        self.num_tokens = int((t != SEP).sum())

    @classmethod
    def load(cls, path: str | os.PathLike, **kw) -> "NgramCorpus":
        with np.load(Path(path)) as f:
            return cls(f["tokens"], int(f["vocab_size"]), **kw)

    @staticmethod
    def save(path: str | os.PathLike, answers: list[list[int]], vocab_size: int) -> None:
        flat = [t for a in answers for t in (*a, SEP)]
        np.savez_compressed(Path(path), tokens=np.asarray(flat, dtype=np.int32), vocab_size=vocab_size)

    def __len__(self) -> int:
        return len(self.keys)

    def next_token(self, context: list[int], min_ratio: float | None = None) -> int | None:
        """The corpus's next token after `context`'s longest known tail, if it is frequent enough
        (`min_ratio`: this call's threshold instead of the corpus's)."""
        q = np.array(_query_keys(context, self.max_n), dtype=np.uint64)
        if not len(q) or not len(self.keys):
            return None
        pos = np.minimum(np.searchsorted(self.keys, q), len(self.keys) - 1)
        hit = np.flatnonzero(self.keys[pos] == q)
        if not len(hit):
            return None
        p = pos[hit[-1]]  # the longest tail the corpus holds decides
        c = int(self.count[p])
        ratio = self.min_ratio if min_ratio is None else min_ratio
        return int(self.next[p]) if c >= self.min_count and c >= ratio * int(self.total[p]) else None

    def draft(self, context: list[int], k: int, min_ratio: float | None = None) -> list[int]:
        """Up to k tokens continuing `context`, each the corpus's next token after the ones before."""
        ctx, out = list(context[-self.max_n:]), []
        while len(out) < k:
            x = self.next_token(ctx, min_ratio)
            if x is None:
                break
            out.append(x)
            ctx = ctx[1 - self.max_n:] + [x] if self.max_n > 1 else [x]
        return out
