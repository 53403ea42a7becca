"""The simulator's background transfers: the queue of prefetches on the link, the utility
prefetcher's top-up, cancellation of stale prefetches, and the next-layer predictor hook."""

from __future__ import annotations

from typing import cast

from engine.offline.sim_state import ReplayState
from policies.utility import PREFETCH_MIN_LEVEL, worth_displacing


class PrefetchReplay(ReplayState):
    # -- the link and the queue of prefetches ---------------------------------------------
    def _advance(self, now: float) -> None:
        """Start queued prefetches that a worker would have picked up by `now`."""
        q, link = self.link.queue, self.link
        while q and link.next_start() <= now:
            key = next(iter(q))
            del q[key]
            self.predicted.discard(key)
            self.cache.land(key, link.start(link.next_start()))
            self.bg_cpu_s += self.costs.per_load_s

    def _prefetch(self, key: int) -> None:
        self.link.queue[key] = None
        self.cache.protect(key)
        self.r.prefetch_issued += 1

    def _top_up(self, layer: int) -> bool:
        """engine/experts/tiers/utility_prefetch.py UtilityPrefetcher.top_up, over the simulated store:
        the hottest missing experts, into a free slot or over a victim worth displacing."""
        est, cache, E = self.utility, self.cache, self.E
        assert est is not None
        for e in est.ranked(layer, PREFETCH_MIN_LEVEL):
            if self.link.pending(self.clock) >= len(self.link.worker_free_at):
                return False  # no idle transfer worker (UtilityPrefetcher.max_pending)
            key = layer * E + e
            if key in cache.ready:  # resident, or already on its way
                continue
            victim = None
            if not cache.free:
                victim = cast(
                    "int | None", cache.eviction.victim(cache.evictable(self.clock, False))
                )  # keys are ints
                if victim is None:
                    return False
                if not worth_displacing(est, cache.eviction, key, int(victim)):
                    continue
            if cache.reserve(key, False, self.clock, pin=False, victim=victim) is None:
                return False
            self._prefetch(key)
        return True

    def _cancel_stale(self) -> None:
        est = self.utility
        assert est is not None
        keep: dict[int, None] = {}
        for key in self.link.queue:
            if est.level(*divmod(key, self.E)) < PREFETCH_MIN_LEVEL:
                self._cancel(key)
            else:
                keep[key] = None
        self.link.queue = keep

    def _cancel(self, key: int) -> None:
        """A queued prefetch is cancelled: its slot is free again, not counted as wasted. The
        eviction policy hears of it as a removal (the engine's abort has it forget the key)."""
        self.cache.protected.pop(key, None)
        self.cache.drop(key)
        self.r.prefetch_cancelled += 1

    def _predict(self, rows: list[int], layer: int) -> None:
        """The predictor hook: prefetch the union of its ranked predictions for `layer + 1`."""
        pred, cache, E = self.s.predictor, self.cache, self.E
        budget = self.s.predictor_budget or self.k
        ranked: dict[int, None] = {}
        lists = [pred.predict(t, layer) for t in rows]
        for i in range(
            max(map(len, lists), default=0)
        ):  # interleave ranks across rows: rank 0 of every row first
            for lst in lists:
                if i < len(lst):
                    ranked.setdefault(int(lst[i]))
        chosen = list(ranked)[:budget]
        nxt = (layer + 1) * E
        # Never evict what the same prediction asks for (a resident predicted expert is about to be
        # used): pinned while its slots are reserved, as the engine's lease pins them.
        cache.pin_only(nxt + e for e in chosen)
        for e in chosen:
            key = nxt + e
            if key in cache.ready:
                continue
            if cache.reserve(key, False, self.clock, pin=False) is None:
                break
            self._prefetch(key)
            self.predicted.add(key)
        cache.pins.clear()
