"""Next-layer expert predictors beside SpecPrefetch's adapter (engine/prefetch/adapter.py), the
baselines the seed compares it with. Each is a torch module called as the adapter is,
`module(x [T, D], anchor, base [T, E] | None) -> logits [T, E]`, so the same trainer
(engine/prefetch/training.py fit_predictor), the same recall measure and the same engine hook
(engine/prefetch/adapter_prefetcher.py) take every one of them.

- **FATE**: layer l+1's own router applied to layer l's router input, no parameter of its own:
  `fate_predictor` is an adapter whose low-rank term is zero and which has no bias.
- **ProMoE-style**: one small network per layer from this layer's hidden state to the next
  layer's expert scores, trained offline; ProMoE's predictors are per-layer MLPs that do not use
  the model's router: `PerLayerPredictor(..., mlp_width=W, fate_base=False)`.
- **Draft model**: the speculative pair's draft runs on the token before the target does; its
  final hidden state, mapped to each target MoE layer's router space by a per-layer linear head,
  is the draft's routing of the target's experts (the embedded draft is dense: it has no router
  of its own to reuse). `PerLayerPredictor(draft_hidden, ..., fate_base=False)` on inputs from
  `draft_hidden_states`.
- `PerLayerPredictor(..., fate_base=True)` is also bench/prefetch_bound.py's bound: the guess plus
  a full map per layer contains every linear predictor of the adapter's form.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.prefetch.adapter import RouterAdapter


def fate_predictor(hidden: int, num_experts: int, anchors: int) -> RouterAdapter:
    """FATE as an adapter: the next router on this layer's input, nothing learned (B = 0, no bias).
    In the engine it folds into the next router's own weight: one matmul per layer."""
    return RouterAdapter(hidden, num_experts, rank=1, anchors=anchors, bias=False).eval()


class PerLayerPredictor(nn.Module):
    """One head per anchor layer (a Linear, or a one-hidden-layer GELU MLP) from an input vector
    to the next layer's logits; with `fate_base` the head is added to the next router's guess."""

    def __init__(
        self,
        hidden: int,
        experts: int,
        anchors: int,
        mlp_width: int = 0,
        fate_base: bool = True,
    ) -> None:
        super().__init__()
        self.fate_base = fate_base

        def head() -> nn.Module:
            if not mlp_width:
                return nn.Linear(hidden, experts)
            return nn.Sequential(
                nn.Linear(hidden, mlp_width), nn.GELU(), nn.Linear(mlp_width, experts)
            )

        self.heads = nn.ModuleList(head() for _ in range(anchors))
        if fate_base:  # start as exactly the guess, like the adapter
            for h in self.heads:
                last = h[-1] if isinstance(h, nn.Sequential) else h
                assert isinstance(last, nn.Linear)
                nn.init.zeros_(last.weight)
                nn.init.zeros_(last.bias)

    def forward(
        self, x: torch.Tensor, anchors: int | torch.Tensor, base: torch.Tensor | None
    ) -> torch.Tensor:
        """x [T, D]; anchors: one anchor for every row (the engine's call) or one per row [T]
        (the trainer's random batches); base [T, E], needed only with fate_base."""
        if isinstance(anchors, int):
            out = self.heads[anchors](x.float())
        else:
            out = torch.zeros(x.shape[0], self.heads_out(), dtype=torch.float32, device=x.device)
            for a, h in enumerate(self.heads):
                sel = anchors == a
                if bool(sel.any()):
                    out[sel] = h(x[sel].float())
        if self.fate_base:
            assert base is not None, "this predictor refines the next router's guess: pass base"
            out = out + base.float()
        return out

    def heads_out(self) -> int:
        last = self.heads[0]
        last = last[-1] if isinstance(last, nn.Sequential) else last
        assert isinstance(last, nn.Linear)
        return last.out_features

    def trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


@torch.inference_mode()
def draft_hidden_states(draft: nn.Module, windows: list[list[int]]) -> torch.Tensor:
    """The draft model's last hidden state (`hidden_states[-1]`) for every token of `windows`
    [N, D_draft], each window run on its own from an empty KV cache, as engine/offline/trace.py
    runs the target, so row i of both belongs to the same token and context."""
    dev = next(draft.parameters()).device
    out = []
    for w in windows:
        res = draft(input_ids=torch.tensor([w], device=dev), output_hidden_states=True)
        out.append(res.hidden_states[-1][0].float().cpu())
    return torch.cat(out) if out else torch.zeros(0, 0)
