"""The draft being trained: a transformers `LlamaModel` body plus a reduced head, and its export as
a plain Hugging Face checkpoint.

Training uses a head of N x hidden rows, one per kept token (FR-Spec, Zhao et al. 2025), so the
largest matmul shrinks with the vocabulary. A stock `LlamaForCausalLM` needs a head row for every
token, so the export writes a full-size `lm_head` whose kept rows are the trained ones and whose
other rows are copies of the input embeddings (a tied-head fallback: with `--init-from-target` on
a tied target these are the target's own head rows). `specdec.json`'s `draft_vocab` lists the kept
ids; `specdec.loader.load_model` slices the head back to them, which is what the engine runs.

Initialisation from the target (DistillSpec, Zhou et al. 2023, starts from a pretrained draft;
here the target's first layers are the nearest thing): embeddings, the first `layers` decoder
layers, the final norm and the kept head rows are copied wherever shapes match.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor, nn


def draft_config(target_cfg, layers: int, hidden: int | None = None, intermediate: int | None = None,
                 heads: int | None = None, kv_heads: int | None = None):
    """A LlamaConfig for the draft; unset sizes are the target's (intermediate scales with hidden)."""
    from transformers import LlamaConfig

    t = target_cfg.get_text_config() if hasattr(target_cfg, "get_text_config") else target_cfg
    hidden = hidden or t.hidden_size
    heads = heads or t.num_attention_heads
    kv_heads = kv_heads or getattr(t, "num_key_value_heads", None) or heads
    if intermediate is None:
        scaled = max(64, round(t.intermediate_size * hidden / t.hidden_size / 64) * 64)
        intermediate = t.intermediate_size if hidden == t.hidden_size else scaled
    t_head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    head_dim = t_head_dim if hidden == t.hidden_size and heads == t.num_attention_heads else hidden // heads
    if heads % kv_heads:
        raise ValueError(f"--heads {heads} must be a multiple of --kv-heads {kv_heads}")
    rope = getattr(t, "rope_parameters", None) or {"rope_type": "default",
                                                   "rope_theta": getattr(t, "rope_theta", 10000.0)}
    return LlamaConfig(
        vocab_size=t.vocab_size, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=getattr(t, "max_position_embeddings", 4096), rms_norm_eps=t.rms_norm_eps,
        rope_parameters=dict(rope), tie_word_embeddings=False, attention_bias=False,
        bos_token_id=getattr(target_cfg, "bos_token_id", None), eos_token_id=getattr(target_cfg, "eos_token_id", None),
        pad_token_id=getattr(target_cfg, "pad_token_id", None), architectures=["LlamaForCausalLM"])


class DraftLM(nn.Module):
    """LlamaModel body + head over the kept vocabulary: input ids [B, T] -> logits [B, T, N]."""

    def __init__(self, config, kept: list[int]):
        super().__init__()
        from transformers import LlamaModel

        self.config = config
        self.body = LlamaModel(config)
        self.register_buffer("kept", torch.tensor(kept, dtype=torch.long), persistent=True)
        self.head = nn.Linear(config.hidden_size, len(kept), bias=False)
        nn.init.normal_(self.head.weight, std=config.initializer_range)

    def forward(self, input_ids: Tensor) -> Tensor:
        h = self.body(input_ids=input_ids).last_hidden_state  # [B, T, hidden]
        return self.head(h)  # [B, T, N]

    def init_from_target(self, target_sd: dict[str, Tensor], freeze_embeddings: bool = True) -> list[str]:
        """Copy matching tensors from a compact-target state dict (specdec.model names); returns what
        was copied. Embeddings are then frozen unless told otherwise (they are most of the draft)."""
        copied = []
        own = self.body.state_dict()
        with torch.no_grad():
            for name, t in target_sd.items():
                if name == "lm_head.weight":
                    if t.shape[1] == self.head.weight.shape[1]:
                        self.head.weight.copy_(t[self.kept].float())
                        copied.append("lm_head[kept]")
                    continue
                layer = int(name.split(".")[1]) if name.startswith("layers.") else -1
                if layer >= self.config.num_hidden_layers or name not in own or own[name].shape != t.shape:
                    continue
                own[name].copy_(t.float())
                copied.append(name)
        if freeze_embeddings and "embed_tokens.weight" in copied:
            self.body.embed_tokens.weight.requires_grad_(False)
        return copied

    def full_head(self) -> Tensor:
        """[V, hidden]: the trained rows at the kept ids, input embeddings elsewhere."""
        full = self.body.embed_tokens.weight.detach().clone()
        full[self.kept] = self.head.weight.detach()
        return full


def save_hf(student: DraftLM, out: Path, tokenizer, extra: dict, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write config.json, model.safetensors, the tokenizer and specdec.json to `out`."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    sd = {"model." + k: v.detach().to(dtype).contiguous() for k, v in student.body.state_dict().items()}
    sd["lm_head.weight"] = student.full_head().to(dtype).contiguous()
    tmp = out / "model.safetensors.tmp"
    save_file(sd, str(tmp), metadata={"format": "pt"})
    tmp.chmod(0o644)
    tmp.replace(out / "model.safetensors")
    cfg = student.config
    cfg.dtype = dtype
    cfg.save_pretrained(out)
    tokenizer.save_pretrained(out)
    write_extra(out / "specdec.json", extra)


def write_extra(path: Path, extra: dict) -> None:
    """specdec.json, readable: everything indented except the (long) draft_vocab list on one line."""
    rest = {k: v for k, v in extra.items() if k != "draft_vocab"}
    body = json.dumps(rest, indent=1)[1:-1].strip("\n")
    vocab = json.dumps(extra.get("draft_vocab"))
    path.write_text("{\n" + (body + ",\n" if body else "") + f' "draft_vocab": {vocab}\n}}\n')
