"""Autoscaling policies driven with real Ray 2.60 AutoscalingContext objects (no cluster).

`Sim` plays the Serve controller: it builds a context per tick, calls the policy, applies the
decision at once and carries policy_state and last_scale_up_time forward as Ray does.
"""
from __future__ import annotations

import inspect
import math
import pickle

import pytest
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.config import AutoscalingConfig, AutoscalingContext, AutoscalingPolicy

from serve_app import autoscaling as A

P = A.AutoscalingParams(target_tokens_per_s=100.0, draft_tokens_per_s=400.0,
                        target_sequences_per_replica=16, router_ongoing_per_replica=32,
                        downscale_delay_s=60.0, upscale_cooldown_s=15.0)
T0 = 1_000_000.0


def make_ctx(name: str, *, replicas: int, target: int | None = None, totals: dict | None = None,
             means: dict | None = None, min_replicas: int = 1, max_replicas: int = 10,
             state: dict | None = None, now: float = T0, last_up: float | None = None,
             total_requests: float = 0.0, app: str = "specdec",
             ray_config: dict | None = None) -> AutoscalingContext:
    """totals are split evenly over the replicas (rates, counts); means are reported as-is."""
    dep = DeploymentID(name=name, app_name=app)
    rids = [ReplicaID(unique_id=f"{name}-{i}", deployment_id=dep) for i in range(replicas)]
    agg: dict = {}
    for key, total in (totals or {}).items():
        agg[key] = {r: total / replicas for r in rids}
    for key, mean in (means or {}).items():
        agg[key] = {r: mean for r in rids}
    return AutoscalingContext(
        deployment_id=dep, deployment_name=name, app_name=app,
        current_num_replicas=replicas,
        target_num_replicas=replicas if target is None else target,
        running_replicas=rids, total_num_requests=total_requests, total_queued_requests=0.0,
        aggregated_metrics=agg, raw_metrics={},
        capacity_adjusted_min_replicas=min_replicas, capacity_adjusted_max_replicas=max_replicas,
        policy_state=dict(state or {}), last_scale_up_time=last_up, last_scale_down_time=None,
        current_time=now,
        config=AutoscalingConfig(min_replicas=min_replicas, max_replicas=max_replicas, **(ray_config or {})),
    )


class Sim:
    """One deployment under a deployment-level policy."""

    def __init__(self, policy_cls, name: str, replicas: int = 1, **bounds):
        self.policy, self.name, self.replicas, self.bounds = policy_cls(**P.model_dump()), name, replicas, bounds
        self.state: dict = {}
        self.last_up: float | None = None
        self.history: list[int] = []

    def step(self, now: float, totals: dict | None = None, means: dict | None = None, **kw) -> int:
        ctx = make_ctx(self.name, replicas=self.replicas, totals=totals, means=means, state=self.state,
                       now=now, last_up=self.last_up, **self.bounds, **kw)
        n, self.state = self.policy(ctx)
        assert isinstance(n, int) and isinstance(self.state, dict)
        if n > self.replicas:
            self.last_up = now
        self.replicas = n
        self.history.append(n)
        return n


def changes(history: list[int]) -> int:
    return sum(1 for a, b in zip(history, history[1:]) if a != b)


# ------------------------------------------------------------------------------------------------

def test_target_load_rising_scales_up():
    sim = Sim(A.TargetPolicy, "Target", replicas=1)
    t = T0
    for tps in (50, 90, 200, 400, 600):
        for _ in range(3):  # a few ticks per level, 20 s apart (past the upscale cooldown)
            sim.step(t, totals={A.TARGET_TOKENS_PER_S: tps})
            t += 20
    assert sim.history == sorted(sim.history), "never scales down while load rises"
    assert sim.history[0] == 1  # 50 tok/s on one replica: u = 0.5, hold
    assert sim.replicas == math.ceil(600 / 100 / P.target_utilization)  # 9


def test_upscale_cooldown_after_real_scale_up():
    sim = Sim(A.TargetPolicy, "Target", replicas=1)
    assert sim.step(T0, totals={A.TARGET_TOKENS_PER_S: 150}) == 3
    # metrics still lag: even more load, but within the cooldown -> hold
    assert sim.step(T0 + 5, totals={A.TARGET_TOKENS_PER_S: 400}) == 3
    assert sim.step(T0 + 16, totals={A.TARGET_TOKENS_PER_S: 400}) == 6


