"""Whether the input embedding's table stays in the checkpoint, read a row per token (engine/weights/
disk_embedding.py `DiskEmbedding`), and what it then holds in memory: decided from the headers, with
torch not imported (a load plan's survey, engine/plan/survey.py)."""

from __future__ import annotations

from transformers import PretrainedConfig

from engine.weights.arch import ArchSpec, disk_names
from engine.weights.model_config import device_type
from engine.weights.safetensors_index import TensorLocation

CACHE_BYTES = 16 << 20  # rows kept in RAM, most recently used first (4096 rows of 4 KiB)


def disk_embedding_source(
    name: str | None,
    config: PretrainedConfig,
    spec: ArchSpec,
    tensors: dict[str, TensorLocation],
    dtype: str,
    device: str,
    enabled: bool = True,
) -> TensorLocation | None:
    """Where the input embedding's rows are read from when it stays on disk (`enabled`:
    EngineConfig.embedding_on_disk), else None (it is copied into memory); `name`: the input
    embedding's in-memory name (None: it has none); `dtype`, `device`: the compute dtype's and device's
    names."""
    if not enabled or device_type(device) != "cpu" or getattr(config, "tie_word_embeddings", False):
        return None
    if name is None:
        return None
    loc = next((tensors[n] for n in disk_names(spec, name) if n in tensors), None)
    if loc is None or loc.dtype != dtype or f"{loc.name}_scale_inv" in tensors:
        return None
    return loc


def resident_bytes(loc: TensorLocation) -> int:
    """What a DiskEmbedding over `loc` holds in memory at most: its row cache."""
    return min(loc.nbytes, CACHE_BYTES)
