"""SpecPrefetch's router adapter: predicts layer l+1's router logits from layer l's router input.

    prediction_{l+1}(x_l) = router_{l+1}(x_l) + B·A·x_l + b_l

- router_{l+1}(x_l) is the model's own next router applied to this layer's input: the
  FATE/ProMoE-style guess, frozen, with no parameter of its own (it is the model's).
- B·A is one low-rank map shared by every anchor layer (A: r×D, B: E×r, r·(D+E) parameters),
  the seed's adapter; it learns what FATE's guess gets wrong. b_l is an optional per-layer bias.
- `fate_base=False` drops the first term: the seed's plain B·A·x_l form.
The teacher is layer l+1's detached native router output; predictions only start transfers,
the native router still picks the experts that run.

The file is a small safetensors beside the model (`prefetcher.safetensors`), with metadata
naming the model it was trained for: a fingerprint of the model's router weights, so an
adapter trained for another checkpoint is refused in one line instead of predicting noise.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from engine.errors import ConfigError

FILE_NAME = "prefetcher.safetensors"


class RouterAdapter(nn.Module):
    def __init__(
        self,
        hidden: int,
        num_experts: int,
        rank: int,
        anchors: int,
        bias: bool = True,
        fate_base: bool = True,
    ) -> None:
        super().__init__()
        self.hidden, self.num_experts, self.rank, self.anchors = hidden, num_experts, rank, anchors
        self.fate_base = fate_base
        self.A = nn.Parameter(torch.randn(rank, hidden) / hidden**0.5)  # [r, D]
        self.B = nn.Parameter(
            torch.zeros(num_experts, rank)
        )  # [E, r]: starts as exactly the base guess
        self.bias = (
            nn.Parameter(torch.zeros(anchors, num_experts)) if bias else None
        )  # [anchors, E]

    def forward(
        self, x: torch.Tensor, anchor: int | torch.Tensor, base: torch.Tensor | None
    ) -> torch.Tensor:
        """x [T, D] router input of anchor layer `anchor` (index among the MoE layers but the last);
        base [T, E] the next router's logits on x (required when fate_base). Returns [T, E]."""
        out = (x.to(self.A.dtype) @ self.A.T) @ self.B.T
        if self.bias is not None:
            out = out + self.bias[anchor]
        if self.fate_base:
            assert base is not None, "this adapter refines the next router's guess: pass base"
            out = out + base.to(out.dtype)
        return out

    @torch.no_grad()
    def folded(
        self,
        anchor: int,
        router_weight: torch.Tensor | None,
        router_bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The whole prediction for one anchor as one linear map (W [E, D], b [E] or None), given the
        next router's own map when its logits are linear (router_weight [E, D], router_bias):
        x·(W_router + B·A)ᵀ + b_router + b_l. The adapter is frozen at serve time, so the engine
        runs one matmul per layer instead of the router's, then A's, then B's (each a kernel call
        that costs more than its arithmetic on small shapes). W is router-sized: as much memory
        as the model's own router, once per anchor."""
        w = self.B.float() @ self.A.float()
        b = self.bias[anchor].float().clone() if self.bias is not None else None
        if self.fate_base:
            assert router_weight is not None, (
                "this adapter refines the next router's guess: pass its weight"
            )
            dev = router_weight.device
            w, b = w.to(dev) + router_weight.float(), None if b is None else b.to(dev)
            if router_bias is not None:
                b = router_bias.float() if b is None else b + router_bias.float()
        return w, b

    def trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def router_fingerprint(routers: list[torch.Tensor]) -> str:
    """A short hash of the model's router weights: which checkpoint an adapter belongs to."""
    h = hashlib.sha256()
    for w in routers:
        h.update(w.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def save_adapter(
    adapter: RouterAdapter, path: str | Path, fingerprint: str, extra: dict | None = None
) -> Path:
    path = Path(path)
    tensors = {"A": adapter.A.detach().contiguous(), "B": adapter.B.detach().contiguous()}
    if adapter.bias is not None:
        tensors["bias"] = adapter.bias.detach().contiguous()
    meta = {
        "hidden": adapter.hidden,
        "num_experts": adapter.num_experts,
        "rank": adapter.rank,
        "anchors": adapter.anchors,
        "fate_base": adapter.fate_base,
        "fingerprint": fingerprint,
        **(extra or {}),
    }
    save_file(tensors, str(path), metadata={"moe_offload_prefetcher": json.dumps(meta)})
    return path


def load_adapter(path: str | Path, fingerprint: str | None = None) -> RouterAdapter:
    """Load an adapter; with `fingerprint`, refuse one trained for another model (one line)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"{path}: no prefetcher file; train one with `moe-offload train-prefetcher --model DIR --data FILE`"
        )
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        raw = (f.metadata() or {}).get("moe_offload_prefetcher")
    if raw is None:
        raise ConfigError(
            f"{path}: not a moe-offload prefetcher file (no metadata); retrain it with `moe-offload train-prefetcher`"
        )
    meta = json.loads(raw)
    if fingerprint is not None and meta["fingerprint"] != fingerprint:
        raise ConfigError(
            f"{path}: this prefetcher was trained for another checkpoint (router fingerprint {meta['fingerprint']}, "
            f"model has {fingerprint}); retrain it with `moe-offload train-prefetcher`"
        )
    tensors = load_file(str(path))
    adapter = RouterAdapter(
        meta["hidden"],
        meta["num_experts"],
        meta["rank"],
        meta["anchors"],
        "bias" in tensors,
        meta["fate_base"],
    )
    with torch.no_grad():
        adapter.A.copy_(tensors["A"])
        adapter.B.copy_(tensors["B"])
        if adapter.bias is not None:
            adapter.bias.copy_(tensors["bias"])
    return adapter.eval()
