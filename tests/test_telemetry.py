"""Tracing setup: jsonl spans with parent links, W3C context across a real process boundary,
"none" installing nothing, sampling, env parsing and Ray Serve's exporter hook. No Ray cluster."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from deployments import tracing
from serve_app import telemetry as T
from serve_app.telemetry import TracingConfig

REPO = Path(__file__).resolve().parents[1]


def reset_tracing() -> None:
    """Shut down what setup_tracing installed and forget it. (OpenTelemetry sets the *global*
    provider once per process: after a reset a new setup's provider serves deployments.tracing's
    spans but not `opentelemetry.trace.get_tracer()`.)"""
    if getattr(T._provider, "_specdec_owned", False):
        T._provider.shutdown()
    T._config, T._provider, T._memory_exporter = None, None, None
    tracing.use_tracer(None)


def flush_tracing() -> bool:
    """Export buffered spans now (batch processors export in the background otherwise)."""
    return T._provider is None or T._provider.force_flush(5000)


@pytest.fixture(autouse=True)
def fresh_tracing():
    reset_tracing()
    yield
    reset_tracing()


def run_python(code: str, env: dict[str, str] | None = None, args: list[str] = ()) -> str:
    """Run `code` in a fresh interpreter (its own process, own OTel globals)."""
    full_env = {k: v for k, v in os.environ.items()
                if not k.startswith(("OTEL_", "SPECDEC_TRACING", "RAY_SERVE_TRACING"))}
    full_env["PYTHONPATH"] = str(REPO) + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.update(env or {})
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=REPO,
                         env=full_env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def read_spans(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_jsonl_exporter_writes_parseable_spans_with_parent_links(tmp_path):
    path = tmp_path / "spans.jsonl"
    provider = T.setup_tracing(TracingConfig(exporter="jsonl", path=str(path), service_name="svc"))
    assert provider is not None and T.setup_tracing(TracingConfig(exporter="memory")) is provider
    with tracing.span("other") as other:
        linked = other.span.get_span_context()
    with tracing.span("request", **{"request.id": "r1", "prompt_tokens": 7}):
        from opentelemetry import trace
        with tracing.span("round", links=[trace.set_span_in_context(other.span)]) as round_span:
            round_span.set_attribute("k", 4)
    assert flush_tracing()
    spans = {s["name"]: s for s in read_spans(path)}
    assert set(spans) == {"request", "round", "other"}
    req, rnd = spans["request"], spans["round"]
    assert rnd["links"] == [{"trace_id": format(linked.trace_id, "032x"), "span_id": format(linked.span_id, "016x"),
                             "attributes": {}}] and req["links"] == []
    assert rnd["trace_id"] == req["trace_id"] and len(req["trace_id"]) == 32
    assert rnd["parent_id"] == req["span_id"] and req["parent_id"] is None
    assert req["attributes"] == {"request.id": "r1", "prompt_tokens": 7} and rnd["attributes"] == {"k": 4}
    assert req["pid"] == os.getpid() and req["resource"]["process.pid"] == os.getpid()
    assert req["resource"]["service.name"] == "svc"
    assert req["duration_ms"] >= rnd["duration_ms"] >= 0


def test_context_round_trips_across_a_process_boundary(tmp_path):
    path = tmp_path / "spans.jsonl"
    T.setup_tracing(TracingConfig(exporter="jsonl", path=str(path)))
    child_code = """
        import json, sys
        from deployments import tracing
        from serve_app import telemetry as T
        T.setup_tracing()  # from env: jsonl into the same file, new roots never sampled
        assert tracing.start_span("unrelated_root")[0].is_recording() is False
        with tracing.span("remote_child", carrier=json.loads(sys.argv[1])) as s:
            assert s.is_recording()  # ParentBased: follows the sampled remote parent
        T._provider.force_flush()
    """
    with tracing.span("router_round") as parent:
        carrier = tracing.inject()
        assert set(carrier) >= {"traceparent"}
        run_python(child_code, args=[json.dumps(carrier)],
                   env={"SPECDEC_TRACING_EXPORTER": "jsonl", "SPECDEC_TRACING_PATH": str(path),
                        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"})
    flush_tracing()
    spans = {s["name"]: s for s in read_spans(path)}
    assert set(spans) == {"router_round", "remote_child"}
    child, par = spans["remote_child"], spans["router_round"]
    ctx = parent.get_span_context()
    version, trace_id, span_id, flags = carrier["traceparent"].split("-")
    assert (version, trace_id, span_id) == ("00", f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}")
    assert int(flags, 16) & 0x01  # sampled (OTel 1.45 also sets 0x02, W3C level-2 "random")
    assert child["trace_id"] == par["trace_id"] and child["parent_id"] == par["span_id"]
    assert child["parent_remote"] is True and child["pid"] != par["pid"]


def test_extract_of_empty_carrier_is_none():
    assert tracing.extract(None) is None and tracing.extract({}) is None
    assert tracing.inject() == {}  # no active span


def test_none_installs_nothing_and_costs_nothing():
    out = run_python("""
        import time
        from opentelemetry import trace
        from deployments import tracing
        from serve_app import telemetry as T
        assert T.setup_tracing(T.TracingConfig(exporter="none")) is None
        assert type(trace.get_tracer_provider()) is trace.ProxyTracerProvider
        assert isinstance(tracing._tracer, trace.NoOpTracer)
        with tracing.span("x", a=1) as s:
            assert not s.is_recording()
            assert tracing.inject() == {}
        n = 20000
        t0 = time.perf_counter()
        for _ in range(n):
            with tracing.span("hot"):
                pass
        per_span_us = (time.perf_counter() - t0) / n * 1e6
        t0 = time.perf_counter()
        for _ in range(n):
            tracing.inject()
        per_inject_us = (time.perf_counter() - t0) / n * 1e6
        print(per_span_us, per_inject_us)
    """)
    per_span_us, per_inject_us = map(float, out.split())
    assert per_span_us < 100 and per_inject_us < 100  # a no-op: a few us even on a busy CPU


def test_sampling_ratio_zero_drops_new_traces_but_follows_sampled_parents():
    T.setup_tracing(TracingConfig(exporter="memory", sampling_ratio=0.0))
    exporter = T._memory_exporter
    for _ in range(50):
        with tracing.span("dropped") as s:
            assert not s.is_recording()
    assert exporter.get_finished_spans() == ()
    sampled_parent = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    with tracing.span("continued", carrier=sampled_parent):
        pass
    (kept,) = exporter.get_finished_spans()
    assert kept.name == "continued" and format(kept.context.trace_id, "032x") == "0af7651916cd43dd8448eb211c80319c"


def test_sampling_ratio_one_keeps_everything():
    T.setup_tracing(TracingConfig(exporter="memory", sampling_ratio=1.0))
    for _ in range(20):
        with tracing.span("kept"):
            pass
    assert len(T._memory_exporter.get_finished_spans()) == 20


def test_from_env_picks_the_exporter_and_leaves_the_rest_to_the_sdk():
    assert TracingConfig.from_env({}).exporter == "none"
    cfg = TracingConfig.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/",
                                  "OTEL_TRACES_SAMPLER_ARG": "0.25", "OTEL_SERVICE_NAME": "llm"})
    assert (cfg.exporter, cfg.otlp_endpoint, cfg.sampling_ratio, cfg.service_name) == ("otlp", None, None, None)
    cfg = TracingConfig.from_env({"SPECDEC_TRACING_EXPORTER": "jsonl", "SPECDEC_TRACING_PATH": "/x.jsonl",
                                  "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"})
    assert (cfg.exporter, cfg.path) == ("jsonl", "/x.jsonl")
    assert TracingConfig.from_env({"SPECDEC_TRACING_EXPORTER": "jsonl"}).path.endswith("specdec-spans.jsonl")
    assert TracingConfig.from_env({"OTEL_TRACES_EXPORTER": "console"}).exporter == "console"
    assert TracingConfig.from_env({"OTEL_SDK_DISABLED": "true",
                                   "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}).exporter == "none"
    assert TracingConfig.from_env({"OTEL_TRACES_EXPORTER": "zipkin",  # unsupported: never otlp instead
                                   "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}).exporter == "none"
    assert TracingConfig.from_env({"OTEL_TRACES_EXPORTER": "zipkin,console"}).exporter == "console"
    with pytest.raises(ValueError):
        TracingConfig(exporter="jsonl")
    with pytest.raises(ValueError, match="is a directory"):  # (every replica failed to start on it)
        TracingConfig(exporter="jsonl", path=tempfile.gettempdir())
    with pytest.raises(ValueError):
        TracingConfig(exporter="otlp", sampling_ratio=1.5)


def test_a_request_span_is_a_child_of_the_current_span_without_a_traceparent():
    """Serve's request span is current when the ingress opens `router.request`: with no
    traceparent header it must be the parent (one trace per request, not two)."""
    T.setup_tracing(TracingConfig(exporter="memory"))
    with tracing.span("serve.request") as outer:
        req, _ = tracing.start_span("router.request", {"user-agent": "x"})
        req.end()
        incoming = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
        joined, _ = tracing.start_span("router.request", incoming)
        joined.end()
    assert req.parent.span_id == outer.get_span_context().span_id
    assert joined.parent.span_id == 0xb7ad6b7169203331  # a client's traceparent still wins
    # Serve's span already under the client's traceparent (its proxy propagated it): nested under it
    with tracing.span("serve.request", incoming) as serve_span:
        nested, _ = tracing.start_span("router.request", incoming)
        nested.end()
    assert nested.parent.span_id == serve_span.get_span_context().span_id


def test_a_request_span_is_a_child_of_serves_request_span_whatever_span_is_current():
    """With Ray Serve's tracing on, Serve's request span (`serve.get_trace_context()`, the `server`
    argument) is the parent, even when another span is current: FastAPI's own HTTP span starts
    from the headers alone, a trace of its own without a traceparent. A client's traceparent that
    Serve's span is not under still wins."""
    from opentelemetry import trace
    T.setup_tracing(TracingConfig(exporter="memory"))
    incoming = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    with tracing.span("replica_handle_request", incoming) as serve_span:
        server = trace.set_span_in_context(serve_span.span)
    with tracing.span("POST /v1/completions"):  # FastAPI's, a root: no traceparent reached it
        plain, _ = tracing.start_span("router.request", {}, server)
        plain.end()
    with tracing.span("POST /v1/completions", incoming) as fastapi_span:  # under the client's
        joined, _ = tracing.start_span("router.request", incoming, server)
        joined.end()
        other = {"traceparent": "00-1af7651916cd43dd8448eb211c80319c-c7ad6b7169203331-01"}
        elsewhere, _ = tracing.start_span("router.request", other, server)
        elsewhere.end()
    assert plain.parent.span_id == joined.parent.span_id == serve_span.get_span_context().span_id
    assert fastapi_span.get_span_context().span_id != plain.parent.span_id
    assert elsewhere.parent.span_id == 0xc7ad6b7169203331
    alone, _ = tracing.start_span("router.request", {}, trace.set_span_in_context(trace.INVALID_SPAN))
    alone.end()
    assert alone.parent is None  # Serve's tracing off: no span in its context, a root


