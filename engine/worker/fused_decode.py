"""A one-token decode step's decoder layers, one native call each (engine/native/decode_layer.c).

Why: with every expert resident, a decode layer of engine/worker/lean_forward.py is eight native
kernels and the Python that calls them (projections, attention, norms, router, experts): 0.37 ms
of Python a layer on the tiny peers checkpoint and 0.68 on the mid one, as measured on the eleventh
session's machine (docs/benchmarks/peers.md, History), against llama.cpp's one graph per token.
`decode_layer` runs the same kernels in the same order on the same buffers, so Python is left with
one call, the KV cache's bookkeeping and the hit counters: 14 us a layer on the tiny checkpoint,
67-78 on the mid one (each call there follows 50 MB of streamed weights, so the interpreter's own
data comes from memory).

When: a lean-forward decode step of one request on the CPU (the native kernels), the cache within
the native attention's range, the model's every layer a plain llama-style MoE layer (a softmax
top-k router, routed SwiGLU experts the native MoE call reads, at most a SwiGLU shared expert with an
optional sigmoid gate as Qwen2-MoE's; no dense MLP layer), every
expert resident for good (`ExpertStore.complete`, the resident lane of engine/experts/moe_executor.py)
and nothing listening to the routing (traces, predictors) or planning around misses (CPU experts,
the utility estimator). Its norms and router must have passed their first-call check against the
modules they replace (engine/native/layers.py, router.py): the first decode steps run the
layer-by-layer path, which does those checks, and this takes over once they have passed. Anything
else keeps the layer-by-layer path, step by step.

Exactness: the same arithmetic as the layer-by-layer path, bit for bit, except in f32 models, where
the attention projections run the native gemv instead of torch's F.linear: another order of each
dot product's sum, logits within f32 rounding (tests/test_fused_decode.py). A shared expert's SiLU and
gate sigmoid are computed with the C library's expf where the layer-by-layer path runs torch's
vectorised exp: in bf16 a product may then round the other way now and then (same greedy tokens,
logits within a few bf16 ulps in the test).
`MOE_OFFLOAD_FUSED_DECODE=0` turns it off.
"""
from __future__ import annotations

import ctypes
import os

import torch
from torch import nn
from transformers import DynamicCache

from engine.experts.moe_block import OffloadedMoeBlock
from engine.native.kernels import W_CODES, X_CODES, NativeKernels
from engine.native.layers import NativeLinear, NativeRMSNorm
from engine.native.router import NativeTopKRouter
from engine.weights.moe_hook import BlockAdapter
from engine.worker.kv_cache import InPlaceLayer

_I64, _F, _P = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
MAX_TOPK = 64  # decode_layer.c's limit


class LayerSpec(ctypes.Structure):
    """decode_layer.c's `layer_spec_t`: the same fields in the same order."""

    _fields_ = ([(n, _I64) for n in ("xtype", "proj_wtype", "norm_wtype", "expert_wtype", "H", "hq", "hk", "d", "rot", "E",
                                     "topk", "I", "norm_topk")]
                + [(n, _F) for n in ("q_eps", "k_eps", "post_eps", "next_eps", "scale", "pad_")]
                + [(n, _P) for n in ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo", "q_norm", "k_norm", "post_norm", "next_norm",
                                     "router", "gate_up", "gate_up_scale", "down", "down_scale", "sh_gate", "sh_up", "sh_down",
                                     "sh_gate_w")]
                + [("sh_I", _I64)])


def fused_decode_enabled() -> bool:
    return os.environ.get("MOE_OFFLOAD_FUSED_DECODE", "1") != "0"


class NotYet(Exception):
    """A check this path relies on has not run yet (a norm or router not called natively so far)."""


class Unsupported(Exception):
    """This model can never take the fused path; the message says why."""


