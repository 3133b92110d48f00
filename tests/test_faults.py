"""Fault injection on a running app (tiny models, one local cluster): a draft replica killed
mid-generation, a tensor-parallel worker killed mid-generation, clients that disconnect.
Faults are injected through Ray (`ray.kill`); every test is bounded in time."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from fake_handles import FakeTarget as _FakeTarget
from fake_handles import Method as _Method
from service_checks import assert_idle, assert_idle_async

pytestmark = pytest.mark.ray

GREEDY = {"temperature": 0, "ignore_eos": True}
PROMPTS = ["def add(a, b):", "import json\n", "class Foo:", "for i in range("]


def _replica_actors(app: str, deployment: str) -> dict[str, object]:
    """unique replica id -> actor handle of every live Serve replica of `deployment`."""
    import ray
    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    out = {}
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"].startswith(prefix):
            try:
                out[a["name"][len(prefix):]] = ray.get_actor(a["name"], namespace=a["namespace"])
            except ValueError:  # died meanwhile
                pass
    return out


def _stats_by_replica(app: str, deployment: str, calls: int = 12) -> dict[str, dict]:
    """Stats of the replicas of a deployment (calls land on replicas at random)."""
    from ray import serve
    h = serve.get_deployment_handle(deployment, app_name=app)
    out = {}
    for _ in range(calls):
        s = h.stats.remote().result(timeout_s=30)
        out[s["replica"]] = s
    return out


def _complete(url, model, prompt, max_tokens, **extra):
    r = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                  **GREEDY, **extra}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


async def _stream(c: httpx.AsyncClient, url, model, prompt, max_tokens, progress: dict, key):
    """Stream a completion; returns (status, text, error or None). `progress[key]` counts chunks."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, **GREEDY}
    text, error = [], None
    async with c.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            return r.status_code, "", json.loads(await r.aread())["error"]
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = chunk["error"]
                continue
            text.append(chunk["choices"][0]["text"])
            progress[key] = progress.get(key, 0) + 1
    return r.status_code, "".join(text), error


async def _run_streams_with_fault(url, model, prompts, max_tokens, fault, min_chunks=5, bound_s=120.0):
    """Start one stream per prompt, call `fault()` (in a thread: it may block on Ray) once every
    stream has produced `min_chunks` chunks, and return the streams' results (bounded: no stream
    may hang)."""
    progress: dict[int, int] = {}
    async with httpx.AsyncClient(timeout=bound_s) as c:
        tasks = [asyncio.ensure_future(_stream(c, url, model, p, max_tokens, progress, i))
                 for i, p in enumerate(prompts)]
        t0 = time.monotonic()
        while min(progress.get(i, 0) for i in range(len(prompts))) < min_chunks:
            assert time.monotonic() - t0 < 60, f"streams did not start: {progress}"
            assert not any(t.done() for t in tasks), "a stream ended before the fault"
            await asyncio.sleep(0.02)
        await asyncio.to_thread(fault)
        return await asyncio.wait_for(asyncio.gather(*tasks), timeout=bound_s)


# ---- (a) a draft replica dies mid-generation ---------------------------------------------------
@pytest.fixture(scope="module")
def draft_app(deploy, ray_cluster, tiny_dir, tiny_draft_dir):
    url = deploy("fdraft", {"target": str(tiny_dir), "draft": str(tiny_draft_dir), "proposer": "draft",
                            "max_model_len": 512, "dtype": "float32", "num_speculative_tokens": 3,
                            "draft_replicas": 2, "batch_wait_timeout_s": 0.05,
                            # pinned k: the adaptive policy would rightly stop drafting with this random
                            # draft (acceptance ~0), and the fault must hit a replica that holds lanes
                            "adaptive": False})
    yield url, tiny_dir.name
    from ray import serve
    serve.delete("fdraft")


@pytest.mark.asyncio
async def test_draft_replica_killed_mid_generation(draft_app):
    import ray
    url, model = draft_app
    n_tokens = 96
    plain = [_complete(url, model, p, n_tokens, num_speculative_tokens=0) for p in PROMPTS]
    short_ref = _complete(url, model, PROMPTS[0], 24, num_speculative_tokens=0)
    killed = {}

    def kill_busy_draft():
        stats = _stats_by_replica("fdraft", "Draft")
        busy = [rid for rid, s in stats.items() if s["active_sequences"] > 0]
        assert busy, stats  # the lanes really speculate on a draft replica
        actors = _replica_actors("fdraft", "Draft")
        for rid in busy:
            ray.kill(actors[rid], no_restart=True)
            killed[rid] = stats[rid]["pid"]

    t0 = time.monotonic()
    results = await _run_streams_with_fault(url, model, PROMPTS, n_tokens, kill_busy_draft)
    assert killed
    for (status, text, error), ref in zip(results, plain):
        assert status == 200 and error is None, (status, error)
        assert text == ref  # greedy: identical to plain decoding despite the lost draft replica
    assert time.monotonic() - t0 < 120
    # speculation resumes on the surviving / replacement replica, nothing is held afterwards
    deadline = time.monotonic() + 60
    while not (set(_replica_actors("fdraft", "Draft")) - set(killed)) and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    assert _complete(url, model, PROMPTS[0], 24) == short_ref
    await assert_idle_async("fdraft", url)
    # assert_idle polls one Draft replica per call; the lane's last draft release trails the
    # response and goes to the replica it is pinned to: wait (bounded) until every replica is idle.
    deadline = time.monotonic() + 30
    while True:
        stats = await asyncio.to_thread(_stats_by_replica, "fdraft", "Draft")
        if all(s["active_sequences"] == 0 for s in stats.values()) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.25)
    for rid, s in stats.items():
        assert rid not in killed and s["active_sequences"] == 0, s


# ---- (c) client disconnects ------------------------------------------------------------------
def test_chat_stream_disconnect_frees_slots(draft_app):
    url, model = draft_app
    body = {"model": model, "messages": [{"role": "user", "content": "tell me a long story"}], "max_tokens": 400,
            "stream": True, **GREEDY}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break  # leaving the block closes the connection mid-stream
    assert_idle("fdraft", url, timeout_s=30)


def test_non_streaming_client_timeout_frees_slots(draft_app):
    url, model = draft_app
    body = {"model": model, "prompt": "def long(", "max_tokens": 450, "n": 3, **GREEDY}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.25))
    assert_idle("fdraft", url, timeout_s=30)


@pytest.mark.asyncio
async def test_many_disconnects_leave_nothing_behind(draft_app):
    url, model = draft_app
    baseline = httpx.get(f"{url}/stats").json()["tasks"]

    async def hang_up(c, i):
        body = {"model": model, "prompt": f"x{i} =", "max_tokens": 300, "stream": True, **GREEDY}
        path = "/v1/completions"
        if i % 2:
            body = {**{k: v for k, v in body.items() if k != "prompt"},
                    "messages": [{"role": "user", "content": f"x{i}"}]}
            path = "/v1/chat/completions"
        async with c.stream("POST", f"{url}{path}", json=body) as r:
            n = 0
            async for _ in r.aiter_lines():
                n += 1
                if n > 3 + i % 5:
                    return

    async def main():
        async with httpx.AsyncClient(timeout=60) as c:
            await asyncio.gather(*[hang_up(c, i) for i in range(12)])
    await main()
    await assert_idle_async("fdraft", url, timeout_s=30, max_tasks=baseline)


# ---- (b) a tensor-parallel worker dies --------------------------------------------------------
@pytest.fixture(scope="module")
def tp_app(deploy, ray_cluster, tiny_dir):
    url = deploy("ftp", {"target": str(tiny_dir), "proposer": "ngram", "tp": 2, "max_model_len": 512,
                         "dtype": "float32", "target_cpus": 0.25, "batch_wait_timeout_s": 0.05})
    yield url, tiny_dir.name
    from ray import serve
    serve.delete("ftp")


@pytest.mark.asyncio
async def test_tp_worker_killed_mid_generation(tp_app):
    import ray
    from ray import serve
    url, model = tp_app
    n_tokens = 80
    prompts = PROMPTS[:2]
    ref = [_complete(url, model, p, n_tokens) for p in prompts]
    short_ref = [_complete(url, model, p, 24) for p in prompts]
    target = serve.get_deployment_handle("Target", app_name="ftp")
    before = await asyncio.wait_for(target.stats.remote(), 30)
    victims = await asyncio.wait_for(target.worker_handles.remote(), 30)
    assert len(victims) == 1

    t0 = time.monotonic()
    results = await _run_streams_with_fault(url, model, prompts, n_tokens,
                                            lambda: ray.kill(victims[0], no_restart=True), min_chunks=3, bound_s=150)
    elapsed = time.monotonic() - t0
    assert elapsed < 150  # none hangs
    for (status, text, error), r in zip(results, ref):
        assert status == 200
        if error is None:  # retried on the replacement replica (re-prefilled): same greedy output
            assert text == r
        else:  # or a clear 503, never a 500
            assert error["type"] == "server_error" and "target unavailable" in error["message"], error
    # the broken replica was replaced; new requests succeed on a new TP group
    deadline = time.monotonic() + 90
    while True:
        try:
            after = await asyncio.wait_for(target.stats.remote(), 10)
            if after["pid"] != before["pid"]:
                break
        except Exception:  # noqa: BLE001 - the broken group answers errors until replaced
            pass
        assert time.monotonic() < deadline, "target replica was not replaced"
        await asyncio.sleep(1.0)
    assert after["tp_worker_pids"] and after["tp_worker_pids"][0] not in before["tp_worker_pids"]
    assert [_complete(url, model, p, 24) for p in prompts] == short_ref
    await assert_idle_async("ftp", url)


