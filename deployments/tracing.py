"""The one span API of the service, on the OpenTelemetry *API* only.

Every span in the code base is opened here: `span()` (a context manager) or `start_span()` (a
span that outlives one block, e.g. a streamed HTTP request). Context crosses actor and HTTP
boundaries as a W3C carrier dict (`inject()` on one side, the `carrier` argument on the other).

Where spans go is set up elsewhere: Serve replicas get a tracer provider from Ray Serve's
built-in tracing or from serve_app.telemetry.setup_tracing, which hands its tracer to this module
(`use_tracer`). Each replica and TP worker calls it through `ensure_provider`, from the import path
in SPECDEC_TRACING_SETUP (the indirection Ray uses for RAY_SERVE_TRACING_EXPORTER_IMPORT_PATH) and
the app's tracing variables, which come in each deployment's config. With no provider installed
every call is the API's no-op.
"""
from __future__ import annotations

import importlib
import os
from contextlib import contextmanager
from typing import Any, Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.propagate import extract as _extract
from opentelemetry.propagate import inject as _inject

SCOPE = "specdec"
_tracer: Any = trace.get_tracer(SCOPE)  # follows the global provider until use_tracer() says otherwise
_setup_done = False
_flush: Any = None  # the provider's force_flush(timeout_millis), when setup_tracing installed one


def use_tracer(tracer: Any | None, flush: Any = None) -> None:
    """Open spans with `tracer` (serve_app.telemetry's); None: the global provider's. `flush`:
    exports what its provider still buffers (see `flush`)."""
    global _tracer, _flush
    _tracer = tracer if tracer is not None else trace.get_tracer(SCOPE)
    _flush = flush


def flush(timeout_s: float = 5.0) -> None:
    """Export the spans a batch processor still holds: call it when a replica or worker stops
    (Serve stops a replica with ray.kill, which skips atexit handlers)."""
    if _flush is not None:
        _flush(int(timeout_s * 1000))


def ensure_provider(env: Mapping[str, str] | None = None) -> None:
    """Install this process's tracer provider once, if SPECDEC_TRACING_SETUP names a setup function.

    `env`: the app's tracing variables (AppArgs.tracing_env), set in this process first. They come
    in each deployment's config, not in its runtime_env: a Serve config's `ray_actor_options`
    replace the whole runtime_env, and with it a replica's tracing."""
    global _setup_done
    os.environ.update(env or {})
    if _setup_done:
        return
    _setup_done = True
    path = os.environ.get("SPECDEC_TRACING_SETUP")
    if path:
        module, _, fn = path.partition(":")
        getattr(importlib.import_module(module), fn)()


def inject(context: Context | None = None) -> dict:
    """W3C carrier ({"traceparent": ...}) of the current (or given) context; {} without a span."""
    carrier: dict = {}
    _inject(carrier, context=context)
    return carrier


def extract(carrier: Mapping[str, str] | None) -> Context | None:
    """The Context a carrier (or HTTP headers) describes; None for an empty one."""
    return _extract(carrier) if carrier else None


class _Span:
    """The OTel span, plus `set(**attrs)`."""

    def __init__(self, span):
        self.span = span

    def set(self, **attrs) -> None:
        self.span.set_attributes(attrs)

    def __getattr__(self, name):
        return getattr(self.span, name)


def mark_error(sp, error: BaseException) -> None:
    """Record `error` on span `sp` and set its status to ERROR (a failed request, a failed round)."""
    sp.record_exception(error)
    sp.set_status(trace.Status(trace.StatusCode.ERROR, str(error)))


def _span_context(ctx: Context | None):
    return trace.get_current_span(ctx).get_span_context() if ctx is not None else trace.INVALID_SPAN_CONTEXT


def start_span(name: str, carrier: Mapping[str, str] | None = None, server: Context | None = None,
               **attrs) -> tuple[Any, Context]:
    """A span the caller ends, child of the `server`'s request span (Ray Serve's, with Serve's
    tracing on) when it holds one in the trace of `carrier` (an incoming `traceparent`) or there is
    none; else of the carrier's context, but of the current span when that is in the carrier's
    trace (an ingress span under the client's: nested, not its sibling); else of the current span,
    else a root. Returns it and the Context that holds it (give it to work done for this span: it
    is what `inject(ctx)` sends on)."""
    ensure_provider()
    current = otel_context.get_current()
    client = _span_context(_extract(carrier or {}, context=Context()))
    trace_id = client.trace_id if client.is_valid else None
    if _span_context(server).is_valid and trace_id in (None, _span_context(server).trace_id):
        parent = server
    elif trace_id is None or _span_context(current).trace_id == trace_id:
        parent = current
    else:
        parent = _extract(carrier, context=current)
    sp = _tracer.start_span(name, context=parent, attributes=attrs or None)
    return sp, trace.set_span_in_context(sp, parent)


def sampled_first(contexts: list[Context | None]) -> tuple[Context | None, list[Context | None]]:
    """The parent and the links of a span that serves several requests (a batched round): the first
    context whose span is sampled, so that a sampled request keeps its rounds (the child of an
    unsampled parent is dropped with it), and the others as links."""
    for i, c in enumerate(contexts):
        if c is not None and trace.get_current_span(c).get_span_context().trace_flags.sampled:
            return c, contexts[:i] + contexts[i + 1:]
    return (contexts[0], contexts[1:]) if contexts else (None, [])


@contextmanager
def span(name: str, carrier: Mapping[str, str] | None = None, parent: Context | None = None, links=(), **attrs):
    """A current span named `name`, child of `carrier`'s (or the `parent` Context's) context when
    given, else of the current one; `links` are other contexts it also serves (a batched round)."""
    ensure_provider()
    ctx = extract(carrier) if carrier else parent
    token = otel_context.attach(ctx) if ctx is not None else None
    span_links = [trace.Link(trace.get_current_span(c).get_span_context()) for c in links if c is not None]
    try:
        with _tracer.start_as_current_span(name, links=span_links, attributes=attrs or None) as sp:
            yield _Span(sp)
    finally:
        if token is not None:
            otel_context.detach(token)
