"""Dense layers of a model on the CPU through the native kernels, for steps with few rows.

- `NativeLinear` (bf16 models): attention projections, shared experts, lm_head. torch's bf16
  `F.linear` for one row streams 5-6 GB/s on this project's machine against 8-9 for the native
  kernel's AVX-512 BF16 dot products (docs/benchmarks/kernels.md). The layer stays an
  `nn.Linear` (isinstance checks and state dicts are unchanged); only its forward picks the kernel.
- RMSNorm (any dtype): transformers' llama-style norm is eight torch calls (casts, pow, mean,
  rsqrt, two products), 30-50 us a norm at one row, four norms a layer; the native one is one call.
  Architectures write their norms differently (Gemma's 1 + w, zero-centred weights, f32 weights
  in a bf16 model), so each norm module is checked against its own forward on its first call and
  keeps that forward if they differ.

Everything else (prompts and evaluation forwards, whatever their length: engine/native/row_kernels.py;
batches over 16 rows, other dtypes, other devices) runs as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.native.kernels import MAX_ROWS, X_CODES, NativeKernels
from engine.native.loaded import bf16_gemv, native
from engine.native.row_kernels import native_rows_allowed


class NativeLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if x.dim() >= 2 and x.numel() <= MAX_ROWS * x.shape[-1]:
            y = bf16_gemv(x.reshape(-1, x.shape[-1]), w)
            if y is not None:
                if self.bias is not None:
                    y = y + self.bias
                return y.view(*x.shape[:-1], w.shape[0])
        return F.linear(x, w, self.bias)


class NativeRMSNorm:
    """A norm module's forward, replaced on the instance: the native kernel for few-row CPU inputs
    once its first such call has matched the module's own forward, the module's forward otherwise."""

    def __init__(self, module: nn.Module, eps: float) -> None:
        self.module: Any = module  # the norm module it stands in for (its weight, its own forward)
        self.eps = eps
        self.original: Callable[[torch.Tensor], torch.Tensor] = type(module).forward.__get__(module)
        self.verified: bool | None = None  # None: not yet checked
        self._accepted: tuple[torch.Size, torch.dtype] | None = (
            None  # the last input shape and dtype found to run natively
        )

    def kernels_for(self, x: torch.Tensor) -> NativeKernels | None:
        """The kernels where this norm runs x natively (few contiguous CPU rows in its weight's dtype, and
        not found to differ from the module), else None. Also what engine/worker/lean_forward.py asks
        before fusing this norm with its neighbours."""
        # This runs several times a layer in every decode step, where each norm sees one shape: an
        # input of the shape and dtype accepted last time needs only the contiguity check (and the
        # verdict of the first call's check against the module).
        if not native_rows_allowed():
            return None
        if (
            self._accepted == (x.shape, x.dtype)
            and x.is_contiguous()
            and self.verified is not False
        ):
            return native()
        w = self.module.weight
        if (
            self.verified is False
            or x.dtype != w.dtype
            or x.numel() > MAX_ROWS * x.shape[-1]
            or w.shape != x.shape[-1:]
            or x.dtype not in X_CODES
            or x.device.type != "cpu"
            or w.device.type != "cpu"
            or not x.is_contiguous()
        ):
            return None
        self._accepted = (x.shape, x.dtype)
        return native()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        kernels = self.kernels_for(x)
        if kernels is None:
            return self.original(x)
        y = kernels.rmsnorm(x, self.module.weight, self.eps)
        if self.verified is None:
            ref = self.original(x)
            tol = 1e-5 if x.dtype == torch.float32 else 2**-7  # f32 rounding; one bf16 ulp
            self.verified = ref.dtype == y.dtype and bool(
                torch.allclose(y.float(), ref.float(), rtol=tol, atol=tol)
            )
            return ref
        return y


def _rmsnorm_eps(module: nn.Module) -> float | None:
    """The epsilon of a llama-style RMSNorm module (by name and attributes), else None."""
    if not type(module).__name__.endswith("RMSNorm") or not isinstance(
        getattr(module, "weight", None), torch.Tensor
    ):
        return None
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return float(eps) if isinstance(eps, float) else None


def accelerate(model: nn.Module) -> int:
    """Route `model`'s CPU norms (and, in bf16, its plain linears) through the native kernels;
    returns how many modules changed."""
    if native() is None:
        return 0
    changed = 0
    for module in model.modules():
        w = getattr(module, "weight", None)
        if not isinstance(w, torch.Tensor) or w.device.type != "cpu":
            continue
        if type(module) is nn.Linear and w.dtype == torch.bfloat16:
            module.__class__ = NativeLinear
            changed += 1
        elif (eps := _rmsnorm_eps(module)) is not None and w.dtype in (
            torch.float32,
            torch.bfloat16,
        ):
            module.forward = NativeRMSNorm(module, eps)
            changed += 1
    return changed
