"""The replacement for transformers' sparse MoE block.

It keeps the native router (`gate`) and, for Qwen2-MoE, the shared expert and its
gate, untouched, so routing is exactly as trained. Only the routed experts move: they
run through the MoeExecutor against the tiered expert store.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.experts.moe_executor import MoeExecutor
from engine.experts.routing_bus import RoutingBus


def is_sparse_moe_block(module: nn.Module) -> bool:
    experts = getattr(module, "experts", None)
    return hasattr(module, "gate") and experts is not None and hasattr(experts, "gate_up_proj")


class OffloadedMoeBlock(nn.Module):
    def __init__(self, native: nn.Module, layer: int, executor: MoeExecutor, bus: RoutingBus) -> None:
        super().__init__()
        self.layer = layer
        self.gate = native.gate  # native router: (logits, top-k weights, top-k ids)
        self.shared_expert = getattr(native, "shared_expert", None)
        self.shared_expert_gate = getattr(native, "shared_expert_gate", None)
        self.executor = executor  # plain attributes, not submodules: they own no parameters
        self.bus = bus  # traces, estimators and predictors listen here

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        B, S, H = hidden_states.shape
        x = hidden_states.reshape(-1, H)  # [T, H]
        logits, weights, ids = self.gate(x)  # [T, E], [T, k], [T, k]
        self.bus.publish(self.layer, x, logits, ids, weights)
        out = self.executor.run(self.layer, x, ids, weights, logits)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = F.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out.reshape(B, S, H)
