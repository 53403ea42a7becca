"""Dense linears quantized at load (`--dense-quant int8`): attention projections, dense and shared-expert
MLPs, lm_head.

Format: symmetric round-to-nearest per output channel, q = round(w / s) in [-127, 127] with one fp16
scale per row, s = max|w_r| / 127 (rounded to fp16 first, then used to quantize, so that s * q is what
the weight stands for): what the native gemv's W_I8 weights take (engine/native/cpu_gemv.c), and the
bytes of a GGUF Q8_0 file's dense tensors (1 byte a weight plus a 2-byte scale a row, against Q8_0's
2 bytes per 32 weights).

Compute: the rows of decode and verification steps (engine/native/row_kernels.py) run the native gemv,
which computes each row alike whatever the row count (a verification window's rows as plain decode
rows, so greedy speculation stays exact); prompt rows and everything the kernels do not take run
torch: y = (x q^T) * s, with q widened to the activation dtype (exact: |q| <= 127) for that call only.
The fused decode step (engine/worker/fused_decode.py) reads `qweight` and `scale` directly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.huge_pages import empty, huge_empty
from engine.native.dense_names import FLOAT_NAMES, QUANTIZED_NAMES
from engine.native.loaded import usable

DENSE_QUANTS = ("none", "int8")
FLOAT_WEIGHTS = tuple(
    getattr(torch, n) for n in FLOAT_NAMES
)  # the weights quantize_dense quantizes


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [rows, cols], scale fp16 [rows]) of a weight [rows, cols]: symmetric, per row, round to nearest."""
    wf = w.detach().float()
    scale = (wf.abs().amax(dim=1) / 127.0).to(torch.float16)
    s = scale.float()
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    q = torch.round(wf * inv[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


class QuantLinear(nn.Module):
    """A linear layer whose weight is int8 per output channel (`qweight` [out, in], fp16 `scale` [out]); the
    bias, if any, stays in the compute dtype. Output dtype: the input's."""

    qweight: torch.Tensor
    scale: torch.Tensor

    def __init__(self, linear: nn.Linear, huge_pages: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, s = quantize_rows(linear.weight)
        if huge_pages and q.device.type == "cpu":  # the decode streams it: engine/huge_pages.py
            q = huge_empty(tuple(q.shape), q.dtype).copy_(q)
        self.register_buffer("qweight", q)
        self.register_buffer("scale", s)
        self.bias = linear.bias
        self.train(linear.training)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight the int8 codes stand for, s * q, in `dtype` (for checks and comparisons)."""
        return (self.qweight.float() * self.scale.float()[:, None]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        kernels = usable(rows) if x.dtype in (torch.float32, torch.bfloat16) else None
        if kernels is not None:
            y = kernels.gemv(rows, self.qweight, self.scale)
        else:
            y = F.linear(rows, self.qweight.to(x.dtype)) * self.scale.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per row"


def quantize_dense(model: nn.Module, mode: str, huge_pages: bool = False) -> int:
    """Replace `model`'s dense linears (QUANTIZED_NAMES outside routed experts, and lm_head) with QuantLinear
    per `mode` ("none": nothing), their codes in huge pages where `huge_pages`; returns how many were replaced. A linear under several parents (tied)
    becomes one QuantLinear everywhere. Run before engine/native/layers.py's `accelerate`."""
    if mode == "none":
        return 0
    if mode not in DENSE_QUANTS:
        raise ValueError(f"dense quant {mode!r}: use one of {', '.join(DENSE_QUANTS)}")
    done: dict[int, QuantLinear] = {}
    for parent, name, child in dense_linears(model):
        if child.weight.dtype not in FLOAT_WEIGHTS:
            continue
        if id(child) not in done:
            done[id(child)] = QuantLinear(child, huge_pages)
        parent.register_module(name, done[id(child)])
    return len(done)


def dense_linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, name, linear) of `model`'s dense linears: QUANTIZED_NAMES outside the routed experts, and
    lm_head; a linear under several parents comes once per parent."""
    out = []
    for pname, parent in list(model.named_modules()):
        if ".experts" in f".{pname}":
            continue  # routed experts: their own formats (`shared_experts` does not match)
        for name, child in list(parent.named_children()):
            wanted = name in QUANTIZED_NAMES or (name == "lm_head" and pname == "")
            if type(child) is nn.Linear and wanted:
                out.append((parent, name, child))
    return out


def shared_weights(model: nn.Module) -> set[int]:
    """ids of the parameters a module other than a linear holds (an embedding table an LM head is tied to)."""
    return {
        id(p)
        for m in model.modules()
        if type(m) is not nn.Linear
        for p in m.parameters(recurse=False)
    }


def _narrowable(w: torch.Tensor, shared: set[int]) -> bool:
    """An f32 weight no other module holds: narrow_dense's candidates (it then checks the values)."""
    return w.dtype == torch.float32 and id(w) not in shared


def narrow_dense(model: nn.Module, huge_pages: bool = False) -> int:
    """An f32 model's dense linears (dense_linears) whose weights are all bf16 values, as a bf16
    checkpoint's are once widened, keep bf16 weights: the native kernels widen each weight as they read
    it (exactly: the same products), torch's path per call (engine/native/layers.py NativeLinear). A weight
    another module shares (an LM head tied to the input embedding) stays as it is. Run after
    `quantize_dense` and before `accelerate`, where the native kernels run; returns how many narrowed."""
    linears = dense_linears(model)
    shared = shared_weights(model)
    done = 0
    for child in {id(c): c for _, _, c in linears}.values():
        w = child.weight
        if not _narrowable(w, shared) or w.device.type != "cpu":
            continue
        if bool((w.detach().view(torch.int32) & 0xFFFF).any()):
            continue  # not bf16 values: narrowing would round
        narrow = empty(tuple(w.shape), torch.bfloat16, huge_pages).copy_(w.detach())
        child.weight = nn.Parameter(narrow, requires_grad=False)
        done += 1
    return done
