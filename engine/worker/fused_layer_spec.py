"""How a decoder layer's modules become decode_layer.c's `layer_spec_t` (engine/worker/fused_decode.py
runs it): the struct, the field builders of each part (attention and norms, router, SwiGLU MLPs) and the checks
that decide whether a part can run natively (`NotYet` until a first-call check has run, `Unsupported` for good).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch import nn

from engine.experts.compute.moe_block import OffloadedMoeBlock
from engine.native.kernels import W_CODES, X_CODES
from engine.native.layers import NativeLinear, NativeRMSNorm
from engine.native.limits import MAX_HEAD_GROUP, MAX_TOPK
from engine.native.quant_linear import QuantLinear
from engine.native.router import NativeSigmoidRouter, NativeTopKRouter
from engine.native.row_ops import reads_weights

_I64, _F, _P = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class LayerSpec(ctypes.Structure):
    """decode_layer.c's `layer_spec_t`: the same fields in the same order."""

    _fields_ = (
        [
            (n, _I64)
            for n in (
                "xtype",
                "proj_wtype",
                "norm_wtype",
                "expert_wtype",
                "H",
                "hq",
                "hk",
                "d",
                "rot",
                "E",
                "topk",
                "I",
                "norm_topk",
            )
        ]
        + [(n, _F) for n in ("q_eps", "k_eps", "post_eps", "next_eps", "scale", "pad_")]
        + [
            (n, _P)
            for n in (
                "wq",
                "wk",
                "wv",
                "wo",
                "bq",
                "bk",
                "bv",
                "bo",
                "q_norm",
                "k_norm",
                "post_norm",
                "next_norm",
                "router",
                "gate_up",
                "gate_up_scale",
                "down",
                "down_scale",
                "sh_gate",
                "sh_up",
                "sh_down",
                "sh_gate_w",
            )
        ]
        + [(n, _I64) for n in ("sh_I", "router_kind", "router_wtype", "n_group", "topk_group")]
        + [("score_bias", _P)]
        + [(n, _F) for n in ("routed_scale", "pad2_")]
        + [(n, _P) for n in ("route_x", "route_logits", "route_weights", "route_ids")]
        + [(n, _P) for n in ("wq_s", "wk_s", "wv_s", "wo_s", "sh_gate_s", "sh_up_s", "sh_down_s")]
        + [(n, _P) for n in ("gate_up_zero", "down_zero")]
    )


ROUTER_SOFTMAX, ROUTER_SIGMOID, ROUTER_NONE = 0, 1, 2  # decode_layer.c's router kinds


class NotYet(Exception):
    """A check this path relies on has not run yet (a norm or router not called natively so far)."""


class Unsupported(Exception):
    """This model can never take the fused path; the message says why."""


def attention_fields(layer: Any, next_norm: Any, x: torch.Tensor, cos: torch.Tensor) -> dict:
    """The LayerSpec fields of the attention half, the norms and the dtypes."""
    dtype, att = x.dtype, layer.att
    norms = [norm(m, dtype) for m in (layer.in_norm, layer.post_norm, next_norm)]
    qk = (
        [norm(m, dtype) for m in (layer.q_norm, layer.k_norm)]
        if layer.q_norm is not None
        else [None, None]
    )
    projections = [
        linear_weights(p, dtype) for p in (layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj)
    ]
    d = att.head_dim
    hq, hk = projections[0][0].shape[0] // d, projections[1][0].shape[0] // d
    if hq % hk or hq // hk > MAX_HEAD_GROUP or d > 1024 or cos.shape[-1] % 2 or cos.shape[-1] > d:
        raise Unsupported("an attention shape the native kernel does not take")
    norm_dtypes = {n.module.weight.dtype for n in norms + [q for q in qk if q is not None]}
    if len(norm_dtypes) != 1:
        raise Unsupported("norm weights of several dtypes")
    p = [t.data_ptr() if t is not None else None for t in (w for trio in projections for w in trio)]
    return dict(
        xtype=X_CODES[dtype],
        proj_wtype=proj_wtype([w for w, _, s in projections if s is None], dtype),
        norm_wtype=W_CODES[norm_dtypes.pop()],
        H=x.shape[-1],
        hq=hq,
        hk=hk,
        d=d,
        rot=cos.shape[-1],
        q_eps=qk[0].eps if qk[0] else 0.0,
        k_eps=qk[1].eps if qk[1] else 0.0,
        post_eps=norms[1].eps,
        next_eps=norms[2].eps,
        scale=float(att.scaling),
        wq=p[0],
        bq=p[1],
        wq_s=p[2],
        wk=p[3],
        bk=p[4],
        wk_s=p[5],
        wv=p[6],
        bv=p[7],
        wv_s=p[8],
        wo=p[9],
        bo=p[10],
        wo_s=p[11],
        q_norm=qk[0].module.weight.data_ptr() if qk[0] else None,
        k_norm=qk[1].module.weight.data_ptr() if qk[1] else None,
        post_norm=norms[1].module.weight.data_ptr(),
        next_norm=norms[2].module.weight.data_ptr(),
    )


