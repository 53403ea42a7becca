"""Safetensors headers read without torch: each tensor's file, byte range, dtype tag and shape.

A file is 8 bytes of header length, the header (JSON) and the data. We parse the header ourselves
(engine/weights/checkpoint.py turns these entries into `TensorLocation`s with torch dtypes): the disk
tier needs each tensor's absolute byte range for uncached reads, a truncated file must be caught at load
with a clear message, and a load plan (engine/weights/header_survey.py) is decided from names and shapes
alone, with torch not imported."""

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
class HeaderEntry:
    """One tensor as its file's header describes it: `dtype`, torch's name for it (DTYPE_NAMES)."""

    name: str
    path: Path
    offset: int  # absolute, in `path`
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


def read_entries(path: Path) -> dict[str, HeaderEntry]:
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
    out: dict[str, HeaderEntry] = {}
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
        out[name] = HeaderEntry(name, path, data_start + begin, end - begin, dtype, shape)
    return out


def index_entries(model_dir: Path) -> dict[str, HeaderEntry]:
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
    out: dict[str, HeaderEntry] = {}
    for f in files:
        out.update(read_entries(f))
    return out