def test_a_shared_span_takes_its_first_sampled_parent():
    """A batched round is a child of one request and links the others: of the first *sampled* one,
    since the child of an unsampled parent is dropped with it (a sampled request lost its rounds)."""
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    def ctx(trace_id: int, sampled: bool):
        flags = TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
        return trace.set_span_in_context(NonRecordingSpan(SpanContext(trace_id, 1, True, flags)))
    a, b, c = ctx(1, False), ctx(2, True), ctx(3, True)
    assert tracing.sampled_first([a, b, c]) == (b, [a, c])
    assert tracing.sampled_first([None, a]) == (None, [a])  # none sampled: the first, as before
    assert tracing.sampled_first([]) == (None, [])


def test_a_failed_request_or_round_is_an_error_in_its_trace():
    from opentelemetry.trace import StatusCode
    T.setup_tracing(TracingConfig(exporter="memory"))
    sp, _ = tracing.start_span("router.request")
    tracing.mark_error(sp, RuntimeError("target unavailable"))
    sp.end()
    with tracing.span("router.round") as rnd:
        tracing.mark_error(rnd, RuntimeError("target unavailable"))
    spans = T._memory_exporter.get_finished_spans()
    assert [s.status.status_code for s in spans] == [StatusCode.ERROR] * 2
    assert all(s.events[0].name == "exception" for s in spans)


