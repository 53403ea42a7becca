"""Property-based fuzzing of /v1/responses, /v1/messages, count_tokens and /tokenize bodies: never
a 5xx, errors in each API's own shape, and streams that end with their final event."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from fuzz_common import fuzz_settings, json_values, post_json
from hypothesis import given
from hypothesis import strategies as st
from server_fixtures import RunningServer

pytestmark = pytest.mark.timeout(600)
MODEL = "tiny"

anything = json_values(text_size=12, collection_size=3, max_leaves=8)
texts = st.one_of(st.text(max_size=30), anything)
schema = st.one_of(
    st.just(
        {
            "type": "object",
            "properties": {"a": {"enum": [1, 2]}},
            "required": ["a"],
            "additionalProperties": False,
        }
    ),
    st.dictionaries(
        st.sampled_from(["type", "properties", "enum", "required", "$ref"]), anything, max_size=2
    ),
    anything,
)
r_item = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "developer", "wizard"])},
        optional={
            "content": st.one_of(
                texts,
                st.lists(
                    st.fixed_dictionaries(
                        {
                            "type": st.sampled_from(["input_text", "output_text", "input_image"]),
                            "text": texts,
                        }
                    ),
                    max_size=2,
                ),
            ),
            "type": st.sampled_from(["message", "other"]),
        },
    ),
    st.fixed_dictionaries(
        {"type": st.just("function_call")},
        optional={"call_id": texts, "name": texts, "arguments": texts},
    ),
    st.fixed_dictionaries(
        {"type": st.just("function_call_output")}, optional={"call_id": texts, "output": texts}
    ),
    anything,
)
r_tool = st.one_of(
    st.fixed_dictionaries(
        {
            "type": st.sampled_from(["function", "web_search"]),
            "name": st.sampled_from(["f", "bad name", ""]),
        },
        optional={"parameters": schema},
    ),
    anything,
)
responses_body = st.fixed_dictionaries(
    {
        "model": st.one_of(st.just(MODEL), anything),
        "input": st.one_of(texts, st.lists(r_item, max_size=3)),
    },
    optional={
        "instructions": texts,
        "max_output_tokens": st.one_of(st.integers(-2, 6), anything),
        "temperature": st.one_of(st.floats(-1, 3), anything),
        "top_p": st.one_of(st.floats(-0.5, 1.5), anything),
        "tools": st.one_of(st.lists(r_tool, max_size=2), anything),
        "tool_choice": st.one_of(
            st.sampled_from(["none", "auto", "required"]),
            st.fixed_dictionaries(
                {"type": st.just("function"), "name": st.sampled_from(["f", "g"])}
            ),
            anything,
        ),
        "text": st.one_of(
            st.fixed_dictionaries(
                {
                    "format": st.fixed_dictionaries(
                        {"type": st.sampled_from(["text", "json_object", "json_schema", "yaml"])},
                        optional={"schema": schema, "name": texts},
                    )
                }
            ),
            anything,
        ),
        "stream": st.one_of(st.booleans(), anything),
        "store": st.one_of(st.booleans(), anything),
        "previous_response_id": texts,
        "reasoning": st.one_of(
            st.fixed_dictionaries({"effort": st.sampled_from(["none", "low", "high"])}), anything
        ),
    },
)
block = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
    st.fixed_dictionaries(
        {"type": st.just("tool_use")}, optional={"id": texts, "name": texts, "input": anything}
    ),
    st.fixed_dictionaries(
        {"type": st.just("tool_result")},
        optional={
            "tool_use_id": texts,
            "content": st.one_of(
                texts,
                st.lists(
                    st.fixed_dictionaries(
                        {"type": st.sampled_from(["text", "image"]), "text": texts}
                    ),
                    max_size=2,
                ),
            ),
        },
    ),
    st.fixed_dictionaries({"type": st.sampled_from(["image", "thinking", "document"])}),
    anything,
)
a_msg = st.one_of(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "assistant", "system"]),
            "content": st.one_of(texts, st.lists(block, max_size=3)),
        }
    ),
    anything,
)
a_tool = st.one_of(
    st.fixed_dictionaries(
        {"name": st.sampled_from(["f", "g"]), "input_schema": schema},
        optional={"type": st.sampled_from(["custom", "web_search_20250305"])},
    ),
    anything,
)
messages_body = st.fixed_dictionaries(
    {
        "model": st.one_of(st.just(MODEL), anything),
        "messages": st.one_of(st.lists(a_msg, min_size=1, max_size=3), anything),
    },
    optional={
        "max_tokens": st.one_of(st.integers(-1, 6), anything),
        "system": st.one_of(texts, st.lists(block, max_size=2)),
        "stop_sequences": st.one_of(st.lists(texts, max_size=3), anything),
        "temperature": st.one_of(st.floats(-1, 2), anything),
        "top_p": st.one_of(st.floats(-0.5, 1.5), anything),
        "top_k": st.one_of(st.integers(-2, 40), anything),
        "tools": st.one_of(st.lists(a_tool, max_size=2), anything),
        "stream": st.one_of(st.booleans(), anything),
        "tool_choice": st.one_of(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["auto", "any", "tool", "none", "bad"])},
                optional={
                    "name": st.sampled_from(["f", "x"]),
                    "disable_parallel_tool_use": st.booleans(),
                },
            ),
            anything,
        ),
        "thinking": st.one_of(
            st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled"])}), anything
        ),
    },
)


def _events(r: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: ")]


FUZZ = fuzz_settings(80)


@FUZZ
@given(body=responses_body)
def test_fuzz_responses(fuzz_server: RunningServer, fuzz_client: httpx.Client, body: dict) -> None:
    r = post_json(fuzz_client, "/v1/responses", body)
    assert r.status_code < 500, (r.status_code, r.text[:400], fuzz_server.log()[-1500:])
    if r.status_code >= 400:
        assert set(r.json()) == {"error"} and isinstance(r.json()["error"]["message"], str)
    elif r.headers["content-type"].startswith("text/event-stream"):
        ev = _events(r)
        assert [e["sequence_number"] for e in ev] == list(range(len(ev))) and ev[-1]["type"] in (
            "response.completed",
            "response.incomplete",
        )
    else:
        assert r.json()["object"] == "response" and r.json()["output"]


@FUZZ
@given(body=messages_body)
def test_fuzz_messages_and_count_tokens(
    fuzz_server: RunningServer, fuzz_client: httpx.Client, body: dict
) -> None:
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = post_json(fuzz_client, path, body)
        assert r.status_code < 500 or r.status_code == 529, (
            r.status_code,
            r.text[:400],
            fuzz_server.log()[-1500:],
        )
        if r.status_code >= 400:
            j = r.json()
            assert (
                j["type"] == "error"
                and isinstance(j["error"]["message"], str)
                and j["error"]["type"].endswith("_error")
            )
        elif r.headers["content-type"].startswith("text/event-stream"):
            assert [e["type"] for e in _events(r)][-2:] == ["message_delta", "message_stop"]
        else:
            assert (
                "input_tokens" in r.json()
                if path.endswith("count_tokens")
                else r.json()["type"] == "message"
            )


@FUZZ
@given(
    body=st.one_of(
        st.fixed_dictionaries(
            {"content": texts}, optional={"add_special": anything, "with_pieces": anything}
        ),
        st.fixed_dictionaries(
            {"tokens": st.one_of(st.lists(st.integers(-5, 400), max_size=8), anything)}
        ),
        anything,
    )
)
def test_fuzz_tokenize(fuzz_server: RunningServer, fuzz_client: httpx.Client, body: Any) -> None:
    for path in ("/tokenize", "/detokenize"):
        r = post_json(fuzz_client, path, body)
        assert r.status_code in (200, 400), (r.status_code, r.text[:300])
