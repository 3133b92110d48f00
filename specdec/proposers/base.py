"""The proposer interface: `propose(batch) -> DraftOutput` for a whole batch.

A proposer keeps per-sequence state (a draft KV cache, or just the token history) that it syncs
from the confirmed tokens each round brings (`SpecBatch.offsets`/`new_tokens`). Configuration picks
a variant by name through the builder registry in `specdec.proposers` (`BUILDERS`), without an
if-chain.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from specdec.metadata import DraftOutput, SpecBatch

# Sampled rows draw each draft from the top-TOP_J truncation of the draft's distribution, so that q
# crosses processes as [rows, k, TOP_J]. At temperature 1.0 on everyday chat a truncation to 32 cost
# 0.015 of first-step acceptance, 128 costs 0.005; at 0.7 and on code neither costs anything
# measurable (bench/draft_topk.py --temperatures, BENCHMARKS.md "How wide the draft's q").
TOP_J = 128


class Proposer(ABC):
    needs_features = False  # True: propose() reads the target's features (SpecBatch.features)
    feature_layers: tuple[int, ...] = ()  # target layers whose outputs lead those features (EAGLE-3 fusion)

    @abstractmethod
    def propose(self, batch: SpecBatch) -> DraftOutput:
        """Propose up to batch.num_draft[i] tokens for each row."""

    def release(self, seq_ids) -> None:
        """Forget finished or aborted sequences."""

    @property
    def num_active(self) -> int:
        """Sequences whose state this proposer holds."""
        return 0

    @property
    def has_model(self) -> bool:
        """True when proposing costs a model forward (its cost enters the adaptive policy)."""
        return False
