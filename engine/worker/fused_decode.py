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
the native attention's range, the model's every layer a llama-style MoE layer (a softmax top-k
router, or a DeepSeek-V3-style sigmoid router with correction bias and groups as GLM-4-MoE's; routed
SwiGLU experts the native MoE call reads; at most a SwiGLU shared expert, gated as Qwen2-MoE's or not)
or a dense SwiGLU layer (GLM-4-MoE's first ones), every
expert resident for good (`ExpertStore.complete`, the resident lane of engine/experts/moe_executor.py)
and nothing listening to the routing (traces, predictors) or planning around misses (CPU experts,
the utility estimator). Its norms and router must have passed their first-call check against the
modules they replace (engine/native/layers.py, router.py): the first decode steps run the
layer-by-layer path, which does those checks, and this takes over once they have passed. Anything
else keeps the layer-by-layer path, step by step.

Exactness: the same arithmetic as the layer-by-layer path, bit for bit, except in f32 models, where
the attention projections run the native gemv instead of torch's F.linear: another order of each
dot product's sum, logits within f32 rounding (tests/test_fused_decode.py). A shared expert's SiLU and
gate sigmoid and the sigmoid router are computed with the C library's expf where the layer-by-layer
path runs torch's vectorised exp (and the sigmoid router's f32 logits with the native gemv's sums): in
bf16 a product may then round the other way now and then (same greedy tokens, logits within a few bf16
ulps in the test; the tiny checkpoints and the embedded model came out bit-identical). The sigmoid
router is checked once against its module's forward on a random row when the step is built.
`--forward lean` turns it off.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

from engine.experts.moe_block import OffloadedMoeBlock
from engine.native.kernels import W_CODES, X_CODES, NativeKernels
from engine.native.layers import NativeLinear, NativeRMSNorm
from engine.native.router import NativeTopKRouter, same_routing
from engine.weights.moe_hook import BlockAdapter
from engine.worker import dispatch
from engine.worker.kv_cache import InPlaceLayer

_I64, _F, _P = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
MAX_TOPK = 64  # decode_layer.c's limits: experts a row, and rows a step
MAX_ROWS = 16


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
    )


ROUTER_SOFTMAX, ROUTER_SIGMOID, ROUTER_NONE = 0, 1, 2  # decode_layer.c's router kinds
SIGMOID_ROUTERS = frozenset(
    {"Glm4MoeTopkRouter", "DeepseekV3TopkRouter"}
)  # router_sigmoid's arithmetic, checked on first build


class NotYet(Exception):
    """A check this path relies on has not run yet (a norm or router not called natively so far)."""


class Unsupported(Exception):
    """This model can never take the fused path; the message says why."""


class FusedDecode:
    """Built once per model by `LeanForward`; `step` runs a decode step's layers or declines."""

    def __init__(self, kernels: NativeKernels, layers: list, final_norm: nn.Module) -> None:
        self.kernels, self.layers, self.final_norm = kernels, layers, final_norm
        self.state = (
            "pending"  # "pending": try to build at the next step; "ready"; "off": never (see why)
        )
        self.why = ""
        self._specs: list[LayerSpec] = []
        self._keep: list[
            object
        ] = []  # the pointer tables the specs point into: alive as long as they are
        # The MoE blocks (dense layers have none), whose stores and listeners each step checks.
        self._blocks: list[OffloadedMoeBlock] = [
            layer.mlp for layer in layers if isinstance(layer.mlp, OffloadedMoeBlock)
        ]
        if not self._blocks:
            self.state, self.why = "off", "no routed experts"
        self._hit_calls: list[
            tuple[OffloadedMoeBlock, int]
        ] = []  # each MoE block and the experts its router picks
        # Each MoE layer's routing as the native call writes it: (block, x [1, H], logits [1, E] f32,
        # weights [1, k] f32, ids [1, k] int64), published on the routing bus after the step (deferred listeners).
        self._routes: list[
            tuple[OffloadedMoeBlock, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
        ] = []
        self._rot = -1
        self._positions = 0  # cached positions the scratch buffer has room for
        self._dtype: torch.dtype | None = None
        self._work: torch.Tensor | None = None
        self._kv_like: torch.Tensor | None = (
            None  # [1, hk, MAX_ROWS, d] rows for a cache layer's first append or growth
        )
        self._row_kv: tuple = ()

    def shape_flags(self) -> tuple[bool, bool, bool, bool]:
        """(all resident, planned per layer, live listener, wrapped) of the model's MoE blocks, for the
        dispatcher's StepShape (engine/worker/dispatch.py): what can change from a step to the next."""
        resident, planned, live, wrapped = True, False, False, False
        for block in self._blocks:
            executor = block.executor
            resident = resident and executor.store.complete
            planned = planned or not executor.lane_open()
            live = live or block.bus.live
            wrapped = wrapped or bool(block.timers)  # a benchmark's timer must see the block run
        return resident, planned, live, wrapped

    def step(
        self,
        x: torch.Tensor,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        caches: list[DynamicCache],
        rows: tuple[int, ...],
        max_positions: int,
    ) -> str | None:
        """Run every layer on x (the embedded rows [R, H], R = sum(rows) <= MAX_ROWS: rows[i] of request i, whose
        cache is caches[i], in that order) and h (their input norm), in place: x ends as the residual stream and
        h as the final norm's output. A request's rows are consecutive positions after its cached ones (a decode
        row, or a verification window, attending causally). The dispatcher has found the step's shape fit
        (engine/worker/dispatch.py `fused_decline`). Returns None, or why it declined, having changed nothing
        (one of dispatch's reasons)."""
        if self.state == "off":
            return dispatch.LAYER_UNSUPPORTED
        if self.state != "ready" and not self._build(x[:1], cos, max_positions):
            return dispatch.LAYER_UNSUPPORTED if self.state == "off" else dispatch.CHECKS_PENDING
        if (
            x.dtype is not self._dtype
            or cos.shape[-1] != self._rot
            or not (cos.is_contiguous() and sin.is_contiguous())
        ):
            return dispatch.NOT_PLANNED
        n_specs, limit = (
            len(self._specs),
            min(max_positions, self._positions),
        )  # the scratch holds scores for _positions
        for c, n in zip(caches, rows):
            layers: list[Any] = c.layers  # InPlaceLayer, checked here
            if len(layers) < n_specs or not all(
                type(layer) is InPlaceLayer for layer in layers[:n_specs]
            ):
                return dispatch.NOT_PLANNED
            if layers[0].get_seq_length() + n > limit:
                return dispatch.OUT_OF_RANGE
        lib, nt, R = self.kernels.lib, torch.get_num_threads(), x.shape[0]
        assert self._work is not None and self._kv_like is not None  # built
        xp, hp, cp, sp, work = (
            x.data_ptr(),
            h.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            self._work.data_ptr(),
        )
        kptrs, vptrs, caps, ats = self._row_kv
        like = [
            self._kv_like.narrow(2, 0, n) for n in rows
        ]  # [1, hk, n, d]: what each request's rows append
        for i, spec in enumerate(self._specs):
            r, ends = 0, []
            for c, n, kv in zip(caches, rows, like):
                layer: Any = c.layers[i]
                kb, vb, at = layer.reserve(kv, kv)
                if (
                    kb.dtype is not kv.dtype
                ):  # a request's cache holds its model's dtype: a bug, not an input
                    raise RuntimeError(f"KV cache in {kb.dtype} for a {kv.dtype} decode step")
                for j in range(n):
                    kptrs[r], vptrs[r], caps[r], ats[r] = (
                        kb.data_ptr(),
                        vb.data_ptr(),
                        kb.shape[2],
                        at + j,
                    )
                    r += 1
                ends.append((layer, at + n))
            rc = lib.decode_layer(
                ctypes.byref(spec), R, xp, hp, cp, sp, kptrs, vptrs, caps, ats, work, nt
            )
            if rc != 0:  # the specs were checked when built: a bug, not an input
                raise RuntimeError(f"native decode_layer failed ({rc})")
            for layer, end in ends:
                layer.advance(end)
        for block, calls in self._hit_calls:
            block.executor.stats.record_all_hits(block.layer, calls * R)
        if self._blocks[0].bus.active:
            self._publish_routing(R)
        return None

    def _publish_routing(self, R: int) -> None:
        """The step's routing (R rows), layer by layer, to the bus's deferred listeners (copies: the buffers are
        rewritten by the next step). As the layer-by-layer path publishes it, the top-k best first by
        weight; the logits and weights in float32."""
        for block, x, logits, weights, ids in self._routes:
            x, logits, w, i = (
                x[:R].clone(),
                logits[:R].clone(),
                weights[:R].clone(),
                ids[:R].clone(),
            )
            if (
                not block.adapter.sorted_topk
            ):  # a sigmoid router's ids come in the order of its biased scores
                order = torch.argsort(w, dim=1, descending=True, stable=True)
                w, i = w.gather(1, order), i.gather(1, order)
            block.bus.publish(block.layer, x, logits, i, w)

    def _build(self, x: torch.Tensor, cos: torch.Tensor, max_positions: int) -> bool:
        try:
            self._specs, self._keep, self._hit_calls, self._routes = [], [], [], []
            for i, layer in enumerate(self.layers):
                nxt = self.layers[i + 1].in_norm if i + 1 < len(self.layers) else self.final_norm
                self._specs.append(self._spec(layer, nxt, x, cos))
        except NotYet:
            return False
        except Unsupported as e:
            self.state, self.why = "off", str(e)
            return False
        self._rot, self._dtype, self._positions = cos.shape[-1], x.dtype, max_positions
        nbytes = max(
            self.kernels.lib.decode_layer_work_bytes(ctypes.byref(s), max_positions, MAX_ROWS)
            for s in self._specs
        )
        self._work = torch.empty(nbytes, dtype=torch.uint8)
        att = self.layers[0].att
        self._kv_like = torch.zeros((1, self._specs[0].hk, MAX_ROWS, att.head_dim), dtype=x.dtype)
        # Each row's KV buffers, their capacities and its position, filled per layer per step.
        self._row_kv = (
            (_P * MAX_ROWS)(),
            (_P * MAX_ROWS)(),
            (_I64 * MAX_ROWS)(),
            (_I64 * MAX_ROWS)(),
        )
        self.state = "ready"
        return True

    def _spec(self, layer: Any, next_norm: Any, x: torch.Tensor, cos: torch.Tensor) -> LayerSpec:
        """One layer's LayerSpec; raises NotYet or Unsupported."""
        dtype = x.dtype
        if dtype not in X_CODES or x.device.type != "cpu":
            raise Unsupported(f"activations in {dtype} on {x.device.type}")
        fields = self._attention_fields(layer, next_norm, x, cos)
        if isinstance(layer.mlp, OffloadedMoeBlock):
            fields.update(self._moe_fields(layer.mlp, x))
        else:  # a dense layer (GLM-4-MoE's and DeepSeek-V3's first ones): its SwiGLU MLP alone
            fields.update(
                _swiglu_fields(layer.mlp, dtype, f"layer {layer.att.layer_idx}'s MLP"),
                router_kind=ROUTER_NONE,
            )
        return LayerSpec(**fields)

    def _attention_fields(
        self, layer: Any, next_norm: Any, x: torch.Tensor, cos: torch.Tensor
    ) -> dict:
        """The LayerSpec fields of the attention half, the norms and the dtypes."""
        dtype, att = x.dtype, layer.att
        norms = [_norm(m, dtype) for m in (layer.in_norm, layer.post_norm, next_norm)]
        qk = (
            [_norm(m, dtype) for m in (layer.q_norm, layer.k_norm)]
            if layer.q_norm is not None
            else [None, None]
        )
        projections = [
            _weights(p, dtype) for p in (layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj)
        ]
        d = att.head_dim
        hq, hk = layer.q_proj.weight.shape[0] // d, layer.k_proj.weight.shape[0] // d
        if hq % hk or hq // hk > 64 or d > 1024 or cos.shape[-1] % 2 or cos.shape[-1] > d:
            raise Unsupported("an attention shape the native kernel does not take")
        norm_dtypes = {n.module.weight.dtype for n in norms + [q for q in qk if q is not None]}
        if len(norm_dtypes) != 1:
            raise Unsupported("norm weights of several dtypes")
        p = [
            t.data_ptr() if t is not None else None
            for t in (w for pair in projections for w in pair)
        ]
        return dict(
            xtype=X_CODES[dtype],
            proj_wtype=W_CODES[dtype],
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
            wk=p[2],
            bk=p[3],
            wv=p[4],
            bv=p[5],
            wo=p[6],
            bo=p[7],
            q_norm=qk[0].module.weight.data_ptr() if qk[0] else None,
            k_norm=qk[1].module.weight.data_ptr() if qk[1] else None,
            post_norm=norms[1].module.weight.data_ptr(),
            next_norm=norms[2].module.weight.data_ptr(),
        )

    def _moe_fields(self, block: OffloadedMoeBlock, x: torch.Tensor) -> dict:
        """The LayerSpec fields of a MoE block: its router, the pointer tables of its experts, its shared expert."""
        dtype, where = x.dtype, f"layer {block.layer}"
        if type(block.adapter) is not BlockAdapter or not block.plain_output:
            raise Unsupported(f"{where}: not a plain routed MoE block")
        executor = block.executor
        moe = executor.native_moe
        if moe is None or not moe.accepts(x) or executor.store.slots.device.type != "cpu":
            raise Unsupported(f"{where}: its experts do not run natively for {dtype} rows")
        fields = self._router_fields(block, x)
        E = executor.num_experts
        slots = executor.expert_pointers(block.layer)
        tables = [
            (_P * E)(*(s[j] for s in slots)) for j in range(4)
        ]  # gate_up, its scales, down, its scales
        self._keep.append(tables)  # read below, valid for good: step() found the store complete
        self._hit_calls.append((block, fields["topk"]))
        k = fields["topk"]
        route = (
            block,
            torch.zeros((MAX_ROWS, x.shape[-1]), dtype=dtype),
            torch.zeros((MAX_ROWS, E)),
            torch.zeros((MAX_ROWS, k)),
            torch.zeros((MAX_ROWS, k), dtype=torch.int64),
        )
        self._routes.append(route)  # alive as long as the specs that point into them
        fields.update(
            route_x=route[1].data_ptr(),
            route_logits=route[2].data_ptr(),
            route_weights=route[3].data_ptr(),
            route_ids=route[4].data_ptr(),
        )
        fields.update(
            E=E,
            I=moe.intermediate,
            expert_wtype=W_CODES[moe.weight_dtype],
            gate_up=ctypes.addressof(tables[0]),
            down=ctypes.addressof(tables[2]),
            gate_up_scale=ctypes.addressof(tables[1]) if moe.quantized else None,
            down_scale=ctypes.addressof(tables[3]) if moe.quantized else None,
        )
        shared = _shared_expert(block)
        if shared is not None:
            fields.update(_swiglu_fields(shared, dtype, f"{where}'s shared expert"))
            gate = block._modules.get("shared_expert_gate")
            if gate is not None:
                gate_w, gate_b = _weights(gate, dtype)
                if gate_w.shape[0] != 1 or gate_b is not None:
                    raise Unsupported(f"{where}: a shared expert gate of another shape")
                fields["sh_gate_w"] = gate_w.data_ptr()
        return fields

    def _router_fields(self, block: OffloadedMoeBlock, x: torch.Tensor) -> dict:
        """The LayerSpec fields of a block's router: the native softmax top-k router once it has passed its
        first-call check (engine/native/router.py), or a DeepSeek-V3-style sigmoid router checked here, once,
        against its own forward on a random row."""
        where = f"layer {block.layer}"
        native = block.adapter.decide_native_router(block)
        if isinstance(native, NativeTopKRouter):
            if (
                native.verified is None
            ):  # not routed a one-token step yet: its check, on a random row
                native(_probe(native.weight.shape[1], x.dtype, block.layer))
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
        if type(router).__name__ not in SIGMOID_ROUTERS:
            raise Unsupported(f"{where}: a {type(router).__name__}, which does not run natively")
        w = router.weight
        bias = getattr(router, "e_score_correction_bias", None)
        bias = (
            bias.detach().float().contiguous() if bias is not None else None
        )  # f32, as the router adds it
        k, groups, keep, norm, scale = (
            router.top_k,
            router.num_group,
            router.topk_group,
            bool(router.norm_topk_prob),
            float(router.routed_scaling_factor),
        )
        if (
            w.dtype not in W_CODES
            or w.dtype == torch.int8
            or not w.is_contiguous()
            or w.device.type != "cpu"
            or k > MAX_TOPK
        ):
            raise Unsupported(f"{where}: a router weight the native kernel does not read")
        probe = _probe(w.shape[1], x.dtype, block.layer)
        got = self.kernels.router_sigmoid(probe, w, bias, k, groups, keep, norm, scale)
        if got is None or not same_routing(_by_id(got), _by_id(router.forward(probe)), 1e-5):
            raise Unsupported(
                f"{where}: the native sigmoid router does not match {type(router).__name__}"
            )
        self._keep.append(bias)
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


def _by_id(
    routing: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits, weights, ids) with the top-k in ascending expert order: DeepSeek-V3-style routers take
    topk(sorted=False), whose order is unspecified, so two results compare as sets."""
    logits, weights, ids = routing
    order = torch.argsort(ids, dim=1)
    return logits, weights.gather(1, order), ids.gather(1, order)


def _shared_expert(block: OffloadedMoeBlock) -> nn.Module | None:
    """The block's shared expert, as BlockAdapter.dense finds it (Qwen2-MoE's `shared_expert`, GLM-4-MoE's
    `shared_experts`), or None."""
    shared = block._modules.get("shared_expert")
    return block._modules.get("shared_experts") if shared is None else shared


def _swiglu_fields(mlp: Any, dtype: torch.dtype, what: str) -> dict:
    """The LayerSpec sh_* fields of a SwiGLU MLP (gate_proj, up_proj, down_proj without biases, SiLU), run as
    its forward runs it; raises Unsupported for another form."""
    act = getattr(mlp, "act_fn", None)
    if type(act).__name__ not in ("SiLUActivation", "SiLU") or not all(
        isinstance(getattr(mlp, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")
    ):
        raise Unsupported(f"{what} is not a plain SwiGLU MLP")
    (gate, gb), (up, ub), (down, db) = (
        _weights(getattr(mlp, n), dtype) for n in ("gate_proj", "up_proj", "down_proj")
    )
    if gb is not None or ub is not None or db is not None:
        raise Unsupported(f"{what} has biases")
    return dict(
        sh_gate=gate.data_ptr(), sh_up=up.data_ptr(), sh_down=down.data_ptr(), sh_I=gate.shape[0]
    )


def _probe(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A random row [1, n] for a first-call check the step runs itself (a router or norm that no one-row
    step has called yet: a server whose first steps are batched)."""
    return torch.randn((1, n), generator=torch.Generator().manual_seed(seed)).to(dtype)


def _norm(module: Any, dtype: torch.dtype) -> NativeRMSNorm:
    """The module's native norm, checked against the module (on a random row, where no step has yet); NotYet
    where that check cannot run natively yet."""
    fn = module
    if not isinstance(fn, NativeRMSNorm) or fn.verified is False:
        raise Unsupported(f"{type(module).__name__} does not run natively")
    if fn.verified is None:
        w = fn.module.weight
        fn(_probe(w.shape[0], w.dtype, 0))
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


def _weights(proj: Any, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) of a plain linear projection in the activation dtype."""
    if type(proj) not in (nn.Linear, NativeLinear):
        raise Unsupported(f"a projection of type {type(proj).__name__}")
    w, b = proj.weight, proj.bias
    if (
        w.dtype != dtype
        or not w.is_contiguous()
        or w.device.type != "cpu"
        or (b is not None and (b.dtype != dtype or not b.is_contiguous()))
    ):
        raise Unsupported("a projection weight the native gemv does not read")
    return w, b
