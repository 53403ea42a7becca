"""A lean forward for dense draft models: the same arithmetic as transformers, a tenth of the calls.

Why: a draft is only worth running if its steps are cheap next to the target's. On CPU (and
for any small draft on a GPU) a transformers forward costs its module calls, decorators, cache
bookkeeping and per-layer Python, not its arithmetic: the embedded draft (6 layers of width 48)
took 4.4 ms a step, more than half the time of a target step, so 4 proposals cost more than
the 2.9 tokens a verification kept (docs/benchmarks/speculative.md). This module runs the
draft's own weights (fused q/k/v and gate/up projections, built once) with one flat function
per step and a preallocated KV buffer per request, so cropping a rejected tail is a length
change and appending is one copy.

Scope: decoder-only llama-style models (qwen3 with q/k norms, qwen2 with q/k/v biases, llama,
mistral without a sliding window), the architectures drafts use. Anything else runs through
transformers (`LeanDenseModel.supports` says which). Not bit-identical to transformers
(fused projections), which a draft need not be: verification keeps the target's
tokens whatever the draft proposes; tests check the logits agree to float rounding.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.activations import ACT2FN

from engine.worker.packed_batch import causal_mask, spans_of

LEAN_MODEL_TYPES = frozenset({"qwen3", "qwen2", "llama", "mistral"})


class LeanKVCache:
    """One request's keys and values for every layer, [layers, h_kv, capacity, d] each, grown
    by doubling; `length` positions are valid."""

    def __init__(
        self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.length = 0
        self.k = torch.empty(layers, kv_heads, 64, head_dim, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)

    def crop(self, length: int) -> None:
        """Forget every position from `length` on (a rejected speculative tail)."""
        self.length = min(self.length, length)

    def reserve(self, extra: int) -> None:
        need = self.length + extra
        if need > self.k.shape[2]:
            cap = max(need, 2 * self.k.shape[2])
            for name in ("k", "v"):
                old = getattr(self, name)
                new = old.new_empty(old.shape[0], old.shape[1], cap, old.shape[3])
                new[:, :, : self.length] = old[:, :, : self.length]
                setattr(self, name, new)


class LeanDenseModel:
    """The forward of a llama-style dense model from its transformers module's weights."""

    @staticmethod
    def supports(model: PreTrainedModel) -> bool:
        cfg = model.config
        return (
            cfg.model_type in LEAN_MODEL_TYPES
            and getattr(cfg, "sliding_window", None) is None
            and not getattr(cfg, "use_sliding_window", False)
        )

    def __init__(self, model: PreTrainedModel) -> None:
        assert self.supports(model), f"no lean forward for {model.config.model_type}"
        cfg, inner = model.config, model.model
        self.device, self.dtype = inner.embed_tokens.weight.device, inner.embed_tokens.weight.dtype
        self.embed = inner.embed_tokens.weight
        self.rotary = (
            inner.rotary_emb
        )  # transformers' own: every rope scaling variant, same cos/sin
        self.norm_w, self.eps = inner.norm.weight, cfg.rms_norm_eps
        self.lm_head = model.lm_head.weight
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.act = ACT2FN[cfg.hidden_act]
        self.layers: list[dict[str, Any]] = [self._fuse(layer) for layer in inner.layers]

    @staticmethod
    def _fuse(layer: Any) -> dict[str, Any]:
        """The layer's weights (fused q/k/v and gate/up), as tensors; `layer` is the architecture's own module."""
        att, mlp = layer.self_attn, layer.mlp

        def cat(*lins: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
            bias = [lin.bias for lin in lins]
            return torch.cat([lin.weight for lin in lins]), (
                torch.cat(bias) if all(b is not None for b in bias) else None
            )

        qkv_w, qkv_b = cat(att.q_proj, att.k_proj, att.v_proj)
        gu_w, gu_b = cat(mlp.gate_proj, mlp.up_proj)
        return {
            "in_norm": layer.input_layernorm.weight,
            "post_norm": layer.post_attention_layernorm.weight,
            "qkv_w": qkv_w,
            "qkv_b": qkv_b,
            "o_w": att.o_proj.weight,
            "o_b": att.o_proj.bias,
            "q_norm": getattr(att, "q_norm", None) and att.q_norm.weight,
            "k_norm": getattr(att, "k_norm", None) and att.k_norm.weight,
            "gu_w": gu_w,
            "gu_b": gu_b,
            "down_w": mlp.down_proj.weight,
            "down_b": mlp.down_proj.bias,
        }

    def new_cache(self) -> LeanKVCache:
        return LeanKVCache(len(self.layers), self.kv_heads, self.head_dim, self.dtype, self.device)

    @torch.inference_mode()
    def forward(
        self,
        windows: list[list[int]],
        starts: list[int],
        caches: list[LeanKVCache],
        keep: list[list[int]],
    ) -> list[torch.Tensor]:
        """The contract of ModelRunner.forward: every window in one pass; keep[r]: rows of
        window r whose logits are returned ([len(keep[r]), V]). Each cache holds exactly the
        positions before its window's start (the caller crops a rejected tail, as for the runner)."""
        lengths = [len(w) for w in windows]
        ids = torch.tensor([t for w in windows for t in w], device=self.device)
        pos = torch.cat(
            [torch.arange(s, s + n, device=self.device) for s, n in zip(starts, lengths)]
        )
        x = F.embedding(ids, self.embed)  # [N, H]
        cos, sin = self.rotary(x[None], pos[None])  # [1, N, d]
        cos, sin = cos[0, :, None], sin[0, :, None]  # [N, 1, d]: broadcast over heads
        for c, s, n in zip(caches, starts, lengths):
            assert c.length == s, (
                f"a window starting at {s} needs {s} cached positions, the cache has {c.length}"
            )
            c.reserve(n)
        nq, nk, d = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.head_dim
        for li, w in enumerate(self.layers):
            h = _rms_norm(x, w["in_norm"], self.eps)
            q, k, v = F.linear(h, w["qkv_w"], w["qkv_b"]).split((nq, nk, nk), dim=-1)
            q, k, v = (
                q.view(-1, self.heads, d),
                k.view(-1, self.kv_heads, d),
                v.view(-1, self.kv_heads, d),
            )
            if w["q_norm"] is not None:
                q = _rms_norm(q, w["q_norm"], self.eps)
                k = _rms_norm(k, w["k_norm"], self.eps)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            att = self._attend(li, q, k, v, caches, lengths)  # [N, heads * d]
            x = x + F.linear(att, w["o_w"], w["o_b"])
            h = _rms_norm(x, w["post_norm"], self.eps)
            g, u = F.linear(h, w["gu_w"], w["gu_b"]).chunk(2, dim=-1)
            x = x + F.linear(self.act(g) * u, w["down_w"], w["down_b"])
        for c, n in zip(caches, lengths):
            c.length += n
        rows = torch.tensor(
            [s + i for (s, _), kk in zip(spans_of(lengths), keep) for i in kk],
            dtype=torch.long,
            device=self.device,
        )
        logits = F.linear(_rms_norm(x[rows], self.norm_w, self.eps), self.lm_head)
        return list(torch.split(logits, [len(kk) for kk in keep]))

    def _attend(
        self,
        li: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        caches: list[LeanKVCache],
        lengths: list[int],
    ) -> torch.Tensor:
        """Write each request's new keys/values after its cached ones and attend causally."""
        outs, row = [], 0
        for c, n in zip(caches, lengths):
            L0 = c.length
            c.k[li, :, L0 : L0 + n] = k[row : row + n].transpose(0, 1)
            c.v[li, :, L0 : L0 + n] = v[row : row + n].transpose(0, 1)
            keys, vals = c.k[li, :, : L0 + n], c.v[li, :, : L0 + n]  # [h_kv, L, d]
            qr = q[row : row + n].transpose(0, 1)  # [h, n, d]
            mask = None if n == 1 else causal_mask(n, L0 + n, q.device)  # [1, 1, n, L]
            o = F.scaled_dot_product_attention(
                qr[None],
                keys[None],
                vals[None],
                attn_mask=mask,
                enable_gqa=self.heads != self.kv_heads,
            )[0]  # [h, n, d]
            outs.append(o.transpose(0, 1).reshape(n, -1))
            row += n
        return torch.cat(outs) if len(outs) > 1 else outs[0]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm, op for op (fp32 weights): torch.rms_norm costs 5x more on CPU."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, h, d] rotated by position (transformers' rotate_half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
