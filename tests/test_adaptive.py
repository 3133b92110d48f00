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
