"""One tensor of a checkpoint read through the page cache, and torch's dtype for a header's dtype name:
where tensors are made from the headers' locations (engine/weights/safetensors_index.py, read without
torch)."""

from __future__ import annotations

import torch

from engine.errors import CheckpointError
from engine.weights.safetensors_index import TensorLocation


def torch_dtype(name: str) -> torch.dtype:
    """torch's dtype for its name ("bfloat16"), as the headers and a load plan give dtypes."""
    return getattr(torch, name)


def read_tensor(loc: TensorLocation) -> torch.Tensor:
    """Read one tensor through the page cache (used for the small, non-expert weights)."""
    with open(loc.path, "rb") as f:
        f.seek(loc.offset)
        buf = bytearray(f.read(loc.nbytes))
    if len(buf) != loc.nbytes:
        raise CheckpointError(f"{loc.path}: truncated while reading tensor {loc.name}")
    dtype = torch_dtype(loc.dtype)
    if loc.nbytes == 0:
        return torch.empty(loc.shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype).reshape(loc.shape)
