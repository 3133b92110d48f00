"""The application's typed arguments: one model for the whole app, cross-checked at build time.

`AppArgs` holds what a user passes to `serve run serve_app:build_app key=value ...` (or the
`args:` of a Serve config file) and derives each deployment's own config model from it. Checks
that span deployments happen in `validate_models()`, before anything is deployed: the target and
draft exist, share one tokenizer, and the tensor-parallel degree divides the head counts.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, model_validator

from deployments.common import Device, ForwardTimeout, NumThreads
from deployments.draft import DraftConfig, ProposerSettings
from deployments.batcher import RouterConfig, SchedulingConfig
from deployments.target import TargetConfig
from serve_app.telemetry import TracingConfig
from specdec.checks import DRAFT_PROPOSERS
from specdec.eagle_draft import feature_layers

# prompt lookup alone pays in small rounds only, and longer there (SchedulingConfig.lookup_k, lookup_max_batch)
LOOKUP_WITHOUT_CORPUS = {"lookup_max_batch": 4, "lookup_k": 4}


class ApiConfig(BaseModel):
    """HTTP API limits and security."""

    max_body_bytes: int = Field(1 << 20, ge=1024, description="Largest request body; larger gets 413.")
    max_n: int = Field(64, ge=1, description="Largest `n` (samples per prompt).")
    max_tokens_limit: int = Field(4096, ge=1, description="Largest max_tokens a request may ask for.")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a chat request gives none (at most max_tokens_limit).")
    max_stop: int = Field(16, ge=1, description="Most stop strings per request.")
    max_stop_len: int = Field(256, ge=1, description="Longest stop string.")
    require_api_key: bool = Field(False, description="Require `Authorization: Bearer <key>`; keys from SPECDEC_API_KEYS, SPECDEC_API_KEYS_FILE or api_keys_file.")
    api_keys_file: str | None = Field(None, description="File with one API key per line ('#' comments), read by each router replica; the keys themselves never enter the app's config.")


class AppArgs(SchedulingConfig, ProposerSettings):
    """Arguments of `serve_app:build_app`: the router's scheduling knobs and the proposer settings
    (inherited from the deployments' models) and what the builder derives the rest from."""

    model_config = {"extra": "forbid"}

    target: str = Field("smollm2", description="Target checkpoint: a Hugging Face directory, a .gguf file, or 'smollm2' (the demo model).")
    proposer: Literal["auto", "ngram", "draft", "eagle", "hybrid", "self", "none"] = Field("auto", description="Proposer: n-gram lookup, a draft model, an EAGLE-style draft over the target's features, hybrid (n-gram matches first, the draft otherwise), the target's first layers, or none. 'auto': the draft shipped for the target in the fastest measured mode (the demo target: hybrid with 'smollm2-eagle'), hybrid when a draft is given, n-gram otherwise.")
    tp: int = Field(1, ge=1, description="Tensor-parallel degree of each target replica.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="Weights and activations dtype. 'auto': bfloat16 on CPUs with native bfloat16 instructions (avx512_bf16, AMX), where bf16 speculation stays greedy-identical; float32 on other CPUs and on GPUs (see specdec.loader.fast_dtype; resolved on the machine that builds the app).")
    device: Device = "cpu"
    max_model_len: int | None = Field(None, ge=16, description="Longest sequence (prompt + output) in tokens. None: the target's own limit (max_position_embeddings), capped so that a target replica's preallocated KV cache fits in kv_cache_memory_gib; an explicit value above the model's limit is an error.")
    kv_cache_memory_gib: float = Field(2.0, gt=0, description="Memory the KV caches of one replica may take: a target replica's (all its slots, all TP ranks, and its in-target draft's), and a draft replica's (every lane's rows). Bounds the derived max_model_len, and an explicit max_model_len whose caches need more is an error (a replica also checks its machine's free memory before allocating).")
    model_name: str | None = Field(None, description="Model id in the API (default: derived from target).")
    num_threads: NumThreads = 0
    forward_timeout_s: ForwardTimeout = 300.0
    draft_threads: int = Field(1, ge=0, description="torch threads of a draft replica (0: like num_threads). One by default: the draft's forwards are small, and where it shares cores with the target, a second OpenMP team spin-waiting between proposals slowed the target's steps by ~10% (bench/round_profile.py, 2 cores).")
    target_cpus: float = Field(0.5, gt=0, description="CPUs per target rank (one placement-group bundle each).")
    draft_cpus: float = Field(0.25, gt=0, description="CPUs per draft replica.")
    router_cpus: float = Field(0.1, gt=0, description="CPUs per router replica.")
    target_replicas: int = Field(1, ge=1, description="Target replicas (initial when autoscaling).")
    draft_replicas: int = Field(1, ge=1, description="Draft replicas (initial when autoscaling).")
    router_replicas: int = Field(1, ge=1, description="Router replicas (initial when autoscaling).")
    autoscaling: bool = Field(False, description="Scale deployments with the custom policies in serve_app.autoscaling.")
    max_target_replicas: int = Field(4, ge=1, description="Upper bound for target replicas when autoscaling.")
    max_draft_replicas: int = Field(4, ge=1, description="Upper bound for draft replicas when autoscaling.")
    max_router_replicas: int = Field(2, ge=1, description="Upper bound for router replicas when autoscaling.")
    autoscaling_policy_kwargs: dict = Field(default_factory=dict, description="Overrides of serve_app.autoscaling.AutoscalingParams (capacities, thresholds, delays).")
    lookup_corpus: str | None = Field("auto", description="Corpus of the target's own answers to other questions (specdec.corpus; an .npz file made by specdec-corpus, or a shipped corpus's name) that continues prompt-lookup drafts in multi-step plain rounds, so they find tokens before an answer repeats itself; the output stays plain decoding's. 'auto': the corpus shipped for the target (the demo target: 'smollm2-corpus'), none otherwise; None: prompt lookup alone.")
    draft_in_target: bool = Field(True, description="With an EAGLE-style draft and tp=1 (the default app), the Target replica also holds a copy of the draft (~10 MB beside the target's shared embedding and head) and, in multi-step plain rounds, drafts draft_in_target_k tokens per step for rows that prompt lookup finds nothing for, checked against plain decoding's own draws like any lookup, so output stays plain decoding's; no Draft call and no feature transfer for those rounds. In process, bf16, batch 1, 64 tokens (bench/draft_in_target.py), over plain decoding: greedy 1.25x with lookups alone -> 1.43x with the in-target draft, T = 0.7 1.17x -> 1.32x, T = 1.0 1.02x -> 1.05x; through HTTP at concurrency 1, greedy spec/off 1.24-1.28x -> 1.39-1.41x (BENCHMARKS.md).")
    draft_in_target_k: int = Field(2, ge=1, le=8, description="Draft tokens per sampled row and step of the in-target draft (draft_in_target); like prompt lookups, at most lookup_k per row in rounds of several rows (max(lookup_k, ngram_k) at batch 1), and none above lookup_max_batch rows. With prepacked weights, in process at batch 1, 3 against 2: T 0.7 1.40x vs 1.40x, T 1.0 1.29x vs 1.27x (16 task questions) and 1.31x vs 1.35x (8 fresh ones).")
    draft_in_target_greedy_k: int = Field(3, ge=1, le=8, description="Draft tokens per greedy row and step of the in-target draft: a greedy row accepts more of a chain (capped as draft_in_target_k is). 3 against 2, in process at batch 1 with prepacked weights: 1.72x vs 1.68x over plain decoding (16 task questions), 1.53x vs 1.45x (8 fresh ones; bench/draft_in_target.py).")
    compile: bool = Field(False, description="Compile the target's layer stack when a target replica starts (TargetConfig.compile; CPU, tp=1): a bf16 step of the demo target ~22 ms instead of ~32, after minutes of compiling the first time.")
    lanes_per_target: int = Field(2, ge=1, description="Running batches (lanes) one target replica holds KV caches for, over all routers.")
    api: ApiConfig = Field(default_factory=ApiConfig, description="HTTP API limits and security.")
    tracing: TracingConfig | None = Field(None, description="OpenTelemetry tracing for every process of the app; None: from the standard OTel / SPECDEC_TRACING_* environment variables; 'none' on the command line: off.")

    @model_validator(mode="before")
    @classmethod
    def _parse_cli_strings(cls, data):
        """`serve run ... api={"max_n":8}` passes strings: parse JSON for nested fields."""
        for key in ("draft", "lookup_corpus"):
            if isinstance(data, dict) and data.get(key) in ("", "none", "None"):
                data = {**data, key: None}
        if isinstance(data, dict) and data.get("tracing") in ("none", "None"):  # no tracing (not: from the environment)
            data = {**data, "tracing": {"exporter": "none"}}
        for key in ("api", "tracing", "autoscaling_policy_kwargs"):
            if isinstance(data, dict) and isinstance(data.get(key), str):
                data = {**data, key: json.loads(data[key])}
        return data

    @model_validator(mode="after")
    def _check(self) -> "AppArgs":
        if self.dtype == "auto":
            from specdec.loader import fast_dtype
            self.dtype = fast_dtype(self.device)
        if self.proposer == "auto":
            from serve_app.constants import AUTO_PROPOSER_WITH_DRAFT, AUTO_PROPOSER_WITHOUT_DRAFT
            from specdec.loader import bundled_draft_for
            self.draft = self.draft or bundled_draft_for(self.target)
            self.proposer = AUTO_PROPOSER_WITH_DRAFT if self.draft else AUTO_PROPOSER_WITHOUT_DRAFT
        if self.lookup_corpus == "auto":
            from specdec.loader import bundled_corpus_for
            self.lookup_corpus = bundled_corpus_for(self.target)
        for key, value in LOOKUP_WITHOUT_CORPUS.items() if not self.lookup_corpus else ():
            if key not in self.model_fields_set:
                setattr(self, key, value)
        if self.proposer in DRAFT_PROPOSERS and not self.draft:
            raise ValueError(f"proposer={self.proposer!r} needs draft=PATH (a checkpoint with the target's tokenizer)")
        if self.draft and self.proposer not in DRAFT_PROPOSERS:
            raise ValueError(f"draft={self.draft!r} is given but proposer={self.proposer!r}; set proposer to one "
                             f"of {sorted(DRAFT_PROPOSERS)}")
        if self.device == "cpu" and self.dtype == "float16":
            raise ValueError("float16 is not supported on CPU; use bfloat16 or float32")
        from specdec.loader import local_path
        for key in ("target", "draft", "lookup_corpus"):  # replicas resolve paths in their own working directory
            if getattr(self, key) and (path := local_path(getattr(self, key))) is not None:
                setattr(self, key, str(path.resolve()))
        return self

    # ---- derived -----------------------------------------------------------------------------
    @property
    def served_model_name(self) -> str:
        if self.model_name:
            return self.model_name
        from specdec.loader import is_demo_target
        if is_demo_target(self.target):
            return "SmolLM2-135M-Instruct"
        return Path(self.target.rstrip("/")).name.removesuffix(".gguf")

    @property
    def speculate(self) -> bool:
        return self.proposer != "none" and self.num_speculative_tokens > 0

    @property
    def draft_on_device(self) -> bool:
        """The Draft replicas hold a model on `device` (n-gram lookup holds none: no GPU for it)."""
        return self.proposer != "ngram"

    @property
    def uses_features(self) -> bool:
        """The draft reads the target's features (an EAGLE-style checkpoint)."""
        from specdec.eagle_draft import is_eagle
        return self.speculate and self.proposer in DRAFT_PROPOSERS and is_eagle(self.draft)

    @property
    def in_target_draft(self) -> str | None:
        """The EAGLE-style draft a target replica also holds (draft_in_target: tp=1 only)."""
        return self.draft if self.uses_features and self.draft_in_target and self.tp == 1 else None

    @property
    def total_lanes(self) -> int:
        """Running batches the targets can hold at most (every lane needs a target's cache slots)."""
        return self.lanes_per_target * (max(self.max_target_replicas, self.target_replicas) if self.autoscaling
                                        else self.target_replicas)

    def tracing_env(self) -> dict[str, str]:
        """Environment for every replica (and TP worker) so that each installs the same tracing
        (tracing=None: each process reads the OTel / SPECDEC_TRACING_* variables it inherits);
        each deployment's config carries it (deployments.common.Traced)."""
        env = {"SPECDEC_TRACING_SETUP": "serve_app.telemetry:setup_tracing"}
        return env if self.tracing is None else env | self.tracing.env()

    def target_bundles(self) -> list[dict]:
        """Placement-group bundles of one target replica: one per tensor-parallel rank."""
        bundle = {"CPU": self.target_cpus}
        if self.device == "cuda":
            bundle["GPU"] = 1
        return [dict(bundle) for _ in range(self.tp)]

    def _runtime(self) -> dict:
        """The shared model-runtime settings (deployments.common.ModelRuntime) of draft and target."""
        return {"dtype": self.dtype, "device": self.device, "max_model_len": self._max_len(),
                "num_threads": self.num_threads, "forward_timeout_s": self.forward_timeout_s,
                "tracing_env": self.tracing_env()}

    def target_config(self) -> TargetConfig:
        return TargetConfig(**self._runtime(), model=self.target, tp=self.tp, num_slots=self.target_slots,
                            worker_cpus=self.target_cpus,
                            return_hidden=self.uses_features,
                            feature_layers=feature_layers(self.draft) if self.uses_features else [],
                            worker_gpus=1 if self.device == "cuda" else 0, lookup_corpus=self.lookup_corpus,
                            draft_in_target=self.in_target_draft,
                            draft_in_target_k=self.draft_in_target_k, draft_in_target_greedy_k=self.draft_in_target_greedy_k,
                            compile=self.compile)

    def draft_config(self) -> DraftConfig | None:
        if not self.speculate:
            return None
        return DraftConfig(**self.model_dump(include=set(ProposerSettings.model_fields)),
                           proposer=self.proposer, target=self.target, num_slots=self.max_batch_size * self.total_lanes,
                           **{**self._runtime(), "num_threads": self.draft_threads or self.num_threads})

    def router_config(self) -> RouterConfig:
        return RouterConfig(**self.model_dump(include=set(SchedulingConfig.model_fields)),
                            tokenizer=self.target, model_name=self.served_model_name,
                            max_lanes=max(1, self.total_lanes // self.router_replicas),
                            speculate=self.speculate, max_model_len=self._max_len(),
                            proposer_has_model=True,  # even n-gram drafts cost a deployment hop per round
                            features=self.uses_features, tracing_env=self.tracing_env(),
                            target_build=self.target_config().build_key())

    @property
    def target_slots(self) -> int:
        """KV-cache slots of one target replica: one row per lane it can hold."""
        return self.max_batch_size * self.lanes_per_target

    def _kv_caches(self, margs, draft_kv: int) -> list[tuple[str, int, int]]:
        """(replica, slots, bytes per position) of each replica's preallocated KV caches: a target
        replica's (all TP ranks, and its in-target draft's copy) and a draft replica's (every lane's
        rows; `draft_kv`: the draft's bytes per position, 0 for a draft without a cache)."""
        from specdec.loader import parse_dtype
        target_kv = margs.kv_bytes_per_token(parse_dtype(self.dtype).itemsize)
        caches = [("a target replica", self.target_slots, target_kv + (draft_kv if self.in_target_draft else 0))]
        return caches + ([("a draft replica", self.max_batch_size * self.total_lanes, draft_kv)] if draft_kv else [])

    def _resolve_max_model_len(self, margs, draft_kv: int = 0) -> int:
        """An explicit max_model_len, checked against the model and the KV-cache budget; else the
        model's own limit, capped so that every replica's caches fit the budget (as vLLM derives it
        from the model config and the cache memory)."""
        limit, what = margs.max_position_embeddings, "positions"
        if margs.sliding_window and margs.sliding_window < limit:  # exact only within one window
            limit, what = margs.sliding_window, "sliding-window span (not implemented: whole contexts are attended)"
        from specdec.model import KV_MARGIN
        budget = int(self.kv_cache_memory_gib * 2**30)
        caches = self._kv_caches(margs, draft_kv)
        if self.max_model_len is not None:
            if self.max_model_len > limit:
                raise ValueError(f"max_model_len={self.max_model_len} exceeds the target's {limit} {what}")
            for replica, slots, per_token in caches:
                if (need := per_token * slots * (self.max_model_len + KV_MARGIN)) > budget:
                    raise ValueError(f"the KV cache of {replica} ({slots} slots x {self.max_model_len} positions, "
                                     f"{per_token} bytes each) needs {need / 2**30:.2f} GiB, more than "
                                     f"kv_cache_memory_gib={self.kv_cache_memory_gib}; raise kv_cache_memory_gib "
                                     "(the replica must have the memory), or lower max_model_len / max_batch_size "
                                     "/ lanes_per_target")
            return self.max_model_len
        fits = min((budget // (per_token * slots) - KV_MARGIN) // 16 * 16 for _, slots, per_token in caches)
        if fits < 16:
            raise ValueError(f"kv_cache_memory_gib={self.kv_cache_memory_gib} holds {max(fits, 0)} positions for "
                             f"{self.target_slots} slots per replica; raise it, or lower max_batch_size / lanes_per_target")
        return min(limit, fits)

    def _max_len(self) -> int:
        if self.max_model_len is None:
            raise ValueError("max_model_len is derived from the target's config: call validate_models() first")
        return self.max_model_len

    # ---- cross-deployment checks (build time) ------------------------------------------------
    def validate_models(self) -> None:
        """Check the checkpoints against each other (specdec.checks: configs and tokenizers, not
        weights) and derive max_model_len from the target and the KV-cache budget."""
        from specdec.checks import check_models
        fit = check_models(self.target, self.draft, self.proposer, tp=self.tp, dtype=self.dtype,
                           self_draft_layers=self.self_draft_layers, lookup_corpus=self.lookup_corpus)
        explicit_len = self.max_model_len is not None
        self.max_model_len = self._resolve_max_model_len(fit.target, fit.draft_kv_bytes if self.speculate else 0)
        if fit.draft_positions is not None and fit.draft_positions < self.max_model_len:
            if explicit_len:
                raise ValueError(f"draft {self.draft} handles {fit.draft_positions} positions, "
                                 f"fewer than max_model_len={self.max_model_len}: lower max_model_len")
            self.max_model_len = fit.draft_positions // 16 * 16  # derived: the draft's limit too
