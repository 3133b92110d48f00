"""The data that crosses between the planner, the proposer and the target in one round.

One `SpecBatch` describes a batched round (after vLLM's SpecDecodeMetadata). Proposer and target
are stateful per sequence (they hold its KV cache) but are told only what is new: each side has
an *offset* (how many confirmed tokens of the sequence it already holds) and gets the confirmed
tokens after it. A side that does not know a sequence at the offset it is sent (a restarted
replica) reports the row as `unknown`; the planner then resends the whole context next round.
These objects are plain tensors and lists; across Ray their tensors travel as numpy arrays
(specdec/wire.py), which Ray serializes far more cheaply.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from specdec.rejection_sampler import DraftProbs
from specdec.wire import Wire

# uniforms[:, U_DRAFT, j]: draws draft token j+1; U_ACCEPT: accept test of draft j+1;
# U_SAMPLE: draws the recovered/bonus token at position j
U_DRAFT, U_ACCEPT, U_SAMPLE = 0, 1, 2


@dataclass
class SpecBatch(Wire):
    """One speculative round over a batch, as seen by one side (proposer or target)."""

    seq_ids: list[int]
    offsets: list[int]  # confirmed tokens the receiver already holds for each row
    new_tokens: list[list[int]]  # confirmed tokens after `offsets`
    num_draft: list[int]  # draft tokens asked for (proposer) / proposed (target), per row
    temperature: Tensor  # [B] float32, 0 = greedy
    top_k: Tensor  # [B] long, 0 = off
    top_p: Tensor  # [B] float32
    uniforms: Tensor  # [B, 3, K+1] float64, see U_* above; a multi-step round: [B, 3, W], column j
    # drawing the row's j-th token of the round (W: the most tokens a row may emit in it)
    release: list[int] = field(default_factory=list)  # sequences to forget before this round
    # Multi-step plain round (no row drafts): row i runs up to steps[i] forwards in this one call
    # (one token each, more with `lookup`), its j-th token drawing with uniforms[i, :, j], and stops early
    # at a token of stop_ids[i]; the same tokens as separate plain rounds, one call's hops for all
    steps: list[int] | None = None
    stop_ids: list[list[int]] | None = None
    features: list[tuple[int, Tensor] | None] | None = None  # per row (first position, [n, hidden])
    # of target features the proposer has not been sent yet (EAGLE-style drafts only)
    lookup: list[int] | None = None  # a multi-step round: row i's steps[i] forwards each also
    # verify up to lookup[i] tokens found by prompt lookup in its own context, the row emitting up
    # to budget[i] tokens in all (TargetWorker._multi_step; None: steps[i])
    budget: list[int] | None = None
    siblings: bool = False  # a model proposer adds, for greedy rows, a sibling of the first draft
    # (its second choice there): the smallest draft tree, verified in the same target forward
    ngram_k: list[int] | None = None  # per row: how long drafts found by prompt lookup may run
    # (>= num_draft[i]; the hybrid's n-gram rows: no draft forward, so longer chains are cheap)
    coupled: list[bool] | None = None  # a speculative round: rows (sampled, seeded) verified against
    # plain decoding's own draws, their uniforms keyed by position (coupled_verify): whatever was
    # drafted, k, the batch or a failed call, they emit plain decoding's tokens for their seed
    race: list[bool] | None = None  # a multi-step round: rows (sampled, unseeded: their output need not
    # reproduce) whose in-target draft chains are raced with the noise of the positions they draft
    # (TargetWorker._step_drafts, sampling.race_sample)
    race_noise: list | None = None  # to an in-process proposer: per row, the Exp(1) noise of the positions it
    # drafts ([k, vocab], or a sampling.RaceNoise over its vocabulary); it takes the token its q wins the race
    # with (never crosses processes)
    partial: list[bool] | None = None  # to the target: rows whose new tokens are the next part of a long
    # prompt (chunked prefill across rounds, Scheduler.target_end): cached, nothing emitted
    prompt_len: list[int] | None = None  # to the target, in rounds with a prefill: each row's prompt length
    # (the prompt's chunks may attend with SDPA, runner.run_ragged)
    trace_context: dict | None = None  # W3C carrier for tracing across processes
    build: str = ""  # the target configuration the sender's tokens are for ('' = any): a receiver of
    # another refuses the round (during a redeploy old and new replicas run side by side)

    def __len__(self) -> int:
        return len(self.seq_ids)

    @property
    def max_draft(self) -> int:
        return max(self.num_draft, default=0)

    def row_budget(self, i: int) -> int:
        """Tokens row i may emit in this multi-step round (`budget`, else one per step)."""
        return self.budget[i] if self.budget else self.steps[i]

    def with_side(self, offsets: list[int], new_tokens: list[list[int]], **kw) -> "SpecBatch":
        return replace(self, offsets=offsets, new_tokens=new_tokens, **kw)


@dataclass
class DraftOutput(Wire):
    """What a proposer returns: up to k draft tokens per row (+ the distributions they came from)."""

    tokens: Tensor  # [B, K] long, rows padded past num_draft
    num_draft: list[int]  # proposed per row (may be fewer than asked: no n-gram match, unknown row)
    probs: DraftProbs | None = None  # None: one-hot q (greedy rows, n-gram)
    unknown: list[int] = field(default_factory=list)  # rows whose context the proposer lacked
    draft_time: float = 0.0  # seconds spent in the proposer's model work
    draft_steps: int = 0  # forward passes the proposer ran
    served: tuple[float, float] | None = None  # wall clock (time.time) at which a replica began / ended the call
    sibling: Tensor | None = None  # [B] long: a greedy row's alternative first draft token, -1 none

    @classmethod
    def empty(cls, batch_size: int) -> "DraftOutput":
        return cls(torch.zeros(batch_size, 0, dtype=torch.long), [0] * batch_size)


@dataclass
class VerifyOutput(Wire):
    """What the target returns: the tokens each row emits this round (accepted + recovered/bonus)."""

    tokens: list[list[int]]
    num_accepted: list[int]
    unknown: list[int] = field(default_factory=list)  # rows the target lacked: nothing emitted
    target_time: float = 0.0  # seconds in the target's forward + sampling
    hidden: list[Tensor] | None = None  # per row [n, hidden]: target features for EAGLE-style drafts
    hidden_start: list[int] | None = None  # per row: position of hidden[i][0]
    steps: int = 1  # target forwards this call ran (a multi-step plain round: more than one)
    sibling_accepted: int = 0  # rows whose first draft was rejected and its sibling accepted
    lookup_proposed: int = 0  # prompt-lookup tokens verified in a multi-step round (all rows)
    lookup_accepted: int = 0  # of which accepted
    target_drafted: int = 0  # of the lookup tokens, those the target's own drafter proposed (TargetWorker.drafter)
    target_draft_accepted: int = 0  # of which accepted
    lookup_rows: list[tuple[int, int]] | None = None  # per row: (forwards that carried its lookups, lookup tokens accepted)
    served: tuple[float, float] | None = None  # wall clock (time.time) at which a replica began / ended the call
    refused: list[int] | None = None  # of the unknown rows, those refused a KV slot (they wait in line)

    @classmethod
    def refusal(cls, batch_size: int, hidden: bool = False) -> "VerifyOutput":
        """Every row refused a slot, nothing changed: a lane moving in to a replica without room for it."""
        rows = list(range(batch_size))
        return cls([[] for _ in rows], [0] * batch_size, rows, 0.0, [None] * batch_size if hidden else None,
                   [0] * batch_size, refused=list(rows))
