"""Speculation statistics on the hot path: plain counters, no exporters (the Prometheus metrics
live in deployments/metrics.py).

Definitions (used everywhere): a *row-round* is one sequence in one round. Per row-round the
target emits accepted + 1 tokens (the last one recovered or bonus), so
- acceptance rate      = accepted / proposed;
- mean accepted length = emitted / row-rounds = mean of (accepted + 1), rounds without drafts
  counting 1: the tokens a target forward yields per sequence from the proposer's drafts. A
  multi-step plain round books a row-round per token: the tokens its prompt lookups and the
  Target replica's own drafter find are counted apart (`lookup_*`, `target_draft*`);
- per-position acceptance[j] = accepted at draft position j / proposed at position j.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


@dataclass
class SpecStats:
    rounds: int = 0
    row_rounds: int = 0
    spec_row_rounds: int = 0  # row-rounds that had at least one draft token
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0
    proposed_per_pos: list[int] = field(default_factory=list)
    accepted_per_pos: list[int] = field(default_factory=list)
    batch_size_sum: int = 0
    draft_time: float = 0.0  # seconds, summed over rounds
    target_time: float = 0.0
    round_time: float = 0.0  # wall time of whole rounds (draft + target + everything else)
    sibling_accepted: int = 0  # row-rounds whose first draft was rejected and its sibling accepted
    lookup_proposed: int = 0  # prompt-lookup tokens verified inside multi-step plain rounds (not
    lookup_accepted: int = 0  # in proposed / accepted: no proposer drafted them; their tokens are)
    target_drafted: int = 0  # of the lookup tokens, those the target replica's own drafter proposed
    target_draft_accepted: int = 0
    draft_steps: int = 0  # proposer forwards of steady drafting rounds (no prefill, no catch-up on plain
    draft_step_time: float = 0.0  # rounds' tokens) and their seconds: the per-step cost c is measured on these

    def observe_row(self, proposed: int, accepted: int, emitted: int) -> None:
        self.row_rounds += 1
        self.proposed += proposed
        self.accepted += accepted
        self.emitted += emitted
        if proposed:
            self.spec_row_rounds += 1
        while len(self.proposed_per_pos) < proposed:
            self.proposed_per_pos.append(0)
            self.accepted_per_pos.append(0)
        for j in range(proposed):
            self.proposed_per_pos[j] += 1
            if j < accepted:
                self.accepted_per_pos[j] += 1

    def observe_round(self, batch_size: int, draft_time: float, target_time: float, round_time: float) -> None:
        self.rounds += 1
        self.batch_size_sum += batch_size
        self.draft_time += draft_time
        self.target_time += target_time
        self.round_time += round_time

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.emitted / self.row_rounds if self.row_rounds else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted_per_pos, self.proposed_per_pos)]

    @property
    def mean_batch_size(self) -> float:
        return self.batch_size_sum / self.rounds if self.rounds else 0.0

    def merge(self, other: "SpecStats") -> None:
        """Add `other`'s counts (every field: counters summed, per-position lists by position)."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(mine, list):
                mine.extend([0] * (len(theirs) - len(mine)))
                for j, v in enumerate(theirs):
                    mine[j] += v
            else:
                setattr(self, f.name, mine + theirs)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(acceptance_rate=self.acceptance_rate, mean_accepted_length=self.mean_accepted_length,
                 per_position_acceptance=self.per_position_acceptance, mean_batch_size=self.mean_batch_size)
        return d


@dataclass
class RoundTimes:
    """Summed wall time of rounds of one kind, split by where it went (the service's round profile).

    `*_call_s` is what the loop waited for a proposer / target call; `*_compute_s` is the part the
    callee reports as its own work, and the rest of a call is the hop: `*_to_s` from the call to
    the replica's method starting (routing, serialization, transfer, queueing in the replica),
    `*_back_s` from the method's end to the caller resuming (serialization of the result,
    transfer, the caller's event loop); the remainder is the replica's own overhead around the
    work (lock, spans). `plan_s`: bookkeeping before the calls; `commit_s`: applying the results
    and waking the clients; `round_s`: the whole round.
    """

    rounds: int = 0
    rows: int = 0
    tokens: int = 0
    plan_s: float = 0.0
    draft_call_s: float = 0.0
    draft_compute_s: float = 0.0
    draft_to_s: float = 0.0
    draft_back_s: float = 0.0
    target_call_s: float = 0.0
    target_compute_s: float = 0.0
    target_to_s: float = 0.0
    target_back_s: float = 0.0
    commit_s: float = 0.0
    round_s: float = 0.0

    def add(self, rows: int, tokens: int, **seconds: float) -> None:
        self.rounds += 1
        self.rows += rows
        self.tokens += tokens
        for name, s in seconds.items():
            setattr(self, name, getattr(self, name) + s)


@dataclass
class RoundProfile:
    """RoundTimes per round kind: 'plain' (no proposer call) and 'spec' (drafts asked for)."""

    kinds: dict[str, RoundTimes] = field(default_factory=dict)

    def observe(self, kind: str, rows: int, tokens: int, **seconds: float) -> None:
        self.kinds.setdefault(kind, RoundTimes()).add(rows, tokens, **seconds)

    def to_dict(self) -> dict:
        return {k: asdict(v) for k, v in self.kinds.items()}
