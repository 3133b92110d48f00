"""Test helpers for deployed apps: wait until one holds nothing (no sequences, slots or stray tasks),
and send it concurrent greedy completions."""
from __future__ import annotations

import asyncio
import time

import httpx


def app_state(app: str, url: str, headers: dict | None = None) -> dict:
    """Target/Draft active sequences and the router's running/queued/lanes/tasks."""
    from ray import serve
    target = serve.get_deployment_handle("Target", app_name=app).stats.remote().result(timeout_s=30)
    state = {"target_active": target["active_sequences"], "target_free_slots": target["free_slots"]}
    try:
        draft = serve.get_deployment_handle("Draft", app_name=app).stats.remote().result(timeout_s=30)
        state["draft_active"] = draft["active_sequences"]
    except Exception:  # noqa: BLE001 - an app without a draft deployment
        state["draft_active"] = 0
    router = httpx.get(f"{url}/stats", headers=headers, timeout=30).json()
    state.update({k: router[k] for k in ("running", "queued", "lanes", "tasks")})
    return state


def wait_idle(app: str, url: str, headers: dict | None = None, timeout_s: float = 30.0,
              max_tasks: int | None = None) -> dict:
    """Poll until nothing is held (and the router's task count is at most `max_tasks`); return the
    last state, which the caller asserts on."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = app_state(app, url, headers)
        idle = (s["target_active"] == 0 and s["draft_active"] == 0 and s["running"] == 0 and s["queued"] == 0
                and s["lanes"] == 0 and (max_tasks is None or s["tasks"] <= max_tasks))
        if idle or time.monotonic() > deadline:
            return s
        time.sleep(0.25)


def assert_idle(app: str, url: str, headers: dict | None = None, timeout_s: float = 30.0,
                max_tasks: int | None = None) -> dict:
    s = wait_idle(app, url, headers, timeout_s, max_tasks)
    assert s["target_active"] == 0 and s["draft_active"] == 0, s
    assert s["running"] == 0 and s["queued"] == 0 and s["lanes"] == 0, s
    if max_tasks is not None:
        assert s["tasks"] <= max_tasks, s
    return s


async def assert_idle_async(app: str, url: str, headers: dict | None = None, timeout_s: float = 30.0,
                            max_tasks: int | None = None) -> dict:
    """`assert_idle` for async tests: Serve refuses sync handle calls on a running event loop."""
    return await asyncio.to_thread(assert_idle, app, url, headers, timeout_s, max_tasks)


async def greedy_burst(url: str, model: str, prompts: list[str], max_tokens: int) -> list[str]:
    """The texts of greedy completions (ignore_eos) of `prompts`, all sent at once."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=120) as c:
        rs = await asyncio.gather(*[c.post(f"{url}/v1/completions", json={**body, "prompt": p}) for p in prompts])
    return [r.json()["choices"][0]["text"] for r in rs]
