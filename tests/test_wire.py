"""The round's data classes cross processes with their tensors as numpy arrays (specdec/wire.py)."""
from __future__ import annotations

import pickle

import pytest
import torch
import ray.cloudpickle as cloudpickle

from specdec.metadata import DraftOutput, SpecBatch, VerifyOutput
from specdec.rejection_sampler import DraftProbs


def _batch(dtype=torch.float32) -> SpecBatch:
    B, K = 2, 3
    return SpecBatch(seq_ids=[1, 2], offsets=[10, 0], new_tokens=[[5], [1, 2, 3]], num_draft=[K, 0],
                     temperature=torch.tensor([0.0, 0.7]), top_k=torch.tensor([0, 5]), top_p=torch.tensor([1.0, 0.9]),
                     uniforms=torch.rand(B, 3, K + 1, dtype=torch.float64), release=[7],
                     features=[(9, torch.randn(2, 8).to(dtype)), None], trace_context={"traceparent": "x"})


@pytest.mark.parametrize("dumps", [pickle.dumps, cloudpickle.dumps], ids=["pickle", "cloudpickle"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_keeps_every_field(dumps, dtype):
    b = _batch(dtype)
    d = DraftOutput(torch.randint(0, 50, (2, 3)), [3, 0], DraftProbs(torch.randint(0, 50, (2, 3, 4)), torch.rand(2, 3, 4)),
                    [1], 0.01, 3)
    v = VerifyOutput([[1, 2], []], [1, 0], [1], 0.1, [torch.randn(2, 8).to(dtype), None], [9, 0])
    for obj in (b, d, v):
        blob = dumps(obj)
        assert b"torch._utils" not in blob and b"_rebuild_tensor" not in blob  # no tensor pickled as such
        back = pickle.loads(blob)
        assert type(back) is type(obj)
        for name, want in vars(obj).items():
            got = getattr(back, name)
            if isinstance(want, torch.Tensor):
                assert got.dtype == want.dtype and torch.equal(got, want)
            elif isinstance(want, DraftProbs):
                assert torch.equal(got.ids, want.ids) and torch.equal(got.vals, want.vals)
            elif name in ("features", "hidden"):
                for w, g in zip(want, got):
                    wt, gt = (w[1], g[1]) if isinstance(w, tuple) else (w, g)
                    assert (wt is None and gt is None) or (gt.dtype == wt.dtype and torch.equal(gt, wt))
                    if isinstance(w, tuple):
                        assert g[0] == w[0] and isinstance(g, tuple)
            else:
                assert got == want, name


def test_arrived_tensors_are_writable():
    """Tensors rebuilt from read-only buffers (Ray's) are copies the receiver may write to."""
    import numpy as np
    from specdec.wire import _Array
    a = _Array(torch.arange(4))
    a.array = np.frombuffer(a.array.tobytes(), dtype=a.array.dtype)  # read-only, like Ray's buffers
    t = a.tensor()
    t[0] = 9
    assert t.tolist() == [9, 1, 2, 3]


def test_a_verify_output_from_a_replica_that_predates_refused_reads_as_none():
    """During a rolling update an older Target replica sends VerifyOutputs without `refused`: they
    read as None (the batcher treats None as no row refused), never as a missing attribute."""
    state = VerifyOutput([[1]], [1]).__getstate__()
    del state["refused"]
    old = VerifyOutput.__new__(VerifyOutput)
    old.__setstate__(state)
    assert old.refused is None
