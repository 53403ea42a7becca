"""Quantized experts, built once into a sidecar safetensors file and read from there.

`--expert-quant int8|int4` is applied when the slow tier is built: every routed expert is read
from the checkpoint, encoded into its quantized slot row (engine/experts/formats/quant.py) and written
to a sidecar file, one U8 tensor `layers.{l}.experts` [E, slot_bytes] per MoE layer, so each
expert is one contiguous run of bytes. Both slow tiers then read the sidecar instead of the
checkpoint, so every transfer, slot and byte counter sees the quantized size.

The sidecar is named by a hash of the checkpoint files (names, sizes, mtimes), the format and
its group size, so a changed checkpoint or setting builds a new one and the next start with
the same ones reuses it. It lives in a cache directory, not in the model directory: a stray
*.safetensors file there would be taken for part of the checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import torch
from tqdm.auto import tqdm

from engine import env
from engine.errors import ConfigError
from engine.experts.formats.checkpoint_experts import PackedShape
from engine.experts.formats.quant import GroupQuantFormat, PlainFormat
from engine.experts.formats.slot_layout import GroupQuantLayout
from engine.weights.checkpoint import read_tensor
from engine.weights.expert_layout import ExpertLocator
from engine.weights.safetensors_index import TensorLocation, read_header

SIDECAR_VERSION = 1  # bump when the encoding changes, so stale sidecars are never reused


class SidecarLocator:
    """ExpertLocator's interface over a sidecar file: one U8 segment per expert."""

    def __init__(
        self, path: Path, moe_layers: list[int], num_experts: int, slot_bytes: int
    ) -> None:
        self.path, self.num_experts, self.shape = path, num_experts, PackedShape(slot_bytes)
        tensors = read_header(path)
        self._segments = {
            (l, e): [tensors[f"layers.{l}.experts"].slice_first_dim(e)]
            for l in moe_layers
            for e in range(num_experts)
        }

    def segments(self, layer: int, expert: int) -> list[TensorLocation]:
        return self._segments[(layer, expert)]

    def nbytes_on_disk(self, layer: int, expert: int) -> int:
        return self._segments[(layer, expert)][0].nbytes


def default_cache_dir() -> Path:
    return env.xdg_cache_root() / "experts"


def sidecar_path(
    locator: ExpertLocator, fmt: GroupQuantLayout, moe_layers: list[int], cache_dir: Path
) -> Path:
    files = sorted(
        {
            s.path
            for l in moe_layers
            for e in range(locator.num_experts)
            for s in locator.segments(l, e)
        }
    )
    h = hashlib.sha256(
        json.dumps(
            [
                SIDECAR_VERSION,
                fmt.name,
                fmt.group,
                fmt.kernel.views,
                moe_layers,
                locator.num_experts,
            ]
        ).encode()
    )
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    return (
        cache_dir
        / f"{files[0].parent.name}-{fmt.name}-g{fmt.group}-{h.hexdigest()[:16]}.safetensors"
    )


def quantized_locator(
    locator: ExpertLocator,
    fmt: GroupQuantFormat,
    moe_layers: list[int],
    cache_dir: str | Path | None,
) -> SidecarLocator:
    """The sidecar for these experts in this format, built now if no valid one exists."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"{cache}: cannot create the quantized-expert cache directory ({e.strerror})"
        ) from None
    path = sidecar_path(locator, fmt, moe_layers, cache)
    if not path.exists():
        _build(locator, fmt, moe_layers, path)
    return SidecarLocator(path, moe_layers, locator.num_experts, fmt.slot_numel)


def _build(
    locator: ExpertLocator, fmt: GroupQuantFormat, moe_layers: list[int], path: Path
) -> None:
    """Stream the sidecar to disk layer by layer (never all experts in memory), then rename into place."""
    E, row = locator.num_experts, fmt.slot_numel
    header: dict[str, dict] = {
        "__metadata__": {
            "format": fmt.name,
            "group": str(fmt.group),
            "version": str(SIDECAR_VERSION),
        }
    }
    for i, l in enumerate(moe_layers):
        header[f"layers.{l}.experts"] = {
            "dtype": "U8",
            "shape": [E, row],
            "data_offsets": [i * E * row, (i + 1) * E * row],
        }
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)  # safetensors pads the header to 8 bytes
    unpack = PlainFormat(
        fmt.kernel, "float32"
    )  # splits a packed float buffer into the kernel's weights
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)) + blob)
            with tqdm(
                total=len(moe_layers) * E,
                desc=f"quantizing experts ({fmt.name})",
                unit="expert",
                leave=False,
            ) as bar:
                for l in moe_layers:
                    for e in range(E):
                        flat = torch.cat(
                            [
                                read_tensor(s).reshape(-1).to(torch.float32)
                                for s in locator.segments(l, e)
                            ]
                        )
                        f.write(fmt.encode(unpack.views(flat)).numpy().tobytes())
                        bar.update()
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ConfigError(
            f"{path}: cannot write the quantized-expert cache ({e.strerror})"
        ) from None
