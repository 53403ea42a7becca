"""Which native expert path takes slots of a format, decided by dtype names from the format alone: no
kernels loaded (what a load plan names; engine/experts/compute/native_moe.py and native_mxfp4.py run it)."""

from __future__ import annotations

from engine.experts.formats.expert_kernels import GptOssKernel, SwiGLUKernel
from engine.experts.formats.native_quant import Mxfp4GptOssFormat
from engine.experts.formats.quant import ExpertFormat, GroupQuantFormat, PlainFormat

FLOATS = ("float32", "bfloat16")
MXFP4_LINE = (
    "native MXFP4 (FP4 codes decoded in registers, f32 sums)"  # the plan's name for the path
)


def fused_weight_dtype(fmt: ExpertFormat, hidden: int, intermediate: int) -> str | None:
    """The weights NativeMoe reads slots of `fmt` as, by name ("float32", "bfloat16", "int8"; "int4":
    int4 groups), or None where it does not take them (then torch runs the experts); what a load plan
    names before any kernel is loaded."""
    if type(fmt.kernel) is not SwiGLUKernel:
        return None
    if isinstance(fmt, PlainFormat) and fmt.slot_dtype in FLOATS:
        return fmt.slot_dtype
    if (
        isinstance(fmt, GroupQuantFormat)
        and fmt.bits == 8
        and all(fmt.group_of(s[1]) == s[1] for _, s in fmt.kernel.views)
    ):
        return "int8"
    if (
        isinstance(fmt, GroupQuantFormat)
        and fmt.bits == 4
        and fmt.compute_dtype == "bfloat16"
        and all(fmt.group_of(s[1]) == 64 for _, s in fmt.kernel.views)
        and hidden % 64 == 0
        and intermediate % 64 == 0
    ):
        return "int4"
    return None


def swiglu_line(weight_dtype: str) -> str:
    """The plan's name for NativeMoe reading `weight_dtype` weights (fused_weight_dtype)."""
    return f"native SwiGLU, one call a layer ({weight_dtype} weights)"


def mxfp4_applies(fmt: Mxfp4GptOssFormat, hidden: int, intermediate: int) -> bool:
    """Whether NativeMxfp4Moe takes slots of `fmt` (else torch runs them)."""
    return not (
        not isinstance(fmt.kernel, GptOssKernel)
        or fmt.compute_dtype not in FLOATS
        or fmt.bias_dtype not in FLOATS
        or hidden % 32
        or intermediate % 32
    )


def native_experts_line(fmt: ExpertFormat, hidden: int, intermediate: int) -> str | None:
    """The plan's name for the native path `native_experts` gives slots of `fmt` where the native kernels
    run, or None where torch runs them: decided from the format alone, no kernels loaded."""
    if isinstance(fmt, Mxfp4GptOssFormat):
        return MXFP4_LINE if mxfp4_applies(fmt, hidden, intermediate) else None
    weight_dtype = fused_weight_dtype(fmt, hidden, intermediate)
    return swiglu_line(weight_dtype) if weight_dtype is not None else None
