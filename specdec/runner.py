"""Slot bookkeeping and ragged forward passes shared by the target and draft models.

A `SlotTable` maps sequence ids to KV-cache slots (lowest free slot first, so a steady batch
occupies a contiguous range that attention reads by slicing) and remembers how many positions of
each slot hold valid keys/values. `run_ragged` runs rows with different numbers of new tokens:
short rows (decode/verify) share one padded forward, long rows (prefills) run on their own so a
long prompt never pads the whole batch, in chunks of `PREFILL_CHUNK` positions (chunked prefill,
as vLLM's): a chunk attends to the cache and to itself, so a prompt of T tokens computes the
T^2 / 2 causal scores instead of all T^2 of one call, and no call holds a T x T score matrix.

A chunk that ends before its prompt's last token (`prompt_lens`) takes SDPA's attention even in a
position-invariant model (`Transformer.position_invariant`): invariance matters where one position
is computed by calls of different shapes (a plain step and a verification), and such a chunk is
computed alike in every mode (its cuts depend on positions only, and the prompt's last token, whose
logits give the first output token, drafts and siblings come in a later chunk, which keeps the
model's own attention). The demo target, bf16, 2 cores, chunks of 128 (bench/prefill_chunks.py):
1,024 tokens 1.16 -> 0.87 s, 4,096 tokens 16.3 -> 5.3 s (53.9 s in one call).
"""
from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from specdec import envs

SHORT_ROW = 16  # rows with at most this many new tokens are batched together
# Positions per forward of a long row. The demo target (bf16 and float32, 2 cores), a prompt whole /
# in chunks of 64, 128, 192, 256: 1,024 tokens 3.0 / 1.4 / 1.1 / 1.3 / 1.5 s; 2,048 tokens 11.3 / 3.5 /
# 3.4 / 4.1 / 4.8 s (bf16); 200 tokens 0.22 s whole, 0.18 s in chunks of 128 (bench/prefill_chunks.py).
PREFILL_CHUNK = envs.PREFILL_CHUNK
EVICT_IDLE_S = 30.0  # a full table may take back a slot that no round has touched for this long
WAITER_FORGET_S = 2.0  # a refused sequence keeps its place in line while its router resends it this often


class CacheFullError(RuntimeError):
    """No free KV slot, or a sequence outgrew its slot's positions."""


@dataclass
class SlotState:
    slot: int
    tokens: list[int] = field(default_factory=list)  # confirmed tokens, then a proposer's tentative drafts
    confirmed: int = 0  # tokens[:confirmed] came from a sync (the rest are this replica's own drafts)
    cached: int = 0  # positions [0, cached) of the slot hold valid keys/values
    used: float = field(default_factory=time.monotonic)  # when a round last synced it