def test_load_falling_returns_to_min_after_delay():
    sim = Sim(A.TargetPolicy, "Target", replicas=5, min_replicas=1)
    t = T0
    for _ in range(11):  # 0..50 s of idle: still inside the 60 s downscale delay
        assert sim.step(t, totals={A.TARGET_TOKENS_PER_S: 0.0, A.TARGET_ACTIVE_SEQUENCES: 0}) == 5
        t += 5
    t = T0 + 60
    assert sim.step(t, totals={A.TARGET_TOKENS_PER_S: 0.0, A.TARGET_ACTIVE_SEQUENCES: 0}) == 1


def test_downscale_timer_resets_when_load_returns():
    sim = Sim(A.TargetPolicy, "Target", replicas=4)
    sim.step(T0, totals={A.TARGET_TOKENS_PER_S: 50})  # low: timer starts
    sim.step(T0 + 50, totals={A.TARGET_TOKENS_PER_S: 300})  # back in band: timer resets
    assert sim.step(T0 + 70, totals={A.TARGET_TOKENS_PER_S: 50}) == 4  # 20 s low, not 60
    assert sim.step(T0 + 130, totals={A.TARGET_TOKENS_PER_S: 50}) == 1


def test_target_scales_on_sequences():
    sim = Sim(A.TargetPolicy, "Target", replicas=1)
    n = sim.step(T0, totals={A.TARGET_TOKENS_PER_S: 10, A.TARGET_ACTIVE_SEQUENCES: 32})
    assert n == math.ceil(32 / 16 / P.target_utilization)  # 3


def test_router_policy_ongoing_requests_and_builtin_fallback():
    sim = Sim(A.RouterPolicy, "Router", replicas=1)
    assert sim.step(T0, totals={A.ROUTER_ONGOING_REQUESTS: 20}) == 1  # u = 0.62: in band
    assert sim.step(T0 + 1, totals={A.ROUTER_ONGOING_REQUESTS: 64}) == 3
    # before any custom stats arrive, Serve's own ongoing-request count is used
    ctx = make_ctx("Router", replicas=1, total_requests=64.0)
    assert A.RouterPolicy(**P.model_dump())(ctx)[0] == 3


def test_draft_released_when_acceptance_collapses_and_returns_on_recovery():
    # Deployment-level: the router's adaptive k turns speculation down, so proposals/s fall.
    sim = Sim(A.DraftPolicy, "Draft", replicas=1, min_replicas=1)
    t = T0
    sim.step(t, totals={A.DRAFT_TOKENS_PER_S: 1200})  # healthy speculation: 1200 / 400 / 0.7
    assert sim.replicas == 5
    for _ in range(13):  # acceptance collapses -> only probe rounds propose
        t += 5
        sim.step(t, totals={A.DRAFT_TOKENS_PER_S: 20})
    assert sim.replicas == 1
    t += 30
    sim.step(t, totals={A.DRAFT_TOKENS_PER_S: 1200})  # acceptance recovered
    assert sim.replicas == 5


def test_flapping_near_a_threshold_does_not_oscillate():
    # around the upscale threshold (0.85 of 100 tok/s on one replica)
    sim = Sim(A.TargetPolicy, "Target", replicas=1)
    for i in range(200):
        sim.step(T0 + 5 * i, totals={A.TARGET_TOKENS_PER_S: 95 if i % 2 else 80})
    assert changes(sim.history) <= 1
    # around the downscale threshold (0.5 per replica on two replicas), for 20 minutes
    sim = Sim(A.TargetPolicy, "Target", replicas=2)
    for i in range(240):
        sim.step(T0 + 5 * i, totals={A.TARGET_TOKENS_PER_S: 60 if i % 2 else 110})
    assert changes(sim.history) == 0


