"""Target deployment: each replica is a tensor-parallel group of `tp` ranks.

The replica actor is rank 0. It reserves one placement-group bundle per rank (set by the builder
with STRICT_PACK), starts `tp - 1` `TPWorker` actors in the other bundles, and all ranks form a
torch.distributed group (gloo on CPU, NCCL on GPU). Every rank loads the model and keeps its
Megatron shard (`specdec.tp.apply_tp`). A verify call runs the same forward on every rank
(rank 0 sends the inputs to the workers), and only rank 0 samples and keeps sequence state.

A group is only as alive as its ranks: when a forward fails in a group (a worker died, a
collective broke), the replica marks itself broken, answers every later verify with
`TargetFault` (the router retries the lane on another replica) and fails its health check, so
Serve replaces the whole group.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import socket
import time

import ray
import torch
from pydantic import Field, model_validator

from deployments.tracing import ensure_provider, flush
from deployments.common import HoldsRows, ModelRuntime, ModelThread, replica_id, set_torch_threads, short_error
from deployments.metrics import (TARGET_ACTIVE_SEQUENCES, TARGET_BUSY_FRACTION, TARGET_TOKENS_PER_S,
                                 LoadMeter)
from specdec.corpus import NgramCorpus
from specdec.loader import load_model, parse_dtype, resolve_corpus
from specdec.metadata import DraftOutput, SpecBatch, VerifyOutput
from specdec.target_worker import TargetWorker
from specdec.tp import apply_tp

log = logging.getLogger("ray.serve")


class TargetFault(RuntimeError):
    """This target replica cannot serve (its tensor-parallel group is broken): retry elsewhere."""


class WrongBuild(TargetFault):
    """A round from a router built for another Target configuration (`TargetConfig.build_key`):
    during a redeploy old and new replicas run side by side, and a row's tokens verified by
    another model, or past another max_model_len, would come back wrong or fail its lane. The
    router avoids `replica` and retries elsewhere."""

    def __init__(self, message: str, replica: str = ""):
        super().__init__(message)
        self.replica = replica

    def __reduce__(self):
        return type(self), (self.args[0], self.replica)


class RanksOutOfStep(RuntimeError):
    """A forward failed on rank 0 while the other ranks still wait in its collectives: the
    group's next collectives would pair with theirs, so the group cannot serve any more."""


OUT_OF_STEP_WAIT_S = 5.0  # how long a failed rank 0 waits for the other ranks to fail the same forward


class TargetConfig(ModelRuntime):
    """Configuration of the Target deployment."""

    model: str = Field(description="Target checkpoint: HF directory, .gguf file, or 'smollm2'.")
    tp: int = Field(1, ge=1, description="Tensor-parallel degree: ranks (bundles) per replica.")
    num_slots: int = Field(16, ge=1, description="KV-cache slots (concurrent sequences) per replica.")
    return_hidden: bool = Field(False, description="Return hidden states of emitted positions (EAGLE drafts).")
    feature_layers: list[int] = Field(default_factory=list, description="Layers whose outputs precede the final feature in those hidden states (an EAGLE-3 draft's fusion, from its config.json).")
    worker_cpus: float = Field(0.5, gt=0, description="CPUs each TP worker actor asks for (its bundle's share).")
    worker_gpus: float = Field(0, ge=0, description="GPUs each TP worker actor asks for.")
    lookup_corpus: str | None = Field(None, description="Corpus of the target's own answers (specdec.corpus: an .npz file, or a shipped corpus's name) that continues prompt-lookup drafts in multi-step plain rounds; None: prompt lookup alone.")
    draft_in_target: str | None = Field(None, description="An EAGLE-style draft checkpoint that the replica also loads (tp=1; it shares the target's embedding and head): in multi-step plain rounds it drafts the rows that prompt lookup finds nothing for, from the features computed in this process (TargetWorker.drafter); None: lookups only.")
    draft_in_target_k: int = Field(2, ge=1, le=8, description="Tokens the in-target draft proposes per sampled row and step.")
    draft_in_target_greedy_k: int | None = Field(None, ge=1, le=8, description="Tokens it proposes per greedy row and step; None: draft_in_target_k.")
    compile: bool = Field(False, description="Compile the target's layer stack (specdec.model.Transformer.compile_layers: torch.compile, inductor's C++ wrapper) when the replica starts; CPU and tp=1 only. Minutes of compiling the first time on a small CPU (inductor caches the code on disk); then a bf16 step of the demo target at batch 1 takes ~22 ms instead of ~32.")

    @model_validator(mode="after")
    def _draft_needs_one_rank(self) -> "TargetConfig":
        if self.draft_in_target and self.tp > 1:
            raise ValueError("draft_in_target needs tp=1 (the draft shares rank 0's unsharded embedding and head)")
        if self.compile and (self.tp > 1 or self.device != "cpu"):
            raise ValueError("compile needs tp=1 and device=cpu (the compiled path is measured there only)")
        return self

    def build_key(self) -> str:
        """What a router's rounds must be computed with to be verified here: the model, its numerics,
        the context length and the features it returns (a hash; other fields change no token)."""
        keys = {"model", "dtype", "device", "tp", "compile", "max_model_len", "return_hidden", "feature_layers"}
        return hashlib.sha256(json.dumps(self.model_dump(include=keys), sort_keys=True).encode()).hexdigest()[:16]


