"""The Responses API (/v1/responses) and the Anthropic Messages API (/v1/messages) against the
real server on the embedded model, driven by the official openai and anthropic SDKs: usage,
greedy equality with chat, streamed event order, forced tool calls and tool-result round
trips, json_schema, stored responses, count_tokens, /tokenize, and each API's error shape."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import httpx
import jsonschema
import openai
import pytest
from server_fixtures import RunningServer, serve

pytestmark = pytest.mark.timeout(300)
MODEL = "emb"
KEY = "sekret"
SYSTEM = "You are a helpful assistant."
USER = "ROMEO:\nBut soft, what light through yonder window breaks?"
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
R_TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather forecast",
        "parameters": CITY,
    }
]
A_TOOLS = [{"name": "get_weather", "description": "Weather forecast", "input_schema": CITY}]
GREEDY_A = {
    "extra_body": {"temperature": 0}
}  # anthropic 2.15's create() has no temperature argument


@pytest.fixture(scope="module")
def srv(tmp_path_factory) -> Iterator[RunningServer]:
    args = [
        "--served-model-name",
        MODEL,
        "--api-key",
        KEY,
        "--max-body-bytes",
        "65536",
        "--speculative",
        "off",
    ]
    with serve(args, tmp_path_factory.mktemp("agents") / "server.log", ready_timeout=240) as s:
        yield s


@pytest.fixture(scope="module")
def oai(srv: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.v1, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def ant(srv: RunningServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.base_url, api_key=KEY, max_retries=0, timeout=120)


def _chat(oai: openai.OpenAI, max_tokens: int = 24):
    return oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}],
        max_tokens=max_tokens,
        temperature=0,
    )


# -- Responses ---------------------------------------------------------------------------------
def test_responses_usage_and_greedy_equality_with_chat_and_messages(
    oai: openai.OpenAI, ant: anthropic.Anthropic
) -> None:
    chat = _chat(oai)
    r = oai.responses.create(
        model=MODEL, instructions=SYSTEM, input=USER, max_output_tokens=24, temperature=0
    )
    m = ant.messages.create(
        model=MODEL,
        system=SYSTEM,
        messages=[{"role": "user", "content": USER}],
        max_tokens=24,
        **GREEDY_A,
    )
    text = chat.choices[0].message.content
    assert text and r.output_text == text == m.content[0].text
    assert (
        r.usage.input_tokens
        == chat.usage.prompt_tokens
        == m.usage.input_tokens + m.usage.cache_read_input_tokens
    )
    assert r.usage.output_tokens == chat.usage.completion_tokens == m.usage.output_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    # The chat request just cached this prompt, so both later requests read the same prefix from it.
    cached = r.usage.input_tokens_details.cached_tokens
    assert 0 < cached < r.usage.input_tokens and cached == m.usage.cache_read_input_tokens
    if chat.choices[0].finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert m.stop_reason == "max_tokens"
    else:
        assert r.status == "completed" and m.stop_reason == "end_turn"
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant"


def test_responses_input_items_equal_a_string_input(oai: openai.OpenAI) -> None:
    a = oai.responses.create(
        model=MODEL, input=USER, max_output_tokens=12, temperature=0, store=False
    )
    b = oai.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": [{"type": "input_text", "text": USER}]}],
        max_output_tokens=12,
        temperature=0,
        store=False,
    )
    assert a.output_text == b.output_text and a.usage.input_tokens == b.usage.input_tokens


def test_responses_stream_event_order_and_assembled_text(oai: openai.OpenAI) -> None:
    whole = oai.responses.create(
        model=MODEL, input=USER, max_output_tokens=20, temperature=0, store=False
    )
    with oai.responses.stream(
        model=MODEL, input=USER, max_output_tokens=20, temperature=0, store=False
    ) as s:
        events = list(s)
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # Every finish ends with response.completed, its status saying whether the limit cut it:
    # the event the SDK's get_final_response() waits for.
    end = "response.completed"
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    head = [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    tail = [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        end,
    ]
    assert kinds == head + ["response.output_text.delta"] * len(deltas) + tail
    assert events[-1].response.status == whole.status
    assert "".join(deltas) == whole.output_text == events[-1].response.output_text
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == whole.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    assert len({e.item_id for e in events if hasattr(e, "item_id")}) == 1


def test_responses_stream_helper_returns_the_final_response_at_the_limit(
    oai: openai.OpenAI,
) -> None:
    """max_output_tokens reached: the SDK helper still returns the final response (the stream
    ends with response.completed, whose status is incomplete)."""
    with oai.responses.stream(
        model=MODEL, input=USER, max_output_tokens=2, temperature=0, store=False
    ) as s:
        text = "".join(e.delta for e in s if e.type == "response.output_text.delta")
        final = s.get_final_response()
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert final.usage.output_tokens == 2 and final.output_text == text
    assert [o.status for o in final.output] == ["incomplete"]


def test_responses_forced_function_call_then_tool_result_round_trip(oai: openai.OpenAI) -> None:
    r = oai.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=R_TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=80,
        temperature=0,
    )
    assert r.status == "completed" and [o.type for o in r.output] == ["function_call"]
    call = r.output[0]
    assert (
        call.name == "get_weather"
        and call.call_id.startswith("call_")
        and call.id.startswith("fc_")
    )
    jsonschema.validate(json.loads(call.arguments), CITY)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    # The same conversation, once continued from the stored response and once sent whole:
    cont = oai.responses.create(
        model=MODEL, previous_response_id=r.id, input=[result], max_output_tokens=12, temperature=0
    )
    whole = oai.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            result,
        ],
        tools=R_TOOLS,
        max_output_tokens=12,
        temperature=0,
        store=False,
    )
    assert cont.previous_response_id == r.id
    assert (
        cont.output_text == whole.output_text
        and cont.usage.input_tokens == whole.usage.input_tokens > r.usage.input_tokens
    )


def test_responses_streamed_function_call_assembles(oai: openai.OpenAI) -> None:
    kw = {
        "model": MODEL,
        "input": "Weather in Rome?",
        "tools": R_TOOLS,
        "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 80,
        "temperature": 0,
        "store": False,
    }
    whole = oai.responses.create(**kw)
    with oai.responses.stream(**kw) as s:
        events = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == final.output[0].arguments == whole.output[0].arguments
    jsonschema.validate(json.loads(args), CITY)


def test_responses_json_schema_text_format(oai: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    r = oai.responses.create(
        model=MODEL,
        input="A person as JSON.",
        text={
            "format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}
        },
        max_output_tokens=60,
        temperature=0.8,
        store=False,
    )
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)


def test_responses_store_retrieve_delete(oai: openai.OpenAI) -> None:
    r = oai.responses.create(model=MODEL, input="Hello", max_output_tokens=5, temperature=0)
    got = oai.responses.retrieve(r.id)
    assert (
        got.id == r.id
        and got.output_text == r.output_text
        and got.usage.output_tokens == r.usage.output_tokens
    )
    oai.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(
            model=MODEL, previous_response_id=r.id, input="again", max_output_tokens=5
        )
    unstored = oai.responses.create(model=MODEL, input="Hello", max_output_tokens=5, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(unstored.id)


def test_responses_error_objects(srv: RunningServer, oai: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="other", input="x")
    bad = [
        (
            {
                "model": MODEL,
                "input": [
                    {"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}
                ],
            },
            "input[0].content[0].type",
        ),
        (
            {
                "model": MODEL,
                "input": "x",
                "tool_choice": {"type": "function", "name": "nope"},
                "tools": R_TOOLS,
            },
            "tool_choice",
        ),
        ({"model": MODEL, "input": []}, "input"),
        ({"model": MODEL, "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ]
    for body, param in bad:
        r = httpx.post(
            srv.v1 + "/responses", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30
        )
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert (
            err["type"] == "invalid_request_error"
            and err["param"] == param
            and "Traceback" not in err["message"]
        )
    r = httpx.post(srv.v1 + "/responses", json={"model": MODEL, "input": "x"}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


# -- Messages ----------------------------------------------------------------------------------
def test_messages_stream_event_order_and_assembled_text(ant: anthropic.Anthropic) -> None:
    kw = {
        "model": MODEL,
        "system": [{"type": "text", "text": SYSTEM}],
        "messages": [{"role": "user", "content": USER}],
        "max_tokens": 20,
        **GREEDY_A,
    }
    whole = ant.messages.create(**kw)
    with ant.messages.stream(**kw) as s:
        events = list(s)
        final = s.get_final_message()
    raw = [e.type for e in events if e.type not in ("text",)]  # "text" is the helper's own event
    deltas = [e.delta.text for e in events if e.type == "content_block_delta"]
    assert raw == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * len(deltas),
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert "".join(deltas) == whole.content[0].text == final.content[0].text
    assert (
        final.stop_reason == whole.stop_reason
        and final.usage.output_tokens == whole.usage.output_tokens
    )
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens


def test_messages_stop_sequences_and_max_tokens(ant: anthropic.Anthropic) -> None:
    free = ant.messages.create(
        model=MODEL, messages=[{"role": "user", "content": USER}], max_tokens=30, **GREEDY_A
    )
    assert free.stop_reason == "max_tokens" and free.usage.output_tokens == 30
    word = free.content[0].text.split()[2]  # a word the greedy output reaches
    cut = ant.messages.create(
        model=MODEL,
        messages=[{"role": "user", "content": USER}],
        max_tokens=30,
        stop_sequences=[word, "zzzq"],
        **GREEDY_A,
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert free.content[0].text.startswith(cut.content[0].text) and word not in cut.content[0].text


def test_messages_forced_tool_then_tool_result_round_trip(ant: anthropic.Anthropic) -> None:
    q = {"role": "user", "content": "What is the weather in Paris?"}
    m = ant.messages.create(
        model=MODEL,
        messages=[q],
        tools=A_TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
        max_tokens=80,
        **GREEDY_A,
    )
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"]
    use = m.content[0]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, CITY)
    follow = [
        q,
        {"role": "assistant", "content": m.content},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21 C"}],
        },
    ]
    r = ant.messages.create(model=MODEL, messages=follow, tools=A_TOOLS, max_tokens=12, **GREEDY_A)
    assert r.content[0].type == "text" and r.usage.input_tokens > m.usage.input_tokens
    n = ant.messages.count_tokens(model=MODEL, messages=follow, tools=A_TOOLS)
    assert n.input_tokens == r.usage.input_tokens + r.usage.cache_read_input_tokens


def test_messages_tool_choice_any_streams_one_tool_use(ant: anthropic.Anthropic) -> None:
    kw = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": A_TOOLS,
        "max_tokens": 120,
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        **GREEDY_A,
    }
    with ant.messages.stream(**kw) as s:
        events = list(s)
        final = s.get_final_message()
    assert final.stop_reason == "tool_use" and [b.type for b in final.content] == ["tool_use"]
    starts = [e for e in events if e.type == "content_block_start"]
    assert len(starts) == 1 and starts[0].content_block.type == "tool_use"
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    assert json.loads(partial) == final.content[0].input
    jsonschema.validate(final.content[0].input, CITY)


def test_count_tokens_matches_real_usage(ant: anthropic.Anthropic) -> None:
    kw = {
        "model": MODEL,
        "system": SYSTEM,
        "messages": [{"role": "user", "content": USER}],
        "tools": A_TOOLS,
    }
    n = ant.messages.count_tokens(**kw)
    m = ant.messages.create(**kw, max_tokens=3, **GREEDY_A)
    assert n.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens > 10


def test_messages_error_shapes(srv: RunningServer, ant: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as e:
        ant.messages.create(
            model="claude-other", messages=[{"role": "user", "content": "x"}], max_tokens=5
        )
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    hdr = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    cases = [
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
            400,
            "max_tokens",
        ),  # max_tokens is required
        (
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
                "max_tokens": 5,
            },
            400,
            "image",
        ),
        (
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 5,
                "tools": [{"name": "w", "description": "a client tool needs its schema"}],
            },
            400,
            "input_schema",
        ),
        (
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 5,
                "temperature": 1.5,
            },
            400,
            "temperature",
        ),
    ]
    for body, status, needle in cases:
        r = httpx.post(srv.v1 + "/messages", json=body, headers=hdr, timeout=30)
        assert r.status_code == status, r.text
        j = r.json()
        assert (
            j["type"] == "error"
            and j["error"]["type"] == "invalid_request_error"
            and needle in j["error"]["message"]
        )
    r = httpx.post(
        srv.v1 + "/messages", json=cases[0][0], headers={"x-api-key": "wrong"}, timeout=30
    )
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(
        srv.v1 + "/messages",
        content=b'{"model": "' + b"x" * 70000 + b'"}',
        headers={**hdr, "content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 413 and r.json() == {
        "type": "error",
        "error": {"type": "request_too_large", "message": r.json()["error"]["message"]},
    }
    r = httpx.post(
        srv.v1 + "/messages",
        content=b"{not json",
        headers={**hdr, "content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["type"] == "error"


def test_tokenize_and_detokenize(srv: RunningServer) -> None:
    from transformers import AutoTokenizer

    from models import EMBEDDED_TARGET

    tok = AutoTokenizer.from_pretrained(EMBEDDED_TARGET)
    hdr = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(srv.base_url + "/tokenize", json={"content": USER}, headers=hdr, timeout=30)
    assert (
        r.status_code == 200
        and r.json()["tokens"] == tok(USER, add_special_tokens=False)["input_ids"]
    )
    pieces = httpx.post(
        srv.base_url + "/tokenize",
        json={"content": USER, "with_pieces": True},
        headers=hdr,
        timeout=30,
    ).json()["tokens"]
    assert [p["id"] for p in pieces] == r.json()["tokens"] and "".join(
        p["piece"] for p in pieces
    ) == USER
    back = httpx.post(
        srv.base_url + "/detokenize", json={"tokens": r.json()["tokens"]}, headers=hdr, timeout=30
    )
    assert back.json() == {"content": USER}
    bad = httpx.post(
        srv.base_url + "/detokenize", json={"tokens": [10**9]}, headers=hdr, timeout=30
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert (
        httpx.post(srv.base_url + "/tokenize", json={"content": "x"}, timeout=30).status_code == 401
    )