def router_fields(block: OffloadedMoeBlock, x: torch.Tensor, keep_alive: list[object]) -> dict:
    """The LayerSpec fields of a block's router: the native softmax top-k router once it has passed its
    first-call check (engine/native/router.py), or a DeepSeek-V3-style sigmoid router checked here, once,
    against its own forward on a random row (engine/native/router.py's NativeSigmoidRouter, as the lean path runs it)."""
    where = f"layer {block.layer}"
    native = block.adapter.decide_native_router(block)
    if isinstance(native, NativeTopKRouter):
        if native.verified is None:  # not routed a one-token step yet: its check, on a random row
            native(random_row(native.weight.shape[1], x.dtype, block.layer))
        if native.verified is None:
            raise NotYet
        if not native.verified or native.top_k > MAX_TOPK:
            raise Unsupported(f"{where}: the router does not run natively")
        return dict(
            router_kind=ROUTER_SOFTMAX,
            router=native.weight.data_ptr(),
            topk=native.top_k,
            norm_topk=int(native.norm),
        )
    router: Any = getattr(block, str(block.adapter.router))
    if not isinstance(native, NativeSigmoidRouter):
        raise Unsupported(f"{where}: a {type(router).__name__}, which does not run natively")
    if (
        native.verified is None
    ):  # its first-call check against the router's forward, on a random row
        native(random_row(router.weight.shape[1], x.dtype, block.layer))
    if not native.verified:
        raise Unsupported(
            f"{where}: the native sigmoid router does not match {type(router).__name__}"
        )
    w, bias, k, groups, keep, norm, scale = (
        router.weight,
        native.bias,
        native.top_k,
        native.groups,
        native.keep,
        native.norm,
        native.scale,
    )
    keep_alive.append(bias)
    return dict(
        router_kind=ROUTER_SIGMOID,
        router=w.data_ptr(),
        router_wtype=W_CODES[w.dtype],
        topk=k,
        norm_topk=int(norm),
        n_group=groups,
        topk_group=keep,
        score_bias=None if bias is None else bias.data_ptr(),
        routed_scale=scale,
    )


def shared_expert(block: OffloadedMoeBlock) -> nn.Module | None:
    """The block's shared expert, as BlockAdapter.dense finds it (Qwen2-MoE's `shared_expert`, GLM-4-MoE's
    `shared_experts`), or None."""
    shared = block._modules.get("shared_expert")
    return block._modules.get("shared_experts") if shared is None else shared


def proj_wtype(weights: list[torch.Tensor], dtype: torch.dtype) -> int:
    """The W_* code of a layer's float projection weights (one for all of them: decode_layer.c's proj_wtype);
    `dtype`'s where there are none (every projection int8)."""
    dtypes = {w.dtype for w in weights} or {dtype}
    if len(dtypes) != 1:
        raise Unsupported("projection weights of several dtypes")
    return W_CODES[dtypes.pop()]


