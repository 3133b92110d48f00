"""Tensor parallelism as one transform over a loaded model (after gpt-fast's tp.py; Megatron-LM,
Shoeybi et al. 2019).

`apply_tp(model, rank, world_size)` keeps this rank's shard of every linear layer:
- column-parallel (split output features): q/k/v projections (whole attention heads) and the
  MLP's gate/up projections;
- row-parallel (split input features): the attention output and MLP down projections, followed by
  an all-reduce (a forward hook) that sums the partial results of all ranks (with more than two
  ranks in rank order, so that a position's logits do not depend on the others in its forward).
Embeddings, norms and the LM head stay replicated, so every rank ends with the full logits. The
model code itself never sees a rank; each rank's KV cache holds only its own kv heads.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def check_tp(args, world_size: int) -> None:
    """Raise ValueError unless `world_size` divides the head and MLP dimensions."""
    for name, n in (("attention heads", args.num_heads), ("key/value heads", args.num_kv_heads),
                    ("MLP intermediate size", args.intermediate_size)):
        if n % world_size:
            raise ValueError(f"tensor parallel size {world_size} does not divide the model's {n} {name}")


def _shard(linear: nn.Linear, dim: int, rank: int, world: int) -> None:
    w = linear.weight.detach()
    linear.weight = nn.Parameter(w.chunk(world, dim=dim)[rank].clone(), requires_grad=False)
    if linear.bias is not None and dim == 0:
        linear.bias = nn.Parameter(linear.bias.detach().chunk(world)[rank].clone(), requires_grad=False)
    linear.in_features, linear.out_features = linear.weight.shape[1], linear.weight.shape[0]


def _all_reduce_hook(group, world: int):
    """The row-parallel layer's sum over ranks. Two ranks: all_reduce (a + b == b + a exactly).
    More: gloo and NCCL split a buffer by its size, so the order in which a position's partial
    sums are added (and so its rounding) would depend on how many positions share the forward,
    and a verify of k+1 positions would not give plain decoding's logits; so gather the partials
    and add them in rank order, in float32, the same whatever the shape."""
    def reduce_two(_module, _inputs, output):
        dist.all_reduce(output, group=group)
        return output

    def reduce_in_rank_order(_module, _inputs, output):
        parts = [torch.empty_like(output) for _ in range(world)]  # world x [batch, T, hidden]
        dist.all_gather(parts, output.contiguous(), group=group)
        total = parts[0].float()
        for part in parts[1:]:
            total += part
        return total.to(output.dtype)
    return reduce_two if world <= 2 else reduce_in_rank_order


def apply_tp(model, rank: int, world_size: int, group=None):
    """Shard `model` (a specdec.model.Transformer) in place for `rank` of `world_size`."""
    if world_size == 1:
        return model
    check_tp(model.args, world_size)
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for lin in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
            _shard(lin, 0, rank, world_size)
        for lin in (attn.o_proj, mlp.down_proj):
            _shard(lin, 1, rank, world_size)
            lin.register_forward_hook(_all_reduce_hook(group, world_size))
        attn.num_heads //= world_size
        attn.num_kv_heads //= world_size
    model.tp_rank, model.tp_world_size = rank, world_size
    return model

