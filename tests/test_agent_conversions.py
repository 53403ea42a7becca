"""Pure parts of the Responses / Messages translation: input items and content blocks as chat
messages, the bounded response store, and which stop string ended an output."""

from __future__ import annotations

import pytest

from engine.core.detokenizer import IncrementalDetokenizer
from server.errors import ApiError
from server.messages_request import MessagesRequest, chat_messages, to_chat
from server.response_store import ResponseStore
from server.responses_request import InputItem, ResponsesRequest, input_messages
from server.responses_request import to_chat as responses_to_chat


def test_function_call_items_join_the_assistant_turn() -> None:
    items = [
        InputItem.model_validate(d)
        for d in [
            {"role": "user", "content": "q"},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "let me look"}],
            },
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"a": 1}'},
            {"type": "function_call_output", "call_id": "c1", "output": "one"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "two"}],
            },
        ]
    ]
    msgs = input_messages(items)
    assert [m.role for m in msgs] == ["user", "assistant", "tool", "tool"]
    assert msgs[1].content == "let me look" and [c.id for c in msgs[1].tool_calls or []] == [
        "c1",
        "c2",
    ]
    assert [(m.tool_call_id, m.content) for m in msgs[2:]] == [("c1", "one"), ("c2", "two")]


def test_instructions_are_not_part_of_the_stored_conversation() -> None:
    chat, conv, _ = responses_to_chat(ResponsesRequest(instructions="be brief", input="hi"), [])
    assert [m.role for m in chat.messages] == ["system", "user"] and [m.role for m in conv] == [
        "user"
    ]
    with pytest.raises(ApiError) as e:
        responses_to_chat(
            ResponsesRequest(input="x", text={"format": {"type": "json_schema", "name": "n"}}), []
        )
    assert e.value.status == 400 and e.value.param == "text.format.schema"


def test_anthropic_blocks_as_chat_messages() -> None:
    body = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 5,
            "system": [{"type": "text", "text": "sys "}, {"type": "text", "text": "two"}],
            "messages": [
                {"role": "user", "content": "q"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hmm"},
                        {"type": "text", "text": "ok"},
                        {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "content": [{"type": "text", "text": "r"}],
                        },
                        {"type": "text", "text": "next"},
                    ],
                },
            ],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "tools": [{"name": "f", "input_schema": {"type": "object"}}],
            "stop_sequences": ["END"],
            "top_k": 5,
        }
    )
    msgs = chat_messages(body)
    assert [(m.role, m.content) for m in msgs] == [
        ("system", "sys two"),
        ("user", "q"),
        ("assistant", "ok"),
        ("tool", "r"),
        ("user", "next"),
    ]
    assert msgs[2].tool_calls is not None and msgs[2].tool_calls[0].function.arguments == '{"x": 1}'
    chat = to_chat(body, body.max_tokens)
    assert (
        chat.tool_choice == "required"
        and chat.parallel_tool_calls is False
        and chat.stop == ["END"]
        and chat.top_k == 5
    )


def test_store_evicts_oldest_past_its_byte_cap_and_expires() -> None:
    now = [0.0]
    s = ResponseStore(max_bytes=300, ttl_s=10.0, clock=lambda: now[0])
    big = {"text": "x" * 100}
    assert s.put("a", big, []) and s.put("b", big, [])
    assert s.bytes <= 300 and len(s) == 2
    assert s.put("c", big, [])  # over the cap: "a" goes
    assert (
        s.get("a") is None and s.get("b") is not None and s.get("c") is not None and s.bytes <= 300
    )
    assert not s.put("huge", {"text": "x" * 400}, [])  # alone over the cap: not stored
    now[0] = 10.5
    assert s.get("b") is None and len(s) == 0 and s.bytes == 0
    assert s.delete("c") is False


def test_detokenizer_names_the_stop_string_that_matched() -> None:
    from transformers import AutoTokenizer

    from models import EMBEDDED_TARGET

    tok = AutoTokenizer.from_pretrained(EMBEDDED_TARGET)
    d = IncrementalDetokenizer(tok, ("world", "lo w"))
    for t in tok("hello world again", add_special_tokens=False)["input_ids"]:
        d.append([t])
    assert d.stopped and d.matched == "lo w" and d.text == "hel"  # the earliest match wins


def test_anthropic_statuses_for_an_unavailable_engine() -> None:
    import json as _json

    from server.anthropic_errors import anthropic_error

    full = anthropic_error(503, "queue full", {"Retry-After": "1"}, "queue_full")
    assert (
        full.status_code == 429
        and _json.loads(full.body)["error"]["type"] == "rate_limit_error"
        and full.headers["retry-after"] == "1"
    )
    loading = anthropic_error(503, "loading", None, "loading")
    assert loading.status_code == 529 and _json.loads(loading.body) == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "loading"},
    }
    assert _json.loads(anthropic_error(413, "big").body)["error"]["type"] == "request_too_large"
