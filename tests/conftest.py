"""Shared fixtures: tiny random checkpoints (seconds) and, for slow tests, the demo target."""
from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    from specdec.testing import make_tiny_checkpoint
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_target"), seed=0, layers=2)


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory):
    from specdec.testing import make_tiny_checkpoint
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_draft"), seed=1, layers=1, hidden=32,
                                heads=2, kv_heads=1, intermediate=64)


@pytest.fixture(scope="session")
def tiny_tok(tiny_dir):
    from specdec.loader import load_tokenizer
    return load_tokenizer(tiny_dir)


@pytest.fixture(scope="session")
def demo_dir():
    """The demo target converted to safetensors (cached under SPECDEC_CACHE_DIR)."""
    from specdec.loader import materialize, resolve
    return materialize(resolve("smollm2")).path


@pytest.fixture(scope="session")
def demo_tok(demo_dir):
    from specdec.loader import load_tokenizer
    return load_tokenizer(demo_dir)


@pytest.fixture(scope="session")
def demo_model(demo_dir):
    from specdec.loader import load_model
    return load_model(demo_dir, dtype=torch.float32)
