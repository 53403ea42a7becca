"""The fewest loads any eviction policy could make on a recorded sequence of expert accesses.

Belady's MIN: on a miss with a full tier, evict the resident expert whose next use is
farthest in the future (or never). No online policy can do better on the same sequence, so
the count is a lower bound for LRU, frequency, utility eviction and any prefetcher that only
moves loads earlier (a prefetched expert still costs one load).

The engine computes the experts of a layer one after another and releases each slot after
its expert ran, so flattening each layer's set of experts into consecutive single accesses
is the same constraint the executor works under.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Sequence

NEVER = 1 << 62


def flatten(accesses: Iterable[Iterable[int]]) -> list[int]:
    """Expert keys in access order, one entry per (layer call, expert), sorted within a call."""
    return [key for group in accesses for key in sorted(set(group))]


def min_loads(sequence: Sequence[int], capacity: int, resident: Iterable[int] = ()) -> int:
    """Loads Belady's MIN makes on `sequence` with `capacity` slots, starting from `resident`."""
    return len(min_load_positions(sequence, capacity, resident))


def min_load_positions(
    sequence: Sequence[int], capacity: int, resident: Iterable[int] = ()
) -> list[int]:
    """The positions in `sequence` where Belady's MIN loads (see min_loads): a part of a longer
    recording (one load pass of a server) counts the loads of the recording's best schedule inside it."""
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    next_use = [NEVER] * len(sequence)
    last: dict[int, int] = {}
    for i in range(len(sequence) - 1, -1, -1):
        next_use[i] = last.get(sequence[i], NEVER)
        last[sequence[i]] = i
    # The starting residents: keep at most `capacity`, those used soonest (MIN's own choice).
    start = sorted(set(resident), key=lambda k: last.get(k, NEVER))[:capacity]
    cached: dict[int, int] = {k: last.get(k, NEVER) for k in start}  # key -> its next use
    heap = [(-nu, k) for k, nu in cached.items()]  # max-heap on next use, stale entries skipped
    heapq.heapify(heap)
    loads: list[int] = []
    for i, key in enumerate(sequence):
        if key not in cached:
            loads.append(i)
            if len(cached) >= capacity:
                while True:
                    nu, victim = heapq.heappop(heap)
                    if cached.get(victim) == -nu:
                        del cached[victim]
                        break
        cached[key] = next_use[i]
        heapq.heappush(heap, (-next_use[i], key))
    return loads


def lru_loads(sequence: Sequence[int], capacity: int, resident: Iterable[int] = ()) -> int:
    """Loads plain LRU makes on the same sequence: checks that a recording matches the engine."""
    cached: OrderedDict[int, None] = OrderedDict((k, None) for k in list(resident)[:capacity])
    loads = 0
    for key in sequence:
        if key in cached:
            cached.move_to_end(key)
            continue
        loads += 1
        if len(cached) >= capacity:
            cached.popitem(last=False)
        cached[key] = None
    return loads
