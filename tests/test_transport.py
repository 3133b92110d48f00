"""The replicas' inter-deployment transport carries a lane's largest calls.

The router's per-round calls travel over Serve's inter-deployment gRPC (`serve_app.api._direct`:
`_by_reference=False` handles), and a replica's gRPC server keeps gRPC's 4 MiB limit on what it
receives. A Draft call of a lane of 16 rows carries the target's
features of every row's tokens since the last call (4.4 MB measured with the demo pair): above
the limit, the call fails and the lane runs without drafts. The app's replicas run with
`SERVE_REPLICA_ENV`, which lifts the limit; this test sends a 5 MiB payload both ways."""
import numpy as np
import pytest
from ray import serve

from serve_app.api import _direct
from serve_app.builder import SERVE_REPLICA_ENV

PAYLOAD = 5 * 2**20


@serve.deployment(ray_actor_options={"num_cpus": 0.01})
class Callee:
    def size(self, arr: np.ndarray) -> int:
        return int(arr.nbytes)


@serve.deployment(ray_actor_options={"num_cpus": 0.01})
class Caller:
    def __init__(self, callee):
        self.callee = _direct(callee)  # the router's handles

    async def send(self, nbytes: int) -> int | str:
        try:
            return await self.callee.size.remote(np.ones(nbytes, dtype=np.uint8))
        except Exception as e:  # noqa: BLE001 - the test reads what went wrong
            return repr(e)


def _app(env: dict):
    opts = {"num_cpus": 0.01, "runtime_env": {"env_vars": env}}
    return Caller.options(ray_actor_options=opts).bind(Callee.options(ray_actor_options=opts).bind())


@pytest.mark.parametrize("env, ok", [(SERVE_REPLICA_ENV, True), ({}, False)], ids=["app-env", "serve-default"])
def test_a_call_above_4_mib_reaches_the_replica(ray_cluster, env, ok):
    name = f"transport-{'app' if ok else 'default'}"
    handle = serve.run(_app(env), name=name, route_prefix=None)
    try:
        got = handle.send.remote(PAYLOAD).result(timeout_s=60)
        if ok:
            assert got == PAYLOAD
        else:  # Serve's own default refuses it: what the app's env is for
            assert "larger than max" in str(got), got
    finally:
        serve.delete(name)
