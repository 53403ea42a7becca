"""The dense linears a load quantizes (`--dense-quant int8`) or narrows (bf16 weights read by the native
kernels), by name: what engine/native/quant_linear.py acts on in the built model and what a load plan
counts from the checkpoint's headers (engine/weights/header_survey.py). Plain data: no torch."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from engine.native.decode_shapes import ITEMSIZE

# The nn.Linear names --dense-quant int8 quantizes: attention projections, SwiGLU MLPs (dense layers' and
# shared experts'), and the output head. Routers (`gate`, `shared_expert_gate`) and routed experts keep
# their weights: the router's kernels and the expert formats are their own (engine/experts/formats/quant.py).
QUANTIZED_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FLOAT_NAMES = ("float32", "bfloat16", "float16")  # the weight dtypes quantize_dense quantizes


def narrows_dense(bf16_dense: bool, device_type: str, native: bool) -> bool:
    """Whether a load narrows an f32 model's bf16-valued dense weights (quant_linear.narrow_dense):
    EngineConfig.bf16_dense, on the CPU, where the native kernels run (`native`: the plan's kernel build
    is not None), which read bf16 weights for f32 rows. The plan counts the bytes by this rule and the
    load narrows by it, both from the plan's kernel answer."""
    return bf16_dense and device_type == "cpu" and native


@dataclass(frozen=True)
class DenseLinear:
    """A dense linear's weight (`dense_linears`) as a load plan counts it from the checkpoint's headers
    (engine/weights/header_survey.py `memory_name`: in-memory, but for the sparse block's name as on disk),
    its size and rows, and whether another module holds it too (lm_head tied to the input embedding)."""

    name: str
    numel: int
    rows: int
    shared: bool


def dense_bytes_saved(
    linears: Iterable[DenseLinear],
    dtype: str,
    checkpoint_dtypes: Mapping[str, str],
    dense_quant: str,
    narrow: bool,
) -> int:
    """Bytes the load's `quantize_dense` (per `dense_quant`) and, where `narrow`, `narrow_dense` take off
    the dense linears (`dense_linears`, as the checkpoint's headers name them: engine/weights/header_survey.py)
    held in the compute `dtype` (torch's name for it), for the memory plan; `checkpoint_dtypes`: the
    checkpoint's tensor dtypes by tensor name (`narrow`: narrows_dense's answer). narrow_dense narrows an f32
    weight whose values are bf16, which a bf16 checkpoint tensor's are; a weight whose name the checkpoint
    does not hold as it is (a wrapper's prefix) saves nothing. A tied weight saves nothing, and int8 codes
    beside it add their bytes (the table keeps its float copy)."""
    if dtype not in FLOAT_NAMES:
        return 0
    saved = 0
    for w in linears:
        full = w.numel * ITEMSIZE[dtype]
        if dense_quant == "int8":
            codes = w.numel + 2 * w.rows  # int8 a weight, an fp16 scale a row
            saved += -codes if w.shared else full - codes
        elif (
            narrow
            and dtype == "float32"
            and not w.shared
            and checkpoint_dtypes.get(w.name) == "bfloat16"
        ):
            saved += full // 2
    return saved
