"""RouterMetrics / LoadMeter with ray.serve.metrics replaced by strict fakes, and the Grafana
dashboard checked against the metric definitions. No Ray cluster."""
from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest

from deployments import metrics as M

DASHBOARD = Path(__file__).resolve().parents[1] / "serve_app" / "grafana" / "specdec_dashboard.json"


class FakeMetric:
    """Mimics ray.util.metrics validation: tag keys must be declared and all given, values str,
    counters only go up by > 0, histograms need positive boundaries."""

    registry: dict[str, "FakeMetric"] = {}

    def __init__(self, name, description="", tag_keys=None, boundaries=None):
        assert tag_keys is None or isinstance(tag_keys, tuple)
        self.name, self.description, self.tag_keys = name, description, tag_keys or ()
        self.records: list[tuple[float, dict]] = []
        FakeMetric.registry[name] = self

    def _record(self, value, tags):
        assert isinstance(value, (int, float)) and not isinstance(value, bool), (self.name, value)
        tags = dict(tags or {})
        assert set(tags) == set(self.tag_keys), (self.name, tags, self.tag_keys)
        assert all(isinstance(v, str) for v in tags.values())
        self.records.append((value, tags))

    # helpers for assertions
    def last(self, **tags) -> float:
        matching = [v for v, t in self.records if t == tags]
        assert matching, (self.name, tags)
        return matching[-1]

    def total(self, **tags) -> float:
        return sum(v for v, t in self.records if all(t.get(k) == x for k, x in tags.items()))

    def values(self) -> list[float]:
        return [v for v, _ in self.records]


class FakeCounter(FakeMetric):
    def inc(self, value=1.0, tags=None):
        if value <= 0:
            raise ValueError(f"value must be >0, got {value}")
        self._record(value, tags)


class FakeGauge(FakeMetric):
    def set(self, value, tags=None):
        self._record(value, tags)


class FakeHistogram(FakeMetric):
    def __init__(self, name, description="", boundaries=None, tag_keys=None):
        assert boundaries and all(b > 0 for b in boundaries) and list(boundaries) == sorted(boundaries)
        super().__init__(name, description, tag_keys)
        self.boundaries = boundaries

    def observe(self, value, tags=None):
        self._record(value, tags)


class Clock:
    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def fakes(monkeypatch):
    import ray.serve.metrics as serve_metrics

    FakeMetric.registry = {}
    monkeypatch.setattr(serve_metrics, "Counter", FakeCounter)
    monkeypatch.setattr(serve_metrics, "Gauge", FakeGauge)
    monkeypatch.setattr(serve_metrics, "Histogram", FakeHistogram)
    return FakeMetric.registry


def test_every_metric_is_created_once_with_its_kind(fakes):
    M.RouterMetrics()
    assert set(fakes) == {s.name for s in M.METRICS}
    kinds = {"counter": FakeCounter, "gauge": FakeGauge, "histogram": FakeHistogram}
    for spec in M.METRICS:
        assert type(fakes[spec.name]) is kinds[spec.kind] and spec.name.startswith("specdec_")
        assert fakes[spec.name].tag_keys == spec.tag_keys


def test_record_round_counts_and_gauges(fakes):
    rm = M.RouterMetrics(clock=Clock())
    rm.record_round(batch_size=3, num_draft=[4, 4, 0], num_accepted=[2, 4, 0], num_emitted=[3, 5, 1],
                    draft_s=0.004, target_s=0.02, round_s=0.03)
    f = fakes
    assert f[M.GENERATED_TOKENS].total() == 9
    assert f[M.DRAFT_TOKENS].total() == 8 and f[M.ACCEPTED_TOKENS].total() == 6
    assert f[M.ACCEPTANCE_RATE].last() == pytest.approx(6 / 8)
    assert f[M.MEAN_ACCEPTED_LENGTH].last() == pytest.approx((3 + 5 + 1) / 3)  # mean(accepted + 1)
    positions = {j: f[M.POSITION_ACCEPTANCE].last(position=str(j)) for j in range(4)}
    assert positions == {0: 1.0, 1: 1.0, 2: 0.5, 3: 0.5}
    assert f[M.NUM_DRAFT_MEAN].last() == 4.0
    assert sorted(f[M.NUM_DRAFT].values()) == [0, 4, 4]
    assert f[M.BATCH_SIZE].values() == [3]
    assert f[M.DRAFT_TIME].values() == [0.004] and f[M.TARGET_TIME].values() == [0.02]
    assert f[M.ROUND_TIME].values() == [0.03]


