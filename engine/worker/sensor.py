"""The speculative sensor (MoE-SpAc): per-expert activation counts in each verification window.

It listens to the routing bus during the target's forward, keeps each MoE layer's top-k ids
for the step, and after verification turns them into `WindowCounts` for every request that
had proposals: counts over all window rows, and over the rows that were kept. The step's
report goes out on the bus (`subscribe_windows`); the distinct experts per window and layer
are counted in EngineStats next to the plain per-token top-k.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.core.step_types import StepOutput, StepPlan
from engine.experts.routing_bus import RoutingBus, RoutingEvent, WindowCounts, WindowReport
from engine.stats import EngineStats


class SpecSensor:
    def __init__(self, bus: RoutingBus, stats: EngineStats, num_experts: int) -> None:
        self.bus, self.stats, self.num_experts = bus, stats, num_experts
        # Also report plain decode steps as one-row windows (the utility estimator listens even
        # when a request decodes without proposals); they are kept out of the window metrics.
        self.include_plain = False
        self._step: dict[int, RoutingEvent] = {}
        bus.subscribe(
            self._on_routing, live=False
        )  # counts after the forward: the fused step may run

    def _on_routing(self, ev: RoutingEvent) -> None:
        self._step[ev.layer] = ev  # a rerun after a failed read overwrites: the last forward counts

    def observe(self, plan: StepPlan, out: StepOutput) -> None:
        events, self._step = self._step, {}
        windows: list[WindowCounts] = []
        union: dict[int, torch.Tensor] = {}
        for layer, ev in events.items():
            span_of = dict(zip(ev.step.request_ids, ev.step.spans))
            for w in plan.work:
                res = out.results.get(w.request_id)
                plain = w.num_draft == 0
                if (
                    (plain and (w.is_prefill or not self.include_plain))
                    or res is None
                    or res.error is not None
                    or w.request_id not in span_of
                ):
                    continue
                s, e = span_of[w.request_id]
                first = e - 1 - w.num_draft  # window rows: [last token, proposals]
                kept = len(res.sampled)  # the last token's row + accepted proposals
                ids = ev.ids[first:e]  # [rows, k]
                counts = torch.bincount(ids.flatten(), minlength=self.num_experts).cpu()
                acc = torch.bincount(ids[:kept].flatten(), minlength=self.num_experts).cpu()
                windows.append(WindowCounts(layer, w.request_id, e - first, kept, counts, acc))
                union[layer] = union.get(layer, torch.zeros_like(counts)) + counts
                if not plain:
                    self.stats.record_window_experts(layer, int((counts > 0).sum()))
        if windows:
            self.bus.publish_windows(WindowReport(tuple(windows), union))


def sensor_for(om: Any) -> SpecSensor:
    """The model's one sensor (speculation and the utility estimator share it, so every window
    is reported once); created on first use and run by every engine core of this model."""
    if om.sensor is None:
        om.sensor = SpecSensor(om.bus, om.stats, om.num_experts)
    return om.sensor
