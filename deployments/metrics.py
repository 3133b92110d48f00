"""Replica-side metrics: Prometheus metrics through Ray, and the autoscaling stats replicas report.

Two consumers read what a replica measures, at two speeds:

* **Prometheus / Grafana** (`RouterMetrics`). The router replica creates one `RouterMetrics` and
  calls its `record_*` methods from the hot path. Each call is a handful of Python additions and
  Ray metric records (~1-2 us each measured without a cluster), so a round costs tens of
  microseconds against rounds of tens of milliseconds. Metrics are `ray.serve.metrics`
  Counter/Gauge/Histogram: inside a replica Ray adds the `deployment`, `replica` and
  `application` tags, and exports every name with a `ray_` prefix, counters with a `_total`
  suffix and histograms as `_bucket`/`_sum`/`_count` (see `prometheus_series`). The Grafana
  dashboard `serve_app/grafana/specdec_dashboard.json` plots every metric in `METRICS`.

* **The Serve autoscaler** (`record_autoscaling_stats() -> dict[str, float]` on each replica,
  read by the policies in `serve_app/autoscaling.py`). The key names below are the contract
  between the deployments and the policies; they live here, under `deployments`, because the
  deployments must not import `serve_app` while `serve_app` may import this module.
  `RouterMetrics.autoscaling_stats()` builds the router's dict; `LoadMeter` gives Target and
  Draft replicas their windowed tokens/s and busy fraction.

Speculation definitions match `specdec.stats`: a *sequence-round* is one sequence in one round;
acceptance rate = accepted / proposed; mean accepted length = mean of (accepted + 1) over
sequence-rounds (a round without drafts counts 1: the tokens one target forward yields per
sequence); acceptance at draft position j = sequence-rounds accepting position j / sequence-rounds
proposing it. "Recent" gauges cover the last `window_s` seconds of rounds.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Literal

from ray.serve import metrics as serve_metrics

# ---------------------------------------------------------------------------------------------
# Autoscaling stats keys (values returned by each replica's record_autoscaling_stats()).
# Ray 2.60 gives a policy, per key, one value per running replica: that replica's reports
# aggregated over the deployment's look_back_period_s with its aggregation_function (a
# time-weighted mean by default). Summing over replicas gives deployment totals.
# ---------------------------------------------------------------------------------------------

# Router
ROUTER_ONGOING_REQUESTS = "ongoing_requests"  # sequences running + queued on this router replica
ROUTER_QUEUED_REQUESTS = "queued_requests"  # sequences waiting for a batch slot
ROUTER_TOKENS_PER_S = "tokens_per_s"  # generated tokens/s over the recent window
ROUTER_ACCEPTANCE_RATE = "acceptance_rate"  # recent draft acceptance, 0..1 (last known if none)
ROUTER_SPECULATING_FRACTION = "speculating_fraction"  # running sequences with speculation on, 0..1
ROUTER_DRAFT_TOKENS_PER_S = "draft_tokens_per_s"  # draft tokens requested per second
ROUTER_STATS_KEYS = (
    ROUTER_ONGOING_REQUESTS, ROUTER_QUEUED_REQUESTS, ROUTER_TOKENS_PER_S,
    ROUTER_ACCEPTANCE_RATE, ROUTER_SPECULATING_FRACTION, ROUTER_DRAFT_TOKENS_PER_S,
)

# Target
TARGET_TOKENS_PER_S = "tokens_per_s"  # tokens emitted by this replica per second
TARGET_ACTIVE_SEQUENCES = "active_sequences"  # sequences holding KV state on this replica
TARGET_BUSY_FRACTION = "busy_fraction"  # fraction of wall time spent in forward passes
TARGET_STATS_KEYS = (TARGET_TOKENS_PER_S, TARGET_ACTIVE_SEQUENCES, TARGET_BUSY_FRACTION)

# Draft
DRAFT_TOKENS_PER_S = "draft_tokens_per_s"  # tokens proposed by this replica per second
DRAFT_BUSY_FRACTION = "busy_fraction"  # fraction of wall time spent in forward passes
DRAFT_STATS_KEYS = (DRAFT_TOKENS_PER_S, DRAFT_BUSY_FRACTION)


# ---------------------------------------------------------------------------------------------
# Prometheus metrics
# ---------------------------------------------------------------------------------------------

MetricKind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True)
class MetricSpec:
    """One exported metric: its Ray name (without Ray's `ray_` prefix), kind, help and tags."""

    name: str
    kind: MetricKind
    description: str
    tag_keys: tuple[str, ...] = ()
    boundaries: tuple[float, ...] = ()


# Bucket boundaries (Ray requires them > 0). Integer-valued histograms put a boundary at 0.5 so
# that 0 gets its own bucket (Prometheus buckets are cumulative "<= le").
_SECONDS_FAST = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0,
                 2.5, 5.0)
