"""A compact Llama-family decoder that runs ragged batches over a preallocated KV cache.

The idea (after gpt-fast's model.py): the KV cache is one preallocated tensor per layer, indexed
by *slot* (one slot per live sequence) and *position*. A forward call brings, for every row of
the batch, a slot, the position of its first new token and up to T new tokens; keys and values
are written at those positions, and rollback of rejected speculative tokens is nothing more than
the caller forgetting positions (the next write overwrites them).

Weights, config and tokenizer come from transformers (`from_hf`): Llama, Mistral (full
attention), Qwen2 (qkv bias), Qwen3 (q/k norm) and SmolLM share this layout. The transformers
model is the reference the logits are tested against (tests/test_model.py).

The model is rank-free: tensor parallelism is applied afterwards by `specdec.tp.apply_tp`, which
shards the linear layers and adds an all-reduce after the row-parallel ones.

Position invariance. Speculative greedy output equals plain greedy output only if a position's
logits do not depend on how many positions share the forward (one in a plain step, k+1 in a
verification). In float32 on CPU they do by ~1e-6, which flipped a tie of that size; in bfloat16
by up to ~0.7 logits, which flips near-ties often: SDPA's CPU kernel rounds a query row differently with one and with several queries,
and matmul kernels pick their blocking by the row count (measured: bench/bf16_invariance.py).
`Transformer.position_invariant` (default: on for bfloat16/float16, and for float32 on CPU) removes both: attention as
float32 matmuls with a float32 softmax, the query heads of a key/value head stacked into one matrix padded
to a multiple of `ATTN_ROWS` rows (never fewer than 4), the weighted sum over keys taken in chunks of a constant
`ATTN_KEYS` keys added in order (a matmul's own reduction over a longer key axis adds in another order
when masked keys follow a query's last one), and a lone one-token step (batch 1, T = 1) padded to
two positions (the dummy's key/value land one position ahead, are never attended, and are
overwritten by the next token). With it a position's logits are bit-identical for 1 to 8 positions
per forward and for several batch sizes (tests/test_model.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdec import envs


@dataclass
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None  # attention span of (some) layers; not implemented: max_model_len <= it

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV-cache bytes one position of one sequence takes: keys and values of every layer."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_hf_config(cls, cfg) -> "ModelArgs":
        """The runner's arguments for a Hugging Face config; ValueError for an architecture or a
        feature this runner does not implement (it would load and compute something else)."""
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        _check_supported(text)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        rope = getattr(text, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(text, "rope_theta", 10000.0))
        return cls(
            vocab_size=text.vocab_size,
            hidden_size=text.hidden_size,
            intermediate_size=text.intermediate_size,
            num_layers=text.num_hidden_layers,
            num_heads=text.num_attention_heads,
            num_kv_heads=getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=text.rms_norm_eps,
            rope_theta=float(theta),
            max_position_embeddings=_exact_positions(text, rope),
            attention_bias=text.model_type == "qwen2",
            qk_norm=text.model_type in ("qwen3",),
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            sliding_window=_sliding_window(text),
        )


# Decoders this runner computes exactly as transformers does (tests/test_model.py compares them):
# Llama's layout, with q/k/v biases (Qwen2) or q/k norms (Qwen3). Others with the same weight
# names compute something else (Gemma's (1 + w) norms and embedding scale, Granite's multipliers).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def _check_supported(text) -> None:
    kind = getattr(text, "model_type", None)
    if kind not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {kind!r} is not supported: this engine runs Llama-style decoders "
                         f"({', '.join(SUPPORTED_MODEL_TYPES)})")
    unsupported = {
        f"hidden_act={getattr(text, 'hidden_act', 'silu')!r}": getattr(text, "hidden_act", "silu") not in ("silu", "swish"),
        "mlp_bias": bool(getattr(text, "mlp_bias", False)),
        "attention_bias (o_proj bias)": kind != "qwen2" and bool(getattr(text, "attention_bias", False)),
    }
    found = [name for name, present in unsupported.items() if present]
    if found:
        raise ValueError(f"this {kind} checkpoint uses {', '.join(found)}, which this engine does not implement")


def _exact_positions(text, rope: dict) -> int:
    """Positions this runner computes exactly: its rotary frequencies are fixed when it loads,
    and LongRoPE's switch to its long factors past the original length (transformers' dynamic
    update) does not happen here, so such a model is capped at its original length."""
    limit = getattr(text, "max_position_embeddings", 4096)
    if rope.get("rope_type") == "longrope":
        # a top-level value wins, as transformers' loaded model reads it (AutoConfig alone puts
        # max_position_embeddings in rope_parameters for the legacy `rope_scaling` spelling)
        original = getattr(text, "original_max_position_embeddings", None) or rope.get("original_max_position_embeddings")
        limit = min(limit, original or limit)
    return limit


def _sliding_window(text) -> int | None:
    """The window of sliding-window attention layers, if the config has any."""
    window = getattr(text, "sliding_window", None)
    if not window:
        return None
    kinds = getattr(text, "layer_types", None)
    if kinds is not None:
        return int(window) if "sliding_attention" in kinds else None
    if text.model_type in ("qwen2", "qwen3"):
        return int(window) if getattr(text, "use_sliding_window", False) else None
    return int(window)


def free_memory(device: torch.device) -> int | None:
    """Bytes that can still be allocated on `device` (CPU: MemAvailable, within a cgroup v2
    memory limit), or None when unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            free = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None
    try:
        with open("/sys/fs/cgroup/memory.max") as f, open("/sys/fs/cgroup/memory.current") as g:
            limit = f.read().strip()
            if limit != "max":
                free = min(free, int(limit) - int(g.read()))
    except (OSError, ValueError):
        pass
    return free


