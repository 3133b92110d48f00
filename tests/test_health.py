"""A replica that cannot serve says so: a model call that hangs fails the health check (Target at
any tp, Draft), and a KV cache that cannot fit is refused before it is allocated."""
import asyncio
import time

import pytest

from deployments.common import ModelThread
from deployments.draft import DraftDeployment
from deployments.target import TargetDeployment
from serve_app.args import AppArgs
from specdec import model as model_mod
from specdec.loader import load_model


async def _hang_then_recover(replica, seconds: float) -> None:
    """While a model call runs past forward_timeout_s the health check fails; after it, it passes."""
    replica.check_health()
    call = asyncio.ensure_future(replica.thread.call(time.sleep, seconds))
    await asyncio.sleep(seconds / 2)
    with pytest.raises(TimeoutError, match="forward_timeout_s"):
        replica.check_health()
    await call
    replica.check_health()


@pytest.mark.asyncio
async def test_model_thread_reports_a_stuck_call_only_past_the_timeout():
    thread = ModelThread(1, "t")
    thread.check_not_stuck(0.01)  # idle
    call = asyncio.ensure_future(thread.call(time.sleep, 0.3))
    await asyncio.sleep(0.1)
    thread.check_not_stuck(5.0)  # running, but not for long
    with pytest.raises(TimeoutError):
        thread.check_not_stuck(0.05)
    await call
    thread.check_not_stuck(0.01)


@pytest.mark.asyncio
async def test_target_replica_with_a_hung_forward_fails_its_health_check(tiny_dir):
    replica = TargetDeployment({"model": str(tiny_dir), "num_slots": 2, "max_model_len": 64,
                                "forward_timeout_s": 0.2})
    await _hang_then_recover(replica, 0.8)


@pytest.mark.asyncio
async def test_draft_replica_with_a_hung_proposal_fails_its_health_check(tiny_draft_dir):
    replica = DraftDeployment({"proposer": "draft", "draft": str(tiny_draft_dir), "num_slots": 2,
                               "max_model_len": 64, "forward_timeout_s": 0.2})
    await _hang_then_recover(replica, 0.8)


def test_builder_gives_the_draft_a_health_check(tiny_dir, tiny_draft_dir):
    from serve_app.builder import build_app
    app = build_app({"target": str(tiny_dir), "draft": str(tiny_draft_dir), "proposer": "draft",
                     "max_model_len": 64, "forward_timeout_s": 30})
    deployments = {d.name: d for d in _deployments(app)}
    assert deployments["Draft"]._deployment_config.health_check_period_s == 2
    assert deployments["Draft"].init_args[0]["forward_timeout_s"] == 30
    assert deployments["Target"].init_args[0]["forward_timeout_s"] == 30
    # a Router that Serve stops (redeploy, scale-in) lets its streams finish: Serve's default 20 s
    # cut every longer one without an end
    assert deployments["Router"]._deployment_config.graceful_shutdown_timeout_s >= 300


def test_the_router_lets_in_as_many_requests_as_it_has_rows_and_queue(tiny_dir):
    """Serve's own admission (max_ongoing_requests) must not refuse requests the Router has rows
    for: 40 rows x 2 lanes, no queue, took only 64 at once (the rest waited in Serve's queue)."""
    from serve_app.builder import build_app
    app = build_app({"target": str(tiny_dir), "proposer": "ngram", "max_model_len": 64, "max_batch_size": 40,
                     "lanes_per_target": 2, "max_queued_sequences": 0, "kv_cache_memory_gib": 1})
    router = {d.name: d for d in _deployments(app)}["Router"]
    assert router._deployment_config.max_ongoing_requests >= 80


def _deployments(app):
    """The deployments under an application's ingress (Ray 2.60's bound graph)."""
    out, todo = [], [app]
    while todo:
        d = todo.pop()._bound_deployment
        out.append(d)
        todo += [a for a in d.init_args if hasattr(a, "_bound_deployment")]
    return out


def test_explicit_max_model_len_must_fit_the_kv_budget(tiny_dir):
    ok = AppArgs(target=str(tiny_dir), proposer="ngram", max_model_len=256, kv_cache_memory_gib=0.01)
    ok.validate_models()
    big = AppArgs(target=str(tiny_dir), proposer="ngram", max_model_len=256, max_batch_size=64,
                  kv_cache_memory_gib=0.001)
    with pytest.raises(ValueError, match="kv_cache_memory_gib"):
        big.validate_models()


def test_derived_max_model_len_leaves_room_for_the_cache_margin(tiny_dir):
    from specdec.loader import parse_dtype
    a = AppArgs(target=str(tiny_dir), proposer="ngram", kv_cache_memory_gib=0.002, dtype="float32")
    a.validate_models()
    m = load_model(str(tiny_dir))
    per_token = m.args.kv_bytes_per_token(parse_dtype("float32").itemsize)
    assert per_token * a.target_slots * (a.max_model_len + model_mod.KV_MARGIN) <= 0.002 * 2**30
    assert a.max_model_len >= 16


def test_a_cache_larger_than_free_memory_is_refused_before_allocating(tiny_dir, monkeypatch):
    free = model_mod.free_memory(load_model(str(tiny_dir)).device)
    assert free is None or free > 0
    m = load_model(str(tiny_dir))
    monkeypatch.setattr(model_mod, "free_memory", lambda device: 1 << 20)
    with pytest.raises(MemoryError, match="max_model_len"):
        m.setup_cache(64, 4096)
    assert all(layer.self_attn.kv_cache is None for layer in m.layers)
    m.setup_cache(1, 16)  # a small one fits


def test_a_tp_worker_answers_its_health_ping_during_a_long_call(ray_cluster, tiny_dir):
    """The replica's health check pings its TP workers with a 10 s timeout: a worker busy in a
    long forward (a long prefill) must still answer, or Serve replaces a healthy replica. Here
    the long call is joining a group whose rank 0 never comes (it waits forward_timeout_s)."""
    import socket
    import time

    import ray

    from deployments.target import TPWorker
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    w = TPWorker.options(num_cpus=0.1).remote({"model": str(tiny_dir), "forward_timeout_s": 20.0}, 1, 2)
    try:
        busy = w.init.remote("gloo", "127.0.0.1", port)
        time.sleep(1.0)  # the call is running
        assert ray.get(w.ping.remote(), timeout=10)[0] == 1
        ready, _ = ray.wait([busy], timeout=0)
        assert not ready  # (still in the long call while it answered)
    finally:
        ray.kill(w)
