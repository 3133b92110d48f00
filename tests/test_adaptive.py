"""Adaptive k: acceptance estimates, batch-size-aware costs, switching off and probing."""
from specdec.adaptive import AdaptiveConfig, AdaptiveK, CostModel, expected_tokens, speedup_bound


def test_expected_tokens_and_bound():
    assert expected_tokens(0.0, 4) == 1.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-9
    assert abs(speedup_bound(0.5, 2, 0.1) - 1.75 / 1.2) < 1e-9


def test_verify_cost_depends_on_batch_size():
    cost = CostModel()
    for _ in range(5):
        cost.observe(0, 0.0, 0, 0.060, batch=1)
        cost.observe(2, 0.0, 0, 0.070, batch=1)  # memory-bound: verifying 3 positions is cheap
        cost.observe(0, 0.0, 0, 0.075, batch=8)
        cost.observe(2, 0.0, 0, 0.150, batch=8)  # compute-bound: 24 positions cost double
    assert abs(cost.verify_cost(2, 1) - 70 / 60) < 1e-6
    assert abs(cost.verify_cost(4, 8) - 3.0) < 1e-6  # interpolated linearly from K=2
    ak = AdaptiveK(AdaptiveConfig(k_max=4, prior_acceptance=0.3))
    assert ak.choose(cost, has_model=False, batch=1) > 0  # n-gram at batch 1: worth it
    assert ak.choose(cost, has_model=False, batch=8) == 0  # at batch 8: not worth it


def test_plain_round_recalibration():
    cost = CostModel(recalibrate_every=3)
    assert cost.needs_plain_round(4)
    cost.observe(0, 0.0, 0, 0.05, batch=4)
    assert not cost.needs_plain_round(4)
    for _ in range(3):
        cost.observe(2, 0.0, 0, 0.06, batch=4)
    assert cost.needs_plain_round(4)


def test_speculation_switches_off_and_probes():
    cfg = AdaptiveConfig(k_max=4, prior_acceptance=0.6, probe_interval=4)
    ak, cost = AdaptiveK(cfg), CostModel(prior_c=0.2)
    assert ak.choose(cost) > 0
    for _ in range(10):  # every draft rejected
        k = ak.choose(cost)
        ak.update(k, k, 0)
    assert ak.acceptance < 0.35  # it stopped proposing once speculation no longer paid
    ks = []
    for _ in range(8):
        k = ak.choose(cost)
        ks.append(k)
        ak.update(k, k, 0)
    assert ks.count(0) >= 6 and any(k > 0 for k in ks)  # mostly off, with periodic probes


# ---- the scheduler's use of the policy: mixed batches, live k_max ------------------------------
import torch  # noqa: E402

from specdec.metadata import DraftOutput, VerifyOutput  # noqa: E402
from specdec.sampling import SamplingParams  # noqa: E402
from specdec.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from specdec.sequence import Sequence  # noqa: E402


def _run_rounds(sched: Scheduler, rounds: int, step_s: float = 0.05) -> list[dict[int, int]]:
    """Simulate rounds in which every draft is accepted; a round costs step_s * (1 + 0.05 K).
    Returns each round's k per sequence id."""
    history = []
    for _ in range(rounds):
        plan = sched.plan()
        if plan is None:
            break
        ks = plan.draft_batch.num_draft
        draft = DraftOutput(torch.full((len(ks), max(ks, default=0)), 7), list(ks), draft_steps=max(ks, default=0))
        sched.target_batch(plan, draft)  # as the engine does (marks prefill rounds)
        verify = VerifyOutput([[7] * (k + 1) for k in ks], list(ks))
        t = step_s * (1 + 0.05 * max(ks, default=0))
        sched.commit(plan, draft, verify, 0.002 * max(ks, default=0), t, t)
        history.append(dict(zip(plan.draft_batch.seq_ids, ks)))
    return history


def _seq(**params) -> Sequence:
    return Sequence([1, 2, 3], SamplingParams(**{"max_tokens": 10_000, "ignore_eos": True, **params}))


def test_pinned_row_does_not_starve_adaptive_rows():
    """A seeded sampled row (k independent of timings) or a request's fixed k shares the batch:
    calibration must not keep every adaptive row at k = 0 while it runs."""
    for pinned in ({"temperature": 1.0, "seed": 3}, {"temperature": 0, "num_speculative_tokens": 2}):
        sched = Scheduler(SchedulerConfig(max_batch_size=4, k_max=4))
        free, pin = sched.add(_seq(temperature=0)), sched.add(_seq(**pinned))
        ks = [h[free.seq_id] for h in _run_rounds(sched, 30)]
        assert sum(k > 0 for k in ks[5:]) >= 20, (pinned, ks)  # at 100% acceptance it speculates
        assert pin.num_output > 0


def test_calibration_waits_for_a_round_without_prefill():
    """Calibration rounds are measured only without a prefill; new sequences arriving every round
    must neither block calibration forever nor keep the others at k = 0."""
    sched = Scheduler(SchedulerConfig(max_batch_size=64, k_max=4))
    first = sched.add(_seq(temperature=0))
    _run_rounds(sched, 1)
    ks = []
    for _ in range(30):
        sched.add(_seq(temperature=0, max_tokens=4))  # a prefill in every round (batch stays 2-3)
        ks.append(_run_rounds(sched, 1)[0][first.seq_id])
    assert sum(k > 0 for k in ks[3:]) >= 20, ks


def test_lowering_k_max_applies_to_running_sequences():
    sched = Scheduler(SchedulerConfig(max_batch_size=2, k_max=4))
    seq = sched.add(_seq(temperature=0))
    assert max(h[seq.seq_id] for h in _run_rounds(sched, 10)) > 1
    sched.set_config(SchedulerConfig(max_batch_size=2, k_max=1))
    assert max(h[seq.seq_id] for h in _run_rounds(sched, 10)) == 1
    late = sched.add(_seq(temperature=0))
    assert sched.adaptive_cfg.k_max == 1 and late.adaptive.cfg.k_max == 1
