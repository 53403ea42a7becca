"""Storage formats of a routed expert in its fast-tier slot, and dequant-on-compute.

A format decides how the kernel's weights (engine/experts/formats/expert_kernels.py) are encoded in
one slot row, and turns a slot back into float weights right before the matmuls. The slot is
what the slow tier stores and what a transfer copies, so a smaller encoding means fewer bytes
on every link and more experts per byte of fast tier.

- `PlainFormat`: the weights as floats in the compute dtype (the default, exact); with an f32
  compute dtype and a bf16 checkpoint, the slots keep the checkpoint's bf16 (every bf16 value is
  an f32 value, so widening at compute time is exact: the same products at half the bytes).
- `GroupQuantFormat` (`--expert-quant int8|int4`; groups default to whole rows for int8, 64 for int4): group-wise quantization of every 2-D weight
  along its last dimension (the input dimension of `F.linear` weights), in groups of `group`
  values (gcd(cols, group) when a dimension is not a multiple of it; 0: whole rows).
  - int8: symmetric, q = round(w / s) in [-127, 127], s = max|w| / 127 per group, s in fp16.
    1 byte + 2/group bytes per weight (1.03 B at group 64: 1.94x fewer than bf16).
  - int4: asymmetric, w ~= s * (q - z), q in [0, 15], s and z in fp16 per group. Start from
    round-to-nearest over [min, max], then refine s and z by least squares on the chosen codes
    (the half-quadratic idea of HQQ with an L2 loss; a few closed-form steps, no calibration
    data). Two codes per byte, low nibble first. 0.5 + 4/group bytes per weight (0.5625 B at
    group 64: 3.56x fewer than bf16).
  1-D weights (gpt-oss biases) stay float32: they are a few hundred bytes per expert.
  Group 0 means whole rows: one scale per output channel.
- Fast path: int8 in whole rows, SwiGLU, computing in bf16 on the CPU, multiplies the int8 slot
  directly instead of dequantizing it on every call: through the native VNNI kernel
  (engine/native/, activations quantized in blocks of 64 as llama.cpp's Q8_0 does; 7-9 GB/s of
  int8 weights here) or, without it, torch's weight-only int8 matmul (`aten._weight_int8pack_mm`,
  about 5 GB/s), against 1.2 GB/s for dequantize-then-linear (1 thread, [1024, 1024] weights;
  docs/benchmarks/kernels.md).
Each encoded part starts on a 16-byte boundary so it can be viewed in place as int8/fp16/fp32.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import cast

import torch

from engine.experts.formats.expert_kernels import ExpertKernel, SwiGLUKernel
from engine.experts.formats.slot_layout import GroupQuantLayout, PlainLayout, SlotLayout
from engine.native.loaded import usable


class ExpertFormat(SlotLayout, ABC):
    """A slot's layout (engine/experts/formats/slot_layout.py) and how its weights are read back."""

    kernel: ExpertKernel

    @abstractmethod
    def views(self, row: torch.Tensor) -> list:
        """Per-slot windows onto one slot row, made once when the executor starts."""

    @abstractmethod
    def weights(self, views: list) -> list[torch.Tensor]:
        """Float weights (compute dtype) shaped as the kernel's views."""

    def forward(self, views: list, x: torch.Tensor) -> torch.Tensor:
        return self.kernel.forward(self.weights(views), x)


class PlainFormat(PlainLayout, ExpertFormat):
    """The checkpoint's weights as floats in `slot_dtype` (default: the compute dtype, and then
    `weights` is free, no copy). A narrower slot dtype (bf16 slots, f32 compute): `weights` widens
    them, the native kernels read them as they are."""

    kernel: ExpertKernel

    def views(self, row: torch.Tensor) -> list:
        out, at = [], 0
        for _, shape in self.kernel.views:
            n = math.prod(shape)
            out.append(row[at : at + n].view(shape))
            at += n
        return out

    def weights(self, views: list) -> list[torch.Tensor]:
        if self.slot_dtype == self.compute_dtype:
            return views
        return [v.to(getattr(torch, self.compute_dtype)) for v in views]


