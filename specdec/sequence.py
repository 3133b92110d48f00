"""A sequence being generated: its tokens, sampling state, stop conditions and streamed text.

Stop conditions are applied token by token when a round's tokens are appended, so a stop that
falls inside an accepted run ends the sequence there: nothing after it is kept or returned.
Stop strings are cut from the text (OpenAI semantics); streamed text holds back a tail that could
still become a stop string, and an incomplete UTF-8 character.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from specdec.adaptive import AdaptiveConfig, AdaptiveK
from specdec.sampling import SamplingParams, new_base_seed

_ids = itertools.count(1)

FINISH_STOP, FINISH_LENGTH, FINISH_ABORT = "stop", "length", "abort"


@dataclass
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    seq_id: int = field(default_factory=lambda: next(_ids))
    max_model_len: int = 1 << 30
    adaptive: AdaptiveK | None = None
    tokens: list[int] = field(default_factory=list)  # prompt + output (confirmed)
    text: str = ""  # decoded output, cut at a stop string
    sent_chars: int = 0  # text already handed out by take_delta()
    finish_reason: str | None = None
    draft_offset: int = 0  # confirmed tokens the proposer holds
    target_offset: int = 0  # confirmed tokens the target holds
    proposed: int = 0
    accepted: int = 0
    rounds: int = 0
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    base_seed: int | None = None  # keys this sequence's uniforms (see sampling.round_uniforms)
    meta: dict = field(default_factory=dict)  # caller's data (e.g. the request's trace context)
    feat_start: int = 0  # position of feats[0]: target features not yet sent to an EAGLE proposer
    feats: list = field(default_factory=list)  # tensors [n, hidden], contiguous from feat_start

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt_ids)
        if self.base_seed is None:
            self.base_seed = new_base_seed(self.params.seed)
        if self.adaptive is None:
            self.adaptive = AdaptiveK(AdaptiveConfig())

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        """Tokens this sequence may still emit."""
        return min(self.params.max_tokens - self.num_output, self.max_model_len - len(self.tokens))

    def append(self, new: list[int], tokenizer) -> int:
        """Append a round's tokens, applying stop conditions. Returns how many were kept."""
        p = self.params
        kept = 0
        for tok in new:
            if self.finished:
                break
            self.tokens.append(tok)
            kept += 1
            if self.first_token_time is None:
                self.first_token_time = time.perf_counter()
            if (tok in self.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids:
                self.finish_reason = FINISH_STOP
            elif p.stop and tokenizer is not None:
                self._check_stop_strings(tokenizer)
            if not self.finished and self.remaining <= 0:
                self.finish_reason = FINISH_LENGTH
        if tokenizer is not None and not (p.stop and self.finish_reason == FINISH_STOP):
            self.text = tokenizer.decode(self.output_ids, skip_special_tokens=True)
        return kept

    def _check_stop_strings(self, tokenizer) -> None:
        text = tokenizer.decode(self.output_ids, skip_special_tokens=True)
        start = max(0, len(self.text) - max(len(s) for s in self.params.stop))
        hits = [i for i in (text.find(s, start) for s in self.params.stop) if i >= 0]
        if hits:
            self.text = text[: min(hits)]
            self.finish_reason = FINISH_STOP
        else:
            self.text = text

    def take_delta(self) -> str:
        """New text safe to stream: all of it once finished, else minus a possible stop prefix."""
        end = len(self.text)
        if not self.finished:
            if self.params.stop:
                end -= max(len(s) for s in self.params.stop) - 1
            while end > self.sent_chars and self.text[end - 1] == "\ufffd":
                end -= 1  # an incomplete UTF-8 character: wait for its next bytes
        if end <= self.sent_chars:
            return ""
        delta = self.text[self.sent_chars:end]
        self.sent_chars = end
        return delta

    # ---- target features for EAGLE-style proposers -----------------------------------------
    MAX_PENDING_FEATURES = 1024  # older pending features are dropped (the proposer restarts there)

    @property
    def num_pending_features(self) -> int:
        return sum(len(f) for f in self.feats)

    def add_features(self, start: int, feats) -> None:
        """Queue the target's features of positions [start, start + n) for the proposer."""
        if not self.feats or start != self.feat_start + self.num_pending_features:
            self.feat_start, self.feats = start, []  # a re-prefill or a gap: start over from here
        self.feats.append(feats)
        extra = self.num_pending_features - self.MAX_PENDING_FEATURES
        if extra > 0:
            self.drop_features(extra)

    def pending_features(self):
        """(first position, [n, hidden]) of the queued features, or None."""
        if not self.feats:
            return None
        if len(self.feats) > 1:
            import torch
            self.feats = [torch.cat(self.feats)]
        return self.feat_start, self.feats[0]

    def drop_features(self, n: int) -> None:
        """Forget the first n queued positions (sent to the proposer, or too old)."""
        if n <= 0 or not self.feats:
            return
        pending = self.pending_features()[1]
        self.feat_start += n
        self.feats = [pending[n:]] if n < len(pending) else []

    def abort(self) -> None:
        if not self.finished:
            self.finish_reason = FINISH_ABORT