def test_clamped_to_min_and_max():
    ctx = make_ctx("Target", replicas=2, totals={A.TARGET_TOKENS_PER_S: 10_000}, max_replicas=4)
    assert A.TargetPolicy(**P.model_dump())(ctx)[0] == 4
    ctx = make_ctx("Target", replicas=3, totals={A.TARGET_TOKENS_PER_S: 0}, min_replicas=2,
                   state={"specdec.target.low_since": T0 - 1000, "specdec.target.low_base": 3})
    assert A.TargetPolicy(**P.model_dump())(ctx)[0] == 2
    # bounds moved under the current count (e.g. target_capacity): clamp at once
    ctx = make_ctx("Target", replicas=6, totals={A.TARGET_TOKENS_PER_S: 420}, max_replicas=3)
    assert A.TargetPolicy(**P.model_dump())(ctx)[0] == 3
    ctx = make_ctx("Draft", replicas=0, min_replicas=1)  # no data, below min
    assert A.DraftPolicy(**P.model_dump())(ctx)[0] == 1


def test_missing_metrics_hold_current_count():
    ctx = make_ctx("Target", replicas=3)  # replicas have not reported yet
    n, state = A.TargetPolicy(**P.model_dump())(ctx)
    assert n == 3 and state == {}


def test_policy_state_preserves_foreign_keys():
    ctx = make_ctx("Target", replicas=2, totals={A.TARGET_TOKENS_PER_S: 40},
                   state={"__ray_internal": 7})
    _, state = A.TargetPolicy(**P.model_dump())(ctx)
    assert state["__ray_internal"] == 7 and "specdec.target.low_since" in state


def test_no_zero_replicas_while_requests_are_in_flight():
    """With min_replicas 0, the first tick of new traffic still sees the idle stats (replicas push
    them every ~10 s): requests in flight keep one Target and one Router. (Ray holds a replica
    while its own downscale delay runs; the policy's timer had run out, and the first busy tick
    answered 0.)"""
    for policy, name, key in ((A.TargetPolicy, "Target", A.TARGET_TOKENS_PER_S),
                              (A.RouterPolicy, "Router", A.ROUTER_ONGOING_REQUESTS)):
        pol, state = policy(**P.model_dump()), {}
        for i in range(20):  # idle, Ray still holding the replica
            n, state = pol(make_ctx(name, replicas=1, min_replicas=0, totals={key: 0.0}, state=state, now=T0 + 5 * i))
        assert n == 0  # what the policy asks for an idle deployment
        n, state = pol(make_ctx(name, replicas=1, min_replicas=0, totals={key: 0.0}, state=state, now=T0 + 100,
                                total_requests=6))
        assert n == 1, name
    pol, state = A.DraftPolicy(**P.model_dump()), {}  # a Draft may go: lanes run plain rounds without drafts
    for i in range(20):
        n, state = pol(make_ctx("Draft", replicas=1, min_replicas=0, totals={A.DRAFT_TOKENS_PER_S: 0.0},
                                state=state, now=T0 + 5 * i, total_requests=3))
    assert n == 0


def test_app_policy_keeps_a_target_while_requests_are_in_flight():
    sim = AppSim(target=1)
    sim.bounds["Target"] = {"min_replicas": 0}
    for i in range(20):
        sim.step(T0 + 5 * i, router_stats(ongoing=0, tps=0, draft_tps=0))
        sim.n["Target"] = 1  # Ray still holding it
    sim.step(T0 + 100, router_stats(ongoing=0, tps=0, draft_tps=0), router_requests=5)  # all stats stale
    assert sim.n["Target"] == 1 and sim.n["Router"] >= 1


# --- application level ----------------------------------------------------------------------------

class AppSim:
    """Router + Target + Draft under app_policy."""

    def __init__(self, router=1, target=1, draft=1, params=P, draft_min=1):
        self.n = {"Router": router, "Target": target, "Draft": draft}
        self.bounds = {name: {} for name in self.n}
        self.bounds["Draft"] = {"min_replicas": draft_min}
        self.state = {name: {} for name in self.n}
        self.last_up: dict = {name: None for name in self.n}
        self.params = params
        self.history: list[dict] = []

    def step(self, now: float, router: tuple[dict, dict], target: dict | None = None,
             draft: dict | None = None, router_requests: float = 0.0):
        router, router_means = router
        ctxs = {
            "Router": make_ctx("Router", replicas=self.n["Router"], totals=router, means=router_means,
                               state=self.state["Router"], now=now, last_up=self.last_up["Router"],
                               total_requests=router_requests, **self.bounds["Router"]),
            "Target": make_ctx("Target", replicas=self.n["Target"], totals=target,
                               state=self.state["Target"], now=now, last_up=self.last_up["Target"],
                               **self.bounds["Target"]),
            "Draft": make_ctx("Draft", replicas=self.n["Draft"], totals=draft,
                              state=self.state["Draft"], now=now, last_up=self.last_up["Draft"],
                              **self.bounds["Draft"]),
        }
        contexts = {c.deployment_id: c for c in ctxs.values()}
        decisions, states = A.AppPolicy(**self.params.model_dump())(contexts)
        for name, c in ctxs.items():
            n = decisions[c.deployment_id]
            if n > self.n[name]:
                self.last_up[name] = now
            self.n[name] = n
            self.state[name] = states[c.deployment_id]
        self.history.append(dict(self.n))
        return decisions, states


