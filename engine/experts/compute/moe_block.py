"""The replacement for transformers' sparse MoE block.

It keeps the native router and any shared expert or dense MLP (through the architecture's
BlockAdapter, engine/weights/moe_hook.py) untouched, so routing is exactly as trained. Only the routed experts move: they
run through the MoeExecutor against the tiered expert store.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from engine.experts.compute.moe_executor import MoeExecutor
from engine.experts.routing_bus import RoutingBus
from engine.weights.moe_hook import BlockAdapter, router_ranking


class OffloadedMoeBlock(nn.Module):
    def __init__(
        self,
        native: nn.Module,
        layer: int,
        executor: MoeExecutor,
        bus: RoutingBus,
        adapter: BlockAdapter | None = None,
    ) -> None:
        super().__init__()
        self.layer = layer
        # How this architecture routes and combines (engine/weights/moe_hook.py); plain attribute, not a module.
        self.adapter = adapter if adapter is not None else BlockAdapter(native, "?")
        self.adapter.adopt(
            self, native
        )  # native router, shared experts and block buffers, under their names
        self.executor = executor  # plain attributes, not submodules: they own no parameters
        self.bus = bus  # traces, estimators and predictors listen here
        # The router's balancing bias for ranking stand-ins, looked up on first use (after the model
        # has been placed on its device): looking it up is nn.Module getattrs that raise and catch an
        # AttributeError on routers without one, microseconds in every layer of every step.
        self._score_bias: torch.Tensor | None = None
        self._score_bias_known = False
        # Timers of this block's calls (benchmarks: bench/measure_hardware.py), each told (seconds, rows) after a
        # call. A timed block keeps the layer-by-layer path: the fused decode step runs no block's Python.
        self.timers: list[Callable[[float, int], None]] = []

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        B, S, H = hidden_states.shape
        out, logits, weights = self._rows(hidden_states.reshape(-1, H))
        return self.adapter.output(out.reshape(B, S, H), logits, weights)  # type: ignore[return-value]  # a tuple where the architecture's block returns one

    def forward_rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H], for callers that keep hidden states as rows (engine/worker/lean_forward.py);
        only where the architecture returns the block's output as it is (`plain_output`)."""
        return self._rows(x)[0]

    @property
    def plain_output(self) -> bool:
        return type(self.adapter).output is BlockAdapter.output

    def _rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> (the block's output rows [T, H], router logits [T, E], top-k weights [T, k])."""
        if not self.timers:
            return self._compute(x)
        t0 = time.perf_counter()
        out = self._compute(x)
        for timer in self.timers:
            timer(time.perf_counter() - t0, x.shape[0])
        return out

    def _compute(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits, weights, ids = self.adapter.route(self, x)  # [T, E], [T, k], [T, k]
        # Policies, traces and predictors read slot 0 as the first choice. Softmax routers return their
        # top-k sorted; DeepSeek-V3-style routers (glm4_moe, deepseek_v3) take topk(sorted=False), so sort here.
        if not self.adapter.sorted_topk and not _sorted_row(weights):
            order = torch.argsort(weights, dim=1, descending=True, stable=True)
            weights, ids = weights.gather(1, order), ids.gather(1, order)
        self.bus.publish(self.layer, x, logits, ids, weights)
        x_in, w_in = self.adapter.expert_inputs(x, weights)  # Llama 4 scales the input rows instead
        # Stand-ins are ranked as the router ranks (sigmoid + balancing bias for DeepSeek-V3-style
        # routers): the resident expert it would have picked next. On the embedded glm4_moe this
        # measured lower ΔPPL than ranking raw logits (docs/benchmarks/policies.md section 1).
        scores = logits
        if self.executor.policy.needs_logits:
            if not self._score_bias_known:
                self._score_bias, self._score_bias_known = self.adapter.selection_bias(self), True
            scores = router_ranking(logits, self._score_bias)
        out = self.executor.run(self.layer, x_in, ids, w_in, scores)
        shared = self.adapter.dense(self, x)
        if shared is not None:
            out = out + shared
        return out, logits, weights


def _sorted_row(weights: torch.Tensor) -> bool:
    """A single row already in descending order (softmax routers' sorted top-k): the stable sort
    would leave it as it is, so a decode step skips its three tensor ops."""
    if weights.shape[0] != 1:
        return False
    w = weights.tolist()[0]
    return all(a >= b for a, b in zip(w, w[1:]))
