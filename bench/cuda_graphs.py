"""CUDA graphs for the dense part of a decode step, measured rather than assumed (issue 15 §3).

A whole decode step cannot be one CUDA graph in this engine: each MoE layer's router output goes to
the host, where the policy decides which experts are resident, waited for, substituted or run on
the CPU, and what to load next. That sync is the point of offloading. What a graph could still
replace is the run of small kernels between two syncs: a layer's attention sublayer (input norm,
q/k/v projections, q/k norms, rotary, the KV write, attention, o_proj, the residual and the next
norm). This module times that sublayer of one decoder layer of a transformers model for a single
decode token, eagerly and as a replayed CUDA graph with static buffers (a fixed-size KV cache and a
mask), so gpu_check can say how much of a decode step graphs would save.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F


def _attention_sublayer(
    model: torch.nn.Module, device: torch.device, cache_len: int
) -> Callable[[], None]:
    """One decode token through layer 0's attention sublayer, on static buffers (graph-capturable)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import apply_rotary_pos_emb

    layer, cfg = model.model.layers[0], model.config
    at = layer.self_attn
    dtype = next(model.parameters()).dtype
    hd, nkv = at.head_dim, cfg.num_key_value_heads
    x = torch.randn(1, 1, cfg.hidden_size, device=device, dtype=dtype)
    k_cache = torch.randn(1, nkv, cache_len, hd, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    pos = torch.tensor([cache_len // 2], device=device)
    mask = (torch.arange(cache_len, device=device) <= pos).view(1, 1, 1, cache_len)
    cos, sin = model.model.rotary_emb(x, pos.view(1, 1))
    out = torch.empty_like(x)
    q_norm = getattr(at, "q_norm", torch.nn.Identity())
    k_norm = getattr(at, "k_norm", torch.nn.Identity())

    def step() -> None:
        h = layer.input_layernorm(x)
        q = q_norm(at.q_proj(h).view(1, 1, -1, hd)).transpose(1, 2)
        k = k_norm(at.k_proj(h).view(1, 1, -1, hd)).transpose(1, 2)
        v = at.v_proj(h).view(1, 1, -1, hd).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k_cache.index_copy_(2, pos, k)
        v_cache.index_copy_(2, pos, v)
        o = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask, enable_gqa=True)
        out.copy_(
            layer.post_attention_layernorm(x + at.o_proj(o.transpose(1, 2).reshape(1, 1, -1)))
        )

    return step


def _per_call_s(fn: Callable[[], None], device: torch.device, iters: int) -> float:
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / iters


@torch.inference_mode()
def attention_graph_figures(
    model: torch.nn.Module, device: torch.device, cache_len: int = 512, iters: int = 300
) -> dict[str, float]:
    """Seconds per call of one layer's attention sublayer, eager and replayed as a CUDA graph
    (NaN on the CPU, where there are no graphs), and the kernels it launches."""
    step = _attention_sublayer(model, device, cache_len)
    eager = _per_call_s(step, device, iters)
    graph = math.nan
    if device.type == "cuda":
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up off the default stream, as capture requires
            for _ in range(3):
                step()
        torch.cuda.current_stream(device).wait_stream(side)
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                step()
            graph = _per_call_s(g.replay, device, iters)
        except RuntimeError as e:  # report it and keep the rest of the GPU check's figures
            print(f"CUDA graph capture of the attention sublayer failed: {e}", flush=True)
    return {"eager_s": eager, "graph_s": graph, "layers": float(model.config.num_hidden_layers)}