def router_stats(ongoing=8.0, queued=0.0, tps=100.0, acceptance=0.6, spec=1.0, draft_tps=400.0):
    totals = {A.ROUTER_ONGOING_REQUESTS: ongoing, A.ROUTER_QUEUED_REQUESTS: queued,
              A.ROUTER_TOKENS_PER_S: tps, A.ROUTER_DRAFT_TOKENS_PER_S: draft_tps}
    means = {A.ROUTER_ACCEPTANCE_RATE: acceptance, A.ROUTER_SPECULATING_FRACTION: spec}
    return totals, means


def test_app_policy_decides_all_three_keyed_by_deployment_id():
    sim = AppSim()
    decisions, states = sim.step(T0, router_stats(ongoing=80, queued=40, tps=300, draft_tps=1000),
                                 {A.TARGET_TOKENS_PER_S: 300}, {A.DRAFT_TOKENS_PER_S: 900})
    assert {d.name for d in decisions} == {"Router", "Target", "Draft"}
    assert all(isinstance(d, DeploymentID) for d in decisions) and set(states) == set(decisions)
    assert decisions[DeploymentID("Router", "specdec")] == math.ceil(80 / 32 / 0.7)  # 4
    # the router's 80 sequences (40 queued) need ceil(80 / 16 / 0.7) target replicas
    assert decisions[DeploymentID("Target", "specdec")] == 8
    assert decisions[DeploymentID("Draft", "specdec")] == math.ceil(1000 / 400 / 0.7)  # 4


def test_app_policy_ignores_unknown_deployments():
    ctx = make_ctx("Tokenizer", replicas=2)
    decisions, states = A.AppPolicy(**P.model_dump())({ctx.deployment_id: ctx})
    assert decisions == {} and set(states) == {ctx.deployment_id}


def test_app_policy_acceptance_collapse_releases_drafts_then_recovery_returns_them():
    sim = AppSim(draft=1)
    t = T0
    healthy = router_stats(ongoing=8, tps=150, acceptance=0.6, draft_tps=1200)
    sim.step(t, healthy)
    assert sim.n["Draft"] == 5
    # acceptance collapses; the windowed draft demand still lags high, but drafts are released
    collapsed = router_stats(ongoing=8, tps=60, acceptance=0.1, spec=0.1, draft_tps=900)
    for _ in range(13):
        t += 5
        sim.step(t, collapsed)
    assert sim.n["Draft"] == P.draft_floor_while_serving == 1
    assert sim.state["Router"]["specdec.acceptance_collapsed"] is True
    # mid-band acceptance does not end the collapse (hysteresis) ...
    t += 20
    sim.step(t, router_stats(ongoing=8, tps=80, acceptance=0.3, spec=0.3, draft_tps=900))
    assert sim.n["Draft"] == 1
    # ... acceptance above acceptance_high does
    t += 20
    sim.step(t, healthy)
    assert sim.n["Draft"] == 5 and sim.state["Router"]["specdec.acceptance_collapsed"] is False


def test_app_policy_acceptance_flapping_does_not_oscillate_drafts():
    sim = AppSim(draft=3)
    for i in range(240):
        a = 0.18 if i % 2 else 0.3  # straddles acceptance_low only
        sim.step(T0 + 5 * i, router_stats(ongoing=8, tps=100, acceptance=a, spec=0.5, draft_tps=800))
    assert changes([h["Draft"] for h in sim.history]) <= 1


