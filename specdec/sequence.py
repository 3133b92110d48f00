"""A sequence being generated: its tokens, sampling state, stop conditions and streamed text.

Stop conditions are applied token by token when a round's tokens are appended, so a stop that
falls inside an accepted run ends the sequence there: nothing after it is kept or returned.
Text is decoded incrementally (specdec.detokenizer: a few tokens per token, not the whole output)
and is append-only, so what `take_delta()` streams always adds up to `text`. Stop strings are cut
from the text (OpenAI semantics) and are searched for only in text not searched yet (plus the
stop length - 1 characters before it); streamed text holds back a tail that could still become a
stop string, and the detokenizer holds back an incomplete UTF-8 character. Stop and EOS token ids
end the sequence without adding text.
"""
from __future__ import annotations

import itertools
import secrets
import time
from dataclasses import dataclass, field

from specdec.adaptive import AdaptiveConfig, AdaptiveK
from specdec.detokenizer import IncrementalDetokenizer
from specdec.sampling import SamplingParams, new_base_seed

# Sequence ids key KV-cache slots on Target and Draft replicas that several processes (Router
# replicas) share, so they must not repeat across processes: each process counts up from a random
# 62-bit start (two processes' ranges of 2**32 ids overlap with probability ~2**-29).
_ids = itertools.count(secrets.randbits(62) + 1)

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
    sent_chars: int = 0  # text already handed out by take_delta()
    finish_reason: str | None = None
    draft_offset: int = 0  # confirmed tokens the proposer holds
    target_offset: int = 0  # confirmed tokens the target holds
    proposed: int = 0
    accepted: int = 0
    rounds: int = 0
    lookup_hits: float = 0.0  # decayed: lookup tokens accepted in multi-step plain rounds (LookupGate)
    lookup_forwards: float = 0.0  # decayed: forwards that carried this row's lookups
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    base_seed: int | None = None  # keys this sequence's uniforms (see sampling.round_uniforms)
    meta: dict = field(default_factory=dict)  # caller's data (e.g. the request's trace context)
    feat_start: int = 0  # position of feats[0]: target features not yet sent to an EAGLE proposer
    feats: list = field(default_factory=list)  # tensors [n, hidden], contiguous from feat_start
    detok: IncrementalDetokenizer | None = field(default=None, init=False, repr=False)  # set by append
    stop_ids: frozenset[int] = field(default=frozenset(), init=False, repr=False)  # params.stop_token_ids
    stop_hold: int = field(default=0, init=False, repr=False)  # longest stop string - 1 (chars)
    stop_scan_from: int = field(default=0, init=False, repr=False)  # text before it: searched for stops

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt_ids)
        if self.base_seed is None:
            self.base_seed = new_base_seed(self.params.seed)
        if self.adaptive is None:
            self.adaptive = AdaptiveK(AdaptiveConfig())
        self.stop_ids = frozenset(self.params.stop_token_ids)
        self.stop_hold = max(map(len, self.params.stop), default=1) - 1

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

    def stop_token_set(self) -> list[int]:
        """Token ids that end this sequence (EOS unless ignore_eos, and its stop_token_ids)."""
        eos = set() if self.params.ignore_eos else set(self.eos_token_ids)
        return sorted(eos | self.stop_ids)

    @property
    def remaining(self) -> int:
        """Tokens this sequence may still emit."""
        return min(self.params.max_tokens - self.num_output, self.max_model_len - len(self.tokens))

    @property
    def text(self) -> str:
        """Decoded output, cut at a stop string: what is final so far, all of it once finished."""
        return self.detok.text if self.detok is not None else ""

    def append(self, new: list[int], tokenizer) -> int:
        """Append a round's tokens, applying stop conditions. Returns how many were kept."""
        kept = 0
        for tok in new:
            if self.finished:
                break
            self.tokens.append(tok)
            kept += 1
            if self.first_token_time is None:
                self.first_token_time = time.perf_counter()
            if (tok in self.eos_token_ids and not self.params.ignore_eos) or tok in self.stop_ids:
                self._finish(FINISH_STOP)
                continue
            if tokenizer is not None:
                self._detokenize(tok, tokenizer)
            if not self.finished and self.remaining <= 0:
                self._finish(FINISH_LENGTH)
        return kept

    def _detokenize(self, tok: int, tokenizer) -> None:
        if self.detok is None:
            self.detok = IncrementalDetokenizer(tokenizer, context=self.prompt_ids)
        if self.detok.push(tok) and self.params.stop:
            self._stop_at_string()

    def _finish(self, reason: str) -> None:
        """End by a token (EOS, stop id, length): the held-back text is final, and may hold a stop."""
        self.finish_reason = reason
        if self.detok is not None:
            self.detok.flush()
            if self.params.stop:
                self._stop_at_string()

    def _stop_at_string(self) -> None:
        """Finish at the first stop string in the text not searched yet, cutting it off."""
        start = self.stop_scan_from
        window = self.detok.read(start) + self.detok.pending
        hits = [i for i in (window.find(s) for s in self.params.stop) if i >= 0]
        self.stop_scan_from = max(start, len(self.detok) - self.stop_hold)
        if hits:
            self.finish_reason = FINISH_STOP
            self.detok.flush()
            self.detok.truncate(start + min(hits))

    def take_delta(self) -> str:
        """New text safe to stream: all of it once finished, else minus a possible stop prefix."""
        if self.detok is None:
            return ""
        end = len(self.detok) - (0 if self.finished else self.stop_hold)
        if end <= self.sent_chars:
            return ""
        delta = self.detok.read(self.sent_chars, end)
        self.sent_chars = end
        return delta

    # ---- target features for EAGLE-style proposers -----------------------------------------
    MAX_PENDING_FEATURES = 1024  # older pending features are dropped (the proposer restarts there)

    @property
    def num_pending_features(self) -> int:
        return sum(len(f) for f in self.feats)

    def add_features(self, start: int, feats) -> None:
        """Queue the target's features of positions [start, start + n) for the proposer; positions
        fed again (after a taken sibling the target re-feeds its position) replace the queued ones."""
        end = self.feat_start + self.num_pending_features
        if self.feats and self.feat_start < start < end:
            self.feats = [self.pending_features()[1][: start - self.feat_start]]
        elif not self.feats or start != end:
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