def test_lookup_tokens_are_counted_apart_from_drafts(fakes):
    """A multi-step plain round with prompt lookup: its lookups go to their own counters and
    leave the draft counters and the acceptance rate alone."""
    rm = M.RouterMetrics(clock=Clock())
    rm.record_round(1, [0], [0], [12], draft_s=0.0, target_s=0.1, round_s=0.1, lookup_proposed=9,
                    lookup_accepted=4)
    assert fakes[M.LOOKUP_TOKENS].total() == 9 and fakes[M.LOOKUP_ACCEPTED_TOKENS].total() == 4
    assert fakes[M.GENERATED_TOKENS].total() == 12 and fakes[M.DRAFT_TOKENS].records == []
    rm.record_round(1, [0], [0], [1], 0.0, 0.01, 0.01)
    assert fakes[M.LOOKUP_TOKENS].total() == 9  # no zero increments


def test_round_without_drafts_records_no_zero_increments(fakes):
    rm = M.RouterMetrics(clock=Clock())
    rm.record_round(2, [0, 0], [0, 0], [0, 0], draft_s=0.0, target_s=0.01, round_s=0.012)
    assert fakes[M.GENERATED_TOKENS].records == [] and fakes[M.DRAFT_TOKENS].records == []
    assert fakes[M.DRAFT_TIME].records == []  # draft time only for rounds that drafted
    assert fakes[M.MEAN_ACCEPTED_LENGTH].last() == 0.0  # (rows that got no token are no row-rounds: no data)
    with pytest.raises(ValueError):
        rm.record_round(2, [1], [0, 0], [1, 1], 0.0, 0.0, 0.0)


def test_window_forgets_old_rounds(fakes):
    clock = Clock()
    rm = M.RouterMetrics(window_s=10.0, clock=clock)
    rm.record_round(1, [4], [4], [5], 0.01, 0.02, 0.03)
    assert fakes[M.ACCEPTANCE_RATE].last() == 1.0
    clock.t += 5
    rm.record_round(1, [4], [0], [1], 0.01, 0.02, 0.03)
    assert fakes[M.ACCEPTANCE_RATE].last() == 0.5
    clock.t += 6  # the first round is now older than the window
    rm.record_round(1, [2], [0], [1], 0.01, 0.02, 0.03)
    assert fakes[M.ACCEPTANCE_RATE].last() == 0.0
    assert fakes[M.POSITION_ACCEPTANCE].last(position="0") == 0.0
    assert rm.window_summary()["per_position_acceptance"] == [0.0, 0.0, 0.0, 0.0]


def test_queue_speculation_and_request_lifecycle(fakes):
    rm = M.RouterMetrics(clock=Clock())
    rm.record_queue(waiting=5, running=8)
    rm.record_speculation(on=6, off=2)
    rm.record_request_start()
    rm.record_request_start()
    rm.record_first_token(0.12)
    rm.record_inter_token(0.03)
    rm.record_request_end("stop", prompt_tokens=11, completion_tokens=20)
    rm.record_request_end("length", prompt_tokens=0, completion_tokens=0)
    rm.record_request_end("abort", prompt_tokens=3, completion_tokens=1)  # more ends than starts
    f = fakes
    assert f[M.QUEUE_WAITING].last() == 5 and f[M.QUEUE_RUNNING].last() == 8
    assert f[M.SPECULATION_SEQUENCES].last(speculation="on") == 6
    assert f[M.SPECULATION_SEQUENCES].last(speculation="off") == 2
    assert f[M.REQUESTS_STARTED].total() == 2
    assert {r: f[M.REQUESTS_FINISHED].total(finish_reason=r) for r in ("stop", "length", "abort")} == {
        "stop": 1, "length": 1, "abort": 1}
    assert f[M.PROMPT_TOKENS].total() == 14 and f[M.COMPLETION_TOKENS].total() == 21
    assert f[M.REQUESTS_IN_FLIGHT].values() == [1, 2, 1, 0, 0]
    assert f[M.TTFT].values() == [0.12] and f[M.ITL].values() == [0.03]


