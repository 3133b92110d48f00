"""Custom Ray Serve autoscaling policies for the Router, Target and Draft deployments.

Each deployment's load becomes *replica-units of demand* (replicas needed at 100 % utilization),
sized for a target utilization with hysteresis:

    units    = max(signal / per-replica capacity, ...)      e.g. tokens/s / target_tokens_per_s
    desired  = ceil(units / target_utilization)
    u        = units / current target replicas
    scale up    when u > upscale_utilization    (at most once per upscale_cooldown_s after a scale-up)
    scale down  when u < downscale_utilization and desired < current, for downscale_delay_s in a row

`desired` leaves u <= target_utilization < upscale_utilization, so a scale-down never lands where
the next tick scales up again. No data holds the current count; results are clamped to the
context's capacity-adjusted min/max.

`RouterPolicy`, `TargetPolicy` and `DraftPolicy` decide one deployment each; `AppPolicy` decides
all three at once (an application-level policy).

Ray 2.60 (ray/serve/_private/autoscaling_state.py) instantiates a policy class once as
`Class(**policy_kwargs)` (any `AutoscalingParams` field) and calls the instance every tick
(~0.1 s): a deployment policy as `policy(ctx) -> (num_replicas, policy_state)`, an application
policy as `policy({id: ctx}) -> ({id: num_replicas}, {id: state})`. Config files name the classes
(`serve_app.autoscaling:AppPolicy`): Ray hands `policy_kwargs` only to a class, and would ignore
them silently beside an instance. Our state lives under "specdec." keys beside Ray's.
Ray's own upscale/downscale delays stack with ours: keep them short. `DEFAULT_PARAMS` reads
`SPECDEC_AUTOSCALING_<FIELD>` once, in the process that pickles the policy (Ray pickles this
module by value).
"""
from __future__ import annotations

import math
import os
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping

from pydantic import BaseModel, ConfigDict, Field, model_validator

from deployments.metrics import (  # noqa: F401  (re-exported: the stats-key contract)
    DRAFT_BUSY_FRACTION, DRAFT_TOKENS_PER_S, ROUTER_ACCEPTANCE_RATE, ROUTER_DRAFT_TOKENS_PER_S, ROUTER_ONGOING_REQUESTS,
    ROUTER_QUEUED_REQUESTS, ROUTER_SPECULATING_FRACTION, ROUTER_TOKENS_PER_S, TARGET_ACTIVE_SEQUENCES,
    TARGET_BUSY_FRACTION, TARGET_TOKENS_PER_S)
from specdec.adaptive import expected_tokens

if TYPE_CHECKING:
    from ray.serve.config import AutoscalingContext

ENV_PREFIX = "SPECDEC_AUTOSCALING_"
_STATE = "specdec."  # prefix of our keys in policy_state (Ray keeps its own keys alongside)


