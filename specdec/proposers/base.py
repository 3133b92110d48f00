"""The proposer interface: `propose(batch) -> DraftOutput` for a whole batch.

A proposer keeps per-sequence state (a draft KV cache, or just the token history) that it syncs
from the confirmed tokens each round brings (`SpecBatch.offsets`/`new_tokens`). Configuration picks
a variant by name through the builder registry in `specdec.proposers` (`BUILDERS`), without an
if-chain.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from specdec.metadata import DraftOutput, SpecBatch

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
