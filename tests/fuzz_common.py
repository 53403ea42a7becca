"""What the hypothesis fuzz files (test_fuzz.py, test_agent_fuzz.py) share: arbitrary JSON-like
values, the raw POST they send them with, and the settings that keep a run reproducible."""

from __future__ import annotations

import json
from typing import Any

import httpx
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st


def json_values(text_size: int, collection_size: int, max_leaves: int) -> st.SearchStrategy[Any]:
    """Arbitrary JSON-like values: null, booleans, integers beyond 64 bits, floats with NaN and
    infinities, short strings, and lists and objects of them, nested."""
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=text_size),
    )
    return st.recursive(
        scalars,
        lambda c: st.one_of(
            st.lists(c, max_size=collection_size),
            st.dictionaries(st.text(max_size=8), c, max_size=collection_size),
        ),
        max_leaves=max_leaves,
    )


def post_json(hc: httpx.Client, path: str, body: Any) -> httpx.Response:
    """POST `body` as JSON, NaN and infinities included (Python's json writes them)."""
    return hc.post(
        path, content=json.dumps(body, allow_nan=True), headers={"content-type": "application/json"}
    )


def fuzz_settings(max_examples: int) -> settings:
    """Derandomized, no example database, no deadline: the same examples on every run."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
