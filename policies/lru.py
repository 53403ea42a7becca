"""Least-recently-used eviction."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable

from policies.base import EvictionPolicy, as_set


class LRUEviction(EvictionPolicy):
    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()  # oldest first

    def on_insert(self, key: Hashable) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_access(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victim(self, candidates: Iterable[Hashable]) -> Hashable | None:
        allowed = as_set(candidates)  # the store passes a live view: no copy of every resident
        for key in self._order:  # oldest first
            if key in allowed:
                return key
        return None
