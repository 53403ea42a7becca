"""Policies are chosen by name from config files and the command line."""
from __future__ import annotations

from collections.abc import Callable

from policies.base import EvictionPolicy, MissPolicy
from policies.fetch_all import FetchAll
from policies.lru import LRUEviction

MISS_POLICIES: dict[str, Callable[[], MissPolicy]] = {"fetch-all": FetchAll}
EVICTIONS: dict[str, Callable[[], EvictionPolicy]] = {"lru": LRUEviction}


def make_miss_policy(name: str) -> MissPolicy:
    if name not in MISS_POLICIES:
        raise ValueError(f"unknown miss policy {name!r}; choose one of: {', '.join(sorted(MISS_POLICIES))}")
    return MISS_POLICIES[name]()


def make_eviction(name: str) -> EvictionPolicy:
    if name not in EVICTIONS:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of: {', '.join(sorted(EVICTIONS))}")
    return EVICTIONS[name]()
