"""The routing bus: every MoE layer publishes what its native router chose, to any listener.

Listeners (router traces, the speculative sensor, the next-layer predictor) subscribe a callable
and get one `RoutingEvent` per MoE layer per forward, on the compute thread. A *live* listener
gets it before the layer's experts run (a predictor that starts transfers for the next layer
must); a *deferred* one may get it after the step's forward: the fused decode step
(engine/worker/fused_decode.py) runs a whole layer in one native call, which writes its routing to
a buffer, and publishes the step's events after the call, so only live listeners keep a step off
that path. The runner sets the step context first, so a listener can tell which rows belong to
which request. With no subscriber, publishing costs one truth test.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


def spans_of(lengths: list[int]) -> list[tuple[int, int]]:
    """Row range [start, end) of each window in the packed sequence."""
    spans, start = [], 0
    for n in lengths:
        spans.append((start, start + n))
        start += n
    return spans


@dataclass(frozen=True)
class StepContext:
    """Which rows of the packed step belong to which request (plain data)."""

    request_ids: tuple[str, ...] = ()
    spans: tuple[tuple[int, int], ...] = ()  # row range of each request's window
    # Each request's window (its input tokens) and the position of its first token: what a
    # predictor that runs its own model on the step's tokens needs (engine/prefetch/draft_predictor.py).
    windows: tuple[list[int], ...] = ()
    starts: tuple[int, ...] = ()

    @classmethod
    def of(
        cls, request_ids: tuple[str, ...], windows: list[list[int]], starts: list[int]
    ) -> StepContext:
        """The context of a packed step of `windows` (one per request, in row order)."""
        spans = tuple(spans_of([len(w) for w in windows]))
        return cls(request_ids, spans, tuple(windows), tuple(starts))


@dataclass(frozen=True)
class RoutingEvent:
    layer: int  # model layer index
    x: torch.Tensor  # [T, H] router input
    logits: torch.Tensor  # [T, E] router logits
    ids: torch.Tensor  # [T, k] selected experts, best first
    weights: torch.Tensor  # [T, k] their gate weights
    step: StepContext = field(default_factory=StepContext)


@dataclass(frozen=True)
class WindowCounts:
    """The speculative sensor's reading for one request's verification window in one MoE layer.

    counts[e]: activations of expert e over the window's rows (0..rows); accepted_counts[e]:
    the same over the rows whose tokens were kept (the last token and the accepted proposals).
    """

    layer: int
    request_id: str
    rows: int  # 1 + proposals
    kept: int  # rows whose positions were accepted
    counts: torch.Tensor  # [E] int64
    accepted_counts: torch.Tensor  # [E] int64


@dataclass(frozen=True)
class WindowReport:
    """Every verification window of one step, per layer and request, plus the step's union."""

    windows: tuple[WindowCounts, ...]
    union: dict[int, torch.Tensor]  # layer -> [E] counts summed over the step's windows


Listener = Callable[[RoutingEvent], None]
WindowListener = Callable[[WindowReport], None]


class RoutingBus:
    def __init__(self) -> None:
        self._listeners: list[Listener] = []
        self._live: list[
            Listener
        ] = []  # the listeners that must see a layer's routing before its experts run
        self._window_listeners: list[WindowListener] = []
        self.step = StepContext()

    def subscribe(self, fn: Listener, *, live: bool = True) -> Callable[[], None]:
        """Add a listener; returns the function that removes it. live=False: the listener may get a
        step's events after the step's forward (see the module docstring)."""
        self._listeners.append(fn)
        if live:
            self._live.append(fn)

        def remove() -> None:
            self._listeners.remove(fn)
            if fn in self._live:
                self._live.remove(fn)

        return remove

    def subscribe_windows(self, fn: WindowListener) -> Callable[[], None]:
        """Listen to the speculative sensor: one WindowReport after each verification step."""
        self._window_listeners.append(fn)
        return lambda: self._window_listeners.remove(fn)

    def publish_windows(self, report: WindowReport) -> None:
        for fn in list(self._window_listeners):
            fn(report)

    @property
    def active(self) -> bool:
        """Whether anyone listens to routing events at all."""
        return bool(self._listeners)

    @property
    def live(self) -> bool:
        """Whether a listener must see each layer's routing before the layer's experts run."""
        return bool(self._live)

    def publish(
        self,
        layer: int,
        x: torch.Tensor,
        logits: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
    ) -> None:
        if self._listeners:
            ev = RoutingEvent(layer, x, logits, ids, weights, self.step)
            for fn in list(self._listeners):
                fn(ev)
