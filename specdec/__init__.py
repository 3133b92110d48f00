"""specdec: the speculative decoding engine, pure torch.

Speculative decoding (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative
Sampling"): a cheap draft proposes k tokens, the target verifies all of them in one forward pass,
and a lossless rejection sampler keeps the longest acceptable prefix plus one token of its own, so
the output follows the target's distribution exactly (token for token under greedy decoding).

The layout follows vLLM v1: `engine` (`LLMEngine`, the loop in process) drives `round` (one round,
written once) over a `scheduler`, a proposer from `proposers` (n-gram, draft model, EAGLE draft
over the target's features in `eagle_draft`, hybrid) and the target side in `target_worker`,
with `rejection_sampler` and `sampling` as pure functions; `checks` says whether a target, its
draft and a lookup corpus fit together before any weights load. The Ray Serve deployments
(`deployments`, `serve_app`) drive the same round against deployment handles; the offline tools
(distillation, the benchmark) live in `specdec_tools`, which this package never imports.

The public names below are imported lazily, so that `import specdec.envs` (or any one submodule)
stays light and no submodule import runs into a half-initialised `specdec`.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "LLMEngine": "specdec.engine",
    "EngineConfig": "specdec.engine",
    "SamplingParams": "specdec.sampling",
    "NgramProposer": "specdec.proposers",
    "DraftModelProposer": "specdec.proposers",
    "EagleProposer": "specdec.proposers",
    "HybridProposer": "specdec.proposers",
    "check_models": "specdec.checks",
}

__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    from specdec.checks import check_models
    from specdec.engine import EngineConfig, LLMEngine
    from specdec.proposers import DraftModelProposer, EagleProposer, HybridProposer, NgramProposer
    from specdec.sampling import SamplingParams


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'specdec' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
