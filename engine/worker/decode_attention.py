"""A step's attention in the lean forward (engine/worker/lean_forward.py), after the q/k/v
projections and before o_proj.

- `native_attention`: one native call a request for any number of its rows (cpu_gemv.c
  `attention_rows`: q/k norms, rotary, KV append, attention, row by row as a decode row alone),
  where the CPU kernels, the dtype, the in-place KV cache (engine/worker/kv_cache.py) and the
  per-head norms allow it.
- `sdpa_decode_attention`: what transformers' SDPA attention does for a single-token query without
  a mask, per request, without the packed bookkeeping.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from engine.native.kernels import X_CODES, NativeKernels
from engine.native.layers import verified_kernels
from engine.native.limits import MAX_HEAD_GROUP
from engine.worker.kv_cache import InPlaceLayer
from engine.worker.kv_pool import NATIVE_KV_LAYERS, PagedLayer
from engine.worker.lean_layer import LeanLayer
from engine.worker.packed_batch import PackedBatch


def native_attention(
    kernels: NativeKernels | None,
    layer: LeanLayer,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    batch: PackedBatch,
) -> torch.Tensor | None:
    """Every new row of the step, from its projections [N, heads * d] to o_proj's input [N, hq * d], one
    native call a request (its rows in order: a decode row, a verification window or a prompt chunk), or
    None where it does not apply (then the torch path runs): the CPU kernels, a float dtype, the
    in-place KV cache, the rotary table's rows, per-head norms that are verified native ones.

    Why one kernel for every row: each row attends to its keys in one order whatever rows share the
    step, so a window's rows, a prompt's rows and a decode row at the same position compute the same
    bits (attention.c `attention_rows`); torch's SDPA and packed attention sum in orders that depend
    on the query count. Also why it is fast on small models: between the projections and o_proj a
    decode layer made about a dozen torch calls (views, transposes, the cache's bookkeeping, SDPA, a
    copy back), more than the arithmetic. Against SDPA, logits agree to float rounding, not bit for bit
    (tests/test_lean_forward.py)."""
    att = layer.att
    cos, sin = cos_sin  # [1, N, rot]
    d = att.head_dim
    hq, hk = q.shape[1] // d, k.shape[1] // d
    if (
        kernels is None
        or q.dtype not in X_CODES
        or not (q.dtype == k.dtype == v.dtype == cos.dtype == sin.dtype)
        or q.device.type != "cpu"
        or d > 1024
        or hq % hk
        or hq // hk > MAX_HEAD_GROUP
        or cos.shape[-1] % 2
        or cos.shape[-1] > d
        or not (cos.is_contiguous() and sin.is_contiguous())
        or not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous())
    ):
        return None
    norms = layer.native_qk_norms
    if norms is None and layer.q_norm is not None:
        qn, kn = layer.q_norm, layer.k_norm
        if (
            verified_kernels(qn, q[:1].view(hq, d)) is None
            or verified_kernels(kn, k[:1].view(hk, d)) is None
        ):
            return None
        norms = layer.native_qk_norms = (qn.weight, kn.weight, qn.eps, kn.eps)  # verified: for good
    layers = [c.layers[att.layer_idx] for c in batch.caches]
    if not all(type(c) in NATIVE_KV_LAYERS for c in layers):
        return None
    outs = [
        _attend_rows(
            kernels,
            c,
            q[s:e].view(e - s, hq, d),
            k=k[s:e].view(e - s, hk, d),
            v=v[s:e].view(e - s, hk, d),
            norms=norms,
            cos=cos[0, s:e],
            sin=sin[0, s:e],
            scale=att.scaling,
        )
        for (s, e), c in zip(batch.spans, layers, strict=True)
    ]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def sdpa_decode_attention(
    att: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: PackedBatch
) -> torch.Tensor:
    """One new row per request: what transformers' SDPA attention does for a single-token query
    without a mask (integrations/sdpa_attention.py: GQA inside SDPA, not causal), per request.
    q [1, h, B, d], k and v [1, h_kv, B, d]; returns [1, B, h, d]."""
    gqa = att.num_key_value_groups > 1
    if len(batch.caches) == 1:  # one request: no per-request slices
        keys, values = batch.caches[0].update(k, v, att.layer_idx)
        o = F.scaled_dot_product_attention(
            q, keys, values, dropout_p=0.0, scale=att.scaling, is_causal=False, enable_gqa=gqa
        )
        return o.transpose(1, 2).contiguous()
    outs = []
    for r, c in enumerate(batch.caches):
        keys, values = c.update(k[:, :, r : r + 1], v[:, :, r : r + 1], att.layer_idx)
        o = F.scaled_dot_product_attention(
            q[:, :, r : r + 1],
            keys,
            values,
            dropout_p=0.0,
            scale=att.scaling,
            is_causal=False,
            enable_gqa=gqa,
        )
        outs.append(o.transpose(1, 2))
    return (torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]).contiguous()


def _attend_rows(
    kernels: NativeKernels,
    cache: InPlaceLayer | PagedLayer,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    norms: tuple[torch.Tensor, torch.Tensor, float, float] | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One request's new rows (q [T, hq, d], k and v [T, hk, d]) through the native attention, their keys
    and values appended to `cache`; returns [T, hq * d]."""
    rows, hk, d = k.shape
    kb, vb, length = cache.reserve(
        k.view(1, rows, hk, d).transpose(1, 2), v.view(1, rows, hk, d).transpose(1, 2)
    )
    if (
        kb.dtype != q.dtype
    ):  # a request's cache holds its model's dtype: this would be a bug, not an input
        raise RuntimeError(f"KV cache in {kb.dtype} for a {q.dtype} attention row")
    out = kernels.decode_attention(
        q,
        k,
        v,
        norms=norms,
        cos=cos,
        sin=sin,
        key_buffer=kb,
        value_buffer=vb,
        at=length,
        scale=scale,
        table=cache.block_table,
        block=cache.block_size,
    )
    cache.advance(length + rows)
    return out
