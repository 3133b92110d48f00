"""The batcher: the batching core of the Router deployment (the ingress, serve_app/api.py). Runs the
engine's speculative rounds against the Draft and Target deployment handles.

Requests become sequences in a bounded queue. Sequences run in *lanes*: a lane is one running
batch (up to `max_batch_size`) pinned to one draft replica and one target replica (the replicas
that hold its KV caches, see deployments/affinity.py). Each lane loops over the rounds of
`specdec.round` (plan, propose, verify, commit), whose two calls become

    draft = await draft.propose(plan.draft_batch, pin=...)   # one call for the whole batch
    verify = await target.verify(target_batch, draft, pin=...)

and sequences join and leave between rounds. A new lane opens when every lane is full (its first
call goes unpinned, so it lands on the least-loaded replica: scale-out is used), and a lane whose
target replica has no slot for some of its rows moves to a replica no lane uses: any, when other lanes share
its replica, else one that reports free slots for all its rows (`room`); at most once per MOVE_COOLDOWN_S,
as those reports lag. Lanes run in a
context of their own: they outlive the request that opened them, so their calls are not Serve
child requests of it (which Serve cancels when that client disconnects).

Admission: lanes x max_batch_size rows (sized to the targets' KV-cache slots, allocated up front)
plus `max_queued_sequences` waiting; a request that fits in neither gets `Overloaded` (503 +
Retry-After), so accepted work is bounded by memory that is already there. Fairness: one request
(its n samples and prompts) holds at most `max_request_share` of the rows at once; its other
sequences wait while later requests start, so an n = 64 request cannot lock other clients out.

Failures: a failing (or, past `draft_timeout_s`, silent) draft call makes the lane run plain
rounds for a while (greedy and seeded output unchanged: both are plain decoding's); a lost target replica
(actor died, or `TargetFault`: its tensor-parallel group broke) is retried on another replica,
which re-prefills the lane's sequences from the router's copy of their tokens, until
`retry_deadline_s`; then, or if no replica answers by then, the lane's requests fail with 503. So is
a Target replica of another build (`WrongBuild`: during a redeploy, old and new replicas run side by
side; rounds carry the build they are for, and only a replica of that build verifies them). A
replica that does not answer in time (a hung forward) is avoided by new calls for `SUSPECT_S`
(while others can serve): a Draft call past `draft_timeout_s` (the lane leaves it), a Target call
past `retry_deadline_s`.
A lane that fails or is cancelled fails its sequences, so no request waits forever.
"""
from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from deployments.common import MaxModelLen, Traced, replica_id, short_error
from deployments.target import TargetFault, WrongBuild
from deployments.tracing import ensure_provider, inject, mark_error, sampled_first, span
from specdec.loader import load_tokenizer
from specdec.metadata import DraftOutput
from specdec.sampling import SamplingParams
from specdec.adaptive import CostModel
from specdec.engine import eos_ids_of
from specdec.round import RoundResult, round_steps, run_round_async
from specdec.scheduler import Scheduler, SchedulerConfig, scheduler_config
from specdec.sequence import Sequence
from specdec.stats import RoundProfile, SpecStats

log = logging.getLogger("ray.serve")
MAX_PENDING_RELEASES = 1024  # finished ids a lane keeps for its next draft call before sending them alone
SUSPECT_S = 60.0  # how long new calls avoid a replica a call timed out on
MOVE_COOLDOWN_S = 10.0  # a lane short of slots moves to a replica reporting room at most this often
HEALTH_TIMEOUT_S = 5.0  # how long a health probe waits for a Target replica to answer
HEALTH_CACHE_S = 2.0  # a probe's answer serves the health checks of this long (probes add no load)


