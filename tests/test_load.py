"""Load test (loopback, bounded): 32 concurrent streaming clients, 256 greedy requests on a tiny
app. Zero failures, every output equal to its unloaded output, and afterwards nothing held: no
sequences in Target/Draft, nothing running or queued in the router, its asyncio tasks back to the
baseline. Prints the bench/load_test.py table (run with -s to see it)."""
from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import httpx
import pytest

from service_checks import assert_idle_async

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
CONCURRENCY, REQUESTS = 32, 256
PROMPTS = [f"{p}{i}" for i, p in enumerate(["def f", "x = ", "class A", "import os, sys", "# note ",
                                             "for k in d", "return y", "print("] * 2)]  # 16 distinct
MAX_TOKENS = [16 + (i * 5) % 17 for i in range(len(PROMPTS))]  # 16..32


def _load_module():
    spec = importlib.util.spec_from_file_location("load_test", ROOT / "bench" / "load_test.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def load_app(deploy, ray_cluster, tiny_dir, tiny_draft_dir):
    url = deploy("load", {"target": str(tiny_dir), "draft": str(tiny_draft_dir), "proposer": "draft",
                          "max_model_len": 256, "dtype": "float32", "num_speculative_tokens": 3,
                          "max_batch_size": 8, "lanes_per_target": 4, "batch_wait_timeout_s": 0.01})
    yield url, tiny_dir.name
    from ray import serve
    serve.delete("load")


@pytest.mark.asyncio
async def test_load_32_concurrent_streams(load_app):
    url, model = load_app
    lt = _load_module()
    # unloaded outputs: one client, each distinct prompt once
    unloaded = await lt.run_load(url, model, concurrency=1, requests=len(PROMPTS), prompts=PROMPTS,
                                  max_tokens=MAX_TOKENS, timeout_s=120)
    assert not unloaded.failures, unloaded.table()
    expected = {r.index: r.text for r in unloaded.results}
    baseline = (await assert_idle_async("load", url))["tasks"]

    report = await lt.run_load(url, model, concurrency=CONCURRENCY, requests=REQUESTS, prompts=PROMPTS,
                                max_tokens=MAX_TOKENS, timeout_s=120)
    print(f"\nunloaded (concurrency 1):\n{unloaded.table()}\n\nloaded:\n{report.table()}")
    assert len(report.results) == REQUESTS
    assert not report.failures, report.table()
    wrong = [r.index for r in report.results if r.text != expected[r.index]]
    assert not wrong, f"{len(wrong)} outputs differ from their unloaded output (prompts {sorted(set(wrong))})"
    assert report.elapsed < 150
    stats = httpx.get(f"{url}/stats", timeout=30).json()
    assert stats["row_rounds"] / stats["rounds"] > 2  # requests really shared batches
    # flat at the end: no sequences, slots or tasks left behind
    state = await assert_idle_async("load", url, timeout_s=30, max_tasks=baseline)
    assert state["target_free_slots"] == 32