def _load_rank(cfg: TargetConfig, rank: int, world: int):
    set_torch_threads(cfg.num_threads)
    device = f"cuda:{torch.cuda.current_device()}" if cfg.device == "cuda" else "cpu"
    model = load_model(cfg.model, dtype=parse_dtype(cfg.dtype), device="cpu")
    if rank == 0:  # only rank 0's features leave the replica: the other ranks skip the taps
        model.feature_layers = tuple(cfg.feature_layers)
    return apply_tp(model, rank, world).to(device)  # sharded on the host: a rank's device holds its shard only


def _init_dist(backend: str, addr: str, port: int, rank: int, world: int, timeout_s: float) -> None:
    """Join the group; a collective waiting longer than `timeout_s` for a peer raises (torch's
    default, 30 minutes, left rank 0 hung when a worker's forward failed alone)."""
    import datetime

    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))


@ray.remote(concurrency_groups={"health": 1})
class TPWorker:
    """Rank r > 0 of a target replica: holds a shard and mirrors rank 0's forward calls. `ping`
    runs in a group of its own: a health check answers during a long forward (a prefill), which
    otherwise held it past its 10 s timeout and got a healthy replica replaced."""

    def __init__(self, cfg: dict, rank: int, world: int):
        self.cfg, self.rank, self.world = TargetConfig(**cfg), rank, world
        ensure_provider(self.cfg.tracing_env)
        self.model = None

    def init(self, backend: str, addr: str, port: int) -> int:
        _init_dist(backend, addr, port, self.rank, self.world, self.cfg.forward_timeout_s)
        self.model = _load_rank(self.cfg, self.rank, self.world)
        return os.getpid()

    def setup_cache(self, num_slots: int, max_len: int) -> None:
        self.model.setup_cache(num_slots, max_len)

    def forward(self, tokens, slots, starts, last, n_logits, n_hidden=0, trace_carrier=None, sibling=None,
                exact=None):
        from deployments.tracing import span
        with span("tp_worker.forward", trace_carrier, rank=self.rank, rows=int(tokens.shape[0])):
            with torch.inference_mode():
                self.model(tokens, slots, starts, last, n_logits, n_hidden, sibling, exact)
        return True

    @ray.method(concurrency_group="health")
    def ping(self) -> tuple[int, int]:
        return self.rank, os.getpid()

    def flush(self) -> None:
        """Export buffered spans: the worker dies with its replica (ray.kill skips atexit)."""
        flush()


class TPGroupModel:
    """Rank 0's view of the group: calling it runs the forward on every rank, returns rank 0's."""

    def __init__(self, model, workers: list):
        self.model, self.workers = model, workers
        self.args = model.args
        self.trace_carrier = None

    @property
    def device(self):
        return self.model.device

    def setup_cache(self, num_slots: int, max_len: int) -> None:
        refs = [w.setup_cache.remote(num_slots, max_len) for w in self.workers]
        self.model.setup_cache(num_slots, max_len)
        ray.get(refs)

    def __call__(self, tokens, slots, starts, last=None, n_logits: int = 1, n_hidden: int = 0, sibling=None,
                 exact=None):
        cpu = [t.cpu() if torch.is_tensor(t) else t for t in (tokens, slots, starts, last, sibling)]
        refs = [w.forward.remote(*cpu[:4], n_logits, n_hidden, self.trace_carrier, cpu[4], exact) for w in self.workers]
        try:
            out = self.model(tokens, slots, starts, last, n_logits, n_hidden, sibling, exact)
        except Exception as e:
            # the same failure on every rank (at the same point) leaves the group in step; a rank-0-only
            # one (e.g. an allocation on the rank that also holds the logits) leaves the others waiting
            _, waiting = ray.wait(refs, num_returns=len(refs), timeout=OUT_OF_STEP_WAIT_S)
            if waiting:
                raise RanksOutOfStep(f"rank 0 failed mid-forward ({type(e).__name__}: {e}) while "
                                     f"{len(waiting)} rank(s) still wait in its collectives") from e
            raise
        ray.get(refs)  # surfaces a dead worker as an exception
        return out