def test_router_autoscaling_stats(fakes):
    clock = Clock()
    rm = M.RouterMetrics(window_s=10.0, clock=clock)
    assert set(rm.autoscaling_stats()) == set(M.ROUTER_STATS_KEYS)
    rm.record_queue(waiting=3, running=4)
    rm.record_speculation(on=3, off=1)
    clock.t += 2
    rm.record_round(4, [4, 4, 2, 0], [1, 3, 2, 0], [2, 4, 3, 1], 0.01, 0.02, 0.04)
    clock.t += 2
    stats = rm.autoscaling_stats()
    assert all(isinstance(v, float) for v in stats.values())
    assert stats[M.ROUTER_ONGOING_REQUESTS] == 7 and stats[M.ROUTER_QUEUED_REQUESTS] == 3
    assert stats[M.ROUTER_TOKENS_PER_S] == pytest.approx(10 / 4)  # 4 s old replica
    assert stats[M.ROUTER_DRAFT_TOKENS_PER_S] == pytest.approx(10 / 4)
    assert stats[M.ROUTER_ACCEPTANCE_RATE] == pytest.approx(6 / 10)
    assert stats[M.ROUTER_SPECULATING_FRACTION] == 0.75
    clock.t += 60  # window empty: rates fall to 0, acceptance keeps its last known value
    stats = rm.autoscaling_stats()
    assert stats[M.ROUTER_TOKENS_PER_S] == 0.0 and stats[M.ROUTER_ACCEPTANCE_RATE] == pytest.approx(0.6)


def test_load_meter():
    clock = Clock()
    meter = M.LoadMeter(window_s=10.0, clock=clock)
    clock.t += 2
    meter.record(tokens=20, busy_s=0.5)
    clock.t += 2
    meter.record(tokens=20, busy_s=1.5)
    assert meter.tokens_per_s() == pytest.approx(40 / 4) and meter.busy_fraction() == pytest.approx(0.5)
    clock.t += 9  # the first record left the window
    assert meter.tokens_per_s() == pytest.approx(20 / 10) and meter.busy_fraction() == pytest.approx(0.15)
    clock.t += 20
    assert meter.tokens_per_s() == 0.0 and meter.busy_fraction() == 0.0


def test_window_gauges_fall_back_when_their_rounds_leave_the_window(fakes):
    clock = Clock()
    rm = M.RouterMetrics(window_s=10.0, clock=clock)
    rm.record_round(1, [4], [4], [5], 0.01, 0.02, 0.03)
    clock.t += 60
    rm.record_round(1, [0], [0], [1], 0.01, 0.02, 0.03)  # speculation off since
    assert fakes[M.NUM_DRAFT_MEAN].last() == 0.0
    assert fakes[M.POSITION_ACCEPTANCE].last(position="3") == 0.0  # not 1.0 from a minute ago