class SlotTable:
    """Slots by sequence id. A full table takes back the least recently used slot once it has
    been idle `evict_idle_s` (its router stopped sending the sequence: it crashed, or a release
    was lost), calling `on_evict(seq_id)`; should that sequence come back it is unknown here and
    its router re-prefills it, so taking a slot back is always safe.

    Slots go first come, first served: a sequence refused for want of a slot waits in line
    (`waiting`), and a freed slot goes to the oldest waiter, not to whichever call comes next.
    Several routers share a replica, and a round frees its finished rows and starts its new ones
    in the same call: the router that held the slots took back every slot it freed, and another
    router's rows waited until its queue ran dry. A waiter its router stopped resending for
    `WAITER_FORGET_S` (it moved its lane, or its client left) gives up its place."""

    def __init__(self, num_slots: int, max_len: int, evict_idle_s: float = EVICT_IDLE_S,
                 on_evict: Callable[[int], None] | None = None):
        self.max_len = max_len
        self.free = list(range(num_slots))
        heapq.heapify(self.free)
        self.seqs: dict[int, SlotState] = {}
        self.evict_idle_s, self.on_evict = evict_idle_s, on_evict
        self.evicted = 0
        self.waiting: dict[int, float] = {}  # refused sequence id -> when last refused (in order of first refusal)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self.seqs

    def __getitem__(self, seq_id: int) -> SlotState:
        return self.seqs[seq_id]

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, seq_id: int) -> SlotState:
        if seq_id in self.seqs:
            self.release(seq_id)
        if not self.free and self.seqs:
            self._evict_idle()
        if len(self.free) <= self._waiters_ahead(seq_id):  # (the free slots are theirs)
            self.waiting[seq_id] = time.monotonic()  # (a known waiter keeps its place)
            raise CacheFullError("no free KV-cache slot")
        self.waiting.pop(seq_id, None)
        st = SlotState(heapq.heappop(self.free))
        self.seqs[seq_id] = st
        return st

    def _waiters_ahead(self, seq_id: int) -> int:
        """Sequences refused before `seq_id` that still wait (all of them for a newcomer)."""
        now = time.monotonic()
        self.waiting = {s: t for s, t in self.waiting.items() if now - t < WAITER_FORGET_S}
        ahead = 0
        for s in self.waiting:
            if s == seq_id:
                break
            ahead += 1
        return ahead

    def hold(self, seq_id: int) -> None:
        """Keep a place in line for a sequence its router resends whole next round (one that moved
        its lane here): the free slots it will take are not a newcomer's (`room`)."""
        if seq_id not in self.seqs:
            self.waiting.setdefault(seq_id, time.monotonic())

    def room(self) -> int:
        """Slots a newcomer could take now: the free ones less those that waiters still in line
        will get (read-only: another thread may be allocating)."""
        now = time.monotonic()
        waiting = sum(1 for t in list(self.waiting.values()) if now - t < WAITER_FORGET_S)
        return max(0, len(self.free) - waiting)

    def release(self, seq_id: int) -> None:
        self.waiting.pop(seq_id, None)  # (finished, or its client left, while it waited)
        st = self.seqs.pop(seq_id, None)
        if st is not None:
            heapq.heappush(self.free, st.slot)

    def active(self) -> int:
        """Sequences a round touched within evict_idle_s (the others may be abandoned: load that
        is not there)."""
        now = time.monotonic()
        return sum(1 for st in list(self.seqs.values()) if now - st.used < self.evict_idle_s)

    def _evict_idle(self) -> None:
        seq_id, st = min(self.seqs.items(), key=lambda item: item[1].used)
        if time.monotonic() - st.used >= self.evict_idle_s:
            self.release(seq_id)
            self.evicted += 1
            if self.on_evict is not None:
                self.on_evict(seq_id)

    def sync(self, seq_id: int, offset: int, new_tokens: list[int]) -> SlotState | None:
        """Apply the confirmed tokens a round brings; offset 0 starts the sequence afresh.

        Tokens the table held past `offset` (a proposer's tentative drafts) are replaced; cached
        positions stay valid as far as the old and new tokens agree. Returns None when the
        sequence cannot be continued at `offset` (unknown, or a gap): report it unknown. An offset
        past the confirmed tokens is a gap too: a router that moved its lane away and back (before
        this replica applied the release it sent) counts tokens another replica confirmed, and
        this one's tentative drafts must not pass for them.
        """
        if offset == 0:
            st = self.allocate(seq_id)
            st.tokens = list(new_tokens)
            st.confirmed = len(st.tokens)
            return st
        st = self.seqs.get(seq_id)
        if st is None or st.confirmed < offset:
            return None
        st.used = time.monotonic()
        tail = st.tokens[offset:]
        common = 0
        for a, b in zip(tail, new_tokens):
            if a != b:
                break
            common += 1
        del st.tokens[offset:]
        st.tokens.extend(new_tokens)
        st.confirmed = len(st.tokens)
        st.cached = min(st.cached, offset + common)
        return st


def run_ragged(model, feeds: list[list[int]], slots: list[int], starts: list[int],
               n_logits: list[int], return_hidden: bool = False, n_hidden: list[int] | None = None,
               features: list[Tensor] | None = None, siblings: list[int] | None = None,
               prompt_lens: list[int] | None = None):
    """Forward rows of different lengths; returns per-row logits [n_logits[i], V] (and hidden).

    feeds[i]: new tokens of row i, written at positions starts[i]... of slot slots[i].
    n_hidden[i]: features returned for row i's last n_hidden[i] positions (default n_logits[i]).
    features[i]: [len(feeds[i]), hidden] input features per token (EAGLE drafts), or None.
    siblings[i]: k > 0 when the last token of feeds[i] is a sibling of the first of the k drafts
    before it (a draft tree: same position, does not see the chain), else 0.
    prompt_lens[i]: row i's positions below this are its prompt (chunks ending before its last
    token take SDPA, above).
    """
    n_hidden = n_hidden or n_logits
    out_logits: list[Tensor | None] = [None] * len(feeds)
    out_hidden: list[Tensor | None] = [None] * len(feeds)
    short = [i for i, f in enumerate(feeds) if len(f) <= SHORT_ROW]
    if short:
        _run_rows(model, short, feeds, slots, starts, n_logits, return_hidden, n_hidden, features, siblings,
                  out_logits, out_hidden)
    for i in (i for i, f in enumerate(feeds) if len(f) > SHORT_ROW):
        _run_long(model, i, feeds, slots, starts, n_logits, return_hidden, n_hidden, features, siblings,
                  out_logits, out_hidden, prompt_lens[i] if prompt_lens else 0)
    return (out_logits, out_hidden) if return_hidden else out_logits


