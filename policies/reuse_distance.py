"""Reuse-distance eviction: evict the expert whose next use is predicted farthest away.

Belady's MIN (engine/offline/belady.py) evicts the expert used farthest in the future; this
policy estimates that time from two things an MoE server knows:

- **The layer cycle.** MoE layers run in a fixed order, once per forward. When layer l is
  running, an expert of layer l+1 can be needed within one layer, while an expert of layer l
  that this call did not use cannot be needed before the next forward. LRU gets this
  backwards as soon as a step's experts outnumber the tier: the expert it evicts (least
  recently used) belongs to the layer that runs next, and so every step evicts exactly what
  the next step needs. With 8 streams on the embedded model at cache 0.25, LRU made 3× the
  loads of MIN on the same accesses (docs/benchmarks/concurrency.md).
- **How often the expert is used.** p, an exponential moving average over the forwards that
  ran its layer of whether it was used (rate `RATE`), so an expert kept by one stream's
  topic has p near 1 and a one-off has p near `RATE`, decaying.

The predicted next use, in MoE layer runs from now, is the distance to the expert's layer's
next run plus (1/p - 1) whole forwards (the mean wait of a geometric law), and the victim is
the expert with the largest one. Pure decision object: the store tells it which layer starts
(`on_layer`) and which experts are used; keys are the store's `layer * num_experts + expert`.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable, Iterable, Sequence

from policies.base import EvictionPolicy, as_set
from policies.lazy_heap import lowest_allowed

RATE = (
    0.5  # EMA rate of p per run of the expert's layer: a use counts about as much as the last two
)


class ReuseDistanceEviction(EvictionPolicy):
    """Keys are `layer * num_experts + expert`. Within one layer every expert's p decays by the
    same factor per run of the layer, so their order by p only changes when one is used: each
    layer keeps a heap of its residents ordered by log p as of run 0, and a victim is found by
    comparing the least likely resident of each layer, not by scanning every resident."""

    name = "reuse"

    def __init__(self, rate: float = RATE) -> None:
        if not 0.0 < rate < 1.0:
            raise ValueError(f"reuse rate must be in (0, 1), got {rate}")
        self.rate = rate
        self._log_keep = math.log1p(-rate)  # log of the factor p decays by per run of its layer
        self._position: dict[int, int] = {}  # model layer -> its place in the forward's order
        self.num_experts = 0
        self._runs: dict[int, int] = {}  # model layer -> how many times it started
        self._current = -1  # place of the layer running now (-1: none yet)
        self._p: dict[
            Hashable, tuple[float, int]
        ] = {}  # key -> (p just after its last use, runs then)
        # Residents: key -> log p as of run 0 of its layer (the heap order); per layer, a heap of
        # (that value, key) with stale entries skipped lazily.
        self._resident: dict[Hashable, float] = {}
        self._heaps: dict[int, list[tuple[float, Hashable]]] = {}
        self._stale = 0  # heap entries pushed by inserts since the heaps were last rebuilt

    def bind(self, moe_layers: Sequence[int], num_experts: int) -> None:
        """Tell the policy the model's MoE layers, in the order a forward runs them."""
        self._position = {layer: i for i, layer in enumerate(moe_layers)}
        self.num_experts = num_experts

    # -- what happens -----------------------------------------------------------------------
    def on_layer(self, layer: int) -> None:
        self._runs[layer] = self._runs.get(layer, 0) + 1
        self._current = self._position.get(layer, -1)

    def on_insert(self, key: Hashable) -> None:
        self._use(key, insert=True)

    def on_access(self, key: Hashable) -> None:
        self._use(key)

    def on_remove(self, key: Hashable) -> None:
        self._resident.pop(key, None)  # its heap entry goes stale; p outlives residency

    def forget(self, key: Hashable) -> None:
        self._resident.pop(key, None)

    def _layer(self, key: Hashable) -> int:
        return int(key) // self.num_experts if self.num_experts else 0  # type: ignore[call-overload]

    def _use(self, key: Hashable, insert: bool = False) -> None:
        layer = self._layer(key)
        runs = self._runs.get(layer, 0)
        st = self._p.get(key)
        if st is not None and st[1] == runs:  # already counted in this run of its layer
            if not insert:
                return
            p = st[0]
        else:
            p = (st[0] * math.exp(self._log_keep * (runs - st[1])) if st else 0.0) + self.rate
            self._p[key] = (p, runs)
        order = math.log(p) - self._log_keep * runs  # log p at run r is order + r * log_keep
        if insert:
            self._resident[key] = order
            heapq.heappush(self._heaps.setdefault(layer, []), (order, key))
            self._stale += 1
            if self._stale > len(self._resident) + 1024:
                self._rebuild()
        elif key in self._resident:
            # A use only raises a resident's order, so its heap entry stays a lower bound: it is
            # brought up to date when it reaches the top (`lowest_allowed`), not on every use.
            self._resident[key] = order

    def _rebuild(self) -> None:
        """Drop the stale entries: every insert pushes one, and a stale entry leaves only when it
        reaches a heap's top during an eviction, so without a bound the heaps could keep growing."""
        heaps: dict[int, list[tuple[float, Hashable]]] = {}
        for key, order in self._resident.items():
            heaps.setdefault(self._layer(key), []).append((order, key))
        for heap in heaps.values():
            heapq.heapify(heap)
        self._heaps, self._stale = heaps, 0

    # -- the decision -------------------------------------------------------------------------
    def predicted_next_use(self, key: Hashable) -> float:
        """MoE layer runs until `key` is expected to be used again (inf: never seen used)."""
        st = self._p.get(key)
        if st is None:
            return math.inf
        layer = self._layer(key)
        return self._wait(
            layer, st[0] * math.exp(self._log_keep * (self._runs.get(layer, 0) - st[1]))
        )

    def _wait(self, layer: int, p: float) -> float:
        """MoE layer runs until an expert of `layer` used with probability p per forward is used:
        until its layer runs next (the running layer comes back after a whole forward), plus the
        mean wait of a geometric law in whole forwards. inf when p underflowed to 0."""
        if p <= 0.0:
            return math.inf
        n = max(1, len(self._position))
        ahead = (self._position.get(layer, 0) - self._current) % n or n
        return ahead + n * (1.0 / p - 1.0)

    def victim(self, candidates: Iterable[Hashable]) -> Hashable | None:
        allowed = as_set(candidates)
        best, best_key = -1.0, None
        for layer, heap in self._heaps.items():
            found = lowest_allowed(heap, self._resident, allowed)
            if found is None:
                continue
            key, order = found
            t = self._wait(layer, math.exp(order + self._log_keep * self._runs.get(layer, 0)))
            if t == math.inf:
                return key  # unused for so long that p underflowed: no use is expected at all
            if t > best:
                best, best_key = t, key
        if best_key is None:  # candidates the policy never saw inserted: any of them
            best_key = next((k for k in allowed if k not in self._resident), None)
        return best_key
