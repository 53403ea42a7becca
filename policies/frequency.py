"""Frequency-based eviction with decay: a decayed LFU with dynamic aging.

Each use adds 1 to an expert's score, and all scores decay by `decay` per cache access,
so a score is an exponentially weighted count of recent use: hot experts stay resident
through a burst of one-off misses, which plain LRU would let flush them.

Plain (decayed) LFU has a known failure: a newcomer enters with score 1 and is the next
victim, so after a topic shift the new hot set churns among itself while the old set
sits on decaying scores. Dynamic aging (as in LFU-DA) fixes that: a newcomer starts at
the score of the last evicted expert (+1), so it competes on equal footing.
"""
from __future__ import annotations

import math
from collections.abc import Hashable, Iterable

from policies.base import EvictionPolicy


class FrequencyEviction(EvictionPolicy):
    name = "frequency"

    def __init__(self, decay: float = 0.999) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"frequency decay must be in (0, 1], got {decay}")
        self._log_decay = math.log(decay)
        self.clock = 0  # counts accesses
        # Scores are stored as of the time they were last updated: (score, clock then).
        self._score: dict[Hashable, tuple[float, int]] = {}
        self._floor: tuple[float, int] = (0.0, 0)  # score of the last evicted expert

    def _decayed(self, st: tuple[float, int]) -> float:
        return st[0] * math.exp(self._log_decay * (self.clock - st[1]))

    def score(self, key: Hashable) -> float:
        return self._decayed(self._score[key]) if key in self._score else 0.0

    def on_insert(self, key: Hashable) -> None:
        self.clock += 1
        base = max(self.score(key), self._decayed(self._floor))  # dynamic aging
        self._score[key] = (base + 1.0, self.clock)

    def on_access(self, key: Hashable) -> None:
        self.clock += 1
        self._score[key] = (self.score(key) + 1.0, self.clock)

    def on_remove(self, key: Hashable) -> None:
        self._floor = (self.score(key), self.clock)
        del self._score[key]

    def forget(self, key: Hashable) -> None:
        self._score.pop(key, None)  # not an eviction: the aging floor stays where it is

    def victim(self, candidates: Iterable[Hashable]) -> Hashable | None:
        return min(candidates, key=self.score, default=None)
