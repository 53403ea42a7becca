"""A route log: the experts every MoE layer calls, step by step, written for offline replay.

What it is for: measuring a policy against the best possible one on the *same* accesses. `bench serve`
starts the engine with --route-log under a partial fast tier, cuts the log at each load pass, and counts
the loads Belady's MIN (engine/offline/belady.py) would make on it beside the loads the engine made.

Format (text, one line per MoE layer call, in compute order): `layer e1 e2 ...`, the distinct experts
the layer's rows route to, ascending. The first line is a header, `# route log: slots N experts E`:
the fast tier's slots and the experts per layer, so a reader needs nothing else (key = layer * E + e).

The listener is deferred (engine/experts/routing_bus.py): it never keeps a step off the fused path, and
it only reads the router's choice, so the tokens are the same with or without the log.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from engine.experts.routing_bus import RoutingBus, RoutingEvent

HEADER = "# route log: slots {slots} experts {experts}\n"


class RouteLog:
    def __init__(self, path: str | Path, bus: RoutingBus, slots: int, experts: int) -> None:
        self.file: TextIO = open(path, "w", buffering=1)  # line-buffered: a reader sees whole lines
        self.file.write(HEADER.format(slots=slots, experts=experts))
        self._unsubscribe: Callable[[], None] = bus.subscribe(self.on_routing, live=False)

    def on_routing(self, ev: RoutingEvent) -> None:
        ids = sorted(set(ev.ids.reshape(-1).tolist()))
        self.file.write(f"{ev.layer} {' '.join(map(str, ids))}\n")

    def close(self) -> None:
        self._unsubscribe()
        self.file.close()


def read_route_log(path: str | Path) -> tuple[int, int, list[tuple[int, list[int]]]]:
    """(slots, experts per layer, [(layer, experts)]) from a log; a last line still being written is
    left out."""
    text = Path(path).read_text()
    lines = text.split("\n")[:-1]  # the part after the last newline is incomplete
    if not lines or not lines[0].startswith("# route log:"):
        raise ValueError(f"{path}: not a route log (no header)")
    fields = lines[0].split()
    slots, experts = (
        int(fields[fields.index("slots") + 1]),
        int(fields[fields.index("experts") + 1]),
    )
    calls = []
    for line in lines[1:]:
        layer, *ids = (int(v) for v in line.split())
        calls.append((layer, ids))
    return slots, experts, calls