def test_a_forward_that_fails_on_rank_0_alone_breaks_the_group(ray_cluster, monkeypatch):
    """Rank 0 failing mid-forward while another rank still waits in that forward's collectives
    (an allocation failure on rank 0 alone): the next forward's collectives would pair with the
    waiting ones, stalling it for forward_timeout_s (300 s). The failure now marks the group
    broken; one that every rank hit alike stays the original error (the group is in step)."""
    import ray
    import deployments.target as T
    monkeypatch.setattr(T, "OUT_OF_STEP_WAIT_S", 2.0)

    @ray.remote(num_cpus=0)
    class Rank:
        def __init__(self, waits: bool):
            self.waits = waits

        def ready(self, tensor) -> bool:  # (a tensor: torch imported, as in a group's workers)
            return True

        def forward(self, *args):
            if self.waits:
                time.sleep(30)  # parked in rank 0's remaining collectives
            raise RuntimeError("the same allocation failed here")

    class Rank0:
        args = None

        def __call__(self, *args):
            raise RuntimeError("cannot allocate memory")
    waiting, failing = Rank.remote(True), Rank.remote(False)
    try:
        import torch
        tokens = torch.zeros(1, 1, dtype=torch.long)
        ray.get([waiting.ready.remote(tokens), failing.ready.remote(tokens)])  # (started, as a group's workers are)
        with pytest.raises(T.RanksOutOfStep, match="1 rank"):
            T.TPGroupModel(Rank0(), [waiting])(tokens, tokens, tokens)
        with pytest.raises(RuntimeError, match="cannot allocate") as in_step:
            T.TPGroupModel(Rank0(), [failing])(tokens, tokens, tokens)
        assert not isinstance(in_step.value, T.RanksOutOfStep)
        replica = object.__new__(T.TargetDeployment)
        assert replica._group_broken(T.RanksOutOfStep("rank 0 failed mid-forward"))
    finally:
        ray.kill(waiting)
        ray.kill(failing)


# ---- the batcher's fault handling, in process (fake deployment handles, no cluster) ------------
def _target_fault():
    import ray.exceptions
    from deployments.target import TargetFault
    return ray.exceptions.RayTaskError("verify", "Traceback: ...", TargetFault("worker died")).as_instanceof_cause()


def _batcher(tiny_dir, target, **cfg):
    from deployments.batcher import Batcher
    return Batcher({"tokenizer": str(tiny_dir), "speculate": False, "max_model_len": 256,
                       "batch_wait_timeout_s": 0, **cfg}, None, target)


async def _generate(batcher, prompt_ids, max_tokens):
    from specdec.sampling import SamplingParams
    [seq] = batcher.submit([prompt_ids], [SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)])
    try:
        while not seq.finished:
            await batcher.wait(seq)
        return seq.output_ids
    finally:
        batcher.finish(seq)


def _new_worker(tiny_dir, slots: int = 4):
    import torch
    from specdec.loader import load_model
    from specdec.target_worker import TargetWorker
    return TargetWorker(load_model(tiny_dir, dtype=torch.float32), slots, 256)


async def _drain(batcher, seqs):
    for s in seqs:
        while not s.finished:
            await batcher.wait(s)
        batcher.finish(s)
    for _ in range(200):
        if not batcher.lanes and not batcher._background:
            break
        await asyncio.sleep(0.02)


@pytest.fixture(scope="module")
def tiny_worker(tiny_dir):
    return _new_worker(tiny_dir)


@pytest.mark.asyncio
async def test_batcher_retries_a_broken_target_group_and_output_is_unchanged(tiny_dir, tiny_worker):
    ok = _batcher(tiny_dir, _FakeTarget(tiny_worker))
    ref = await _generate(ok, [5, 6, 7], 12)
    flaky = _FakeTarget(tiny_worker, failures=2, error=_target_fault)
    out = await _generate(_batcher(tiny_dir, flaky), [5, 6, 7], 12)
    assert out == ref and flaky.calls > 2
    assert len(tiny_worker.table) == 0


@pytest.mark.parametrize("kind", ["target-fault", "actor-died", "no-replica-answers"])
@pytest.mark.asyncio
async def test_batcher_gives_503_past_the_retry_deadline(tiny_dir, kind):
    import ray.exceptions
    from deployments.batcher import RequestFailed
    target = {"target-fault": lambda: _FakeTarget(failures=10**9, error=_target_fault),
              "actor-died": lambda: _FakeTarget(failures=10**9, error=ray.exceptions.ActorDiedError),
              "no-replica-answers": lambda: _FakeTarget(hang=True)}[kind]()

    batcher = _batcher(tiny_dir, target, retry_deadline_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(RequestFailed) as e:
        await asyncio.wait_for(_generate(batcher, [5, 6, 7], 8), timeout=10)
    for _ in range(100):  # the lane winds down
        if not batcher.lanes:
            break
        await asyncio.sleep(0.02)
    err, elapsed = e.value, time.monotonic() - t0
    assert err.status == 503 and "target unavailable" in str(err)
    assert elapsed < 5
    assert not batcher.lanes and not batcher.queue and not batcher.events and not batcher.errors


@pytest.mark.asyncio
async def test_batcher_fails_a_lane_cleanly_on_an_application_error(tiny_dir):
    from deployments.batcher import RequestFailed

    batcher = _batcher(tiny_dir, _FakeTarget(failures=10**9, error=lambda: ValueError("boom")))
    with pytest.raises(RequestFailed) as e:
        await asyncio.wait_for(_generate(batcher, [5, 6, 7], 8), timeout=10)
    assert e.value.status == 500


@pytest.mark.asyncio
async def test_batcher_cancelled_lane_fails_its_requests_instead_of_hanging(tiny_dir):
    from deployments.batcher import RequestFailed

    batcher = _batcher(tiny_dir, _FakeTarget(hang=True))
    gen = asyncio.ensure_future(_generate(batcher, [5, 6, 7], 8))
    while not batcher.lanes:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    batcher.lanes[0].task.cancel()  # e.g. the replica shuts down
    with pytest.raises(RequestFailed) as e:
        await asyncio.wait_for(gen, timeout=10)
    assert e.value.status == 503


class _FlakyDraft:
    """A Draft handle (n-gram proposer in process) whose calls fail while `down` is set."""

    def __init__(self):
        from specdec.proposers import NgramProposer
        self.proposer = NgramProposer()
        self.calls = self.failed = 0
        self.down = False
        self.propose, self.release = _Method(self._propose), _Method(self._release)

    async def _propose(self, batch, pin=None, avoid=None):
        import ray.exceptions
        self.calls += 1
        if self.down:
            self.failed += 1
            self.down = self.failed < 2  # a replacement replica answers from the next call on
            raise ray.exceptions.ActorDiedError()
        if self.calls == 4:
            self.down = True  # dies after three good rounds
        return "draft-a", self.proposer.propose(batch)

    async def _release(self, ids, pin=None):
        self.proposer.release(ids)


@pytest.mark.asyncio
async def test_batcher_runs_plain_rounds_while_the_draft_is_down(tiny_dir, tiny_worker):
    from deployments.batcher import Batcher
    from specdec.sampling import SamplingParams

    plain = await _generate(_batcher(tiny_dir, _FakeTarget(tiny_worker)), [5, 6, 7, 5, 6, 7, 5, 6], 60)
    draft = _FlakyDraft()
    batcher = Batcher({"tokenizer": str(tiny_dir), "max_model_len": 256, "batch_wait_timeout_s": 0,
                         "draft_backoff_s": 0.05, "num_speculative_tokens": 3, "adaptive": False}, draft,
                         _FakeTarget(tiny_worker))

    [seq] = batcher.submit([[5, 6, 7, 5, 6, 7, 5, 6]], [SamplingParams(max_tokens=60, temperature=0,
                                                                      ignore_eos=True)])
    while not seq.finished:
        await batcher.wait(seq)
    batcher.finish(seq)
    for _ in range(100):
        if not batcher.lanes:
            break
        await asyncio.sleep(0.02)
    assert seq.output_ids == plain  # greedy: unchanged by the lost drafts
    assert draft.failed == 2 and draft.calls > draft.failed + 3  # it failed, then speculation resumed
    assert sum(batcher.engine_stats()["draft_failures"].values()) == draft.failed  # counted (/stats), not only logged
    assert seq.proposed > 0
    assert draft.proposer.num_active == 0 and len(tiny_worker.table) == 0  # nothing leaked on either side


class _SlowOnceDraft(_FlakyDraft):
    """A live but slow draft replica: the first call that carries releases outlasts the timeout."""

    def __init__(self):
        super().__init__()
        self.slowed = False

    async def _propose(self, batch, pin=None, avoid=None):
        self.calls += 1
        if batch.release and not self.slowed:
            self.slowed = True
            await asyncio.sleep(2.0)  # the batcher gives up first (draft_timeout_s)
        return "draft-a", self.proposer.propose(batch)


class _ErrorOnceDraft(_SlowOnceDraft):
    """A live draft replica whose first call that carries releases raises (a bug, a bad batch)."""

    async def _propose(self, batch, pin=None, avoid=None):
        self.calls += 1
        if batch.release and not self.slowed:
            self.slowed = True
            raise ValueError("proposer failed")
        return "draft-a", self.proposer.propose(batch)


class _UnavailableOnceTarget(_FakeTarget):
    """ActorUnavailableError on the first verify that carries releases (the actor comes back)."""

    def __init__(self, worker):
        super().__init__(worker)
        self.failed = False

    async def _verify(self, batch, draft, pin=None, avoid=None, room=None):
        import ray.exceptions
        self.calls += 1
        if batch.release and not self.failed:
            self.failed = True
            raise ray.exceptions.ActorUnavailableError("unreachable for a moment", None)
        return "replica-b", self.worker.verify(batch, draft)


@pytest.mark.parametrize("fault", ["draft-timeout", "draft-error", "target-unavailable"])
@pytest.mark.asyncio
async def test_batcher_keeps_releases_across_failed_calls(tiny_dir, tiny_worker, fault):
    """Releases carried by a call that failed are delivered later: a slow draft replica, one whose
    call raised, or a target replica that was unreachable for a moment frees every finished
    sequence's slot."""
    from deployments.batcher import Batcher
    from specdec.sampling import SamplingParams

    draft = _ErrorOnceDraft() if fault == "draft-error" else _SlowOnceDraft()
    draft.slowed = not fault.startswith("draft")  # fails once only in the draft cases
    target = _UnavailableOnceTarget(tiny_worker) if fault == "target-unavailable" else _FakeTarget(tiny_worker)

    batcher = Batcher({"tokenizer": str(tiny_dir), "max_model_len": 256, "batch_wait_timeout_s": 0,
                         "draft_timeout_s": 0.3, "draft_backoff_s": 0.0, "num_speculative_tokens": 2,
                         "adaptive": False}, draft, target)
    seqs = batcher.submit([[5, 6, 7, 5, 6, 7]], [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
                                              for n in (2, 40)])
    await _drain(batcher, seqs)
    assert draft.slowed and (fault.startswith("draft") or target.failed)  # the fault happened
    assert draft.proposer.num_active == 0 and len(tiny_worker.table) == 0  # nothing leaked on either side


@pytest.mark.asyncio
async def test_batcher_one_large_n_request_does_not_lock_out_other_clients(tiny_dir, tiny_worker):
    """An n = 8 request on a batcher with 4 rows holds at most max_request_share (2 rows): a later
    single-sample request starts at once and finishes long before the large one's first wave."""
    from specdec.sampling import SamplingParams

    batcher = _batcher(tiny_dir, _FakeTarget(tiny_worker), max_batch_size=2, max_lanes=2,
                     max_request_share=0.5)
    # the first wave is long (160 tokens) against the client's 5, whatever the machine's speed
    greedy = SamplingParams(max_tokens=160, temperature=0, ignore_eos=True)
    big = batcher.submit([[5, 6, 7]], [greedy] * 8)
    held = []

    async def watch():
        while True:
            held.append(sum(s in big for l in batcher.lanes for s in (*l.scheduler.running, *l.scheduler.waiting)))
            await asyncio.sleep(0.002)
    watcher = asyncio.ensure_future(watch())
    while not any(s.num_output for s in big):  # the big request runs (no wall-clock wait)
        await asyncio.sleep(0.002)
    small = await asyncio.wait_for(_generate(batcher, [9, 10, 11], 5), timeout=30)
    done_early = sum(s.finished for s in big)
    while not all(s.finished for s in big):
        await asyncio.gather(*(batcher.wait(s) for s in big if not s.finished))
    watcher.cancel()
    outs = [s.output_ids for s in big]
    for s in big:
        batcher.finish(s)
    assert len(small) == 5
    assert done_early == 0  # before: the 8 samples took all 4 rows and queued ahead of the client
    assert max(held) == 2  # never more than its share of the rows
    assert all(len(o) == 160 and o == outs[0] for o in outs)  # every sample ran (greedy: identical)
    assert not batcher.queue and not batcher.events
    assert len(tiny_worker.table) == 0


class _TwoReplicas:
    """Two in-process replicas ("a", "b") of a deployment behind a fake handle: `replicas` maps
    each name to its worker or proposer; a release goes to the pinned one, or to both."""

    def __init__(self, replicas: dict):
        self.replicas = replicas

    def options(self, **_):
        return self

    @staticmethod
    def _route(pin, avoid) -> str:
        """As the affinity router: the pin, else the first replica not avoided."""
        return pin or next((n for n in "ab" if n not in (avoid or ())), "a")

    async def _release(self, ids, pin=None):
        for name, r in self.replicas.items():
            if pin in (None, name):
                r.release(ids)


class _TwoReplicaTarget(_TwoReplicas):
    """Two Target replicas ("a", "b"), each with its own worker; the first pinned verify that
    reaches "a" after `fail_after` calls raises ActorUnavailableError once ("a" stays alive and
    still answers releases), and unpinned calls go to "b" from then on."""

    def __init__(self, workers: dict, fail_after: int = 2):
        super().__init__(workers)
        self.fail_after, self.calls, self.failed = fail_after, 0, False
        self.verify, self.release = _Method(self._verify), _Method(self._release)

    async def _verify(self, batch, draft, pin=None, avoid=None, room=None):
        import ray.exceptions
        self.calls += 1
        name = pin or ("b" if self.failed else "a")
        if name == "a" and self.calls > self.fail_after and not self.failed:
            self.failed = True
            raise ray.exceptions.ActorUnavailableError("unreachable for a moment", None)
        return name, self.replicas[name].verify(batch, draft)


@pytest.mark.asyncio
async def test_batcher_frees_the_live_rows_on_a_replica_that_was_unavailable_for_a_moment(tiny_dir):
    """A lane re-prefilled on replica b after replica a was unreachable (it came back) frees the
    rows a still holds: no slot on either replica outlives the request."""
    from specdec.sampling import SamplingParams

    workers = {"a": _new_worker(tiny_dir), "b": _new_worker(tiny_dir)}
    target = _TwoReplicaTarget(workers)
    batcher = _batcher(tiny_dir, target)
    seqs = batcher.submit([[5, 6, 7]], [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)] * 2)
    await asyncio.wait_for(_drain(batcher, seqs), timeout=30)
    assert target.failed and all(len(s.output_ids) == 12 for s in seqs)
    assert len(workers["a"].table) == 0 and len(workers["b"].table) == 0


