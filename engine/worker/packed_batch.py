"""One forward for many requests: every request's window packed into one row sequence.

Why this mechanism (see docs/architecture.md, "Batched steps"):
- The MoE layers are what an offloading server must batch: with all windows packed into one
  [1, N] sequence, each MoE layer sees the N rows of every request at once, groups them per
  expert, and loads and runs each expert once per step for everyone who routed to it.
- Attention is the only part that must stay per request. Rather than a padded [B, S] batch
  (re-stacking every KV cache each step, and attending over padding), each request keeps its
  own transformers `DynamicCache`, and a registered attention function runs SDPA per request
  on its slice of the packed queries. Windows may have any length and start position, so
  prefill chunks, plain decodes and speculative windows share one step.
- Each request's slice sees exactly the keys and values, mask and shapes it would see if it
  ran alone, so a batched step reproduces single-request attention bit for bit.

Contract with transformers 5 modeling code (qwen3_moe, qwen2_moe, mixtral, olmoe, and dense
qwen2/qwen3/llama/mistral drafts): attention modules call `cache.update(k, v, layer_idx,
kwargs=...)` and then the attention function named by `config._attn_implementation`. Mask
creation is skipped for implementations without a registered mask function, which is what
we want: the packed layout has no single mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface, DynamicCache, PretrainedConfig, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from engine.experts.routing_bus import spans_of
from engine.weights.forward_support import PACKED_MODEL_TYPES

PACKED_ATTENTION = "moe_offload_packed"

# Caches with recurrent (linear-attention) state cannot be cropped back after a rejected
# speculative window.
NO_ROLLBACK_MODEL_TYPES = frozenset({"qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text"})


@dataclass
class PackedBatch:
    """The windows of one step. Built by the runner, read by the cache and attention hooks."""

    caches: list[DynamicCache]  # one per request, in packing order
    lengths: list[int]  # [B] window lengths T_r; the packed sequence has N = sum(T_r) rows
    spans: list[tuple[int, int]] = field(init=False)  # row range of each request
    # layer_idx -> per-request (keys, values) after this step's update: [1, h_kv, L_r, d]
    kv: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.spans = spans_of(self.lengths)


class PackedCache:
    """Duck-typed transformers Cache that fans the packed step's new keys/values out to each
    request's own DynamicCache. Only `update` is used: positions are passed explicitly and
    mask creation is skipped for the packed attention implementation."""

    is_compileable = False

    def __init__(self, batch: PackedBatch) -> None:
        self.batch = batch

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states, value_states: [1, h_kv, N, d]
        b = self.batch
        b.kv[layer_idx] = [
            c.update(key_states[:, :, s:e], value_states[:, :, s:e], layer_idx)
            for c, (s, e) in zip(b.caches, b.spans)
        ]
        return key_states, value_states  # the packed attention reads b.kv, not these


def causal_mask(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """Bottom-right aligned causal mask [1, 1, T, L] (True = attend): query i sees keys <= L-T+i."""
    q = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
    return (torch.arange(kv_len, device=device)[None, :] <= q)[None, None]


def packed_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    packed_batch: PackedBatch | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """query: [1, h, N, d]. Returns [1, N, h, d] like transformers' attention functions."""
    if packed_batch is None:
        # A plain forward (trace, reference checks): full sequences or single-token decodes,
        # for which SDPA's own causal flag is exact.
        assert query.shape[2] in (1, key.shape[2]), (
            "windows with a past need the packed path (explicit mask)"
        )
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    outs = []
    for (s, e), (k, v) in zip(packed_batch.spans, packed_batch.kv[module.layer_idx]):
        T, L = e - s, k.shape[2]
        # T == L (a fresh prompt) or T == 1 (decode): SDPA's own path, exactly as alone.
        mask = None if T in (1, L) else causal_mask(T, L, query.device)
        o, _ = sdpa_attention_forward(module, query[:, :, s:e], k, v, mask, **kwargs)
        outs.append(o)
    return torch.cat(outs, dim=1), None


AttentionInterface.register(PACKED_ATTENTION, packed_attention)


def use_packed_attention(model: PreTrainedModel) -> bool:
    """Route every attention module of `model` through `packed_attention`, where the
    architecture supports it; returns whether it does."""
    if model.config.model_type not in PACKED_MODEL_TYPES:
        return False
    cfgs: list[PretrainedConfig] = [model.config] + [
        getattr(model.config, n) for n in ("text_config",) if hasattr(model.config, n)
    ]
    for cfg in cfgs:
        cfg._attn_implementation = PACKED_ATTENTION
    return True


def positions(batch: PackedBatch, starts: list[int], device: torch.device) -> torch.Tensor:
    """Position ids [1, N]: each request's window continues its own sequence."""
    return torch.cat(
        [torch.arange(p, p + n, device=device) for p, n in zip(starts, batch.lengths)]
    )[None]


@torch.inference_mode()
def one_by_one_forward(
    model: PreTrainedModel,
    windows: list[list[int]],
    starts: list[int],
    caches: list[DynamicCache],
    keep: list[list[int]],
    device: torch.device,
) -> list[torch.Tensor]:
    """The fallback for architectures without packed attention: one native forward per window
    (correct, but each MoE layer then sees one request's rows at a time)."""
    out = []
    for w, start, cache, k in zip(windows, starts, caches, keep):
        pos = torch.arange(start, start + len(w), device=device)[None]
        logits = model(
            input_ids=torch.tensor([w], device=device),
            position_ids=pos,
            cache=cache,
            use_cache=True,
            logits_to_keep=torch.tensor(k, dtype=torch.long, device=device),
        ).logits[0]
        out.append(logits)
    return out


@torch.inference_mode()
def packed_forward(
    model: PreTrainedModel,
    windows: list[list[int]],
    starts: list[int],
    caches: list[DynamicCache],
    keep: list[list[int]],
    device: torch.device,
) -> list[torch.Tensor]:
    """Run every window in one forward. keep[r]: window rows of request r whose logits are
    wanted. Returns per request logits [len(keep[r]), V]."""
    batch = PackedBatch(caches, [len(w) for w in windows])
    ids = torch.tensor([[t for w in windows for t in w]], device=device)  # [1, N]
    rows = [s + i for (s, _), k in zip(batch.spans, keep) for i in k]
    logits = model(
        input_ids=ids,
        position_ids=positions(batch, starts, device),
        cache=PackedCache(batch),
        use_cache=True,
        logits_to_keep=torch.tensor(rows, dtype=torch.long, device=device),  # long even when empty
        packed_batch=batch,
    ).logits[0]  # [R, V]
    return list(torch.split(logits, [len(k) for k in keep]))
