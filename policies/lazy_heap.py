"""A min-heap of (order, key) kept lazily, for eviction policies whose orders only rise between
evictions (a use raises an expert's order; nothing lowers it): entries are not updated on every
use, only when they reach the top. Shared by frequency and reuse-distance eviction."""

from __future__ import annotations

import heapq
from collections.abc import Container, Hashable, Mapping


def lowest_allowed(
    heap: list[tuple[float, Hashable]],
    current: Mapping[Hashable, float],
    allowed: Container[Hashable],
) -> tuple[Hashable, float] | None:
    """The allowed key with the lowest current order, and that order. Entries older than their
    key's current order (used since) are re-pushed at it; entries of keys gone from `current`
    (evicted) are dropped; keys that are not allowed now (pinned, protected) are put back after."""
    skipped, found = [], None
    while heap:
        order, key = heap[0]
        now = current.get(key)
        if now != order:
            heapq.heappop(heap)
            if now is not None:
                heapq.heappush(heap, (now, key))  # used since: its real place is further down
            continue
        if key in allowed:
            found = (key, order)
            break
        skipped.append(heapq.heappop(heap))
    for entry in skipped:
        heapq.heappush(heap, entry)
    return found
