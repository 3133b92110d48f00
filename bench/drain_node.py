"""What a worker pod's preStop hook does to a stream in flight: drain the Ray node, or `ray stop` it.

A local cluster of three nodes on this machine (`ray.cluster_utils.Cluster`): a head with no CPUs,
node A with a streaming Serve replica (one line per second, `graceful_shutdown_timeout_s` 60), and
node B, added while the stream runs. Then either A is drained (`ray drain-node`, what
docker/drain-node.sh asks for) or A's processes are killed (what a bare `ray stop` does). The
table says how much of the stream the client got, when the old replica ended, and where the next
request is served.

    python bench/drain_node.py
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import threading
import time

LINES = 20


def run(mode: str) -> dict:
    import ray
    import requests
    from ray import serve
    from ray.cluster_utils import Cluster
    from ray.util.state import list_actors
    from starlette.responses import StreamingResponse

    @serve.deployment(ray_actor_options={"num_cpus": 0.5}, graceful_shutdown_timeout_s=60)
    class Stream:
        async def __call__(self, request):
            async def lines():
                for i in range(LINES):
                    yield f"{i} {ray.get_runtime_context().get_node_id()[:8]}\n"
                    await asyncio.sleep(1)
            return StreamingResponse(lines())

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        node_a = cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
        serve.run(Stream.bind(), route_prefix="/")
        got: list[str] = []
        error: list[str] = []

        def client():
            try:
                with requests.get("http://127.0.0.1:8000/", stream=True, timeout=120) as r:
                    got.extend(line.decode() for line in r.iter_lines())
            except Exception as e:  # noqa: BLE001 - reported in the table
                error.append(type(e).__name__)

        t0 = time.time()
        thread = threading.Thread(target=client)
        thread.start()
        time.sleep(3)
        node_b = cluster.add_node(num_cpus=1)
        if mode == "drain":
            subprocess.run(["ray", "drain-node", "--address", cluster.address, "--node-id", node_a.node_id,
                            "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "bench",
                            "--deadline-remaining-seconds", "120"], check=True, capture_output=True)
        else:
            cluster.remove_node(node_a)
        old_gone = None
        while old_gone is None and time.time() - t0 < 120:
            alive = list_actors(filters=[("class_name", "=", "ServeReplica:default:Stream"), ("state", "=", "ALIVE")])
            if not any(a.node_id == node_a.node_id for a in alive):
                old_gone = time.time() - t0
            time.sleep(0.5)
        thread.join()
        with requests.get("http://127.0.0.1:8000/", stream=True, timeout=60) as r:
            next_from = next(r.iter_lines()).decode().split()[1]
        where = {node_a.node_id[:8]: "A", node_b.node_id[:8]: "B"}
        return {"mode": mode, "lines": len(got), "error": error[0] if error else "-",
                "old_gone_s": old_gone, "next_from": where.get(next_from, next_from)}
    finally:
        ray.shutdown()
        cluster.shutdown()


def main() -> None:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    rows = [run(mode) for mode in ("drain", "ray stop")]
    print(f"| preStop | stream lines received (of {LINES}) | stream error | old replica gone after (s) "
          "| next request served by |")
    print("|---|---|---|---|---|")
    for r in rows:
        gone = "-" if r["old_gone_s"] is None else f"{r['old_gone_s']:.1f}"
        print(f"| {r['mode']} | {r['lines']} | {r['error']} | {gone} | node {r['next_from']} |")


if __name__ == "__main__":
    main()
