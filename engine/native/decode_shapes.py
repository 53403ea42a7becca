"""What a decode step of a model streams, as plain data (no torch): the shapes the native kernels'
measurement (engine/native/autotune.py) times, named by a load plan before any tensor exists
(engine/plan/resolve.py). Dtypes are torch's names for them; `ITEMSIZE` gives their element bytes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The plan's line for --native-kernels off (engine/native/loaded.py, engine/memory/machine.py).
NATIVE_OFF = "off: --native-kernels off (torch's kernels)"

# Element bytes of the dtypes a plan names (torch's names: "bfloat16", not "torch.bfloat16").
ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "int64": 8,
    "float32": 4,
    "int32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


def dtype_name(dtype: object) -> str:
    """`dtype`'s name without the "torch." prefix ("bfloat16"), for a torch dtype or a name alike."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class DecodeShapes:
    """What a decode step multiplies: the matrices [rows, cols] of one layer (experts' gate_up and down,
    attention's q projection) in the activation dtype, and how many experts a token runs.
    `expert_dtype`: the experts' weights under the native kernels where they differ ("" where they do
    not): an f32 model's bf16 slots, which torch's path would hold in f32."""

    dtype: str  # "float32" or "bfloat16"
    mats: tuple[tuple[int, int], ...]
    top_k: int = 1
    expert_dtype: str = ""

    def weight_dtypes(self, native: bool) -> list[str]:
        """The dtype of each of `mats` as the native kernels (`native`) or torch's path hold it."""
        experts = self.expert_dtype if native and self.expert_dtype else self.dtype
        return [experts] * (len(self.mats) - 1) + [self.dtype]

    def layer_bytes(self, native: bool = True) -> int:
        """The weight bytes one decode layer streams: top_k times the expert matrices (all but the last),
        and four attention projections of the last one's size (q, k, v, o: an upper bound for GQA)."""
        sizes = [ITEMSIZE[d] for d in self.weight_dtypes(native)]
        *experts, attention = self.mats
        return (
            self.top_k * sum(s * r * c for s, (r, c) in zip(sizes, experts))
            + sizes[-1] * 4 * attention[0] * attention[1]
        )

    def torch_ops_per_layer(self) -> int:
        """What torch's layer-by-layer path spends a decode layer besides streaming its matmuls, in units of
        one small torch call. Calibrated, not counted: on the mid checkpoint (top-8, f32, an AMD EPYC with
        AVX2, docs/benchmarks/cpu_paths.md) that path took 1.3 ms a layer beyond its matmuls' streaming
        time, about 370 small calls' worth (module calls, norms, rotary, attention, router, and each
        expert's activation, product, scale and sum)."""
        return 50 + 40 * self.top_k


def decode_shapes(
    config: Any,
    dtype: str,
    H: int,
    I: int,
    top_k: int,
    expert_dtype: str | None = None,
) -> DecodeShapes | None:
    """The matrices a decode step of this model streams (an expert's gate_up and down, the q projection)
    and its experts a token, for the native kernels' measurement (`measured`); None for a
    dtype they do not read. `dtype`, `expert_dtype`: torch's names ("float32"); `expert_dtype`: the
    experts' slots under the native kernels where they differ from `dtype` (bf16 slots of an f32 model)."""
    if dtype not in ("float32", "bfloat16"):
        return None
    heads = getattr(config, "num_attention_heads", 0) or 1
    head_dim = getattr(config, "head_dim", None) or H // heads
    return DecodeShapes(
        dtype, ((2 * I, H), (H, I), (heads * head_dim, H)), top_k, expert_dtype or ""
    )
