"""Which native expert path takes slots of a format, decided by dtype names from the format alone: no
kernels loaded (what a load plan names; engine/experts/compute/native_moe.py and native_mxfp4.py run it)."""

from __future__ import annotations

from engine.experts.formats.slot_layout import (
    GptOssViews,
    GroupQuantLayout,
    Mxfp4Layout,
    PlainLayout,
    SlotLayout,
    SwiGLUViews,
)

FLOATS = ("float32", "bfloat16")
MXFP4_LINE = (
    "native MXFP4 (FP4 codes decoded in registers, f32 sums)"  # the plan's name for the path
)


def fused_weight_dtype(fmt: SlotLayout, hidden: int, intermediate: int) -> str | None:
    """The weights NativeMoe reads slots of `fmt` as, by name ("float32", "bfloat16", "int8"; "int4":
    int4 groups), or None where it does not take them (then torch runs the experts); what a load plan
    names before any kernel is loaded."""
    if not isinstance(fmt.kernel, SwiGLUViews):
        return None
    if isinstance(fmt, PlainLayout) and fmt.slot_dtype in FLOATS:
        return fmt.slot_dtype
    if (
        isinstance(fmt, GroupQuantLayout)
        and fmt.bits == 8
        and all(fmt.group_of(s[1]) == s[1] for _, s in fmt.kernel.views)
    ):
        return "int8"
    if (
        isinstance(fmt, GroupQuantLayout)
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


def mxfp4_applies(fmt: Mxfp4Layout, hidden: int, intermediate: int) -> bool:
    """Whether NativeMxfp4Moe takes slots of `fmt` (else torch runs them)."""
    return not (
        not isinstance(fmt.kernel, GptOssViews)
        or fmt.compute_dtype not in FLOATS
        or fmt.bias_dtype not in FLOATS
        or hidden % 32
        or intermediate % 32
    )


def native_experts_line(fmt: SlotLayout, hidden: int, intermediate: int) -> str | None:
    """The plan's name for the native path `native_experts` gives slots of `fmt` where the native kernels
    run, or None where torch runs them: decided from the format alone, no kernels loaded."""
    if isinstance(fmt, Mxfp4Layout):
        return MXFP4_LINE if mxfp4_applies(fmt, hidden, intermediate) else None
    weight_dtype = fused_weight_dtype(fmt, hidden, intermediate)
    return swiglu_line(weight_dtype) if weight_dtype is not None else None