class FusedDecode:
    """Built once per model by `LeanForward`; `step` runs a decode step's layers or declines."""

    def __init__(self, kernels: NativeKernels, layers: list, final_norm: nn.Module) -> None:
        self.kernels, self.layers, self.final_norm = kernels, layers, final_norm
        self.state = "pending"  # "pending": try to build at the next step; "ready"; "off": never (see why)
        self.why = ""
        self._specs: list[LayerSpec] = []
        self._keep: list[object] = []  # the pointer tables the specs point into: alive as long as they are
        self._blocks: list[OffloadedMoeBlock] = [layer.mlp for layer in layers]
        if not all(isinstance(b, OffloadedMoeBlock) for b in self._blocks):
            self.state, self.why = "off", "a layer without routed experts"
        self._rot = -1
        self._positions = 0  # cached positions the scratch buffer has room for
        self._dtype: torch.dtype | None = None
        self._work: torch.Tensor | None = None
        self._kv_like: torch.Tensor | None = None  # a [1, hk, 1, d] row for a cache layer's first append or growth

    def step(self, x: torch.Tensor, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: DynamicCache,
             max_positions: int) -> bool:
        """Run every layer on x (the embedded row [1, H]) and h (its input norm), in place: x ends as the
        residual stream and h as the final norm's output. Returns False, having changed nothing, where
        this step cannot take the fused path."""
        if self.state == "off":
            return False
        # What can change from a step to the next, cheapest first; then, until it has been built, the build.
        for block in self._blocks:
            executor = block.executor
            if (not executor.store.complete or not executor._lane_open() or block.bus.active
                    or "forward" in block.__dict__):  # a wrapped forward (a benchmark's timer) must run
                return False
        if self.state != "ready" and not self._build(x, cos, max_positions):
            return False
        if x.dtype is not self._dtype or cos.shape[-1] != self._rot or not (cos.is_contiguous() and sin.is_contiguous()):
            return False
        layers = cache.layers
        if len(layers) < len(self._specs) or not all(type(c) is InPlaceLayer for c in layers[: len(self._specs)]):
            return False
        if layers[0].get_seq_length() + 1 > min(max_positions, self._positions):  # the scratch holds scores for _positions
            return False
        lib, nt = self.kernels.lib, torch.get_num_threads()
        xp, hp, cp, sp, work = x.data_ptr(), h.data_ptr(), cos.data_ptr(), sin.data_ptr(), self._work.data_ptr()
        kv_like = self._kv_like
        for spec, c in zip(self._specs, layers):
            kb, vb, at = c.reserve(kv_like, kv_like)
            if kb.dtype is not kv_like.dtype:  # a request's cache holds its model's dtype: a bug, not an input
                raise RuntimeError(f"KV cache in {kb.dtype} for a {kv_like.dtype} decode step")
            rc = lib.decode_layer(ctypes.byref(spec), xp, hp, cp, sp, kb.data_ptr(), vb.data_ptr(), kb.shape[2], at, work, nt)
            if rc != 0:  # the specs were checked when built: a bug, not an input
                raise RuntimeError(f"native decode_layer failed ({rc})")
            c.advance(at + 1)
        for block, spec in zip(self._blocks, self._specs):
            block.executor.stats.record_all_hits(block.layer, spec.topk)
        return True

    def _build(self, x: torch.Tensor, cos: torch.Tensor, max_positions: int) -> bool:
        try:
            self._specs, self._keep = [], []
            for i, layer in enumerate(self.layers):
                nxt = self.layers[i + 1].in_norm if i + 1 < len(self.layers) else self.final_norm
                self._specs.append(self._spec(layer, nxt, x, cos))
        except NotYet:
            return False
        except Unsupported as e:
            self.state, self.why = "off", str(e)
            return False
        self._rot, self._dtype, self._positions = cos.shape[-1], x.dtype, max_positions
        nbytes = max(self.kernels.lib.decode_layer_work_bytes(ctypes.byref(s), max_positions) for s in self._specs)
        self._work = torch.empty(nbytes, dtype=torch.uint8)
        att = self.layers[0].att
        self._kv_like = torch.zeros((1, self._specs[0].hk, 1, att.head_dim), dtype=x.dtype)
        self.state = "ready"
        return True

    def _spec(self, layer, next_norm: nn.Module, x: torch.Tensor, cos: torch.Tensor) -> LayerSpec:
        """One layer's LayerSpec; raises NotYet or Unsupported."""
        dtype, att, block = x.dtype, layer.att, layer.mlp
        if dtype not in X_CODES or x.device.type != "cpu":
            raise Unsupported(f"activations in {dtype} on {x.device.type}")
        if type(block.adapter) is not BlockAdapter or not block.plain_output:
            raise Unsupported(f"layer {att.layer_idx}: not a plain routed MoE block")
        shared = _shared_expert(block, dtype)
        router = block.adapter._native_router
        if router is None or (isinstance(router, NativeTopKRouter) and router.verified is None):
            raise NotYet
        if not isinstance(router, NativeTopKRouter) or not router.verified or router.top_k > MAX_TOPK:
            raise Unsupported(f"layer {att.layer_idx}: the router does not run natively")
        executor = block.executor
        moe = executor._native
        if moe is None or not moe.accepts(x) or executor.store.slots.device.type != "cpu":
            raise Unsupported(f"layer {att.layer_idx}: its experts do not run natively for {dtype} rows")
        norms = [_norm(m, dtype) for m in (layer.in_norm, layer.post_norm, next_norm)]
        qk = [_norm(m, dtype) for m in (layer.q_norm, layer.k_norm)] if layer.q_norm is not None else [None, None]
        projections = [_weights(p, dtype) for p in (layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj)]
        d = att.head_dim
        hq, hk = layer.q_proj.weight.shape[0] // d, layer.k_proj.weight.shape[0] // d
        if hq % hk or hq // hk > 64 or d > 1024 or cos.shape[-1] % 2 or cos.shape[-1] > d:
            raise Unsupported("an attention shape the native kernel does not take")
        E, layer_index = executor.num_experts, block.layer
        slots = [executor._pointers[executor.store.slot_index(layer_index * E + e)] for e in range(E)]
        tables = [(_P * E)(*(s[j] for s in slots)) for j in range(4)]  # gate_up, its scales, down, its scales
        self._keep.append(tables)  # read below, valid for good: step() found the store complete
        norm_dtypes = {n.module.weight.dtype for n in norms + [q for q in qk if q is not None]}
        if len(norm_dtypes) != 1:
            raise Unsupported("norm weights of several dtypes")
        p = [t.data_ptr() if t is not None else None for t in (w for pair in projections for w in pair)]
        spec = LayerSpec(
            xtype=X_CODES[dtype], proj_wtype=W_CODES[dtype], norm_wtype=W_CODES[norm_dtypes.pop()], expert_wtype=W_CODES[moe.weight_dtype],
            H=x.shape[-1], hq=hq, hk=hk, d=d, rot=cos.shape[-1], E=E, topk=router.top_k, I=moe.intermediate, norm_topk=int(router.norm),
            q_eps=qk[0].eps if qk[0] else 0.0, k_eps=qk[1].eps if qk[1] else 0.0, post_eps=norms[1].eps, next_eps=norms[2].eps,
            scale=float(att.scaling), wq=p[0], bq=p[1], wk=p[2], bk=p[3], wv=p[4], bv=p[5], wo=p[6], bo=p[7],
            q_norm=qk[0].module.weight.data_ptr() if qk[0] else None, k_norm=qk[1].module.weight.data_ptr() if qk[1] else None,
            post_norm=norms[1].module.weight.data_ptr(), next_norm=norms[2].module.weight.data_ptr(), router=router.weight.data_ptr(),
            gate_up=ctypes.addressof(tables[0]), down=ctypes.addressof(tables[2]),
            gate_up_scale=ctypes.addressof(tables[1]) if moe.quantized else None,
            down_scale=ctypes.addressof(tables[3]) if moe.quantized else None)
        if shared is not None:
            (gate, up, down), gate_w = shared
            spec.sh_gate, spec.sh_up, spec.sh_down, spec.sh_I = gate.data_ptr(), up.data_ptr(), down.data_ptr(), gate.shape[0]
            spec.sh_gate_w = gate_w.data_ptr() if gate_w is not None else None
        return spec