class SchedulingConfig(BaseModel):
    """How the router batches and speculates: the knobs a user sets (AppArgs inherits them) and
    may change at runtime through the Router deployment's `user_config`."""

    model_config = ConfigDict(allow_inf_nan=False)  # ("inf" from the command line: a lane that sleeps forever)

    max_batch_size: int = Field(8, ge=1, description="Sequences per running batch (lane).")
    batch_wait_timeout_s: float = Field(0.005, ge=0, description="Wait for more requests before a new lane's first round.")
    max_queued_sequences: int = Field(256, ge=0, description="Waiting sequences per router beyond which requests get 503 + Retry-After.")
    max_request_share: float = Field(0.5, gt=0, le=1, description="Largest share of a router's rows (lanes x max_batch_size) that one request's sequences (its n samples, its prompts) may hold at once; the rest of them wait, so other clients keep being served.")
    num_speculative_tokens: int = Field(4, ge=0, le=16, description="k_max: most draft tokens per round, the cap of the adaptive k and of per-request k.")
    adaptive: bool = Field(True, description="Adapt k per sequence to its measured acceptance.")
    plain_steps: int = Field(8, ge=1, le=64, description="A round in which no row drafts decodes up to this many tokens per row in one Target call (one call's hops for all of them; the same tokens as that many plain rounds); a prefill, or sequences waiting to join the lane, make it a one-step round.")
    siblings_max_batch: int = Field(0, ge=0, description="Rounds of at most this many rows verify, beside each greedy row's chain, a sibling of its first draft (the draft's second choice: the smallest draft tree, one more position in the same forward); 0: chains only. Off by default: in bf16 the sibling's attention sums its own key in another order than a plain step does, so at exact bf16 ties its bonus token can differ from plain greedy's (float32 is unaffected).")
    lookup_k: int = Field(2, ge=0, le=16, description="In multi-step plain rounds of several rows, rows also verify up to this many tokens per step found by lookup (prompt lookup in their own context, continued from the lookup corpus; in the Target call, no Draft call), kept where they equal the target's own token (greedy: its argmax; sampled: its draw with that position's uniform), so the output is plain decoding's; a request's num_speculative_tokens caps it; 0: off. In process with the corpus, greedy, lanes of 4 / 8: 2 tokens 1.40x / 1.36x over no lookups to EOS (4 tokens: 1.38x / 1.21x) and 1.11x at 64 tokens in lanes of 4 (4 tokens: 1.04x); prompt lookup alone did better with 4, so the app sets 4 without a corpus. Rounds of one row use ngram_k.")
    lookup_max_batch: int = Field(8, ge=0, description="Lookups in rounds of at most this many rows (lookup_k, ngram_k). HTTP, bf16, 2 cores, answers ending at EOS: prompt lookup alone took spec/off at concurrency 4 from 0.97x to 1.22x (everyday) and 1.13x to 1.26x (tasks) going from 1 to 4, and at concurrency 16 lookups in every batch cost 1.10x -> 0.89x; continued from a lookup corpus they pay in batches of 8 in process (1.19x; prompt lookup alone 1.03x), so the app's default is 8 (a default lane) with a corpus and 4 without one. In lanes of 16 (HTTP, concurrency 16, one run each) corpus lookups measured 1.17x (tasks, to EOS), 0.94x (fresh questions, to EOS) and 0.79x (64 fixed tokens): not the default.")
    ngram_k: int = Field(8, ge=0, le=32, description="In rounds of one row: proposer='hybrid''s greedy rows drafted by prompt lookup propose up to this many tokens instead of k, and a plain round's lookups run up to this many instead of lookup_k (a lookup costs no draft forward, and at batch 1 in bf16 eight positions verify in ~1.1 forwards; engine, code prompts: 1.94x -> 2.06x; plain rounds with lookups at batch 1, answers to EOS: 1.49-1.50x -> 1.51-1.54x); a request's num_speculative_tokens caps it; 0: k and lookup_k.")
    max_prefill_tokens: int = Field(256, ge=0, description="A prompt with more tokens than this to go enters the target over several rounds, about this many per round (cut at multiples of the runner's prefill chunk, SPECDEC_PREFILL_CHUNK), while the lane's other rows keep decoding, instead of holding them, and the target replica's other lanes, for its whole prefill (chunked prefill, as vLLM's); speculation and plain decoding cut a prompt alike, so their greedy outputs stay equal. 0: every prompt in one round.")


class RouterConfig(SchedulingConfig, Traced):
    """Configuration of the Router (ingress) deployment: the scheduling knobs, and what the
    builder derives from the app's arguments."""

    tokenizer: str = Field(description="Checkpoint whose tokenizer the router uses (the target's).")
    model_name: str = Field("specdec", description="Model id served in the OpenAI API.")
    max_lanes: int = Field(4, ge=1, description="Concurrent running batches per router replica.")
    speculate: bool = Field(True, description="False: plain decoding (no draft calls).")
    proposer_has_model: bool = Field(True, description="Drafting costs a model forward (False for n-gram lookup): enters the adaptive cost model.")
    features: bool = Field(False, description="Pass the target's features of confirmed positions to the draft (EAGLE-style drafts).")
    max_model_len: MaxModelLen = 2048
    retry_deadline_s: float = Field(60.0, gt=0, description="How long a lane retries a failing target before failing its requests.")
    target_build: str = Field("", description="The Target configuration the rounds are for (TargetConfig.build_key; '' = any): a Target replica of another build refuses them (WrongBuild) and the lane retries elsewhere, so during a redeploy old and new replicas never verify each other's sequences.")
    draft_backoff_s: float = Field(5.0, ge=0, description="After a failed draft call, rounds run without drafts this long.")
    draft_timeout_s: float = Field(10.0, gt=0, description="A draft call slower than this counts as failed (e.g. no draft replica up).")


class RequestFailed(Exception):
    """A sequence could not be finished; `status` is the HTTP status to report."""

    def __init__(self, message: str, status: int = 503):
        super().__init__(message)
        self.status = status


class Overloaded(RequestFailed):
    def __init__(self, message: str = "server overloaded: too many queued requests", retry_after: int = 1):
        super().__init__(message, 503)
        self.retry_after = retry_after