def test_flush_exports_what_a_batch_processor_still_holds(tmp_path):
    """A replica stopping (ray.kill skips atexit) flushes its spans first."""
    path = tmp_path / "spans.jsonl"
    T.setup_tracing(TracingConfig(exporter="jsonl", path=str(path), batch=True))
    with tracing.span("last"):
        pass
    assert not path.exists() or not read_spans(path)  # still buffered
    tracing.flush()
    assert [s["name"] for s in read_spans(path)] == ["last"]


def test_explicit_config_reaches_another_process_through_the_sdks_own_variables(tmp_path):
    """AppArgs.tracing -> env() -> a replica's from_env() + the SDK: same sampler, name, endpoint."""
    path = tmp_path / "spans.jsonl"
    cfg = TracingConfig(exporter="jsonl", path=str(path), sampling_ratio=0.0, service_name="llm",
                        otlp_endpoint="http://c:4318/custom")
    env = cfg.env()
    assert env["OTEL_TRACES_SAMPLER_ARG"] == "0.0" and env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] == "http://c:4318/custom"
    out = run_python("""
        from deployments import tracing
        from serve_app import telemetry as T
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        T.setup_tracing()
        with tracing.span("dropped"):  # ratio 0: new roots are not sampled
            pass
        with tracing.span("kept", carrier={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}):
            pass
        T._provider.force_flush()
        print(OTLPSpanExporter()._endpoint)
    """, env=env)
    assert out.strip() == "http://c:4318/custom"
    (kept,) = read_spans(path)
    assert kept["name"] == "kept" and kept["resource"]["service.name"] == "llm"


