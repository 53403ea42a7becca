"""The dense layers of a bf16 model on the CPU (attention projections, shared experts, routers,
lm_head) through the native kernel when a step has few rows.

Why: torch's bf16 `F.linear` for one row streams 5-6 GB/s on this project's machine against
9-10 for the native kernel's AVX-512 BF16 dot products (docs/benchmarks/kernels.md). The
layer stays an `nn.Linear` (isinstance checks and state dicts are unchanged); only its forward
picks the kernel, and everything else (prefill, batches over 16 rows, other dtypes, other
devices) goes to F.linear as before.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.native.kernels import MAX_ROWS, native, usable


class NativeLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if x.dtype == w.dtype == torch.bfloat16 and x.dim() >= 2 and x.numel() <= MAX_ROWS * x.shape[-1]:
            rows = x.reshape(-1, x.shape[-1])
            kernels = usable(rows)
            if kernels is not None and w.is_contiguous():
                y = kernels.gemv(rows, w)
                if self.bias is not None:
                    y = y + self.bias
                return y.view(*x.shape[:-1], w.shape[0])
        return F.linear(x, w, self.bias)


def accelerate_linears(model: nn.Module) -> int:
    """Turn every plain bf16 CPU nn.Linear of `model` into a NativeLinear; returns how many changed."""
    if native() is None:
        return 0
    changed = 0
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.dtype == torch.bfloat16 and module.weight.device.type == "cpu":
            module.__class__ = NativeLinear
            changed += 1
    return changed