def test_load_meter_is_safe_across_threads():
    """The model thread records while Serve's thread pool reads the autoscaling stats: the running
    sums must stay those of the window's events (a race left phantom tokens/s for good)."""
    import sys
    import threading
    import time
    meter = M.LoadMeter(window_s=0.0005)
    stop = time.monotonic() + 1.0
    errors = []

    def run(fn):
        try:
            while time.monotonic() < stop:
                fn()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often, as a busy replica would
    try:
        threads = [threading.Thread(target=run, args=(lambda: meter.record(3, 0.001),)),
                   threading.Thread(target=run, args=(lambda: (meter.tokens_per_s(), meter.busy_fraction()),))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    time.sleep(0.01)
    assert not errors and meter.tokens_per_s() == 0.0 and meter._tokens == 0


def test_real_ray_metric_classes_accept_every_definition():
    # No cluster: Ray's metric objects still validate names, tags and boundaries locally.
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an invalid name is only a warning in Ray
        rm = M.RouterMetrics()
    rm.record_round(2, [3, 0], [1, 0], [2, 1], 0.01, 0.02, 0.03)
    rm.record_queue(1, 2)
    rm.record_speculation(1, 1)
    rm.record_request_start()
    rm.record_first_token(0.1)
    rm.record_inter_token(0.01)
    rm.record_request_end("stop", 5, 6)


# --- dashboard ------------------------------------------------------------------------------------

def test_dashboard_covers_every_metric():
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    text = "\n".join(exprs)
    tokens = set(re.findall(r"\bray_specdec_[a-z0-9_]+", text))
    for spec in M.METRICS:
        assert M.prometheus_series(spec) in tokens, f"{spec.name} has no panel"
    # and no query refers to a series that does not exist
    valid = set()
    for spec in M.METRICS:
        base = f"ray_{spec.name}"
        valid |= {"counter": {base + "_total"}, "gauge": {base},
                  "histogram": {base + "_bucket", base + "_sum", base + "_count"}}[spec.kind]
    assert tokens <= valid, tokens - valid
    assert "ray_serve_deployment_replica_healthy" in text


def test_dashboard_is_importable_grafana_json():
    dash = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert dash["uid"] and dash["title"] and dash.get("id") is None
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        assert {"h", "w", "x", "y"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        if p["type"] != "row":
            assert p["datasource"] == "${datasource}" and p["targets"]
            for t in p["targets"]:
                assert t["datasource"] == "${datasource}" and t["expr"].count("(") == t["expr"].count(")")
                assert t["expr"].count("{") == t["expr"].count("}")


@pytest.mark.asyncio
async def test_request_metrics_count_requests_not_choices(fakes, tiny_dir):
    """One request of n = 4 choices of a 3-token prompt is one request and 3 prompt tokens (as
    its usage says), and the queue gauges drop to 0 when its lane closes."""
    import asyncio

    import torch
    from deployments.batcher import Batcher
    from fake_handles import FakeTarget
    from specdec.loader import load_model
    from specdec.sampling import SamplingParams
    from specdec.target_worker import TargetWorker

    worker = TargetWorker(load_model(tiny_dir, dtype=torch.float32), 4, 128)

    b = Batcher({"tokenizer": str(tiny_dir), "speculate": False, "max_model_len": 128, "batch_wait_timeout_s": 0},
                None, FakeTarget(worker))
    seqs = b.submit([[5, 6, 7]], [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (2, 3, 4, 5)])
    for s in seqs:
        while not s.finished:
            await b.wait(s)
        b.finish(s)
    for _ in range(100):
        if not b.lanes:
            break
        await asyncio.sleep(0.02)
    assert fakes[M.REQUESTS_STARTED].total() == 1
    assert fakes[M.REQUESTS_FINISHED].total(finish_reason="length") == 1
    assert fakes[M.PROMPT_TOKENS].total() == 3 and fakes[M.COMPLETION_TOKENS].total() == 14
    assert fakes[M.REQUESTS_IN_FLIGHT].last() == 0
    assert fakes[M.QUEUE_RUNNING].last() == 0 and fakes[M.QUEUE_WAITING].last() == 0


@pytest.mark.asyncio
async def test_drafts_of_rows_the_target_did_not_verify_are_not_counted_as_rejected(fakes, tiny_dir):
    """Three rows, a target with one KV slot: two rows come back `unknown` each round, their
    drafts never judged. A draft equal to the target is always accepted, so the metrics'
    acceptance must be 1, as the engine's own statistics say."""
    import torch
    from deployments.batcher import Batcher
    from fake_handles import FakeDraft, FakeTarget
    from specdec.loader import load_model
    from specdec.proposers.draft_model import DraftModelProposer
    from specdec.sampling import SamplingParams
    from specdec.target_worker import TargetWorker

    worker = TargetWorker(load_model(tiny_dir, dtype=torch.float32), 1, 128)
    draft = DraftModelProposer(load_model(tiny_dir, dtype=torch.float32), 3, 128)
    b = Batcher({"tokenizer": str(tiny_dir), "speculate": True, "max_model_len": 128, "batch_wait_timeout_s": 0,
                 "adaptive": False, "num_speculative_tokens": 3, "max_batch_size": 3, "max_lanes": 1,
                 "max_request_share": 1.0}, FakeDraft(draft), FakeTarget(worker))
    seqs = b.submit([[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15]],
                    [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)] * 3)
    for s in seqs:
        while not s.finished:
            await b.wait(s)
        b.finish(s)
    assert b.resyncs["target"] > 0  # rows did come back unverified
    assert b.stats.proposed > 0 and b.stats.accepted == b.stats.proposed
    assert fakes[M.DRAFT_TOKENS].total() == fakes[M.ACCEPTED_TOKENS].total() == b.stats.proposed
    # nor booked as plain row-rounds (the gauge read 2.5 beside /stats' 4.0; k = 0 observed for each)
    assert fakes[M.MEAN_ACCEPTED_LENGTH].last() == pytest.approx(b.stats.mean_accepted_length) == pytest.approx(4.0)
    assert 0 not in fakes[M.NUM_DRAFT].values()


@pytest.mark.asyncio
async def test_metrics_count_what_sequences_received(fakes, tiny_dir):
    """A stop inside the first round's accepted run: one TTFT and no ITL for the sequence, and the
    generated-tokens counter counts its 2 tokens, not the round's 4 (the tokens past the stop);
    rows admitted to a lane and not yet in a round count as running."""
    import torch
    from deployments.batcher import Batcher
    from fake_handles import FakeDraft, FakeTarget
    from specdec.loader import load_model
    from specdec.proposers.draft_model import DraftModelProposer
    from specdec.sampling import SamplingParams
    from specdec.target_worker import TargetWorker

    worker = TargetWorker(load_model(tiny_dir, dtype=torch.float32), 4, 128)
    draft = DraftModelProposer(load_model(tiny_dir, dtype=torch.float32), 4, 128)  # = the target: all accepted
    b = Batcher({"tokenizer": str(tiny_dir), "speculate": True, "max_model_len": 128, "batch_wait_timeout_s": 0,
                 "adaptive": False, "num_speculative_tokens": 3, "max_lanes": 1}, FakeDraft(draft), FakeTarget(worker))
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    [ref] = b.submit([[9, 10, 11, 12]], [greedy])
    assert b.record_autoscaling_stats()[M.ROUTER_ONGOING_REQUESTS] == 1  # admitted into its lane, before any round
    assert fakes[M.QUEUE_RUNNING].last() == 1
    while not ref.finished:
        await b.wait(ref)
    b.finish(ref)
    for m in (M.TTFT, M.ITL, M.GENERATED_TOKENS):
        fakes[m].records.clear()
    [s] = b.submit([[9, 10, 11, 12]], [SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[ref.output_ids[1]])])
    while not s.finished:
        await b.wait(s)
    b.finish(s)
    assert s.num_output == 2 and s.rounds == 1
    assert len(fakes[M.TTFT].records) == 1 and not fakes[M.ITL].records
    assert fakes[M.GENERATED_TOKENS].total() == 2


