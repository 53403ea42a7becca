"""transformers' packed forward for llama-style targets and drafts, op for op, without its wrappers.

Why: on a small model, or whenever the experts are resident and fast, a decode step's time is
the Python around the arithmetic: each `model(...)` call goes through output dataclasses,
kwargs plumbing, decorators, mask creation (skipped for the packed layout anyway) and a module
`__call__` per sublayer, about 0.4 ms a layer on the tiny peers checkpoint
(docs/benchmarks/peers_tiny.md). This module runs the same sublayers (each module's own
`forward`: the native norms and linears, the architecture's own rotary function, the offloaded
MoE block) in the same order, with the packed attention of engine/worker/packed_batch.py, so its
logits are the packed forward's bit for bit (tests/test_lean_forward.py); it only drops the
layers of Python in between. Where neighbouring steps would each run a native kernel anyway, one
native call does both with the same arithmetic (the per-head q/k norms and the rotary embedding;
a residual add and the next norm), and a plain decode step attends without the packed
bookkeeping (engine/worker/decode_attention.py).

Scope: the architectures whose decoder layer is exactly "norm, attention, residual, norm, MLP,
residual" (the MLP an offloaded MoE block or a dense one: the MoE targets' dense layers, the dense
drafts' every layer, engine/speculative/draft.py) and whose attention is "q/k/v projections, optional per-head q/k norm, rotary, cache
update, attention function, o projection" in transformers 5 (engine/weights/forward_support.py), without a
sliding window. Everything else keeps transformers' forward; so does `--forward transformers`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from engine.experts.compute.moe_block import OffloadedMoeBlock
from engine.native.kernels import X_CODES
from engine.native.layers import NativeRMSNorm, verified_kernels
from engine.native.loaded import native
from engine.weights.forward_support import lean_structure
from engine.worker import dispatch
from engine.worker.decode_attention import native_attention, sdpa_decode_attention
from engine.worker.fused_decode import FusedDecode
from engine.worker.lean_layer import LeanLayer
from engine.worker.packed_batch import (
    PACKED_ATTENTION,
    PackedBatch,
    PackedCache,
    packed_attention,
    positions,
)

# The fused step's attention workspace covers this many cached positions; past it the step goes layer
# by layer, through the same native attention (engine/worker/decode_attention.py): the same bits.
NATIVE_ATTENTION_MAX_POSITIONS = 1024


class LeanForward:
    """`packed_forward`'s contract (engine/worker/packed_batch.py) for a supported model."""

    @staticmethod
    def supports(model: PreTrainedModel) -> bool:
        """An architecture and structure the lean forward runs (engine/weights/forward_support.py),
        its attention routed through the packed attention."""
        return model.config._attn_implementation == PACKED_ATTENTION and lean_structure(model)

    def __init__(
        self, model: PreTrainedModel, fused: bool = True, native_attention: bool = True
    ) -> None:
        """fused: decode steps may take the fused native step; native_attention: a decode row's attention in
        one native call (the fused step needs it). Both as the plan resolved them (engine/plan/execution.py)."""
        assert self.supports(model), f"no lean forward for {model.config.model_type}"
        self.model = model
        self.inner = model.model
        self.layers = [
            LeanLayer(layer) for layer in self.inner.layers[: model.config.num_hidden_layers]
        ]
        # The architecture's own rotary function (glm4_moe rotates only part of each head).
        self.rotate: Callable = sys.modules[
            type(self.layers[0].att).__module__
        ].apply_rotary_pos_emb
        self.kernels = (
            native() if self.inner.embed_tokens.weight.device.type == "cpu" else None
        )  # rotary in C
        # cos/sin of positions 0..P-1, computed once by the model's own rotary module and sliced per step.
        # Only for the default rope type, whose frequencies never change (dynamic scalings recompute them).
        self._table_ok = getattr(self.inner.rotary_emb, "rope_type", None) == "default"
        # A decode row's attention in one native call (engine/worker/decode_attention.py); else torch's SDPA.
        self._native_attention = self.kernels is not None and native_attention
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None
        # A one-request decode step's layers, one native call each (engine/worker/fused_decode.py), where it applies.
        self._fused = (
            FusedDecode(self.kernels, self.layers, self.inner.norm)
            if self.kernels is not None and self._native_attention and fused
            else None
        )
        self.last_path: tuple[str, str] = (
            "lean",
            "",
        )  # the last call's path, and why it was not the fused one

    @torch.inference_mode()
    def __call__(
        self,
        windows: list[list[int]],
        starts: list[int],
        caches: list[DynamicCache],
        keep: list[list[int]],
        device: torch.device,
    ) -> list[torch.Tensor]:
        batch = PackedBatch(caches, [len(w) for w in windows])
        cache = PackedCache(batch)
        decode = all(
            n == 1 for n in batch.lengths
        )  # plain decodes: attention without the packed bookkeeping
        ids = torch.tensor([t for w in windows for t in w], device=device)  # [N]
        inner = self.inner
        # Hidden states stay rows [N, H] (transformers' [1, N, H] less the batch dimension: every sublayer
        # here is row-wise), which saves the MoE blocks' reshapes.
        x = inner.embed_tokens.forward(ids)  # [N, H]
        cos_sin = self._rotary(x, batch, starts, device)
        h = self.layers[0].in_norm.forward(x)
        declined = self._try_fused(x, h, cos_sin, batch, caches)
        fused = declined is None
        self.last_path = ("fused", "") if declined is None else ("lean", declined)
        for i, layer in enumerate(self.layers if not fused else ()):
            x, h = self._add_norm(
                x, self._attention(layer, h, cos_sin, cache, batch, decode), layer.post_norm
            )
            nxt = self.layers[i + 1].in_norm if i + 1 < len(self.layers) else inner.norm
            x, h = self._add_norm(x, self._mlp(layer.mlp, h), nxt)
        # h: the final norm's output
        if (
            len(keep) == 1
            and keep[0]
            and keep[0] == list(range(keep[0][0], keep[0][0] + len(keep[0])))
        ):
            k0 = keep[0][
                0
            ]  # one request, consecutive rows (a decode, a prompt's last row): a slice
            return [self.model.lm_head.forward(h[k0 : k0 + len(keep[0])])]
        rows = torch.tensor(
            [s + i for (s, _), k in zip(batch.spans, keep) for i in k],
            dtype=torch.long,
            device=device,
        )
        logits = self.model.lm_head.forward(h[rows])  # [R, V]
        return list(torch.split(logits, [len(k) for k in keep]))

    def _try_fused(
        self,
        x: torch.Tensor,
        h: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        batch: PackedBatch,
        caches: list[DynamicCache],
    ) -> str | None:
        """Run the step's layers through the fused step where the dispatcher and the step allow; returns None
        where it ran, else why not (engine/worker/dispatch.py's reasons)."""
        if self._fused is None:
            return dispatch.NOT_PLANNED
        rows = tuple(batch.lengths)
        if (
            sum(rows) > dispatch.MAX_FUSED_ROWS
        ):  # before the flags: a long prefill chunk need not gather them
            return dispatch.TOO_MANY_ROWS
        fresh = any(c.get_seq_length() == 0 for c in caches)
        why = dispatch.fused_decline(dispatch.StepShape(rows, fresh, *self._fused.shape_flags()))
        return (
            why
            if why is not None
            else self._fused.step(x, h, *cos_sin, caches, rows, NATIVE_ATTENTION_MAX_POSITIONS)
        )

    @staticmethod
    def _mlp(mlp: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
        """The layer's MoE block or dense MLP on rows h [N, H]."""
        if not isinstance(mlp, OffloadedMoeBlock):
            return mlp.forward(h)  # dense MLPs are row-wise whatever the shape
        if not mlp.plain_output:  # a tuple output
            return mlp.forward(h[None])[0]
        return mlp.forward_rows(h)

    def _rotary(
        self, x: torch.Tensor, batch: PackedBatch, starts: list[int], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [1, N, rot] of every packed row's position, as the model's rotary module returns
        them: each position's angles are one product and one cos/sin apart, so a row of a table made
        once equals the module's result for that position alone (tests/test_lean_forward.py)."""
        if not self._table_ok:
            return self.inner.rotary_emb.forward(x, positions(batch, starts, device))
        end = max(s + n for s, n in zip(starts, batch.lengths))
        if self._table is None or self._table[0].shape[1] < end or self._table[0].dtype != x.dtype:
            size = max(256, 1 << (end - 1).bit_length())
            self._table = self.inner.rotary_emb.forward(x, torch.arange(size, device=device)[None])
        cos, sin = self._table
        if len(starts) == 1:  # one request: a slice (a view), no index tensor
            s, n = starts[0], batch.lengths[0]
            return cos[:, s : s + n], sin[:, s : s + n]
        pos = positions(batch, starts, device)[0]
        return cos[:, pos], sin[:, pos]

    def _attention(
        self,
        layer: LeanLayer,
        h: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        cache: PackedCache,
        batch: PackedBatch,
        decode: bool,
    ) -> torch.Tensor:
        """The attention module's forward (see the module docstring) with its inputs already known."""
        att = layer.att
        q, k, v = (
            layer.q_proj.forward(h),
            layer.k_proj.forward(h),
            layer.v_proj.forward(h),
        )  # [N, heads * d]
        if self._native_attention:  # every row: decode, window or prompt (batch-invariant)
            out = native_attention(self.kernels, layer, q, k=k, v=v, cos_sin=cos_sin, batch=batch)
            if out is not None:
                return layer.o_proj.forward(out)
        shape = (
            1,
            h.shape[0],
            -1,
            att.head_dim,
        )  # [1, N, heads, d], as transformers' attention views them
        q, k, v = q.view(shape), k.view(shape), v.view(shape).transpose(1, 2)
        if layer.q_norm is not None and self._fused_qk(layer, q, k, *cos_sin):
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        else:
            if layer.q_norm is not None:
                q, k = layer.q_norm.forward(q), layer.k_norm.forward(k)
            q, k = self._rotate(q, k, *cos_sin)
        if decode:
            out = sdpa_decode_attention(att, q, k, v, batch)
        else:
            k, v = cache.update(k, v, att.layer_idx)
            out, _ = packed_attention(
                att, q, k, v, None, packed_batch=batch, dropout=0.0, scaling=att.scaling
            )
        return layer.o_proj.forward(out.reshape(h.shape[0], -1).contiguous())

    def _add_norm(
        self, x: torch.Tensor, a: torch.Tensor, norm: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + a, norm(x + a)): the residual add and the next norm, in one native call where the norm
        would itself run the native kernel (a verified NativeRMSNorm, few rows); the same arithmetic."""
        kernels = verified_kernels(norm, x)
        if kernels is None or a.dtype != x.dtype or a.shape != x.shape or not a.is_contiguous():
            x = x + a
            return x, norm.forward(x)
        assert isinstance(norm, NativeRMSNorm)  # verified_kernels found it one
        return kernels.add_rmsnorm(x, a, norm.weight, norm.eps)

    def _fused_qk(
        self,
        layer: LeanLayer,
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> bool:
        """q/k norms and rotary in one native call, in place, where each norm would itself have run
        the native kernel (a verified NativeRMSNorm, few rows) and the rotary kernel applies: the
        same arithmetic as the two steps apart. Returns whether it ran."""
        qn, kn = layer.q_norm, layer.k_norm
        kernels = verified_kernels(qn, q)
        if kernels is None or verified_kernels(kn, k) is None or not self._rope_ok(q, k, cos, sin):
            return False
        kernels.qk_norm_rope(
            q,
            k,
            q_weight=qn.weight,
            k_weight=kn.weight,
            q_eps=qn.eps,
            k_eps=kn.eps,
            cos=cos,
            sin=sin,
        )
        return True

    def _rope_ok(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> bool:
        """Whether the native rotary kernel takes these tensors (CPU, contiguous, one float dtype, even rot <= d)."""
        return (
            self.kernels is not None
            and q.dtype == k.dtype == cos.dtype == sin.dtype
            and q.dtype in X_CODES
            and q.is_contiguous()
            and k.is_contiguous()
            and cos.is_contiguous()
            and sin.is_contiguous()
            and q.device.type == "cpu"
            and cos.shape[-1] % 2 == 0
            and cos.shape[-1] <= min(q.shape[-1], 1024)
        )

    def _rotate(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k [1, N, heads, d] -> rotated [1, heads, N, d]: the native kernel in place where it takes
        them (same rounding as torch's elementwise ops), else the architecture's own function."""
        kernels = self.kernels
        if kernels is not None and self._rope_ok(q, k, cos, sin):
            return kernels.rope(q, cos, sin).transpose(1, 2), kernels.rope(k, cos, sin).transpose(
                1, 2
            )
        return self.rotate(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