_SECONDS_TTFT = (0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 20.0,
                 30.0, 60.0)
_BATCH = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256)
_K = (0.5, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16)

GENERATED_TOKENS = "specdec_generated_tokens"
DRAFT_TOKENS = "specdec_draft_tokens"
ACCEPTED_TOKENS = "specdec_accepted_draft_tokens"
REQUESTS_STARTED = "specdec_requests_started"
REQUESTS_FINISHED = "specdec_requests"
PROMPT_TOKENS = "specdec_prompt_tokens"
COMPLETION_TOKENS = "specdec_completion_tokens"
LOOKUP_TOKENS = "specdec_lookup_tokens"
DRAFT_FAILURES = "specdec_draft_call_failures"
LOOKUP_ACCEPTED_TOKENS = "specdec_lookup_accepted_tokens"
ACCEPTANCE_RATE = "specdec_acceptance_rate"
MEAN_ACCEPTED_LENGTH = "specdec_mean_accepted_length"
POSITION_ACCEPTANCE = "specdec_position_acceptance_rate"
NUM_DRAFT_MEAN = "specdec_num_draft_tokens_mean"
QUEUE_WAITING = "specdec_queue_waiting"
QUEUE_RUNNING = "specdec_queue_running"
SPECULATION_SEQUENCES = "specdec_speculation_sequences"
REQUESTS_IN_FLIGHT = "specdec_requests_in_flight"
NUM_DRAFT = "specdec_num_draft_tokens"
BATCH_SIZE = "specdec_batch_size"
TTFT = "specdec_time_to_first_token_seconds"
ITL = "specdec_inter_token_latency_seconds"
DRAFT_TIME = "specdec_draft_time_seconds"
TARGET_TIME = "specdec_target_time_seconds"
ROUND_TIME = "specdec_round_time_seconds"

METRICS: tuple[MetricSpec, ...] = (
    # counters
    MetricSpec(GENERATED_TOKENS, "counter", "Tokens generated (emitted to sequences) by rounds."),
    MetricSpec(DRAFT_TOKENS, "counter", "Draft tokens proposed for verification."),
    MetricSpec(ACCEPTED_TOKENS, "counter", "Draft tokens accepted by the target."),
    MetricSpec(LOOKUP_TOKENS, "counter", "Lookup tokens verified inside multi-step plain rounds (prompt lookup, the lookup corpus, and "
               "the Target replica's own drafter)."),
    MetricSpec(LOOKUP_ACCEPTED_TOKENS, "counter", "Lookup tokens the target accepted."),
    MetricSpec(DRAFT_FAILURES, "counter", "Draft calls that failed or timed out, by exception type (each turns "
               "its lane's drafts off for draft_backoff_s).", tag_keys=("error",)),
    MetricSpec(REQUESTS_STARTED, "counter", "Requests admitted (an HTTP request, whatever its prompts and n)."),
    MetricSpec(REQUESTS_FINISHED, "counter", "Requests finished, by finish reason (of several choices: error if "
               "the server failed any (a 5xx, or an error event in a stream), else abort if any was aborted "
               "(a client gone), else length if any hit its limit, else stop).", tag_keys=("finish_reason",)),
    MetricSpec(PROMPT_TOKENS, "counter", "Prompt tokens of finished requests (each prompt once, whatever n)."),
    MetricSpec(COMPLETION_TOKENS, "counter", "Completion tokens of finished requests."),
    # gauges
    MetricSpec(ACCEPTANCE_RATE, "gauge", "Draft acceptance rate (accepted / proposed), recent window."),
    MetricSpec(MEAN_ACCEPTED_LENGTH, "gauge",
               "Mean of (accepted + 1) per sequence-round, recent window: tokens per target forward from the "
               "proposer's drafts (a plain round counts 1; lookups inside it: specdec_lookup_*)."),
    MetricSpec(POSITION_ACCEPTANCE, "gauge",
               "Acceptance rate at each draft position (0 = first draft token), recent window.",
               tag_keys=("position",)),
    MetricSpec(NUM_DRAFT_MEAN, "gauge",
               "Mean draft length k over sequence-rounds that speculated, recent window."),
    MetricSpec(QUEUE_WAITING, "gauge", "Sequences waiting for a batch slot."),
    MetricSpec(QUEUE_RUNNING, "gauge", "Sequences in the running batch."),
    MetricSpec(SPECULATION_SEQUENCES, "gauge",
               "Running sequences with speculation on / off (adaptive k = 0 is off).",
               tag_keys=("speculation",)),
    MetricSpec(REQUESTS_IN_FLIGHT, "gauge", "Requests started and not yet finished."),
    # histograms
    MetricSpec(NUM_DRAFT, "histogram", "Draft length k per sequence-round (0 = not speculating).",
               boundaries=_K),
    MetricSpec(BATCH_SIZE, "histogram", "Sequences per round.", boundaries=_BATCH),
    MetricSpec(TTFT, "histogram", "Time to first token, seconds.", boundaries=_SECONDS_TTFT),
    MetricSpec(ITL, "histogram", "Time between consecutive tokens of a sequence, seconds: a round's time over the "
               "tokens it gave the sequence, one observation per sequence and round after its first.",
               boundaries=_SECONDS_FAST),
    MetricSpec(DRAFT_TIME, "histogram", "Draft proposal time per round (rounds with drafts), seconds.",
               boundaries=_SECONDS_FAST),
    MetricSpec(TARGET_TIME, "histogram", "Target verification time per round, seconds.",
               boundaries=_SECONDS_FAST),
    MetricSpec(ROUND_TIME, "histogram", "Wall time of a whole round, seconds.",
               boundaries=_SECONDS_FAST),
)


