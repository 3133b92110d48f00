"""OpenTelemetry tracing for the service: one switch, standard env vars, W3C context across actors.

`setup_tracing(cfg)` installs, once per process, a TracerProvider (sampler: ParentBased(
TraceIdRatioBased(sampling_ratio)), or the SDK's own from OTEL_TRACES_SAMPLER) with one exporter
from `EXPORTERS`: "otlp" (OTLP over HTTP/protobuf, batched), "console" (stdout), "jsonl" (one
compact JSON object per span -- trace_id, span_id, parent_id, times, attributes, links, resource, pid --
appended to a file that several processes can share, batched), "memory" (tests, debugging). With
"none" nothing is installed and spans cost a no-op call.

Ray Serve's own tracing (RAY_SERVE_TRACING_EXPORTER_IMPORT_PATH=
serve_app.telemetry:ray_serve_tracing_exporter) installs its TracerProvider in every replica and
proxy; `setup_tracing` then adopts it (only one provider can be global), so our spans become
children of Serve's request spans. Call it in a deployment's constructor, not at import time.
Plain actors (the TP workers) call it with no argument, through SPECDEC_TRACING_SETUP (read by
deployments/tracing.py, the one span API, which setup_tracing points at its provider's tracer).
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from typing import Any, Literal, Mapping

from opentelemetry import trace
from opentelemetry.sdk.trace.export import ConsoleSpanExporter
from pydantic import BaseModel, ConfigDict, Field, model_validator

from deployments import tracing

logger = logging.getLogger(__name__)

ExporterName = Literal["none", "console", "jsonl", "otlp", "memory"]


class TracingConfig(BaseModel):
    """Where spans go and how many traces are kept."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    exporter: ExporterName = Field(
        "none", description="Span exporter: none (tracing off, no cost), console (stdout), jsonl "
        "(JSON lines appended to `path`), otlp (OTLP http/protobuf) or memory (in-process list).")
    path: str | None = Field(
        None, description="File that the jsonl exporter appends to (required for jsonl).")
    otlp_endpoint: str | None = Field(
        None, description="Full OTLP/HTTP traces URL, e.g. http://collector:4318/v1/traces. None: "
        "the OTLP exporter reads OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT itself.")
    sampling_ratio: float | None = Field(
        None, ge=0.0, le=1.0, description="Fraction of new traces (root spans) sampled; spans with a "
        "parent follow the parent's decision (ParentBased). None: the SDK's own sampler from "
        "OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG (default parent-based, always on).")
    service_name: str | None = Field(
        None, description="OpenTelemetry resource service.name. None: the SDK's OTEL_SERVICE_NAME / "
        "OTEL_RESOURCE_ATTRIBUTES, else 'specdec'.")
    batch: bool | None = Field(
        None, description="BatchSpanProcessor (True) or SimpleSpanProcessor (False). None: batch "
        "for otlp and jsonl, simple for console and memory.")

    @model_validator(mode="after")
    def _path_for_jsonl(self) -> "TracingConfig":
        if self.exporter == "jsonl" and not self.path:
            raise ValueError("exporter 'jsonl' needs a path")
        if self.exporter == "jsonl" and (self.path.endswith(os.sep) or os.path.isdir(self.path)):
            raise ValueError(f"tracing path {self.path} is a directory; give the file spans are appended to")
        return self

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "TracingConfig":
        """Which exporter, from the environment; the SDK reads its other variables itself.

        SPECDEC_TRACING_EXPORTER (none|console|jsonl|otlp|memory) and SPECDEC_TRACING_PATH win
        (SPECDEC_TRACING_BATCH=0|1 picks the span processor); otherwise OTEL_SDK_DISABLED,
        OTEL_TRACES_EXPORTER (otlp|console|none), and an OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT alone
        selects otlp. Sampler, service name and endpoint stay None: the TracerProvider, Resource and
        OTLP exporter read OTEL_TRACES_SAMPLER(_ARG), OTEL_SERVICE_NAME and the endpoint variables.
        """
        env = os.environ if environ is None else environ
        get = lambda k: (env.get(k) or "").strip().lower()  # noqa: E731
        exporter = get("SPECDEC_TRACING_EXPORTER")
        if not exporter:
            listed = [x.strip() for x in get("OTEL_TRACES_EXPORTER").split(",") if x.strip()]
            known = [x for x in listed if x in ("otlp", "console", "none")]
            endpoint = get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or get("OTEL_EXPORTER_OTLP_ENDPOINT")
            if listed != known[:1]:
                logger.warning("OTEL_TRACES_EXPORTER=%s: one exporter of otlp, console, none is supported; using %s",
                               ",".join(listed), known[0] if known else "none")
            if get("OTEL_SDK_DISABLED") == "true":
                exporter = "none"
            elif listed:
                exporter = known[0] if known else "none"  # (an unknown exporter never turns into otlp)
            else:
                exporter = "otlp" if endpoint else "none"
        path = (env.get("SPECDEC_TRACING_PATH") or "").strip() or None
        if exporter == "jsonl" and not path:
            path = os.path.join(tempfile.gettempdir(), "specdec-spans.jsonl")
        return cls(exporter=exporter, path=path, batch={"1": True, "0": False}.get(get("SPECDEC_TRACING_BATCH")))

    def env(self) -> dict[str, str]:
        """The environment variables that make another process's from_env() and SDK read this config."""
        env = {"SPECDEC_TRACING_EXPORTER": self.exporter}
        if self.path:
            env["SPECDEC_TRACING_PATH"] = self.path
        if self.batch is not None:
            env["SPECDEC_TRACING_BATCH"] = "1" if self.batch else "0"
        if self.sampling_ratio is not None:
            env |= {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": str(self.sampling_ratio)}
        if self.service_name:
            env["OTEL_SERVICE_NAME"] = self.service_name
        if self.otlp_endpoint:
            env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = self.otlp_endpoint
        return env


# ---------------------------------------------------------------------------------------------
# exporters
# ---------------------------------------------------------------------------------------------

def span_to_json_line(span: Any) -> str:
    """One compact JSON line for a finished SDK span (the jsonl exporter's formatter)."""
    ctx = span.context
    parent = span.parent
    start, end = span.start_time, span.end_time
    record = {
        "name": span.name,
        "trace_id": format(ctx.trace_id, "032x"),
        "span_id": format(ctx.span_id, "016x"),
        "parent_id": format(parent.span_id, "016x") if parent is not None else None,
        "parent_remote": bool(parent.is_remote) if parent is not None else None,
        "kind": span.kind.name,
        "start_ns": start,
        "end_ns": end,
        "duration_ms": (end - start) / 1e6 if start is not None and end is not None else None,
        "status": span.status.status_code.name,
        "attributes": dict(span.attributes or {}),
        "events": [{"name": e.name, "ts_ns": e.timestamp, "attributes": dict(e.attributes or {})}
                   for e in span.events],
        "links": [{"trace_id": format(l.context.trace_id, "032x"), "span_id": format(l.context.span_id, "016x"),
                   "attributes": dict(l.attributes or {})} for l in span.links],
        "resource": dict(span.resource.attributes) if span.resource is not None else {},
        "pid": os.getpid(),
    }
    return json.dumps(record, separators=(",", ":"), default=str) + "\n"


class FileConsoleSpanExporter(ConsoleSpanExporter):
    """The SDK's ConsoleSpanExporter writing to a file it owns: closes the file on shutdown."""

    def shutdown(self) -> None:
        if not self.out.closed:
            self.out.flush()
            self.out.close()


_memory_exporter: Any = None


def _otlp(cfg: TracingConfig) -> Any:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter(endpoint=cfg.otlp_endpoint)


def _jsonl(cfg: TracingConfig) -> Any:
    os.makedirs(os.path.dirname(os.path.abspath(cfg.path)), exist_ok=True)
    out = open(cfg.path, "a", encoding="utf-8")  # closed by the provider's shutdown
    return FileConsoleSpanExporter(out=out, formatter=span_to_json_line, service_name=cfg.service_name)


def _memory(cfg: TracingConfig) -> Any:
    global _memory_exporter
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    _memory_exporter = InMemorySpanExporter()
    return _memory_exporter


EXPORTERS = {"otlp": _otlp, "jsonl": _jsonl, "memory": _memory,
             "console": lambda cfg: ConsoleSpanExporter(service_name=cfg.service_name)}


def make_span_processor(cfg: TracingConfig) -> Any:
    """A span processor (batch or simple, see TracingConfig.batch) around cfg's exporter."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    exporter = EXPORTERS[cfg.exporter](cfg)
    batch = cfg.batch if cfg.batch is not None else cfg.exporter in ("otlp", "jsonl")
    return BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)


# ---------------------------------------------------------------------------------------------
# process-wide setup
# ---------------------------------------------------------------------------------------------

_lock = threading.Lock()
_config: TracingConfig | None = None  # the config setup_tracing ran with (None: not yet)
_provider: Any = None  # the SDK TracerProvider our spans go to (None: tracing off; `_specdec_owned`: ours)
_serve_processors_made = False  # ray_serve_tracing_exporter ran in this process


def setup_tracing(cfg: TracingConfig | None = None) -> Any:
    """Install tracing for this process (first call wins; later calls return the same provider).

    `cfg` defaults to TracingConfig.from_env(). Returns the SDK TracerProvider in use, or None
    when the exporter is "none".
    """
    global _config, _provider
    cfg = cfg if cfg is not None else TracingConfig.from_env()
    with _lock:
        if _config is not None:
            if cfg != _config:
                logger.warning("tracing already set up with %r; ignoring %r", _config, cfg)
            return _provider
        _config = cfg
        if cfg.exporter == "none":
            tracing.use_tracer(trace.NoOpTracer())
            return None

        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        existing = trace.get_tracer_provider()
        if isinstance(existing, TracerProvider) and not getattr(existing, "_specdec_owned", False):
            provider = existing  # e.g. Ray Serve's: share it
            if not _serve_processors_made:
                provider.add_span_processor(make_span_processor(cfg))
        else:
            resource = Resource.create({"process.pid": os.getpid(),
                                        **({SERVICE_NAME: cfg.service_name} if cfg.service_name else {})})
            if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):  # none in the env
                resource = resource.merge(Resource({SERVICE_NAME: "specdec"}))
            sampler = None if cfg.sampling_ratio is None else ParentBased(TraceIdRatioBased(cfg.sampling_ratio))
            provider = TracerProvider(resource=resource, sampler=sampler)  # None: from OTEL_TRACES_SAMPLER
            provider._specdec_owned = True
            provider.add_span_processor(make_span_processor(cfg))
            if isinstance(existing, trace.ProxyTracerProvider):
                trace.set_tracer_provider(provider)  # so library instrumentation sees it too
        _provider = provider
        tracing.use_tracer(provider.get_tracer(tracing.SCOPE), flush=provider.force_flush)
        return provider


# ---------------------------------------------------------------------------------------------
# Ray Serve's built-in tracing hook
# ---------------------------------------------------------------------------------------------

def ray_serve_tracing_exporter():
    """For RAY_SERVE_TRACING_EXPORTER_IMPORT_PATH=serve_app.telemetry:ray_serve_tracing_exporter.

    Ray Serve 2.60 imports this in each proxy and replica, checks it is a plain function with no
    parameters, calls it and requires a list of SpanProcessor, which it adds to the
    TracerProvider it installs (its sampler: RAY_SERVE_TRACING_SAMPLING_RATIO). The exporter
    comes from TracingConfig.from_env() of that process; "none" yields no processors.
    """
    global _serve_processors_made
    cfg = TracingConfig.from_env()
    if cfg.exporter == "none":
        logger.warning("RAY_SERVE_TRACING_EXPORTER_IMPORT_PATH points at specdec but "
                       "SPECDEC_TRACING_EXPORTER / OTEL_* select no exporter: spans are dropped")
        return []
    _serve_processors_made = True
    return [make_span_processor(cfg)]