def test_a_multi_step_plain_row_counts_a_row_round_per_token_as_spec_stats_does(fakes):
    """A plain round of 8 steps yields 8 tokens in 8 forwards: mean accepted length 1 for it, as in
    /stats (SpecStats), not 8 tokens booked as one forward's, which overstated the gauge beside
    speculative rounds."""
    from specdec.stats import SpecStats
    rm, stats = M.RouterMetrics(clock=Clock()), SpecStats()
    rm.record_round(2, [3, 0], [2, 0], [3, 8], 0.004, 0.02, 0.03)
    stats.observe_row(3, 2, 3)
    for _ in range(8):
        stats.observe_row(0, 0, 1)  # (Scheduler.commit books a multi-step row so)
    assert fakes[M.MEAN_ACCEPTED_LENGTH].last() == pytest.approx(stats.mean_accepted_length) == pytest.approx(11 / 9)
    assert sorted(fakes[M.NUM_DRAFT].values()) == [0] * 8 + [3]


def test_window_gauges_empty_when_the_router_goes_idle(fakes):
    """Serve polls the autoscaling stats: an idle router's window empties, and its gauges with it
    (they kept the last busy window's values for as long as no round came)."""
    clock = Clock()
    rm = M.RouterMetrics(window_s=10.0, clock=clock)
    rm.record_round(1, [4], [4], [5], 0.01, 0.02, 0.03)
    assert fakes[M.MEAN_ACCEPTED_LENGTH].last() == 5.0
    clock.t += 3600
    rm.autoscaling_stats()
    assert fakes[M.MEAN_ACCEPTED_LENGTH].last() == 0.0 and fakes[M.NUM_DRAFT_MEAN].last() == 0.0
    assert fakes[M.POSITION_ACCEPTANCE].last(position="0") == 0.0