class KVCache(nn.Module):
    """Preallocated keys/values: [slots, kv_heads, max_len, head_dim] per layer, head-major, so
    that the keys a batch reads, [B, kv_heads, L, head_dim], are a view attention's matmuls take
    as they are (a position-major cache made every layer copy them through a transpose first).

    `max_len` includes a margin for padded rows of ragged batches (their padding positions
    write garbage past the row's end, which is never attended and later overwritten).
    """

    def __init__(self, num_slots: int, max_len: int, num_kv_heads: int, head_dim: int, dtype, device=None):
        super().__init__()
        shape = (num_slots, num_kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, rows: "BatchIndex", k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v [B, T, kv_heads, head_dim] at each row's (slot, positions); return the rows'
        keys and values [B, kv_heads, kv_len, head_dim]."""
        self.k.transpose(1, 2).index_put_((rows.slot_grid, rows.pos_grid), k)  # (the transpose: a view)
        self.v.transpose(1, 2).index_put_((rows.slot_grid, rows.pos_grid), v)
        if rows.slot_range is not None:
            lo, hi = rows.slot_range
            return self.k[lo:hi, :, : rows.kv_len], self.v[lo:hi, :, : rows.kv_len]
        return self.k[rows.slots, :, : rows.kv_len], self.v[rows.slots, :, : rows.kv_len]


@dataclass
class BatchIndex:
    """Where a ragged batch lives in the cache; computed once per forward, shared by all layers."""

    slots: Tensor  # [B] cache slot of each row
    slot_range: tuple[int, int] | None  # (lo, hi) when slots are contiguous: read by slicing
    slot_grid: Tensor  # [B, T]
    pos_grid: Tensor  # [B, T] absolute position of each input token
    kv_len: int  # keys read per row: max over rows of start + T
    mask: Tensor  # [B, 1, T, kv_len] True where a query may attend
    exact: bool = False  # position-invariant attention (see the module docstring)
    rope_grid: Tensor | None = None  # [B, T] rotary positions where they differ from pos_grid (siblings)

    @classmethod
    def build(cls, slots: Tensor, starts: Tensor, T: int, exact: bool = False,
              sibling: Tensor | None = None, align: int = 1) -> "BatchIndex":
        """sibling [B, 2]: (index s within the row's T tokens, chain length k) of a row's sibling of
        its first draft, or s = -1. The sibling is written to the cache after the chain (index s)
        but sits at the first draft's position (starts + s - k) and does not see the chain's k keys.
        align: keys read per row rounded up to a multiple of this (masked; the cache's margin holds them)."""
        device = slots.device
        offs = torch.arange(T, device=device)
        pos_grid = starts[:, None] + offs[None, :]  # [B, T]
        kv_len = -(-(int(starts.max().item()) + T) // align) * align
        if align > 1:  # at least two chunks (the extra one all masked adds zeros): one chunk is a graph of its own when compiled
            kv_len = max(kv_len, 2 * align)
        keys = torch.arange(kv_len, device=device)
        mask = keys[None, None, :] <= pos_grid[:, :, None]  # [B, T, kv_len]
        rope_grid = None
        if sibling is not None and bool((sibling[:, 0] >= 0).any()):
            b = (sibling[:, 0] >= 0).nonzero().squeeze(1)
            s_idx, first = sibling[b, 0], starts[b] + sibling[b, 0] - sibling[b, 1]  # [nb]
            rope_grid = pos_grid.clone()
            rope_grid[b, s_idx] = first
            chain = (keys[None, :] >= first[:, None]) & (keys[None, :] < (starts[b] + s_idx)[:, None])
            mask[b, s_idx] &= ~chain
        s = slots.tolist()
        contiguous = s == list(range(s[0], s[0] + len(s)))
        return cls(
            slots=slots,
            slot_range=(s[0], s[0] + len(s)) if contiguous else None,
            slot_grid=slots[:, None].expand(-1, T),
            pos_grid=pos_grid,
            kv_len=kv_len,
            mask=mask[:, None],
            exact=exact,
            rope_grid=rope_grid,
        )


PACK_ROWS = 2  # the row count oneDNN's weight layout is chosen for (rows of a step at batch 1: see `lone`)
# Rows per reduced-precision CPU matmul call. On a Xeon with AMX, oneDNN's bf16
# kernels give a row the same result for every call of 1 to 32 rows, and another from 33 rows up (every
# linear shape of the demo target and its draft, 1 and 2 threads: bench/linear_rows.py), so a
# verification of 8 rows x 5 positions differed in the last bits from the plain steps of the same rows
# and speculative greedy output left plain decoding's (29 of 32 answers at k = 4, batch 8; the EPYC these
# limits were first measured on has no such step). Calls of more rows run in chunks of this many: +23% for
# 8 rows x 5 positions, +30% for a 64-token prefill. Prefills too: a row's first call holds its prompt plus
# its drafts in speculative decoding and the prompt alone in plain decoding, and calls of 33 rows or more
# do not even agree with each other (a version that left a lone row's calls whole diverged in 3 of 32).
LINEAR_ROWS = 32
_REDUCED = (torch.bfloat16, torch.float16)


def _can_pack() -> dict[torch.dtype, bool]:
    """Weight dtypes this build of torch can prepack for oneDNN's CPU matmul."""
    if not (envs.PACK_WEIGHTS and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return {}
    return {torch.float32: True, torch.bfloat16: bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())}


_PACKABLE = _can_pack()


class PackedWeight:
    """oneDNN's prepacked (blocked) copy of a CPU linear layer's weight, and the matmul that reads it.

    At a few rows per forward (decoding, verification) a CPU forward is a stream of the weights
    through matrix-vector products; F.linear reads a plain row-major weight at ~16 GB/s on this
    2-core CPU (bf16, a weight larger than the cache; float32: 5 GB/s) where the memory delivers
    ~60. The same weight reordered once into oneDNN's blocked layout (what inductor's CPU freezing
    pass does, `mkldnn._linear_pointwise`) streams at ~29 GB/s: a bf16 forward of the demo target at
    batch 1 takes ~28 ms instead of ~37-41, and 5 positions cost no more than 1
    (bench/packed_weights.py). The copy is made on first use and again whenever the weight changes
    (another storage, e.g. tensor-parallel sharding, or an in-place load: its version counter), so
    it never goes stale; it costs a second copy of the linear weights in memory
    (SPECDEC_PACK_WEIGHTS=0: plain F.linear, no copy). Only CPU inference takes it: autograd, other
    devices and dtypes run F.linear. A row's result does not depend on how many rows share the
    call (1-8, tests/test_model.py), which bf16 speculation's identity with plain decoding needs.
    """

    __slots__ = ("key", "weight")

    def __init__(self):
        self.key: tuple | None = None
        self.weight: Tensor | None = None

    def linear(self, x: Tensor, w: Tensor, b: Tensor | None, parts: tuple[Tensor, ...] = ()) -> Tensor:
        """F.linear(x, w, b); `parts`: tensors that `w` is made of whose in-place changes it does
        not see in its own version counter (FusedLinear's layers, whose weights are views set via .data).
        Reduced-precision CPU inference over more than LINEAR_ROWS rows runs in chunks of that many."""
        rows = x.numel() // max(1, x.shape[-1])
        if (rows > LINEAR_ROWS and x.dtype in _REDUCED and x.device.type == "cpu"
                and not (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad))):
            chunks = x.reshape(rows, x.shape[-1]).split(LINEAR_ROWS)
            return torch.cat([self._linear(c, w, b, parts) for c in chunks]).view(*x.shape[:-1], -1)
        return self._linear(x, w, b, parts)

    def _linear(self, x: Tensor, w: Tensor, b: Tensor | None, parts: tuple[Tensor, ...]) -> Tensor:
        if (not _PACKABLE.get(w.dtype) or x.dtype != w.dtype or x.device.type != "cpu"
                or (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad))):
            return F.linear(x, w, b)
        key = (w.data_ptr(), w.shape, w.dtype, *(None if t.is_inference() else t._version for t in (w, *parts)))
        if key != self.key:
            self.weight, self.key = torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), PACK_ROWS), key
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, b, "none", [], "")


