"""Pure parts of the Responses / Messages translation: input items and content blocks as chat
messages, the bounded response store, and which stop string ended an output."""

from __future__ import annotations

import pytest

from engine.core.detokenizer import IncrementalDetokenizer
from engine.errors import ConfigError
from server.config import ServerConfig
from server.errors import ApiError
from server.messages_request import MessagesRequest, chat_messages, to_chat
from server.protocol import ChatCompletionRequest, ChatMessage
from server.response_store import ResponseStore
from server.responses_request import InputItem, ResponsesRequest, input_messages
from server.responses_request import to_chat as responses_to_chat
from server.responses_stream import call_item
from server.tools import forced_body


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
        "error": {"type": "overloaded_error", "message": "loading", "code": "loading"},
    }
    assert _json.loads(anthropic_error(413, "big").body)["error"]["type"] == "request_too_large"


def test_system_messages_anywhere_merge_into_the_system_prompt_in_order() -> None:
    # Claude Code's shape: a block `system`, then a {"role": "system"} message after the user turn.
    body = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 8,
            "system": [{"type": "text", "text": "A", "cache_control": {"type": "ephemeral"}}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                {"role": "system", "content": [{"type": "text", "text": "B"}]},
            ],
            "thinking": {"type": "adaptive", "display": "omitted"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015"}]},
            "output_config": {"effort": "medium"},
            "metadata": {"user_id": "{}"},
        }
    )
    msgs = chat_messages(body)
    assert [(m.role, m.content) for m in msgs] == [("system", "A\n\nB"), ("user", "hi")]
    assert body.thinking_switch() is True


def test_tools_the_server_cannot_run_are_dropped_not_refused() -> None:
    body = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "x"}],
            "tools": [
                {"type": "web_search_20250305", "name": "web_search"},
                {"name": "Read", "input_schema": {"type": "object"}, "defer_loading": True},
            ],
            "tool_choice": {"type": "auto"},
        }
    )
    chat = to_chat(body, 8)
    assert [t.function.name for t in chat.tools or []] == ["Read"]
    only_hosted = ResponsesRequest.model_validate(
        {
            "input": "x",
            "tools": [{"type": "web_search", "external_web_access": False}],
            "tool_choice": "auto",
        }
    )
    chat2, _, _ = responses_to_chat(only_hosted, [])
    assert chat2.tools is None and chat2.tool_choice is None


def test_namespace_tools_flatten_and_calls_name_their_namespace() -> None:
    fn = {"type": "function", "name": "wait_agent", "parameters": {"type": "object"}}
    body = ResponsesRequest.model_validate(
        {
            "input": [
                {"role": "user", "content": "x"},
                {
                    "type": "function_call",
                    "call_id": "c1",
                    "name": "wait_agent",
                    "namespace": "multi_agent_v1",
                    "arguments": "{}",
                },
                {"type": "function_call_output", "call_id": "c1", "output": "done"},
            ],
            "tools": [
                {"type": "namespace", "name": "multi_agent_v1", "description": "d", "tools": [fn]}
            ],
            "store": False,
            "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "k",
            "client_metadata": {"turn_id": "t"},
            "reasoning": {"summary": "auto"},
        }
    )
    chat, _, spaced = responses_to_chat(body, [])
    assert [t.function.name for t in chat.tools or []] == ["multi_agent_v1__wait_agent"]
    assert chat.messages[1].tool_calls[0].function.name == "multi_agent_v1__wait_agent"
    item = call_item("c2", "multi_agent_v1__wait_agent", "{}", "completed", spaced)
    assert (item["name"], item["namespace"]) == ("wait_agent", "multi_agent_v1")
    assert "namespace" not in call_item("c3", "plain", "{}", "completed", spaced)


def test_forced_tool_call_applies_once_per_conversation() -> None:
    forced = ServerConfig(force_tool_call=('Read={"file_path": "/x"}', "Bash")).forced()
    tools = [
        {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
        for n in ("Bash", "Read")
    ]
    ask = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "q"}], "tools": tools}
    )
    got = forced_body(ask, forced)
    assert got is not None and got.tool_choice.function.name == "Read"  # the first one offered
    assert [t.function.parameters for t in got.tools] == [
        {"type": "object"},
        {"const": {"file_path": "/x"}},
    ]
    answered = ask.model_copy(
        update={
            "messages": [*ask.messages, ChatMessage(role="tool", tool_call_id="c", content="r")]
        }
    )
    assert forced_body(answered, forced) is None and forced_body(ask, ()) is None
    with pytest.raises(ConfigError, match="JSON object"):
        ServerConfig(force_tool_call=("Read=[1]",))
