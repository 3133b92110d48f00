"""docker/drain-node.sh, the Ray worker pods' preStop hook, run with a fake `ray` CLI and processes
titled like Serve's (their own title, so the session's real Ray cluster does not count)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "docker" / "drain-node.sh"

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")


@pytest.fixture
def fake_ray(tmp_path):
    """A `ray` on PATH that logs each call with its time; `drain-node` exits with $DRAIN_RC."""
    bin_dir, log = tmp_path / "bin", tmp_path / "ray.log"
    bin_dir.mkdir()
    (bin_dir / "ray").write_text(
        f'#!/bin/sh\necho "$(date +%s.%N) $*" >> {log}\n'
        'if [ "$1" = drain-node ]; then exit "${DRAIN_RC:-0}"; fi\n')
    (bin_dir / "ray").chmod(0o755)
    return bin_dir, log


def _calls(log: Path) -> list[tuple[float, str]]:
    return [(float(t), args) for t, _, args in (line.partition(" ") for line in log.read_text().splitlines())]


def _serve_process(title: str, seconds: float) -> subprocess.Popen:
    """A process titled `title` for `seconds` (returned once its title is set: bash execs first)."""
    proc = subprocess.Popen(["bash", "-c", f'exec -a "{title}" sleep {seconds}'])
    cmdline = Path(f"/proc/{proc.pid}/cmdline")
    for _ in range(500):
        if cmdline.read_bytes().startswith(title.encode()):
            return proc
        time.sleep(0.01)
    proc.kill()
    raise AssertionError(f"{title} never ran")


def _run_hook(fake_ray, deadline_s: int, pattern: str, drain_rc: int = 0) -> float:
    bin_dir, _ = fake_ray
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SPECDEC_DRAIN_PROCESSES": pattern,
           "SPECDEC_DRAIN_POLL_S": "0.2", "DRAIN_RC": str(drain_rc), "SPECDEC_DRAIN_LOG": str(bin_dir.parent / "hook.log")}
    t0 = time.time()
    subprocess.run(["/bin/sh", str(SCRIPT), str(deadline_s)], env=env, check=True, timeout=60,
                   capture_output=True)
    return t0


def test_the_hook_drains_the_node_and_stops_ray_only_after_serve_left_it(fake_ray):
    tag = uuid.uuid4().hex[:8]
    started = time.time()
    replica = _serve_process(f"ray::ServeReplica:{tag}:Router", 2)
    _run_hook(fake_ray, 30, f"^ray::(ServeReplica|ProxyActor):{tag}")
    (t_drain, drain), (t_stop, stop) = _calls(fake_ray[1])
    assert drain.split() == ["drain-node", "--address", "auto", "--reason", "DRAIN_NODE_REASON_PREEMPTION",
                             "--reason-message", "pod", "terminating", "(preStop", "hook)",
                             "--deadline-remaining-seconds", "30"]  # (`auto`: this node's cluster, never a new one)
    assert stop == "stop"
    assert replica.poll() is not None and 2 <= t_stop - started < 30  # the replica's 2 s, not the deadline's 30
    assert "Serve left the node" in (fake_ray[1].parent / "hook.log").read_text()  # (the container's log)


def test_the_deadline_bounds_the_wait(fake_ray):
    tag = uuid.uuid4().hex[:8]
    replica = _serve_process(f"ray::ProxyActor:{tag}", 60)
    try:
        t0 = _run_hook(fake_ray, 2, f"^ray::(ServeReplica|ProxyActor):{tag}")
        (_, _), (t_stop, stop) = _calls(fake_ray[1])
        assert stop == "stop" and 0.9 <= t_stop - t0 < 30 and replica.poll() is None  # (whole seconds)
        assert "deadline reached" in (fake_ray[1].parent / "hook.log").read_text()
    finally:
        replica.kill()


def test_a_failed_drain_request_stops_ray_at_once(fake_ray):
    tag = uuid.uuid4().hex[:8]
    replica = _serve_process(f"ray::ServeReplica:{tag}:Router", 60)
    try:
        t0 = _run_hook(fake_ray, 30, f"^ray::ServeReplica:{tag}", drain_rc=1)
        (_, drain), (t_stop, stop) = _calls(fake_ray[1])
        assert drain.startswith("drain-node") and stop == "stop" and t_stop - t0 < 10 and replica.poll() is None
    finally:
        replica.kill()


def test_the_default_pattern_names_serve_replicas_and_proxies_not_the_rest(ray_cluster):
    """Matched against the process titles of the session's real cluster, with one replica up."""
    from ray import serve

    @serve.deployment(ray_actor_options={"num_cpus": 0.01})
    class DrainProbe:
        def __call__(self) -> str:
            return "ok"

    default = re.search(r"SPECDEC_DRAIN_PROCESSES:-'([^']+)'", SCRIPT.read_text()).group(1)
    serve.run(DrainProbe.bind(), name="drain-probe", route_prefix="/drain-probe")
    try:
        titles = set()
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                title = cmdline.read_bytes().split(b"\0")[0].decode(errors="replace").strip()
            except OSError:
                continue
            if title.startswith("ray::"):
                titles.add(title.split(".")[0])  # ("ray::Actor.method" while one runs)
        matched = {t for t in titles if re.search(default, t)}
        assert "ray::ServeReplica:drain-probe:DrainProbe" in matched and "ray::ProxyActor" in matched
        assert "ray::ServeController" in titles and not matched & {"ray::ServeController"}
    finally:
        serve.delete("drain-probe")
