"""The speculative decoding service on Ray Serve.

`serve run serve_app:app` starts the default application (demo target SmolLM2-135M-Instruct,
the project's default proposer) on 127.0.0.1:8000; `serve run serve_app:build_app key=value ...`
builds any other configuration (see serve_app.args.AppArgs).
"""
from __future__ import annotations

from serve_app.builder import build_app

__all__ = ["build_app", "app"]


def __getattr__(name: str):
    if name == "app":  # built on first access, so importing serve_app stays cheap
        return build_app({})
    raise AttributeError(name)
