"""Helpers shared by the deployments: threads, replica identity."""
from __future__ import annotations

import os

import torch

from specdec import envs


def set_torch_threads(n: int) -> None:
    """Ray sets torch to one thread in replicas with fractional num_cpus: choose explicitly."""
    n = n or envs.NUM_THREADS or (os.cpu_count() or 1)
    torch.set_num_threads(max(1, n))


def replica_id() -> str:
    """This Serve replica's unique id ('' outside Serve)."""
    try:
        from ray import serve
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - not inside a replica
        return ""
