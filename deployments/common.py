"""What the deployments share: the model-runtime settings (one definition of dtype, device,
max_model_len and threads, inherited by each model deployment's config), threads, replica identity."""
from __future__ import annotations

import os
from typing import Annotated, Literal

import torch
from pydantic import BaseModel, Field

from specdec import envs

Dtype = Annotated[Literal["float32", "bfloat16", "float16"], Field(description="Weights and activations dtype.")]
Device = Annotated[Literal["cpu", "cuda"], Field(description="Where the model runs (cuda: one GPU per TP rank).")]
MaxModelLen = Annotated[int, Field(ge=16, description="Longest sequence (prompt + output) in tokens.")]
NumThreads = Annotated[int, Field(ge=0, description="torch threads per model process (0: SPECDEC_NUM_THREADS, else all cores).")]


class ModelRuntime(BaseModel):
    """How a model replica runs: the settings every model-holding deployment shares."""

    dtype: Dtype = "float32"
    device: Device = "cpu"
    max_model_len: MaxModelLen = 2048
    num_threads: NumThreads = 0


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
