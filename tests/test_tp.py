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


def _rank(rank, world, port, path, ids, out_q):
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model = apply_tp(load_model(path), rank, world)
    model.setup_cache(1, 64)
    with torch.inference_mode():
        logits, _ = model(torch.tensor([ids]), torch.tensor([0]), torch.tensor([0]), n_logits=len(ids))
        # a second, incremental step through the sharded cache
        step, _ = model(torch.tensor([[7]]), torch.tensor([0]), torch.tensor([len(ids)]))
    if rank == 0:
        out_q.put((logits[0].tolist(), step[0, -1].tolist()))  # plain data outlives this process
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        out_q.close()
        out_q.join_thread()  # the result is in the pipe before the process ends
    os._exit(0)  # done: skip interpreter teardown, where gloo's threads once aborted a rank (SIGABRT,
    # "terminate called without an active exception") after it had finished its work


def test_tp2_logits_match_single_process(tiny_dir):
    ids = [3, 17, 250, 9, 41, 5]
    ref_model = load_model(tiny_dir)
    ref_model.setup_cache(1, 64)
    with torch.inference_mode():
        ref, _ = ref_model(torch.tensor([ids]), torch.tensor([0]), torch.tensor([0]), n_logits=len(ids))
        ref_step, _ = ref_model(torch.tensor([[7]]), torch.tensor([0]), torch.tensor([len(ids)]))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, str(tiny_dir), ids, q)) for r in range(2)]
    for p in procs:
        p.start()
    logits, step = (torch.tensor(x) for x in q.get(timeout=120))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert torch.allclose(logits, ref[0], atol=1e-4)
    assert torch.allclose(step, ref_step[0, -1], atol=1e-4)
    assert torch.equal(logits.argmax(-1), ref[0].argmax(-1))


def test_tp_degree_must_divide_heads():
    args = ModelArgs(vocab_size=10, hidden_size=576, intermediate_size=1536, num_layers=1, num_heads=9,
                     num_kv_heads=3, head_dim=64)
    check_tp(args, 3)
    with pytest.raises(ValueError, match="does not divide the model's 9 attention heads"):
        check_tp(args, 2)
