"""`build_app(args) -> Application`: the three deployments wired together (Ray Serve LLM style:
a builder, not module-level decorators).

    Router (ingress, OpenAI API, batching, speculative rounds)
      |-- Draft   (proposer replicas; KV-cache affinity by a custom request router)
      `-- Target  (tensor-parallel groups: tp placement-group bundles per replica, STRICT_PACK)

Arguments are validated and cross-checked when the app is built (serve_app.args.AppArgs), so a
bad combination fails before anything is deployed.
"""
from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.config import BackpressureConfig, RequestRouterConfig

from deployments.affinity import REQUEST_ROUTER_PATH, ROUTING_STATS_PERIOD_S
from deployments.draft import DraftDeployment
from deployments.target import TargetDeployment
from serve_app import constants
from serve_app.api import OpenAIIngress
from serve_app.args import AppArgs


def _scaling(args: AppArgs, name: str, initial: int, upper: int) -> dict:
    """num_replicas, or an autoscaling config with the project's policy for `name`."""
    if not args.autoscaling:
        return {"num_replicas": initial}
    from serve_app.autoscaling import autoscaling_config
    # capacities this app's own arguments give (a user's autoscaling_policy_kwargs win): a Target
    # replica holds target_slots sequences, a Router replica its lanes' rows
    sized = {"target_sequences_per_replica": float(args.target_slots),
             "router_ongoing_per_replica": float(args.router_config().max_lanes * args.max_batch_size)}
    return {"autoscaling_config": autoscaling_config(name, min_replicas=1, max_replicas=max(upper, initial),
                                                     initial_replicas=initial,
                                                     policy_kwargs={**sized, **args.autoscaling_policy_kwargs})}


# Serve's per-replica switches for the per-round hops (read when a replica's process imports
# Serve): user code on the replica's main event loop, and a handle's routing on the caller's
# loop, instead of a thread and a loop of their own each (one cross-thread handoff less per call
# on each side; the model work runs on the replica's ModelThread anyway). And the largest call a
# replica's inter-deployment gRPC server accepts and its handles' channels receive (Ray 2.60 reads
# it on both sides): Serve keeps gRPC's 4 MiB, which a Draft call of a lane of 16 rows exceeds (the
# target's features of every row's tokens since the last call: 16 rows x ~80 positions x 3 layers
# x 576 x 2 bytes = 4.4 MB, measured), and so does a Target's answer to a prompt of ~1,200 tokens
# (its features); 2 GiB - 1 is gRPC's maximum. A Serve config's `ray_actor_options` replace these
# (runtime_env included): k8s/rayservice.yaml restates them where it sets its own.
SERVE_REPLICA_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
                     "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(2**31 - 1)}


def _actor_options(args: AppArgs, num_cpus: float, num_gpus: float = 0) -> dict:
    return {"num_cpus": num_cpus, "num_gpus": num_gpus,
            "runtime_env": {"env_vars": dict(SERVE_REPLICA_ENV)}}  # (tracing: in each deployment's config)


def build_app(args: dict[str, Any] | AppArgs | None = None) -> serve.Application:
    """Build the application from `serve run serve_app:build_app key=value ...` arguments."""
    a = args if isinstance(args, AppArgs) else AppArgs.model_validate(dict(args or {}))
    a.validate_models()
    affinity = RequestRouterConfig(request_router_class=REQUEST_ROUTER_PATH)
    bundles = a.target_bundles()
    target = serve.deployment(
        TargetDeployment, name="Target",
        ray_actor_options=_actor_options(a, bundles[0]["CPU"], bundles[0].get("GPU", 0)),
        **({"placement_group_bundles": bundles, "placement_group_strategy": "STRICT_PACK"} if a.tp > 1 else {}),
        max_ongoing_requests=4 * a.lanes_per_target, health_check_period_s=2, health_check_timeout_s=30,
        request_router_config=RequestRouterConfig(request_router_class=REQUEST_ROUTER_PATH,  # (free slots: affinity.py)
                                                  request_routing_stats_period_s=ROUTING_STATS_PERIOD_S),
        **_scaling(a, "Target", a.target_replicas, a.max_target_replicas),
    ).bind(a.target_config().model_dump())
    draft = None
    dcfg = a.draft_config()
    if dcfg is not None:
        draft = serve.deployment(
            DraftDeployment, name="Draft",
            ray_actor_options=_actor_options(a, a.draft_cpus, 1 if a.device == "cuda" and a.draft_on_device else 0),
            max_ongoing_requests=8 * a.lanes_per_target, request_router_config=affinity,
            health_check_period_s=2, health_check_timeout_s=30,
            **_scaling(a, "Draft", a.draft_replicas, a.max_draft_replicas),
        ).bind(dcfg.model_dump())
    rcfg = a.router_config()
    router = serve.deployment(
        OpenAIIngress, name="Router", ray_actor_options=_actor_options(a, a.router_cpus),
        # The router sheds load itself (503 + Retry-After, OpenAI body) when its lanes and queue are
        # full, so Serve lets in as many requests as a replica has rows and queue (n = 1 each); Serve's
        # own queue at the proxy is the last guard against a flood of connections.
        max_ongoing_requests=max(64, rcfg.max_lanes * a.max_batch_size + a.max_queued_sequences),
        max_queued_requests=max(64, 4 * a.max_queued_sequences),
        backpressure_config=BackpressureConfig(status_code=503, retry_after_s=1),
        graceful_shutdown_timeout_s=constants.ROUTER_DRAIN_S,
        # runtime knobs (SchedulingConfig): {} so that a config file's user_config, once removed, is
        # replaced by {} (the built values) on the running replicas too; None would leave them as they were
        user_config={},
        **_scaling(a, "Router", a.router_replicas, a.max_router_replicas),
    ).bind(rcfg.model_dump(), a.api.model_dump(), draft, target)
    return router
