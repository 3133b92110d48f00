"""Adaptive speculation length, per sequence.

Model (Leviathan et al. 2023, sec. 3): if each draft token is accepted independently with
probability a, a round with k drafts emits E(k) = (1 - a^(k+1)) / (1 - a) tokens and costs
k*c + v(k) target-step units, where c is the measured draft-step / target-step cost ratio and
v(k) the measured cost of verifying k+1 positions relative to one. Each sequence keeps a decayed
estimate of a (accepted draft tokens / Bernoulli trials, a rejection ending the trials of its
round) and picks the k in 0..k_max that maximizes E(k) / cost(k). k = 0 -- plain decoding, the
same loop -- wins when no k gives an expected speedup above 1; after `probe_interval` rounds off,
one round probes with the best k >= 1 so a sequence whose text turned predictable comes back.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AdaptiveConfig:
    k_max: int = 4
    prior_acceptance: float = 0.6
    prior_weight: float = 4.0  # pseudo-trials behind the prior
    decay: float = 0.9  # per-round decay of the evidence (recent rounds count more)
    probe_interval: int = 8  # rounds with speculation off before one probing round
    min_speedup: float = 1.0  # speculate only when the expected speedup exceeds this


def expected_tokens(a: float, k: int) -> float:
    """E[tokens emitted per round] with k drafts and per-token acceptance a."""
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def speedup_bound(a: float, k: int, c: float) -> float:
    """The theoretical speedup S = (1 - a^(k+1)) / ((1 - a)(k c + 1))."""
    return expected_tokens(a, k) / (k * c + 1.0)


class CostModel:
    """Measured costs: draft step time and target round time by number of draft tokens (EMA)."""

    def __init__(self, prior_c: float = 0.1, prior_verify_slope: float = 0.05, ema: float = 0.1):
        self.ema = ema
        self.draft_step: float | None = None
        self.target: dict[int, float] = {}
        self.prior_c, self.prior_slope = prior_c, prior_verify_slope

    def observe(self, k_max: int, draft_time: float, draft_steps: int, target_time: float) -> None:
        def upd(old, new):
            return new if old is None else (1 - self.ema) * old + self.ema * new
        if draft_steps > 0:
            self.draft_step = upd(self.draft_step, draft_time / draft_steps)
        self.target[k_max] = upd(self.target.get(k_max), target_time)

    @property
    def base(self) -> float | None:
        return self.target.get(0) or (min(self.target.values()) if self.target else None)

    @property
    def c(self) -> float:
        """Draft step cost / target step cost."""
        if self.draft_step is None or not self.base:
            return self.prior_c
        return self.draft_step / self.base

    def verify_cost(self, k: int) -> float:
        """Cost of verifying k drafts relative to a plain step (>= 1)."""
        base = self.base
        if k in self.target and base and 0 in self.target:
            return max(1.0, self.target[k] / base)
        return 1.0 + self.prior_slope * k

    def round_cost(self, k: int, has_model: bool = True) -> float:
        return (k * self.c if has_model else 0.0) + self.verify_cost(k)


class AdaptiveK:
    """Per-sequence acceptance estimate and choice of k."""

    def __init__(self, cfg: AdaptiveConfig):
        self.cfg = cfg
        self.succ = cfg.prior_acceptance * cfg.prior_weight
        self.trials = cfg.prior_weight
        self.off_rounds = 0

    @property
    def acceptance(self) -> float:
        return self.succ / self.trials if self.trials else 0.0

    def update(self, planned: int, proposed: int, accepted: int) -> None:
        """Record a committed round: k planned, drafts actually proposed, drafts accepted."""
        self.off_rounds = self.off_rounds + 1 if planned == 0 else 0
        if proposed == 0:
            return
        d = self.cfg.decay
        self.succ = d * self.succ + accepted
        self.trials = d * self.trials + accepted + (1 if accepted < proposed else 0)

    def best(self, cost: CostModel, has_model: bool, k_min: int = 0) -> tuple[int, float]:
        a = self.acceptance
        scores = [(expected_tokens(a, k) / cost.round_cost(k, has_model), k)
                  for k in range(k_min, self.cfg.k_max + 1)]
        s, k = max(scores)
        return k, s

    def choose(self, cost: CostModel, has_model: bool = True) -> int:
        """k for the next round (no state change: `update` records what ran)."""
        k, s = self.best(cost, has_model)
        if k > 0 and s > self.cfg.min_speedup:
            return k
        if self.off_rounds + 1 >= self.cfg.probe_interval:  # probe: measure acceptance again
            return self.best(cost, has_model, k_min=1)[0]
        return 0