class AutoscalingParams(BaseModel):
    """Capacities, thresholds and names used by every policy in this module."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    target_tokens_per_s: float = Field(
        100.0, gt=0, description="Generated tokens/s one Target replica sustains at full batch, "
        "measured at `reference_acceptance` (e.g. with specdec-bench).")
    target_sequences_per_replica: float = Field(
        16.0, gt=0, description="Concurrent sequences one Target replica serves well (its KV slots "
        "/ max batch); sequences beyond this count as extra load.")
    draft_tokens_per_s: float = Field(400.0, gt=0, description="Draft tokens/s one Draft replica can propose.")
    router_ongoing_per_replica: float = Field(
        32.0, gt=0, description="Running + queued sequences one Router replica handles well.")
    target_utilization: float = Field(
        0.7, gt=0, le=1, description="Utilization that scaling aims for: desired = ceil(units / this).")
    upscale_utilization: float = Field(0.85, gt=0, description="Scale up when load per current replica exceeds this.")
    downscale_utilization: float = Field(
        0.5, ge=0, description="Scale down only when load per current replica is below this ...")
    downscale_delay_s: float = Field(
        60.0, ge=0, description="... continuously for this long (the timer resets when load rises "
        "or the replica count changes).")
    upscale_cooldown_s: float = Field(
        15.0, ge=0, description="Minimum time after an actual scale-up before the next one, so "
        "lagging windowed metrics can reflect the new replicas.")
    scale_on_busy: bool = Field(
        False, description="Also count the sum of replicas' busy_fraction as load. Off by default: "
        "with synchronous rounds a replica is busy whenever any sequence runs, even at batch 1.")
    acceptance_low: float = Field(
        0.2, ge=0, le=1, description="AppPolicy: router acceptance below this marks speculation "
        "collapsed (draft replicas released).")
    acceptance_high: float = Field(0.35, ge=0, le=1, description="AppPolicy: acceptance above this ends a collapse.")
    reference_acceptance: float = Field(
        0.6, ge=0, lt=1, description="Acceptance at which target_tokens_per_s was measured.")
    reference_k: int = Field(4, ge=1, description="Typical draft length, for the expected tokens per target forward.")
    acceptance_aware_capacity: bool = Field(
        True, description="AppPolicy: scale the target's capacity by tokens per forward at the "
        "current acceptance relative to the reference.")
    draft_floor_while_serving: int = Field(
        1, ge=0, description="AppPolicy: draft replicas kept while the router has traffic, even "
        "when speculation collapsed, so probing rounds can detect recovery.")
    router_deployment: str = Field("Router", description="Router deployment name (AppPolicy).")
    target_deployment: str = Field("Target", description="Target deployment name (AppPolicy).")
    draft_deployment: str = Field("Draft", description="Draft deployment name (AppPolicy).")

    @model_validator(mode="after")
    def _ordered(self) -> "AutoscalingParams":
        if not self.downscale_utilization < self.target_utilization < self.upscale_utilization:
            raise ValueError("need downscale_utilization < target_utilization < upscale_utilization")
        if not self.acceptance_low <= self.acceptance_high:
            raise ValueError("need acceptance_low <= acceptance_high")
        return self

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> "AutoscalingParams":
        """Defaults, overridden by SPECDEC_AUTOSCALING_<FIELD> env vars, then by `overrides`."""
        env = os.environ if environ is None else environ
        values = {name: env[key] for name in cls.model_fields if env.get(key := ENV_PREFIX + name.upper())}
        return cls(**{**values, **overrides})


DEFAULT_PARAMS = AutoscalingParams.from_env()


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------

def _metric(ctx: "AutoscalingContext", key: str) -> list[float] | None:
    """Per-replica values of a custom stat, or None when no running replica reported it."""
    per_replica = (ctx.aggregated_metrics or {}).get(key)
    return [float(v) for v in per_replica.values()] if per_replica else None


def _sum(ctx: "AutoscalingContext", key: str) -> float | None:
    vals = _metric(ctx, key)
    return None if vals is None else sum(vals)


def _clamp(n: int, ctx: "AutoscalingContext") -> int:
    return max(ctx.capacity_adjusted_min_replicas, min(ctx.capacity_adjusted_max_replicas, int(n)))


def expected_tokens_per_forward(acceptance: float, k: int, speculating_fraction: float = 1.0) -> float:
    """E[tokens per sequence per target forward]: (1 - a^(k+1)) / (1 - a) when speculating, else 1."""
    e = expected_tokens(min(max(acceptance, 0.0), 1.0), k)
    f = min(max(speculating_fraction, 0.0), 1.0)
    return f * e + (1.0 - f)


def decide(ctx: "AutoscalingContext", units: float | None, p: AutoscalingParams,
           state: dict[str, Any], key: str, floor: int = 0) -> int:
    """The hysteresis step shared by all policies (see module docstring); mutates `state`.

    `units` is the load in replica-units (None: no data -> hold). `key` namespaces the timers in
    `state`; `floor` is a lower bound on the desired count (before min/max clamping).
    """
    base = ctx.target_num_replicas
    low_since_k, low_base_k = f"{_STATE}{key}.low_since", f"{_STATE}{key}.low_base"
    now = ctx.current_time if ctx.current_time is not None else time.time()
    if units is None:  # no data: hold (the downscale timer too), but never below the floor
        return _clamp(max(base, floor), ctx)
    units = max(0.0, units)
    desired = max(math.ceil(units / p.target_utilization - 1e-9), floor)
    if base > 0 and desired < base and units / base < p.downscale_utilization:
        if state.get(low_since_k) is None or state.get(low_base_k) != base:  # low from now on
            state[low_since_k], state[low_base_k] = now, base
        return _clamp(desired if now - state[low_since_k] >= p.downscale_delay_s else base, ctx)
    state.pop(low_since_k, None)
    if base <= 0:  # scaling from zero: no hysteresis
        return _clamp(desired, ctx)
    if desired > base and (units / base > p.upscale_utilization or floor > base):
        cooling = ctx.last_scale_up_time is not None and now - ctx.last_scale_up_time < p.upscale_cooldown_s
        return _clamp(base if cooling else desired, ctx)
    return _clamp(base, ctx)


def _max_units(*units: float | None) -> float | None:
    known = [u for u in units if u is not None]
    return max(known) if known else None


def _router_units(ctx: "AutoscalingContext", p: AutoscalingParams) -> float | None:
    ongoing = _sum(ctx, ROUTER_ONGOING_REQUESTS)
    if ongoing is None:  # no custom stats yet: Serve's own count of ongoing requests
        ongoing = ctx.total_num_requests
    return None if ongoing is None else ongoing / p.router_ongoing_per_replica


def _target_units(ctx: "AutoscalingContext", p: AutoscalingParams, extra_sequences: float = 0.0,
                  tokens_per_s: float | None = None, capacity_scale: float = 1.0) -> float | None:
    tps = _max_units(_sum(ctx, TARGET_TOKENS_PER_S), tokens_per_s)  # (the routers' rate arrives as tokens_per_s)
    active = _sum(ctx, TARGET_ACTIVE_SEQUENCES)
    seqs = None
    if active is not None or extra_sequences:  # (the routers' queues arrive as extra_sequences)
        seqs = max(active or 0.0, extra_sequences)
    busy = _sum(ctx, TARGET_BUSY_FRACTION) if p.scale_on_busy else None
    return _max_units(None if tps is None else tps / (p.target_tokens_per_s * capacity_scale),
                      None if seqs is None else seqs / p.target_sequences_per_replica, busy)


def _draft_units(ctx: "AutoscalingContext", p: AutoscalingParams,
                 requested_tokens_per_s: float | None = None) -> float | None:
    tps = _max_units(_sum(ctx, DRAFT_TOKENS_PER_S), requested_tokens_per_s)
    busy = _sum(ctx, DRAFT_BUSY_FRACTION) if p.scale_on_busy else None
    return _max_units(None if tps is None else tps / p.draft_tokens_per_s, busy)


# ---------------------------------------------------------------------------------------------
# policies: Ray instantiates Class(**policy_kwargs) once and calls the instance every tick
# ---------------------------------------------------------------------------------------------

class _Policy:
    def __init__(self, **policy_kwargs: Any):
        self.params = (AutoscalingParams(**{**DEFAULT_PARAMS.model_dump(), **policy_kwargs})
                       if policy_kwargs else DEFAULT_PARAMS)


class _DeploymentPolicy(_Policy):
    """One deployment's policy: `units(ctx, params)` is its load in replica-units; `key`
    namespaces its timers in policy_state."""

    key: str
    units: Callable[["AutoscalingContext", AutoscalingParams], float | None]
    serves_requests = True  # never 0 replicas while requests are in flight (stats lag ~10 s behind them)

    def __call__(self, ctx: "AutoscalingContext") -> tuple[int, dict]:
        state = dict(ctx.policy_state or {})
        floor = 1 if self.serves_requests and (ctx.total_num_requests or 0) > 0 else 0
        return decide(ctx, self.units(ctx, self.params), self.params, state, self.key, floor=floor), state


class RouterPolicy(_DeploymentPolicy):
    """Router: ongoing (running + queued) sequences per replica vs router_ongoing_per_replica."""

    key, units = "router", staticmethod(_router_units)


class TargetPolicy(_DeploymentPolicy):
    """Target: generated tokens/s vs target_tokens_per_s and active sequences vs slots."""

    key, units = "target", staticmethod(_target_units)


class DraftPolicy(_DeploymentPolicy):
    """Draft: proposed tokens/s vs draft_tokens_per_s. When acceptance collapses the router's
    adaptive scheduler stops drafting, demand falls and draft replicas are released; they return
    with acceptance."""

    key, units = "draft", staticmethod(_draft_units)
    serves_requests = False  # lanes run plain rounds without drafts


def _weighted_mean(values: list[float] | None, weights: list[float] | None) -> float | None:
    if not values:
        return None
    if weights and len(weights) == len(values) and sum(weights) > 0:
        return sum(v * w for v, w in zip(values, weights)) / sum(weights)
    return sum(values) / len(values)


class AppPolicy(_Policy):
    """One decision for Router, Target and Draft from the router's queue and acceptance: the
    target's capacity scales with the tokens one forward yields at the router's current
    acceptance, the router's *requested* draft tokens/s sizes the draft, and acceptance below
    `acceptance_low` (until above `acceptance_high`) keeps drafts at `draft_floor_while_serving`.

    Deployments are recognized by name (params.*_deployment); others are left out of the
    decisions (Ray then keeps their replica count and state).
    """

    def __call__(self, contexts: dict[Any, "AutoscalingContext"]) -> tuple[dict[Any, int], dict[Any, dict]]:
        p = self.params
        by_name = {ctx.deployment_name: (dep_id, ctx) for dep_id, ctx in contexts.items()}
        states = {dep_id: dict(ctx.policy_state or {}) for dep_id, ctx in contexts.items()}
        decisions: dict[Any, int] = {}

        r_id, r_ctx = by_name.get(p.router_deployment, (None, None))
        ongoing = r_tps = acceptance = spec_frac = draft_req = None
        collapsed = False
        if r_ctx is not None:
            ongoing = _sum(r_ctx, ROUTER_ONGOING_REQUESTS)
            r_tps = _sum(r_ctx, ROUTER_TOKENS_PER_S)
            draft_req = _sum(r_ctx, ROUTER_DRAFT_TOKENS_PER_S)
            acceptance = _weighted_mean(_metric(r_ctx, ROUTER_ACCEPTANCE_RATE),
                                        _metric(r_ctx, ROUTER_DRAFT_TOKENS_PER_S))
            spec_frac = _weighted_mean(_metric(r_ctx, ROUTER_SPECULATING_FRACTION),
                                       _metric(r_ctx, ROUTER_ONGOING_REQUESTS))
            decisions[r_id] = decide(r_ctx, _router_units(r_ctx, p), p, states[r_id], "router",
                                     floor=1 if (r_ctx.total_num_requests or 0) > 0 else 0)
            # Speculation collapse, with hysteresis; judged only while drafts are being requested.
            collapsed = bool(states[r_id].get(f"{_STATE}acceptance_collapsed", False))
            if acceptance is not None and (draft_req or 0.0) > 0:
                collapsed = acceptance < p.acceptance_low or (collapsed and acceptance <= p.acceptance_high)
            states[r_id][f"{_STATE}acceptance_collapsed"] = collapsed

        serving = (ongoing or 0.0) > 0 or (r_ctx is not None and (r_ctx.total_num_requests or 0) > 0)
        t_id, t_ctx = by_name.get(p.target_deployment, (None, None))
        if t_ctx is not None:
            scale = states[t_id].get(f"{_STATE}capacity_scale", 1.0)  # (a tick without the router's stats keeps it)
            if p.acceptance_aware_capacity and acceptance is not None and spec_frac is not None:
                scale = (expected_tokens_per_forward(acceptance, p.reference_k, spec_frac)
                         / expected_tokens_per_forward(p.reference_acceptance, p.reference_k, 1.0))
                states[t_id][f"{_STATE}capacity_scale"] = scale
            units = _target_units(t_ctx, p, extra_sequences=ongoing or 0.0, tokens_per_s=r_tps,
                                  capacity_scale=scale)
            busy = serving or (t_ctx.total_num_requests or 0) > 0  # (stats lag ~10 s behind requests)
            decisions[t_id] = decide(t_ctx, units, p, states[t_id], "target", floor=1 if busy else 0)

        d_id, d_ctx = by_name.get(p.draft_deployment, (None, None))
        if d_ctx is not None:
            floor = min(p.draft_floor_while_serving, d_ctx.capacity_adjusted_max_replicas) if serving else 0
            units = 0.0 if collapsed else _draft_units(d_ctx, p, requested_tokens_per_s=draft_req)
            decisions[d_id] = decide(d_ctx, units, p, states[d_id], "draft", floor=floor)

        return decisions, states


# ---------------------------------------------------------------------------------------------
# config helpers for the builder
# ---------------------------------------------------------------------------------------------

_ROLES = {"router": RouterPolicy, "target": TargetPolicy, "draft": DraftPolicy}


def autoscaling_config(role: str, *, min_replicas: int = 1, max_replicas: int = 1,
                       policy_kwargs: dict[str, Any] | None = None, **overrides: Any):
    """A Ray `AutoscalingConfig` running this module's policy class for a deployment role or name
    (Router/Target/Draft, any case) with `policy_kwargs` (AutoscalingParams fields, checked now).

    Ray's own upscale/downscale delays default to small values here because the policies keep
    their own cooldown and downscale delay; any AutoscalingConfig field can be overridden.
    """
    from ray.serve.config import AutoscalingConfig, AutoscalingPolicy

    cls = _ROLES.get(role.lower())
    if cls is None:
        raise ValueError(f"no autoscaling policy for deployment {role!r}")
    cls(**(policy_kwargs or {}))  # fail early on typos
    policy = AutoscalingPolicy(policy_function=f"{__name__}:{cls.__name__}", policy_kwargs=policy_kwargs or {})
    fields = {"min_replicas": min_replicas, "max_replicas": max_replicas, "upscale_delay_s": 2.0,
              "downscale_delay_s": 5.0, **overrides}
    return AutoscalingConfig(policy=policy, **fields)
