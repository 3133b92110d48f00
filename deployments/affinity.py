"""KV-cache affinity for the Draft and Target deployments: a custom Ray Serve request router.

A sequence's KV cache lives in one replica, so the router pins each batch ("lane") to the
replicas that hold its caches by passing `pin=<replica id>` with every call. This request router
sends a pinned call to that replica when it is still a candidate, and otherwise (first call of a
lane, or the replica is gone) makes a power-of-two choice (two random replicas, the shorter queue
wins) among the replicas that other lanes do not use yet (`avoid=`), so lanes spread out and a
replica just added by scale-out gets the next lane; a pinned Draft call that shares its replica
with other lanes moves to such a replica (Draft replicas hold state for every lane, so a lane would
otherwise stay where it is as long as it has work, and a new replica would sit idle). A pinned call
that gives `room=<rows>` (a lane whose Target replica refused some rows a slot) moves to another
replica outside `avoid` whose routing stats report at least that many free slots (the roomiest),
else stays: so a lane starved on a replica that other routers' lanes fill uses an idle one, and
a `room` move never trades a full replica for another full one. Stats lag, so the replica checks
again when the call arrives (`TargetDeployment.verify`: it refuses the whole call without room for
all its rows, and the lane stays). A replica that receives sequences it
does not hold reports them unknown and the router resends their context (re-prefill), so replica
loss costs a prefill, never a request.

Why not extend Serve's PowerOfTwoChoicesRequestRouter: its choice ignores the candidates it is
given (so `avoid` would do nothing), and it fulfils requests in FIFO order: the replica one
routing task found goes to the oldest waiting request, whatever that request asked for, which
swaps lanes whose rounds are in flight together (the first one's replica slower to answer its
queue-length probe). Here each replica goes to the request it was chosen for; and since a routing
task then serves only its own call, every waiting call gets a task (Serve's default, two per
replica, would let calls waiting on one full or unreachable replica hold them all, stalling calls
for idle ones). An unpinned call that the replicas outside `avoid` could not take for
AVOID_GRACE_S also tries the avoided ones (a full, wedged or unreachable fresh replica must not
strand a new lane).
"""
from __future__ import annotations

import random
import time

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica


AVOID_GRACE_S = 1.0  # how long an unpinned call waits for a replica no other lane uses
ROUTING_STATS_PERIOD_S = 2.0  # how often Serve asks a Target replica for its free slots (`room` moves)


class AffinityRequestRouter(RequestRouter):
    @property
    def max_num_routing_tasks(self) -> int:
        return self.max_num_routing_tasks_cap  # one per waiting call (module docstring)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        kwargs = pending_request.kwargs if pending_request is not None else {}
        if pending_request is not None:  # a choice that was full is retried after a backoff, not in a tight loop
            pending_request.routing_context.should_backoff = True
        pin = kwargs.get("pin")
        avoid = set(kwargs.get("avoid") or ())
        fresh = [r for r in candidate_replicas if r.replica_id.unique_id not in avoid]
        if pin:
            for r in candidate_replicas:
                if r.replica_id.unique_id == pin:
                    # a pin that other lanes share, given with `avoid` (Draft calls: a Draft replica
                    # holds every lane's state, so lanes never leave one on their own), moves to a
                    # replica no lane uses (one scale-out just added); a lane short of slots, to one
                    # with room for it; else it stays
                    if pin in avoid and fresh:  # (one reporting room first, when it asks for room)
                        return [_roomiest(fresh, r, kwargs.get("room")), random.sample(fresh, min(2, len(fresh))), [r]]
                    return [_roomiest(fresh, r, kwargs.get("room")), [r]]
        used = [r for r in candidate_replicas if r.replica_id.unique_id in avoid]
        ranks = [random.sample(pool, min(2, len(pool))) for pool in (fresh, used) if pool]  # the shorter queue of each
        waited = pending_request is not None and time.time() - pending_request.created_at > AVOID_GRACE_S
        return ranks if waited or not fresh else ranks[:1]

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata=None) -> None:
        """Give `replica` to the request it was chosen for (the routing task passes that request's
        own metadata object), never to another one that happens to wait longer."""
        pr = next((p for p in self._pending_requests_to_fulfill
                   if p.metadata is request_metadata and not p.future.done()), None)
        if pr is None:  # already routed or cancelled: the routing task moves on
            return
        self._cancel_routing_task_for_pending_request(pr)
        self._record_queue_wait_time(pr)
        pr.future.set_result(replica)
        self._remove_pending_request_from_indices(pr)
        self._pending_requests_to_fulfill.remove(pr)


def _roomiest(replicas: list[RunningReplica], pin: RunningReplica, room: int | None) -> list[RunningReplica]:
    """Up to two replicas other than `pin` reporting at least `room` free KV slots, the roomiest first."""
    free = lambda r: (r.routing_stats or {}).get("free_slots", 0)  # noqa: E731 - (Target's record_routing_stats)
    return sorted((r for r in replicas if r is not pin and room and free(r) >= room), key=free, reverse=True)[:2]


REQUEST_ROUTER_PATH = f"{__name__}:AffinityRequestRouter"
