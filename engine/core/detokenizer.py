"""Incremental detokenization with stop strings, for streaming.

Cost per token is bounded, whatever the output length: like vLLM, only a short tail of tokens
is decoded each time (`prefix_offset`..end against `prefix_offset`..`read_offset`), and the
new characters are appended. A byte-level BPE token may hold part of a UTF-8 character;
while the tail decodes to a trailing U+FFFD the text is not advanced, so the concatenated
stream always equals a full decode. Text ending in a prefix of a stop string is held back
until it is resolved.
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
        self.max_stop = max((len(s) for s in self.stops), default=0)
        self.tokens: list[int] = []
        self.text = ""  # decoded text so far (truncated at a stop string once found)
        self.released = 0  # characters of `text` already sent
        self.stopped = False
        self.matched: str | None = (
            None  # the stop string that ended the text (Anthropic's stop_sequence)
        )
        # tokens[prefix_offset:read_offset] were decoded last time: context for the next decode,
        # so tokenizers that merge spaces or bytes across token boundaries decode correctly.
        self._prefix_offset = 0
        self._read_offset = 0

    def append(self, token_ids: list[int]) -> None:
        """Add tokens; sets `stopped` when a stop string appears (text is cut before it)."""
        self.tokens.extend(token_ids)
        if self.tokenizer is None or self.stopped:
            return
        prev = len(self.text)
        self.text += self._new_text()
        if self.stops and len(self.text) > prev:
            # A stop string may straddle the previous end: search from just before it.
            start = max(0, prev - self.max_stop + 1)
            hits = [(i, s) for s in self.stops if (i := self.text.find(s, start)) >= 0]
            if hits:
                at, self.matched = min(hits, key=lambda h: h[0])
                self.text = self.text[:at]
                self.stopped = True

    def _new_text(self, final: bool = False) -> str:
        """Text the tokens since the last call add; at the end (`final`), even an incomplete character."""
        dec = self.tokenizer.decode
        prefix = dec(self.tokens[self._prefix_offset : self._read_offset], skip_special_tokens=True)
        full = dec(self.tokens[self._prefix_offset :], skip_special_tokens=True)
        if (full.endswith("\ufffd") and not final) or len(full) <= len(prefix):
            return ""  # an incomplete multi-byte character (or nothing visible yet): wait
        new = full[len(prefix) :]
        self._prefix_offset = self._read_offset  # the tokens just decoded are the next context
        self._read_offset = len(self.tokens)
        return new

    def release(self, final: bool) -> str:
        """Text that is safe to send now; everything left when `final`."""
        if final and not self.stopped and self.tokenizer is not None:
            self.text += self._new_text(
                final=True
            )  # flush what is held back (an incomplete character at the end)
        end = len(self.text)
        if not final:
            end = min(end, len(self.text) - _stop_prefix_overlap(self.text, self.stops))
        end = max(end, self.released)
        out = self.text[self.released : end]
        self.released = end
        return out