class _HangOnReleaseTarget(_FakeTarget):
    """A Target whose verify hangs (never reaches the worker) once a call carries releases."""

    async def _verify(self, batch, draft, pin=None, avoid=None, room=None):
        self.calls += 1
        if batch.release:
            await asyncio.Event().wait()
        return "replica-b", self.worker.verify(batch, draft)


@pytest.mark.asyncio
async def test_batcher_delivers_the_releases_of_a_verify_that_timed_out(tiny_dir):
    """A lane that gives up on a target call (no answer by retry_deadline_s) still frees the
    finished rows that call carried, not only its live ones."""
    from deployments.batcher import RequestFailed
    from specdec.sampling import SamplingParams

    worker = _new_worker(tiny_dir)
    batcher = _batcher(tiny_dir, _HangOnReleaseTarget(worker), retry_deadline_s=0.5)
    short, long = batcher.submit([[5, 6, 7]], [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
                                                for n in (2, 40)])
    with pytest.raises(RequestFailed) as e:
        await asyncio.wait_for(_drain(batcher, [short, long]), timeout=30)
    assert e.value.status == 503 and short.finish_reason == "length"
    batcher.finish(long)
    await asyncio.wait_for(_drain(batcher, []), timeout=30)
    assert len(worker.table) == 0


@pytest.mark.asyncio
async def test_a_slot_no_router_sends_any_more_is_taken_back(tiny_dir):
    """A replica whose only slot is held by a sequence no router sends any more (its router
    crashed, or a release was lost) takes the slot back once it has been idle a while: the next
    request runs instead of waiting for it forever."""
    import time
    worker = _new_worker(tiny_dir, slots=1)
    worker.table.allocate(10**12).used = time.monotonic() - 60  # idle for a minute
    batcher = _batcher(tiny_dir, _FakeTarget(worker))
    out = await asyncio.wait_for(_generate(batcher, [5, 6, 7], 4), timeout=30)
    assert len(out) == 4 and worker.table.evicted == 1
    await asyncio.wait_for(_drain(batcher, []), timeout=30)
    assert len(worker.table) == 0


def test_sequence_ids_differ_across_processes():
    """Router replicas share Target and Draft replicas, whose slots are keyed by sequence id: two
    processes must not number their sequences alike."""
    import subprocess
    import sys
    code = ("from specdec.sequence import Sequence; from specdec.sampling import SamplingParams; "
            "print(Sequence([1], SamplingParams()).seq_id)")
    ids = {int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
           for _ in range(2)}
    assert len(ids) == 2


def test_reconfigure_validates_before_it_applies(tiny_dir):
    """Runtime knobs (the Router's user_config) are converted and checked first: a bad value
    changes nothing, and max_batch_size cannot outgrow the KV slots the replicas were built with."""
    import math
    batcher = _batcher(tiny_dir, _FakeTarget(), max_batch_size=4)
    batcher.reconfigure({"max_batch_size": "2", "adaptive": "false", "plain_steps": 2.0})
    assert (batcher.cfg.max_batch_size, batcher.cfg.adaptive, batcher.cfg.plain_steps) == (2, False, 2)
    for bad in ({"max_batch_size": 0}, {"max_batch_size": 8}, {"batch_wait_timeout_s": math.inf},
                {"plain_steps": 2.5}):
        with pytest.raises(ValueError):
            batcher.reconfigure(bad)
        assert batcher.cfg.max_batch_size == 2 and batcher.cfg.batch_wait_timeout_s == 0
    batcher.reconfigure({"max_batch_size": 4})  # back up to what it was built with
    assert (batcher.cfg.adaptive, batcher.cfg.plain_steps) == (True, batcher.built.plain_steps)  # left out: built values
    batcher.reconfigure({"max_batch_size": 2})
    batcher.reconfigure({})  # as a replica started with this user_config
    assert batcher.cfg == batcher.built and batcher.cfg.max_batch_size == 4
    with pytest.raises(ValueError, match="built without speculation"):  # no Draft deployment: nothing to turn on
        batcher.reconfigure({"num_speculative_tokens": 4})
    batcher.reconfigure({"num_speculative_tokens": 0})


class _TwoTargets(_TwoReplicas):
    """Two in-process Target replicas routed like the affinity router; replica "a" hangs (alive)
    from its 4th call."""

    def __init__(self, path):
        import torch

        from specdec.loader import load_model
        from specdec.target_worker import TargetWorker
        super().__init__({n: TargetWorker(load_model(path, dtype=torch.float32), 4, 256) for n in "ab"})
        self.calls = {"a": 0, "b": 0}
        self.verify, self.release = _Method(self._verify), _Method(self._release)

    async def _verify(self, batch, draft, pin=None, avoid=None, room=None):
        name = self._route(pin, avoid)
        self.calls[name] += 1
        if name == "a" and self.calls["a"] > 3:
            await asyncio.Event().wait()  # a forward that never returns
        return name, self.replicas[name].verify(batch, draft)