def swiglu_fields(mlp: Any, dtype: torch.dtype, what: str, wtype: int) -> dict:
    """The LayerSpec sh_* fields of a SwiGLU MLP (gate_proj, up_proj, down_proj without biases, SiLU), run as
    its forward runs it; raises Unsupported for another form. `wtype`: the layer's proj_wtype
    (attention_fields'), which its float weights must share."""
    act = getattr(mlp, "act_fn", None)
    if type(act).__name__ not in ("SiLUActivation", "SiLU") or not all(
        isinstance(getattr(mlp, n, None), (nn.Linear, QuantLinear))
        for n in ("gate_proj", "up_proj", "down_proj")
    ):
        raise Unsupported(f"{what} is not a plain SwiGLU MLP")
    (gate, gb, gs), (up, ub, us), (down, db, ds) = (
        linear_weights(getattr(mlp, n), dtype) for n in ("gate_proj", "up_proj", "down_proj")
    )
    if gb is not None or ub is not None or db is not None:
        raise Unsupported(f"{what} has biases")
    own = proj_wtype([w for w, s in ((gate, gs), (up, us), (down, ds)) if s is None], dtype)
    if own != wtype and any(s is None for s in (gs, us, ds)):
        raise Unsupported(f"{what}: weights in another dtype than the attention projections'")
    return dict(
        sh_gate=gate.data_ptr(),
        sh_up=up.data_ptr(),
        sh_down=down.data_ptr(),
        sh_I=gate.shape[0],
        sh_gate_s=gs.data_ptr() if gs is not None else None,
        sh_up_s=us.data_ptr() if us is not None else None,
        sh_down_s=ds.data_ptr() if ds is not None else None,
    )


def random_row(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A random row [1, n] for a first-call check the step runs itself (a router or norm that no one-row
    step has called yet: a server whose first steps are batched)."""
    return torch.randn((1, n), generator=torch.Generator().manual_seed(seed)).to(dtype)


def norm(module: Any, dtype: torch.dtype) -> NativeRMSNorm:
    """The module's native norm, checked against the module (on a random row, where no step has yet); NotYet
    where that check cannot run natively yet."""
    fn = module
    if not isinstance(fn, NativeRMSNorm) or fn.verified is False:
        raise Unsupported(f"{type(module).__name__} does not run natively")
    if fn.verified is None:
        w = fn.module.weight
        fn(random_row(w.shape[0], w.dtype, 0))
    if fn.verified is None:
        raise NotYet
    if fn.verified is False:
        raise Unsupported(f"{type(module).__name__} does not run natively")
    w = fn.module.weight
    if (
        w.dtype not in (torch.float32, torch.bfloat16)
        or not w.is_contiguous()
        or w.device.type != "cpu"
    ):
        raise Unsupported(f"{type(module).__name__}: a weight the native norm does not read")
    return fn


def linear_weights(
    proj: Any, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(weight, bias, row scales) of a plain linear projection in the activation dtype (scales None), or of an
    int8 QuantLinear (its codes and fp16 scales; the bias in the activation dtype)."""
    if isinstance(proj, QuantLinear):
        b = proj.bias
        if (
            proj.qweight.device.type != "cpu"
            or not proj.qweight.is_contiguous()
            or (b is not None and (b.dtype != dtype or not b.is_contiguous()))
        ):
            raise Unsupported("an int8 projection the native gemv does not read")
        return proj.qweight, b, proj.scale
    if type(proj) not in (nn.Linear, NativeLinear):
        raise Unsupported(f"a projection of type {type(proj).__name__}")
    w, b = proj.weight, proj.bias
    if (
        not reads_weights(w.dtype, dtype)  # bf16 weights of an f32 model: quant_linear.narrow_dense
        or not w.is_contiguous()
        or w.device.type != "cpu"
        or (b is not None and (b.dtype != dtype or not b.is_contiguous()))
    ):
        raise Unsupported("a projection weight the native gemv does not read")
    return w, b, None
