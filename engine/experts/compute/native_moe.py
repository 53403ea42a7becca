"""One decode token through a layer's resident SwiGLU experts in one native call.

Why: at one token per step the experts of a layer are 8 or so matrix-vector products each, and
on the CPU each expert through torch costs five calls (two projections, the activation, the
product, the scaling) plus the Python between them: 40-50 us an expert on small models, more
than its arithmetic. engine/native/cpu_gemv.c's `moe_swiglu` runs them all, summed in the order
given, from the slots' own memory (no copy, no per-expert tensor).

Which slots it reads: float slots (f32 or bf16: the compute dtype, or bf16 slots of an f32 model,
widened as they are read), whole-row int8 slots and int4
slots in groups of 64 with a bf16 compute dtype (`moe_q4_rows`: nibbles unpacked in registers, int8
dot products), SwiGLU only. gpt-oss's MXFP4 slots take engine/experts/compute/native_mxfp4.py's kernel; everything
else (Llama 4, FP8 blocks, gpt-oss in floats) keeps the torch path.
"""

from __future__ import annotations

import torch

from engine.experts.formats.native_path import fused_weight_dtype, swiglu_line
from engine.experts.formats.quant import ExpertFormat, PlainFormat
from engine.native.kernels import W_CODES, NativeKernels
from engine.native.loaded import native
from engine.native.row_kernels import native_rows_allowed

# gate_up, gate_up scales, down, down scales (0: none); int4 slots add gate_up zeros and down zeros
SlotPointers = tuple[int, ...]
INT4 = torch.uint8  # NativeMoe.weight_dtype of int4 slots (two codes a byte)
# fused_weight_dtype's names -> the weights NativeMoe reads
WEIGHT_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "int4": INT4,
}
W_Q4 = 3  # cpu_gemv.h's code for them


class NativeMoe:
    def __init__(
        self,
        kernels: NativeKernels,
        fmt: ExpertFormat,
        weight_dtype: torch.dtype,
        hidden: int,
        intermediate: int,
    ) -> None:
        self.kernels, self.fmt, self.weight_dtype = kernels, fmt, weight_dtype
        self.hidden, self.intermediate = hidden, intermediate
        self.quantized = weight_dtype in (torch.int8, INT4)  # slots carry row or group scales
        self.int4 = weight_dtype == INT4
        # The activation dtype float slots serve: the format's compute dtype (bf16 slots of an f32 model
        # take f32 rows and widen each weight as they read it).
        self.float_x = (
            getattr(torch, fmt.compute_dtype) if isinstance(fmt, PlainFormat) else weight_dtype
        )

    @property
    def wtype(self) -> int:
        """decode_layer.c's expert_wtype code of these slots."""
        return W_Q4 if self.int4 else W_CODES[self.weight_dtype]

    @classmethod
    def for_format(cls, fmt: ExpertFormat, hidden: int, intermediate: int) -> NativeMoe | None:
        """The fused path for slots of `fmt`, or None where it does not apply (then torch runs the experts)."""
        weight_dtype = fused_weight_dtype(fmt, hidden, intermediate)
        kernels = native()
        if weight_dtype is None or kernels is None:
            return None
        return cls(kernels, fmt, WEIGHT_DTYPES[weight_dtype], hidden, intermediate)

    def describe(self) -> str:
        """The plan's name for this path."""
        return swiglu_line("int4" if self.int4 else str(self.weight_dtype)[6:])

    def accepts(self, x: torch.Tensor) -> bool:
        """Whether rows x run here: contiguous CPU rows of a step whose rows take the native kernels
        (decode and verification rows: engine/native/row_kernels.py), however many (`rows` takes 16 at a
        time). Float slots take rows in their format's compute dtype (the reference computes in it); int8
        slots take either."""
        return (
            x.device.type == "cpu"
            and x.shape[0] >= 1
            and x.is_contiguous()
            and native_rows_allowed()
            and (
                (not self.quantized and x.dtype == self.float_x)
                or (self.int4 and x.dtype == torch.bfloat16)
                or (not self.int4 and self.quantized and x.dtype in (torch.float32, torch.bfloat16))
            )
        )

    def pointers(self, views: list) -> SlotPointers:
        """Addresses of one slot's weights, from its views (engine/experts/formats/quant.py); stable while the slot lives."""
        if self.int4:
            (p_gu, s_gu, z_gu), (p_d, s_d, z_d) = views
            return tuple(
                t.data_ptr() for t in (p_gu, s_gu, p_d, s_d, z_gu, z_d)
            )  # gate_up, scales, down, scales, zeros
        if self.quantized:
            (q_gu, s_gu), (q_d, s_d) = views
            return q_gu.data_ptr(), s_gu.data_ptr(), q_d.data_ptr(), s_d.data_ptr()
        gate_up, down = views
        return gate_up.data_ptr(), 0, down.data_ptr(), 0

    def rows(self, x: torch.Tensor, slot: SlotPointers) -> torch.Tensor:
        """Rows x [n, H] (accepted) through the one expert at `slot`, unscaled -> [n, H], any n in one
        call (each row computes as it would alone)."""
        n = x.shape[0]
        if self.int4:
            return self.kernels.moe_q4(
                x, self.hidden, self.intermediate, [slot], [0] * n, [1.0] * n
            )
        return self.kernels.expert_rows(x, self.weight_dtype, self.hidden, self.intermediate, slot)

    def rows_routed(
        self, x: torch.Tensor, slots: list[SlotPointers], ids: list[int], weights: list[float]
    ) -> torch.Tensor:
        """Rows x [R, H] (accepted) through k experts each: row r takes slots[ids[r * k + j]], scaled
        by weights[r * k + j], summed in ascending slot index -> [R, H] (each row as it computes alone)."""
        if self.int4:
            return self.kernels.moe_q4(x, self.hidden, self.intermediate, slots, ids, weights)
        return self.kernels.moe_rows(
            x,
            self.weight_dtype,
            self.hidden,
            intermediate=self.intermediate,
            slots=slots,
            ids=ids,
            weights=weights,
        )

    def run(self, x: torch.Tensor, slots: list[SlotPointers], weights: list[float]) -> torch.Tensor:
        """x [1, H] through the experts in `slots`, scaled by `weights`, summed in that order -> [1, H]."""
        if self.int4:
            return self.kernels.moe_q4(
                x, self.hidden, self.intermediate, slots, list(range(len(slots))), weights
            )
        return self.kernels.moe_swiglu(
            x,
            self.weight_dtype,
            self.hidden,
            intermediate=self.intermediate,
            gate_up=[p[0] for p in slots],
            down=[p[2] for p in slots],
            weights=weights,
            gate_up_scale=[p[1] for p in slots] if self.quantized else None,
            down_scale=[p[3] for p in slots] if self.quantized else None,
        )