@pytest.mark.asyncio
async def test_new_lanes_avoid_a_target_replica_that_did_not_answer(tiny_dir):
    """A forward that hangs keeps its replica alive (and healthy to Serve until forward_timeout_s):
    the lane on it fails at retry_deadline_s (a slow forward looks the same until then), and new
    lanes go to the other replica. Before, new lanes kept landing on the hung one and failing."""
    from deployments.batcher import Batcher, RequestFailed
    from specdec.sampling import SamplingParams
    t = _TwoTargets(tiny_dir)
    b = Batcher({"tokenizer": str(tiny_dir), "speculate": False, "max_model_len": 256, "batch_wait_timeout_s": 0,
                 "plain_steps": 1, "retry_deadline_s": 1.0}, None, t)
    outcomes = []
    for prompt in ([5, 6, 7], [8, 9, 10]):
        (s,) = b.submit([prompt], [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)])
        try:
            while not s.finished:
                await b.wait(s)
            outcomes.append(len(s.output_ids))
        except RequestFailed as e:
            outcomes.append(e.status)
        b.finish(s)
    assert outcomes == [503, 20] and "a" in b.suspects and t.calls["a"] == 4 and t.calls["b"] > 0


class _TwoDrafts(_TwoReplicas):
    """Two in-process Draft replicas routed like the affinity router; `stall(name, call)` is
    awaited after a call's proposal is computed (its slots taken), before it answers."""

    def __init__(self, make, stall):
        super().__init__({n: make() for n in "ab"})
        self.calls, self.stall = {"a": 0, "b": 0}, stall
        self.propose, self.release = _Method(self._propose), _Method(self._release)

    async def _propose(self, batch, pin=None, avoid=None):
        name = self._route(pin, avoid)
        self.calls[name] += 1
        out = self.replicas[name].propose(batch)
        await self.stall(name, self.calls[name])
        return name, out


@pytest.mark.asyncio
async def test_a_lane_leaves_a_hung_draft_replica(tiny_dir):
    """A Draft replica whose proposal hangs: after the draft timeout the lane drops its pin (and
    frees its state there in the background), and its next drafts go to the other replica; before,
    it went back to the hung one after every backoff, for a timeout each time."""
    import torch

    from deployments.batcher import Batcher
    from fake_handles import FakeTarget
    from specdec.loader import load_model
    from specdec.proposers.ngram import NgramProposer
    from specdec.sampling import SamplingParams
    from specdec.target_worker import TargetWorker

    async def hang(name, call):
        if name == "a" and call > 2:
            await asyncio.Event().wait()

    drafts = _TwoDrafts(lambda: NgramProposer(min_n=1, max_n=3), hang)
    target = FakeTarget(TargetWorker(load_model(tiny_dir, dtype=torch.float32), 4, 256))
    b = Batcher({"tokenizer": str(tiny_dir), "speculate": True, "max_model_len": 256, "batch_wait_timeout_s": 0,
                 "adaptive": False, "num_speculative_tokens": 2, "draft_timeout_s": 0.3, "draft_backoff_s": 0.05,
                 "plain_steps": 1},
                drafts, target)
    (s,) = b.submit([[5, 6, 7, 5, 6, 7, 5, 6]], [SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)])
    while not s.finished:
        await b.wait(s)
    b.finish(s)
    assert len(s.output_ids) == 200 and drafts.calls["a"] == 3 and drafts.calls["b"] > 3 and "a" in b.suspects


async def _outcome(b, s):
    """A request's token count, or its error status."""
    from deployments.batcher import RequestFailed
    try:
        while not s.finished:
            await b.wait(s)
        await b.wait(s)
        return len(s.output_ids)
    except RequestFailed as e:
        return e.status
    finally:
        b.finish(s)


@pytest.mark.asyncio
async def test_queued_requests_do_not_follow_a_failed_lane_onto_its_hung_replica(tiny_dir):
    """The lane whose Target call timed out takes the queued requests next: they start on the
    other replica (before, the lane kept its pin on the hung one, and each queued request failed
    after another retry_deadline_s), and the hung one is told to free the failed row."""
    from deployments.batcher import Batcher
    from specdec.sampling import SamplingParams
    t = _TwoTargets(tiny_dir)
    b = Batcher({"tokenizer": str(tiny_dir), "speculate": False, "max_model_len": 256, "batch_wait_timeout_s": 0,
                 "plain_steps": 1, "retry_deadline_s": 1.0, "max_lanes": 1, "max_batch_size": 1}, None, t)
    p = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    seqs = [b.submit([prompt], [p])[0] for prompt in ([5, 6, 7], [8, 9, 10], [11, 12, 13])]  # 2 queued
    outcomes = await asyncio.wait_for(asyncio.gather(*(_outcome(b, s) for s in seqs)), 20)
    assert outcomes == [503, 20, 20] and t.calls["a"] == 4 and "a" in b.suspects
    assert all(len(w.table) == 0 for w in t.replicas.values())  # (the release to "a" is the worker's own call)


@pytest.mark.asyncio
async def test_a_sequence_cancelled_during_a_draft_call_that_times_out_is_freed_there(tiny_dir, tiny_draft_dir):
    """A client leaves while its lane's Draft call is in flight, and the call then times out: the
    slow replica frees the cancelled row's slot too (before, only the rows still running were
    released there; the cancelled one's release went to the next replica)."""
    import torch

    from deployments.batcher import Batcher
    from fake_handles import FakeTarget
    from specdec.loader import load_model
    from specdec.proposers import build_proposer
    from specdec.sampling import SamplingParams
    from specdec.target_worker import TargetWorker

    slow = asyncio.Event()

    async def stall(name, call):  # "a" computes its third proposal (slots taken) but answers after 1 s
        if name == "a" and call == 3:
            slow.set()
            await asyncio.sleep(1.0)

    d = _TwoDrafts(lambda: build_proposer("draft", draft=str(tiny_draft_dir), num_slots=8, max_model_len=256), stall)
    target = FakeTarget(TargetWorker(load_model(tiny_dir, dtype=torch.float32), 4, 256))
    b = Batcher({"tokenizer": str(tiny_dir), "speculate": True, "max_model_len": 256, "batch_wait_timeout_s": 0,
                 "adaptive": False, "num_speculative_tokens": 2, "draft_timeout_s": 0.3, "draft_backoff_s": 0.05,
                 "plain_steps": 1, "max_batch_size": 2, "max_lanes": 1}, d, target)
    p = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    keep, cancel = (b.submit([prompt], [p])[0] for prompt in ([5, 6, 7, 5, 6], [9, 8, 7, 9, 8]))
    await asyncio.wait_for(slow.wait(), 10)
    assert cancel.seq_id in d.replicas["a"].table.seqs
    b.finish(cancel)  # the client disconnects mid-call
    assert await asyncio.wait_for(_outcome(b, keep), 20) == 60
    await _drain(b, [])
    await asyncio.sleep(1.0)  # the slow call ends too
    assert "a" in b.suspects and not d.replicas["a"].table.seqs and not d.replicas["b"].table.seqs
    assert len(target.worker.table) == 0


@pytest.mark.asyncio
async def test_a_target_call_that_fails_keeps_the_releases_it_carried(tiny_dir):
    """A Target call that fails with an application error before the replica ran it (a transport
    error, say) fails its lane (500); the finished sequence's release it carried is sent with the
    lane's final flush (before, it was lost and the slot stayed taken)."""
    from fake_handles import FakeTarget
    from specdec.sampling import SamplingParams
    worker = _new_worker(tiny_dir)
    target = FakeTarget(worker, fail_from=4)  # calls 1-3 run, the 4th (carrying the release) raises
    b = _batcher(tiny_dir, target, plain_steps=1, max_batch_size=2, max_lanes=1)
    short, long = (b.submit([prompt], [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)])[0]
                   for prompt, n in (([5, 6, 7], 3), ([8, 9, 10], 50)))
    assert [await _outcome(b, short), await _outcome(b, long)] == [3, 500]
    await _drain(b, [])
    await asyncio.sleep(0.3)  # (a lane leaves `lanes` before its final releases are awaited)
    assert len(worker.table) == 0


def test_suspected_replicas_are_forgotten_once_their_time_is_up(tiny_dir):
    import time
    b = _batcher(tiny_dir, _FakeTarget())
    b.suspects = {"gone": time.monotonic() - 1, "recent": time.monotonic() + 30}
    b._suspect("new")
    assert set(b.suspects) == {"recent", "new"}


def test_a_draft_replica_never_takes_its_own_drafts_for_confirmed_tokens(tiny_draft_dir):
    """A lane that left a Draft replica and came back before the release it sent there arrived
    sends an offset counting tokens another replica confirmed: past this replica's confirmed
    tokens, where it holds its own tentative drafts. The row is unknown there (re-prefilled);
    before, the drafts passed for context and every later draft of the row was drawn from it."""
    import torch

    from specdec.loader import load_model
    from specdec.metadata import SpecBatch
    from specdec.proposers.draft_model import DraftModelProposer

    def batch(offset, new, k=3):
        return SpecBatch([7], [offset], [new], [k], torch.zeros(1), torch.zeros(1, dtype=torch.long),
                         torch.ones(1), torch.zeros(1, 3, k + 1, dtype=torch.float64))

    d = DraftModelProposer(load_model(tiny_draft_dir, dtype=torch.float32), 4, 256)
    prompt = [11, 42, 7, 99, 5, 300, 17]
    first = d.propose(batch(0, prompt))
    assert d.table[7].tokens == prompt + first.tokens[0, :2].tolist()  # two tentative drafts held
    assert d.propose(batch(len(prompt) + 2, [24])).unknown == [0]  # (two tokens confirmed elsewhere)
    assert d.propose(batch(len(prompt), [24, 24, 24])).unknown == []  # at its own confirmed length: fine