def test_app_policy_low_acceptance_needs_more_target_capacity():
    def target_after(acceptance, spec):
        sim = AppSim(target=2)
        sim.step(T0, router_stats(ongoing=4, tps=180, acceptance=acceptance, spec=spec))
        return sim.n["Target"]
    assert target_after(0.6, 1.0) == 3  # 180 / 100 / 0.7
    assert target_after(0.05, 0.0) > 3  # no speculation: ~2.3x fewer tokens per target forward


def test_app_policy_draft_floor_only_while_serving():
    sim = AppSim(draft=2, draft_min=0)
    for i in range(20):  # idle app: drafts go to 0 after the delay
        sim.step(T0 + 5 * i, router_stats(ongoing=0, tps=0, acceptance=0.1, spec=0, draft_tps=0))
    assert sim.n["Draft"] == 0
    sim.step(T0 + 200, router_stats(ongoing=3, tps=10, acceptance=0.1, spec=0, draft_tps=0))
    assert sim.n["Draft"] == 1  # traffic again: floor of one draft for probing


# --- Ray 2.60 integration (config validation, class policies, Ray's wrappers) ----------------------

def test_autoscaling_config_accepts_policy_import_paths():
    cfg = AutoscalingConfig(policy=AutoscalingPolicy(policy_function="serve_app.autoscaling:TargetPolicy"))
    assert cfg.policy.policy_function == "serve_app.autoscaling:TargetPolicy"
    assert not cfg.policy.is_default_policy_function()
    policy = cfg.policy.get_policy()(**cfg.policy.policy_kwargs)  # cloudpickled by value, as the controller receives it
    ctx = make_ctx("Target", replicas=1, totals={A.TARGET_TOKENS_PER_S: 1000}, max_replicas=3)
    assert policy(ctx)[0] == 3


def test_class_policy_receives_policy_kwargs():
    from ray.serve._private.autoscaling_state import _resolve_policy_callable

    cfg = A.autoscaling_config("target", min_replicas=1, max_replicas=8,
                               policy_kwargs={"target_tokens_per_s": 50.0})
    assert cfg.policy.policy_function == "serve_app.autoscaling:TargetPolicy"
    policy = _resolve_policy_callable(cfg.policy)  # what Ray does: Class(**policy_kwargs) once
    assert policy.params.target_tokens_per_s == 50.0
    ctx = make_ctx("Target", replicas=1, totals={A.TARGET_TOKENS_PER_S: 100})
    assert policy(ctx)[0] == 3  # 100 / 50 / 0.7
    with pytest.raises(Exception):
        A.TargetPolicy(no_such_knob=1)


def test_autoscaling_config_for_deployment_names():
    for name, cls in (("Router", "RouterPolicy"), ("Target", "TargetPolicy"), ("draft", "DraftPolicy")):
        policy = A.autoscaling_config(name, max_replicas=4).policy
        assert policy.policy_function == f"serve_app.autoscaling:{cls}"
        assert AutoscalingConfig(min_replicas=1, max_replicas=4, policy=policy).policy == policy
    cfg = A.autoscaling_config("Target", policy_kwargs={"target_tokens_per_s": 9.0})
    assert cfg.policy.policy_kwargs == {"target_tokens_per_s": 9.0}
    with pytest.raises(ValueError):
        A.autoscaling_config("Tokenizer")
    with pytest.raises(ValueError):  # typo caught when building the app
        A.autoscaling_config("Target", policy_kwargs={"target_tokens_per_sec": 9.0})
    with pytest.raises(ValueError):  # Ray builds AppPolicy(**policy_kwargs): a typo fails there too
        A.AppPolicy(target_tokens_per_sec=9.0)


def test_app_level_policy_in_serve_config_schema():
    """serve_config.yaml's application-level policy, with kwargs, as Serve's controller builds it."""
    import pathlib

    import yaml
    from ray.serve.schema import ServeDeploySchema

    cfg = yaml.safe_load((pathlib.Path(__file__).parents[1] / "serve_config.yaml").read_text())
    (app_cfg,) = cfg["applications"]
    app_cfg["autoscaling_policy"] = {**app_cfg["autoscaling_policy"], "policy_kwargs": {"target_tokens_per_s": 120.0}}
    declared = ServeDeploySchema.model_validate(cfg).applications[0].autoscaling_policy
    assert declared["policy_function"] == "serve_app.autoscaling:AppPolicy"
    policy = AutoscalingPolicy(**declared)  # what the controller builds from the config
    instance = policy.get_policy()(**policy.policy_kwargs)  # Ray: a class gets the kwargs
    assert isinstance(instance, A.AppPolicy) and instance.params.target_tokens_per_s == 120.0
    for d in cfg["applications"][0]["deployments"]:  # classes too, so that policy_kwargs would apply
        assert inspect.isclass(AutoscalingConfig(**d["autoscaling_config"]).policy.get_policy()), d["name"]


