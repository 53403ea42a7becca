"""Interfaces between the engine (mechanism) and the policies (decisions).

Contract: policies are called from the engine's scheduler thread with plain Python
numbers (expert ids, gate weights, router logits, a residency predicate). They never
touch tensors, the transfer engine or the store; the engine carries out what they decide.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

DROPPED = -1  # expert id of a row slot that runs nothing (its gate mass was dropped)


@dataclass(frozen=True)
class ExpertPlan:
    """What the MoE layer runs for the T token rows of one step.

    experts[t][j] / weights[t][j]: the expert and gate weight used for row t, slot j
    (DROPPED means the slot runs nothing). `weights is None` means the router's own
    weights, unchanged (the exact path).
    fetch: non-resident experts that must be loaded before they run.
    substituted: one (missed expert, normalized gate mass) per substituted call.
    calls_hit / calls_fetched: selected (row, slot) calls served from the fast tier / by a load.
    """

    experts: Sequence[Sequence[int]]
    weights: Sequence[Sequence[float]] | None
    fetch: Sequence[int]
    substituted: Sequence[tuple[int, float]] = field(default_factory=tuple)
    calls_hit: int = 0
    calls_fetched: int = 0


class SubstituteChoice(ABC):
    """Decides what stands in for a missed expert that the miss policy chose not to wait for."""

    name: str = "abstract"
    needs_logits: bool = False

    @abstractmethod
    def choose(
        self,
        row_experts: Sequence[int],
        slot: int,
        ranking: Sequence[int] | None,
        is_resident: Callable[[int], bool],
    ) -> int | None:
        """ranking: all experts of the layer by the router's ranking score for this row, best first (given
        when `needs_logits`). Returns the resident expert to run in `slot` instead (it takes the missed expert's weight),
        DROPPED to drop the slot and renormalize the row, or None when nothing can stand in
        (the engine then fetches the missed expert after all). Pure."""


class MissPolicy(ABC):
    """Decides, for each selected expert that is not resident, whether to wait for it."""

    name: str = "abstract"
    needs_logits: bool = False  # set when the plan needs the full router logits per row

    @abstractmethod
    def plan(
        self,
        layer: int,
        experts: Sequence[Sequence[int]],
        weights: Sequence[Sequence[float]],
        is_resident: Callable[[int], bool],
        logits: Sequence[Sequence[float]] | None = None,
    ) -> ExpertPlan:
        """Called once per MoE layer per step, before any expert runs. Pure: no side effects.

        experts/weights: [T][k], each row sorted by gate weight, highest (first choice) first.
        """


class AdmissionPolicy(ABC):
    """Decides which substituted experts are worth bringing into the fast tier in the background."""

    name: str = "abstract"

    @abstractmethod
    def observe(self, layer: int, substituted: Sequence[tuple[int, float]]) -> list[int]:
        """Record this step's substitutions; return experts of `layer` to admit now.

        Stateful (it accumulates evidence) but touches nothing outside itself.
        """


def as_set(candidates: Iterable[Hashable]) -> AbstractSet[Hashable]:
    """Eviction candidates that answer `in` quickly: sets, and the store's live view of its
    evictable residents, as they are; anything else is copied into a set."""
    return candidates if isinstance(candidates, AbstractSet) else set(candidates)


class FilteredView(AbstractSet[Hashable]):
    """The members of `base` that `keep`, as a live view: a policy that walks its own order asks
    `in` of a few keys, and nobody lists every candidate to build a subset."""

    def __init__(self, base: AbstractSet[Hashable], keep: Callable[[Hashable], bool]) -> None:
        self._base, self._keep = base, keep

    def __contains__(self, key: object) -> bool:
        return key in self._base and self._keep(key)

    def __iter__(self):  # noqa: ANN204
        return (k for k in self._base if self._keep(k))

    def __len__(self) -> int:
        return sum(1 for _ in self)


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

    def bind(self, moe_layers: Sequence[int], num_experts: int) -> None:  # noqa: B027 (optional hook)
        """The model's MoE layers in the order a forward runs them, and experts per layer (keys
        are `layer * num_experts + expert`). Policies that rank by layer order use it. Default:
        ignored."""

    def on_layer(self, layer: int) -> None:  # noqa: B027 (optional hook)
        """An MoE layer (model layer index) starts planning: policies that know the forward's
        layer order (reuse distance) track where in it the engine is. Default: ignored."""

    def predicted_next_use(self, key: Hashable) -> float | None:
        """MoE layer runs until `key` is expected to be used, for policies that predict it
        (reuse distance), else None. Prefetchers read it so that a guess never displaces an
        expert that is needed sooner than the guess."""
        return None

    def forget(self, key: Hashable) -> None:
        """A requested load was cancelled or failed before the expert was ever resident: drop it
        without treating it as an eviction (default: the same as on_remove)."""
        self.on_remove(key)

    @abstractmethod
    def victim(self, candidates: Iterable[Hashable]) -> Hashable | None:
        """The candidate to evict, or None when there is no candidate."""
