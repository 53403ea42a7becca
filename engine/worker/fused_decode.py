"""A decode step's decoder layers, one native call each (engine/native/decode_layer.c), for up to
MAX_ROWS rows: one row per request of a batched decode step, or a verification window's k+1 rows.

Why: with every expert resident, a decode layer of engine/worker/lean_forward.py is eight native
kernels and the Python that calls them (projections, attention, norms, router, experts); the
interpreter then costs more than the arithmetic on small and mid-size models, where llama.cpp runs
one graph per token (docs/benchmarks/peers.md measures both). `decode_layer` runs the same kernels in
the same order on the same buffers, so Python is left with one call a layer, the KV cache's
bookkeeping and the hit counters. Rows that route to one expert share one read of its weights.

When: the dispatcher (engine/worker/dispatch.py) sends a step here when it runs on the CPU's native
kernels, its cache lies within the native attention's range, every expert is resident for good
(`ExpertStore.complete`, the resident lane of engine/experts/compute/moe_executor.py) and nothing plans
around misses (CPU experts, the utility estimator) and no live routing listener must see a layer
before its experts run (a predictor starting transfers); deferred listeners (statistics, traces, the
speculative sensor) get the step's routing after the call, from buffers it writes. The model's every layer
must be a llama-style MoE layer (a softmax top-k router, or a DeepSeek-V3-style sigmoid router with
correction bias and groups as GLM-4-MoE's; routed SwiGLU experts; at most a SwiGLU shared expert,
gated as Qwen2-MoE's or not) or a dense SwiGLU layer (a dense draft's every one, which has no experts
to wait for); engine/worker/fused_layer_spec.py builds each
layer's spec and says why a layer cannot run. Norms and routers must have passed their first-call
check against the modules they replace (engine/native/layers.py, router.py); the step runs those
checks itself on a random row where no step has yet.

Exactness: the same arithmetic as the layer-by-layer path, bit for bit, except in f32 models, where
the attention projections run the native gemv instead of torch's F.linear: another order of each
dot product's sum, logits within f32 rounding (tests/test_fused_decode.py). A shared expert's SiLU and
gate sigmoid and the sigmoid router are computed with the C library's expf where the layer-by-layer
path runs torch's vectorised exp: in bf16 a product may then round the other way now and then (same
greedy tokens, logits within a few bf16 ulps in the test). `--forward lean` turns it off.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

from engine.experts.compute.moe_block import OffloadedMoeBlock
from engine.native.kernels import X_CODES, NativeKernels
from engine.native.limits import MAX_ROWS
from engine.native.row_ops import kv_table
from engine.native.structs import DecodeStep
from engine.weights.moe_hook import BlockAdapter
from engine.worker import dispatch
from engine.worker.fused_layer_spec import (
    ROUTER_NONE,
    LayerSpec,
    NotYet,
    Unsupported,
    attention_fields,
    linear_weights,
    router_fields,
    shared_expert,
    swiglu_fields,
)
from engine.worker.kv_pool import NATIVE_KV_LAYERS


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
        self._step: DecodeStep | None = (
            None  # decode_layer's step descriptor: scratch and KV arrays set once
        )

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
        declined = self._caches_decline(caches, rows, max_positions)
        if declined is not None:
            return declined
        lib, R, step = self.kernels.lib, x.shape[0], self._step
        assert self._kv_like is not None and step is not None  # built
        # The step's rows and threads (its scratch and KV arrays were set when built); each layer reads them.
        step.x, step.h, step.cos, step.sin = (
            x.data_ptr(),
            h.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
        )
        step.R, step.nthreads = R, torch.get_num_threads()
        kptrs, vptrs, tables, blocks, ats = self._row_kv
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
                table, bs = kv_table(kb, layer.block_table, layer.block_size)
                for j in range(n):
                    kptrs[r], vptrs[r], tables[r], blocks[r], ats[r] = (
                        kb.data_ptr(),
                        vb.data_ptr(),
                        table,
                        bs,
                        at + j,
                    )
                    r += 1
                ends.append((layer, at + n))
            rc = lib.decode_layer(ctypes.byref(spec), step)
            if rc != 0:  # the specs were checked when built: a bug, not an input
                raise RuntimeError(f"native decode_layer failed ({rc})")
            for layer, end in ends:
                layer.advance(end)
        for block, calls in self._hit_calls:
            block.executor.stats.record_all_hits(block.layer, calls * R)
        if self._blocks and self._blocks[0].bus.active:
            self._publish_routing(R)
        return None

    def _caches_decline(
        self, caches: list[DynamicCache], rows: tuple[int, ...], max_positions: int
    ) -> str | None:
        """Why the requests' caches cannot take this step (one of dispatch's reasons: a cache layer
        the native call cannot write, or rows past the scratch's positions), or None."""
        n_specs, limit = (
            len(self._specs),
            min(max_positions, self._positions),
        )  # the scratch holds scores for _positions
        for c, n in zip(caches, rows):
            layers: list[Any] = c.layers  # in-place or paged, checked here
            if len(layers) < n_specs or not all(
                type(layer) in NATIVE_KV_LAYERS for layer in layers[:n_specs]
            ):
                return dispatch.NOT_PLANNED
            if layers[0].get_seq_length() + n > limit:
                return dispatch.OUT_OF_RANGE
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
        # Each row's KV buffers, block table, positions a block and position, filled per layer per step.
        self._row_kv = (
            (ctypes.c_void_p * MAX_ROWS)(),
            (ctypes.c_void_p * MAX_ROWS)(),
            (ctypes.c_void_p * MAX_ROWS)(),
            (ctypes.c_int64 * MAX_ROWS)(),
            (ctypes.c_int64 * MAX_ROWS)(),
        )
        kbufs, vbufs, tables, bss, ats = (ctypes.addressof(a) for a in self._row_kv)
        self._step = DecodeStep(
            work=self._work.data_ptr(), kbufs=kbufs, vbufs=vbufs, tables=tables, bss=bss, ats=ats
        )
        self.state = "ready"
        return True

    def _spec(self, layer: Any, next_norm: Any, x: torch.Tensor, cos: torch.Tensor) -> LayerSpec:
        """One layer's LayerSpec; raises NotYet or Unsupported."""
        dtype = x.dtype
        if dtype not in X_CODES or x.device.type != "cpu":
            raise Unsupported(f"activations in {dtype} on {x.device.type}")
        fields = attention_fields(layer, next_norm, x, cos)
        if isinstance(layer.mlp, OffloadedMoeBlock):
            fields.update(self._moe_fields(layer.mlp, x, fields["proj_wtype"]))
        else:  # a dense layer (GLM-4-MoE's and DeepSeek-V3's first ones): its SwiGLU MLP alone
            fields.update(
                swiglu_fields(
                    layer.mlp, dtype, f"layer {layer.att.layer_idx}'s MLP", fields["proj_wtype"]
                ),
                router_kind=ROUTER_NONE,
            )
        return LayerSpec(**fields)

    def _moe_fields(self, block: OffloadedMoeBlock, x: torch.Tensor, wtype: int) -> dict:
        """The LayerSpec fields of a MoE block: its router, the pointer tables of its experts, its shared expert
        (whose float weights share the layer's proj_wtype, `wtype`)."""
        dtype, where = x.dtype, f"layer {block.layer}"
        if type(block.adapter) is not BlockAdapter or not block.plain_output:
            raise Unsupported(f"{where}: not a plain routed MoE block")
        executor = block.executor
        moe = executor.native_moe
        if moe is None or not moe.accepts(x) or executor.store.slots.device.type != "cpu":
            raise Unsupported(f"{where}: its experts do not run natively for {dtype} rows")
        fields = router_fields(block, x, self._keep)
        E = executor.num_experts
        slots = executor.expert_pointers(block.layer)
        tables = [
            (ctypes.c_void_p * E)(*(s[j] for s in slots)) for j in range(len(slots[0]))
        ]  # gate_up, its scales, down, its scales (int4: and the zeros of each)
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
            expert_wtype=moe.wtype,
            gate_up=ctypes.addressof(tables[0]),
            down=ctypes.addressof(tables[2]),
            gate_up_scale=ctypes.addressof(tables[1]) if moe.quantized else None,
            down_scale=ctypes.addressof(tables[3]) if moe.quantized else None,
            gate_up_zero=ctypes.addressof(tables[4]) if moe.int4 else None,
            down_zero=ctypes.addressof(tables[5]) if moe.int4 else None,
        )
        shared = shared_expert(block)
        if shared is not None:
            fields.update(swiglu_fields(shared, dtype, f"{where}'s shared expert", wtype))
            gate = block._modules.get("shared_expert_gate")
            if gate is not None:
                gate_w, gate_b, gate_s = linear_weights(gate, dtype)
                if gate_w.shape[0] != 1 or gate_b is not None or gate_s is not None:
                    raise Unsupported(f"{where}: a shared expert gate of another shape")
                fields["sh_gate_w"] = gate_w.data_ptr()
        return fields
