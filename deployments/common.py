"""Helpers shared by the deployments: threads, replica identity, rate windows."""
from __future__ import annotations

import os
import time
from collections import deque

import torch


def set_torch_threads(n: int) -> None:
    """Ray sets torch to one thread in replicas with fractional num_cpus: choose explicitly."""
    n = n or int(os.environ.get("SPECDEC_NUM_THREADS", "0")) or (os.cpu_count() or 1)
    torch.set_num_threads(max(1, n))


def replica_id() -> str:
    """This Serve replica's unique id ('' outside Serve)."""
    try:
        from ray import serve
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - not inside a replica
        return ""


class RateWindow:
    """Events per second over a sliding window (for autoscaling stats)."""

    def __init__(self, window_s: float = 10.0):
        self.window_s = window_s
        self.events: deque[tuple[float, float]] = deque()
        self.busy: deque[tuple[float, float]] = deque()

    def add(self, amount: float, busy_s: float = 0.0) -> None:
        now = time.monotonic()
        self.events.append((now, amount))
        if busy_s:
            self.busy.append((now, busy_s))
        self._trim(now)

    def _trim(self, now: float) -> None:
        for q in (self.events, self.busy):
            while q and q[0][0] < now - self.window_s:
                q.popleft()

    def rate(self) -> float:
        self._trim(time.monotonic())
        return sum(a for _, a in self.events) / self.window_s

    def busy_fraction(self) -> float:
        self._trim(time.monotonic())
        return min(1.0, sum(b for _, b in self.busy) / self.window_s)