def prometheus_series(spec: MetricSpec) -> str:
    """The series name Prometheus scrapes for `spec` (what a dashboard query must use)."""
    suffix = {"counter": "_total", "gauge": "", "histogram": "_bucket"}[spec.kind]
    return f"ray_{spec.name}{suffix}"


def _make(spec: MetricSpec):
    # Looked up on the module at call time so tests can monkeypatch ray.serve.metrics.
    if spec.kind == "counter":
        return serve_metrics.Counter(spec.name, description=spec.description,
                                     tag_keys=spec.tag_keys or None)
    if spec.kind == "gauge":
        return serve_metrics.Gauge(spec.name, description=spec.description,
                                   tag_keys=spec.tag_keys or None)
    return serve_metrics.Histogram(spec.name, description=spec.description,
                                   boundaries=list(spec.boundaries), tag_keys=spec.tag_keys or None)


class _RoundWindow:
    """Speculation counts of the rounds in the last `window_s` seconds, with running sums."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self.rounds: deque = deque()  # (t, row_rounds, proposed, accepted, emitted, spec_rows, pos_p, pos_a)
        self.row_rounds = self.proposed = self.accepted = self.emitted = self.spec_rows = 0
        self.pos_proposed: list[int] = []
        self.pos_accepted: list[int] = []

    def add(self, t: float, row_rounds: int, proposed: int, accepted: int, emitted: int,
            spec_rows: int, pos_p: list[int], pos_a: list[int]) -> None:
        self.rounds.append((t, row_rounds, proposed, accepted, emitted, spec_rows, pos_p, pos_a))
        self._apply(row_rounds, proposed, accepted, emitted, spec_rows, pos_p, pos_a, 1)

    def evict(self, now: float) -> None:
        horizon = now - self.window_s
        while self.rounds and self.rounds[0][0] < horizon:
            _, *vals = self.rounds.popleft()
            self._apply(*vals, -1)

    def _apply(self, row_rounds, proposed, accepted, emitted, spec_rows, pos_p, pos_a, sign) -> None:
        self.row_rounds += sign * row_rounds
        self.proposed += sign * proposed
        self.accepted += sign * accepted
        self.emitted += sign * emitted
        self.spec_rows += sign * spec_rows
        if len(self.pos_proposed) < len(pos_p):
            grow = len(pos_p) - len(self.pos_proposed)
            self.pos_proposed.extend([0] * grow)
            self.pos_accepted.extend([0] * grow)
        for j, (p, a) in enumerate(zip(pos_p, pos_a)):
            self.pos_proposed[j] += sign * p
            self.pos_accepted[j] += sign * a


class RouterMetrics:
    """Prometheus metrics of a router replica, plus the router's autoscaling stats.

    Create once per replica (Ray metric objects are registered by name). All `record_*` methods
    are cheap enough for the hot path. `clock` is injectable for tests.
    """

    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._window = _RoundWindow(window_s)
        self._started = clock()
        self._m = {spec.name: _make(spec) for spec in METRICS}
        self._waiting = 0
        self._running = 0
        self._spec_on = 0
        self._spec_off = 0
        self._in_flight = 0
        self._last_acceptance = 0.0
        self._pos_tags: list[dict[str, str]] = []

    # -- hot path ------------------------------------------------------------------------------

    def record_round(self, batch_size: int, num_draft: list[int], num_accepted: list[int],
                     num_emitted: list[int], draft_s: float, target_s: float, round_s: float,
                     lookup_proposed: int = 0, lookup_accepted: int = 0) -> None:
        """One speculative round: per-sequence drafts proposed / accepted / tokens the sequence
        received (0: a row the target did not hold, or whose client left), and the round's
        prompt-lookup tokens (multi-step plain rounds)."""
        if not (len(num_draft) == len(num_accepted) == len(num_emitted)):
            raise ValueError("num_draft, num_accepted and num_emitted must have one entry per sequence")
        m = self._m
        proposed = accepted = emitted = spec_rows = row_rounds = 0
        pos_p: list[int] = []
        pos_a: list[int] = []
        k_hist = m[NUM_DRAFT]
        for d, a, e in zip(num_draft, num_accepted, num_emitted):
            if not e:  # a row the target did not hold, or whose client left: no row-round (as SpecStats)
                continue
            d, a = int(d), min(int(a), int(d))
            proposed += d
            accepted += a
            emitted += int(e)
            n = int(e) if d == 0 and e > 1 else 1  # a multi-step plain row: a row-round per token, as SpecStats
            row_rounds += n
            for _ in range(n):
                k_hist.observe(d)
            if d:
                spec_rows += 1
                if len(pos_p) < d:
                    pos_p.extend([0] * (d - len(pos_p)))
                    pos_a.extend([0] * (d - len(pos_a)))
                for j in range(d):
                    pos_p[j] += 1
                for j in range(a):
                    pos_a[j] += 1
        if emitted > 0:
            m[GENERATED_TOKENS].inc(emitted)
        if proposed > 0:
            m[DRAFT_TOKENS].inc(proposed)
            m[DRAFT_TIME].observe(float(draft_s))
        if accepted > 0:
            m[ACCEPTED_TOKENS].inc(accepted)
        if lookup_proposed > 0:
            m[LOOKUP_TOKENS].inc(int(lookup_proposed))
        if lookup_accepted > 0:
            m[LOOKUP_ACCEPTED_TOKENS].inc(int(lookup_accepted))
        m[BATCH_SIZE].observe(int(batch_size))
        m[TARGET_TIME].observe(float(target_s))
        m[ROUND_TIME].observe(float(round_s))

        now = self._clock()
        w = self._window
        w.add(now, row_rounds, proposed, accepted, emitted, spec_rows, pos_p, pos_a)
        w.evict(now)
        self._publish_window()

    def record_draft_failure(self, error: str) -> None:
        self._m[DRAFT_FAILURES].inc(tags={"error": error})

    def record_queue(self, waiting: int, running: int) -> None:
        self._waiting, self._running = int(waiting), int(running)
        self._m[QUEUE_WAITING].set(self._waiting)
        self._m[QUEUE_RUNNING].set(self._running)

    def record_speculation(self, on: int, off: int) -> None:
        """Running sequences with speculation on (k >= 1) and off (k = 0)."""
        self._spec_on, self._spec_off = int(on), int(off)
        g = self._m[SPECULATION_SEQUENCES]
        g.set(self._spec_on, tags={"speculation": "on"})
        g.set(self._spec_off, tags={"speculation": "off"})

    def record_request_start(self) -> None:
        self._m[REQUESTS_STARTED].inc()
        self._in_flight += 1
        self._m[REQUESTS_IN_FLIGHT].set(self._in_flight)

    def record_first_token(self, ttft_s: float) -> None:
        self._m[TTFT].observe(float(ttft_s))

    def record_inter_token(self, itl_s: float) -> None:
        self._m[ITL].observe(float(itl_s))

    def record_request_end(self, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> None:
        self._m[REQUESTS_FINISHED].inc(tags={"finish_reason": str(finish_reason)})
        if prompt_tokens > 0:
            self._m[PROMPT_TOKENS].inc(int(prompt_tokens))
        if completion_tokens > 0:
            self._m[COMPLETION_TOKENS].inc(int(completion_tokens))
        self._in_flight = max(0, self._in_flight - 1)
        self._m[REQUESTS_IN_FLIGHT].set(self._in_flight)

    # -- derived values ------------------------------------------------------------------------

    def _publish_window(self) -> None:
        w, m = self._window, self._m
        if w.proposed:
            self._last_acceptance = w.accepted / w.proposed
            m[ACCEPTANCE_RATE].set(self._last_acceptance)
        m[NUM_DRAFT_MEAN].set(w.proposed / w.spec_rows if w.spec_rows else 0.0)
        m[MEAN_ACCEPTED_LENGTH].set((w.accepted + w.row_rounds) / w.row_rounds if w.row_rounds else 0.0)
        gauge = m[POSITION_ACCEPTANCE]
        while len(self._pos_tags) < len(w.pos_proposed):
            self._pos_tags.append({"position": str(len(self._pos_tags))})
        for j, tags in enumerate(self._pos_tags):  # every position ever shown: 0 once none is proposed there
            p = w.pos_proposed[j] if j < len(w.pos_proposed) else 0
            gauge.set(w.pos_accepted[j] / p if p else 0.0, tags=tags)

    def _span(self, now: float) -> float:
        return max(1e-9, min(self._window.window_s, now - self._started))

    def window_summary(self) -> dict[str, float]:
        """Recent-window speculation figures (what the gauges show), for logs and tests."""
        now = self._clock()
        w = self._window
        w.evict(now)
        self._publish_window()  # (Serve polls this: an idle router's gauges empty with its window)
        return {
            "acceptance_rate": w.accepted / w.proposed if w.proposed else self._last_acceptance,
            "mean_accepted_length": (w.accepted + w.row_rounds) / w.row_rounds if w.row_rounds else 0.0,
            "per_position_acceptance": [a / p if p else 0.0 for a, p in zip(w.pos_accepted, w.pos_proposed)],
            "tokens_per_s": w.emitted / self._span(now),
            "draft_tokens_per_s": w.proposed / self._span(now),
        }

    def autoscaling_stats(self) -> dict[str, float]:
        """The router's `record_autoscaling_stats()` dict (keys ROUTER_*, all floats)."""
        s = self.window_summary()
        running_total = self._spec_on + self._spec_off
        return {
            ROUTER_ONGOING_REQUESTS: float(self._waiting + self._running),
            ROUTER_QUEUED_REQUESTS: float(self._waiting),
            ROUTER_TOKENS_PER_S: float(s["tokens_per_s"]),
            ROUTER_ACCEPTANCE_RATE: float(s["acceptance_rate"]),
            ROUTER_SPECULATING_FRACTION: self._spec_on / running_total if running_total else 0.0,
            ROUTER_DRAFT_TOKENS_PER_S: float(s["draft_tokens_per_s"]),
        }