@dataclass
class _RequestTally:
    """A request's figures for the metrics while its sequences (prompts x n) finish."""

    left: int  # sequences not finished yet
    prompt_tokens: int  # each prompt once
    completion_tokens: int = 0
    reason: str = "stop"  # error if any failed, else abort if any was aborted, else length if any hit its limit, else stop

    def add(self, seq: Sequence, failed: bool = False) -> bool:
        """Count a finished sequence (`failed`: the server failed it); whether it was the request's last."""
        self.left -= 1
        self.completion_tokens += seq.num_output
        rank = ("stop", "length", "abort", "error")
        r = "error" if failed else seq.finish_reason if seq.finish_reason in rank else "abort"
        self.reason = max(self.reason, r, key=rank.index)
        return self.left == 0


@dataclass
class Lane:
    scheduler: Scheduler
    target_pin: str | None = None
    draft_pin: str | None = None
    draft_down_until: float = 0.0
    pending_draft_release: list[int] = field(default_factory=list)
    task: asyncio.Task | None = None
    starved: bool = False  # its target refused some rows a slot in the last round (they wait in line there)
    moved_at: float = 0.0  # when it last moved off a replica short of slots (time.monotonic)

    @property
    def load(self) -> int:
        return len(self.scheduler.running) + len(self.scheduler.waiting)


def _held(lane: Lane) -> list[int]:
    """Ids whose state the lane's current replicas may hold: its running rows and those that left
    since its last call (finished or cancelled, their releases not yet sent)."""
    return [s.seq_id for s in lane.scheduler.running] + list(lane.scheduler.to_release)