_COMPILED_PACKS: dict[tuple, PackedWeight] = {}  # a compiled stack's weights -> their packed copies


@torch.library.custom_op("specdec::linear", mutates_args=())
def compiled_linear(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """`PackedWeight.linear` as one opaque op for a compiled layer stack (`Transformer.compile_layers`):
    inductor calls it as it is, so a compiled forward multiplies with the same kernels, prepacked
    weights and LINEAR_ROWS chunks as an eager one, whatever its (dynamic) row count."""
    key = (w.data_ptr(), tuple(w.shape), w.dtype)  # (a freed weight's address may come back with another dtype)
    pack = _COMPILED_PACKS.get(key)
    if pack is None:
        pack = _COMPILED_PACKS[key] = PackedWeight()
    return pack.linear(x, w, b)


@compiled_linear.register_fake
def _(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    return x.new_empty(*x.shape[:-1], w.shape[0])


def _linear_call(packed: PackedWeight, x: Tensor, w: Tensor, b: Tensor | None, parts: tuple[Tensor, ...] = ()) -> Tensor:
    if torch.compiler.is_compiling():
        return compiled_linear(x, w, b)
    return packed.linear(x, w, b, parts)


class Linear(nn.Linear):
    """nn.Linear (same parameters and state dict) whose CPU inference matmul reads a `PackedWeight`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.packed = PackedWeight()

    def forward(self, x: Tensor) -> Tensor:
        return _linear_call(self.packed, x, self.weight, self.bias)


class FusedLinear(nn.Module):
    """Linear layers that read the same input, run as one matmul at inference (gpt-fast's wqkv,
    vLLM's QKVParallelLinear / MergedColumnParallelLinear): the q/k/v projections, the MLP's gate
    and up projections. One matmul over the stacked weight rows gives bit-identical outputs (each
    output column is the same dot product; tests/test_model.py) at ~7% less time per forward at
    batch 1 (fewer, larger kernel calls). `fuse` stacks the layers' weights and makes the layers'
    own parameters views of the stack, so the state dict, checkpoints and in-place weight loads
    are unchanged; training (module.training) reads the separate layers, whose gradients it needs.
    Before `fuse` (and for a module that never calls it) the separate layers run."""

    def __init__(self):
        super().__init__()
        self.register_buffer("weight", None, persistent=False)
        self.register_buffer("bias", None, persistent=False)
        self.sizes: list[int] = []
        self.parts: tuple[Tensor, ...] = ()  # the layers' weights (views of `weight`): the packed copy watches them
        self.packed = PackedWeight()

    @torch.no_grad()
    def fuse(self, *layers: nn.Linear) -> None:
        """Stack `layers`' current weights (after tensor-parallel sharding, in the model's dtype)."""
        biased = [lin.bias is not None for lin in layers]
        if any(biased) and not all(biased):
            raise ValueError("fused layers must all have a bias or none")
        if self.weight is not None and [lin.weight.data_ptr() for lin in layers] == \
                [p.data_ptr() for p in self.weight.split(self.sizes)]:
            return  # fused already (a second setup_cache): keep the stack a compiled forward was built on
        w = _stack([lin.weight for lin in layers])
        self.bias = _stack([lin.bias for lin in layers]) if all(biased) else None
        self.sizes = [lin.weight.shape[0] for lin in layers]
        self.weight = w
        self.parts = tuple(lin.weight for lin in layers)
        for lin, part, b in zip(layers, w.split(self.sizes), self.bias.split(self.sizes) if self.bias is not None
                                else [None] * len(layers)):
            lin.weight.data = part
            if b is not None:
                lin.bias.data = b

    def forward(self, x: Tensor, training: bool) -> tuple[Tensor, ...] | None:
        """The layers' outputs from one matmul, or None (not fused, or training)."""
        if self.weight is None or training:
            return None
        return _linear_call(self.packed, x, self.weight, self.bias, self.parts).split(self.sizes, dim=-1)


def _stack(parts: list[Tensor]) -> Tensor:
    """torch.cat(parts), or a view when they already lie back to back in one storage (fused
    before, or another model's fused layers shared without a copy, `Transformer.first_layers`)."""
    first, off = parts[0], parts[0].storage_offset()
    for p in parts:
        if not (p.is_contiguous() and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                and p.storage_offset() == off):
            return torch.cat(parts)
        off += p.numel()
    rows = sum(p.shape[0] for p in parts)
    return first.as_strided((rows, *first.shape[1:]), first.stride())


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.q_proj = Linear(a.hidden_size, a.num_heads * a.head_dim, bias=a.attention_bias)
        self.k_proj = Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.attention_bias)
        self.v_proj = Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.attention_bias)
        self.o_proj = Linear(a.num_heads * a.head_dim, a.hidden_size, bias=False)
        if a.qk_norm:
            self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps)
            self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.kv_cache: KVCache | None = None
        self.qkv = FusedLinear()

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, rows: BatchIndex) -> Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x, self.training) or (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        q = q.view(B, T, self.num_heads, self.head_dim)
        k = k.view(B, T, self.num_kv_heads, self.head_dim)
        v = v.view(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q * cos + rotate_half(q) * sin  # cos/sin: [B, T, 1, head_dim]
        k = k * cos + rotate_half(k) * sin
        if self.kv_cache is None:  # training: the T tokens are the whole sequence (rows.mask is causal)
            keys, values = k.transpose(1, 2), v.transpose(1, 2)
        else:
            keys, values = self.kv_cache.update(rows, k, v)  # [B, kv_heads, L, head_dim]
        attend = grouped_attention if rows.exact else _sdpa
        out = attend(q.transpose(1, 2), keys, values, rows.mask)  # [B, heads, T, head_dim]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))


ATTN_ROWS = 4  # query rows per key/value head in position-invariant attention (padded up to a multiple; see below)
ATTN_KEYS = 64  # keys per chunk of its weighted sum (the keys padded up to a multiple)
KV_MARGIN = 16 + 2 * ATTN_KEYS  # cache positions past max_len: ragged rows' padding, whole chunks of keys


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def grouped_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """Causal attention whose every query row is computed the same way however many rows share
    the call: q [B, H, T, D], k/v [B, Hkv, L, D], mask [B, 1, T, L] -> [B, H, T, D].

    The rep = H / Hkv query heads of a key/value head form one matrix of rep * T rows (no copy of
    k/v), padded to a multiple of ATTN_ROWS: CPU matmul kernels pick their blocking by the row
    count, and the float32 ones give a row the same result for every count from 4 rows up but not
    below (measured on this project's EPYC for every count from 4 to 47, 1 and 2 threads, key
    lengths 64-1024; 16 rows were the padding until that was measured, and cost a plain step at
    batch 16 up to 5x the attention FLOPs). The keys and values are views of the head-major cache
    (`KVCache`), taken by the matmuls without a transpose copy. Scores, softmax and the weighted
    sum are float32 (bf16 scores lost accuracy, tests/test_demo.py). The weighted sum runs over
    chunks of ATTN_KEYS keys, one fixed-size matmul each, added in order: a row's sum then does not
    depend on how many masked keys follow its last one (a plain step reads fewer keys than a
    verification of the same position; one matmul over all keys changed the sum in its last bit
    for ~5% of rows, and greedy outputs at 256 tokens)."""
    B, H, T, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    rep = H // Hkv
    M = rep * T
    rows = -(-M // ATTN_ROWS) * ATTN_ROWS
    qg = F.pad(q.reshape(B, Hkv, M, D).float(), (0, 0, 0, rows - M))  # [B, Hkv, rows, D]
    scores = torch.matmul(qg, k.float().transpose(-1, -2))[:, :, :M]  # [B, Hkv, rep*T, L]
    scores = scores.view(B, Hkv, rep, T, L) * D ** -0.5
    scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    p = torch.softmax(scores, dim=-1).view(B, Hkv, M, L)
    n, pad = -(-L // ATTN_KEYS), -L % ATTN_KEYS  # chunks of keys (the cache reads whole ones: no pad)
    p = F.pad(p, (0, pad, 0, rows - M)).view(B, Hkv, rows, n, ATTN_KEYS)  # zero rows, zero keys
    v = (F.pad(v.float(), (0, 0, 0, pad)) if pad else v.float()).view(B, Hkv, n, ATTN_KEYS, D)  # [B, Hkv, n, C, D]
    out = torch.matmul(p.transpose(2, 3), v).sum(2)[:, :, :M]  # [B, Hkv, n, rows, D] -> [B, Hkv, rep*T, D]
    return out.reshape(B, H, T, D).to(q.dtype)


class MLP(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.gate_proj = Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.up_proj = Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.down_proj = Linear(a.intermediate_size, a.hidden_size, bias=False)
        self.gate_up = FusedLinear()

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x, self.training) or (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.self_attn = Attention(a)
        self.mlp = MLP(a)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, rows: BatchIndex) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, rows)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """Llama-family decoder. `forward` is ragged and cache-backed; see module docstring."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        # kept in float32 outside the module's buffers so that .to(bfloat16) cannot round it
        self.inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, device="cpu").float() / args.head_dim))
        self.attention_scaling = 1.0
        self.num_slots = 0
        self.max_len = 0
        self.exact_positions: bool | None = None  # None: position_invariant follows the dtype
        self._compiled = None  # compile_layers(): the compiled `_stack`
        self.feature_layers: tuple[int, ...] = ()  # layers whose outputs lead the features (EAGLE-3 fusion)

    @property
    def position_invariant(self) -> bool:
        """Whether a position's logits are independent of the forward's shape (module docstring):
        on by default in bfloat16/float16, where rounding differences flip near-ties, and in float32
        on CPU, where SDPA's differences are ~1e-6 but still flipped a tie of 1.2e-6 (a tiny model's
        greedy answer, step 286): there it costs ~10% of a step (SmolLM2, 2 cores). CUDA float32
        keeps SDPA (its GEMMs change with the row count anyway; see README, "A note on bf16")."""
        if self.exact_positions is not None:
            return self.exact_positions
        return self.dtype in (torch.bfloat16, torch.float16) or self.device.type == "cpu"

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def setup_cache(self, num_slots: int, max_len: int, margin: int = KV_MARGIN) -> None:
        """Preallocate the KV cache: `num_slots` sequences of up to `max_len` positions (the margin:
        ragged rows' padding, and position-invariant attention reading whole chunks of keys, at least two), and
        fuse the projections that share an input (`FusedLinear`): the model is set up for inference.
        MemoryError, before allocating, when the device has not that much memory free."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        need = sum(2 * num_slots * a.num_kv_heads * (max_len + margin) * a.head_dim * itemsize
                   for a in (layer.self_attn for layer in self.layers) if a.kv_cache is None
                   or a.kv_cache.k.shape != (num_slots, a.num_kv_heads, max_len + margin, a.head_dim))
        free = free_memory(self.device)
        if free is not None and need > free:
            raise MemoryError(f"the KV cache ({num_slots} slots x {max_len} positions) needs {need / 2**30:.2f} GiB "
                              f"and {self.device} has {free / 2**30:.2f} GiB free: lower max_model_len, or the slots "
                              "(max_batch_size, lanes_per_target)")
        self.num_slots, self.max_len = num_slots, max_len
        for layer in self.layers:
            attn = layer.self_attn
            attn.qkv.fuse(attn.q_proj, attn.k_proj, attn.v_proj)
            layer.mlp.gate_up.fuse(layer.mlp.gate_proj, layer.mlp.up_proj)
            old = attn.kv_cache
            if old is None or old.k.shape != (num_slots, attn.num_kv_heads, max_len + margin, attn.head_dim) \
                    or old.k.dtype != self.dtype or old.k.device != self.device:
                # (a cache of the same shape is kept: every position is written before it is read,
                # and a compiled stack, guarded on these buffers, would otherwise compile again)
                attn.kv_cache = KVCache(num_slots, max_len + margin, attn.num_kv_heads, attn.head_dim,
                                        self.dtype, self.device)

    def rope(self, pos_grid: Tensor) -> tuple[Tensor, Tensor]:
        if self.inv_freq.device != pos_grid.device:
            self.inv_freq = self.inv_freq.to(pos_grid.device)
        freqs = pos_grid[..., None].float() * self.inv_freq  # [B, T, head_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]  # [B, T, 1, head_dim]
        scale = self.attention_scaling
        return (emb.cos() * scale).to(self.dtype), (emb.sin() * scale).to(self.dtype)

    def hidden_states(self, tokens: Tensor, slots: Tensor, starts: Tensor, sibling: Tensor | None = None,
                      taps: bool = False, exact: bool | None = None) -> Tensor:
        """tokens: [B, T] new tokens; slots, starts: [B]; sibling: see `BatchIndex.build`.
        Returns final-norm features [B, T, hidden]; with `taps`, the outputs of `feature_layers`
        (RMS-normalized, no weight) precede them: [B, T, (len(feature_layers) + 1) * hidden], the
        low/middle/high fusion an EAGLE-3 draft reads (Li et al. 2025). `exact`: False runs SDPA
        even where the model is position-invariant (a prompt's chunk, `runner.run_ragged`)."""
        exact = self.position_invariant and exact is not False
        lone = exact and tokens.numel() == 1  # a one-row matmul takes another kernel: add a dummy position
        if lone:
            tokens = tokens.repeat(1, 2)  # (contiguous: a compiled stack guards strides)
        rows = BatchIndex.build(slots, starts, tokens.shape[1], exact, sibling,
                                align=ATTN_KEYS if exact and self.layers[0].self_attn.kv_cache is not None else 1)
        cos, sin = self.rope(rows.pos_grid if rows.rope_grid is None else rows.rope_grid)
        lo, hi = (-1, -1) if self._compiled or rows.slot_range is None else rows.slot_range  # (ints 0/1 would specialize)
        args = (tokens, cos, sin, rows.slots, rows.slot_grid, rows.pos_grid, rows.mask, rows.kv_len, lo, hi, exact, taps)
        if self._compiled is None:
            h = self._stack(*args)
        else:
            with torch.no_grad():  # a compiled stack is inference-only (its matmul op has no backward)
                h = self._compiled(*args)
        return h[:, :1] if lone else h

    def _stack(self, tokens: Tensor, cos: Tensor, sin: Tensor, slots: Tensor, slot_grid: Tensor, pos_grid: Tensor,
               mask: Tensor, kv_len: int, lo: int, hi: int, exact: bool, taps: bool) -> Tensor:
        """Embedding, layers and final norm (`hidden_states` without its host-side bookkeeping: the
        BatchIndex arrives as tensors and ints, so that `compile_layers` can compile this whole)."""
        rows = BatchIndex(slots, None if lo < 0 else (lo, hi), slot_grid, pos_grid, kv_len, mask, exact)
        x = self.embed_tokens(tokens)
        tapped = []
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, rows)
            if taps and i in self.feature_layers:
                tapped.append(F.rms_norm(x, (x.shape[-1],), eps=self.args.rms_norm_eps))
        h = self.norm(x)
        return torch.cat([*tapped, h], dim=-1) if tapped else h

    def compile_layers(self) -> None:
        """Run `_stack` through torch.compile (inductor, dynamic shapes, C++ wrapper) from now on.

        A CPU forward at a few rows per row-batch is mostly Python and small kernels around the
        matmuls (~14 of ~32 ms for the demo target at batch 1 in bf16); compiled, the norms,
        rotary embedding, cache writes and attention arithmetic become a few fused C++ kernels
        and no interpreter. The matmuls stay `PackedWeight`'s, called as the opaque op
        `specdec::linear` (same kernels, chunks and packing as eager), and the attention keeps its
        position-invariant construction, so a position's logits still do not depend on how many
        positions share the forward. They can differ from the eager forward's in the last bits
        (other fusion), so an engine compiles its target before its first forward and keeps it.
        Each new shape class (batch 1 or more, one or more positions, features tapped or not)
        compiles once, minutes on a small CPU (inductor caches the code on disk for later
        processes). CPU only; weights must be final (tensor-parallel sharding, loading) first."""
        if self.device.type != "cpu":
            raise ValueError("compile_layers: CPU only (the GPU path is not measured)")
        if self._compiled is not None:
            return
        self.requires_grad_(False)  # inference only; and a draft freezing the shared embedding later would recompile
        import torch._dynamo
        import torch.fx.experimental._config as fx_config
        fx_config.use_duck_shape = False  # a cache length that once equalled head_dim must not recompile later
        cfg = torch._dynamo.config
        cfg.recompile_limit = max(cfg.recompile_limit, 64)
        cfg.fail_on_recompile_limit_hit = True  # never fall back to eager (other last bits) unnoticed
        self._compiled = torch.compile(self._stack, dynamic=True, options={"cpp_wrapper": True})

    def forward(self, tokens: Tensor, slots: Tensor, starts: Tensor, last: Tensor | None = None,
                n_logits: int = 1, n_hidden: int = 0, sibling: Tensor | None = None,
                exact: bool | None = None) -> tuple[Tensor, Tensor]:
        """Run new tokens and return logits of `n_logits` positions per row ending at `last`.

        tokens: [B, T]; slots, starts: [B]; last: [B] index (within T) of each row's last real
        token (default T-1); sibling [B, 2]: a draft tree's extra node (`BatchIndex.build`);
        exact=False: SDPA attention where the model would be position-invariant (`hidden_states`).
        Returns (logits [B, n_logits, vocab] float32, hidden [B, n, hidden]) with
        n = max(n_logits, n_hidden): features of the last n positions (for EAGLE drafts; with
        `feature_layers`, their taps first, see `hidden_states`).
        """
        return self.head(self.hidden_states(tokens, slots, starts, sibling, taps=n_hidden > 0, exact=exact), last,
                         n_logits, n_hidden)

    def head(self, h: Tensor, last: Tensor | None, n_logits: int, n_hidden: int = 0) -> tuple[Tensor, Tensor]:
        """h: [B, T, hidden] -> (logits of the last n_logits positions up to `last`, their features)."""
        B, T, _ = h.shape
        n = max(n_logits, n_hidden)
        if last is None:
            last = torch.full((B,), T - 1, device=h.device)
        idx = (last[:, None] - n + 1 + torch.arange(n, device=h.device)).clamp(min=0)
        h = torch.gather(h, 1, idx[:, :, None].expand(-1, -1, h.shape[-1]))  # [B, n, hidden]
        top = h[:, n - n_logits:]
        if top.shape[-1] != self.args.hidden_size:  # taps lead h: the head reads the final features,
            top = top[..., -self.args.hidden_size:].contiguous()  # laid out as without taps (same kernel)
        return self.lm_head(top).float(), h

    def first_layers(self, n: int) -> "Transformer":
        """A self-speculation draft: this model's first n layers, final norm and head, sharing the
        weights (no copy) but with its own KV cache (LayerSkip-style early exit, zero training)."""
        if not 0 < n <= self.args.num_layers:
            raise ValueError(f"self-draft layers must be in 1..{self.args.num_layers}, got {n}")
        args = ModelArgs(**{**self.args.__dict__, "num_layers": n})
        with torch.device("meta"):
            draft = Transformer(args)
        shared = {k: v for k, v in self.state_dict().items()
                  if not k.startswith("layers.") or int(k.split(".")[1]) < n}
        draft.load_state_dict(shared, strict=True, assign=True)
        draft.inv_freq, draft.attention_scaling = self.inv_freq, self.attention_scaling
        return draft.eval()

    @classmethod
    def from_hf(cls, hf_model, dtype=None) -> "Transformer":
        """Build from a loaded transformers causal LM, sharing (not copying) its weights."""
        args = ModelArgs.from_hf_config(hf_model.config)
        with torch.device("meta"):
            model = cls(args)
        sd = hf_model.state_dict()
        base = "model." if any(k.startswith("model.layers.") for k in sd) else ""
        mapped, unused = {}, []
        for name, tensor in sd.items():
            if name.startswith(base + "layers.") or name in (base + "embed_tokens.weight", base + "norm.weight"):
                mapped[name[len(base):]] = tensor
            elif name == "lm_head.weight":
                mapped[name] = tensor
            else:
                unused.append(name)
        if "lm_head.weight" not in mapped:
            mapped["lm_head.weight"] = mapped["embed_tokens.weight"]
        unused += model.load_state_dict(mapped, strict=False, assign=True).unexpected_keys
        if unused:  # weights of a feature this runner would silently skip
            raise ValueError(f"checkpoint has weights this engine does not use: {sorted(unused)[:5]}")
        missing = [n for n, p in model.named_parameters() if p.is_meta]
        if missing:
            raise ValueError(f"checkpoint lacks weights for {missing[:5]}")
        rot = getattr(getattr(hf_model, "model", hf_model), "rotary_emb", None)
        if rot is not None:  # any rope variant transformers supports (llama3, yarn, ...)
            if 2 * rot.inv_freq.numel() != model.args.head_dim:  # (a partial_rotary_factor with such a variant)
                raise ValueError(f"rotary frequencies cover {2 * rot.inv_freq.numel()} of the head's {model.args.head_dim} "
                                 "dimensions (partial rotary embeddings are not implemented)")
            model.inv_freq = rot.inv_freq.detach().float().clone()
            model.attention_scaling = float(getattr(rot, "attention_scaling", 1.0))
        if dtype is not None:
            model = model.to(dtype)
        return model.eval()
