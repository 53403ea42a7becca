"""Stored responses (/v1/responses with store=true): bounded in bytes and by age.

Each entry holds the response object a GET returns and the conversation (chat messages) a
later `previous_response_id` continues from.  Its size is the length of both as JSON.  Adding
past `max_bytes` evicts the oldest entries first; an entry older than `ttl_s` is gone.  An
entry larger than the whole budget is not stored (its response says store=false).
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class StoredResponse:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]  # chat messages up to and including this response's output
    size: int
    created: float


class ResponseStore:
    def __init__(
        self, max_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_bytes, self.ttl_s, self.clock = max_bytes, ttl_s, clock
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first
        self.bytes = 0

    def __len__(self) -> int:
        self._expire()
        return len(self._items)

    def put(self, rid: str, response: dict[str, Any], conversation: list[dict[str, Any]]) -> bool:
        """Store (or replace) an entry; False if it alone exceeds the budget."""
        size = len(json.dumps(response, ensure_ascii=False)) + len(
            json.dumps(conversation, ensure_ascii=False)
        )
        if size > self.max_bytes:
            return False
        self.delete(rid)
        self._expire()
        while self._items and self.bytes + size > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.bytes -= old.size
        self._items[rid] = StoredResponse(response, conversation, size, self.clock())
        self.bytes += size
        return True

    def get(self, rid: str) -> StoredResponse | None:
        self._expire()
        return self._items.get(rid)

    def delete(self, rid: str) -> bool:
        item = self._items.pop(rid, None)
        if item is None:
            return False
        self.bytes -= item.size
        return True

    def _expire(self) -> None:
        cutoff = self.clock() - self.ttl_s
        while self._items:
            rid, item = next(iter(self._items.items()))
            if item.created >= cutoff:
                break
            self.delete(rid)
