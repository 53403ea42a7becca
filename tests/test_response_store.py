"""The Responses store's byte budget bounds the memory it holds (found by the 30-minute soak:
kept as dicts, an entry took about 4 times the JSON bytes the budget counted)."""

from __future__ import annotations

import tracemalloc

from server.response_store import ResponseStore


def _entry(i: int) -> tuple[dict, list[dict]]:
    text = f"answer {i} " * 30
    response = {
        "id": f"resp_{i:024d}",
        "object": "response",
        "status": "completed",
        "output": [{"type": "message", "content": [{"type": "output_text", "text": text}]}],
        "usage": {"input_tokens": 40, "output_tokens": 32, "total_tokens": 72},
        "metadata": {},
    }
    conversation = [
        {"role": "user", "content": f"question {i} " * 20},
        {"role": "assistant", "content": text},
    ]
    return response, conversation


def test_the_memory_held_is_about_the_bytes_counted() -> None:
    store = ResponseStore(max_bytes=64 * 2**20, ttl_s=3600.0)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(500):  # each request builds its response; only the store keeps it
            assert store.put(f"r{i}", *_entry(i))
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(store) == 500
    assert held < 1.5 * store.bytes, (held, store.bytes)
    # What was stored reads back whole.
    got = store.get("r7")
    assert got is not None and (got.response, got.conversation) == _entry(7)
