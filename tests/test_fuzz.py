"""Property-based fuzzing of request bodies (hypothesis): whatever arrives, the answer is never
a 5xx (503 only where the server says why: busy), errors are OpenAI error objects, and the
server is alive after each request."""

from __future__ import annotations

import json

import httpx
import pytest
from fuzz_common import fuzz_settings, json_values, post_json
from hypothesis import given
from hypothesis import strategies as st
from server_fixtures import RunningServer

pytestmark = pytest.mark.timeout(900)
MODEL = "tiny"

anything = json_values(text_size=20, collection_size=4, max_leaves=12)
small_int = st.one_of(st.integers(-3, 6), anything)
texts = st.one_of(st.text(max_size=40), anything)
part = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["image_url", "input_audio", "file", "weird"])},
        optional={"image_url": anything},
    ),
    anything,
)
message = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "wizard"])},
        optional={
            "content": st.one_of(texts, st.lists(part, max_size=3)),
            "name": texts,
            "tool_call_id": texts,
            "tool_calls": st.lists(
                st.fixed_dictionaries(
                    {
                        "id": texts,
                        "type": st.just("function"),
                        "function": st.fixed_dictionaries({"name": texts, "arguments": texts}),
                    }
                ),
                max_size=2,
            ),
        },
    ),
    anything,
)
schema = st.one_of(
    st.just(
        {
            "type": "object",
            "properties": {"a": {"type": "integer", "maximum": 9, "minimum": 0}},
            "required": ["a"],
            "additionalProperties": False,
        }
    ),
    st.just({"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2}),
    st.dictionaries(
        st.sampled_from(
            ["type", "properties", "items", "enum", "required", "$ref", "anyOf", "pattern"]
        ),
        anything,
        max_size=3,
    ),
    anything,
)
tool = st.one_of(
    st.fixed_dictionaries(
        {
            "type": st.just("function"),
            "function": st.fixed_dictionaries(
                {"name": st.sampled_from(["f", "g", "bad name"])},
                optional={"parameters": schema, "description": texts},
            ),
        }
    ),
    anything,
)
sampling = {
    "model": st.one_of(st.just(MODEL), anything),
    "max_tokens": small_int,
    "temperature": st.one_of(st.floats(-1, 3), anything),
    "top_p": st.one_of(st.floats(-0.5, 1.5), anything),
    "top_k": small_int,
    "n": small_int,
    "seed": st.one_of(st.integers(-(2**70), 2**70), anything),
    "stop": st.one_of(texts, st.lists(texts, max_size=20)),
    "stream": st.one_of(st.booleans(), anything),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), anything),
    "presence_penalty": st.one_of(st.floats(-3, 3), anything),
    "frequency_penalty": st.one_of(st.floats(-3, 3), anything),
    "ignore_eos": st.one_of(st.booleans(), anything),
    "min_tokens": small_int,
    "logit_bias": anything,
    "user": anything,
}
chat_body = st.fixed_dictionaries(
    {"messages": st.one_of(st.lists(message, min_size=1, max_size=3), anything)},
    optional={
        **sampling,
        "logprobs": st.one_of(st.booleans(), anything),
        "top_logprobs": small_int,
        "max_completion_tokens": small_int,
        "response_format": st.one_of(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["text", "json_object", "json_schema", "yaml"])},
                optional={"json_schema": st.fixed_dictionaries({"name": texts, "schema": schema})},
            ),
            anything,
        ),
        "tools": st.one_of(st.lists(tool, max_size=2), anything),
        "tool_choice": st.one_of(
            st.sampled_from(["none", "auto", "required"]),
            st.fixed_dictionaries(
                {
                    "type": st.just("function"),
                    "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "g"])}),
                }
            ),
            anything,
        ),
    },
)
prompt = st.one_of(
    st.text(max_size=60),
    st.lists(st.text(max_size=20), max_size=3),
    st.lists(st.integers(-5, 400), max_size=20),
    st.lists(st.lists(st.integers(0, 300), max_size=8), max_size=3),
    anything,
)
completion_body = st.fixed_dictionaries(
    {"prompt": prompt},
    optional={
        **sampling,
        "echo": st.one_of(st.booleans(), anything),
        "logprobs": small_int,
        "suffix": texts,
    },
)
# Well-formed bodies with in-range values, so that many requests reach the engine too.
valid_sampling = {
    "max_tokens": st.integers(1, 8),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50),
    "n": st.integers(1, 3),
    "seed": st.integers(-(2**63), 2**63),
    "stop": st.lists(st.text(max_size=4), max_size=3),
    "stream": st.booleans(),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "min_tokens": st.integers(0, 1),
}
valid_chat = st.fixed_dictionaries(
    {
        "model": st.just(MODEL),
        "messages": st.lists(
            st.fixed_dictionaries(
                {
                    "role": st.sampled_from(["system", "user", "assistant"]),
                    "content": st.text(max_size=30),
                }
            ),
            min_size=1,
            max_size=3,
        ),
    },
    optional={
        **valid_sampling,
        "logprobs": st.booleans(),
        "response_format": st.sampled_from(
            [
                {"type": "text"},
                {"type": "json_object"},
                {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "s",
                        "schema": {
                            "type": "object",
                            "properties": {"a": {"enum": [1, 2]}},
                            "required": ["a"],
                            "additionalProperties": False,
                        },
                    },
                },
            ]
        ),
    },
)
valid_completion = st.fixed_dictionaries(
    {
        "model": st.just(MODEL),
        "prompt": st.one_of(
            st.text(min_size=1, max_size=40), st.lists(st.integers(0, 250), min_size=1, max_size=20)
        ),
    },
    optional={
        **valid_sampling,
        "echo": st.booleans(),
        "logprobs": st.integers(0, 5),
    },
)
raw_body = st.one_of(
    st.binary(max_size=200),
    st.text(max_size=200).map(str.encode),
    st.just(b"{"),
    st.just(b"[]"),
    st.just(b"null"),
)