class LoadMeter:
    """Tokens/s and busy fraction of one Target or Draft replica over the last `window_s` seconds.

    Call `record(tokens, busy_s)` after each forward pass (tokens emitted / proposed by it, and
    the seconds it took). Rates divide by the window, or by the replica's age while younger.
    """

    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self._clock = clock
        self._started = clock()
        self._events: deque = deque()
        self._tokens = 0
        self._busy = 0.0
        # the model thread records, Serve's autoscaling-stats call reads (another thread)
        self._lock = threading.Lock()

    def record(self, tokens: int, busy_s: float) -> None:
        with self._lock:
            now = self._clock()
            self._events.append((now, int(tokens), float(busy_s)))
            self._tokens += int(tokens)
            self._busy += float(busy_s)
            self._evict(now)

    def _evict(self, now: float) -> None:
        horizon = now - self.window_s
        while self._events and self._events[0][0] < horizon:
            _, t, b = self._events.popleft()
            self._tokens -= t
            self._busy -= b

    def _span(self, now: float) -> float:
        return max(1e-9, min(self.window_s, now - self._started))

    def tokens_per_s(self) -> float:
        with self._lock:
            now = self._clock()
            self._evict(now)
            return self._tokens / self._span(now)

    def busy_fraction(self) -> float:
        with self._lock:
            now = self._clock()
            self._evict(now)
            return min(1.0, max(0.0, self._busy / self._span(now)))
