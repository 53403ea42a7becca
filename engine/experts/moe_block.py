"""The replacement for transformers' sparse MoE block.

It keeps the native router (`gate`) and, for Qwen2-MoE, the shared expert and its
gate, untouched, so routing is exactly as trained. Only the routed experts move: they
run through the MoeExecutor against the tiered expert store.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.experts.moe_executor import MoeExecutor
from engine.weights.moe_hook import BlockAdapter


def is_sparse_moe_block(module: nn.Module) -> bool:
    experts = getattr(module, "experts", None)
    return hasattr(module, "gate") and experts is not None and hasattr(experts, "gate_up_proj")


class OffloadedMoeBlock(nn.Module):
    def __init__(self, native: nn.Module, layer: int, executor: MoeExecutor, adapter: BlockAdapter | None = None) -> None:
        super().__init__()
        self.layer = layer
        # How this architecture routes and combines (engine/weights/moe_hook.py); plain attribute, not a module.
        self.adapter = adapter if adapter is not None else BlockAdapter(native, "?")
        self.adapter.adopt(self, native)  # native router, shared experts and block buffers, under their names
        self.executor = executor  # plain attribute, not a submodule: it owns no parameters
        # Optional hook (x, logits, ids, weights) for traces and prefetchers; None costs nothing.
        self.observer: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        B, S, H = hidden_states.shape
        x = hidden_states.reshape(-1, H)  # [T, H]
        logits, weights, ids = self.adapter.route(self, x)  # [T, E], [T, k], [T, k]
        if self.observer is not None:
            self.observer(x, logits, ids, weights)
        x_in, w_in = self.adapter.expert_inputs(x, weights)  # Llama 4 scales the input rows instead
        out = self.executor.run(self.layer, x_in, ids, w_in, logits)
        shared = self.adapter.dense(self, x)
        if shared is not None:
            out = out + shared
        return self.adapter.output(out.reshape(B, S, H), logits, weights)
