"""`HybridProposer`: prompt lookup where the context repeats itself, a draft model elsewhere.

Per row and round: if the n-gram proposer finds a match (of at least its `min_n` tokens; the
hybrid uses a longer minimum than plain prompt lookup so that only real repetitions count), its
tokens are proposed with a one-hot q, up to `SpecBatch.ngram_k` of them (a free proposal, so a
longer chain where the planner allows it); otherwise the model proposer drafts k. The choice depends on
the context only, never on random draws, and each row carries the q it was drawn from, so the
rejection sampler stays lossless. The model proposer sees every row every round (with zero drafts
for the n-gram rows), so its cache and feature buffers stay in sync.
"""
from __future__ import annotations

import time

import torch

from specdec.metadata import DraftOutput, SpecBatch
from specdec.proposers.base import Proposer
from specdec.rejection_sampler import DraftProbs


class HybridProposer(Proposer):
    def __init__(self, ngram: Proposer, model: Proposer):
        self.ngram, self.model = ngram, model
        self.needs_features, self.feature_layers = model.needs_features, model.feature_layers
        self.ngram_rows = self.model_rows = 0  # rows drafted by each side (for reports)

    @property
    def has_model(self) -> bool:
        return True

    @property
    def num_active(self) -> int:
        return self.model.num_active

    def release(self, seq_ids) -> None:
        self.ngram.release(seq_ids)
        self.model.release(seq_ids)

    def propose(self, batch: SpecBatch) -> DraftOutput:
        t0 = time.perf_counter()
        # the n-gram side may draft longer rows (ngram_k): its drafts cost no forward
        ng = self.ngram.propose(batch if batch.ngram_k is None else
                                batch.with_side(batch.offsets, batch.new_tokens, num_draft=batch.ngram_k))
        use_ngram = [n > 0 for n in ng.num_draft]
        mine = batch.with_side(batch.offsets, batch.new_tokens,
                               num_draft=[0 if u else k for u, k in zip(use_ngram, batch.num_draft)])
        md = self.model.propose(mine)
        B, K = len(batch), max(batch.max_draft, max(ng.num_draft, default=0))
        J = md.probs.ids.shape[-1] if md.probs is not None else 1
        tokens = torch.zeros(B, K, dtype=torch.long)
        q_ids = torch.zeros(B, K, J, dtype=torch.long)
        q_vals = torch.zeros(B, K, J)
        num = [0] * B
        sibling = None if md.sibling is None else torch.full((B,), -1, dtype=torch.long)
        for i in range(B):
            if use_ngram[i]:
                n = num[i] = ng.num_draft[i]
                tokens[i, :n] = ng.tokens[i, :n]
                q_ids[i, :n] = ng.tokens[i, :n, None]  # one-hot q
                q_vals[i, :n, 0] = 1.0
                self.ngram_rows += 1
            elif md.num_draft[i] > 0:
                n = num[i] = md.num_draft[i]
                tokens[i, :n] = md.tokens[i, :n]
                q_ids[i, :n], q_vals[i, :n] = md.probs.ids[i, :n], md.probs.vals[i, :n]
                if sibling is not None:
                    sibling[i] = md.sibling[i]
                self.model_rows += 1
        unknown = sorted(set(md.unknown) | set(ng.unknown))
        return DraftOutput(tokens, num, DraftProbs(q_ids, q_vals), unknown, time.perf_counter() - t0,
                           md.draft_steps, sibling=sibling)
