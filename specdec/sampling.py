"""Sampling parameters and the logits -> probabilities transforms shared by draft and target.

Randomness never comes from a global generator: every sequence has a base seed (the request's,
or fresh entropy) and the uniforms of a round are drawn from a generator keyed by (base seed,
sequence length), so a round's draws do not depend on what else shares its batch or on how often
it is retried (a replica lost, no free cache slot). A seeded request's tokens are, moreover, the
ones plain decoding draws with its positions' uniforms whatever was drafted (its drafts are
checked against those draws, `rejection_sampler.coupled_verify`): its output reproduces, with or
without speculation, whatever k, batch or failed draft call it met. Samples are drawn by
inverse CDF from one uniform each, which lets the uniforms travel to other processes. Where a draft
must guess the target's draw (the in-target draft's chains of unseeded sampled rows), a position
is drawn instead by the exponential race (Gumbel-max) with noise keyed by its uniform
(`race_noise`, `race_sample`): the draft races its own q with the same noise.

The uniforms come from a hash (SHAKE-128) of the whole seed, position and k, not from a seeded
torch generator: `torch.Generator.manual_seed` keeps only 32 bits, so seeds 1 and 1 + 2**32
would share a stream. Temperatures below `SAMPLING_EPS` are greedy (as in vLLM): dividing logits
by 1e-38 overflows to NaN probabilities.
"""
from __future__ import annotations

import functools
import hashlib
import math
import os
from dataclasses import dataclass, field

import torch
from torch import Tensor


SAMPLING_EPS = 1e-5  # temperatures below this decode greedily