class GroupQuantFormat(GroupQuantLayout, ExpertFormat):
    kernel: ExpertKernel

    def __init__(self, kernel: ExpertKernel, kind: str, group: int, compute_dtype: str) -> None:
        super().__init__(kernel, kind, group, compute_dtype)
        self._int8_rows = (
            self.bits == 8
            and compute_dtype == "bfloat16"
            and type(kernel) is SwiGLUKernel
            and all(self.group_of(shape[1]) == shape[1] for _, shape in kernel.views)
        )
        # int4 in groups of 64, SwiGLU, bf16 compute: the native int4 kernel (where it applies) reads the slot as is.
        self._int4_groups = (
            self.bits == 4
            and compute_dtype == "bfloat16"
            and type(kernel) is SwiGLUKernel
            and all(self.group_of(shape[1]) == 64 for _, shape in kernel.views)
        )

    # -- encoding (when the slow tier is built) -------------------------------------
    def encode(self, weights: list[torch.Tensor]) -> torch.Tensor:
        """Float weights shaped as the kernel's views -> one flat uint8 slot row."""
        out = torch.zeros(self.slot_numel, dtype=torch.uint8)
        for w, parts in zip(weights, self._layout):
            w = w.detach().to(torch.float32)
            encoded = (
                [w]
                if w.dim() != 2
                else (
                    _int8(w, self.group_of(w.shape[1]))
                    if self.bits == 8
                    else quantize_int4(w, self.group_of(w.shape[1]))
                )
            )
            for t, (off, nbytes, dtype, _pshape) in zip(encoded, parts):
                out[off : off + nbytes] = t.to(getattr(torch, dtype)).reshape(-1).view(torch.uint8)
        return out

    # -- decoding (on every expert call) ---------------------------------------------
    def views(self, row: torch.Tensor) -> list:
        return [
            [
                row[off : off + n].view(getattr(torch, dtype)).view(shape)
                for off, n, dtype, shape in parts
            ]
            for parts in self._layout
        ]

    def forward(self, views: list, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and x.dtype == torch.bfloat16:
            if self._int8_rows and hasattr(torch.ops.aten, "_weight_int8pack_mm"):
                (q_gu, s_gu), (q_d, s_d) = views
                gate, up = _int8_linear(x, q_gu, s_gu).chunk(2, dim=-1)
                return _int8_linear(
                    cast("SwiGLUKernel", self.kernel).act_fn(gate) * up, q_d, s_d
                )  # _int8_rows: SwiGLU only
            if self._int4_groups:
                y = self._int4_swiglu(views, x)
                if y is not None:
                    return y
        return super().forward(views, x)  # dequantize, then the kernel

    def _int4_swiglu(self, views: list, x: torch.Tensor) -> torch.Tensor | None:
        """SwiGLU with int4 groups of 64 straight from the slot (engine/native/ gemv_q4), or None where the
        native kernel does not apply."""
        x = x.contiguous()
        kernels = usable(x)
        if kernels is None:
            return None
        (p_gu, s_gu, z_gu), (p_d, s_d, z_d) = views
        gu = kernels.gemv_q4(x, p_gu.view(p_gu.shape[0], -1), s_gu, z_gu)
        if gu is None:
            return None
        gate, up = gu.chunk(2, dim=-1)
        return kernels.gemv_q4(
            (cast("SwiGLUKernel", self.kernel).act_fn(gate) * up).contiguous(),
            p_d.view(p_d.shape[0], -1),
            s_d,
            z_d,
        )

    def weights(self, views: list) -> list[torch.Tensor]:
        out, dt = [], getattr(torch, self.compute_dtype)
        for parts, (_, shape) in zip(views, self.kernel.views):
            if len(parts) == 1:
                out.append(parts[0].to(dt))
            elif self.bits == 8:
                q, s = parts
                out.append((q.to(dt) * s.to(dt)).view(shape))
            else:
                packed, s, z = parts
                q = torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)  # [rows, groups, g]
                out.append(((q.to(dt) - z.to(dt)) * s.to(dt)).view(shape))
        return out


def _int8_linear(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """x [n, in] times a whole-row int8 weight (q [out, 1, in], fp16 scales [out, 1, 1]) -> [n, out].

    On the CPU the native kernel (engine/native/) multiplies with AVX-512 VNNI, the activation
    quantized to int8 in blocks of 64 as llama.cpp's Q8_0 does (about 1.6x torch's weight-only
    op here, docs/benchmarks/kernels.md); elsewhere torch's weight-only int8 matmul."""
    x = x.contiguous()
    kernels = usable(x)
    if kernels is not None:
        return kernels.gemv(x, q.view(q.shape[0], -1), s.view(-1))
    return torch.ops.aten._weight_int8pack_mm(x, q.view(q.shape[0], -1), s.view(-1).to(x.dtype))


def _int8(w: torch.Tensor, g: int) -> list[torch.Tensor]:
    rows, cols = w.shape
    wg = w.view(rows, cols // g, g)
    s = (wg.abs().amax(dim=-1, keepdim=True) / 127.0).to(torch.float16).to(torch.float32)
    s = torch.where(s > 0, s, torch.ones_like(s))  # an all-zero group: any scale decodes to 0
    q = torch.round(wg / s).clamp(-127, 127)
    return [q, s]


def quantize_int4(w: torch.Tensor, g: int, steps: int = 4) -> list[torch.Tensor]:
    rows, cols = w.shape
    wg = w.view(rows, cols // g, g)
    lo, hi = wg.amin(dim=-1, keepdim=True), wg.amax(dim=-1, keepdim=True)
    s = ((hi - lo) / 15.0).clamp(min=1e-8)
    z = -lo / s
    for _ in range(steps + 1):
        s16, z16 = s.to(torch.float16).to(torch.float32), z.to(torch.float16).to(torch.float32)
        q = torch.round(wg / s16 + z16).clamp(0, 15)
        # Least squares w ~= a * q + b on the chosen codes, i.e. s = a, z = -b / a.
        qm, wm = q.mean(dim=-1, keepdim=True), wg.mean(dim=-1, keepdim=True)
        var = ((q - qm) ** 2).mean(dim=-1, keepdim=True)
        a = ((q - qm) * (wg - wm)).mean(dim=-1, keepdim=True) / var.clamp(min=1e-12)
        ok = (var > 1e-12) & (a > 1e-8)
        s = torch.where(ok, a, s16)
        z = torch.where(ok, -(wm - a * qm) / a.clamp(min=1e-8), z16)
    s16, z16 = s.to(torch.float16).to(torch.float32), z.to(torch.float16).to(torch.float32)
    q = torch.round(wg / s16 + z16).clamp(0, 15).to(torch.uint8)
    packed = q[..., 0::2] | (q[..., 1::2] << 4)
    return [packed, s16, z16]
