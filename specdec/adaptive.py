"""Adaptive speculation length, per sequence.

Model (Leviathan et al. 2023, sec. 3): if each draft token is accepted independently with
probability a, a round with k drafts emits E(k) = (1 - a^(k+1)) / (1 - a) tokens and costs
k*c + v(k) target-step units, where c is the measured draft-step / target-step cost ratio and
v(k) the measured cost of verifying k+1 positions relative to one. Each sequence keeps a decayed
estimate of a (accepted draft tokens / Bernoulli trials, a rejection ending the trials of its
round) and picks the k in 0..k_max that maximizes E(k) / cost(k), with costs measured for the
current batch size (verification is cheap at batch 1, dear at large batches). k = 0 -- plain decoding, the
same loop -- wins when no k gives an expected speedup above 1; after `probe_interval` rounds off,
one round probes with the best k >= 1 so a sequence whose text turned predictable comes back. In
a batch the rows' probes are aligned (the scheduler's `probe` argument): one drafting row makes
the whole batch's verify a (k+1)-position forward and turns a multi-step plain round into a
single step, so rows that are due probe together, in a round that drafts anyway or once every
`probe_interval` rounds of the batch, never one row per round.

The model can be wrong (kernel cliffs, contention, a service hop it does not see), so a measured
safeguard sits on top: per batch-size bucket the cost model keeps the tokens per second that
speculative and plain rounds actually obtained (`observe_throughput`), and while speculative
rounds yield fewer (`speculation_loses`), the scheduler keeps adaptive rows plain except for one
probing round every `throttle_probe_every` rounds of that bucket, whose measurement lets
speculation come back when it wins again. Such a probe, like any drafting round right after plain
ones, has its draft catch up on the plain rounds' tokens (with 16 rows: 55-75 ms against the 4-6
ms of a drafting round after a drafting one): a cost of switching, not of speculating, so the
round is measured with its draft steps priced at the steady step cost (`draft_seconds`) instead;
charged in full, every probe lost and kept speculation off where it wins. The same measurement
also corrects the model the other way: while speculative rounds measurably yield more than plain ones (`speculation_wins`, by a
margin), rows whose model says k = 0 speculate anyway, with the model's best k >= 1. The
safeguard averages a round's seconds over a few recent rounds (costs move with the machine) and
its tokens over more (they vary with acceptance from one round to the next, which each row's k
already follows).

Costs are measured per k, not assumed: verifying more positions can cost less (kernel cliffs),
so a k never measured at a bucket is priced as the longest measured one below it (`verify_cost`)
and the round that picks it measures it.

Probing has a floor too (`cannot_pay`): once a bucket's measured costs say that no k would beat a
plain round even at acceptance 0.9 (E(k) tokens for `round_cost(k)`), as where a verify costs
about as many plain rounds as the positions it computes, a probe cannot find a row worth
speculating for and only costs a dear round: adaptive rows stay plain there, and one probe every
`recheck_every` rounds re-measures.
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


def mean_then_ema(old: float, new: float, n: int, ema: float) -> float:
    """The running average of a measurement's `n`-th sample: the plain mean of the first ~1/ema
    samples, an EMA after them (one early sample must not weigh like a window of them)."""
    w = max(ema, 1.0 / n)
    return (1 - w) * old + w * new


class DecayedRatio:
    """A workload's recent rate (successes over trials, both decayed per observation): the prior a
    new sequence starts from, or `default` until `min_trials` of evidence."""

    def __init__(self, decay: float = 0.995, min_trials: float = 8):
        self.decay, self.min_trials = decay, min_trials
        self.num, self.den = 0.0, 0.0

    def add(self, num: float, den: float) -> None:
        self.num = self.decay * self.num + num
        self.den = self.decay * self.den + den

    def value(self, default: float) -> float:
        return self.num / self.den if self.den >= self.min_trials else default


class CostModel:
    """Measured costs per batch size B: target round time by max draft length K, draft step time.

    All EMAs, batch sizes bucketed by powers of two. A verify over K+1 positions per row costs t(B, K) / t(B, 0) plain rounds: cheap
    where the target is memory-bound (batch 1, bf16), expensive where it is compute-bound (large
    batches in float32), so the right k depends on B. t(B, 0) is re-measured by an occasional
    plain round (`needs_plain_round`); unmeasured K are priced optimistically (`verify_cost`).
    """

    def __init__(self, prior_c: float = 0.1, prior_verify_slope: float = 0.15, ema: float = 0.2,
                 recalibrate_every: int = 64, throughput_ema: float = 0.3, tokens_ema: float = 0.1,
                 throughput_min_rows: int = 4,
                 throttle_probe_every: int = 16, win_margin: float = 1.1, recheck_every: int = 256,
                 ceiling_acceptance: float = 0.9, calibration_spacing: int = 4):
        self.ema, self.recalibrate_every, self.calibration_spacing = ema, recalibrate_every, calibration_spacing
        # (bucket, speculative) -> [EMA of tokens per round, EMA of seconds per round, rounds seen, rows seen,
        #                           EMA of tokens per target forward (a multi-step plain round runs several)]
        self.throughput: dict[tuple[int, bool], list[float]] = {}
        # rows of speculative and of plain rounds each before the safeguard judges a bucket: 4 rounds
        # of one row, one of 4 rows or more (a lane of 8 used to pay 4 losing rounds before it did)
        self.throughput_ema, self.tokens_ema, self.throughput_min_rows = throughput_ema, tokens_ema, throughput_min_rows
        self.throttle_probe_every = throttle_probe_every
        self.win_margin = win_margin  # measured speedup above which speculation overrides the model
        self.throttled_rounds: dict[int, int] = {}  # bucket -> rounds planned plain by the safeguard
        self.draft_step: dict[int, float] = {}  # B -> seconds per draft forward
        self.target: dict[tuple[int, int], float] = {}  # (B, K) -> seconds per target round
        self.plain_seen: dict[int, int] = {}  # B -> round index of the last plain round
        self.spec_seen: dict[int, int] = {}  # B -> the bucket's own round count at its last speculative round
        self.bucket_rounds: dict[int, int] = {}  # B -> rounds observed at this bucket
        self.recheck_every = recheck_every  # cannot_pay: rounds before a hopeless bucket is probed again
        self.ceiling_acceptance = ceiling_acceptance  # cannot_pay: the best acceptance a probe could find
        self.rounds = 0
        self.prior_c, self.prior_slope = prior_c, prior_verify_slope
        self.workload_acceptance = DecayedRatio()  # accepted drafts / trials: new sequences' prior
        self.lookups = LookupGate()  # multi-step plain rounds: with or without prompt lookups

    def observe_acceptance(self, proposed: int, accepted: int) -> None:
        if proposed:
            self.workload_acceptance.add(accepted, accepted + (1 if accepted < proposed else 0))

    def acceptance_prior(self, default: float) -> float:
        """Recent acceptance of the workload (new sequences start from it), or `default`."""
        return self.workload_acceptance.value(default)

    def _upd(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.ema) * old + self.ema * new

    @staticmethod
    def bucket(batch: int) -> int:
        """Batch sizes share measurements by power-of-two bucket (1, 2, 4, 8, ...)."""
        return 1 << max(0, batch - 1).bit_length()

    def observe(self, k_max: int, draft_time: float, draft_steps: int, target_time: float, batch: int = 1,
                catch_up: bool = False) -> None:
        """A round's costs. `catch_up`: its draft also caught up on plain rounds' tokens, so its
        time is no draft step's (the target's forward is measured as usual)."""
        batch = self.bucket(batch)
        self.rounds += 1
        n = self.bucket_rounds[batch] = self.bucket_rounds.get(batch, 0) + 1
        if draft_steps > 0 and not catch_up:
            self.draft_step[batch] = self._upd(self.draft_step.get(batch), draft_time / draft_steps)
        self.target[(batch, k_max)] = self._upd(self.target.get((batch, k_max)), target_time)
        if k_max == 0:
            self.plain_seen[batch] = self.rounds
        else:
            self.spec_seen[batch] = n

    # ---- the measured safeguard: tokens per second of speculative vs plain rounds --------------
    def observe_throughput(self, batch: int, speculative: bool, tokens: int, seconds: float, forwards: int = 1) -> None:
        """A round's outcome: `tokens` emitted over all rows in `seconds` of wall time as the loop
        paid it (in the service: hops included). Seconds are averaged over ~1/`throughput_ema`
        recent rounds, tokens over ~1/`tokens_ema` (more), the first rounds by their plain mean:
        a round's cost changes with the machine (contention, a hop), and the safeguard must follow
        it, but a speculative round's tokens vary with acceptance (1 to k + 1 from one round to
        the next), and a window of a few rounds turned speculation off on every dip of acceptance,
        which the rows' own k already answers. The evidence counts rows: a round of B rows holds
        B rows' acceptance (see `throughput_min_rows`). `forwards`: the target forwards the round
        ran (a multi-step plain round: up to plain_steps)."""
        if seconds <= 0:
            return
        key = (self.bucket(batch), speculative)
        old = self.throughput.get(key)
        per_forward = tokens / max(1, forwards)
        if old is None:
            self.throughput[key] = [tokens, seconds, 1, batch, per_forward]
            return
        n = old[2] + 1
        self.throughput[key] = [mean_then_ema(old[0], tokens, n, self.tokens_ema),
                                mean_then_ema(old[1], seconds, n, self.throughput_ema), n, old[3] + batch,
                                mean_then_ema(old[4], per_forward, n, self.tokens_ema)]

    def _throughput_rows(self, bucket: int, speculative: bool) -> int:
        """Rows (rounds times their rows) whose outcome the bucket's measurement holds."""
        return int(self.throughput.get((bucket, speculative), (0, 0, 0, 0))[3])

    def measured_speedup(self, batch: int, min_spec_rows: int | None = None) -> float | None:
        """Speculative rounds' tokens/s over plain rounds' at this bucket; None until both are
        measured (`throughput_min_rows` rows each, or `min_spec_rows` speculative ones)."""
        b = self.bucket(batch)
        need = self.throughput_min_rows if min_spec_rows is None else min_spec_rows
        if self._throughput_rows(b, False) < self.throughput_min_rows or self._throughput_rows(b, True) < need:
            return None
        (ts, ss, *_), (tp, sp, *_) = self.throughput[(b, True)], self.throughput[(b, False)]
        return (ts / ss) / (tp / sp) if tp > 0 else None

    def measured_speedups(self) -> dict[int, float]:
        """measured_speedup of every bucket that has one (for /stats)."""
        return {b: r for b in sorted({b for b, _ in self.throughput}) if (r := self.measured_speedup(b)) is not None}

    def speculation_loses(self, batch: int) -> bool:
        s = self.measured_speedup(batch)
        return s is not None and s < 1.0

    def speculation_wins(self, batch: int) -> bool:
        """Speculative rounds measurably yield more tokens/s than plain ones at this bucket, and
        more tokens per target forward: a speculative forward costs at least a plain one, so one
        that emits no more than a plain forward cannot win, and a measured "win" without it is
        timing noise (a stalled plain round) that must not turn a useless draft back on. (Per
        forward, not per round: a multi-step plain round emits up to plain_steps tokens a row,
        more than any speculative round, and the override never fired beside them.)"""
        s = self.measured_speedup(batch)
        if s is None or s <= self.win_margin:
            return False
        b = self.bucket(batch)
        return self.throughput[(b, True)][4] > self.throughput[(b, False)][4]

    def win_floor(self, batch: int) -> float:
        """Tokens per target forward that a drafting row must expect to share this bucket's measured
        win: a plain row's as measured (1, or more with multi-step lookups), times `win_margin`."""
        rec = self.throughput.get((self.bucket(batch), False))
        per_row = rec[4] * rec[2] / rec[3] if rec and rec[3] else 1.0  # (tokens per forward of a round / its rows)
        return self.win_margin * per_row

    def throttle(self, batch: int) -> bool:
        """True: plan this round plain (speculation measurably loses at this bucket); every
        `throttle_probe_every`-th such round is let through to re-measure speculation."""
        if not self.speculation_loses(batch):
            return False
        b = self.bucket(batch)
        n = self.throttled_rounds[b] = self.throttled_rounds.get(b, 0) + 1
        return n % self.throttle_probe_every != 0

    def cannot_pay(self, batch: int, k_max: int, has_model: bool = True) -> bool:
        """True when this bucket's measured costs say that no k in 1..k_max beats a plain round
        even at per-token acceptance `ceiling_acceptance` (E(k) / round_cost(k) <= 1): probing is
        pointless. Only while the whole speculative rounds measured here so far (one is enough)
        yielded fewer tokens/s than plain ones, so that measurements can overrule the model (see
        `speculation_wins`); and not once every `recheck_every` rounds of this bucket (contention
        may have inflated the costs; rounds at other batch sizes re-measure nothing here, and
        counting them had a lane of 16 probe again after every run at concurrency 1)."""
        b = self.bucket(batch)
        if (b, 0) not in self.target or b not in self.spec_seen or k_max < 1:
            return False
        measured = self.measured_speedup(batch, min_spec_rows=1)
        if measured is None or measured >= 1.0:
            return False
        if self.bucket_rounds[b] - self.spec_seen[b] >= self.recheck_every:
            return False
        a = self.ceiling_acceptance
        return max(expected_tokens(a, k) / self.round_cost(k, has_model, batch, optimistic=False)
                   for k in range(1, k_max + 1)) <= 1.0

    def needs_plain_round(self, batch: int) -> bool:
        """True when t(B, 0) is unknown or stale: the next round should be plain to measure it.

        t(B, 0), the unit of every cost at this bucket, takes one plain round. The safeguard's
        further plain rounds (`throughput_min_rows` rows in all) come one per `calibration_spacing` rounds,
        not in a row: every bucket a batch passes through (rows join and finish) would otherwise
        open with that many plain rounds, and a short-lived bucket would spend most of its life
        on them (in-process batches of 6 answers: ~1/5 of all rounds)."""
        b = self.bucket(batch)
        seen = self.plain_seen.get(b)
        if seen is None:
            return True
        since = self.rounds - seen
        if self._throughput_rows(b, False) < self.throughput_min_rows:
            return since >= self.calibration_spacing  # the safeguard needs plain rounds' tokens/s
        return since >= self.recalibrate_every

    def draft_seconds(self, batch: int, steps: int) -> float:
        """Seconds of `steps` draft steps at this bucket as a drafting round after a drafting one
        pays them (measured; before that, the prior c times a plain round)."""
        b = self.bucket(batch)
        step = self.draft_step.get(b)
        return steps * (step if step is not None else self.prior_c * self.target.get((b, 0), 0.0))

    def c(self, batch: int = 1) -> float:
        """Draft step cost / plain target round cost at batch size B."""
        batch = self.bucket(batch)
        base, step = self.target.get((batch, 0)), self.draft_step.get(batch)
        if not base or step is None:
            return self.prior_c
        return step / base

    def verify_cost(self, k: int, batch: int = 1, optimistic: bool = True) -> float:
        """Cost of a round whose rows verify k drafts, relative to a plain round (>= 1).

        A k never measured at this bucket is priced optimistically, as the longest measured verify
        below it: a verify's cost is not linear in its positions (GEMM kernels change with the row
        count; float32 on one 2-core EPYC: 2 positions 1.42x a step, 3 1.58x, 4 1.26x), so
        extrapolating from a short verify could price a cheaper long one out forever. Optimism
        costs at most one round per k: the round that picks it measures it. `optimistic=False`
        (`cannot_pay`, a decision to stop probing that is re-checked later) prices it on the line
        from a plain round through that verify instead: a k that no round picks (low acceptance
        makes probes pick short ones) would otherwise keep its optimistic price forever."""
        batch = self.bucket(batch)
        base = self.target.get((batch, 0))
        if k == 0:
            return 1.0
        if base:
            known = {kk: t / base for (b, kk), t in self.target.items() if b == batch and kk > 0}
            if k in known:
                return max(1.0, known[k])
            below = max((kk for kk in known if kk < k), default=0)
            if below:  # optimistic: no dearer than the longest measured verify below it (see docstring)
                return max(1.0, known[below] if optimistic else 1.0 + (known[below] - 1.0) * k / below)
            if known:  # only longer ones measured: linear from a plain round to the nearest
                kk = min(known)
                return max(1.0, 1.0 + (known[kk] - 1.0) * k / kk)
        return 1.0 + self.prior_slope * k

    def round_cost(self, k: int, has_model: bool = True, batch: int = 1, optimistic: bool = True) -> float:
        return (k * self.c(batch) if has_model else 0.0) + self.verify_cost(k, batch, optimistic)


