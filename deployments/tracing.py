"""Spans for the deployments through the OpenTelemetry *API* only.

Serve replicas get their tracer provider from Ray Serve's built-in tracing (configured by the
application: see serve_app/telemetry.py). Plain actors such as the TP workers are not Serve
replicas, so they install one themselves from the import path in SPECDEC_TRACING_SETUP (the same
indirection Ray uses for RAY_SERVE_TRACING_EXPORTER_IMPORT_PATH). Context crosses actor calls as a
W3C carrier dict (`inject()` on one side, the `carrier` argument of `span()` on the other). With
no provider installed every call here is the API's no-op.
"""
from __future__ import annotations

import importlib
import os
from contextlib import contextmanager

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagate import extract
from opentelemetry.propagate import inject as _inject

_setup_done = False


def ensure_provider() -> None:
    """Install this process's tracer provider once, if SPECDEC_TRACING_SETUP names a setup function."""
    global _setup_done
    if _setup_done:
        return
    _setup_done = True
    path = os.environ.get("SPECDEC_TRACING_SETUP")
    if path:
        module, _, fn = path.partition(":")
        getattr(importlib.import_module(module), fn)()


def inject() -> dict:
    carrier: dict = {}
    _inject(carrier)
    return carrier


class _Span:
    def __init__(self, span):
        self.span = span

    def set(self, **attrs) -> None:
        for k, v in attrs.items():
            self.span.set_attribute(k, v)


@contextmanager
def span(name: str, carrier: dict | None = None, parent=None, links=(), **attrs):
    """A span named `name`, child of `carrier`'s (or the `parent` Context's) context when given,
    else of the current one; `links` are other contexts it also serves (a batched round)."""
    ensure_provider()
    ctx = extract(carrier) if carrier else parent
    token = otel_context.attach(ctx) if ctx is not None else None
    span_links = [trace.Link(trace.get_current_span(c).get_span_context()) for c in links if c is not None]
    try:
        with trace.get_tracer("specdec").start_as_current_span(name, links=span_links) as sp:
            wrapped = _Span(sp)
            wrapped.set(**attrs)
            yield wrapped
    finally:
        if token is not None:
            otel_context.detach(token)
