"""Tensor parallelism as one transform: two gloo ranks give the logits of one process."""
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from specdec.loader import load_model
from specdec.model import ModelArgs
from specdec.tp import apply_tp, check_tp


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(rank, world, port) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def _report_and_leave(rank, out_q, value) -> None:
    """Rank 0 sends `value` (plain data outlives the process); every rank leaves the group and exits
    without interpreter teardown, where gloo's threads once aborted a finished rank."""
    import torch.distributed as dist
    if rank == 0:
        out_q.put(value)
        out_q.close()
        out_q.join_thread()
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def _run_ranks(target, world: int, *args):
    """Rank 0's value from `target(rank, world, port, *args, queue)` run in `world` processes."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, q)) for r in range(world)]
    for p in procs:
        p.start()
    value = q.get(timeout=120)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return value


def _rank(rank, world, port, path, ids, out_q):
    _join(rank, world, port)
    model = apply_tp(load_model(path), rank, world)
    model.setup_cache(1, 64)
    with torch.inference_mode():
        logits, _ = model(torch.tensor([ids]), torch.tensor([0]), torch.tensor([0]), n_logits=len(ids))
        # a second, incremental step through the sharded cache
        step, _ = model(torch.tensor([[7]]), torch.tensor([0]), torch.tensor([len(ids)]))
    _report_and_leave(rank, out_q, (logits[0].tolist(), step[0, -1].tolist()))


def test_tp2_logits_match_single_process(tiny_dir):
    ids = [3, 17, 250, 9, 41, 5]
    ref_model = load_model(tiny_dir)
    ref_model.setup_cache(1, 64)
    with torch.inference_mode():
        ref, _ = ref_model(torch.tensor([ids]), torch.tensor([0]), torch.tensor([0]), n_logits=len(ids))
        ref_step, _ = ref_model(torch.tensor([[7]]), torch.tensor([0]), torch.tensor([len(ids)]))
    logits, step = (torch.tensor(x) for x in _run_ranks(_rank, 2, str(tiny_dir), ids))
    assert torch.allclose(logits, ref[0], atol=1e-4)
    assert torch.allclose(step, ref_step[0, -1], atol=1e-4)
    assert torch.equal(logits.argmax(-1), ref[0].argmax(-1))


def _reduce_rank(rank, world, port, out_q):
    from specdec.tp import _all_reduce_hook
    _join(rank, world, port)
    hook = _all_reduce_hook(None, world)
    g = torch.Generator().manual_seed(100 + rank)
    differ = 0
    for dtype in (torch.bfloat16, torch.float32):
        rows = torch.randn(16, 5, 576, generator=g).to(dtype)  # 16 trials of 5 positions (a verify)
        for t in range(16):
            one, five = hook(None, None, rows[t, :1].clone()), hook(None, None, rows[t].clone())
            differ += int(not torch.equal(one[0], five[0]))
    _report_and_leave(rank, out_q, differ)


@pytest.mark.parametrize("world", [2, 3])
def test_a_positions_sum_over_ranks_does_not_depend_on_the_others_in_its_forward(world):
    """A plain step (1 position) and a verify (5) must reduce a position to the same bits, or
    speculation would not be greedy-identical; with 3 ranks a plain all_reduce broke this in
    every trial, bf16 and float32 (gloo splits the buffer by its size)."""
    assert _run_ranks(_reduce_rank, world) == 0


def test_tp_degree_must_divide_heads():
    args = ModelArgs(vocab_size=10, hidden_size=576, intermediate_size=1536, num_layers=1, num_heads=9,
                     num_kv_heads=3, head_dim=64)
    check_tp(args, 3)
    with pytest.raises(ValueError, match="does not divide the model's 9 attention heads"):
        check_tp(args, 2)


def _invariance_rank(rank, world, port, path, out_q):
    _join(rank, world, port)
    model = apply_tp(load_model(path, dtype=torch.bfloat16), rank, world)
    model.setup_cache(2, 64)
    prompt, chain = [3, 17, 250, 9, 41, 5], [7, 11, 13, 17, 19]
    with torch.inference_mode():
        for slot in (0, 1):
            model(torch.tensor([prompt]), torch.tensor([slot]), torch.tensor([0]))
        steps = [model(torch.tensor([[t]]), torch.tensor([0]), torch.tensor([len(prompt) + i]))[0][0, -1]
                 for i, t in enumerate(chain)]  # plain decoding: one position per forward
        verify, _ = model(torch.tensor([chain]), torch.tensor([1]), torch.tensor([len(prompt)]),
                          n_logits=len(chain))  # a verify: all of them in one forward
    _report_and_leave(rank, out_q, sum(int(not torch.equal(s, v)) for s, v in zip(steps, verify[0])))


@pytest.mark.parametrize("world", [2, 3])
def test_a_sharded_bf16_model_gives_a_position_the_same_logits_in_a_verify_as_in_a_step(world, tmp_path):
    """End to end through the sharded model: what makes bf16 speculation greedy-identical at any tp."""
    from tiny_models import make_tiny_checkpoint
    path = make_tiny_checkpoint(tmp_path / "t6", seed=0, layers=2, hidden=96, heads=6, kv_heads=6,
                                intermediate=192)
    assert _run_ranks(_invariance_rank, world, str(path)) == 0


def test_a_rank_shards_on_the_host_before_moving_to_its_device(tiny_dir, monkeypatch):
    """Each rank loads the whole model: on its GPU that would need the unsharded model's memory
    per rank, so the shard is cut on the host and only it moves to the device."""
    import deployments.target as target_mod
    seen = []

    class Sharded:
        def to(self, device):
            seen.append(("to", device))
            return self

    real_load = target_mod.load_model
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(target_mod, "load_model", lambda *a, **kw: seen.append(("load", kw["device"])) or real_load(*a, **kw))
    monkeypatch.setattr(target_mod, "apply_tp", lambda m, r, w: seen.append(("shard", str(m.device))) or Sharded())
    cfg = target_mod.TargetConfig(model=str(tiny_dir), tp=2, device="cuda", max_model_len=64)
    target_mod._load_rank(cfg, 0, 2)
    assert seen == [("load", "cpu"), ("shard", "cpu"), ("to", "cuda:0")]
