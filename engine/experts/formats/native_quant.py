"""Experts that come quantized in the checkpoint, kept quantized until the matmul.

- MXFP4 (gpt-oss): per expert, `gate_up_proj_blocks` [2I, H/32, 16] and `down_proj_blocks`
  [H, I/32, 16] (two FP4 e2m1 codes per byte, low nibble first) with one power-of-two scale
  per 32 weights (`*_scales`, uint8 e8m0: 2^(s - 127)), plus bf16 biases. The weights are
  stored out-features-major, i.e. transposed against transformers' in-memory [H, 2I].
- FP8 block (DeepSeek-V3/R1, Kimi-K2, MiniMax-M2, Qwen *-FP8): per expert projection an
  F8_E4M3 `weight` [out, in] and an F32 `weight_scale_inv` [ceil(out/B), ceil(in/B)], one
  scale per B x B block (B = 128 in every released checkpoint).

The slot is the checkpoint's own bytes, concatenated (see RawPartsLayout in
engine/experts/formats/slot_layout.py), so reads, transfers and the fast tier all carry the
quantized size; dequantization happens per expert call, on the compute device.
"""

from __future__ import annotations

import functools

import torch

from engine.experts.formats.expert_kernels import ExpertKernel
from engine.experts.formats.quant import ExpertFormat, GroupQuantFormat, PlainFormat
from engine.experts.formats.slot_layout import (
    Fp8BlockLayout,
    Layouts,
    Mxfp4Layout,
    RawPartsLayout,
)

# FP4 e2m1 code -> value (the same table as transformers.integrations.mxfp4.FP4_VALUES).
_FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


class RawPartsFormat(RawPartsLayout, ExpertFormat):
    """A slot made of the checkpoint's tensors back to back, each viewed in place with its dtype."""

    kernel: ExpertKernel

    def views(self, row: torch.Tensor) -> list:
        return [
            row[off : off + n].view(getattr(torch, dtype)).view(shape)
            for off, n, dtype, shape in self._parts
        ]


@functools.cache
def _mxfp4_tables(dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[256, 2]: a byte's two e2m1 values (low nibble first); [256]: an e8m0 scale's 2^(s - 127).
    Made once per (dtype, device): constants of the format, so the cache changes no result."""
    fp4 = torch.tensor(_FP4, dtype=torch.float32)
    b = torch.arange(256)
    pairs = torch.stack((fp4[b & 15], fp4[b >> 4]), dim=-1)
    pow2 = torch.ldexp(torch.ones(256, dtype=torch.float64), b - 127)
    return pairs.to(dtype).to(device), pow2.to(dtype).to(device)


def dequant_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [R, G, 16] uint8, scales [R, G] uint8 -> weights [R, G * 32], each code's e2m1 value
    times 2^(scale - 127). Exact: an e2m1 value has 2 significant bits, so the product is a float
    of `dtype` unless it leaves the exponent range. One table lookup per byte (both nibbles at once,
    int32 indices) and one per scale: the gather-and-multiply that runs on every expert call."""
    pairs, pow2 = _mxfp4_tables(dtype, blocks.device)
    R, G, _ = blocks.shape
    vals = pairs.index_select(0, blocks.reshape(-1).to(torch.int32)).view(R, G, 32)
    scale = pow2.index_select(0, scales.reshape(-1).to(torch.int32)).view(R, G, 1)
    return (vals * scale).view(R, G * 32)


class Mxfp4GptOssFormat(Mxfp4Layout, RawPartsFormat):
    """Slot: gate_up_bias | down_bias | gate_up blocks | gate_up scales | down blocks | down scales."""

    kernel: ExpertKernel

    def weights(self, views: list) -> list[torch.Tensor]:
        gu_bias, down_bias, gu_blocks, gu_scales, d_blocks, d_scales = views
        dt = getattr(torch, self.compute_dtype)
        gate_up = dequant_mxfp4(
            gu_blocks, gu_scales, dt
        ).t()  # [2I, H] on disk -> [H, 2I] as the kernel wants
        down = dequant_mxfp4(d_blocks, d_scales, dt).t()  # [H, I] -> [I, H]
        return [gate_up, gu_bias.to(dt), down, down_bias.to(dt)]


def dequant_fp8_block(
    w: torch.Tensor, scale_inv: torch.Tensor, block: int, dtype: torch.dtype
) -> torch.Tensor:
    """w [out, in] float8, scale_inv [ceil(out/B), ceil(in/B)] -> w * scale per B x B block."""
    rows, cols = w.shape
    s = scale_inv.to(dtype).repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return w.to(dtype) * s


class Fp8BlockSwiGLUFormat(Fp8BlockLayout, RawPartsFormat):
    """Slot: gate, up, down scales (f32, first so they stay 4-byte aligned) | gate, up, down weights (fp8)."""

    kernel: ExpertKernel

    def weights(self, views: list) -> list[torch.Tensor]:
        sg, su, sd, g, u, d = views
        dt, b = getattr(torch, self.compute_dtype), self.block
        gate_up = torch.cat(
            (dequant_fp8_block(g, sg, b, dt), dequant_fp8_block(u, su, b, dt))
        )  # [2I, H]
        return [gate_up, dequant_fp8_block(d, sd, b, dt)]


# The formats that encode and compute, one per kind (engine/experts/formats/slot_layout.py `Layouts`).
FORMATS = Layouts(PlainFormat, GroupQuantFormat, Mxfp4GptOssFormat, Fp8BlockSwiGLUFormat)
