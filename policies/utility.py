"""MoE-SpAc's Speculative Utility Estimator, and the `utility` eviction policy built on it.

Input: per MoE layer, how often each expert was activated in a verification window (the
speculative sensor, engine/speculative/sensor.py), with the rows of accepted tokens told apart from
rejected ones. Output: a utility level in {0..K} for every (layer, expert), read by the
prefetcher (queue the highest levels that are not resident), by the eviction policy (the
lowest levels leave first) and by the CPU/GPU balancer (hot experts go to the fast device).

Three mechanisms, each with its constant documented below:

- **Demand signal.** A window's count for an expert is the number of its rows that routed to
  the expert (0..rows). Accepted rows count fully, rejected rows count `REJECTED_WEIGHT`:
  a rejected proposal's routing still hints at what the next tokens need, but less.
- **Adaptive boundaries.** The count thresholds b_1 < ... < b_K that map a count to a target
  level follow the workload: b_1 is "used at all" (any count > 0), and b_2..b_K are moving
  averages (rate `BOUNDARY_RATE`) of quantiles of the non-zero counts seen in recent windows.
  A wider window (k=6 instead of 2) or more concurrent requests raise every count, and the
  boundaries follow, so "hot" keeps meaning "among the most used of this workload".
- **Inertial transitions.** A level moves only when the window's target level has been on the
  same side of it for `PATIENCE` consecutive windows; it then moves to the most conservative
  target of that run (the one closest to the current level). A one-window spike, or a single
  window without the expert, moves nothing.

The seed (MoE-SpAc) gives none of these constants; the values are ours, chosen on the
embedded model and documented here so they can be tuned. Pure: plain numbers in and out.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence

from policies.base import EvictionPolicy, FilteredView, as_set
from policies.reuse_distance import ReuseDistanceEviction

NUM_LEVELS = 4  # K + 1: levels 0 (cold) .. 3 (hot)
PATIENCE = 2  # consecutive windows a change must persist before a level moves
REJECTED_WEIGHT = 0.5  # weight of a rejected row's activation against an accepted row's
BOUNDARY_RATE = 0.1  # moving-average rate of the boundaries (about the last 10 windows)
BOUNDARY_QUANTILES = (0.5, 0.8)  # quantiles of the non-zero counts behind b_2 .. b_K
PREFETCH_MIN_LEVEL = (
    1  # level at which an expert is worth a prefetch: used in two consecutive windows
)
PROTECTED_FORWARDS = (
    2  # a prefetched expert stays protected for this many forwards' worth of MoE layer runs
)


def protect_ticks(num_moe_layers: int) -> int:
    """MoE layer runs a prefetched expert stays protected from eviction by other guesses."""
    return PROTECTED_FORWARDS * num_moe_layers


class SpeculativeUtilityEstimator:
    """Per-(layer, expert) utility levels from verification-window activation counts."""

    def __init__(
        self,
        num_experts: int,
        levels: int = NUM_LEVELS,
        patience: int = PATIENCE,
        rejected_weight: float = REJECTED_WEIGHT,
        boundary_rate: float = BOUNDARY_RATE,
        quantiles: Sequence[float] = BOUNDARY_QUANTILES,
    ) -> None:
        if levels < 2 or len(quantiles) != levels - 2:
            raise ValueError(
                f"{levels} levels need {levels - 2} boundary quantiles, got {len(quantiles)}"
            )
        self.num_experts, self.levels, self.patience = num_experts, levels, patience
        self.rejected_weight, self.rate, self.quantiles = (
            rejected_weight,
            boundary_rate,
            tuple(quantiles),
        )
        self.boundaries: list[
            float
        ] = []  # b_2 .. b_K (b_1 is "count > 0"); empty until the first window
        self._level: dict[tuple[int, int], int] = {}  # (layer, expert) -> level, absent = 0
        self._run: dict[
            tuple[int, int], tuple[int, int]
        ] = {}  # key -> (signed run length, conservative target)
        self.windows = 0
        self._hot: tuple[int, dict[int, int]] = (-1, {})  # (windows then, hot_keys() then)

    # -- reading --------------------------------------------------------------------------
    def level(self, layer: int, expert: int) -> int:
        return self._level.get((layer, expert), 0)

    def hot_keys(self) -> dict[int, int]:
        """Store keys (`layer * num_experts + expert`) of every expert above level 0, with its level.
        Levels only change in `observe`, so this is rebuilt once per window, not per eviction."""
        if self._hot[0] != self.windows:
            E = self.num_experts
            self._hot = (
                self.windows,
                {layer * E + e: lv for (layer, e), lv in self._level.items()},
            )
        return self._hot[1]

    def histogram(self, layers: Iterable[int]) -> list[int]:
        """How many (layer, expert) pairs sit at each level, over `layers`."""
        hist = [0] * self.levels
        for layer in layers:
            for e in range(self.num_experts):
                hist[self.level(layer, e)] += 1
        return hist

    def ranked(self, layer: int, min_level: int = 1) -> list[int]:
        """Experts of `layer` at `min_level` or above, hottest first (ties: lower id first)."""
        hot = [(lv, e) for (la, e), lv in self._level.items() if la == layer and lv >= min_level]
        return [e for lv, e in sorted(hot, key=lambda p: (-p[0], p[1]))]

    def target(self, count: float) -> int:
        """The level a single window's count points to, under the current boundaries."""
        if count <= 0:
            return 0
        return 1 + sum(count >= b for b in self.boundaries)

    # -- learning -------------------------------------------------------------------------
    def observe(self, layer_counts: Mapping[int, tuple[Sequence[int], Sequence[int]]]) -> None:
        """One step's windows. layer_counts[layer] = (counts over all window rows, counts over
        the accepted rows), each of length num_experts, summed over the step's requests."""
        effective = {
            layer: [acc + self.rejected_weight * (tot - acc) for tot, acc in zip(counts, accepted)]
            for layer, (counts, accepted) in layer_counts.items()
        }
        self._calibrate([c for row in effective.values() for c in row if c > 0])
        for layer, row in effective.items():
            for e, c in enumerate(row):
                self._step_key((layer, e), self.target(c))
        self.windows += 1

    def _calibrate(self, nonzero: list[float]) -> None:
        """Move b_2..b_K toward this window's quantiles of the non-zero counts (kept increasing)."""
        if not nonzero:
            return
        nonzero.sort()
        fresh = [nonzero[min(len(nonzero) - 1, int(q * len(nonzero)))] for q in self.quantiles]
        if not self.boundaries:
            self.boundaries = fresh
        else:
            self.boundaries = [b + self.rate * (f - b) for b, f in zip(self.boundaries, fresh)]
        # A count must exceed "used at all" to be warm, and each boundary must exceed the last.
        floor = 1.0
        for i, b in enumerate(self.boundaries):
            floor = self.boundaries[i] = max(b, floor + 1e-9)

    def _step_key(self, key: tuple[int, int], target: int) -> None:
        level = self._level.get(key, 0)
        if target == level:
            self._run.pop(key, None)
            return
        side = 1 if target > level else -1
        run, bound = self._run.get(key, (0, target))
        if run * side <= 0:  # the run changed direction (or starts): restart it
            run, bound = 0, target
        run += side
        bound = (
            min(bound, target) if side > 0 else max(bound, target)
        )  # most conservative target of the run
        if abs(run) >= self.patience:
            if bound:
                self._level[key] = bound
            else:
                self._level.pop(key, None)
            self._run.pop(key, None)
        else:
            self._run[key] = (run, bound)


