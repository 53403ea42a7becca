"""Stored responses (/v1/responses with store=true): bounded in bytes and by age.

Each entry holds the response object a GET returns and the conversation (chat messages) a
later `previous_response_id` continues from, both as JSON text: parsed back on each read. Its
size is the length of both texts, so the budget bounds the memory the store holds (kept as
dicts and lists, an entry took about 4 times its JSON's bytes, and a 30-minute soak's front end
grew 1.1 MiB a minute as the store filled).  Adding past `max_bytes` evicts the oldest entries
first; an entry older than `ttl_s` is gone.  An entry larger than the whole budget is not stored
(its response says store=false).
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
    response_json: str
    conversation_json: str  # chat messages up to and including this response's output
    created: float

    @property
    def size(self) -> int:
        return len(self.response_json) + len(self.conversation_json)

    @property
    def response(self) -> dict[str, Any]:
        return json.loads(self.response_json)

    @property
    def conversation(self) -> list[dict[str, Any]]:
        return json.loads(self.conversation_json)


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
        item = StoredResponse(
            json.dumps(response, ensure_ascii=False, separators=(",", ":")),
            json.dumps(conversation, ensure_ascii=False, separators=(",", ":")),
            self.clock(),
        )
        if item.size > self.max_bytes:
            return False
        self.delete(rid)
        self._expire()
        while self._items and self.bytes + item.size > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.bytes -= old.size
        self._items[rid] = item
        self.bytes += item.size
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
