"""An EAGLE-style draft (Li et al. 2024, EAGLE-1): autoregression over the target's *features*.

The target's final-norm feature f_p at position p already decides the token at p+1 (logits =
head(f_p)). EAGLE drafts in feature space: one decoder layer reads, at every position p,

    e_p = fc([f_p ; embed(x_{p+1})])          # [hidden] from [2 * hidden]

(the feature and the token it produced, which removes the sampling ambiguity) and predicts
g_p ~ f_{p+1}; the token after x_{p+1} is drafted from head(g_p). Later draft steps feed their own
predictions g back in place of the target's features. The embedding and the head are the
target's own, frozen and not stored: the head keeps only the rows of a reduced vocabulary
(FR-Spec, Zhao et al. 2025), which the rejection sampler handles losslessly. What a checkpoint
holds is small: fc and the decoder layer (~4.2M parameters for a 576-wide target, 5.2M with EAGLE-3's fusion).

EAGLE-3's feature fusion (Li et al. 2025) is optional: a draft with `feature_layers` reads, in
place of f_p, [t_p^(l1); ...; f_p] -- the RMS-normalized outputs of those target layers before the
final feature (`Transformer.hidden_states(taps=True)`) -- through `fuse` ([hidden] from
[(n+1) * hidden]) at its first step; later steps read their own g as before. `fuse` starts as
[0 ... 0 I], i.e. exactly the unfused draft, so fine-tuning an EAGLE-1 draft only adds to it.

The layer's KV cache is the same slot cache as the target's (specdec.model), indexed by position
relative to the first feature the draft saw for a sequence (`base`): attention with rotary
embeddings depends only on position differences, so a draft that joins a sequence late (a
restarted replica) just attends to fewer positions. Checkpoint layout (a directory):
config.json (the layer's dimensions, `feature_layers`), model.safetensors (fuse, fc and layers), the tokenizer, and
specdec.json with {"kind": "eagle", "target": ..., "draft_vocab": [...], "target_fingerprint": [...]}.
The fingerprint (`target_fingerprint`) lets a target of the same shape but other weights (another
fine-tune) be told apart at load: the draft still loads and output stays the target's, but its
features are not the ones it learned, so acceptance drops, and the log says why.
"""
from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path

import torch
from torch import Tensor, nn
from transformers import AutoConfig, PretrainedConfig

from specdec.model import BatchIndex, DecoderLayer, Linear, ModelArgs, Transformer

EAGLE_KIND = "eagle"
FINGERPRINT_SIZE = 16
log = logging.getLogger(__name__)


def target_fingerprint(target: Transformer) -> list[float]:
    """The first weights of the target's final norm and of its embedding's first column: trained in
    every fine-tune, never sharded or prepacked here (a whole target), and in another dtype changed
    only by its rounding."""
    n = FINGERPRINT_SIZE
    w = torch.cat([target.norm.weight.detach()[:n], target.embed_tokens.weight.detach()[:n, 0]])
    return [round(float(x), 6) for x in w.float().cpu()]


def same_target(saved: list[float], target: Transformer, rtol: float = 0.02) -> bool:
    """Whether `saved` is `target`'s fingerprint (bf16 rounding moves a weight by < 0.4 %)."""
    mine = torch.tensor(target_fingerprint(target))
    theirs = torch.tensor(saved)
    return mine.shape == theirs.shape and bool(((mine - theirs).abs() <= rtol * theirs.abs().clamp(min=1e-3)).all())


class EagleDraftConfig(PretrainedConfig):
    """An EAGLE checkpoint's config.json, known to AutoConfig: transformers reading the directory
    (AutoTokenizer at build time) no longer warns of an unknown model type."""

    model_type = "specdec_eagle"


AutoConfig.register(EagleDraftConfig.model_type, EagleDraftConfig, exist_ok=True)