def test_default_service_name_without_env():
    T.setup_tracing(TracingConfig(exporter="memory"))
    with tracing.span("s"):
        pass
    (s,) = T._memory_exporter.get_finished_spans()
    assert s.resource.attributes["service.name"] == "specdec"


def test_otlp_exporter_is_the_http_protobuf_one():
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    processor = T.make_span_processor(TracingConfig(exporter="otlp",
                                                    otlp_endpoint="http://127.0.0.1:9/v1/traces"))
    try:
        assert isinstance(processor, BatchSpanProcessor)
        assert isinstance(processor._batch_processor._exporter, OTLPSpanExporter)
    finally:
        processor.shutdown()


def test_ray_serve_exporter_hook_passes_serves_checks(monkeypatch):
    from opentelemetry.sdk.trace import SpanProcessor
    from ray.serve._private.tracing_utils import _load_span_processors

    path = "serve_app.telemetry:ray_serve_tracing_exporter"
    monkeypatch.setenv("SPECDEC_TRACING_EXPORTER", "memory")
    processors = _load_span_processors(path, "unused_file_name")  # exactly what Serve does
    assert len(processors) == 1 and isinstance(processors[0], SpanProcessor)
    monkeypatch.setenv("SPECDEC_TRACING_EXPORTER", "none")
    assert _load_span_processors(path, "unused_file_name") == []


def test_setup_adopts_ray_serve_provider_without_duplicate_export(tmp_path):
    path = tmp_path / "spans.jsonl"
    run_python("""
        from ray.serve._private import tracing_utils as serve_tracing
        from ray.serve.schema import TracingConfig as ServeTracingConfig
        from deployments import tracing
        from serve_app import telemetry as T
        ok = serve_tracing.setup_tracing("Router", "replica-1", tracing_config=ServeTracingConfig(
            enabled=True, exporter_import_path="serve_app.telemetry:ray_serve_tracing_exporter",
            sampling_ratio=1.0))
        assert ok
        provider = T.setup_tracing()  # in the deployment constructor
        from opentelemetry import trace
        assert provider is trace.get_tracer_provider()
        with serve_tracing.TraceContextManager("proxy_request"):
            with tracing.span("router_round"):
                pass
        T._provider.force_flush()
    """, env={"SPECDEC_TRACING_EXPORTER": "jsonl", "SPECDEC_TRACING_PATH": str(path)})
    spans = read_spans(path)
    assert sorted(s["name"] for s in spans) == ["proxy_request", "router_round"]  # once each
    by_name = {s["name"]: s for s in spans}
    assert by_name["router_round"]["parent_id"] == by_name["proxy_request"]["span_id"]
