"""What the deployments share: the model-runtime settings (one definition of dtype, device,
max_model_len and threads, inherited by each model deployment's config), the tracing setup, the
model thread, replica identity."""
from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Literal

import torch
from pydantic import BaseModel, Field

from specdec import envs

Dtype = Annotated[Literal["float32", "bfloat16", "float16"], Field(description="Weights and activations dtype.")]
Device = Annotated[Literal["cpu", "cuda"], Field(description="Where the model runs (cuda: one GPU per TP rank).")]
MaxModelLen = Annotated[int, Field(ge=16, description="Longest sequence (prompt + output) in tokens.")]
NumThreads = Annotated[int, Field(ge=0, description="torch threads per model process (0: SPECDEC_NUM_THREADS, else all cores).")]
ForwardTimeout = Annotated[float, Field(gt=0, description="A model call (one verify or proposal) running longer than this fails the replica's health check, so Serve replaces a replica whose forward hangs; also the timeout of a tensor-parallel group's collectives (a rank that failed alone). Longer than the longest prefill.")]


class Traced(BaseModel):
    """A deployment whose replicas (and the processes they start) install the app's tracing."""

    tracing_env: dict[str, str] = Field(
        default_factory=dict, description="Environment variables that set up tracing in each replica and "
        "the processes it starts (AppArgs.tracing_env; deployments.tracing.ensure_provider). In the "
        "config, not the runtime_env: a Serve config's ray_actor_options replace the whole runtime_env.")


class ModelRuntime(Traced):
    """How a model replica runs: the settings every model-holding deployment shares."""

    dtype: Dtype = "float32"
    device: Device = "cpu"
    max_model_len: MaxModelLen = 2048
    num_threads: NumThreads = 0
    forward_timeout_s: ForwardTimeout = 300.0


def set_torch_threads(n: int) -> None:
    """Ray sets torch to one thread in replicas with fractional num_cpus: choose explicitly."""
    n = n or envs.NUM_THREADS or (os.cpu_count() or 1)
    torch.set_num_threads(max(1, n))


class ModelThread:
    """The one thread that runs all of a replica's torch work (loading, forwards, releases).

    Serve runs a replica's sync methods on a thread pool, so consecutive calls land on different
    threads, and each thread that runs a parallel torch op keeps its own OpenMP team, whose
    workers spin after every op. Two teams on two cores slow each other down: measured on this
    project's 2-core machines, a bfloat16 SmolLM2 step took 20-22 ms on one thread and 35-38 ms
    when the model had been loaded on one thread and stepped on another (a 1x576 @ 576x1536
    bf16 matmul: 40 us vs 89 us). Methods that do model work are `async` and hand it here.
    """

    def __init__(self, num_threads: int, name: str = "model"):
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.run(set_torch_threads, num_threads)
        self._busy_since: float | None = None  # when the running call began (None: idle)

    def run(self, fn, *args, **kwargs):
        """Run `fn` on the model thread and wait for it (construction-time work)."""
        return self._executor.submit(fn, *args, **kwargs).result()

    async def call(self, fn, *args, **kwargs):
        """Run `fn` on the model thread without blocking the replica's event loop."""
        return await asyncio.wrap_future(self._executor.submit(self._timed, fn, *args, **kwargs))

    def _timed(self, fn, *args, **kwargs):
        self._busy_since = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            self._busy_since = None

    def check_not_stuck(self, timeout_s: float) -> None:
        """Raise (a failed health check) when the call running now began over `timeout_s` ago:
        the thread is stuck, and every call queued behind it with it."""
        since = self._busy_since
        if since is not None and (busy := time.monotonic() - since) > timeout_s:
            raise TimeoutError(f"a model call has been running for {busy:.0f}s (forward_timeout_s={timeout_s:g})")


class HoldsRows:
    """A replica that keeps per-sequence state (KV rows, draft caches) and frees it on its model thread."""

    id: str
    thread: ModelThread

    def _free(self, seq_ids: list[int]) -> None:
        raise NotImplementedError

    async def release(self, seq_ids: list[int], pin: str | None = None) -> None:
        """Free the sequences' state. A release meant for another replica (`pin`: one that is gone, so
        the request router sent it here) frees nothing: these ids may be rows this replica has just
        taken over."""
        if pin is not None and pin != self.id:
            return
        await self.thread.call(self._free, seq_ids)


def replica_id() -> str:
    """This Serve replica's unique id ('' outside Serve)."""
    try:
        from ray import serve
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - not inside a replica
        return ""


def short_error(e: BaseException) -> str:
    """`Type: first line` of an exception, unwrapping Ray's task errors (whose text is a traceback)."""
    from ray.exceptions import RayTaskError
    if isinstance(e, RayTaskError) and e.cause is not None:
        e = e.cause
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