def make_worker(cfg: TargetConfig, model) -> TargetWorker:
    """The target side of rounds over `model` (rank 0's, or a TP group's) as `cfg` sets it up: KV
    slots, the lookup corpus, the in-target draft (an in-process copy of the service, e.g.
    bench/http_bench.py, builds it the same way)."""
    corpus = NgramCorpus.load(resolve_corpus(cfg.lookup_corpus)) if cfg.lookup_corpus else None
    return TargetWorker(model, cfg.num_slots, cfg.max_model_len, cfg.return_hidden, corpus,
                        _drafter(cfg, model), cfg.draft_in_target_k, cfg.draft_in_target_greedy_k, cfg.compile)


def _drafter(cfg: TargetConfig, model):
    """The in-target draft (TargetConfig.draft_in_target), sharing the target's embedding and head, or None."""
    if not cfg.draft_in_target:
        return None
    from specdec.proposers import build_proposer
    return build_proposer("eagle", draft=cfg.draft_in_target, target=cfg.model, dtype=parse_dtype(cfg.dtype),
                          num_slots=cfg.num_slots, max_model_len=cfg.max_model_len, target_model=model)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class TargetDeployment(HoldsRows):
    """Serve deployment class (decorated by the builder): verify rounds for the router."""

    def __init__(self, config: dict):
        self.cfg = TargetConfig(**config)
        self.build = self.cfg.build_key()
        ensure_provider(self.cfg.tracing_env)
        self.thread = ModelThread(self.cfg.num_threads, "target")  # rank 0's torch work, all of it
        self.workers = self.thread.run(self._start_workers) if self.cfg.tp > 1 else []
        self.worker = self.thread.run(self._load)
        self.broken: str | None = None  # why the TP group cannot serve any more
        self.tokens = LoadMeter()
        self.id = replica_id()
        log.info("target replica %s ready (tp=%d, %s)", self.id, self.cfg.tp, self.cfg.dtype)

    async def __del__(self) -> None:
        """Serve stops the replica: its spans and its TP workers' still buffered are exported."""
        try:
            await asyncio.wait_for(asyncio.gather(*(w.flush.remote() for w in getattr(self, "workers", []))), 5)
        except Exception as e:  # noqa: BLE001 - a dead worker has nothing to send
            log.warning("TP workers' spans not flushed: %r", e)
        flush()

    def _load(self) -> TargetWorker:
        model = _load_rank(self.cfg, 0, self.cfg.tp)
        if self.workers:
            model = TPGroupModel(model, self.workers)
        return make_worker(self.cfg, model)

    def _start_workers(self) -> list:
        from ray.util.placement_group import get_current_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg = get_current_placement_group()
        world = self.cfg.tp
        workers = []
        for rank in range(1, world):
            strategy = (PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=rank)
                        if pg is not None else None)
            workers.append(TPWorker.options(num_cpus=self.cfg.worker_cpus, num_gpus=self.cfg.worker_gpus,
                                            scheduling_strategy=strategy).remote(self.cfg.model_dump(), rank, world))
        backend = "nccl" if self.cfg.device == "cuda" else "gloo"
        addr, port = ray.util.get_node_ip_address(), _free_port()
        refs = [w.init.remote(backend, addr, port) for w in workers]
        _init_dist(backend, addr, port, 0, world, self.cfg.forward_timeout_s)  # joins the workers' rendezvous
        ray.get(refs)
        return workers

    async def ready(self, build: str | None = None) -> str:
        """This replica's id, for a Router's health probe; refused, as a round would be, when the
        replica is broken or runs another build."""
        if build and build != self.build:
            raise WrongBuild(f"target replica {self.id} runs build {self.build}, not {build}", self.id)
        if self.broken:
            raise TargetFault(f"target replica {self.id} is broken: {self.broken}")
        return self.id

    async def verify(self, batch: SpecBatch, draft: DraftOutput, pin: str | None = None,
                     avoid: list[str] | None = None, room: int | None = None) -> tuple[str, VerifyOutput]:
        """One round for a batch; `pin`/`avoid`/`room` are read by the affinity request router. A call
        pinned elsewhere that gives `room` is a lane moving here for want of slots there: taken only if
        this replica has room for all its rows when it runs (TargetWorker.verify), else all refused."""
        arrived = time.time()
        move_in = room if room and pin is not None and pin != self.id else None
        if move_in and self.worker.table.room() < move_in:  # no room now: refused before it queues for the
            out = VerifyOutput.refusal(len(batch), self.worker.return_hidden)  # model thread (there it is checked again, TargetWorker.verify)
        else:
            out = await self.thread.call(self._verify, batch, draft, move_in)
        out.served = (arrived, time.time())
        return self.id, out

    def _verify(self, batch: SpecBatch, draft: DraftOutput, move_in: int | None = None) -> VerifyOutput:
        from deployments.tracing import span
        with span("target.verify", batch.trace_context, rows=len(batch), tp=self.cfg.tp) as sp:
            if self.workers:
                from deployments.tracing import inject
                self.worker.model.trace_carrier = inject()
            t0 = time.perf_counter()
            if batch.build and batch.build != self.build:
                raise WrongBuild(f"target replica {self.id} runs build {self.build}; the round is for "
                                 f"build {batch.build} (a redeploy is under way)", self.id)
            if self.broken:
                raise TargetFault(f"target replica {self.id} is broken: {self.broken}")
            try:
                out = self.worker.verify(batch, draft, move_in)
            except Exception as e:
                if self.workers and self._group_broken(e):
                    self.broken = short_error(e)
                    log.error("tensor-parallel group broken (%s); failing health checks until replaced", self.broken)
                    raise TargetFault(f"target replica {self.id} is broken: {self.broken}") from None
                raise
            n = sum(len(t) for t in out.tokens)
            self.tokens.record(n, time.perf_counter() - t0)
            sp.set(emitted=n, accepted=sum(out.num_accepted), unknown=len(out.unknown))
        return out

    def _free(self, seq_ids: list[int]) -> None:
        self.worker.release(seq_ids)

    def stats(self) -> dict:
        drafter = self.worker.drafter
        return {"replica": self.id, "active_sequences": len(self.worker.table),
                "draft_in_target_active": drafter.num_active if drafter is not None else 0,
                "free_slots": self.worker.table.num_free, "pid": os.getpid(),
                "tp_worker_pids": [pid for _, pid in ray.get([w.ping.remote() for w in self.workers], timeout=10)]}

    def worker_handles(self) -> list:
        """The TP worker actors (for fault-injection tests and debugging)."""
        return list(self.workers)

    def _group_broken(self, e: Exception) -> bool:
        """After a failed forward: is the group unusable (a rank gone, or the collective itself failed)?"""
        if isinstance(e, (ray.exceptions.RayError, RanksOutOfStep)) or "gloo" in str(e).lower() or "nccl" in str(e).lower():
            return True
        try:
            ray.get([w.ping.remote() for w in self.workers], timeout=5)
            return False
        except Exception:  # noqa: BLE001 - dead or unresponsive rank
            return True

    def check_health(self) -> None:
        """Fail (so Serve replaces this replica) when a tensor-parallel worker is gone or a
        forward hangs."""
        if self.broken:
            raise TargetFault(f"tensor-parallel group broken: {self.broken}")
        self.thread.check_not_stuck(self.cfg.forward_timeout_s)
        if self.workers:
            ray.get([w.ping.remote() for w in self.workers], timeout=10)

    def record_routing_stats(self) -> dict:
        """For the affinity request router (Serve polls it every ROUTING_STATS_PERIOD_S): KV slots a
        lane could take here, the free ones less the rows already waiting for one."""
        return {"free_slots": self.worker.table.room()}

    def record_autoscaling_stats(self) -> dict:
        return {TARGET_TOKENS_PER_S: self.tokens.tokens_per_s(), TARGET_ACTIVE_SEQUENCES: float(self.worker.table.active()),
                TARGET_BUSY_FRACTION: self.tokens.busy_fraction()}
