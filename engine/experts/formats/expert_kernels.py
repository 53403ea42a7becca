"""What one routed expert computes, and how its weights sit in its packed buffer.

Every expert is one contiguous buffer (see engine/weights/expert_layout.py). A kernel names
the weights in that buffer, in order, with their shapes (`views`: its geometry, plain data in
engine/experts/formats/slot_layout.py), and computes the expert
from float tensors of exactly those shapes. Storage formats (engine/experts/formats/quant.py) decide
how each weight is encoded in the slot and hand the kernel dequantized float tensors.

Three kernels cover the architectures we run:
- SwiGLU: `gate_up [2I, H] | down [H, I]`, `down(act(gate(x)) * up(x))` (Qwen, Mixtral,
  DeepSeek, GLM, MiniMax, Granite, Phi, ERNIE). Gate and up are adjacent on disk, so the
  per-expert layout [gate | up | down] and transformers' fused `gate_up_proj` row coincide.
- gpt-oss: transposed weights `gate_up [H, 2I]` with gate/up *interleaved* on the last dim,
  biases, and a clamped SwiGLU: `(clamp(up) + 1) * g * sigmoid(alpha * g)`, g = clamp(gate).
- Llama 4: transposed weights `gate_up [H, 2I]` (gate | up halves) and `down [I, H]`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from engine.experts.formats.slot_layout import GptOssViews, KernelViews, Llama4Views, SwiGLUViews
from engine.native.loaded import row_gemv
from engine.native.row_kernels import native_rows_allowed


class ExpertKernel(KernelViews, ABC):
    """A kernel's geometry (engine/experts/formats/slot_layout.py) and what it computes."""

    @abstractmethod
    def forward(self, w: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """x [n, H] and float weights shaped as `views` -> the unscaled expert output [n, H]."""


def _fast_act(
    act_fn: Callable[[torch.Tensor], torch.Tensor],
) -> Callable[[torch.Tensor], torch.Tensor]:
    # transformers' SiLUActivation.forward is F.silu; calling the functional form skips a module call per expert.
    return F.silu if type(act_fn).__name__ in ("SiLU", "SiLUActivation") else act_fn


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear, except for a few f32 or bf16 rows on the CPU: there the native kernel (engine/native/),
    whose result for a row does not depend on how many rows share the call (so a verification window
    computes as single decode rows do), and bf16 streams faster than torch's single-row paths
    (docs/benchmarks/kernels.md); torch.mv for one bf16 row where the native kernels are off (8.7 GB/s
    against F.linear's 6.3)."""
    y = row_gemv(x, w)
    if y is not None:
        return y
    if (
        x.shape[0] == 1
        and x.dtype == w.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and native_rows_allowed()
    ):
        return torch.mv(w, x[0]).unsqueeze(0)
    return F.linear(x, w)


class SwiGLUKernel(SwiGLUViews, ExpertKernel):
    def __init__(
        self, hidden: int, intermediate: int, act_fn: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        super().__init__(hidden, intermediate)
        self.act_fn = _fast_act(act_fn)

    def forward(self, w: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        gate_up, down = w  # [2I, H], [H, I]
        gate, up = _linear(x, gate_up).chunk(2, dim=-1)  # [n, I] each
        return _linear(self.act_fn(gate) * up, down)


class GptOssKernel(GptOssViews, ExpertKernel):
    def __init__(self, hidden: int, intermediate: int, alpha: float, limit: float) -> None:
        super().__init__(hidden, intermediate)
        self.alpha, self.limit = alpha, limit

    def forward(self, w: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        gate_up, gate_up_bias, down, down_bias = w
        gu = x @ gate_up + gate_up_bias  # [n, 2I], gate and up interleaved
        gate = gu[..., ::2].clamp(min=None, max=self.limit)
        up = gu[..., 1::2].clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return ((up + 1) * glu) @ down + down_bias


class Llama4Kernel(Llama4Views, ExpertKernel):
    def __init__(
        self, hidden: int, intermediate: int, act_fn: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        super().__init__(hidden, intermediate)
        self.act_fn = _fast_act(act_fn)

    def forward(self, w: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        gate_up, down = w  # [H, 2I], [I, H]
        gate, up = (x @ gate_up).chunk(2, dim=-1)
        return (up * self.act_fn(gate)) @ down


def make_kernel(kind: str, experts: Any, hidden: int, intermediate: int) -> ExpertKernel:
    """The kernel for a transformers experts module (`kind` comes from the architecture table)."""
    if kind == "swiglu":
        return SwiGLUKernel(hidden, intermediate, experts.act_fn)
    if kind == "gpt_oss":
        return GptOssKernel(hidden, intermediate, float(experts.alpha), float(experts.limit))
    if kind == "llama4":
        return Llama4Kernel(hidden, intermediate, experts.act_fn)
    raise ValueError(f"unknown expert kernel {kind!r}")
