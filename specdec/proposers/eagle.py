"""`EagleProposer`: k draft steps in the target's feature space (specdec.eagle_draft, Li et al. 2024).

Per sequence the proposer holds the confirmed tokens (as every proposer does), a slot of the
draft layer's KV cache and a buffer of target features it has not entered yet. The cache entry
at position p is built from (f_p, x_{p+1}); it is *true* when f_p came from the target, and only
true entries are kept across rounds (`cached` counts them), so rollback after verification is
again just a length. A round:

    step 0: enter every pending true feature (ragged: a prompt's worth on the first round, then
            the features of the last round's accepted tokens) -> g at the last position -> d_1
    step j: enter (g, d_j) at the next position -> g' -> d_{j+1}        (tentative entries)

The target sends features as (first position, [n, hidden]) through `SpecBatch.features`; a gap
(a restarted replica, a trimmed buffer) restarts the draft's context at the first position it
has, which costs acceptance but never correctness; features from before that position (the
target's re-prefill, which the scheduler asks for when the draft lost a sequence) restart it
there, so the draft sees the whole context again. A row with no feature yet (its
first round, before the target has seen it) gets no drafts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specdec.metadata import SpecBatch
from specdec.proposers.base import TOP_J
from specdec.proposers.draft_model import DraftModelProposer
from specdec.runner import run_ragged


@dataclass
class FeatureBuffer:
    """Target features of positions [start, start + len(feats)) not yet entered (plus the last
    entered one, so the final position can always be re-fed); `base` is the position of the
    sequence's cache index 0."""

    base: int = -1
    start: int = 0
    feats: Tensor | None = None  # [n, hidden]

    @property
    def end(self) -> int:
        return self.start + (0 if self.feats is None else len(self.feats))

    def add(self, start: int, feats: Tensor) -> bool:
        """Append features starting at `start`; returns False when they leave a gap (restart)."""
        if self.feats is None or start > self.end:
            self.start, self.feats = start, feats
            return False
        if start + len(feats) > self.end:
            self.feats = torch.cat([self.feats, feats[self.end - start:].to(self.feats.dtype)])
        return True


class EagleProposer(DraftModelProposer):
    needs_features = True

    def __init__(self, model, num_slots: int, max_model_len: int, top_j: int = TOP_J, **_):
        super().__init__(model, num_slots, max_model_len, model.token_map, top_j)
        self.feature_layers = model.feature_layers
        self.buffers: dict[int, FeatureBuffer] = {}
        self._spans: dict[int, tuple[int, int]] = {}  # this round: row -> true positions step 0 enters
        self._g: dict[int, Tensor] = {}  # this round: row -> its last predicted feature

    def release(self, seq_ids) -> None:
        super().release(seq_ids)
        for s in seq_ids:
            self.buffers.pop(s, None)

    def _sync(self, batch: SpecBatch, i: int):
        """Sync row i's tokens and features; plans the true features step 0 enters (`_spans`)."""
        sid = batch.seq_ids[i]
        fresh = batch.offsets[i] == 0
        st = self.table.sync(sid, batch.offsets[i], batch.new_tokens[i])
        if st is None or not st.tokens:
            return None
        buf = self.buffers.get(sid)
        got = batch.features[i] if batch.features is not None else None
        if fresh or buf is None or (got is not None and got[0] < buf.base):  # (earlier context: start over with it)
            buf = self.buffers[sid] = FeatureBuffer()
            st.cached = 0
        if got is not None and not buf.add(got[0], got[1]):
            buf.base, st.cached = got[0], 0  # new context: cache index 0 is this position
        last = len(st.tokens) - 2  # the feature at n-2 (with x_{n-1}) drafts x_n
        if buf.feats is not None and buf.end - 1 >= last:  # else features lag: no drafts this round
            self._spans[i] = (max(buf.start, min(buf.base + st.cached, last)), last)
        return st

    def _new_round(self) -> None:
        self._spans, self._g = {}, {}

    def _can_draft(self, i: int) -> bool:
        return i in self._spans

    def _step(self, j: int, active: list[int], sts: list, batch: SpecBatch) -> list[Tensor]:
        bufs = [self.buffers[batch.seq_ids[i]] for i in active]
        if j == 0:  # enter the pending true features (ragged), draft from the last
            spans = [self._spans[i] for i in active]
            feeds = [st.tokens[a + 1: b + 2] for st, (a, b) in zip(sts, spans)]
            feats = [buf.feats[a - buf.start: b + 1 - buf.start] for buf, (a, b) in zip(bufs, spans)]
            starts = [a - buf.base for buf, (a, _) in zip(bufs, spans)]
        else:  # enter (g, d_j) at the next position (tentative)
            feeds = [[st.tokens[-1]] for st in sts]
            feats = [self._g[i] for i in active]
            starts = [len(st.tokens) - 2 - buf.base for st, buf in zip(sts, bufs)]
        logits, hidden = run_ragged(self.model, feeds, [st.slot for st in sts], starts, [1] * len(sts),
                                    return_hidden=True, features=feats)
        for r, (i, st, buf) in enumerate(zip(active, sts, bufs)):
            self._g[i] = hidden[r][-1:]  # [1, hidden]: the predicted feature, fed back next step
            if j == 0:
                b = self._spans[i][1]
                st.cached = b + 1 - buf.base  # true entries up to position b
                buf.feats, buf.start = buf.feats[b - buf.start:], b  # keep the last for re-feeding
        return logits