def chunk_bounds(start: int, length: int, tail: int, size: int | None = None) -> list[tuple[int, int]]:
    """Positions [a, b) of each forward of a row feeding `length` tokens from `start`: cut at the
    multiples of `size`, none inside the last `tail` positions (the logits the round reads, a draft
    chain and its sibling, stay in one call). The cuts depend on the positions only: a prompt is
    cut alike whether drafts follow it or not, so its keys and values are the same."""
    size = size or PREFILL_CHUNK
    end = start + length
    cuts = range((start // size + 1) * size, end - tail + 1, size)
    bounds = [start, *cuts, end]
    return list(zip(bounds, bounds[1:]))


def _run_long(model, i: int, feeds, slots, starts, n_logits, return_hidden, n_hidden, features, siblings,
              out_logits, out_hidden, prompt_len: int = 0) -> None:
    """One long row, chunk by chunk (`chunk_bounds`): the last chunk's call gives its logits, each
    call the features of its positions among the row's last n_hidden; chunks that end before the
    prompt's last token attend with SDPA (module docstring)."""
    start, feed = starts[i], feeds[i]
    end = start + len(feed)
    nh = max(n_hidden[i], n_logits[i]) if return_hidden else 0
    pieces = []
    for a, b in chunk_bounds(start, len(feed), max(n_logits[i], 1)):
        final = b == end
        one = [feed[a - start: b - start]]
        kept = max(0, b - max(a, end - nh))  # of this chunk's positions, features the caller wants
        logit, hidden = [None], [None]
        _run_rows(model, [0], one, [slots[i]], [a], [n_logits[i] if final else 1], return_hidden,
                  [max(kept, 1)], None if features is None else [features[i][a - start: b - start]],
                  None if siblings is None else [siblings[i] if final else 0], logit, hidden,
                  fast=b < prompt_len)
        if return_hidden and kept:
            pieces.append(hidden[0][-kept:])
        if final:
            out_logits[i] = logit[0]
    if return_hidden:
        out_hidden[i] = torch.cat(pieces)


def _run_rows(model, rows: list[int], feeds, slots, starts, n_logits, return_hidden, n_hidden, features, siblings,
              out_logits, out_hidden, fast: bool = False) -> None:
    """One padded forward of `rows` (indices into the lists), filling out_logits / out_hidden;
    `fast`: SDPA attention (a prompt's chunk, `_run_long`)."""
    device = model.device
    T = max(len(feeds[i]) for i in rows)
    n = max(n_logits[i] for i in rows)
    nh = max(max(n_hidden[i], n_logits[i]) for i in rows) if return_hidden else 0
    tokens = torch.zeros(len(rows), T, dtype=torch.long)
    for r, i in enumerate(rows):
        tokens[r, : len(feeds[i])] = torch.tensor(feeds[i])
    kw = {"exact": False} if fast else {}
    if features is not None:
        feats = torch.zeros(len(rows), T, features[rows[0]].shape[-1], dtype=model.dtype)
        for r, i in enumerate(rows):
            feats[r, : len(feeds[i])] = features[i]
        kw["features"] = feats.to(device)
    last = torch.tensor([len(feeds[i]) - 1 for i in rows])
    if siblings is not None and any(siblings[i] for i in rows):
        kw["sibling"] = torch.tensor([[len(feeds[i]) - 1 if siblings[i] else -1, siblings[i]] for i in rows],
                                     device=device)
    logits, hidden = model(tokens.to(device), torch.tensor([slots[i] for i in rows], device=device),
                           torch.tensor([starts[i] for i in rows], device=device), last.to(device), n,
                           nh, **kw)
    H = hidden.shape[1]
    for r, i in enumerate(rows):  # the row's logits are the last n_logits[i] of the n computed
        out_logits[i] = logits[r, n - n_logits[i]:]
        if return_hidden:
            out_hidden[i] = hidden[r, H - max(n_hidden[i], n_logits[i]):]