@pytest.mark.parametrize("kind", ["draft", "eagle"])
def test_calls_sent_again_give_the_same_answers(tiny_dir, tiny_draft_dir, tiny_eagle_dir, kind):
    """A router re-sends a call whose reply it lost (a timeout, a dropped connection) after the
    replica applied it, so the replica's cache already holds every confirmed token the call sends.
    The repeat must still feed the last confirmed token (its logits decide the next token): with
    every propose and every verify sent twice, greedy output is plain decoding's."""
    import torch

    from specdec.eagle_draft import load_eagle
    from specdec.engine import EngineConfig, LLMEngine
    from specdec.loader import load_model
    from specdec.proposers.base import Proposer
    from specdec.proposers.draft_model import DraftModelProposer
    from specdec.proposers.eagle import EagleProposer
    from specdec.sampling import SamplingParams
    from specdec.target_worker import TargetWorker

    class Twice(Proposer):
        def __init__(self, inner):
            self.inner, self.needs_features = inner, inner.needs_features
        has_model = property(lambda self: True)

        def release(self, seq_ids):
            self.inner.release(seq_ids)

        def propose(self, batch):
            first = self.inner.propose(batch)
            again = self.inner.propose(batch)
            assert torch.equal(again.tokens, first.tokens) and again.num_draft == first.num_draft
            return again

    class VerifyTwice(TargetWorker):
        def verify(self, batch, draft):
            first = super().verify(batch, draft)
            again = super().verify(batch, draft)
            assert again.tokens == first.tokens
            return again

    target = load_model(tiny_dir, dtype=torch.float32)
    inner = (DraftModelProposer(load_model(tiny_draft_dir, dtype=torch.float32), 4, 256) if kind == "draft"
             else EagleProposer(load_eagle(tiny_eagle_dir, target), 4, 256))
    cfg = EngineConfig(max_batch_size=4, max_model_len=256, num_speculative_tokens=3, adaptive=False)
    prompts = [[11, 42, 7, 99, 5, 300, 17], [5, 6, 7, 5, 6, 7, 5]]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    plain = LLMEngine(TargetWorker(target, 4, 256), None, None, cfg, eos_token_ids=[]).generate(prompts, params)
    eng = LLMEngine(VerifyTwice(target, 4, 256), Twice(inner), None, cfg, eos_token_ids=[])
    twice = eng.generate(prompts, params)
    assert [s.output_ids for s in twice] == [s.output_ids for s in plain]
    assert eng.stats.proposed > 0

class _TwoBuilds(_TwoReplicas):
    """Two in-process Target replicas, "b" first for unpinned calls (the one a lane meets first)."""

    def __init__(self, replicas: dict):
        super().__init__(replicas)
        self.verify, self.release = _Method(self._verify), _Method(self._release)

    async def _verify(self, batch, draft, pin=None, avoid=None, room=None):
        name = pin or next((n for n in "ba" if n in self.replicas and n not in (avoid or ())), "b")
        return await self.replicas[name].verify(batch, draft)

    async def _release(self, ids, pin=None):
        for name, r in self.replicas.items():
            if pin in (None, name):
                await r.release(ids)


def _target_replica(name: str, **cfg):
    from deployments.target import TargetDeployment
    replica = TargetDeployment({"num_slots": 4, "max_model_len": 256, **cfg})
    replica.id = name
    return replica


@pytest.mark.asyncio
async def test_a_round_goes_only_to_a_target_of_its_own_build(tiny_dir, tiny_draft_dir):
    """During a redeploy old and new replicas run side by side, and Serve's handles reach both: a
    router's rows verified by another model came back as text of neither, and rows past another
    max_model_len failed their lane. A Target replica of another build (TargetConfig.build_key)
    refuses the round; the lane avoids it and runs on its own build, or fails cleanly (503) when
    there is none."""
    from deployments.batcher import RequestFailed
    from deployments.target import TargetConfig
    own = TargetConfig(model=str(tiny_dir), num_slots=4, max_model_len=256)
    assert own.build_key() == TargetConfig(**{**own.model_dump(), "num_slots": 8, "num_threads": 1}).build_key()
    assert own.build_key() != TargetConfig(**{**own.model_dump(), "max_model_len": 128}).build_key()
    prompt = [5, 9, 14, 3, 27, 8]
    alone = _batcher(tiny_dir, _TwoBuilds({"a": _target_replica("a", model=str(tiny_dir))}),
                     target_build=own.build_key())
    want = await _generate(alone, prompt, 12)
    other = _target_replica("b", model=str(tiny_draft_dir))  # another model, the same tokenizer
    batcher = _batcher(tiny_dir, _TwoBuilds({"a": _target_replica("a", model=str(tiny_dir)), "b": other}),
                       target_build=own.build_key())
    assert await _generate(batcher, prompt, 12) == want
    assert "b" in batcher.suspects and other.worker.table.active() == 0 and set(batcher.rounds_by_target) == {"a"}
    stranded = _batcher(tiny_dir, _TwoBuilds({"b": _target_replica("b", model=str(tiny_draft_dir))}),
                        target_build=own.build_key(), retry_deadline_s=0.5)
    with pytest.raises(RequestFailed) as failed:
        await _generate(stranded, prompt, 12)
    assert failed.value.status == 503


@pytest.mark.asyncio
async def test_two_routers_sharing_a_target_take_its_slots_in_turn(tiny_dir):
    """Two Router replicas (batchers) share one Target replica of 2 slots. The first keeps a queue;
    the second's one request used to wait for that whole queue: each of the first's rounds freed
    its finished rows and started its next ones in the same call, and the second's lane, refused,
    polled in vain. Freed slots now go to the rows that waited first (SlotTable.waiting)."""
    import torch

    from fake_handles import FakeTarget
    from specdec.loader import load_model
    from specdec.target_worker import TargetWorker
    worker = TargetWorker(load_model(tiny_dir, dtype=torch.float32), 2, 256)
    busy, other = (_batcher(tiny_dir, FakeTarget(worker), max_batch_size=2, max_lanes=1, max_queued_sequences=16)
                   for _ in range(2))
    done: list[str] = []

    async def run(batcher, name, prompt, delay=0.0):
        await asyncio.sleep(delay)
        await _generate(batcher, prompt, 12)
        done.append(name)
    await asyncio.gather(*(run(busy, f"busy{i}", [5 + i, 9, 14, 3]) for i in range(8)),
                         run(other, "other", [7, 7, 2, 11], delay=0.01))
    assert done.index("other") <= 5, done  # (2-3 here; it finished last: after all 8 of the busy router's)
    assert worker.table.num_free == 2 and not worker.table.waiting


class _ScaledOutTarget(_TwoReplicas):
    """Target replicas routed as the affinity router does (a pinned call that gives its pin in
    `avoid` moves to a replica no lane uses, if there is one); "b" joins while lanes run."""

    def __init__(self, replicas: dict):
        super().__init__(replicas)
        self.verify, self.release = _Method(self._verify), _Method(self._release)
        self.first_b_call_done: int | None = None  # requests finished when "b" got its first call
        self.finished = 0

    def _route(self, pin, avoid) -> str:
        fresh = [n for n in self.replicas if n not in (avoid or ())]
        if pin in self.replicas:
            return fresh[0] if pin in (avoid or ()) and fresh else pin
        return fresh[0] if fresh else next(iter(self.replicas))

    async def _verify(self, batch, draft, pin=None, avoid=None, room=None):
        name = self._route(pin, avoid)
        if name == "b" and self.first_b_call_done is None:
            self.first_b_call_done = self.finished
        await asyncio.sleep(0.002)  # (other lanes' rounds interleave, as over the network)
        return name, self.replicas[name].verify(batch, draft)


@pytest.mark.asyncio
async def test_a_lane_short_of_slots_moves_to_a_replica_that_scale_out_added(tiny_dir):
    """Two lanes on one Target replica that has slots for 6 of their 8 rows; a second replica joins.
    The lane whose rows wait for slots moves there (freeing its rows on the first), instead of
    staying on the full replica while the new one sits idle until its rows finish."""
    import torch

    from specdec.loader import load_model
    from specdec.target_worker import TargetWorker
    a, b = (TargetWorker(load_model(tiny_dir, dtype=torch.float32), 6, 256) for _ in "ab")  # (a cache each)
    handle = _ScaledOutTarget({"a": a})
    batcher = _batcher(tiny_dir, handle, max_batch_size=4, max_lanes=2, plain_steps=1)
    prompts = [[5 + i, 9, 14, 3] for i in range(8)]

    async def one(p):
        out = await _generate(batcher, p, 24)
        handle.finished += 1
        return out
    runs = [asyncio.ensure_future(one(p)) for p in prompts]
    for _ in range(200):  # until rows wait for slots on "a"
        await asyncio.sleep(0.005)
        if a.table.waiting:
            break
    assert a.table.waiting and a.table.num_free == 0 and handle.finished == 0
    handle.replicas["b"] = b  # scale-out
    outs = await asyncio.gather(*runs)
    assert handle.first_b_call_done == 0  # used while the first lane's rows still ran on "a"
    plain = _batcher(tiny_dir, _FakeTarget(TargetWorker(load_model(tiny_dir, dtype=torch.float32), 8, 256)),
                     max_batch_size=8, max_lanes=1)
    want = [await _generate(plain, p, 24) for p in prompts]
    assert outs == want
    await asyncio.sleep(0.05)  # (the background release to "a")
    assert a.table.num_free == b.table.num_free == 6 and not a.table.waiting




class _AffinityRoutedTarget(_TwoReplicas):
    """Target replicas chosen by the real affinity request router, each reporting its free slots as
    `TargetDeployment.record_routing_stats` does (of the first choice, the first replica: the roomiest)."""

    def __init__(self, replicas: dict):
        from ray.serve._private.common import DeploymentHandleSource, DeploymentID

        from deployments.affinity import AffinityRequestRouter
        super().__init__(replicas)
        self.verify, self.release = _Method(self._verify), _Method(self._release)
        self.router = AffinityRequestRouter(deployment_id=DeploymentID(name="Target", app_name="app"),
                                            handle_source=DeploymentHandleSource.REPLICA)
        self.calls: list[str] = []
        self.finished, self.finished_at_first_b = 0, None
        self.stale: dict[str, dict] = {}  # replica -> the routing stats the router sees instead of its own
        self.served: list[tuple] = []  # (replica, the call's rows, pin, room, rows refused, rows)

    async def _verify(self, batch, draft, pin=None, avoid=None, room=None):
        from types import SimpleNamespace

        from ray.serve._private.common import DeploymentID, ReplicaID

        from deployments.target import TargetDeployment
        replicas = [SimpleNamespace(replica_id=ReplicaID(unique_id=n, deployment_id=DeploymentID(name="Target")),
                                    routing_stats=self.stats(n))
                    for n in self.replicas]
        ranks = await self.router.choose_replicas(replicas, SimpleNamespace(
            kwargs={"pin": pin, "avoid": avoid, "room": room}, routing_context=SimpleNamespace(), created_at=time.time()))
        name = next(rank for rank in ranks if rank)[0].replica_id.unique_id
        self.calls.append(name)
        if name == "b" and self.finished_at_first_b is None:
            self.finished_at_first_b = self.finished
        await asyncio.sleep(0.002)  # (the other router's rounds interleave, as over the network)
        worker = self.replicas[name]

        async def call(fn, *args):
            return fn(*args)
        replica = SimpleNamespace(id=name, thread=SimpleNamespace(call=call), worker=worker,
                                  _verify=lambda batch, draft, move_in: worker.verify(batch, draft, move_in))
        served, out = await TargetDeployment.verify(replica, batch, draft, pin=pin, avoid=avoid, room=room)
        self.served.append((name, frozenset(batch.seq_ids), pin, room, len(out.refused), len(batch)))
        return served, out

    def stats(self, name: str) -> dict:
        """The routing stats the request router sees: the replica's own, or `stale` ones."""
        from types import SimpleNamespace

        from deployments.target import TargetDeployment
        if name in self.stale:
            return self.stale[name]
        return TargetDeployment.record_routing_stats(SimpleNamespace(worker=self.replicas[name]))