class EagleDraft(Transformer):
    """fc over [feature; next-token embedding] + `num_layers` decoder layers + the target's head rows."""

    def __init__(self, args: ModelArgs, draft_vocab: int, num_layers: int = 1, feature_layers=()):
        nn.Module.__init__(self)
        self.args = ModelArgs(**{**asdict(args), "num_layers": num_layers})
        H = args.hidden_size
        self.feature_layers = tuple(feature_layers)  # the target layers fused before its final feature
        self.fuse = Linear((len(self.feature_layers) + 1) * H, H, bias=False) if self.feature_layers else None
        self.fc = Linear(2 * H, H, bias=True)
        self.layers = nn.ModuleList(DecoderLayer(self.args) for _ in range(num_layers))
        self.embed_tokens = nn.Embedding(args.vocab_size, H)  # the target's, frozen, not saved
        self.lm_head = Linear(H, draft_vocab, bias=False)  # the target's kept rows, frozen, not saved
        self.register_buffer("token_map", torch.arange(draft_vocab), persistent=False)
        self.inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2).float() / args.head_dim))
        self.attention_scaling = 1.0
        self.num_slots = self.max_len = 0

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @classmethod
    def for_target(cls, target: Transformer, token_map: Tensor, num_layers: int = 1,
                   args: ModelArgs | None = None, feature_layers=()) -> "EagleDraft":
        """A fresh draft (float32 fuse, fc and layers) sharing `target`'s embedding and the head
        rows of `token_map` (frozen). `args` overrides the layer's sizes (default: the target's);
        `fuse` starts as the identity on the final feature."""
        args = args or target.args
        with torch.device("meta"):
            draft = cls(args, len(token_map), num_layers, feature_layers)
        H = args.hidden_size
        with torch.device(target.device):
            draft.fc = Linear(2 * H, H, bias=True)
            draft.layers = nn.ModuleList(DecoderLayer(draft.args) for _ in range(num_layers))
            if draft.feature_layers:
                draft.fuse = Linear((len(draft.feature_layers) + 1) * H, H, bias=False)
                with torch.no_grad():
                    draft.fuse.weight.zero_()[:, -H:] = torch.eye(H)
        draft.attach_target(target, token_map)
        return draft

    def attach_target(self, target: Transformer, token_map: Tensor) -> None:
        """Share the target's embedding and take its head rows for `token_map` (both frozen)."""
        self.embed_tokens = target.embed_tokens
        self.embed_tokens.weight.requires_grad_(False)
        w = target.lm_head.weight.detach()[token_map.to(target.lm_head.weight.device)]
        self.lm_head = Linear(w.shape[1], w.shape[0], bias=False, device="meta")
        self.lm_head.weight = nn.Parameter(w.clone(), requires_grad=False)
        self.token_map = token_map.to(w.device)
        self.inv_freq, self.attention_scaling = target.inv_freq, target.attention_scaling
        self.fingerprint = target_fingerprint(target)

    @torch.no_grad()
    def load_grown(self, state: dict[str, Tensor]) -> None:
        """Load a checkpoint's trained state (`trained_state`) that has fewer decoder layers than this
        draft: its layers first, then each extra layer as the identity (its attention and MLP output
        projections zero, so the residual stream passes through). The grown draft then computes exactly
        what the checkpoint does, and training only adds to it (as `fuse` starts at the identity)."""
        have = 1 + max((int(k.split(".")[1]) for k in state if k.startswith("layers.")), default=-1)
        if have > len(self.layers):
            raise ValueError(f"the checkpoint has {have} decoder layers, this draft {len(self.layers)}")
        self.load_state_dict(state, strict=False)
        for layer in self.layers[have:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()

    def trained_state(self) -> dict[str, Tensor]:
        """What a checkpoint stores: fc and the decoder layers (not the shared embedding/head)."""
        return {k: v for k, v in self.state_dict().items() if k.startswith(("fuse.", "fc.", "layers."))}

    # ---- forward passes --------------------------------------------------------------------
    def fused(self, features: Tensor) -> Tensor:
        """[..., hidden] features as the layer reads them: the target's taps and f_p
        [..., (n+1) * hidden] through `fuse`; f_p or the draft's own g as they are."""
        features = features.to(self.dtype)
        return features if features.shape[-1] == self.args.hidden_size else self.fuse(features)

    def _inputs(self, features: Tensor, tokens: Tensor) -> Tensor:
        # features: see `fused`, [B, T, *]; tokens: [B, T] (x_{p+1})
        return self.fc(torch.cat([self.fused(features), self.embed_tokens(tokens).to(self.dtype)], dim=-1))

    def forward(self, tokens: Tensor, slots: Tensor, starts: Tensor, last: Tensor | None = None,
                n_logits: int = 1, n_hidden: int = 0, features: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Cache-backed, ragged (as Transformer.forward). Returns (logits over the reduced vocab
        [B, n, V_draft] float32, predicted features g [B, n, hidden])."""
        rows = BatchIndex.build(slots, starts, tokens.shape[1])
        return self.head(self._body(self._inputs(features, tokens), rows), last, n_logits, n_hidden)

    def _body(self, x: Tensor, rows: BatchIndex) -> Tensor:
        cos, sin = self.rope(rows.pos_grid)
        for layer in self.layers:
            x = layer(x, cos, sin, rows)
        return x

    def forward_train(self, features: Tensor, next_tokens: Tensor,
                      context: list[tuple[Tensor, Tensor]] | None = None) -> tuple[Tensor, list]:
        """Whole sequences without the slot cache: features f_0..f_{T-1} [B, T, hidden], next_tokens
        x_1..x_T [B, T] -> (predicted features g [B, T, hidden], this pass's keys/values per layer).

        With `context` (a previous pass's keys/values), position p attends to the context at
        positions < p and to its own entry at p only: exactly a second draft step at inference,
        where the true entries precede one entry built from the draft's own prediction."""
        B, T = next_tokens.shape
        dev = next_tokens.device
        rows = BatchIndex.build(torch.arange(B, device=dev), torch.zeros(B, dtype=torch.long, device=dev), T)
        if context is not None:
            eye = torch.eye(T, dtype=torch.bool, device=dev).expand(B, 1, T, T)
            rows.mask = torch.cat([rows.mask & ~eye, eye], dim=-1)  # [B, 1, T, 2T]
        kvs = [_TrainKV(None if context is None else context[i]) for i in range(len(self.layers))]
        saved = [layer.self_attn.kv_cache for layer in self.layers]
        for layer, kv in zip(self.layers, kvs):
            layer.self_attn.kv_cache = kv
        try:
            g = self._body(self._inputs(features, next_tokens), rows)
        finally:
            for layer, kv in zip(self.layers, saved):
                layer.self_attn.kv_cache = kv
        return g, [(kv.k, kv.v) for kv in kvs]

    # ---- checkpoints -----------------------------------------------------------------------
    def save(self, out: Path, tokenizer, extra: dict, dtype: torch.dtype = torch.bfloat16) -> None:
        from safetensors.torch import save_file

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        a = self.args
        config = {"architectures": ["SpecdecEagleDraft"], "model_type": EagleDraftConfig.model_type,
                  "hidden_size": a.hidden_size, "intermediate_size": a.intermediate_size,
                  "num_hidden_layers": a.num_layers, "num_attention_heads": a.num_heads,
                  "num_key_value_heads": a.num_kv_heads, "head_dim": a.head_dim, "rms_norm_eps": a.rms_norm_eps,
                  "vocab_size": a.vocab_size, "draft_vocab_size": int(self.lm_head.weight.shape[0]),
                  "feature_layers": list(self.feature_layers)}
        (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
        state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in self.trained_state().items()}
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.save_pretrained(out)
        extra = {**extra, "kind": EAGLE_KIND, "draft_vocab": [int(t) for t in self.token_map.tolist()],
                 "target_fingerprint": self.fingerprint}
        (out / "specdec.json").write_text(json.dumps(extra) + "\n")


def _dir(spec: str | Path) -> Path:
    from specdec.loader import ModelLoadError, resolve
    try:
        return resolve(spec).path
    except ModelLoadError:
        return Path(spec)


def is_eagle(spec: str | Path | None) -> bool:
    """True when `spec` (a directory or a bundled name) is an EAGLE-style draft checkpoint."""
    if spec is None:
        return False
    f = _dir(spec) / "specdec.json"
    return f.is_file() and json.loads(f.read_text()).get("kind") == EAGLE_KIND


def check_eagle_fits(path: str | Path, target_args: ModelArgs) -> dict:
    """Refuse a draft trained for another target shape; returns the draft's config."""
    config = json.loads((_dir(path) / "config.json").read_text())
    for key, mine in (("hidden_size", target_args.hidden_size), ("vocab_size", target_args.vocab_size)):
        if config[key] != mine:
            raise ValueError(f"EAGLE draft {path} was trained for {key}={config[key]}, the target has {mine}")
    bad = [i for i in config.get("feature_layers", ()) if not 0 <= i < target_args.num_layers - 1]
    if bad:
        raise ValueError(f"EAGLE draft {path} fuses target layers {bad}; the target has {target_args.num_layers}")
    return config


def feature_layers(spec: str | Path | None) -> list[int]:
    """The target layers an EAGLE checkpoint fuses before the final feature ([] for EAGLE-1 drafts)."""
    if not is_eagle(spec):
        return []
    return list(json.loads((_dir(spec) / "config.json").read_text()).get("feature_layers", []))


def load_eagle(path: str | Path, target: Transformer, dtype: torch.dtype | None = None) -> EagleDraft:
    """Load an EAGLE checkpoint directory onto `target` (whose embedding and head it shares)."""
    from safetensors.torch import load_file

    if not is_eagle(path):
        raise ValueError(f"{path} is not an EAGLE draft (its specdec.json lacks kind={EAGLE_KIND!r})")
    path = _dir(path)
    a = target.args
    config = check_eagle_fits(path, a)
    extra = json.loads((path / "specdec.json").read_text())
    args = ModelArgs(**{**asdict(a), "intermediate_size": config["intermediate_size"],
                        "num_heads": config["num_attention_heads"], "num_kv_heads": config["num_key_value_heads"],
                        "head_dim": config["head_dim"]})
    draft = EagleDraft.for_target(target, torch.tensor(extra["draft_vocab"], dtype=torch.long),
                                  config["num_hidden_layers"], args, config.get("feature_layers", ()))
    state = load_file(str(path / "model.safetensors"))
    missing, unexpected = draft.load_state_dict(state, strict=False)
    trained = set(draft.trained_state())
    if unexpected or trained & set(missing):
        raise ValueError(f"EAGLE checkpoint {path} does not match: missing {sorted(trained & set(missing))[:4]}, "
                         f"unexpected {unexpected[:4]}")
    draft.extra = extra
    if extra.get("target_fingerprint") and not same_target(extra["target_fingerprint"], target):
        log.warning("EAGLE draft %s was trained on another target of this shape (%s; their weights "
                    "differ): output stays the target's, but expect low acceptance", path, extra.get("target", "?"))
    dtype = dtype or target.dtype
    for part in (draft.fuse, draft.fc, draft.layers):  # on the target's device: it shares its embedding and head
        if part is not None:
            part.to(device=target.device, dtype=dtype)
    return draft.eval()


class _TrainKV(nn.Module):
    """Stands in for a layer's KV cache in training: records this pass's keys/values and
    prepends a previous pass's (see EagleDraft.forward_train)."""

    def __init__(self, context: tuple[Tensor, Tensor] | None):
        super().__init__()
        self.context = context
        self.k = self.v = None

    def update(self, rows, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """k, v [B, T, kv_heads, head_dim], recorded; returns the keys/values to attend to laid out
        as the slot cache returns them, [B, kv_heads, L, head_dim]."""
        self.k, self.v = k, v
        if self.context is not None:
            k, v = torch.cat([self.context[0], k], dim=1), torch.cat([self.context[1], v], dim=1)
        return k.transpose(1, 2), v.transpose(1, 2)

