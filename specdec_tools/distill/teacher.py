"""The teacher side of distillation: the target's next-token distributions over the draft's
vocabulary, computed by batched *prefill* of the compact target (specdec.model.Transformer).

Token-level distillation (DistillSpec, Zhou et al. 2023) needs only p_target(. | prefix) at every
position of a training row; one prefill gives all of them, which on this CPU is ~15x cheaper per
token than generating. Only the kept vocabulary's head rows are multiplied (FR-Spec, Zhao et al.
2025: the draft never proposes anything else), the result is renormalised over those ids and
truncated to its top-k (renormalised again), so a batch's targets are two small [B, T, k] tensors.

`select_vocab` picks the reduced head: the N tokens the target predicts most often (greedy) on
training text, always including special and end-of-turn tokens.
"""
from __future__ import annotations

import torch
from torch import Tensor

from specdec.engine import eos_ids_of


def ensure_cache(model, slots: int, max_len: int) -> None:
    """(Re)allocate the model's KV cache when it is smaller than a batch needs."""
    if model.num_slots < slots or model.max_len < max_len or model.layers[0].self_attn.kv_cache is None:
        model.setup_cache(max(slots, model.num_slots), max(max_len, model.max_len))


def pad_rows(rows: list[list[int]], pad: int) -> tuple[Tensor, Tensor]:
    """Right-pad rows: (tokens [B, T], lengths [B])."""
    T = max(len(r) for r in rows)
    tokens = torch.full((len(rows), T), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r)
    return tokens, torch.tensor([len(r) for r in rows])


class Teacher:
    """Sparse teacher targets from the compact target model (any dtype; bf16 is ~2x faster here)."""

    def __init__(self, model, kept: Tensor | None = None, topk: int = 64, chunk_rows: int = 8):
        self.model = model.eval()
        self.topk, self.chunk_rows = topk, chunk_rows
        self.set_vocab(kept)

    def set_vocab(self, kept: Tensor | None) -> None:
        """kept: [N] target ids of the draft head (None = full vocabulary)."""
        w = self.model.lm_head.weight  # [V, hidden]
        self.head = w if kept is None else w[kept].contiguous()  # [N, hidden]

    @torch.no_grad()
    def _hidden(self, tokens: Tensor) -> Tensor:
        B, T = tokens.shape
        ensure_cache(self.model, B, T)
        zeros = torch.zeros(B, dtype=torch.long)
        return self.model.hidden_states(tokens, torch.arange(B), zeros)  # [B, T, hidden]

    @torch.no_grad()
    def targets(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """tokens [B, T] -> (ids [B, T, k] indices into the kept vocabulary, probs [B, T, k] float32)."""
        ids_out, probs_out = [], []
        for chunk in tokens.split(self.chunk_rows):
            h = self._hidden(chunk)  # [b, T, hidden]
            logits = (h @ self.head.T).float()  # [b, T, N]
            vals, ids = logits.topk(min(self.topk, logits.shape[-1]), dim=-1)  # [b, T, k]
            ids_out.append(ids)
            probs_out.append(torch.softmax(vals, dim=-1))
        return torch.cat(ids_out), torch.cat(probs_out)

    @torch.no_grad()
    def greedy(self, tokens: Tensor) -> Tensor:
        """tokens [B, T] -> the target's greedy next token at every position [B, T] (full vocabulary)."""
        out = []
        for chunk in tokens.split(max(1, self.chunk_rows // 2)):
            h = self._hidden(chunk)  # [b, T, hidden]
            out.append((h @ self.model.lm_head.weight.T).argmax(-1))  # [b, T]
        return torch.cat(out)


def special_ids(tokenizer, config=None) -> list[int]:
    """Ids the draft head must always contain: special tokens, EOS and chat end-of-turn tokens."""
    ids = set(tokenizer.all_special_ids) | set(eos_ids_of(tokenizer))
    for tid, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(added, "special", False):
            ids.add(int(tid))
    if config is not None:
        for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
            v = getattr(config, name, None)
            ids.update(v if isinstance(v, list) else [v] if v is not None else [])
    return sorted(i for i in ids if i is not None and i >= 0)


def check_draft_vocab(n: int, vocab_size: int, specials: list[int]) -> None:
    """Refuse a reduced head (0 < n < vocab_size; otherwise the full one) too small for the special tokens."""
    if 0 < n < vocab_size and len(specials) >= n:
        raise ValueError(f"--draft-vocab {n} is smaller than the {len(specials)} special tokens")


def select_vocab(teacher: Teacher, rows: list[list[int]], n: int, vocab_size: int,
                 specials: list[int]) -> tuple[list[int], dict]:
    """The `n` tokens the target predicts most often on `rows` (ties and any shortfall filled by
    input frequency), plus `specials`; sorted ids and a summary (coverage on these rows)."""
    check_draft_vocab(n, vocab_size, specials)
    if n <= 0 or n >= vocab_size:
        return list(range(vocab_size)), {"coverage": 1.0, "tokens": 0}
    pred = torch.zeros(vocab_size, dtype=torch.long)
    seen = torch.zeros(vocab_size, dtype=torch.long)
    for i in range(0, len(rows), teacher.chunk_rows):
        tokens, _ = pad_rows(rows[i: i + teacher.chunk_rows], 0)
        pred += torch.bincount(teacher.greedy(tokens).flatten(), minlength=vocab_size)
        seen += torch.bincount(tokens.flatten(), minlength=vocab_size)
    score = pred.double() * (seen.max().item() + 1) + seen.double()  # greedy counts first
    score[specials] = -1  # added below regardless
    top = score.topk(n - len(specials)).indices.tolist()
    kept = sorted(set(top) | set(specials))
    coverage = pred[kept].sum().item() / max(1, pred.sum().item())
    return kept, {"coverage": coverage, "tokens": int(pred.sum()), "distinct_predicted": int((pred > 0).sum())}
