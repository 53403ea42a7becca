"""Incremental detokenization with stop strings, for streaming.

Text is re-decoded from all output tokens (exact for any tokenizer), and only a *safe* prefix
is released: text ending in an incomplete UTF-8 sequence, or in a prefix of a stop string, is
held back, so the concatenated stream always equals the final text.
"""
from __future__ import annotations

from typing import Any


def _stop_prefix_overlap(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, stops: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stops = tuple(s for s in stops if s)
        self.tokens: list[int] = []
        self.text = ""  # full decoded text so far (truncated at a stop string once found)
        self.released = 0  # characters of `text` already sent
        self.stopped = False

    def append(self, token_ids: list[int]) -> None:
        """Add tokens; sets `stopped` when a stop string appears (text is cut before it)."""
        if self.tokenizer is None or self.stopped:
            self.tokens.extend(token_ids)
            return
        prev = len(self.text)
        self.tokens.extend(token_ids)
        self.text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if self.stops:
            # A stop string may straddle the previous end: search from just before it.
            start = max(0, min(prev, self.released) - max(len(s) for s in self.stops) + 1)
            hits = [i for s in self.stops if (i := self.text.find(s, start)) >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True

    def release(self, final: bool) -> str:
        """Text that is safe to send now; everything left when `final`."""
        end = len(self.text)
        if not final:
            if self.text.endswith("\ufffd"):  # a multi-byte character is still incomplete
                end = len(self.text.rstrip("\ufffd"))
            end = min(end, len(self.text) - _stop_prefix_overlap(self.text, self.stops))
        end = max(end, self.released)
        out = self.text[self.released : end]
        self.released = end
        return out