def worth_displacing(
    estimator: SpeculativeUtilityEstimator, eviction: EvictionPolicy, candidate: int, victim: int
) -> bool:
    """Whether a prefetch of `candidate` may evict `victim` (keys are `layer * num_experts + expert`).

    Two conditions. The candidate's utility level must be strictly higher: a guess never
    displaces an expert that is at least as useful. And, where the eviction policy predicts next
    uses (reuse distance), the candidate must be expected sooner than the victim: the rule of
    integrated prefetching and caching (Cao, Felten, Karlin and Li, SIGMETRICS 1995), "never
    replace a block that is needed before the one fetched". The level test alone lets a
    guess push out the expert of the layer that runs next when utility eviction's lowest level
    holds it."""
    E = estimator.num_experts
    if estimator.level(*divmod(victim, E)) >= estimator.level(*divmod(candidate, E)):
        return False
    wait_c, wait_v = eviction.predicted_next_use(candidate), eviction.predicted_next_use(victim)
    return wait_c is None or wait_v is None or wait_c < wait_v


class UtilityEviction(EvictionPolicy):
    """Evict the resident expert with the lowest utility level; among equals, the one whose next
    use is predicted farthest (reuse distance, policies/reuse_distance.py: the layer order and how
    regularly it is used). Keys are `layer * num_experts + expert` (the store's keys)."""

    name = "utility"

    def __init__(self, estimator: SpeculativeUtilityEstimator | None = None) -> None:
        self.estimator = estimator  # bound by the loader to the model's one estimator
        self.ties = ReuseDistanceEviction()  # bound by the loader to the model's MoE layer order

    def bind(self, moe_layers: Sequence[int], num_experts: int) -> None:
        self.ties.bind(moe_layers, num_experts)

    def on_layer(self, layer: int) -> None:
        self.ties.on_layer(layer)

    def on_insert(self, key: Hashable) -> None:
        self.ties.on_insert(key)

    def on_access(self, key: Hashable) -> None:
        self.ties.on_access(key)

    def on_remove(self, key: Hashable) -> None:
        self.ties.on_remove(key)

    def forget(self, key: Hashable) -> None:
        self.ties.forget(key)

    def predicted_next_use(self, key: Hashable) -> float | None:
        return self.ties.predicted_next_use(key)

    def utility(self, key: Hashable) -> int:
        if self.estimator is None:
            return 0
        layer, expert = divmod(int(key), self.estimator.num_experts)  # type: ignore[call-overload]
        return self.estimator.level(layer, expert)

    def victim(self, candidates: Iterable[Hashable]) -> Hashable | None:
        allowed = as_set(candidates)
        if self.estimator is None:
            return self.ties.victim(allowed)
        # Level 0 first, as a live view: the tie-break walks its own order and asks `in` of a few
        # keys, instead of this reading every candidate's level on every eviction (most are cold).
        hot = self.estimator.hot_keys()
        cold = self.ties.victim(FilteredView(allowed, lambda key: key not in hot))
        if cold is not None:
            return cold
        lowest: dict[int, set[Hashable]] = {}  # every candidate is hot: group the few hot ones
        for key, level in hot.items():
            if key in allowed:
                lowest.setdefault(level, set()).add(key)
        return self.ties.victim(lowest[min(lowest)]) if lowest else None
