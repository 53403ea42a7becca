"""Dense layers of a model on the CPU through the native kernels, for every row of every step.

- `NativeLinear` (f32 and bf16 models): attention projections, shared experts, lm_head. torch's bf16
  `F.linear` for one row streams 5-6 GB/s on this project's machine against 8-9 for the native
  kernel's AVX-512 BF16 dot products (docs/benchmarks/kernels.md). And torch's result for a row
  depends on how many rows share the call (its one-row and many-row kernels sum in other orders),
  where the native kernel's does not: a verification window's rows and a prompt's rows then compute
  as single decode rows do, so speculation, batching and prefix caching stay exact. The layer stays an `nn.Linear` (isinstance checks
  and state dicts are unchanged); only its forward picks the kernel.
- RMSNorm (any dtype): transformers' llama-style norm is eight torch calls (casts, pow, mean,
  rsqrt, two products), 30-50 us a norm at one row, four norms a layer; the native one is one call.
  Architectures write their norms differently (Gemma's 1 + w, zero-centred weights, f32 weights
  in a bf16 model), so each norm module is checked against its own forward on its first call and
  keeps that forward if they differ.

Everything else (other dtypes, other devices, a step run under `native_rows(False)`:
engine/native/row_kernels.py) runs as before.
"""

from __future__ import annotations

from types import MethodType
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from engine.native.kernels import X_CODES, NativeKernels
from engine.native.loaded import native, row_gemv
from engine.native.row_kernels import native_rows_allowed
from engine.native.structs import Weight


class _KeptGemv(NamedTuple):
    """A NativeLinear's last native call: its kernels, weight Parameter and that weight's address, the
    rows' dtype and width, and the weight's descriptor (NativeKernels.weight_of)."""

    kernels: NativeKernels
    weight: torch.Tensor
    address: int
    dtype: torch.dtype
    cols: int
    descriptor: Weight


class NativeLinear(nn.Linear):
    """An `nn.Linear` whose f32 or bf16 CPU rows run through the native gemv; torch's `F.linear`
    otherwise. It stays an `nn.Linear`: isinstance checks and state dicts are unchanged."""

    @classmethod
    def replacing(cls, linear: nn.Linear) -> NativeLinear:
        """A NativeLinear over `linear`'s own weight and bias Parameters (tied weights stay tied)."""
        new = cls(
            linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta"
        )
        new.weight, new.bias = linear.weight, linear.bias
        new.train(linear.training)
        return new

    # The last native call's weight descriptor and what it was made for (_KeptGemv): a decode step
    # sends each projection the same kind of rows every layer and step, and checking only what can
    # change since costs a third of what the general path's Python did on a small model.
    _kept: _KeptGemv | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kept = self._kept
        if (
            kept is not None
            and x.dim() == 2
            and x.dtype is kept.dtype
            and self._parameters["weight"] is kept.weight
            and kept.weight.data_ptr() == kept.address
            and self._parameters.get("bias") is None
            and native_rows_allowed()
            and native() is kept.kernels
            and x.is_cpu
            and x.is_contiguous()
            and x.shape[0] >= 1
            and x.shape[1] == kept.cols
        ):
            return kept.kernels.gemv_with(kept.descriptor, x)
        w = self.weight
        if x.dim() >= 2 and x.numel():
            rows = x.reshape(-1, x.shape[-1])
            y = row_gemv(rows, w)
            if y is not None:
                kernels = native()
                assert kernels is not None  # row_gemv ran them
                self._kept = _KeptGemv(
                    kernels, w, w.data_ptr(), x.dtype, w.shape[1], kernels.weight_of(w)
                )
                if self.bias is not None:
                    y = y + self.bias
                return y.view(*x.shape[:-1], w.shape[0])
        # bf16 weights of an f32 model (quant_linear.narrow_dense) widen per call on torch's path.
        return F.linear(x, w if w.dtype == x.dtype else w.to(x.dtype), self.bias)