@pytest.mark.asyncio
async def test_a_lane_short_of_slots_alone_in_its_router_moves_to_a_replica_with_room(tiny_dir):
    """Two routers, one lane each, on a Target replica with slots for 6 of their 8 rows; a second
    replica joins. The lane whose rows wait moves there, as the replica reports room for all its
    rows (before, only a lane that shared its replica with lanes of its own router moved, so this one
    waited on the full replica while the new one sat idle), and its output stays plain decoding's."""
    import torch

    from specdec.loader import load_model
    from specdec.target_worker import TargetWorker
    a, b = (TargetWorker(load_model(tiny_dir, dtype=torch.float32), 6, 256) for _ in "ab")
    handle = _AffinityRoutedTarget({"a": a})
    routers = [_batcher(tiny_dir, handle, max_batch_size=4, max_lanes=1, plain_steps=1) for _ in range(2)]
    prompts = [[5 + i, 9, 14, 3] for i in range(8)]

    async def one(router, p):
        out = await _generate(router, p, 24)
        handle.finished += 1
        return out
    runs = [asyncio.ensure_future(one(routers[i // 4], p)) for i, p in enumerate(prompts)]
    for _ in range(200):  # until rows wait for slots on "a"
        await asyncio.sleep(0.005)
        if a.table.waiting:
            break
    assert a.table.waiting and handle.finished == 0
    handle.replicas["b"] = b  # scale-out
    outs = await asyncio.gather(*runs)
    assert "b" in handle.calls and handle.finished_at_first_b == 0
    # the move's call finds none of the lane's rows on "b" (they keep their places there): the lane
    # stays pinned to "b" and resends them whole, it does not back off and pick a replica again
    move = next(i for i, c in enumerate(handle.served) if c[0] == "b")
    rows = handle.served[move][1]
    assert handle.served[move][2] == "a" and next(c for c in handle.served[move + 1:] if c[1] & rows)[:3] == ("b", rows, "b")
    plain = _batcher(tiny_dir, _FakeTarget(TargetWorker(load_model(tiny_dir, dtype=torch.float32), 8, 256)),
                     max_batch_size=8, max_lanes=1)
    assert outs == [await _generate(plain, p, 24) for p in prompts]
    await asyncio.sleep(0.05)  # (the background release to "a")
    assert a.table.num_free == b.table.num_free == 6 and not a.table.waiting


@pytest.mark.asyncio
async def test_a_lane_moving_to_a_replica_whose_room_is_gone_stays_where_it_is(tiny_dir):
    """Routing stats lag: replica "b" reports room for a starved lane's 4 rows but has 3 free slots
    when the lane's call arrives. "b" refuses the whole call and changes nothing; the lane retries on
    its own replica in the same round, frees nothing there, and does not try again within the
    cooldown. (Before, the lane moved, freed its rows on "a", and starved on "b".)"""
    import torch

    from specdec.loader import load_model
    from specdec.target_worker import TargetWorker
    a, b = TargetWorker(load_model(tiny_dir, dtype=torch.float32), 6, 256), _new_worker(tiny_dir, slots=3)
    handle = _AffinityRoutedTarget({"a": a})
    routers = [_batcher(tiny_dir, handle, max_batch_size=4, max_lanes=1, plain_steps=1) for _ in range(2)]
    prompts = [[5 + i, 9, 14, 3] for i in range(8)]
    runs = [asyncio.ensure_future(_generate(routers[i // 4], p, 24)) for i, p in enumerate(prompts)]
    for _ in range(200):  # until rows wait for slots on "a"
        await asyncio.sleep(0.005)
        if a.table.waiting:
            break
    assert a.table.waiting
    handle.stale["b"] = {"free_slots": 16}
    handle.replicas["b"] = b
    outs = await asyncio.wait_for(asyncio.gather(*runs), timeout=120)
    plain = _batcher(tiny_dir, _FakeTarget(TargetWorker(load_model(tiny_dir, dtype=torch.float32), 8, 256)),
                     max_batch_size=8, max_lanes=1)
    assert outs == [await _generate(plain, p, 24) for p in prompts]
    to_b = [i for i, call in enumerate(handle.served) if call[0] == "b"]
    assert to_b and all(handle.served[i][4] == handle.served[i][5] for i in to_b)  # refused whole, every time
    assert len(b.table) == 0 and not b.table.waiting  # (and held no place in line)
    for i in to_b:  # the same rows, next: to "a", pinned there and asking for no room (the cooldown)
        rows = handle.served[i][1]
        nxt = next(c for c in handle.served[i + 1:] if c[1] & rows)
        assert nxt[0] == "a" and nxt[2] == "a" and nxt[3] is None
    await asyncio.sleep(0.05)
    assert a.table.num_free == 6 and b.table.num_free == 3 and not a.table.waiting


class _ForgetsARow(_FakeTarget):
    """A Target replica that loses `forget` rows of the 3rd call's batch (as an eviction or a
    restart would) before serving it; records the `room` and `pin` every call gives."""

    rooms: list
    pins: list
    forget = 1

    async def _verify(self, batch, draft, pin=None, avoid=None, room=None):
        self.rooms.append(room)
        self.pins.append(pin)
        if self.calls == 2:
            self.worker.release(batch.seq_ids[:self.forget])
        return await super()._verify(batch, draft, pin, avoid, room)


@pytest.mark.asyncio
async def test_a_row_its_replica_lost_does_not_mark_the_lane_short_of_slots(tiny_dir):
    """A row reported unknown because the replica no longer holds it (restart, eviction) is resent
    whole; only rows refused a slot make the lane look for room elsewhere (before, any unknown row
    among others did, and the lane moved for nothing, paying a re-prefill of every row)."""
    from specdec.sampling import SamplingParams
    target = _ForgetsARow(_new_worker(tiny_dir))
    target.rooms, target.pins = [], []
    b = _batcher(tiny_dir, target, plain_steps=1)
    seqs = b.submit([[5, 6, 7]], [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)] * 2)
    await asyncio.wait_for(_drain(b, seqs), timeout=30)
    assert len(target.rooms) > 4 and target.rooms == [None] * len(target.rooms)
    assert [s.output_ids for s in seqs] == [await _generate(_batcher(tiny_dir, _FakeTarget(_new_worker(tiny_dir))),
                                                            [5, 6, 7], 8)] * 2
    assert b.resyncs["target"] == 1


@pytest.mark.asyncio
async def test_only_a_call_pinned_to_another_replica_is_checked_as_a_lane_moving_in(tiny_dir):
    """A starved lane's call gives `room` also when no other replica has room and it stays where it
    is: there it is an ordinary round (its rows are held there), not a lane moving in. A lane moving
    in to a replica without room is refused before its call waits for the model thread."""
    from types import SimpleNamespace

    from deployments.target import TargetDeployment
    from specdec.metadata import VerifyOutput
    seen = []

    async def call(fn, *args):
        return fn(*args)
    free = SimpleNamespace(room=lambda: 3)
    replica = SimpleNamespace(id="a", thread=SimpleNamespace(call=call), worker=SimpleNamespace(table=free, return_hidden=False),
                              _verify=lambda batch, draft, move_in: seen.append(move_in) or VerifyOutput([], []))
    for pin, room in [("a", 4), (None, 4), ("b", None), ("b", 3)]:
        await TargetDeployment.verify(replica, [0] * 4, None, pin=pin, room=room)
    assert seen == [None, None, None, 3]
    rid, out = await TargetDeployment.verify(replica, [0] * 4, None, pin="b", room=4)
    assert rid == "a" and out.refused == out.unknown == [0, 1, 2, 3] and len(seen) == 4


@pytest.mark.asyncio
async def test_a_lane_whose_rows_its_replica_all_lost_resends_them_there_without_backing_off(tiny_dir):
    """Every row unknown but none refused a slot (the replica lost them): the lane keeps its replica
    and resends its rows whole at once; only a round whose rows were all refused backs off and lets
    the request router pick again."""
    from specdec.sampling import SamplingParams
    target = _ForgetsARow(_new_worker(tiny_dir))
    target.rooms, target.pins, target.forget = [], [], 2
    b = _batcher(tiny_dir, target, plain_steps=1)
    seqs = b.submit([[5, 6, 7]], [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)] * 2)
    await asyncio.wait_for(_drain(b, seqs), timeout=30)
    assert b.resyncs["target"] == 2 and target.pins[:2] == [None, "replica-b"]
    assert target.pins[2:] == ["replica-b"] * (len(target.pins) - 2)  # (pinned on after the lost rows)
    assert [s.output_ids for s in seqs] == [await _generate(_batcher(tiny_dir, _FakeTarget(_new_worker(tiny_dir))),
                                                            [5, 6, 7], 8)] * 2


class _OlderReplicaOutOfSlots(_FakeTarget):
    """A replica of an older version (its VerifyOutput has no `refused`) that has no slot for any row
    of the first call; records the pins."""

    pins: list

    async def _verify(self, batch, draft, pin=None, avoid=None, room=None):
        from specdec.metadata import VerifyOutput
        self.pins.append(pin)
        if not self.pins[1:]:
            n = len(batch)
            return "replica-b", VerifyOutput([[] for _ in range(n)], [0] * n, list(range(n)))
        return await super()._verify(batch, draft, pin, avoid, room)


@pytest.mark.asyncio
async def test_a_round_all_unknown_on_an_older_replica_backs_off_as_before(tiny_dir):
    """During a rolling update an older Target replica does not say which rows it refused: all
    unknown still reads as out of slots there, so the lane backs off and lets the router pick again."""
    from specdec.sampling import SamplingParams
    target = _OlderReplicaOutOfSlots(_new_worker(tiny_dir))
    target.pins = []
    b = _batcher(tiny_dir, target, plain_steps=1)
    seqs = b.submit([[5, 6, 7]], [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)] * 2)
    await asyncio.wait_for(_drain(b, seqs), timeout=30)
    assert target.pins[:3] == [None, None, "replica-b"] and all(len(s.output_ids) == 4 for s in seqs)


def test_a_replica_takes_a_moving_lane_only_with_room_for_all_its_rows_and_keeps_their_places(tiny_dir):
    """`TargetWorker.verify(move_in=n)`: with fewer than n slots a newcomer could take, every row is
    refused and nothing changes; with room, the rows that ran elsewhere (reported unknown) keep a
    place in line, so the slots they take on their resend go to no other lane meanwhile."""
    import torch

    from specdec.metadata import DraftOutput, SpecBatch
    from specdec.runner import CacheFullError

    def batch(ids, offsets):
        n = len(ids)
        return SpecBatch(ids, offsets, [[5, 9, 14]] * n, [0] * n, torch.zeros(n), torch.zeros(n, dtype=torch.long),
                         torch.ones(n), torch.zeros(n, 3, 1, dtype=torch.float64))
    w = _new_worker(tiny_dir, slots=4)
    for sid in (100, 101, 102, 103):
        w.table.allocate(sid)
    with pytest.raises(CacheFullError):
        w.table.allocate(104)  # waits in line for the next free slot
    w.table.release(102)
    w.table.release(103)  # 2 free, 1 of them for the waiter
    out = w.verify(batch([1, 2], [7, 0]), DraftOutput.empty(2), move_in=2)
    assert out.refused == out.unknown == [0, 1] and len(w.table) == 2 and list(w.table.waiting) == [104]
    w.table.waiting.clear()
    out = w.verify(batch([1, 2], [7, 0]), DraftOutput.empty(2), move_in=3)  # (the lane's third row is not in this call)
    assert out.refused == [0, 1] and len(w.table) == 2 and not w.table.waiting
    w.table.allocate(102)
    w.table.allocate(103)
    w.table.release(100)
    w.table.release(101)
    out = w.verify(batch([1, 2], [7, 0]), DraftOutput.empty(2), move_in=2)
    assert out.unknown == [0] and out.refused == [] and 2 in w.table and 1 in w.table.waiting
    assert w.table.room() == 0
    with pytest.raises(CacheFullError):
        w.table.allocate(200)  # a newcomer waits behind the held row
    w.verify(batch([1], [0]), DraftOutput.empty(1))  # its resend, whole
    assert 1 in w.table and 1 not in w.table.waiting


def test_a_target_replica_reports_the_slots_a_new_lane_could_take(tiny_dir):
    """Free slots less the rows already waiting for one (they get the next free slots)."""
    from types import SimpleNamespace

    from specdec.runner import CacheFullError

    from deployments.target import TargetDeployment
    w = _new_worker(tiny_dir, slots=4)
    stats = lambda: TargetDeployment.record_routing_stats(SimpleNamespace(worker=w))  # noqa: E731
    assert stats() == {"free_slots": 4}
    for i in range(4):
        w.table.allocate(i)
    for i in (5, 6, 7):
        with pytest.raises(CacheFullError):
            w.table.allocate(i)
    w.table.release(0)
    w.table.release(1)
    assert w.table.num_free == 2 and stats() == {"free_slots": 0}
    w.table.allocate(5)
    w.table.allocate(6)
    w.table.release(2)
    w.table.release(3)
    assert stats() == {"free_slots": 1}  # (7 still waits)
    from specdec.runner import WAITER_FORGET_S
    w.table.waiting[7] -= WAITER_FORGET_S + 1  # its router moved on long ago (no allocation pruned it since)
    assert stats() == {"free_slots": 2}


@pytest.mark.asyncio
async def test_a_release_meant_for_a_gone_replica_frees_nothing_where_it_lands(tiny_dir):
    """The request router sends a call pinned to a replica that is gone to another one: a release
    there must not free rows that replica has just taken over (the lane that moved re-prefilled them)."""
    from functools import partial
    from types import SimpleNamespace

    from deployments.draft import DraftDeployment
    from deployments.target import TargetDeployment

    async def call(fn, *args):
        return fn(*args)
    w = _new_worker(tiny_dir, slots=4)
    w.table.allocate(1)
    freed: list[int] = []
    target = SimpleNamespace(id="b", worker=w, thread=SimpleNamespace(call=call))
    draft = SimpleNamespace(id="b", proposer=SimpleNamespace(release=freed.extend), thread=SimpleNamespace(call=call))
    target._free, draft._free = partial(TargetDeployment._free, target), partial(DraftDeployment._free, draft)
    await TargetDeployment.release(target, [1], pin="a")
    await DraftDeployment.release(draft, [1], pin="a")
    assert 1 in w.table and freed == []
    await TargetDeployment.release(target, [1], pin="b")
    await DraftDeployment.release(draft, [1], pin=None)  # (unpinned: any replica frees finished ids)
    assert 1 not in w.table and freed == [1]


@pytest.mark.asyncio
async def test_a_lane_that_moved_moves_again_by_no_rule_within_the_cooldown(tiny_dir):
    """Also the move off a replica that other lanes of its router share waits MOVE_COOLDOWN_S after
    a move: two lanes that chose the same replica by its stale stats must not bounce between two."""
    from deployments.batcher import MOVE_COOLDOWN_S
    from specdec.sampling import SamplingParams
    b = _idle_batcher(tiny_dir, max_batch_size=2, max_lanes=2, max_request_share=1.0)
    b.submit([[5, 6, 7]], [SamplingParams(max_tokens=4)] * 4)
    first, second = b.lanes
    for lane in b.lanes:
        lane.target_pin, lane.starved = "a", True
    assert "a" in b._avoid(first, "target_pin")  # shared and short of slots: moves to a free replica
    first.moved_at = time.monotonic()
    assert b._avoid(first, "target_pin") == [] and b._room_wanted(first) is None
    first.moved_at -= MOVE_COOLDOWN_S + 0.1
    assert "a" in b._avoid(first, "target_pin")
    await _stop_lanes(b)


class _StarvesThenHangs(_TwoReplicas):
    """Replica "a" answers the first verify (with slots for only some rows), then never again."""

    def __init__(self, worker):
        super().__init__({"a": worker})
        self.verify, self.release = _Method(self._verify), _Method(self._release)
        self.calls = 0

    async def _verify(self, batch, draft, pin=None, avoid=None, room=None):
        self.calls += 1
        if self.calls > 1:
            await asyncio.sleep(3600)
        return "a", self.replicas["a"].verify(batch, draft)


@pytest.mark.asyncio
async def test_a_call_that_could_move_and_timed_out_blames_no_replica(tiny_dir):
    """A starved lane's call may have gone to another replica (`room`): when it times out, the
    replica it was pinned to is not avoided for SUSPECT_S (it may be the healthy one)."""
    handle = _StarvesThenHangs(_new_worker(tiny_dir, slots=2))
    batcher = await _starve_then_time_out(tiny_dir, handle)
    assert handle.calls == 2 and "a" not in batcher.suspects


async def _starve_then_time_out(tiny_dir, handle):
    """A lane of 4 rows on `handle` (a replica with 2 slots, then no answer) until its requests fail."""
    batcher = _batcher(tiny_dir, handle, max_batch_size=4, max_lanes=1, max_request_share=1.0,
                       retry_deadline_s=0.5, plain_steps=1)
    from deployments.batcher import RequestFailed
    from specdec.sampling import SamplingParams
    seqs = batcher.submit([[5, 6, 7, 8]], [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)] * 4)
    for s in seqs:
        with pytest.raises(RequestFailed, match="no replica answered"):
            while True:
                await asyncio.wait_for(batcher.wait(s), timeout=10)
    return batcher


class _RefusesTheMoveThenHangs(_StarvesThenHangs):
    """As _StarvesThenHangs, but the lane's second call (asking for room) reaches "b", which takes
    most of the deadline to refuse the move; the retry on "a" then hangs."""

    async def _verify(self, batch, draft, pin=None, avoid=None, room=None):
        from specdec.metadata import VerifyOutput
        if self.calls == 1:
            self.calls += 1
            assert room and pin == "a"
            await asyncio.sleep(0.3)
            return "b", VerifyOutput.refusal(len(batch))
        return await super()._verify(batch, draft, pin, avoid, room)


@pytest.mark.asyncio
async def test_a_call_that_timed_out_after_its_move_was_refused_blames_no_replica(tiny_dir):
    """Part of the deadline went to the replica that refused the move: the replica the lane stayed on
    is not avoided for SUSPECT_S when the retry there runs out of time."""
    handle = _RefusesTheMoveThenHangs(_new_worker(tiny_dir, slots=2))
    batcher = await _starve_then_time_out(tiny_dir, handle)
    assert handle.calls == 3 and "a" not in batcher.suspects


@pytest.mark.asyncio
async def test_a_lane_short_of_slots_asks_for_room_at_most_once_per_cooldown(tiny_dir):
    """Routing stats lag (ROUTING_STATS_PERIOD_S): a lane that just moved waits MOVE_COOLDOWN_S before it
    asks again, so two lanes that chose the same idle replica do not chase each other back and forth."""
    from deployments.batcher import MOVE_COOLDOWN_S
    from specdec.sampling import SamplingParams
    b = _idle_batcher(tiny_dir, max_batch_size=4, max_lanes=1, max_request_share=1.0)
    b.submit([[5, 6, 7]], [SamplingParams(max_tokens=4)] * 3)
    [lane] = b.lanes
    lane.target_pin, lane.starved = "a", True
    assert b._room_wanted(lane) == 3
    lane.moved_at = time.monotonic()
    assert b._room_wanted(lane) is None
    lane.moved_at -= MOVE_COOLDOWN_S + 0.1
    assert b._room_wanted(lane) == 3
    lane.starved = False
    assert b._room_wanted(lane) is None
    await _stop_lanes(b)

# ---- admission and clean-up paths a mutation review found untested ------------------------------
def _idle_batcher(tiny_dir, **cfg):
    """A batcher whose Target never answers: its lanes and queue stay as admission left them."""
    return _batcher(tiny_dir, _FakeTarget(hang=True), max_model_len=128, **cfg)


async def _stop_lanes(batcher):
    for lane in batcher.lanes:
        lane.task.cancel()
    await asyncio.sleep(0.05)


@pytest.mark.asyncio
async def test_a_lane_never_admits_more_rows_than_max_batch_size(tiny_dir):
    """A lane's rows need KV slots sized for max_batch_size rows: the third row of two requests waits."""
    from specdec.sampling import SamplingParams
    b = _idle_batcher(tiny_dir, max_batch_size=2, max_lanes=1, max_request_share=1.0)
    b.submit([[5, 6, 7]], [SamplingParams(max_tokens=4)])
    b.submit([[5, 6, 7]], [SamplingParams(max_tokens=4)] * 2)
    assert [lane.load for lane in b.lanes] == [2] and len(b.queue) == 1
    await _stop_lanes(b)


@pytest.mark.asyncio
async def test_no_lane_opens_for_a_request_at_its_row_cap(tiny_dir):
    """A request holding its share of rows waits in the queue: no empty lane opens for it (one did,
    ended at once and reopened, spinning)."""
    from specdec.sampling import SamplingParams
    b = _idle_batcher(tiny_dir, max_batch_size=2, max_lanes=2, max_request_share=0.5)  # cap: 2 rows
    b.submit([[5, 6, 7]], [SamplingParams(max_tokens=4)] * 4)
    assert len(b.lanes) == 1 and len(b.queue) == 2
    await _stop_lanes(b)


@pytest.mark.asyncio
async def test_a_queued_sequence_its_client_left_frees_its_place_at_once(tiny_dir):
    """A client gone while its sequence is still queued: the place is free for the next request (a
    dead entry counted against admission, a false 503, and later cost a prefill)."""
    from specdec.sampling import SamplingParams
    b = _idle_batcher(tiny_dir, max_batch_size=1, max_lanes=1, max_queued_sequences=1, max_request_share=1.0)
    p = [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)]
    b.submit([[5, 6, 7]], p)
    [q] = b.submit([[5, 6, 7]], p)
    assert list(b.queue) == [q]
    b.finish(q)
    assert not b.queue
    b.submit([[5, 6, 7]], p)  # admitted, not Overloaded
    await _stop_lanes(b)


@pytest.mark.asyncio
async def test_requests_queued_behind_a_lane_that_failed_are_served(tiny_dir):
    """A lane that dies on an unexpected error fails its own rows (500); those queued behind it get
    a new lane (they waited forever for some other request to arrive)."""
    from deployments.batcher import RequestFailed
    from specdec.sampling import SamplingParams
    target = _FakeTarget(_new_worker(tiny_dir), failures=1, error=lambda: ValueError("boom"))
    b = _batcher(tiny_dir, target, max_model_len=128, max_batch_size=1, max_lanes=1, max_request_share=1.0)
    p = [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)]
    [a] = b.submit([[5, 6, 7]], p)
    [q] = b.submit([[5, 6, 7]], p)
    with pytest.raises(RequestFailed) as e:
        await asyncio.wait_for(_drain(b, [a]), 5)
    assert e.value.status == 500
    await asyncio.wait_for(_drain(b, [q]), 5)
    assert q.finish_reason == "length" and q.num_output == 4


class _ReleaseAlsoFailsOnce(_TwoReplicaTarget):
    """Replica "a" is unreachable for a moment: its next verify and its next release fail."""

    def __init__(self, workers):
        super().__init__(workers)
        self.release_failed = False

    async def _release(self, ids, pin=None):
        import ray.exceptions
        if pin == "a" and not self.release_failed:
            self.release_failed = True
            raise ray.exceptions.ActorUnavailableError("still unreachable", None)
        return await super()._release(ids, pin=pin)


@pytest.mark.asyncio
async def test_a_release_that_fails_once_is_delivered_later(tiny_dir):
    """Slots of a replica unreachable for a moment are freed once it answers again (else they stayed
    taken on a live replica until its idle reclaim, refusing new rows meanwhile)."""
    from specdec.sampling import SamplingParams
    workers = {"a": _new_worker(tiny_dir), "b": _new_worker(tiny_dir)}
    target = _ReleaseAlsoFailsOnce(workers)
    batcher = _batcher(tiny_dir, target)
    seqs = batcher.submit([[5, 6, 7]], [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)] * 2)
    await asyncio.wait_for(_drain(batcher, seqs), timeout=30)
    for _ in range(100):  # (delivered in the background)
        if not len(workers["a"].table):
            break
        await asyncio.sleep(0.05)
    assert target.failed and target.release_failed
    assert len(workers["a"].table) == 0 and len(workers["b"].table) == 0


@pytest.mark.asyncio
async def test_a_lane_with_no_slot_at_all_moves_to_a_replica_that_scale_out_added(tiny_dir):
    """Every row of a lane waiting for a slot on a full replica: the lane backs off and lets the
    router choose again, so a replica that scale-out adds takes it while the other lane still runs."""
    import torch
    from specdec.loader import load_model
    from specdec.target_worker import TargetWorker
    a, b = (TargetWorker(load_model(tiny_dir, dtype=torch.float32), 4, 256) for _ in "ab")
    handle = _ScaledOutTarget({"a": a})
    batcher = _batcher(tiny_dir, handle, max_batch_size=4, max_lanes=2, plain_steps=1)

    async def one(p):
        out = await _generate(batcher, p, 40)
        handle.finished += 1
        return out
    runs = [asyncio.ensure_future(one([5 + i, 9, 14, 3])) for i in range(8)]  # 2 lanes x 4 rows, 4 slots
    for _ in range(400):
        await asyncio.sleep(0.005)
        if len(a.table.waiting) >= 4:
            break
    assert len(a.table.waiting) >= 4 and handle.finished == 0  # the second lane holds no slot on "a"
    handle.replicas["b"] = b  # scale-out
    await asyncio.gather(*runs)
    assert handle.first_b_call_done == 0  # it moved while the first lane still ran on "a"


@pytest.mark.asyncio
async def test_a_capped_requests_queued_rows_keep_their_place_before_later_requests(tiny_dir):
    """Rows a request may not start yet (at its row cap) stay ahead of later requests in the queue,
    so they start first once the request's rows free (put behind, a big-n request could starve)."""
    from specdec.sampling import SamplingParams
    b = _idle_batcher(tiny_dir, max_batch_size=4, max_lanes=1, max_request_share=0.5)  # cap: 2 rows
    a = b.submit([[5, 6, 7]], [SamplingParams(max_tokens=4)] * 4)
    later = b.submit([[5, 6, 7]], [SamplingParams(max_tokens=4)] * 3)
    assert [lane.load for lane in b.lanes] == [4]
    assert list(b.queue) == a[2:] + later[2:]
    await _stop_lanes(b)


@pytest.mark.asyncio
async def test_lanes_over_a_lowered_max_batch_size_do_not_take_room_from_others(tiny_dir):
    """After max_batch_size is lowered at runtime, a lane still holding more rows has no room, not
    negative room that refuses requests the other lanes could take (a false 503)."""
    from specdec.sampling import SamplingParams
    b = _idle_batcher(tiny_dir, max_batch_size=4, max_lanes=2, max_queued_sequences=0, max_request_share=1.0)
    b.submit([[5, 6, 7]], [SamplingParams(max_tokens=4)] * 4)
    b.reconfigure({"max_batch_size": 2})
    b.submit([[5, 6, 7]], [SamplingParams(max_tokens=4)] * 2)  # the second lane's rows
    await _stop_lanes(b)


class _RecordingTarget(_FakeTarget):
    """Records the offsets each verify call sends."""

    def __init__(self, worker):
        super().__init__(worker)
        self.offsets: list[list[int]] = []

    async def _verify(self, batch, draft, pin=None, avoid=None, room=None):
        self.offsets.append(list(batch.offsets))
        return await super()._verify(batch, draft, pin=pin, avoid=avoid)


class _FailsOnceDraft(_FlakyDraft):
    """Its third call fails (the replica died; `target` has verified `failed_after` rounds by then)."""

    def __init__(self, target):
        super().__init__()
        self.target, self.failed_after = target, None

    async def _propose(self, batch, pin=None, avoid=None):
        import ray.exceptions
        self.calls += 1
        if self.calls == 3:
            self.failed, self.failed_after = 1, len(self.target.offsets)
            raise ray.exceptions.ActorDiedError()
        return "draft-a", self.proposer.propose(batch)


@pytest.mark.asyncio
async def test_a_draft_reading_features_gets_the_whole_context_again_after_a_failed_call(tiny_dir, tiny_worker):
    """The replica that serves a features-reading (EAGLE) draft next needs the target's features of
    the whole context, which only the target computes: after a failed draft call the next verify
    resends each row from position 0 (else the new replica drafts without them: lower acceptance)."""
    from deployments.batcher import Batcher
    from specdec.sampling import SamplingParams
    target = _RecordingTarget(tiny_worker)
    draft = _FailsOnceDraft(target)
    batcher = Batcher({"tokenizer": str(tiny_dir), "max_model_len": 256, "batch_wait_timeout_s": 0, "features": True,
                       "draft_backoff_s": 0.0, "num_speculative_tokens": 2, "adaptive": False}, draft, target)
    seqs = batcher.submit([[5, 6, 7, 5, 6, 7]], [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)])
    await asyncio.wait_for(_drain(batcher, seqs), 30)
    n = draft.failed_after
    assert draft.failed == 1 and target.offsets[0] == [0] and n >= 2
    assert target.offsets[n] == [0] and all(o != [0] for o in target.offsets[1:n])  # resent after the failure only