@pytest.mark.asyncio
async def test_rows_of_a_lane_whose_drafts_are_down_do_not_count_as_speculating(fakes, tiny_dir):
    """While the Draft replicas fail (the lane backs off draft_backoff_s) rows plan k > 0 but draft
    nothing: the speculating fraction AppPolicy sizes the Target by must say 0, not ~1."""
    import asyncio

    import torch

    from deployments.batcher import Batcher
    from fake_handles import FakeTarget, Method
    from specdec.loader import load_model
    from specdec.sampling import SamplingParams
    from specdec.target_worker import TargetWorker

    class DeadDraft:
        def __init__(self):
            async def fail(*a, **kw):
                raise ConnectionError("draft replica unavailable")
            self.propose, self.release = Method(fail), Method(fail)

        def options(self, **_):
            return self

    worker = TargetWorker(load_model(tiny_dir, dtype=torch.float32), 4, 128)
    b = Batcher({"tokenizer": str(tiny_dir), "speculate": True, "max_model_len": 128, "batch_wait_timeout_s": 0,
                 "adaptive": True, "num_speculative_tokens": 4, "max_batch_size": 4, "max_lanes": 1,
                 "draft_backoff_s": 60.0}, DeadDraft(), FakeTarget(worker))
    seqs = b.submit([[5, 6, 7, 8], [9, 10, 11]], [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)])
    fractions = []
    while not all(s.finished for s in seqs):
        await asyncio.sleep(0.01)
        if b.lanes and b.lanes[0].scheduler.running:
            fractions.append(b.record_autoscaling_stats()[M.ROUTER_SPECULATING_FRACTION])
    for s in seqs:
        b.finish(s)
    assert b.stats.proposed == 0 and b.draft_failures and fractions and max(fractions) == 0.0


@pytest.mark.asyncio
async def test_a_request_the_server_failed_is_finished_as_error_not_abort(fakes, tiny_dir):
    """A client that hung up and a request the server failed (5xx) read apart in specdec_requests."""
    import asyncio

    import torch

    from deployments.batcher import Batcher, RequestFailed
    from fake_handles import FakeTarget
    from specdec.loader import load_model
    from specdec.sampling import SamplingParams
    from specdec.target_worker import TargetWorker

    target = FakeTarget(TargetWorker(load_model(tiny_dir, dtype=torch.float32), 4, 128), fail_from=1)
    b = Batcher({"tokenizer": str(tiny_dir), "speculate": False, "max_model_len": 128, "batch_wait_timeout_s": 0},
                None, target)
    (s,) = b.submit([[5, 6, 7]], [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)])
    with pytest.raises(RequestFailed):
        while not s.finished:
            await b.wait(s)
    b.finish(s)
    assert fakes[M.REQUESTS_FINISHED].total(finish_reason="error") == 1
    assert fakes[M.REQUESTS_FINISHED].total(finish_reason="abort") == 0
    await asyncio.sleep(0)



def test_mean_draft_length_gauge_forgets_old_rounds(fakes):
    """Rounds that leave the window leave the mean draft length too (their rows stayed in the divisor)."""
    from deployments import metrics as M
    clock = Clock()
    rm = M.RouterMetrics(window_s=10.0, clock=clock)
    rm.record_round(1, [2], [1], [2], 0.01, 0.01, 0.02)
    clock.t += 20
    rm.record_round(1, [4], [1], [2], 0.01, 0.01, 0.02)
    assert fakes[M.NUM_DRAFT_MEAN].last() == 4.0


def test_rates_stay_in_their_ranges_whatever_is_reported(fakes):
    """A verify that reports more accepted than drafted (a bug elsewhere, or a row the target
    drafted itself) never lifts acceptance above 1, and a replica whose forwards overlap the window
    edge is never more than fully busy (the autoscaler reads both)."""
    from deployments import metrics as M
    clock = Clock()
    rm = M.RouterMetrics(window_s=10.0, clock=clock)
    rm.record_round(1, [2], [3], [4], 0.01, 0.01, 0.02)
    assert rm.window_summary()["acceptance_rate"] == 1.0
    meter = M.LoadMeter(window_s=10.0, clock=clock)
    clock.t += 1
    meter.record(5, 3.0)  # 3 s of forwards reported 1 s after the replica started
    assert meter.busy_fraction() == 1.0


def test_position_gauges_fall_to_zero_once_no_draft_reaches_them(fakes):
    """A position that recent rounds no longer draft shows 0, not its old acceptance."""
    from deployments import metrics as M
    clock = Clock()
    rm = M.RouterMetrics(window_s=10.0, clock=clock)
    rm.record_round(1, [3], [3], [4], 0.01, 0.01, 0.02)
    assert fakes[M.POSITION_ACCEPTANCE].last(position="2") == 1.0
    clock.t += 20
    rm.record_round(1, [1], [1], [2], 0.01, 0.01, 0.02)
    assert fakes[M.POSITION_ACCEPTANCE].last(position="2") == 0.0
    assert fakes[M.POSITION_ACCEPTANCE].last(position="0") == 1.0
