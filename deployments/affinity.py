"""KV-cache affinity for the Draft and Target deployments: a custom Ray Serve request router.

A sequence's KV cache lives in one replica, so the router pins each batch ("lane") to the
replicas that hold its caches by passing `pin=<replica id>` with every call. This request router
sends a pinned call to that replica when it is still a candidate, and otherwise (first call of a
lane, or the replica is gone) falls back to Serve's power-of-two-choices over the replicas that
other lanes do not use yet (`avoid=`), so lanes spread out and a replica just added by scale-out
gets the next lane. A replica that receives sequences it
does not hold reports them unknown and the router resends their context (re-prefill), so replica
loss costs a prefill, never a request.
"""
from __future__ import annotations

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RunningReplica


class AffinityRequestRouter(PowerOfTwoChoicesRequestRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        kwargs = pending_request.kwargs if pending_request is not None else {}
        pin = kwargs.get("pin")
        if pin:
            for r in candidate_replicas:
                if r.replica_id.unique_id == pin:
                    return [[r]]
        avoid = set(kwargs.get("avoid") or ())
        fresh = [r for r in candidate_replicas if r.replica_id.unique_id not in avoid]
        return await super().choose_replicas(fresh or candidate_replicas, pending_request)


REQUEST_ROUTER_PATH = f"{__name__}:AffinityRequestRouter"
