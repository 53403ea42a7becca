"""Router traces: for every token and MoE layer, what the native router chose.

Format (one .npz file, numpy's zip of arrays; load with `numpy.load(path)`):
  tokens   [N] int32            the token ids, in order
  ids      [N, L, k] int16      top-k expert ids per token and MoE layer, best first
  weights  [N, L, k] float32    their gate weights (as the model uses them)
  logits   [N, L, E] float16    full router logits (only with --logits)
  hidden   [N, L, H] float16    router input hidden state (only with --hidden; for learned prefetchers)
  meta     0-d str              JSON: model dir, moe_layers, num_experts, top_k, window, expert_nbytes (bytes per expert in the checkpoint)
Traces are recorded with the exact policy (fetch-all), one batched forward per window of
`window` tokens, so routing is the model's own, independent of cache state.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from engine.worker.loader import OffloadedModel
from engine.experts.moe_block import OffloadedMoeBlock


@torch.inference_mode()
def record_trace(om: OffloadedModel, ids: list[int], window: int = 256, logits: bool = False, hidden: bool = False) -> dict[str, np.ndarray]:
    blocks = [om.model.model.layers[i].mlp for i in om.moe_layers]
    assert all(isinstance(b, OffloadedMoeBlock) for b in blocks)
    per_layer: dict[int, list[tuple]] = {i: [] for i in range(len(blocks))}

    def observer(idx: int):
        def fn(x: torch.Tensor, router_logits: torch.Tensor, top_ids: torch.Tensor, top_w: torch.Tensor) -> None:
            per_layer[idx].append((top_ids.cpu(), top_w.float().cpu(),
                                   router_logits.half().cpu() if logits else None, x.half().cpu() if hidden else None))
        return fn

    for i, b in enumerate(blocks):
        b.observer = observer(i)
    try:
        chunks = [c for c in (ids[i : i + window] for i in range(0, len(ids), window)) if c]
        for chunk in tqdm(chunks, desc="tracing", unit="window", leave=False):
            om.model(input_ids=torch.tensor([chunk], device=om.device), use_cache=False)
    finally:
        for b in blocks:
            b.observer = None

    def stack(j: int) -> np.ndarray:
        return torch.stack([torch.cat([rec[j] for rec in per_layer[i]]) for i in range(len(blocks))], dim=1).numpy()

    out = {
        "tokens": np.asarray(ids, dtype=np.int32),
        "ids": stack(0).astype(np.int16),
        "weights": stack(1).astype(np.float32),
        "meta": np.asarray(json.dumps({
            "model": str(om.model_dir), "moe_layers": om.moe_layers, "num_experts": om.num_experts,
            "top_k": om.top_k, "window": window,
            "expert_nbytes": om.transfers.tier.locator.nbytes_on_disk(om.moe_layers[0], 0),
        })),
    }
    if logits:
        out["logits"] = stack(2)
    if hidden:
        out["hidden"] = stack(3)
    return out


def save_trace(trace: dict[str, np.ndarray], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **trace)
    return path if path.suffix == ".npz" else path.with_suffix(path.suffix + ".npz")