class Batcher:
    """Queues sequences and runs lanes of speculative rounds over the Draft and Target
    deployments. Not a deployment itself: the Router deployment's ingress (serve_app/api.py) holds one."""

    def __init__(self, config: dict, draft_handle, target_handle):
        self.cfg = self.built = RouterConfig(**config)  # (`built`: what a knob left out of user_config returns to)
        self.built_batch_size = self.cfg.max_batch_size  # rows per lane the replicas' KV slots were sized for
        self.tokenizer = load_tokenizer(self.cfg.tokenizer)
        self.eos_ids = eos_ids_of(self.tokenizer)
        self.draft, self.target = draft_handle, target_handle
        self.queue: deque[Sequence] = deque()
        self.lanes: list[Lane] = []
        self.events: dict[int, asyncio.Event] = {}
        self.errors: dict[int, RequestFailed] = {}
        self.profile = RoundProfile()  # where rounds' wall time goes (bench/round_profile.py)
        self.cost = CostModel()  # measured costs by batch size, shared by all lanes (they outlive none)
        self.stats = SpecStats()  # one statistics object for all lanes (each lane's scheduler records here)
        self.proposer_has_model = self.cfg.proposer_has_model
        self.resyncs = {"draft": 0, "target": 0}  # rows a replica did not hold (re-prefilled)
        self.draft_failures: dict[str, int] = {}  # failed Draft calls by exception type (each: a lane without drafts)
        self.rounds_by_target: dict[str, int] = {}  # target replica id -> rounds it verified
        # replica id -> until when new calls avoid it: a call to it timed out (a hung forward keeps
        # its process, and its health check, alive until forward_timeout_s)
        self.suspects: dict[str, float] = {}
        self.metrics = self._make_metrics()
        self.requests: dict = {}  # request group -> _RequestTally (metrics count requests, not sequences)
        self._background: set[asyncio.Task] = set()  # releases re-delivered after a failed call
        self._health: tuple[float, str | None] = (-HEALTH_CACHE_S, None)  # (when probed, why not ready)
        self.id = replica_id()
        ensure_provider(self.cfg.tracing_env)

    def _make_metrics(self):
        try:
            from deployments.metrics import RouterMetrics
            return RouterMetrics()
        except Exception as e:  # noqa: BLE001 - metrics are optional outside a cluster
            log.warning("router metrics disabled: %s", e)
            return None

    def reconfigure(self, user_config: dict) -> None:
        """Runtime knobs from the deployment's user_config, over the built config: a knob the new
        user_config leaves out returns to its built value, as in a replica started now."""
        allowed = set(SchedulingConfig.model_fields)
        unknown = set(user_config) - allowed
        if unknown:
            raise ValueError(f"unknown user_config keys {sorted(unknown)}; allowed: {sorted(allowed)}")
        cfg = RouterConfig.model_validate({**self.built.model_dump(), **user_config})  # (converted, or nothing changes)
        if cfg.max_batch_size > self.built_batch_size:
            raise ValueError(f"max_batch_size can only be lowered at runtime: the replicas' KV caches hold "
                             f"{self.built_batch_size} rows per lane (rebuild the app to raise it)")
        if user_config.get("num_speculative_tokens") and not (self.built.speculate and self.draft is not None):
            raise ValueError("num_speculative_tokens > 0 has no effect: the app was built without speculation "
                             "(proposer=none or num_speculative_tokens=0, so no Draft deployment); rebuild it to speculate")
        self.cfg = cfg
        for lane in self.lanes:
            lane.scheduler.set_config(self._sched_cfg())

    def _sched_cfg(self) -> SchedulerConfig:
        return scheduler_config(self.cfg, speculate=self.cfg.speculate and self.draft is not None)

    # ---- request side -------------------------------------------------------------------------
    def capacity(self) -> int:
        """Sequences the lanes can run at once (lanes x batch: the targets' KV-cache slots)."""
        return self.cfg.max_lanes * self.cfg.max_batch_size

    def _room(self) -> int:
        """Rows free now: in open lanes and in lanes not opened yet."""
        free = sum(max(0, self.cfg.max_batch_size - l.load) for l in self.lanes)
        return free + max(0, self.cfg.max_lanes - len(self.lanes)) * self.cfg.max_batch_size

    def check_size(self, prompts: int, choices: int) -> None:
        """RequestFailed (400) when a request of `prompts` x `choices` sequences exceeds what the
        server can ever hold (running and queued)."""
        count, most = prompts * choices, self.capacity() + self.cfg.max_queued_sequences
        if count > most:
            raise RequestFailed(f"too many sequences in one request ({prompts} prompt(s) x {choices} "
                                f"choice(s) = {count}); this server runs at most {most}", 400)

    def submit(self, prompts: list[list[int]], params: list[SamplingParams], group=None) -> list[Sequence]:
        """Queue one request: a sequence per prompt and params entry (n samples of each prompt),
        prompt-major, all or none. Raises RequestFailed (400) when the request alone exceeds
        what the server can ever hold, Overloaded when it fits neither in free lane rows nor in
        the bounded queue now. Sequences of one `group` (one request; default: this call) share
        the request's row cap (`max_request_share`)."""
        count = len(prompts) * len(params)
        self.check_size(len(prompts), len(params))
        if len(self.queue) + count > self.cfg.max_queued_sequences + self._room():
            raise Overloaded()
        seqs = [Sequence(list(ids), p, frozenset(self.eos_ids)) for ids in prompts for p in params]
        group = object() if group is None else group
        for s in seqs:
            s.meta["group"] = group
            self.events[s.seq_id] = asyncio.Event()
            self.queue.append(s)
        if self.metrics:
            self.metrics.record_request_start()
            self.requests[group] = _RequestTally(len(seqs), sum(map(len, prompts)))
            self._record_load()
        self._spawn_lanes()
        return seqs

    async def wait(self, seq: Sequence) -> None:
        """Block until `seq` changes; raises RequestFailed if its lane failed it."""
        ev = self.events.get(seq.seq_id)
        if ev is not None and not seq.finished:
            await ev.wait()
            ev.clear()
        err = self.errors.pop(seq.seq_id, None)
        if err is not None:
            raise err

    def finish(self, seq: Sequence) -> None:
        """Consumer is done with `seq` (finished, failed or disconnected): free everything, once."""
        ev = self.events.pop(seq.seq_id, None)
        if ev is None:
            return  # already finished (or never submitted here)
        if not seq.finished:
            seq.abort()
            try:
                self.queue.remove(seq)
            except ValueError:
                for lane in self.lanes:
                    if lane.scheduler.abort(seq.seq_id):
                        break
        ev.set()  # wake a waiter that is still parked on it
        self.errors.pop(seq.seq_id, None)
        tally = self.requests.get(seq.meta.get("group"))
        if tally is not None and tally.add(seq, seq.meta.get("failed", False)):  # its request's last sequence
            del self.requests[seq.meta.get("group")]
            self.metrics.record_request_end(tally.reason, tally.prompt_tokens, tally.completion_tokens)
            self._record_load()

    # ---- lanes --------------------------------------------------------------------------------
    def _row_cap(self) -> int:
        """Rows one request may hold at once over all lanes."""
        return max(1, int(self.cfg.max_request_share * self.capacity()))

    def _held(self) -> Counter:
        """Rows each request group holds now (running or admitted, over all lanes)."""
        return Counter(s.meta.get("group") for l in self.lanes
                       for s in (*l.scheduler.running, *l.scheduler.waiting))

    def _startable(self) -> bool:
        """Some queued sequence may start now (its request is under its row cap)."""
        if not self.queue:
            return False
        held, cap = self._held(), self._row_cap()
        return any(held[s.meta.get("group")] < cap for s in self.queue)

    def _spawn_lanes(self) -> None:
        for lane in self.lanes:
            self._fill(lane)
        while len(self.lanes) < self.cfg.max_lanes and self._startable():
            lane = Lane(Scheduler(self._sched_cfg(), self.tokenizer, self.eos_ids,
                                  proposer_has_model=self.proposer_has_model, cost=self.cost, stats=self.stats))
            self.lanes.append(lane)
            self._fill(lane)
            # A fresh context: the lane outlives the request that opened it, so its Draft/Target
            # calls must not be Serve child requests of it (cancelled when that client hangs up).
            lane.task = asyncio.get_running_loop().create_task(self._run_lane(lane), context=contextvars.Context())

    def _fill(self, lane: Lane) -> None:
        """Admit queued sequences into `lane`, first come first served among requests under their
        row cap; a capped request's other sequences keep their place in the queue."""
        if not self.queue or lane.load >= self.cfg.max_batch_size:
            return
        held, cap = self._held(), self._row_cap()
        skipped: list[Sequence] = []
        while self.queue and lane.load < self.cfg.max_batch_size:
            s = self.queue.popleft()
            group = s.meta.get("group")
            if held[group] >= cap:
                skipped.append(s)
                continue
            held[group] += 1
            lane.scheduler.add(s)
        self.queue.extendleft(reversed(skipped))

    async def _run_lane(self, lane: Lane) -> None:
        try:
            if self.cfg.batch_wait_timeout_s:
                await asyncio.sleep(self.cfg.batch_wait_timeout_s)  # let a burst arrive together
            while True:
                self._fill(lane)
                if not lane.scheduler.has_work:
                    break
                await self._round(lane)
        except Exception as e:  # noqa: BLE001 - fail this lane's sequences, keep the replica
            log.exception("lane failed")
            self._fail_lane(lane, RequestFailed(f"internal error: {short_error(e)}", 500))
        finally:
            if lane.scheduler.has_work:  # cancelled (replica shutting down): no request may hang
                self._fail_lane(lane, RequestFailed("request cancelled: the server is shutting down", 503))
            self.lanes.remove(lane)
            if self.metrics:
                self._record_load()  # no round will: the gauges must not keep the lane's rows
            await self._flush_releases(lane)
            if self.queue:
                self._spawn_lanes()  # opens lanes only for sequences that may start

    def _fail_lane(self, lane: Lane, err: RequestFailed) -> None:
        for s in list(lane.scheduler.running) + list(lane.scheduler.waiting):
            lane.scheduler.abort(s.seq_id)
            self.errors[s.seq_id] = err
            s.meta["failed"] = True  # (the request's metrics: error, not a client's abort)
            self._notify(s)

    def _notify(self, seq: Sequence) -> None:
        ev = self.events.get(seq.seq_id)
        if ev is not None:
            ev.set()

    async def _flush_releases(self, lane: Lane) -> None:
        ids = lane.scheduler.take_releases()
        calls = []
        if ids:
            calls.append(self.target.release.remote(ids, pin=lane.target_pin))
        dids, lane.pending_draft_release = lane.pending_draft_release + ids, []
        if dids and self.draft is not None and lane.draft_pin:  # (in the background: only the target's
            self._release_later(self.draft, lane.draft_pin, dids)  # slots gate the lane's clients)
        for c in calls:
            try:
                await asyncio.wait_for(c, timeout=self.cfg.draft_timeout_s)
            except Exception as e:  # noqa: BLE001 - a dead replica has nothing to free
                log.warning("release failed: %r", e)

    async def _round(self, lane: Lane) -> None:
        sched = lane.scheduler
        t0 = time.perf_counter()
        steps = round_steps(sched)
        try:
            first = next(steps)
        except StopIteration:
            return  # nothing to run
        plan = first.plan
        calls: dict[str, float] = {}  # wall clock around the calls, for the profile's hop split

        async def propose(plan):
            calls["draft_sent"] = time.time()
            out = await self._propose(lane, plan.draft_batch)
            calls["draft_back"] = time.time()
            return out

        async def verify(plan, draft):
            calls["target_sent"] = time.time()
            out = await self._verify(lane, plan, draft)
            calls["target_back"] = time.time()
            return out

        parent, links = sampled_first([s.meta.get("trace_ctx") for s in plan.seqs])
        with span("router.round", parent=parent, links=links, batch_size=len(plan.seqs),
                  k_max=plan.draft_batch.max_draft,
                  request_ids=",".join(str(s.meta.get("request_id", s.seq_id)) for s in plan.seqs)) as sp:
            plan.draft_batch.trace_context = inject()
            r = await run_round_async(steps, first, propose, verify)
            if r is None:  # the target call failed, and with it the lane's requests
                mark_error(sp, self.errors.get(plan.seqs[0].seq_id) or RequestFailed("target call failed"))
                return
            kept = plan.kept  # (as the requests' usage counts them: nothing past a stop)
            sp.set(proposed=sum(r.judged_drafts), emitted=sum(kept),
                   accepted=sum(min(m, e) for m, e, n in zip(r.verify.num_accepted, kept, r.judged_drafts) if n),
                   bonus=sum(1 for n, m, e in zip(r.judged_drafts, r.verify.num_accepted, kept) if n and m == n < e))
        self._account(r)
        # rows refused a slot (an older replica reports no `refused`: all its unknown rows), not those
        # the replica lacks (a lane that just moved, a restart): those are resent whole to it
        refused = r.verify.unknown if r.verify.refused is None else r.verify.refused
        lane.starved = bool(refused) and len(r.verify.unknown) < len(plan.seqs)  # (all refused: it backs off and re-pins below)
        if not sched.has_work and not self.queue:
            # the lane's last round: free its slots before its clients hear back, so a request they
            # send next never finds the replicas still holding them
            await self._flush_releases(lane)
        for s in plan.seqs:
            self._notify(s)
        self._profile(r, calls, time.perf_counter() - t0)
        if len(refused) == len(plan.seqs):  # no row progressed (target out of slots): back off
            # and let the request router pick again (it avoids other lanes' replicas). Slots free as
            # other lanes finish, and a replica takes back slots no router has touched for a while
            # (specdec.runner.SlotTable: a crashed router's, a lost release's), so the wait ends.
            lane.target_pin = None
            await asyncio.sleep(0.05)

    def _profile(self, r: RoundResult, calls: dict[str, float], round_s: float) -> None:
        ds = r.draft.served or (calls["draft_sent"], calls["draft_back"])
        vs = r.verify.served or (calls["target_sent"], calls["target_back"])  # (a retried verify: its last try)
        self.profile.observe("spec" if r.drafted else "plain", len(r.plan.seqs), sum(r.emitted),
                             plan_s=r.plan_s, draft_call_s=r.draft_s - r.plan_s, draft_compute_s=r.draft.draft_time,
                             draft_to_s=ds[0] - calls["draft_sent"] if r.drafted else 0.0,
                             draft_back_s=calls["draft_back"] - ds[1] if r.drafted else 0.0,
                             target_call_s=r.target_s, target_compute_s=r.verify.target_time,
                             target_to_s=vs[0] - calls["target_sent"], target_back_s=calls["target_back"] - vs[1],
                             commit_s=round_s - r.round_s, round_s=round_s)

    def _account(self, r: RoundResult) -> None:
        """Router-wide rates and metrics of a round (its statistics went to the shared SpecStats)."""
        plan, draft, verify = r.plan, r.draft, r.verify
        draft_s, target_s, round_s = r.draft_s, r.target_s, r.round_s
        self.resyncs["draft"] += len(draft.unknown)
        self.resyncs["target"] += len(verify.unknown)
        if self.metrics:
            kept = plan.kept  # the tokens sequences received (a round's tokens past a stop, or for a client gone, are not)
            self.metrics.record_round(len(plan.seqs), r.judged_drafts, list(verify.num_accepted), kept,
                                      draft_s, target_s, round_s, verify.lookup_proposed, verify.lookup_accepted)
            self._record_load()
            for s, e in zip(plan.seqs, kept):
                if e and s.first_token_time is not None and s.num_output == e:
                    self.metrics.record_first_token(s.first_token_time - s.arrival)
                elif e:
                    self.metrics.record_inter_token(round_s / e)

    def _avoid(self, lane: Lane, attr: str) -> list[str]:
        """Replicas other lanes already use, for a lane's first (unpinned) call, so that lanes
        spread over replicas (and a scaled-out replica gets the next lane), and for a Draft call
        whose replica other lanes share, which then moves to a replica no lane uses."""
        used = [p for l in self.lanes if l is not lane and (p := getattr(l, attr))]
        now = time.monotonic()
        used += [r for r, until in self.suspects.items() if until > now]
        pin = getattr(lane, attr)
        # a pinned call that gives its pin in `avoid` moves to a replica no lane uses, if there is one
        # (affinity.py): a Draft call whose replica other lanes share, a Target call whose replica has
        # no slot for some of its rows and other lanes (so a replica that scale-out adds is used: lanes
        # that stayed on a full one kept it full while it sat idle). A Target call short of slots on a
        # replica of its own may move to one of the others that reports room for it (`_room_wanted`).
        # Either Target move at most once per MOVE_COOLDOWN_S (`_may_move`).
        if not pin:
            return used
        if attr == "draft_pin":
            return used if pin in used else []
        return used if self._may_move(lane) else []

    @staticmethod
    def _may_move(lane: Lane) -> bool:
        """A lane whose Target replica refused some rows a slot, and that did not move within
        MOVE_COOLDOWN_S (routing stats lag: lanes that chose the same replica must not chase each
        other back and forth)."""
        return lane.starved and time.monotonic() - lane.moved_at > MOVE_COOLDOWN_S

    def _room_wanted(self, lane: Lane) -> int | None:
        """For a lane that may move (`_may_move`): its rows, which it takes to a replica that reports
        that many free slots (affinity.py)."""
        return lane.load if lane.target_pin and self._may_move(lane) else None

    def _suspect(self, rid: str | None) -> None:
        """A call timed out on replica `rid` (it may be hung), or it runs another build: new calls
        avoid it for SUSPECT_S (expired entries go: replicas come and go over days)."""
        if rid:
            now = time.monotonic()
            self.suspects = {r: until for r, until in self.suspects.items() if until > now}
            self.suspects[rid] = now + SUSPECT_S

    async def _propose(self, lane: Lane, batch) -> tuple[DraftOutput, bool]:
        if self.draft is None or batch.max_draft == 0 or time.monotonic() < lane.draft_down_until:
            if self.draft is not None:
                lane.pending_draft_release += batch.release  # deliver with the next draft call
                if len(lane.pending_draft_release) >= MAX_PENDING_RELEASES:  # a long run without drafts
                    if lane.draft_pin:  # (an unpinned lane has no draft state anywhere)
                        self._release_later(self.draft, lane.draft_pin, lane.pending_draft_release)
                    lane.pending_draft_release = []
            return DraftOutput.empty(len(batch)), False
        batch.release = lane.pending_draft_release + list(batch.release)
        lane.pending_draft_release = []
        try:
            rid, out = await asyncio.wait_for(self.draft.propose.remote(batch, pin=lane.draft_pin,
                                                                        avoid=self._avoid(lane, "draft_pin")),
                                              timeout=self.cfg.draft_timeout_s)
            if lane.draft_pin and rid != lane.draft_pin:  # moved (rebalanced, or its replica left): free the old one's state
                self._release_later(self.draft, lane.draft_pin, _held(lane) + list(batch.release))
            lane.draft_pin = rid
            return out, True
        except Exception as e:  # noqa: BLE001 - draft loss only costs speed: run a plain round
            # The pin stays after an error: a live replica keeps (and later frees) the lane's draft
            # state; a dead one is no longer a candidate and the affinity router picks another. A
            # replica that did not answer in time may be hung (alive, so still a candidate): the
            # lane leaves it, frees its state there in the background, and new calls avoid it.
            carried = list(batch.release)  # (the round's target call sends them to the target too: not cleared)
            if isinstance(e, asyncio.TimeoutError) and lane.draft_pin:
                self._suspect(lane.draft_pin)
                self._release_later(self.draft, lane.draft_pin, _held(lane) + carried)
                carried, lane.draft_pin = [], None
            log.warning("draft call failed (%r); lane runs without drafts for %.1fs", e, self.cfg.draft_backoff_s)
            kind = type(e).__name__
            self.draft_failures[kind] = self.draft_failures.get(kind, 0) + 1
            if self.metrics:
                self.metrics.record_draft_failure(kind)
            # the releases it carried may not have arrived (a timeout leaves a live, slow replica):
            # deliver them again with the next call (releasing twice is harmless)
            lane.pending_draft_release = carried + lane.pending_draft_release
            lane.draft_down_until = time.monotonic() + self.cfg.draft_backoff_s
            for s in lane.scheduler.running:
                s.draft_offset = 0  # whichever replica serves next must get the full context
                if self.cfg.features:
                    s.target_offset = 0  # ... and its features, which the target computes again
            return DraftOutput.empty(len(batch)), False

    async def _verify(self, lane: Lane, plan, draft: DraftOutput):
        from ray.exceptions import RayActorError
        try:
            from ray.exceptions import ActorUnavailableError
        except ImportError:  # pragma: no cover
            ActorUnavailableError = RayActorError
        deadline = time.monotonic() + self.cfg.retry_deadline_s
        release = list(plan.draft_batch.release)
        backoff, refused_move = 0.2, False
        while True:
            tb = lane.scheduler.target_batch(plan, draft)
            tb.release, tb.build = release, self.cfg.target_build
            try:
                avoid, room = self._avoid(lane, "target_pin"), self._room_wanted(lane)
                may_move = bool(room) or lane.target_pin in avoid
                rid, out = await asyncio.wait_for(self.target.verify.remote(tb, draft, pin=lane.target_pin, avoid=avoid,
                                                                            room=room),
                                                  timeout=max(0.1, deadline - time.monotonic()))
                if may_move and rid != lane.target_pin and len(out.refused or ()) == len(tb):
                    lane.moved_at = time.monotonic()  # the replica it moved to had no room after all: stay
                    refused_move = True
                    continue
                if may_move and rid != lane.target_pin:  # rebalanced: the old replica
                    self._release_later(self.target, lane.target_pin, _held(lane) + release)  # frees its rows
                    lane.moved_at = time.monotonic()  # (and the new one reports them unknown)
                lane.target_pin = rid
                self.rounds_by_target[rid] = self.rounds_by_target.get(rid, 0) + 1
                return out
            except asyncio.TimeoutError:  # e.g. no target replica came up: give up
                # A replica that did not answer in retry_deadline_s may be hung (alive, and healthy
                # to Serve, until forward_timeout_s): new calls avoid it while others can serve.
                # (A slow forward and a hung one look alike before then: the lane's rows fail
                # rather than move.) The lane leaves it, so the queued requests it takes next start
                # elsewhere; the replica frees the rows it held in the background. (A call that
                # could move may have hung elsewhere, and one that a move refused spent part of its
                # time elsewhere: no replica is blamed then.)
                if not (may_move or refused_move):
                    self._suspect(lane.target_pin)
                held = release + (_held(lane) if lane.target_pin else [])  # (the call may never have run there)
                if held:
                    self._release_later(self.target, lane.target_pin, held)
                lane.target_pin = None
                self._fail_lane(lane, RequestFailed("target unavailable: no replica answered within "
                                                    f"{self.cfg.retry_deadline_s:g}s", 503))
                return None
            except (RayActorError, ActorUnavailableError, TargetFault) as e:
                # TargetFault: a replica whose tensor-parallel group broke (a worker died); it
                # fails its health check and Serve replaces it.
                if isinstance(wrong := getattr(e, "cause", e), WrongBuild):  # (Serve wraps it: its cause)
                    self._suspect(wrong.replica)  # new calls avoid it while others can serve
                if time.monotonic() > deadline:
                    self._fail_lane(lane, RequestFailed(f"target unavailable: {short_error(e)}", 503))
                    return None
                log.warning("target replica lost (%s); re-prefilling the lane elsewhere", short_error(e))
                # An unavailable replica may come back: it must still free the finished rows' slots
                # and those of the rows re-prefilled elsewhere (should the lane land there again,
                # a row it no longer holds is re-prefilled: `unknown`).
                held = release + [s.seq_id for s in plan.seqs]
                if lane.target_pin is not None and held:
                    self._release_later(self.target, lane.target_pin, held)
                lane.target_pin = None
                for s in plan.seqs:
                    s.target_offset = 0
                release = []
                await asyncio.sleep(backoff)
                backoff = min(2.0, backoff * 2)
            except BaseException:  # the lane fails (or is cancelled): its final flush sends what this call carried
                lane.scheduler.to_release[:0] = release
                raise

    def _release_later(self, handle, pin: str | None, ids: list[int]) -> None:
        """Deliver releases to replica `pin` of `handle` (Target or Draft) in the background,
        retrying until `retry_deadline_s` (ids of finished sequences are harmless on any other
        replica)."""
        async def deliver():
            deadline, backoff = time.monotonic() + self.cfg.retry_deadline_s, 0.2
            while True:
                try:
                    await asyncio.wait_for(handle.release.remote(ids, pin=pin), timeout=self.cfg.draft_timeout_s)
                    return
                except Exception as e:  # noqa: BLE001 - retried until the deadline
                    if time.monotonic() + backoff > deadline:
                        log.warning("releases for replica %s lost: %s", pin, short_error(e))
                        return
                    await asyncio.sleep(backoff)
                    backoff = min(2.0, backoff * 2)
        task = asyncio.get_running_loop().create_task(deliver(), context=contextvars.Context())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- introspection ------------------------------------------------------------------------
    async def unready(self) -> str | None:
        """Why this router could not serve a request now (no Target replica of its build answered
        within HEALTH_TIMEOUT_S), or None when one did."""
        now = time.monotonic()
        if now - self._health[0] >= HEALTH_CACHE_S:
            try:
                await asyncio.wait_for(self.target.ready.remote(self.cfg.target_build), HEALTH_TIMEOUT_S)
                why = None
            except asyncio.TimeoutError:
                why = f"no Target replica answered within {HEALTH_TIMEOUT_S:g} s"
            except Exception as e:  # noqa: BLE001 - reported, not raised
                why = f"Target: {short_error(e)}"  # (unwraps a replica's error from Ray's traceback text)
            self._health = (time.monotonic(), why)
        return self._health[1]

    def engine_stats(self) -> dict:
        d = self.stats.to_dict()
        d.update(profile=self.profile.to_dict(), measured_speedup=self.cost.measured_speedups(),
                 lookup_gate=self.cost.lookups.to_dict(), lanes=len(self.lanes), queued=len(self.queue), replica=self.id, pid=os.getpid(),
                 running=sum(len(l.scheduler.running) for l in self.lanes),
                 tasks=len(asyncio.all_tasks()),
                 draft_resyncs=self.resyncs["draft"], target_resyncs=self.resyncs["target"],
                 draft_failures=dict(self.draft_failures),
                 lane_targets=[l.target_pin for l in self.lanes], lane_drafts=[l.draft_pin for l in self.lanes],
                 rounds_by_target=dict(self.rounds_by_target))  # debug: asyncio tasks of this replica (leak checks)
        return d

    def _record_load(self) -> None:
        """The live queue, running and speculating counts into the metrics (gauges, autoscaling)."""
        running = [s for l in self.lanes for s in (*l.scheduler.running, *l.scheduler.waiting)]  # (admitted: next round)
        now = time.monotonic()  # a lane whose drafts are off (draft_backoff_s) plans k but drafts nothing
        on = sum(1 for l in self.lanes if now >= l.draft_down_until
                 for s in l.scheduler.running if s.adaptive and s.adaptive.off_rounds == 0)
        self.metrics.record_queue(len(self.queue), len(running))
        self.metrics.record_speculation(on, len(running) - on)

    def record_autoscaling_stats(self) -> dict:
        """Serve's custom autoscaling metrics: RouterMetrics' dict (keys ROUTER_*), load as of now."""
        if self.metrics is None:
            return {}
        self._record_load()
        return self.metrics.autoscaling_stats()
