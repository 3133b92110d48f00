"""Traces across processes, Prometheus metrics from the Ray metrics port, and autoscaling under
real load (bounded in time and requests, loopback only)."""
import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest


pytestmark = pytest.mark.ray

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


def _spans(path: Path, trace_id: str) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            s = json.loads(line)
        except json.JSONDecodeError:
            continue
        if s["trace_id"] == trace_id:
            out.append(s)
    return out


def test_trace_tree_spans_processes(deploy, ray_cluster, tiny_dir, tiny_draft_dir, tmp_path):
    spans_file = tmp_path / "spans.jsonl"
    url = deploy("traced", {"target": str(tiny_dir), "draft": str(tiny_draft_dir), "proposer": "draft",
                            "tp": 2, "target_cpus": 0.25, "max_model_len": 512, "num_speculative_tokens": 2,
                            "adaptive": False,
                            "tracing": {"exporter": "jsonl", "path": str(spans_file), "batch": False}})
    r = httpx.post(f"{url}/v1/completions", timeout=60,
                   headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"},
                   json={"model": tiny_dir.name, "prompt": "def f(x):", "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200
    names = set()
    deadline = time.time() + 90
    while time.time() < deadline:
        spans = _spans(spans_file, TRACE_ID)
        names = {s["name"] for s in spans}
        ids = {s["span_id"] for s in spans}
        complete = all(s["parent_id"] in ids for s in spans if s["name"] != "router.request")
        if complete and {"router.request", "router.round", "draft.propose", "target.verify",
                         "tp_worker.forward"} <= names:
            break
        time.sleep(1)
    by_id = {s["span_id"]: s for s in spans}
    req = next(s for s in spans if s["name"] == "router.request")
    node, hops = req, 0  # joined the caller's traceparent, nested under the ingress's own request spans
    while node["parent_id"] != PARENT_ID:  # (FastAPI's: POST ... -> fastapi.endpoint), not their sibling
        node, hops = by_id[node["parent_id"]], hops + 1
    assert hops <= 3
    rounds = [s for s in spans if s["name"] == "router.round"]
    assert rounds and all(s["parent_id"] == req["span_id"] for s in rounds)
    for s in rounds:
        assert {"batch_size", "k_max", "proposed", "accepted", "emitted", "bonus", "request_ids"} <= set(s["attributes"])
    for name, parent in [("draft.propose", "router.round"), ("target.verify", "router.round"),
                         ("tp_worker.forward", "target.verify")]:
        kids = [s for s in spans if s["name"] == name]
        assert kids, name
        assert all(by_id[s["parent_id"]]["name"] == parent for s in kids), name
    assert sum(s["attributes"]["emitted"] for s in rounds) == 6
    pids = {s["pid"] for s in spans}
    assert len(pids) >= 3  # router, draft, target rank 0 and the TP worker are separate processes
    from ray import serve
    serve.delete("traced")


def _scrape(metrics_port: int) -> str:
    try:
        return httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    except httpx.HTTPError:
        return ""


def _value(text: str, name: str, **labels) -> float | None:
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in "{ ") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    return total if found else None


def test_prometheus_metrics_have_plausible_values(deploy, metrics_port, ray_cluster, tiny_dir):
    url = deploy("metered", {"target": str(tiny_dir), "proposer": "ngram", "max_model_len": 512})
    model = tiny_dir.name
    generated = 0
    for p in ["a = [1, 2, 3, 1, 2, 3, 1, 2", "def f():\n    return f()\n", "x x x x x x"]:
        r = httpx.post(f"{url}/v1/completions", timeout=60, json={"model": model, "prompt": p, "max_tokens": 16,
                                                                  "temperature": 0, "ignore_eos": True})
        generated += r.json()["usage"]["completion_tokens"]
    want = ["ray_specdec_generated_tokens_total", "ray_specdec_requests_total", "ray_specdec_acceptance_rate",
            "ray_specdec_mean_accepted_length", "ray_specdec_batch_size_bucket",
            "ray_specdec_time_to_first_token_seconds_bucket", "ray_specdec_round_time_seconds_bucket",
            "ray_specdec_inter_token_latency_seconds_bucket", "ray_specdec_speculation_sequences"]
    deadline = time.time() + 90
    text = ""
    while time.time() < deadline:  # counters reach the exporter in periodic flushes: wait for the totals
        text = _scrape(metrics_port)
        if (all(_value(text, w, application="metered") is not None for w in want)
                and _value(text, "ray_specdec_generated_tokens_total", application="metered") == generated
                and _value(text, "ray_specdec_requests_total", application="metered") == 3):
            break
        time.sleep(3)
    missing = [w for w in want if _value(text, w, application="metered") is None]
    assert not missing, missing
    assert _value(text, "ray_specdec_generated_tokens_total", application="metered") == generated
    assert _value(text, "ray_specdec_requests_total", application="metered") == 3
    acc = _value(text, "ray_specdec_acceptance_rate", application="metered")
    assert 0.0 <= acc <= 1.0
    assert _value(text, "ray_specdec_mean_accepted_length", application="metered") >= 1.0
    from ray import serve
    serve.delete("metered")


def _replicas(app: str) -> dict[str, int]:
    from ray import serve
    status = serve.status().applications[app].deployments
    return {name: sum(n for state, n in d.replica_states.items() if str(state).endswith("RUNNING"))
            for name, d in status.items()}


@pytest.mark.asyncio
async def test_autoscaling_follows_load_without_failures(deploy, ray_cluster, tiny_dir):
    """Load rises: target and router replicas are added; load stops: back to the minimum."""
    url = deploy("scaled", {
        "target": str(tiny_dir), "proposer": "ngram", "max_model_len": 512, "autoscaling": True,
        "max_target_replicas": 2, "max_router_replicas": 2, "max_draft_replicas": 2, "max_batch_size": 4,
        "target_cpus": 0.25, "draft_cpus": 0.1,
        "autoscaling_policy_kwargs": {"target_sequences_per_replica": 2, "router_ongoing_per_replica": 4,
                                      "target_tokens_per_s": 30, "downscale_delay_s": 3,
                                      "upscale_cooldown_s": 1}})
    model = tiny_dir.name
    assert _replicas("scaled")["Target"] == 1
    failures, done, peak = [], 0, {"Target": 1, "Router": 1}
    stop = asyncio.Event()

    async def client(c, i):
        nonlocal done
        while not stop.is_set():
            r = await c.post(f"{url}/v1/completions", json={"model": model, "prompt": f"def f{i}(", "max_tokens": 32,
                                                            "temperature": 0, "ignore_eos": True})
            if r.status_code != 200:
                failures.append(r.status_code)
            done += 1

    async def load():
        async with httpx.AsyncClient(timeout=120) as c:
            tasks = [asyncio.create_task(client(c, i)) for i in range(12)]
            t0 = time.time()
            while time.time() - t0 < 90:
                await asyncio.sleep(2)
                now = _replicas("scaled")
                for k in peak:
                    peak[k] = max(peak[k], now.get(k, 0))
                if peak["Target"] >= 2:
                    break
            stop.set()
            await asyncio.gather(*tasks)
    await load()
    assert not failures
    assert done > 0
    assert peak["Target"] >= 2, peak
    deadline = time.time() + 90
    while time.time() < deadline and _replicas("scaled")["Target"] > 1:
        time.sleep(2)
    assert _replicas("scaled")["Target"] == 1
    r = httpx.post(f"{url}/v1/completions", timeout=60, json={"model": model, "prompt": "x", "max_tokens": 4})
    assert r.status_code == 200
    from ray import serve
    serve.delete("scaled")
