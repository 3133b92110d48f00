"""The wire format of the round's data classes: tensors cross processes as numpy arrays.

Ray serializes a torch tensor through its generic pickling path, which costs about 1 ms per
tensor on the project's CPU machine (measured: an echo hop carrying a `SpecBatch` with four small
tensors took 14 ms instead of 7 ms; the same fields as numpy arrays 8 ms), and a round sends a
dozen of them. A numpy array rides Ray's pickle-5 out-of-band buffers instead. `Wire` makes a
dataclass pickle every tensor it holds (also inside lists and tuples) as a numpy array
and rebuilds the tensor on arrival, so the engine keeps working with tensors on both sides and
nothing else changes. bfloat16, which numpy lacks, travels as its int16 bit pattern.
"""
from __future__ import annotations

import numpy as np
import torch

_BITS = {torch.bfloat16: torch.int16}  # dtypes numpy lacks, sent as same-width integers


class _Array:
    """A tensor on the wire: its bytes as a numpy array and its torch dtype."""

    __slots__ = ("array", "dtype")

    def __init__(self, t: torch.Tensor):
        t = t.detach().cpu()
        self.dtype = t.dtype
        self.array = (t.view(_BITS[t.dtype]) if t.dtype in _BITS else t).contiguous().numpy()

    def __getstate__(self):
        return self.array, str(self.dtype).removeprefix("torch.")

    def __setstate__(self, state):
        self.array, name = state
        self.dtype = getattr(torch, name)

    def tensor(self) -> torch.Tensor:
        a = self.array if self.array.flags.writeable else self.array.copy()  # Ray's buffers are read-only
        t = torch.from_numpy(a)
        return t.view(self.dtype) if self.dtype in _BITS else t


def _encode(v):
    if isinstance(v, torch.Tensor):
        return _Array(v)
    if isinstance(v, (list, tuple)) and any(isinstance(x, (torch.Tensor, list, tuple)) for x in v):
        return type(v)(_encode(x) for x in v)
    return v


def _decode(v):
    if isinstance(v, _Array):
        return v.tensor()
    if isinstance(v, (list, tuple)) and any(isinstance(x, (_Array, list, tuple)) for x in v):
        return type(v)(_decode(x) for x in v)
    return v


class Wire:
    """Mixin for the dataclasses that cross processes: tensors pickle as numpy arrays."""

    def __getstate__(self):
        return {k: _encode(v) for k, v in self.__dict__.items()}

    def __setstate__(self, state):
        self.__dict__.update({k: _decode(v) for k, v in state.items()})
