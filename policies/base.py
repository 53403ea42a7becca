"""Interfaces between the engine (mechanism) and the policies (decisions).

Contract: policies are called from the engine's scheduler thread, with plain Python
numbers. They must not touch tensors, the transfer engine or the store; the engine
carries out what they decide.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertPlan:
    """What the MoE layer runs for the T token rows of one step.

    experts[t][j] / weights[t][j]: the expert and gate weight used for row t, slot j.
    `weights is None` means "the router's own weights, unchanged" (the exact path).
    fetch: experts that are not resident and must be loaded before they run.
    """

    experts: Sequence[Sequence[int]]
    weights: Sequence[Sequence[float]] | None
    fetch: Sequence[int]


class MissPolicy(ABC):
    """Decides, for each selected expert that is not resident, whether to wait for it."""

    name: str = "abstract"

    @abstractmethod
    def plan(
        self,
        layer: int,
        experts: Sequence[Sequence[int]],
        weights: Sequence[Sequence[float]],
        is_resident: Callable[[int], bool],
    ) -> ExpertPlan:
        """Called once per MoE layer per step, before any expert runs. Pure: no side effects."""


class EvictionPolicy(ABC):
    """Chooses which resident expert leaves the fast tier. Keys are opaque hashables.

    The store calls the `on_*` hooks as residency changes and `victim` when it needs a slot;
    keys that are in use (pinned) are never offered as candidates.
    """

    name: str = "abstract"

    @abstractmethod
    def on_insert(self, key: Hashable) -> None: ...

    @abstractmethod
    def on_access(self, key: Hashable) -> None: ...

    @abstractmethod
    def on_remove(self, key: Hashable) -> None: ...

    @abstractmethod
    def victim(self, candidates: Iterable[Hashable]) -> Hashable | None:
        """The candidate to evict, or None when there is no candidate."""