def test_policies_compose_with_rays_wrappers(monkeypatch):
    import types

    import ray.serve.autoscaling_policy as ray_policy
    from ray.serve.autoscaling_policy import (
        _apply_app_level_autoscaling_config,
        _apply_autoscaling_config,
    )

    clock = [T0]
    monkeypatch.setattr(ray_policy, "time", types.SimpleNamespace(time=lambda: clock[0]))

    # Ray's own upscale_delay_s (30 s) stacks on top: our decision must stay consistent meanwhile.
    wrapped = _apply_autoscaling_config(A.TargetPolicy(**P.model_dump()))
    state: dict = {}
    seen = []
    for i in range(0, 36, 2):
        clock[0] = T0 + i
        ctx = make_ctx("Target", replicas=1, totals={A.TARGET_TOKENS_PER_S: 300}, state=state,
                       now=clock[0], ray_config={"upscale_delay_s": 30.0})
        n, state = wrapped(ctx)
        seen.append(n)
        if n > 1:
            break
    assert seen[0] == 1 and seen[-1] == 5 and len(seen) == 16  # at t = 30 s

    app = _apply_app_level_autoscaling_config(A.AppPolicy(**P.model_dump()))
    ctxs = [make_ctx(name, replicas=1, totals=totals, means=means)
            for name, (totals, means) in {"Router": router_stats(ongoing=40), "Target": ({}, {}),
                                          "Draft": ({}, {})}.items()]
    decisions, states = app({c.deployment_id: c for c in ctxs})
    assert set(decisions) == set(states) == {c.deployment_id for c in ctxs}


def test_params_from_env_and_validation():
    p = A.AutoscalingParams.from_env({"SPECDEC_AUTOSCALING_TARGET_TOKENS_PER_S": "55",
                                      "SPECDEC_AUTOSCALING_SCALE_ON_BUSY": "true"})
    assert p.target_tokens_per_s == 55.0 and p.scale_on_busy is True
    with pytest.raises(ValueError):
        A.AutoscalingParams(downscale_utilization=0.9)
    assert pickle.loads(pickle.dumps(p)) == p


def test_expected_tokens_per_forward():
    assert A.expected_tokens_per_forward(0.0, 4) == 1.0
    assert A.expected_tokens_per_forward(1.0, 4) == 5.0
    assert A.expected_tokens_per_forward(0.6, 4, speculating_fraction=0.0) == 1.0
    assert abs(A.expected_tokens_per_forward(0.6, 4) - (1 - 0.6 ** 5) / 0.4) < 1e-12


def test_a_tick_without_stats_holds_the_count_and_the_downscale_timer():
    """No data holds the current count: it neither restarts the downscale delay (one missing tick
    moved the first scale-down from 65 s to 95 s) nor drops a floor."""
    def first_scale_down(gap_at: float | None) -> float:
        sim = Sim(A.TargetPolicy, "Target", replicas=4)
        for i in range(40):
            t = T0 + 2.5 * i
            sim.step(t, totals=None if gap_at == 2.5 * i else {A.TARGET_TOKENS_PER_S: 50})
            if sim.replicas < 4:
                return 2.5 * i
        return math.inf
    assert first_scale_down(None) == first_scale_down(30.0) < math.inf
    ctx = make_ctx("Target", replicas=0, min_replicas=0, now=T0)  # no stats yet, requests in flight
    assert A.decide(ctx, None, P, {}, "target", floor=1) == 1


