"""Grammar-constrained decoding: the TokenConstraint contract, then JSON mode and JSON schema
through the real server (sampled at temperature 1, streamed and not)."""

from __future__ import annotations

import json
import pickle
import random

import httpx
import jsonschema
import openai
import pytest
import torch
from server_fixtures import RunningServer
from tiny_models import make_tokenizer

from engine.structured import ConstraintSpec, GrammarCompiler
from engine.structured.constraint import check_spec

pytestmark = pytest.mark.timeout(300)
MODEL = "tiny"
MSGS = [{"role": "user", "content": "Describe a person as JSON."}]
# Nested, and bounded (strings, numbers, arrays), so that 150 sampled tokens always suffice.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "admin": {"type": "boolean"},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 6},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "admin", "address", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    tok = make_tokenizer()
    return GrammarCompiler(tok, len(tok), [tok.convert_tokens_to_ids("<|endoftext|>")])


def _walk(c, rng: random.Random, eos: int, limit: int = 400) -> list[int]:
    out: list[int] = []
    for _ in range(limit):
        allowed = c.allowed().nonzero().flatten().tolist()
        t = rng.choice(allowed)
        c.advance(t)
        if t == eos:
            return out
        out.append(t)
    raise AssertionError("grammar did not finish")


def test_constraint_random_walks_are_valid(compiler: GrammarCompiler) -> None:
    tok = make_tokenizer()
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    rng = random.Random(0)
    for _ in range(20):
        c = compiler.make(ConstraintSpec.json_schema(PERSON))
        jsonschema.validate(json.loads(tok.decode(_walk(c, rng, eos))), PERSON)
        assert c.is_terminated() and c.allowed().sum() <= 1


def test_constraint_rollback_restores_the_state(compiler: GrammarCompiler) -> None:
    """Speculative rejection: after rollback(n) the mask is the one before those n tokens."""
    c = compiler.make(ConstraintSpec.json_schema(PERSON))
    rng = random.Random(1)
    masks, toks = [], []
    for _ in range(12):
        masks.append(c.allowed())
        toks.append(rng.choice(masks[-1].nonzero().flatten().tolist()))
        c.advance(toks[-1])
    c.rollback(5)
    assert torch.equal(c.allowed(), masks[7])
    for t in toks[7:]:  # the same tokens are accepted again
        c.advance(t)
    c.rollback(12)
    assert torch.equal(c.allowed(), masks[0])
    with pytest.raises(ValueError):
        c.rollback(1)
    forbidden = int((~masks[0]).nonzero()[0])
    with pytest.raises(ValueError):
        c.advance(forbidden)


def test_spec_is_plain_data() -> None:
    spec = ConstraintSpec.json_schema(PERSON)
    assert pickle.loads(pickle.dumps(spec)) == spec and hash(spec) == hash(
        ConstraintSpec.json_schema(PERSON)
    )
    assert check_spec(spec) is None and check_spec(ConstraintSpec("json_object")) is None
    assert "foo" in (check_spec(ConstraintSpec.json_schema({"type": "foo"})) or "")
    with pytest.raises(ValueError):
        ConstraintSpec("yaml")


@pytest.fixture(scope="module")
def srv(tiny_server: RunningServer) -> RunningServer:
    return tiny_server  # shared (tests/conftest.py): started once per worker


@pytest.fixture(scope="module")
def client(srv: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.v1, api_key="unused", max_retries=0, timeout=120)


SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "person", "schema": PERSON, "strict": True},
}


def _sampled(
    client: openai.OpenAI, requests: int, n: int, stream: bool
) -> list[tuple[str, str | None]]:
    """`requests` x `n` choices at temperature 1 under the PERSON schema: (text, finish_reason)."""
    texts: dict[tuple[int, int], str] = {}
    finishes: dict[tuple[int, int], str | None] = {}
    for seed in range(requests):
        kw = dict(
            model=MODEL,
            messages=MSGS,
            n=n,
            temperature=1.0,
            seed=seed + (100 if stream else 0),
            max_tokens=150,
            response_format=SCHEMA_FORMAT,
        )
        if not stream:
            for c in client.chat.completions.create(**kw).choices:
                texts[seed, c.index], finishes[seed, c.index] = c.message.content, c.finish_reason
            continue
        for ch in client.chat.completions.create(**kw, stream=True):
            for c in ch.choices:
                texts[seed, c.index] = texts.get((seed, c.index), "") + (c.delta.content or "")
                if c.finish_reason:
                    finishes[seed, c.index] = c.finish_reason
    return [(texts[k], finishes.get(k)) for k in sorted(texts)]


def _check_all_valid(outs: list[tuple[str, str | None]], expected: int) -> None:
    assert len(outs) == expected
    for text, finish in outs:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), PERSON)
    assert len({t for t, _ in outs}) > expected // 5  # really sampled, not one answer repeated


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_sampled(client: openai.OpenAI, stream: bool) -> None:
    _check_all_valid(_sampled(client, 1, 8, stream), 8)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_50_sampled(client: openai.OpenAI, stream: bool) -> None:
    """The acceptance figure: 50 sampled outputs, all valid, streamed and not."""
    _check_all_valid(_sampled(client, 5, 10, stream), 50)


def test_json_mode_and_greedy_stream_equality(client: openai.OpenAI) -> None:
    kw = dict(
        model=MODEL,
        messages=MSGS,
        temperature=0,
        max_tokens=200,
        response_format={"type": "json_object"},
    )
    full = client.chat.completions.create(**kw)
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(**kw, stream=True)
        if c.choices
    )
    assert streamed == full.choices[0].message.content
    if (
        full.choices[0].finish_reason == "stop"
    ):  # greedy on a random model may loop until max_tokens
        assert isinstance(json.loads(streamed), dict)
    else:
        assert streamed.startswith("{")
    sampled = client.chat.completions.create(**{**kw, "temperature": 1.0, "n": 8, "seed": 3})
    done = [c.message.content for c in sampled.choices if c.finish_reason == "stop"]
    assert done and all(isinstance(json.loads(t), dict) for t in done)


def test_completions_prompt_is_untouched_by_json(client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(
        model=MODEL, messages=MSGS, temperature=0, max_tokens=8, response_format={"type": "text"}
    )
    assert plain.choices[0].message.content is not None


@pytest.mark.parametrize(
    "fmt,param",
    [
        ({"type": "yaml"}, "response_format.type"),
        ({"type": "json_schema"}, "response_format"),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
            "response_format.json_schema.schema",
        ),
    ],
)
def test_bad_response_format_is_400(srv: RunningServer, fmt: dict, param: str) -> None:
    r = httpx.post(
        srv.v1 + "/chat/completions",
        json={"model": MODEL, "messages": MSGS, "response_format": fmt},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_ignore_eos_with_schema_is_400(srv: RunningServer) -> None:
    r = httpx.post(
        srv.v1 + "/chat/completions",
        json={
            "model": MODEL,
            "messages": MSGS,
            "response_format": {"type": "json_object"},
            "ignore_eos": True,
        },
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "ignore_eos"
