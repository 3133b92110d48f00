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


@pytest.mark.asyncio
async def test_a_pinned_call_sharing_its_replica_moves_to_an_unused_one_and_only_then():
    # shared with another lane (pin in avoid), and a replica no lane uses: move there
    assert await _route({"a": 0.0, "b": 0.0}, ["a"], avoid=["a"]) == ["b"]
    # shared, but every replica in use: stay
    assert await _route({"a": 0.0, "b": 0.0}, ["a"], avoid=["a", "b"]) == ["a"]
    # not shared (or no avoid given, as Target calls): stay
    assert await _route({"a": 0.0, "b": 0.0}, ["a"], avoid=["b"]) == ["a"]
    assert await _route({"a": 0.0, "b": 0.0}, ["a"]) == ["a"]



@pytest.mark.asyncio
async def test_a_lane_short_of_slots_moves_only_to_a_replica_reporting_room_for_all_its_rows():
    """`room=<rows>`: the roomiest replicas other than the pin that report that many free slots and
    are not avoided, else the pin (a full replica is never traded for another full one)."""
    def replica(name: str, free: int | None) -> FakeReplica:
        r = FakeReplica(name, 0.0)
        r.routing_stats = {} if free is None else {"free_slots": free}  # (none reported yet: {})
        return r

    async def ranks(free: dict[str, int | None], room, avoid=()) -> list[list[str]]:
        pending = _pending(0, "a", list(avoid))
        pending.kwargs["room"] = room
        chosen = await _router([]).choose_replicas([replica(n, f) for n, f in free.items()], pending)
        return [[r.replica_id.unique_id for r in rank] for rank in chosen if rank]

    assert await ranks({"a": 0, "b": 2, "c": 6}, 4) == [["c"], ["a"]]
    assert await ranks({"a": 0, "b": 5, "c": 9, "d": 7}, 4) == [["c", "d"], ["a"]]  # the roomiest two
    assert await ranks({"a": 0, "b": 4}, 4) == [["b"], ["a"]]
    assert await ranks({"a": 0, "b": 3}, 4) == [["a"]]  # no room for its 4 rows anywhere: stay
    assert await ranks({"a": 0, "b": 8}, None) == [["a"]]  # not short of slots
    assert await ranks({"a": 0, "b": 8}, 4, avoid=["b"]) == [["a"]]  # (a suspect, or another lane's)
    assert await ranks({"a": 0, "b": None}, 4) == [["a"]]
    assert await _route({"a": 0.0, "b": 0.0}, ["a"], avoid=["a"]) == ["b"]  # (shared: moves as before)
    # shared and short of slots: to a replica no lane uses, one reporting room first
    chosen = await ranks({"a": 0, "b": 0, "c": 6, "d": None}, 4, avoid=["a"])
    assert chosen[0] == ["c"] and sorted(chosen[1]) in (["b", "c"], ["b", "d"], ["c", "d"]) and chosen[2] == ["a"]

class _RoutedDraft:
    """A Draft handle whose calls the real AffinityRequestRouter places on in-process replicas
    (n-gram proposers; a replica's queue length is its calls in flight)."""

    def __init__(self):
        from fake_handles import Method
        self.router = _router([])
        self.replicas, self.proposers, self.n = {}, {}, 0
        self.calls: dict[str, int] = {}
        self.propose, self.release = Method(self._propose), Method(self._release)

    def add_replica(self, name: str) -> None:
        from specdec.proposers.ngram import NgramProposer
        self.replicas[name], self.proposers[name] = FakeReplica(name, 0.0), NgramProposer()
        self.router.update_replicas(list(self.replicas.values()))

    def options(self, **_):
        return self

    async def _place(self, method: str, pin, avoid) -> str:
        self.n += 1
        return (await self.router._choose_replica_for_request(_pending(self.n, pin, list(avoid or ())))).replica_id.unique_id

    async def _propose(self, batch, pin=None, avoid=None):
        rid = await self._place("propose", pin, avoid)
        self.calls[rid] = self.calls.get(rid, 0) + 1
        await asyncio.sleep(0.005)
        return rid, self.proposers[rid].propose(batch)

    async def _release(self, ids, pin=None):
        self.proposers[await self._place("release", pin, [])].release(ids)


@pytest.mark.asyncio
async def test_a_draft_replica_added_while_lanes_run_gets_a_lane(tiny_dir):
    """Draft replicas hold every lane's state, so busy lanes never leave one by themselves: one a
    scale-out adds must still get a lane (it used to get no call while the lanes had work)."""
    import time

    from deployments.batcher import Batcher
    from fake_handles import FakeTarget
    from specdec.loader import load_model
    from specdec.sampling import SamplingParams
    from specdec.target_worker import TargetWorker

    draft = _RoutedDraft()
    draft.add_replica("D1")
    b = Batcher({"tokenizer": str(tiny_dir), "max_model_len": 256, "batch_wait_timeout_s": 0, "max_lanes": 2,
                 "max_batch_size": 4, "num_speculative_tokens": 2, "adaptive": False, "lookup_k": 0,
                 "max_queued_sequences": 64}, draft, FakeTarget(TargetWorker(load_model(tiny_dir), 16, 256)))
    stop = time.monotonic() + 2.5

    async def client(i: int) -> None:  # sends its next request when the last one is done
        while time.monotonic() < stop:
            [s] = b.submit([[5, 6, 7, 5, 6, 7, 8 + i]], [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)])
            while not s.finished:
                await b.wait(s)
            b.finish(s)

    async def scale_out() -> None:
        await asyncio.sleep(0.7)
        assert set(draft.calls) == {"D1"} and len(b.lanes) == 2
        draft.add_replica("D2")

    await asyncio.gather(scale_out(), *(client(i) for i in range(8)))
    assert draft.calls.get("D2", 0) > 10


@pytest.mark.asyncio
async def test_a_new_lane_waits_out_the_grace_for_a_fresh_replica_before_a_used_one():
    """A fresh replica momentarily full: a new lane's call keeps to it for AVOID_GRACE_S (lanes
    spread) and only then also tries the used ones; a call older than the grace tries both at once."""
    from deployments import affinity
    router = _router([FakeReplica("used", 0.0), Stuck("fresh", "full")])
    young = asyncio.ensure_future(router._choose_replica_for_request(_pending(0, None, ["used"])))
    await asyncio.sleep(0.3 * affinity.AVOID_GRACE_S)
    assert not young.done()
    assert (await asyncio.wait_for(young, 5.0)).replica_id.unique_id == "used"
    old = _pending(1, None, ["used"])
    old.created_at -= 2 * affinity.AVOID_GRACE_S
    chosen = await asyncio.wait_for(router._choose_replica_for_request(old), 5.0)  # (never, were it kept to the full one)
    assert chosen.replica_id.unique_id == "used"

