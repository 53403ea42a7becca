"""gpt-oss's MXFP4 experts through the native kernel (engine/native/mxfp4_moe.c), from the slot's own bytes.

The slot keeps the checkpoint's blocks and scales (engine/experts/formats/native_quant.py `Mxfp4GptOssFormat`);
the kernel decodes each FP4 code in registers and multiplies in f32, where the torch path dequantizes
the whole expert to the compute dtype and runs a bf16 matmul. It is used for every CPU row the native
kernels take (decode and verification rows), for a resident slot, a freshly fetched one and a CPU
worker's host buffer alike, so a token's result does not depend on where its experts were. Prompt
rows, other devices and builds without the native kernels keep the torch path.
"""

from __future__ import annotations

import torch

from engine.experts.compute.native_moe import NativeMoe, SlotPointers
from engine.experts.formats.expert_kernels import GptOssKernel
from engine.experts.formats.native_path import MXFP4_LINE, mxfp4_applies
from engine.experts.formats.native_quant import Mxfp4GptOssFormat
from engine.experts.formats.quant import ExpertFormat
from engine.native.kernels import MAX_ROWS, NativeKernels
from engine.native.loaded import native
from engine.native.row_kernels import native_rows_allowed


class NativeMxfp4Moe(NativeMoe):
    """NativeMoe's interface (pointers, rows, run) for MXFP4 gpt-oss slots."""

    def __init__(
        self, kernels: NativeKernels, fmt: Mxfp4GptOssFormat, hidden: int, intermediate: int
    ) -> None:
        super().__init__(kernels, fmt, torch.uint8, hidden, intermediate)
        kernel = fmt.kernel
        assert isinstance(kernel, GptOssKernel)
        self.alpha, self.limit = kernel.alpha, kernel.limit
        self.bias_dtype = getattr(torch, fmt.bias_dtype)
        self.compute_dtype = getattr(torch, fmt.compute_dtype)

    @property
    def wtype(self) -> int:
        raise NotImplementedError("MXFP4 experts have no decode_layer.c weight code")

    @classmethod
    def for_mxfp4(
        cls, fmt: Mxfp4GptOssFormat, hidden: int, intermediate: int
    ) -> NativeMxfp4Moe | None:
        """The native path for `fmt`'s slots, or None where it does not apply (then torch runs them)."""
        kernels = native()
        if not mxfp4_applies(fmt, hidden, intermediate) or kernels is None:
            return None
        return cls(kernels, fmt, hidden, intermediate)

    def describe(self) -> str:
        return MXFP4_LINE

    def accepts(self, x: torch.Tensor) -> bool:
        """Contiguous CPU rows in the compute dtype of a step whose rows take the native kernels."""
        return (
            x.device.type == "cpu"
            and x.shape[0] >= 1
            and x.is_contiguous()
            and x.dtype == self.compute_dtype
            and native_rows_allowed()
        )

    def pointers(self, views: list) -> SlotPointers:
        """gate_up blocks, scales, bias, down blocks, scales, bias: the order moe_mxfp4_rows's tables take."""
        gu_bias, d_bias, gu_blocks, gu_scales, d_blocks, d_scales = views
        return tuple(
            t.data_ptr() for t in (gu_blocks, gu_scales, gu_bias, d_blocks, d_scales, d_bias)
        )

    def _call(
        self, x: torch.Tensor, slots: list[SlotPointers], ids: list[int], weights: list[float]
    ) -> torch.Tensor:
        return self.kernels.moe_mxfp4(
            x,
            self.hidden,
            self.intermediate,
            slots=slots,
            ids=ids,
            weights=weights,
            bias_dtype=self.bias_dtype,
            alpha=self.alpha,
            limit=self.limit,
        )

    def rows(self, x: torch.Tensor, slot: SlotPointers) -> torch.Tensor:
        """Rows x [n, H] through the one expert at `slot`, unscaled -> [n, H] (rows_routed with one slot)."""
        n = x.shape[0]
        return self.rows_routed(x, [slot], [0] * n, [1.0] * n)

    def run(self, x: torch.Tensor, slots: list[SlotPointers], weights: list[float]) -> torch.Tensor:
        """x [1, H] through the experts in `slots`, scaled by `weights`, summed in that order -> [1, H]."""
        return self._call(x, slots, list(range(len(slots))), weights)

    def rows_routed(
        self, x: torch.Tensor, slots: list[SlotPointers], ids: list[int], weights: list[float]
    ) -> torch.Tensor:
        """NativeMoe.rows_routed, MAX_ROWS rows a call (the MXFP4 kernel's limit; each row computes as it would
        alone, so the split changes nothing)."""
        k = len(ids) // x.shape[0]
        parts = [
            self._call(
                x[i : i + MAX_ROWS],
                slots,
                ids[i * k : (i + MAX_ROWS) * k],
                weights[i * k : (i + MAX_ROWS) * k],
            )
            for i in range(0, x.shape[0], MAX_ROWS)
        ]
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def native_experts(fmt: ExpertFormat, hidden: int, intermediate: int) -> NativeMoe | None:
    """The native kernel for slots of `fmt` (MXFP4 gpt-oss here, SwiGLU formats in NativeMoe), or None."""
    if isinstance(fmt, Mxfp4GptOssFormat):
        return NativeMxfp4Moe.for_mxfp4(fmt, hidden, intermediate)
    return NativeMoe.for_format(fmt, hidden, intermediate)