SENT: dict[str, int] = {"n": 0, "ok": 0}


def _check(srv: RunningServer, r: httpx.Response) -> None:
    SENT["n"] += 1
    SENT["ok"] += r.status_code == 200
    assert r.status_code < 500 or (
        r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
    ), (r.status_code, r.text[:500], srv.log()[-2000:])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["type"]
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]"
        for e in events[:-1]:
            assert "error" not in json.loads(e), e  # in-band failures would be 5xx in disguise
    if SENT["n"] % 25 == 0:
        assert httpx.get(srv.base_url + "/health", timeout=10).status_code == 200


FUZZ = fuzz_settings(130)


@FUZZ
@given(body=chat_body)
def test_fuzz_chat(fuzz_server: RunningServer, fuzz_client: httpx.Client, body: dict) -> None:
    _check(fuzz_server, post_json(fuzz_client, "/v1/chat/completions", body))


@FUZZ
@given(body=completion_body)
def test_fuzz_completions(
    fuzz_server: RunningServer, fuzz_client: httpx.Client, body: dict
) -> None:
    _check(fuzz_server, post_json(fuzz_client, "/v1/completions", body))


@FUZZ
@given(body=st.one_of(valid_chat, valid_completion))
def test_fuzz_well_formed(
    fuzz_server: RunningServer, fuzz_client: httpx.Client, body: dict
) -> None:
    _check(
        fuzz_server,
        post_json(
            fuzz_client, "/v1/chat/completions" if "messages" in body else "/v1/completions", body
        ),
    )


@fuzz_settings(60)
@given(
    body=raw_body,
    path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/nope"]),
    ctype=st.sampled_from(["application/json", "text/plain", ""]),
)
def test_fuzz_raw_bytes(
    fuzz_server: RunningServer, fuzz_client: httpx.Client, body: bytes, path: str, ctype: str
) -> None:
    _check(
        fuzz_server,
        fuzz_client.post(path, content=body, headers={"content-type": ctype} if ctype else {}),
    )


def test_fuzz_count_and_alive(fuzz_server: RunningServer) -> None:
    """Runs last in this module: at least 300 generated requests went out, and none broke it."""
    assert SENT["n"] >= 300, SENT
    assert SENT["ok"] >= 60, SENT  # the generators also reach the engine, not only the validator
    print("fuzz requests:", SENT)
    assert httpx.get(fuzz_server.base_url + "/health", timeout=10).json() == {"status": "ready"}
    assert "Traceback" not in fuzz_server.log()
