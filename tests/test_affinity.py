"""The affinity request router sends each pinned call to its own replica, also when calls race."""
from __future__ import annotations

import asyncio

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve._private.request_router.common import PendingRequest

from deployments.affinity import AffinityRequestRouter


class FakeReplica:
    """What the request router reads of a replica; `delay_s` slows its queue-length probe."""

    def __init__(self, name: str, delay_s: float):
        self.replica_id = ReplicaID(unique_id=name, deployment_id=DeploymentID(name="target", app_name="app"))
        self.delay_s = delay_s
        self.max_ongoing_requests = 8
        self.node_id, self.availability_zone, self.multiplexed_model_ids = "node", None, set()
        self.is_cross_language, self.routing_stats = False, {}

    async def get_queue_len(self, *, deadline_s: float) -> int:
        await asyncio.sleep(self.delay_s)
        return 0


def _pending(i: int, pin: str | None, avoid: list[str]) -> PendingRequest:
    meta = RequestMetadata(request_id=f"r{i}", internal_request_id=f"i{i}", call_method="verify")
    return PendingRequest(args=[], kwargs={"pin": pin, "avoid": avoid}, metadata=meta)


async def _route(delays: dict[str, float], pins: list[str | None], avoid: list[str] = ()) -> list[str]:
    """Route one call per pin concurrently over fake replicas; the replica each call got."""
    router = AffinityRequestRouter(deployment_id=DeploymentID(name="target", app_name="app"),
                                   handle_source=DeploymentHandleSource.REPLICA)
    router.update_replicas([FakeReplica(n, d) for n, d in delays.items()])
    chosen = await asyncio.gather(*(router._choose_replica_for_request(_pending(i, p, list(avoid)))
                                    for i, p in enumerate(pins)))
    return [r.replica_id.unique_id for r in chosen]


@pytest.mark.asyncio
async def test_racing_pinned_calls_each_reach_their_own_replica():
    # the first call's replica answers its probe last: Serve's FIFO fulfilment would hand the
    # replica found for the second call to the first (a lane then lands on a replica without its KV)
    for pins in (["slow", "fast"], ["fast", "slow"], ["slow", "fast", "slow", "fast"]):
        assert await _route({"slow": 0.05, "fast": 0.0}, pins) == pins


@pytest.mark.asyncio
async def test_unpinned_calls_avoid_replicas_other_lanes_use():
    for _ in range(5):
        assert await _route({"a": 0.0, "b": 0.0, "c": 0.0}, [None], avoid=["a", "b"]) == ["c"]
    # every replica in use: any will do
    assert (await _route({"a": 0.0, "b": 0.0}, [None], avoid=["a", "b"]))[0] in {"a", "b"}


@pytest.mark.asyncio
async def test_pin_of_a_gone_replica_falls_back_to_a_live_one():
    assert await _route({"a": 0.0, "b": 0.0}, ["dead"], avoid=["a"]) == ["b"]


@pytest.mark.asyncio
async def test_a_call_pinned_to_a_full_replica_backs_off():
    """A pinned replica at max_ongoing_requests is probed again after Serve's backoff, not in a
    tight loop on the router's event loop."""
    class Full(FakeReplica):
        probes = 0

        async def get_queue_len(self, *, deadline_s: float) -> int:
            type(self).probes += 1
            return self.max_ongoing_requests

    router = AffinityRequestRouter(deployment_id=DeploymentID(name="target", app_name="app"),
                                   handle_source=DeploymentHandleSource.REPLICA)
    router.update_replicas([Full("full", 0.0)])
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(router._choose_replica_for_request(_pending(0, "full", [])), 0.5)
    assert Full.probes < 40, Full.probes  # a tight loop probes hundreds of times in 0.5 s


class Stuck(FakeReplica):
    """A replica that cannot take a call: full (`mode="full"`) or never answering its probe."""

    def __init__(self, name: str, mode: str):
        super().__init__(name, 0.0)
        self.mode = mode

    async def get_queue_len(self, *, deadline_s: float) -> int:
        if self.mode == "hang":
            await asyncio.sleep(3600)
        return self.max_ongoing_requests


def _router(replicas) -> AffinityRequestRouter:
    router = AffinityRequestRouter(deployment_id=DeploymentID(name="target", app_name="app"),
                                   handle_source=DeploymentHandleSource.REPLICA)
    router.update_replicas(replicas)
    return router


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["full", "hang"])
async def test_a_new_lane_falls_back_to_a_used_replica_when_the_fresh_one_cannot_take_it(mode):
    router = _router([FakeReplica("used", 0.0), Stuck("fresh", mode)])
    chosen = await asyncio.wait_for(router._choose_replica_for_request(_pending(0, None, ["used"])), 5.0)
    assert chosen.replica_id.unique_id == "used"


@pytest.mark.asyncio
async def test_an_idle_fresh_replica_still_gets_the_new_lane():
    for _ in range(5):
        assert await _route({"used": 0.0, "fresh": 0.0}, [None], avoid=["used"]) == ["fresh"]


@pytest.mark.asyncio
async def test_calls_waiting_on_a_full_replica_do_not_stall_calls_for_another():
    """Each waiting call has its own routing task: four calls waiting on full 'a' (Serve's
    default: two tasks per replica, four here) must not keep a call for idle 'b' waiting."""
    router = _router([Stuck("a", "full"), FakeReplica("b", 0.0)])
    waiting = [asyncio.ensure_future(router._choose_replica_for_request(_pending(i, "a", []))) for i in range(4)]
    await asyncio.sleep(0.05)
    chosen = await asyncio.wait_for(router._choose_replica_for_request(_pending(9, "b", [])), 2.0)
    assert chosen.replica_id.unique_id == "b"
    for w in waiting:
        w.cancel()
