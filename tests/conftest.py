"""Shared fixtures: tiny random checkpoints (seconds) and, for slow tests, the demo target."""
from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models are overhead-bound: one thread is faster, and much faster on a busy machine."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    from tiny_models import make_tiny_checkpoint
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_target"), seed=0, layers=2)


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory):
    from tiny_models import make_tiny_checkpoint
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_draft"), seed=1, layers=1, hidden=32,
                                heads=2, kv_heads=1, intermediate=64)


@pytest.fixture(scope="session")
def tiny_tok(tiny_dir):
    from specdec.loader import load_tokenizer
    return load_tokenizer(tiny_dir)


@pytest.fixture(scope="session")
def demo_dir():
    """The demo target converted to safetensors (cached under SPECDEC_CACHE_DIR)."""
    from specdec.loader import materialize, resolve
    return materialize(resolve("smollm2")).path


@pytest.fixture(scope="session")
def demo_tok(demo_dir):
    from specdec.loader import load_tokenizer
    return load_tokenizer(demo_dir)


@pytest.fixture(scope="session")
def demo_model(demo_dir):
    from specdec.loader import load_model
    return load_model(demo_dir, dtype=torch.float32)


# ---- Ray: one local cluster per test session, started only when a test needs it ---------------
SERVE_PORT = int(os.environ.get("SPECDEC_TEST_PORT", "8123"))
METRICS_PORT = SERVE_PORT + 1  # Ray's Prometheus export port for this session's cluster


@pytest.fixture(scope="session")
def ray_cluster():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("SPECDEC_NUM_THREADS", "1")
    os.environ.setdefault("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "1")  # faster scaling tests
    import ray
    from ray import serve
    # address="local": a cluster of its own, never one a developer started (`ray start`, RAY_ADDRESS)
    ray.init(address="local", num_cpus=8, include_dashboard=False, logging_level="WARNING", log_to_driver=False,
             _metrics_export_port=METRICS_PORT)
    serve.start(http_options={"host": "127.0.0.1", "port": SERVE_PORT})
    yield f"http://127.0.0.1:{SERVE_PORT}"
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def deploy(ray_cluster):
    """`deploy(name, args)`: serve.run an application built from `args` at route /<name> of the
    session's cluster; returns its base URL."""
    def run(name: str, args: dict) -> str:
        from ray import serve
        from serve_app import build_app
        serve.run(build_app(args), name=name, route_prefix=f"/{name}")
        return f"{ray_cluster}/{name}"
    return run


@pytest.fixture(scope="session")
def metrics_port(ray_cluster) -> int:
    """Ray's Prometheus export port for this session's cluster."""
    return METRICS_PORT


@pytest.fixture(scope="session")
def tiny_eagle_dir(tmp_path_factory, tiny_dir, tiny_tok):
    """An untrained EAGLE-style draft for the tiny target (reduced 128-token head) that fuses the
    target's layer 0 with a random fuse (EAGLE-3), so the services that load it carry the taps."""
    import torch
    from specdec.eagle_draft import EagleDraft
    from specdec.loader import load_model
    torch.manual_seed(3)
    target = load_model(tiny_dir)
    ids = torch.randperm(target.args.vocab_size)[:128].sort().values
    out = tmp_path_factory.mktemp("tiny_eagle") / "eagle"
    draft = EagleDraft.for_target(target, ids, feature_layers=(0,))
    with torch.no_grad():
        draft.fuse.weight.normal_(0.0, 0.2)
    draft.save(out, tiny_tok, {"target": str(tiny_dir)}, dtype=torch.float32)
    return out
