"""Proposers and a registry-driven factory: `build_proposer(kind, ...)`.

kinds: "ngram" (prompt lookup), "draft" (a separate draft checkpoint), "eagle" (an EAGLE-style
draft over the target's features, specdec.eagle_draft), "self" (the target's first layers as a
zero-training draft), "hybrid" (n-gram matches first, a draft or EAGLE checkpoint otherwise),
"none" (no speculation).
"""
from __future__ import annotations

from typing import Callable

import torch

from specdec.proposers.base import TOP_J, Proposer
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.eagle import EagleProposer
from specdec.proposers.hybrid import HybridProposer
from specdec.proposers.ngram import NgramProposer

BUILDERS: dict[str, Callable[..., Proposer | None]] = {}


def builder(name: str):
    def deco(fn):
        BUILDERS[name] = fn
        return fn
    return deco


@builder("none")
def _none(**_) -> None:
    return None


@builder("ngram")
def _ngram(ngram_min: int = 1, ngram_max: int = 3, **_) -> Proposer:
    return NgramProposer(min_n=ngram_min, max_n=ngram_max)


def _token_map(model, extra: dict) -> torch.Tensor | None:
    ids = extra.get("draft_vocab")
    return torch.tensor(ids, dtype=torch.long) if ids else None


@builder("draft")
def _draft(draft: str, dtype=torch.float32, device: str = "cpu", num_slots: int = 8,
           max_model_len: int = 2048, top_j: int = TOP_J, **_) -> Proposer:
    from specdec.eagle_draft import is_eagle
    from specdec.loader import load_model
    if is_eagle(draft):  # an EAGLE checkpoint needs the target's features and weights
        return _eagle(draft=draft, dtype=dtype, device=device, num_slots=num_slots, max_model_len=max_model_len,
                      top_j=top_j, **_)
    model = load_model(draft, dtype=dtype, device=device)
    return DraftModelProposer(model, num_slots, max_model_len, _token_map(model, getattr(model, "extra", {})),
                              top_j=top_j)


@builder("eagle")
def _eagle(draft: str, target: str, dtype=torch.float32, device: str = "cpu", num_slots: int = 8,
           max_model_len: int = 2048, top_j: int = TOP_J, target_model=None, **_) -> Proposer:
    from specdec.eagle_draft import load_eagle
    from specdec.loader import load_model
    if target_model is not None:  # in process: share the running target's embedding and head
        model = load_eagle(draft, target_model, dtype)
    else:  # a draft replica: load the target on the host, keep its embedding and head rows only
        model = load_eagle(draft, load_model(target, dtype=dtype, device="cpu"), dtype).to(device)
    return EagleProposer(model, num_slots, max_model_len, top_j=top_j)


@builder("hybrid")
def _hybrid(draft: str, hybrid_ngram_min: int = 3, ngram_max: int = 5, **kw) -> Proposer:
    """n-gram matches of at least `hybrid_ngram_min` tokens, else the draft in `draft` (EAGLE or not)."""
    from specdec.eagle_draft import is_eagle
    model = (_eagle if is_eagle(draft) else _draft)(draft=draft, **kw)
    return HybridProposer(NgramProposer(min_n=hybrid_ngram_min, max_n=max(ngram_max, hybrid_ngram_min)), model)


@builder("self")
def _self(target: str, self_draft_layers: int = 4, dtype=torch.float32, device: str = "cpu",
          num_slots: int = 8, max_model_len: int = 2048, top_j: int = TOP_J, target_model=None, **_) -> Proposer:
    from specdec.loader import load_model
    model = target_model if target_model is not None else load_model(target, dtype=dtype, device=device)
    return DraftModelProposer(model.first_layers(self_draft_layers), num_slots, max_model_len, top_j=top_j)


def build_proposer(kind: str, **kwargs) -> Proposer | None:
    if kind not in BUILDERS:
        raise ValueError(f"unknown proposer {kind!r}; choose one of {sorted(BUILDERS)}")
    return BUILDERS[kind](**kwargs)


__all__ = ["Proposer", "NgramProposer", "DraftModelProposer", "EagleProposer", "HybridProposer",
           "build_proposer"]
