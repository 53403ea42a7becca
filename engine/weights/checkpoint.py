"""Where a checkpoint's tensors are, with their torch dtypes, so expert weights can be fetched by file
offset: the headers (engine/weights/safetensors_index.py, which parses them without torch) as
`TensorLocation`s, and one tensor read through the page cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.errors import CheckpointError
from engine.weights.safetensors_index import DTYPE_NAMES, HeaderEntry, index_entries, read_entries

# torch's dtypes by the names the headers' entries give them (safetensors_index.DTYPE_NAMES)
_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES.values()}


@dataclass(frozen=True)
class TensorLocation:
    """Where one tensor's bytes live: absolute offset in `path`, row-major."""

    name: str
    path: Path
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @staticmethod
    def of(e: HeaderEntry) -> TensorLocation:
        return TensorLocation(e.name, e.path, e.offset, e.nbytes, _DTYPES[e.dtype], e.shape)

    def slice_first_dim(self, index: int) -> TensorLocation:
        """The location of `tensor[index]`, which is contiguous because storage is row-major."""
        if not self.shape or not 0 <= index < self.shape[0]:
            raise CheckpointError(
                f"{self.path}: tensor {self.name} has no row {index} (shape {self.shape})"
            )
        row = self.nbytes // self.shape[0]
        return TensorLocation(
            f"{self.name}[{index}]",
            self.path,
            self.offset + index * row,
            row,
            self.dtype,
            self.shape[1:],
        )


def read_header(path: Path) -> dict[str, TensorLocation]:
    """Parse and validate one safetensors file; raise CheckpointError naming the file on any problem."""
    return {n: TensorLocation.of(e) for n, e in read_entries(path).items()}


def index_checkpoint(model_dir: Path) -> dict[str, TensorLocation]:
    """Map every tensor name in a HF checkpoint directory to its location.

    Accepts a single `model.safetensors`, shards listed by `model.safetensors.index.json`,
    or (as a fallback) every `*.safetensors` file in the directory.
    """
    return {n: TensorLocation.of(e) for n, e in index_entries(model_dir).items()}


def read_tensor(loc: TensorLocation) -> torch.Tensor:
    """Read one tensor through the page cache (used for the small, non-expert weights)."""
    with open(loc.path, "rb") as f:
        f.seek(loc.offset)
        buf = bytearray(f.read(loc.nbytes))
    if len(buf) != loc.nbytes:
        raise CheckpointError(f"{loc.path}: truncated while reading tensor {loc.name}")
    if loc.nbytes == 0:
        return torch.empty(loc.shape, dtype=loc.dtype)
    return torch.frombuffer(buf, dtype=loc.dtype).reshape(loc.shape)
