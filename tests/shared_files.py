"""Tests that need an offline resource outside the repository (the KubeRay CRDs and OpenAI's
OpenAPI document in ../shared, the demo model, ...): skip on a developer's machine that lacks
it, fail in CI, where a missing resource means the checks silently did not run."""
from __future__ import annotations

import os

import pytest


def in_ci() -> bool:
    """`CI` is set to a true value (GitHub Actions, GitLab and .ci/run set CI=true)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no", "off")


def missing_resource(message: str):
    """Skip the calling test because `message` names a resource that is absent; in CI, fail it."""
    if in_ci():
        pytest.fail(f"{message} (required in CI: CI={os.environ.get('CI')!r})", pytrace=False)
    pytest.skip(message)