class LookupGate:
    """Whether a multi-step plain round's rows verify prompt-lookup tokens, per batch bucket.

    A lookup widens every forward of the round (each row carries up to `lookup_k` more positions)
    and pays only with the tokens it gets accepted. What it gets depends on the text and on the
    sampling: a greedy row takes the target's argmax, a sampled row at temperature 1 its draw,
    which matches a lookup far less often (measured in process, bf16, lanes of 8: 25% of lookup
    tokens accepted greedy, 11% at T = 1.0, and lookups turned a lane of 8 sampled rows from 1.0x
    to 0.85x). So both sides are measured: the seconds per forward of multi-step rounds with and
    without lookups at this bucket (slow EMAs; `cost`), and each row's accepted lookup tokens per
    forward (`gain`, from `Sequence.lookup_hits` / `lookup_forwards`). A round carries lookups when its rows' mean gain exceeds
    the measured extra cost of a forward, `cost - 1`. Until each side has `min_samples` rounds a
    bucket alternates, lookups first (one early round, slowed by the streams a new lane opens,
    turned a lane of greedy rows' lookups off for a whole run); afterwards every
    `remeasure_every`-th multi-step round of the bucket takes the other choice, so the losing
    side's time stays current. Lookups never change the output (their tokens are checked against
    plain decoding's own draws), so this choice, which depends on timings, is free to.

    A round lasts as long as its slowest row: with lookups, rows whose tokens are accepted reach
    their budget in fewer forwards and leave, and the round runs on for the others (forwards of
    fewer rows cost nearly as much). So the per-forward comparison also weighs `straggle`, the
    measured ratio of a lookup round's forwards to its rows' mean forwards (slow EMA per bucket):
    a round with lookups pays when (1 + gain) > cost * straggle. Without it, lanes of 4 sampled rows
    at T = 1.0 kept lookups in most rounds at 0.91-0.96x of plain decoding through HTTP; with it,
    in 2-4 of ~32 (the lanes still measured 0.91-0.97x: BENCHMARKS.md).
    """

    def __init__(self, ema: float = 0.1, remeasure_every: int = 16, min_samples: int = 3, prior_gain: float = 0.5,
                 prior_weight: float = 4.0, decay: float = 0.995):
        self.ema, self.remeasure_every, self.min_samples = ema, remeasure_every, min_samples
        self.step: dict[tuple[int, bool], float] = {}  # (bucket, lookups) -> EMA seconds per forward
        self.samples: dict[tuple[int, bool], int] = {}  # (bucket, lookups) -> rounds measured
        self.rounds: dict[int, int] = {}  # bucket -> multi-step rounds planned
        self.gated = 0  # multi-step rounds planned without lookups by this gate
        self.prior_gain, self.prior_weight = prior_gain, prior_weight
        self.workload = DecayedRatio(decay)  # the workload's lookup tokens accepted per forward: new rows' prior
        self.straggle: dict[int, float] = {}  # bucket -> EMA of a lookup round's forwards / its rows' mean forwards
        self.straggle_samples: dict[int, int] = {}

    def observe_row(self, forwards: int, hits: int) -> None:
        """A row's lookups in a round: `hits` tokens accepted over `forwards` forwards that carried them."""
        if forwards:
            self.workload.add(hits, forwards)

    def gain(self, hits: float, forwards: float) -> float:
        """A row's accepted lookup tokens per forward from its own (decayed) evidence, behind
        `prior_weight` forwards of the workload's recent gain (or `prior_gain` before there is any)."""
        prior = self.workload.value(self.prior_gain)
        return (hits + prior * self.prior_weight) / (forwards + self.prior_weight)

    def observe(self, batch: int, lookups: bool, seconds_per_forward: float,
                row_forwards: list[int] | None = None) -> None:
        """A multi-step round's seconds per forward. Averaged slowly (their ratio is the machine's,
        and the two sides are measured at different times, under different contention: a quick
        EMA let one stalled round flip a lane of greedy rows' lookups off), the first rounds by
        their plain mean. `row_forwards` (a round with lookups): how many forwards each row took."""
        b = CostModel.bucket(batch)
        key = (b, lookups)
        n = self.samples[key] = self.samples.get(key, 0) + 1
        self.step[key] = mean_then_ema(self.step.get(key, 0.0), seconds_per_forward, n, self.ema)
        if lookups and row_forwards and sum(row_forwards):
            ratio = max(row_forwards) * len(row_forwards) / sum(row_forwards)  # >= 1
            m = self.straggle_samples[b] = self.straggle_samples.get(b, 0) + 1
            self.straggle[b] = mean_then_ema(self.straggle.get(b, 1.0), ratio, m, self.ema)

    def cost(self, batch: int) -> float | None:
        """Seconds per forward with lookups over without, at this bucket (None: not both measured)."""
        b = CostModel.bucket(batch)
        on, off = self.step.get((b, True)), self.step.get((b, False))
        return on / off if on and off else None

    def to_dict(self) -> dict:
        """For /stats: the measured cost of a forward with lookups per bucket, and the multi-step
        rounds planned, of them without lookups."""
        buckets = sorted({b for b, _ in self.step})
        return {"cost": {b: round(c, 3) for b in buckets if (c := self.cost(b)) is not None},
                "straggle": {b: round(x, 3) for b, x in sorted(self.straggle.items())},
                "rounds": sum(self.rounds.values()), "rounds_without": self.gated}

    def use(self, batch: int, gains: list[float]) -> bool:
        """Plan this multi-step round with lookups? `gains`: each row's accepted lookup tokens per forward."""
        b = CostModel.bucket(batch)
        n = self.rounds[b] = self.rounds.get(b, 0) + 1
        on, off = self.samples.get((b, True), 0), self.samples.get((b, False), 0)
        if min(on, off) < self.min_samples:  # measure both sides first, alternating (lookups first)
            want = on <= off
        else:
            want = sum(gains) / max(1, len(gains)) > self.cost(batch) * self.straggle.get(b, 1.0) - 1.0
            if n % self.remeasure_every == 0:
                want = not want
        self.gated += not want
        return want


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

    def best(self, cost: CostModel, has_model: bool, k_min: int = 0, batch: int = 1,
             k_max: int | None = None) -> tuple[int, float]:
        a = self.acceptance
        top = self.cfg.k_max if k_max is None else k_max
        scores = [(expected_tokens(a, k) / cost.round_cost(k, has_model, batch), k)
                  for k in range(min(k_min, top), top + 1)]
        s, k = max(scores)
        return k, s

    @property
    def probe_due(self) -> bool:
        """Off long enough that the next round should probe (measure acceptance again)."""
        return self.off_rounds + 1 >= self.cfg.probe_interval

    def choose(self, cost: CostModel, has_model: bool = True, batch: int = 1, k_max: int | None = None,
               measured_win: bool = False, probe: bool = True, win_floor: float = 1.0) -> int:
        """k for the next round, at most `k_max` (the live cap; no state change: `update` records
        what ran). `measured_win`: speculative rounds measurably win at this batch size, whatever
        the model says; a row shares that win only if its own drafts are expected to emit more
        than `win_floor` tokens per target forward (a row whose drafts are never accepted, in a
        batch or a lane beside rows whose drafts are, would otherwise draft in every round).
        `probe`: a due probe may run this round (False: it waits for the batch's probing round)."""
        k, s = self.best(cost, has_model, batch=batch, k_max=k_max)
        if k > 0 and s > self.cfg.min_speedup:
            return k
        due = probe and self.probe_due
        if due or measured_win:  # (the best k >= 1 only where it may be used: this runs per row and round)
            k = self.best(cost, has_model, k_min=1, batch=batch, k_max=k_max)[0]
            if due or expected_tokens(self.acceptance, k) > win_floor:
                return k
        return 0