@dataclass
class SamplingParams:
    """Per-request decoding parameters (OpenAI semantics)."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    num_speculative_tokens: int | None = None  # None = adaptive; 0 = no speculation

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if not 0 <= self.temperature < math.inf:  # (NaN fails too: it sampled as 1, and inf uniformly)
            raise ValueError("temperature must be finite and >= 0")
        if self.temperature < SAMPLING_EPS:
            self.temperature = 0.0  # greedy: a tiny temperature would overflow the logits
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if not 0 <= self.top_k < 2**63:  # (a tensor of int64 holds it; any k >= vocab is all tokens)
            raise ValueError("top_k must be >= 0 and below 2**63")
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 0:
            raise ValueError("num_speculative_tokens must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def apply_top_k_top_p(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Mask logits outside the top-k / nucleus. logits: [N, V]; top_k (0 = off), top_p: [N]."""
    V = logits.shape[-1]
    need_k = bool((top_k > 0).any())
    need_p = bool((top_p < 1).any())
    if not (need_k or need_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [N, V]
    mask = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if need_k:
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, V)).clamp(max=V)
        # every token tied with the k-th survives (as in vLLM and transformers): ties are common
        # in bf16 logits, and which of them a positional cut kept was the sort's choice
        mask |= sorted_logits < sorted_logits.gather(-1, (k - 1)[:, None])
    if need_p:
        probs = sorted_logits.masked_fill(mask, float("-inf")).softmax(-1)
        cum_before = probs.cumsum(-1) - probs  # mass strictly before each token
        # keep the smallest prefix reaching top_p; rows at top_p = 1 keep all (their float32 sum can
        # reach 1 before the tail, which would drop it only because another row needs the sort)
        mask |= (cum_before >= top_p[:, None]) & (top_p[:, None] < 1)
    mask[:, 0] = False  # the most likely token always survives
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def logits_to_probs(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Probabilities after temperature, top-k and top-p. logits: [N, V]; params: [N].

    Rows with temperature 0 (greedy) get temperature 1 here; callers treat them separately.
    """
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    logits = logits.float() / t[:, None]
    return apply_top_k_top_p(logits, top_k, top_p).softmax(-1)


def sample_from_probs(probs: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF sample, one uniform per row. probs: [N, V] (need not sum to 1); u: [N] in [0,1)."""
    cdf = probs.double().cumsum(-1)  # [N, V]
    x = u.double() * cdf[:, -1]
    idx = torch.searchsorted(cdf, x[:, None], right=True).squeeze(-1)
    idx = idx.clamp(max=probs.shape[-1] - 1)
    # never return a zero-probability token because of rounding at the top of the cdf
    bad = probs.gather(-1, idx[:, None]).squeeze(-1) <= 0
    if bool(bad.any()):
        idx = torch.where(bad, probs.argmax(-1), idx)
    return idx


_MIX = (-7046029254386353131, -4658895280553007687, -7723592293110705685)  # SplitMix64's odd constants (signed)


def _shr(x: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


@functools.lru_cache(maxsize=8)
def _token_keys(n: int, device: str) -> Tensor:
    return torch.arange(1, n + 1, dtype=torch.int64, device=device) * _MIX[0]


def _mix(u: Tensor, keys: Tensor) -> Tensor:
    """[N, m] int64: SplitMix64 of (the 53 bits of each uniform of u [N], each token key [m])."""
    x = (u.double() * 2.0 ** 53).long()[:, None] ^ keys[None, :]
    x = (x ^ _shr(x, 30)) * _MIX[1]
    x = (x ^ _shr(x, 27)) * _MIX[2]
    return x ^ _shr(x, 31)


def _unit(x: Tensor) -> Tensor:
    """53-bit floats in [0, 1) from mixed int64 words."""
    return _shr(x, 11).double() * 2.0 ** -53


def _exp(x: Tensor) -> Tensor:
    """Exp(1) variates (float32) from mixed int64 words, never 0: a zero would race a token of
    probability 0 to NaN, which argmax takes for the largest."""
    e = (-torch.log(_unit(x) + 2.0 ** -53)).float()  # log of (0, 1]
    return e.clamp_min_(torch.finfo(torch.float32).tiny)


def race_noise(u: Tensor, n: int) -> Tensor:
    """[N, n] float32 Exp(1) variates for token ids 0..n-1, one independent row per uniform of
    u [N] (float64 in [0, 1), 53 bits): SplitMix64 (Steele et al. 2014) of (the uniform's 53 bits,
    token id), a counter-based stream keyed by every bit (a torch.Generator keeps only 32). A
    position's uniform thus fixes the noise of all its tokens, in whichever process needs it."""
    return _exp(_mix(u, _token_keys(n, str(u.device))))


@dataclass
class RaceNoise:
    """The noise of positions' races drawn over some tokens only (`ids`: a draft's reduced
    vocabulary), the other tokens of the vocabulary merged into one exponential clock.

    In the race argmax_v p_v / E_v, the best of a set C of tokens scores P_C / E with E ~ Exp(1)
    (the first of independent exponential clocks of rates p_v rings at rate P_C = sum p_v), and
    which token of C it is follows p on C, independently of E. So racing `ids` with their own
    noise (the same values `race_noise` gives them) against one clock `rest` for the rest, whose
    token is drawn by `pick`, is an exact draw from p, and a draft whose q is zero outside `ids`
    is coupled with it exactly as by the full race, for a sixth of the noise (8192 of 49,152)."""

    ids: Tensor  # [m] token ids raced with their own noise
    noise: Tensor  # [N, m] Exp(1), as race_noise's at those ids
    rest: Tensor  # [N] Exp(1): the merged clock of the other tokens
    pick: Tensor  # [N] in [0, 1): which of the other tokens, when their clock wins

    def __len__(self) -> int:
        return len(self.noise)

    def __getitem__(self, rows: slice) -> "RaceNoise":
        return RaceNoise(self.ids, self.noise[rows], self.rest[rows], self.pick[rows])

    def to(self, device) -> "RaceNoise":
        return RaceNoise(*(t.to(device) for t in (self.ids, self.noise, self.rest, self.pick)))


def race_noise_over(u: Tensor, n: int, ids: Tensor) -> RaceNoise:
    """`race_noise(u, n)` restricted to token `ids` [m], the other tokens of the vocabulary (0..n-1)
    merged (`RaceNoise`): their clock and pick are keyed by ids n and n + 1, outside the vocabulary."""
    ids = ids.to(device=u.device, dtype=torch.int64)
    keys = _token_keys(n + 2, str(u.device))  # the keys race_noise uses, and two more
    extra = _mix(u, keys[n:])  # [N, 2]
    return RaceNoise(ids, _exp(_mix(u, keys[ids])), _exp(extra[:, 0]), _unit(extra[:, 1]))


def noise_over(noise: Tensor | RaceNoise, ids: Tensor | None) -> Tensor:
    """[N, m] the noise of tokens `ids` (all: None), from full noise or a `RaceNoise` over them."""
    if isinstance(noise, RaceNoise):
        if ids is None or not torch.equal(ids.to(noise.ids.device), noise.ids):
            raise ValueError("race noise drawn over other tokens")
        return noise.noise
    return noise if ids is None else noise[:, ids.to(noise.device)]


def race_sample(probs: Tensor, noise: Tensor | RaceNoise) -> Tensor:
    """The exponential race (the Gumbel-max trick): argmax_v probs_v / E_v with E_v ~ Exp(1) iid is
    an exact sample from probs (which need not sum to 1). probs, noise: [N, V] -> [N]; or noise a
    `RaceNoise` (its tokens raced, the rest merged into one clock: the same distribution).

    Two distributions raced with the same noise pick the same token with probability close to
    sum min(p, q), the most any coupling reaches (Gumbel coupling; e.g. Daliri et al. 2024), so a
    draft that races its q with the noise of the position it drafts for proposes the target's own
    draw far more often than its argmax does (TargetWorker, in-target chains of unseeded sampled rows)."""
    p = probs.float()
    if not isinstance(noise, RaceNoise):
        return (p / noise).argmax(-1)
    best, at = (p[:, noise.ids] / noise.noise).max(-1)  # [N]: the raced tokens' winner
    others = p.clone()
    others[:, noise.ids] = 0.0  # [N, V]: the merged tokens
    outside = others.sum(-1) / noise.rest > best  # their clock rings first (never with no mass)
    out = noise.ids[at]
    if bool(outside.any()):
        out = torch.where(outside, sample_from_probs(others, noise.pick), out)
    return out


def _stream(base_seed: int, position: int, k: int, n: int) -> bytes:
    """n 64-bit words of the SHAKE-128 stream keyed by all bits of (seed, position, k)."""
    nbytes = max(8, (base_seed.bit_length() + 8) // 8 + 1)
    key = base_seed.to_bytes(nbytes, "little", signed=True) + position.to_bytes(8, "little") + k.to_bytes(2, "little")
    return hashlib.shake_128(key).digest(8 * n)


def _to_unit(raw: bytes) -> torch.Tensor:
    """53-bit floats in [0, 1) from 64-bit words."""
    words = torch.frombuffer(bytearray(raw), dtype=torch.int64)
    mantissa = (words >> 11) & ((1 << 53) - 1)  # top 53 bits of each word (>> is arithmetic: mask)
    return mantissa.double() * 2.0 ** -53


def round_uniforms(base_seed: int, position: int, k: int) -> torch.Tensor:
    """Uniforms [3, k+1] in [0, 1) for the round that starts at `position` of a sequence seeded
    `base_seed`: 53-bit floats from a SHAKE-128 stream keyed by all bits of (seed, position, k)."""
    return _to_unit(_stream(base_seed, position, k, 3 * (k + 1))).view(3, k + 1)


def position_uniforms(base_seed: int, start: int, n: int) -> torch.Tensor:
    """Uniforms [3, n]: column j holds the draws of one plain token at position start + j, i.e.
    `round_uniforms(base_seed, start + j, 0)[:, 0]` (multi-step plain rounds)."""
    return _to_unit(b"".join(_stream(base_seed, start + j, 0, 3) for j in range(n))).view(n, 3).T


def new_base_seed(seed: int | None) -> int:
    """The request's seed (all of its bits), or fresh entropy when it gave none."""
    if seed is not None:
        return int(seed)
    return int.from_bytes(os.urandom(8), "little")
