"""Safetensors headers read without torch: each tensor's file, byte range, dtype and shape
(`TensorLocation`), so expert weights can be fetched by file offset.

A file is 8 bytes of header length, the header (JSON) and the data. We parse the header ourselves: the
disk tier needs each tensor's absolute byte range for uncached reads, a truncated file must be caught at
load with a clear message, and a load plan (engine/plan/resolve.py) is decided from names, dtypes and
shapes alone, with torch not imported. Dtypes are torch's names for them ("bfloat16"); where tensors are
made, engine/weights/checkpoint.py `torch_dtype` turns a name into torch's dtype."""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from engine.errors import CheckpointError

# safetensors dtype tags -> torch's names for the dtypes
DTYPE_NAMES: dict[str, str] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",  # FP8 block-quantized checkpoints (DeepSeek-V3, MiniMax-M2, Qwen *-FP8)
    "F8_E5M2": "float8_e5m2",
}

_MAX_HEADER = 100 * 1024 * 1024  # same cap as the safetensors library


@dataclass(frozen=True)
class TensorLocation:
    """Where one tensor's bytes live: absolute offset in `path`, row-major; `dtype`, torch's name for
    it (DTYPE_NAMES)."""

    name: str
    path: Path
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]

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
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise CheckpointError(
                    f"{path}: truncated safetensors file ({size} bytes, no header)"
                )
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > _MAX_HEADER or 8 + header_len > size:
                raise CheckpointError(
                    f"{path}: corrupt or truncated safetensors header (claims {header_len} bytes, file has {size})"
                )
            header = json.loads(f.read(header_len))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(f"{path}: corrupt safetensors header (not valid JSON)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")

    data_start = 8 + header_len
    path = Path(path)  # one object shared by the file's tensors (a shard holds thousands)
    out: dict[str, TensorLocation] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPE_NAMES[info["dtype"]]
            begin, end = (int(x) for x in info["data_offsets"])
            shape = tuple(int(s) for s in info["shape"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(
                f"{path}: corrupt safetensors entry for tensor {name!r}"
            ) from None
        if data_start + end > size:
            raise CheckpointError(
                f"{path}: truncated safetensors file: tensor {name} ends at byte {data_start + end} but the file has {size} bytes"
            )
        out[name] = TensorLocation(name, path, data_start + begin, end - begin, dtype, shape)
    return out


def index_checkpoint(model_dir: Path) -> dict[str, TensorLocation]:
    """Map every tensor name in a HF checkpoint directory to its location.

    Accepts a single `model.safetensors`, shards listed by `model.safetensors.index.json`,
    or (as a fallback) every `*.safetensors` file in the directory.
    """
    model_dir = Path(model_dir)
    index_file = model_dir / "model.safetensors.index.json"
    if index_file.exists():
        try:
            weight_map: dict[str, str] = json.loads(index_file.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise CheckpointError(
                f"{index_file}: corrupt index (expected a JSON object with 'weight_map')"
            ) from None
        files = sorted(model_dir / f for f in set(weight_map.values()))
        for f in files:
            if not f.exists():
                raise CheckpointError(f"{f}: missing shard listed in {index_file.name}")
    else:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(
                f"{model_dir}: no *.safetensors weights found (expected model.safetensors or an index)"
            )
    out: dict[str, TensorLocation] = {}
    for f in files:
        out.update(read_header(f))
    return out
