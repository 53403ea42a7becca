"""Frequency-based eviction with exponential decay (a decayed LFU).

Each access adds 1 to the expert's score; scores decay by `decay` per access anywhere
in the cache, so the score is an exponentially weighted count of recent use. The victim
is the candidate with the lowest score. Decay lets the cache follow topic shifts that a
plain LFU would resist forever.
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
        self.decay = decay
        self._log_decay = math.log(decay)
        self.clock = 0  # counts accesses
        # Scores are stored as of the time they were last updated: (score, clock then).
        self._score: dict[Hashable, tuple[float, int]] = {}

    def score(self, key: Hashable) -> float:
        s, t = self._score.get(key, (0.0, self.clock))
        return s * math.exp(self._log_decay * (self.clock - t))

    def on_insert(self, key: Hashable) -> None:
        # Keep the history of an expert that was evicted and comes back; new ones start at 1.
        self.on_access(key)

    def on_access(self, key: Hashable) -> None:
        self.clock += 1
        self._score[key] = (self.score(key) + 1.0, self.clock)

    def on_remove(self, key: Hashable) -> None:
        pass  # remembered, so a returning expert keeps its (decayed) history

    def victim(self, candidates: Iterable[Hashable]) -> Hashable | None:
        return min(candidates, key=self.score, default=None)