def _shared_expert(block: OffloadedMoeBlock, dtype: torch.dtype) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None] | None:
    """((gate_proj, up_proj, down_proj weights), the sigmoid gate's weight or None) of the block's shared expert, as
    BlockAdapter.dense runs it (Qwen2-MoE's `shared_expert` and `shared_expert_gate`), or None where it has none;
    raises Unsupported for a shared expert of another form."""
    modules = block._modules
    shared = modules.get("shared_expert")
    shared = modules.get("shared_experts") if shared is None else shared
    if shared is None:
        return None
    act = getattr(shared, "act_fn", None)
    if ("forward" in shared.__dict__ or type(act).__name__ not in ("SiLUActivation", "SiLU")
            or not all(isinstance(getattr(shared, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj"))):
        raise Unsupported(f"layer {block.layer}: a shared expert that is not a plain SwiGLU MLP")
    projections = tuple(_weights(getattr(shared, n), dtype) for n in ("gate_proj", "up_proj", "down_proj"))
    gate = modules.get("shared_expert_gate")
    gate_w = None
    if gate is not None:
        gate_w, gate_b = _weights(gate, dtype)
        if gate_w.shape[0] != 1 or gate_b is not None:
            raise Unsupported(f"layer {block.layer}: a shared expert gate of another shape")
    if any(b is not None for _, b in projections):
        raise Unsupported(f"layer {block.layer}: a shared expert with biases")
    return tuple(w for w, _ in projections), gate_w


def _norm(module: nn.Module, dtype: torch.dtype) -> NativeRMSNorm:
    """The module's native norm, checked against the module; NotYet before its first check."""
    fn = module.forward
    if not isinstance(fn, NativeRMSNorm) or fn.verified is False:
        raise Unsupported(f"{type(module).__name__} does not run natively")
    if fn.verified is None:
        raise NotYet
    w = fn.module.weight
    if w.dtype not in (torch.float32, torch.bfloat16) or not w.is_contiguous() or w.device.type != "cpu":
        raise Unsupported(f"{type(module).__name__}: a weight the native norm does not read")
    return fn


def _weights(proj: nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) of a plain linear projection in the activation dtype."""
    if type(proj) not in (nn.Linear, NativeLinear) or "forward" in proj.__dict__:
        raise Unsupported(f"a projection of type {type(proj).__name__}")
    w, b = proj.weight, proj.bias
    if w.dtype != dtype or not w.is_contiguous() or w.device.type != "cpu" or (b is not None and (b.dtype != dtype or not b.is_contiguous())):
        raise Unsupported("a projection weight the native gemv does not read")
    return w, b