class NativeRMSNorm(nn.Module):
    """Stands in for a norm module in its parent: the native kernel for CPU rows once its
    first such call has matched the replaced module's own forward, that forward otherwise."""

    weight: torch.Tensor

    def __init__(self, module: nn.Module, eps: float) -> None:
        super().__init__()
        # native_counterpart checked that the weight Parameter is all the module holds.
        assert isinstance(module.weight, nn.Parameter)
        # The replaced module's Parameter itself: the same storage, under the same state-dict key.
        self.weight = module.weight
        self.eps = eps
        # The replaced module's own forward (bound to it), for the first call's check and for what the
        # kernel does not take. A bound method, not a submodule: the module tree keeps one copy of
        # the weight, and the replaced module runs exactly as it did.
        self.original = MethodType(type(module).forward, module)
        self.verified: bool | None = None  # None: not yet checked
        self._accepted: tuple[torch.Size, torch.dtype] | None = (
            None  # the last input shape and dtype found to run natively
        )
        self.train(module.training)

    @property
    def module(self) -> Any:
        """The norm module this one replaced (its weight and its own forward)."""
        return self.original.__self__

    def kernels_for(self, x: torch.Tensor) -> NativeKernels | None:
        """The kernels where this norm runs x natively (contiguous CPU rows in its weight's dtype, and
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
        w = self.weight
        if (
            self.verified is False
            or x.dtype != w.dtype
            or w.shape != x.shape[-1:]
            or x.dtype not in X_CODES
            or x.device.type != "cpu"
            or w.device.type != "cpu"
            or not x.is_contiguous()
        ):
            return None
        self._accepted = (x.shape, x.dtype)
        return native()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = self.kernels_for(x)
        if kernels is None:
            return self.original(x)
        y = kernels.rmsnorm(x, self.weight, self.eps)
        if self.verified is None:
            ref = self.original(x)
            tol = 1e-5 if x.dtype == torch.float32 else 2**-7  # f32 rounding; one bf16 ulp
            self.verified = ref.dtype == y.dtype and bool(
                torch.allclose(y.float(), ref.float(), rtol=tol, atol=tol)
            )
            # The native result once it passed: every call, the first too, computes one way.
            return y if self.verified else ref
        return y


# Dense MLPs whose forward is down_proj(act_fn(gate_proj(x)) * up_proj(x)) in transformers 5, without biases:
# the MoE models' shared experts and dense layers, and the dense drafts' MLPs.
SWIGLU_MLP_CLASSES = frozenset(
    {
        "Qwen2MoeMLP",
        "Qwen3MoeMLP",
        "Glm4MoeMLP",
        "DeepseekV3MLP",
        "Qwen2MLP",
        "Qwen3MLP",
        "LlamaMLP",
        "MistralMLP",
    }
)


class NativeSwiGLU(nn.Module):
    """Stands in for a SwiGLU MLP module in its parent: its projections as they are (native linears), the
    activation and product through the native elementwise kernel, which computes each element one way.
    Why: torch's vectorised silu rounds an element by where it falls in the tensor, so a row's result
    changed with the rows beside it (a prompt's rows against the same row decoded alone)."""

    gate_proj: nn.Module
    up_proj: nn.Module
    down_proj: nn.Module

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        # The module's projections, each as its native counterpart where it has one (the same Parameters):
        # the replaced module's own children are replaced after this one is made.
        for name in ("gate_proj", "up_proj", "down_proj"):
            child = getattr(module, name)
            self.register_module(name, native_counterpart(child) or child)
        self.act_fn = (
            module.act_fn
        )  # what the fused step checks (engine/worker/fused_layer_spec.py)
        self.original = MethodType(type(module).forward, module)
        self.train(module.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.gate_proj(x), self.up_proj(x)
        kernels = native() if native_rows_allowed() else None
        if (
            kernels is None
            or g.dtype not in X_CODES
            or g.dtype != u.dtype
            or g.device.type != "cpu"
            or not (g.is_contiguous() and u.is_contiguous())
        ):
            return self.original(x)
        return self.down_proj(kernels.silu_mul(g, u))


def verified_kernels(norm: object, x: torch.Tensor) -> NativeKernels | None:
    """The kernels where `norm` is a NativeRMSNorm checked against the module it replaced that would run x
    natively: then fusing it with a neighbouring step keeps its arithmetic. A norm not yet checked is checked
    here, on x (its forward, whose result is dropped): otherwise a fresh model's first forward would take the
    unfused torch path and compute other bits than every later forward of the same rows."""
    if not isinstance(norm, NativeRMSNorm):
        return None
    if norm.verified is None and norm.kernels_for(x) is not None:
        norm.forward(x)
    return norm.kernels_for(x) if norm.verified else None


def _rmsnorm_eps(module: nn.Module) -> float | None:
    """The epsilon of a llama-style RMSNorm module (by name and attributes), else None."""
    if not type(module).__name__.endswith("RMSNorm") or not isinstance(
        getattr(module, "weight", None), torch.Tensor
    ):
        return None
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return float(eps) if isinstance(eps, float) else None


def _is_swiglu_mlp(module: nn.Module) -> bool:
    """A listed SwiGLU MLP with SiLU activation and bias-free projections."""
    act = getattr(module, "act_fn", None)
    projections = [getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    return (
        type(module).__name__ in SWIGLU_MLP_CLASSES
        and type(act).__name__ in ("SiLU", "SiLUActivation")
        and all(isinstance(p, nn.Module) and getattr(p, "bias", None) is None for p in projections)
    )


def native_counterpart(module: nn.Module) -> nn.Module | None:
    """The native module that stands in for `module` (an f32 or bf16 CPU `nn.Linear` or llama-style
    RMSNorm), built over its own Parameters; None where it keeps its own forward."""
    if _is_swiglu_mlp(module):
        return NativeSwiGLU(module)
    w = getattr(module, "weight", None)
    if (
        not isinstance(w, torch.Tensor)
        or w.device.type != "cpu"
        or isinstance(module, NativeRMSNorm)
    ):
        return None
    if type(module) is nn.Linear and w.dtype in (torch.float32, torch.bfloat16):
        return NativeLinear.replacing(module)
    eps = _rmsnorm_eps(module)
    # The weight must be all the norm holds: the replacement keeps only it in the module tree.
    params = [n for n, _ in module.named_parameters()]
    only_weight = params == ["weight"] and next(module.buffers(), None) is None
    if eps is not None and only_weight and w.dtype in (torch.float32, torch.bfloat16):
        return NativeRMSNorm(module, eps)
    return None


def accelerate(model: nn.Module) -> int:
    """Replace `model`'s CPU norms and plain linears in their parents with their native
    counterparts; returns how many modules were replaced. A module that sits under several parents is
    replaced by one counterpart everywhere."""
    if native() is None:
        return 0
    replaced: dict[int, nn.Module | None] = {}  # id of a child -> its counterpart (None: kept)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) not in replaced:
                replaced[id(child)] = native_counterpart(child)
            new = replaced[id(child)]
            if new is not None:
                parent.register_module(name, new)
    return sum(new is not None for new in replaced.values())