def test_app_policy_keeps_the_targets_capacity_scale_through_a_router_stats_gap():
    """The Target's capacity scales with the router's acceptance; a tick without the router's stats
    keeps the last scale (falling back to 1 scaled the Target up at unchanged load)."""
    sim = AppSim(router=3, target=6, draft=3)
    stats = router_stats(ongoing=60, tps=600, acceptance=0.9, spec=1.0, draft_tps=1200)
    for i in range(40):
        sim.step(T0 + 2 * i, stats, target={A.TARGET_TOKENS_PER_S: 600})
    settled = sim.n["Target"]
    for i in range(40, 45):  # the router's stats missing for 10 s
        sim.step(T0 + 2 * i, ({}, {}), target={A.TARGET_TOKENS_PER_S: 600})
    assert sim.n["Target"] == settled



def test_acceptance_between_low_and_high_does_not_start_a_collapse():
    """Hysteresis: from a healthy state, acceptance between acceptance_low and acceptance_high is no
    collapse, so Draft replicas follow demand (only a collapse releases them)."""
    from serve_app import autoscaling as A
    router = make_ctx("Router", replicas=1, totals={A.ROUTER_ONGOING_REQUESTS: 4, A.ROUTER_DRAFT_TOKENS_PER_S: 1200.0},
                      means={A.ROUTER_ACCEPTANCE_RATE: 0.3, A.ROUTER_SPECULATING_FRACTION: 1.0}, now=T0,
                      total_requests=4)
    draft = make_ctx("Draft", replicas=1, totals={A.DRAFT_TOKENS_PER_S: 1200.0}, now=T0)
    decisions, states = A.AppPolicy()({router.deployment_id: router, draft.deployment_id: draft})
    assert not states[router.deployment_id]["specdec.acceptance_collapsed"]
    assert decisions[draft.deployment_id] == 5  # 1200 / 400 / 0.7 -> 5


def test_each_downscale_waits_the_whole_delay():
    """After a scale-down the delay starts again: a load that keeps falling steps down one delay at
    a time (the timer of the first step let the second follow at once)."""
    sim = Sim(A.TargetPolicy, "Target", replicas=4, min_replicas=1)
    tps = 1.05 * P.target_tokens_per_s  # 1.05 units: 2 replicas at the target utilization
    assert sim.step(T0, totals={A.TARGET_TOKENS_PER_S: tps}) == 4
    assert sim.step(T0 + P.downscale_delay_s, totals={A.TARGET_TOKENS_PER_S: tps}) == 2
    assert sim.step(T0 + P.downscale_delay_s + 5, totals={A.TARGET_TOKENS_PER_S: 0.0}) == 2
    assert sim.step(T0 + 2 * P.downscale_delay_s + 5, totals={A.TARGET_TOKENS_PER_S: 0.0}) == 1


def test_the_draft_floor_while_serving_raises_the_draft_count():
    """draft_floor_while_serving above the current Draft count scales it up even at low load."""
    router = make_ctx("Router", replicas=1, totals={A.ROUTER_ONGOING_REQUESTS: 1, A.ROUTER_DRAFT_TOKENS_PER_S: 10.0},
                      means={A.ROUTER_ACCEPTANCE_RATE: 0.6, A.ROUTER_SPECULATING_FRACTION: 1.0}, now=T0,
                      total_requests=1)
    draft = make_ctx("Draft", replicas=1, totals={A.DRAFT_TOKENS_PER_S: 10.0}, now=T0)
    decisions, _ = A.AppPolicy(draft_floor_while_serving=2)({router.deployment_id: router, draft.deployment_id: draft})
    assert decisions[draft.deployment_id] == 2


def test_collapse_is_judged_only_while_drafts_are_requested():
    """With no draft tokens requested the router's acceptance is stale: the collapse state stays
    as it was, either way."""
    from serve_app import autoscaling as A
    for before, acceptance in ((False, 0.05), (True, 0.9)):
        router = make_ctx("Router", replicas=1, totals={A.ROUTER_ONGOING_REQUESTS: 1, A.ROUTER_DRAFT_TOKENS_PER_S: 0.0},
                          means={A.ROUTER_ACCEPTANCE_RATE: acceptance, A.ROUTER_SPECULATING_FRACTION: 0.0}, now=T0,
                          total_requests=1, state={"specdec.acceptance_collapsed": before})
        _, states = A.AppPolicy()({router.deployment_id: router})
        assert states[router.deployment_id]["specdec.acceptance_collapsed"] is before
