"""The routing bus: every MoE layer publishes what its native router chose, to any listener.

Listeners (router traces today; the utility estimator and the next-layer predictor later)
subscribe a callable and get one `RoutingEvent` per MoE layer per forward, on the compute
thread, before the layer's experts run. The runner sets the step context first, so a
listener can tell which rows belong to which request. With no subscriber, publishing costs
one truth test.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class StepContext:
    """Which rows of the packed step belong to which request (plain data)."""

    request_ids: tuple[str, ...] = ()
    spans: tuple[tuple[int, int], ...] = ()  # row range of each request's window


@dataclass(frozen=True)
class RoutingEvent:
    layer: int  # model layer index
    x: torch.Tensor  # [T, H] router input
    logits: torch.Tensor  # [T, E] router logits
    ids: torch.Tensor  # [T, k] selected experts, best first
    weights: torch.Tensor  # [T, k] their gate weights
    step: StepContext = field(default_factory=StepContext)


Listener = Callable[[RoutingEvent], None]


class RoutingBus:
    def __init__(self) -> None:
        self._listeners: list[Listener] = []
        self.step = StepContext()

    def subscribe(self, fn: Listener) -> Callable[[], None]:
        """Add a listener; returns the function that removes it."""
        self._listeners.append(fn)
        return lambda: self._listeners.remove(fn)

    @property
    def active(self) -> bool:
        return bool(self._listeners)

    def publish(self, layer: int, x: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        if self._listeners:
            ev = RoutingEvent(layer, x, logits, ids, weights, self.step)
            for fn in list(self._listeners):
                fn(ev)
