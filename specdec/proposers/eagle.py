"""`EagleProposer`: k draft steps in the target's feature space (specdec.eagle, Li et al. 2024).

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
has, which costs acceptance for a while but never correctness. A row with no feature yet (its
first round, before the target has seen it) gets no drafts.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from specdec.metadata import DraftOutput, SpecBatch
from specdec.proposers.base import register
from specdec.proposers.draft_model import DraftModelProposer
from specdec.rejection_sampler import DraftProbs
from specdec.runner import CacheFullError, run_ragged


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


@register("eagle")
class EagleProposer(DraftModelProposer):
    needs_features = True

    def __init__(self, model, num_slots: int, max_model_len: int, top_j: int = 32, **_):
        super().__init__(model, num_slots, max_model_len, model.token_map, top_j)
        self.buffers: dict[int, FeatureBuffer] = {}

    def release(self, seq_ids) -> None:
        super().release(seq_ids)
        for s in seq_ids:
            self.buffers.pop(s, None)

    def _sync(self, batch: SpecBatch, i: int):
        """Sync row i's tokens and features; returns (state, feed positions) or None."""
        sid = batch.seq_ids[i]
        fresh = batch.offsets[i] == 0
        st = self.table.sync(sid, batch.offsets[i], batch.new_tokens[i])
        if st is None or not st.tokens:
            return None
        buf = self.buffers.get(sid)
        if fresh or buf is None:
            buf = self.buffers[sid] = FeatureBuffer()
            st.cached = 0
        got = batch.features[i] if batch.features is not None else None
        if got is not None and not buf.add(got[0], got[1]):
            buf.base, st.cached = got[0], 0  # new context: cache index 0 is this position
        if buf.feats is None:
            return st, None
        last = len(st.tokens) - 2  # the feature at n-2 (with x_{n-1}) drafts x_n
        if buf.end - 1 < last:  # features lag the tokens: nothing to draft from this round
            return st, None
        first = max(buf.start, min(buf.base + st.cached, last))
        return st, (first, last)

    @torch.inference_mode()
    def propose(self, batch: SpecBatch) -> DraftOutput:
        t0 = time.perf_counter()
        self.release(batch.release)
        B, K = len(batch), batch.max_draft
        tokens = torch.zeros(B, K, dtype=torch.long)
        J = min(self.top_j, len(self.token_map))
        q_ids = torch.zeros(B, K, J, dtype=torch.long)
        q_vals = torch.zeros(B, K, J)
        num, unknown, rows = [0] * B, [], {}
        for i in range(B):
            try:
                got = self._sync(batch, i)
            except CacheFullError:
                got = None
            if got is None:
                unknown.append(i)
            elif got[1] is not None and batch.num_draft[i] > 0:
                rows[i] = got
        active, steps, g = list(rows), 0, {}
        for j in range(K):
            active = [i for i in active if batch.num_draft[i] > j]
            if not active:
                break
            sts = [rows[i][0] for i in active]
            bufs = [self.buffers[batch.seq_ids[i]] for i in active]
            if j == 0:  # enter the pending true features (ragged), draft from the last
                spans = [rows[i][1] for i in active]
                feeds = [st.tokens[a + 1: b + 2] for st, (a, b) in zip(sts, spans)]
                feats = [buf.feats[a - buf.start: b + 1 - buf.start] for buf, (a, b) in zip(bufs, spans)]
                starts = [a - buf.base for buf, (a, _) in zip(bufs, spans)]
            else:  # enter (g, d_j) at the next position (tentative)
                feeds = [[st.tokens[-1]] for st in sts]
                feats = [g[i] for i in active]
                starts = [len(st.tokens) - 2 - buf.base for st, buf in zip(sts, bufs)]
            logits, hidden = run_ragged(self.model, feeds, [st.slot for st in sts], starts, [1] * len(sts),
                                        return_hidden=True, features=feats)
            steps += 1
            if j == 0:
                for (i, st, buf) in zip(active, sts, bufs):
                    b = rows[i][1][1]
                    st.cached = b + 1 - buf.base  # true entries up to position b
                    buf.feats, buf.start = buf.feats[b - buf.start:], b  # keep the last for re-feeding
            ids, qi, qv = self._choose(torch.cat(logits), active, batch, j)
            for r, (i, st) in enumerate(zip(active, sts)):
                tokens[i, j], q_ids[i, j], q_vals[i, j] = ids[r], qi[r], qv[r]
                num[i] = j + 1
                g[i] = hidden[r][-1:]  # [1, hidden]
                if j + 1 < batch.num_draft[i]:
                    st.tokens.append(int(ids[r]))  # tentative: fed next step
        return DraftOutput(tokens, num, DraftProbs(q_ids, q_vals), unknown, time.perf_counter() - t0, steps)
