"""Draft deployment: replicas hold a proposer (a draft model, an EAGLE-style draft over the
target's features, the target's first layers, n-gram lookup, or the n-gram/draft hybrid) and the
draft KV caches of the sequences routed to them. One call per round proposes k tokens for a
whole batch; EAGLE drafts get the target's features of the last round with it.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Literal

from pydantic import BaseModel, Field

from deployments.tracing import ensure_provider, flush
from deployments.common import HoldsRows, ModelRuntime, ModelThread, replica_id
from deployments.metrics import DRAFT_BUSY_FRACTION, DRAFT_TOKENS_PER_S, LoadMeter
from specdec.loader import parse_dtype
from specdec.metadata import DraftOutput, SpecBatch
from specdec.proposers import build_proposer
from specdec.proposers.base import TOP_J

log = logging.getLogger("ray.serve")


class ProposerSettings(BaseModel):
    """The proposer settings a user chooses (AppArgs inherits them)."""

    draft: str | None = Field(None, description="Draft checkpoint with the target's tokenizer (proposer='draft', 'eagle' or 'hybrid'): a small causal LM or an EAGLE-style draft ('smollm2-eagle' is the one shipped for the demo target).")
    self_draft_layers: int = Field(4, ge=1, description="Target layers used by proposer='self'.")
    hybrid_ngram_min: int = Field(3, ge=1, description="proposer='hybrid': shortest n-gram match taken instead of the draft.")


class DraftConfig(ModelRuntime, ProposerSettings):
    """Configuration of the Draft deployment."""

    proposer: Literal["ngram", "draft", "eagle", "hybrid", "self"] = Field("ngram", description="Which proposer the replicas run.")
    target: str | None = Field(None, description="Target checkpoint (proposer='self' uses its first layers).")
    num_slots: int = Field(16, ge=1, description="Draft KV-cache slots per replica.")
    top_j: int = Field(TOP_J, ge=1, description="Sampled rows draw drafts from the top-j truncation of q.")
    ngram_min: int = Field(1, ge=1, description="Shortest n-gram matched by prompt lookup.")
    ngram_max: int = Field(3, ge=1, description="Longest n-gram matched by prompt lookup.")


def make_proposer(c: DraftConfig, **overrides):
    """The proposer a Draft replica runs for `c`; `overrides`: other `build_proposer` arguments (an
    in-process copy of the service, e.g. bench/http_bench.py, shares its target model)."""
    kw = dict(draft=c.draft, target=c.target, self_draft_layers=c.self_draft_layers, dtype=parse_dtype(c.dtype),
              device=c.device, num_slots=c.num_slots, max_model_len=c.max_model_len, top_j=c.top_j,
              ngram_min=c.ngram_min, ngram_max=c.ngram_max, hybrid_ngram_min=c.hybrid_ngram_min)
    return build_proposer(c.proposer, **{**kw, **overrides})


class DraftDeployment(HoldsRows):
    """Serve deployment class (decorated by the builder)."""

    def __init__(self, config: dict):
        self.cfg = c = DraftConfig(**config)
        ensure_provider(c.tracing_env)
        self.thread = ModelThread(c.num_threads, "draft")  # all torch work of the replica
        self.proposer = self.thread.run(make_proposer, c)
        self.proposed = LoadMeter()
        self.id = replica_id()
        log.info("draft replica %s ready (%s)", self.id, c.proposer)

    def __del__(self) -> None:
        flush()  # Serve stops the replica (ray.kill skips atexit): export the spans it still buffers

    async def propose(self, batch: SpecBatch, pin: str | None = None,
                      avoid: list[str] | None = None) -> tuple[str, DraftOutput]:
        """Drafts for a batch; `pin`/`avoid` are read by the affinity request router only."""
        arrived = time.time()
        out = await self.thread.call(self._propose, batch)
        out.served = (arrived, time.time())
        return self.id, out

    def _propose(self, batch: SpecBatch) -> DraftOutput:
        from deployments.tracing import span
        with span("draft.propose", batch.trace_context, rows=len(batch), k=batch.max_draft) as sp:
            t0 = time.perf_counter()
            out = self.proposer.propose(batch)
            n = sum(out.num_draft)
            self.proposed.record(n, time.perf_counter() - t0)
            sp.set(proposed=n, unknown=len(out.unknown))
        return out

    def _free(self, seq_ids: list[int]) -> None:
        self.proposer.release(seq_ids)

    def check_health(self) -> None:
        """Fail (so Serve replaces this replica) when a proposal hangs: its lanes would otherwise
        wait draft_timeout_s for it, round after round."""
        self.thread.check_not_stuck(self.cfg.forward_timeout_s)

    def stats(self) -> dict:
        return {"replica": self.id, "pid": os.getpid(), "proposer": self.cfg.proposer,
                "active_sequences": self.proposer.num_active}

    def record_autoscaling_stats(self) -> dict:
        return {DRAFT_TOKENS_PER_S: self.proposed.tokens_per_s(), DRAFT_BUSY_FRACTION: self.proposed.busy_fraction()}
