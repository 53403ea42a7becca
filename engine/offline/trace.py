"""Router traces: for every token and MoE layer, what the native router chose.

Format (one .npz file, numpy's zip of arrays; load with `numpy.load(path)`):
  tokens   [N] int32            the token ids, in order
  ids      [N, L, k] int16      top-k expert ids per token and MoE layer, best first
  weights  [N, L, k] float32    their gate weights (as the model uses them)
  logits   [N, L, E] float16    full router logits (only with --logits)
  hidden   [N, L, H] float16    router input hidden state (only with --hidden; for learned prefetchers)
  meta     0-d str              JSON: model dir, moe_layers, num_experts, top_k, window, expert_nbytes (bytes per expert in the checkpoint),
                                and for routers that pick on sigmoid(logits) + a balancing bias (glm4_moe, deepseek_v3)
                                score_bias [L][E], so logits can be re-ranked as the router ranks them
Traces are recorded with the exact policy (fetch-all), one batched forward per window of
`window` tokens, so routing is the model's own, independent of cache state.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from engine.experts.routing_bus import RoutingEvent
from engine.native.loaded import active
from engine.paths import portable_path
from engine.worker.loaded_model import OffloadedModel


@torch.inference_mode()
def record_trace(
    om: OffloadedModel,
    ids: list[int],
    window: int = 256,
    logits: bool = False,
    hidden: bool = False,
) -> dict[str, np.ndarray]:
    index = {layer: i for i, layer in enumerate(om.moe_layers)}
    per_layer: dict[int, list[tuple]] = {i: [] for i in range(len(index))}

    def listen(ev: RoutingEvent) -> None:
        per_layer[index[ev.layer]].append(
            (
                ev.ids.cpu(),
                ev.weights.float().cpu(),
                ev.logits.half().cpu() if logits else None,
                ev.x.half().cpu() if hidden else None,
            )
        )

    unsubscribe = om.bus.subscribe(listen)
    try:
        chunks = [c for c in (ids[i : i + window] for i in range(0, len(ids), window)) if c]
        for chunk in tqdm(chunks, desc="tracing", unit="window", leave=False):
            with active(om.native):  # the model's own native kernels (engine/native/loaded.py)
                om.model(input_ids=torch.tensor([chunk], device=om.device), use_cache=False)
    finally:
        unsubscribe()

    def stack(j: int) -> np.ndarray:
        return torch.stack(
            [torch.cat([rec[j] for rec in per_layer[i]]) for i in range(len(index))], dim=1
        ).numpy()

    from engine.prefetch.training import moe_blocks

    blocks = moe_blocks(om.model)
    biases = [blocks[layer].adapter.selection_bias(blocks[layer]) for layer in om.moe_layers]
    extra = (
        {"score_bias": [b.cpu().tolist() for b in biases if b is not None]}
        if all(b is not None for b in biases)
        else {}
    )
    out: dict[str, np.ndarray] = {
        "tokens": np.asarray(ids, dtype=np.int32),
        "ids": stack(0).astype(np.int16),
        "weights": stack(1).astype(np.float32),
        "meta": np.asarray(
            json.dumps(
                {
                    "model": portable_path(om.model_dir),
                    "moe_layers": om.moe_layers,
                    "num_experts": om.num_experts,
                    "top_k": om.top_k,
                    "window": window,
                    "expert_nbytes": om.transfers.tier.locator.nbytes_on_disk(om.moe_layers[0], 0),
                    **extra,
                }
            )
        ),
    }
    if logits:
        out["logits"] = stack(2)
    if hidden:
        out["hidden"] = stack(3)
    return out


def save_trace(trace: dict[str, np.ndarray], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **trace)  # type: ignore[arg-type]  # the stub fears a key named allow_pickle
    return path if path.suffix == ".npz" else path.with_suffix(path.suffix + ".npz")
