"""Deployment handles for tests that drive the real Batcher (or ingress) in process, no cluster:
`handle.method.remote(...)` awaits the in-process implementation."""
from __future__ import annotations

import asyncio


class Method:
    """A handle's method: `.remote(...)` is the coroutine of `fn(...)`."""

    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


class FakeTarget:
    """A Target handle over an in-process `TargetWorker`: verify fails its first `failures` calls
    with `error()` (and every call from `fail_from` on with a ValueError), hangs with `hang`, and
    otherwise runs `worker`."""

    def __init__(self, worker=None, failures: int = 0, error=None, hang: bool = False, fail_from: int | None = None):
        self.worker, self.failures, self.error, self.hang, self.fail_from = worker, failures, error, hang, fail_from
        self.calls = 0
        self.down = False  # `ready` (the health probe) raises
        self.verify, self.release, self.ready = Method(self._verify), Method(self._release), Method(self._ready)

    def options(self, **_):
        return self

    async def _verify(self, batch, draft, pin=None, avoid=None, room=None):
        self.calls += 1
        if self.hang:
            await asyncio.Event().wait()
        if self.calls <= self.failures:
            raise self.error()
        if self.fail_from is not None and self.calls >= self.fail_from:
            raise ValueError("boom")
        return "replica-b", self.worker.verify(batch, draft)

    async def _release(self, ids, pin=None):
        if self.worker is not None:
            self.worker.release(ids)

    async def _ready(self, build=None):
        if self.hang:
            await asyncio.Event().wait()
        if self.down:
            raise RuntimeError("no replica")
        return "replica-b"


class FakeDraft:
    """A Draft handle over an in-process proposer."""

    def __init__(self, proposer):
        self.proposer = proposer
        self.propose, self.release = Method(self._propose), Method(self._release)

    def options(self, **_):
        return self

    async def _propose(self, batch, pin=None, avoid=None):
        return "draft-a", self.proposer.propose(batch)

    async def _release(self, ids, pin=None):
        self.proposer.release(ids)
