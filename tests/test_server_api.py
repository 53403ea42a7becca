"""The real server (subprocess, tiny checkpoint) driven by the official openai SDK and httpx."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from server_fixtures import RunningServer
from transformers import AutoTokenizer

pytestmark = pytest.mark.timeout(120)
MODEL = "tiny"
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def srv(tiny_server: RunningServer) -> RunningServer:
    return tiny_server  # shared (tests/conftest.py): started once per worker


@pytest.fixture(scope="module")
def client(srv: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.v1, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tok(tiny_ckpt):
    return AutoTokenizer.from_pretrained(tiny_ckpt())


MSGS = [{"role": "user", "content": "Hello, how are you?"}]


def _stream_chat(
    client: openai.OpenAI, n: int = 1, **kw
) -> tuple[list[str], list[str | None], object, list]:
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MSGS,
            stream=True,
            n=n,
            stream_options={"include_usage": True},
            **kw,
        )
    )
    texts, finishes = [""] * n, [None] * n
    finish_chunks = 0
    assert chunks[0].choices[0].delta.role == "assistant"
    for c in chunks[:-1]:
        assert c.object == "chat.completion.chunk" and len(c.choices) == 1 and c.usage is None
        ch = c.choices[0]
        texts[ch.index] += ch.delta.content or ""
        if ch.finish_reason is not None:
            assert finishes[ch.index] is None, "finish_reason sent twice"
            finishes[ch.index] = ch.finish_reason
            finish_chunks += 1
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert finish_chunks == n
    return texts, finishes, chunks[-1].usage, chunks


def test_health_and_models(srv: RunningServer, client: openai.OpenAI) -> None:
    assert httpx.get(srv.base_url + "/health").json() == {"status": "ready"}
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_the_engine_not_the_front_end_is_the_oom_victim(srv: RunningServer) -> None:
    """Under a memory limit the kernel kills the highest oom_score: the engine, which the front
    end restarts, never the front end with every client's connection (engine/launch.py; a soak
    with --memory-fault-every found the front end killed)."""
    from engine.launch import ENGINE_OOM_SCORE_ADJ

    def adj(pid: int) -> int:
        return int(open(f"/proc/{pid}/oom_score_adj").read())

    engine = srv.engine_pid()
    assert engine is not None
    assert adj(engine) == ENGINE_OOM_SCORE_ADJ > adj(srv.proc.pid) == 0


def test_chat_stream_equals_nonstream_with_exact_usage(client: openai.OpenAI, tok) -> None:
    full = client.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=12, logprobs=True, **GREEDY
    )
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    texts, finishes, usage, _ = _stream_chat(client, max_tokens=12, **GREEDY)
    assert (
        texts[0] == full.choices[0].message.content
        and finishes[0] == full.choices[0].finish_reason == "length"
    )
    prompt_len = len(
        tok(
            tok.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )["input_ids"]
    )
    assert full.usage.prompt_tokens == usage.prompt_tokens == prompt_len
    assert (
        full.usage.completion_tokens
        == usage.completion_tokens
        == 12
        == len(full.choices[0].logprobs.content)
    )
    assert full.usage.total_tokens == prompt_len + 12


def test_completions_prompt_forms_echo_and_stream(client: openai.OpenAI, tok) -> None:
    ids = tok("The quick brown fox")["input_ids"]
    by_text = client.completions.create(
        model=MODEL, prompt="The quick brown fox", max_tokens=6, **GREEDY
    )
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, **GREEDY)
    assert by_text.object == "text_completion" and by_text.choices[0].text == by_ids.choices[0].text
    assert by_text.usage.prompt_tokens == len(ids) and by_text.usage.completion_tokens == 6
    batch = client.completions.create(model=MODEL, prompt=[ids, [5, 6, 7]], max_tokens=6, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1] and batch.choices[0].text == by_text.choices[
        0
    ].text
    assert batch.usage.prompt_tokens == len(ids) + 3 and batch.usage.completion_tokens == 12
    echo = client.completions.create(
        model=MODEL, prompt="The quick brown fox", max_tokens=6, echo=True, **GREEDY
    )
    assert echo.choices[0].text == "The quick brown fox" + by_text.choices[0].text
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="The quick brown fox",
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == by_text.choices[0].text
    assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason) == 1
    assert chunks[-1].usage.completion_tokens == 6


def test_n2_and_seed_determinism(client: openai.OpenAI) -> None:
    kw = dict(
        model=MODEL,
        messages=MSGS,
        max_tokens=10,
        temperature=1.0,
        n=2,
        seed=1234,
        extra_body={"ignore_eos": True},
    )
    a, b = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.usage.completion_tokens == 20
    texts, finishes, usage, _ = _stream_chat(
        client, n=2, max_tokens=10, temperature=1.0, seed=1234, extra_body={"ignore_eos": True}
    )
    assert (
        texts == [c.message.content for c in a.choices]
        and finishes == ["length", "length"]
        and usage.completion_tokens == 20
    )
    other = client.chat.completions.create(**{**kw, "seed": 99})
    assert [c.message.content for c in other.choices] != [c.message.content for c in a.choices]


def test_stop_strings(client: openai.OpenAI) -> None:
    ref = (
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=16, **GREEDY)
        .choices[0]
        .text
    )
    i = next(
        i
        for i in range(2, len(ref) - 1)
        if ref[i].isprintable() and ref[i] != "\ufffd" and ref[i] not in ref[:i]
    )
    stop = ref[i]
    got = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=16, stop=[stop, "zzzz"], **GREEDY
    )
    assert got.choices[0].text == ref[:i] and got.choices[0].finish_reason == "stop"
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="Hello", max_tokens=16, stop=[stop], stream=True, **GREEDY
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == ref[:i]


def test_logprobs_bounds(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=8, logprobs=True, top_logprobs=3, **GREEDY
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 8
    for e in content:
        assert -1e4 < e.logprob <= 0 and len(e.top_logprobs) == 3
        assert [t.logprob for t in e.top_logprobs] == sorted(
            (t.logprob for t in e.top_logprobs), reverse=True
        )
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob)  # greedy picks the argmax
    c = client.completions.create(
        model=MODEL, prompt="Hello there", max_tokens=5, logprobs=2, echo=True, **GREEDY
    )
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == c.usage.prompt_tokens + 5
    assert lp.token_logprobs[0] is None and all(-1e4 < x <= 0 for x in lp.token_logprobs[1:])


BAD = [
    ("/chat/completions", {"model": MODEL}, 400),  # no messages
    ("/chat/completions", {"model": MODEL, "messages": MSGS, "temperature": -1}, 400),
    ("/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("/chat/completions", {"model": MODEL, "messages": MSGS, "n": 0}, 400),
    ("/chat/completions", {"model": MODEL, "messages": MSGS, "top_logprobs": 2}, 400),
    ("/chat/completions", {"model": MODEL, "messages": MSGS, "max_tokens": 100000}, 400),
    ("/chat/completions", {"model": "nope", "messages": MSGS}, 404),
    ("/completions", {"model": MODEL, "prompt": []}, 400),
    ("/completions", {"model": MODEL, "prompt": [10**9]}, 400),
    ("/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400),
    ("/completions", "{not json", 400),
    ("/nowhere", {}, 404),
]


@pytest.mark.parametrize("path,body,status", BAD)
def test_client_errors_return_error_objects(
    srv: RunningServer, path: str, body: object, status: int
) -> None:
    kw = {"content": body} if isinstance(body, str) else {"json": body}
    r = httpx.post(srv.v1 + path, headers={"content-type": "application/json"}, timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    ok = httpx.post(
        srv.v1 + "/completions",
        json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "whatever": 1},
        timeout=30,
    )
    assert ok.status_code == 200  # still answering; unknown fields are ignored


def test_sdk_raises_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MSGS)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=10**6)


def test_32_concurrent_streams(srv: RunningServer, client: openai.OpenAI) -> None:
    prompts = [f"Request number {i}" for i in range(4)]
    ref = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=8, **GREEDY).choices[0].text
        for p in prompts
    ]

    async def one(ac: openai.AsyncOpenAI, i: int) -> tuple[int, str, str | None]:
        text, fin = "", None
        async for c in await ac.completions.create(
            model=MODEL, prompt=prompts[i % 4], max_tokens=8, stream=True, **GREEDY
        ):
            text += c.choices[0].text
            fin = c.choices[0].finish_reason or fin
        return i, text, fin

    async def main() -> list[tuple[int, str, str | None]]:
        async with openai.AsyncOpenAI(
            base_url=srv.v1, api_key="x", max_retries=0, timeout=90
        ) as ac:
            return await asyncio.gather(*(one(ac, i) for i in range(32)))

    for i, text, fin in asyncio.run(main()):
        assert text == ref[i % 4] and fin == "length"


def test_metrics_match_requests_served(srv: RunningServer, client: openai.OpenAI) -> None:
    before = srv.metrics()
    rs = [
        client.completions.create(model=MODEL, prompt=f"metrics {i}", max_tokens=3 + i, **GREEDY)
        for i in range(3)
    ]
    after = srv.metrics()

    def d(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    assert d("moe_offload_requests_finished_total", finish_reason="length") == 3
    assert d("moe_offload_generation_tokens_total") == sum(r.usage.completion_tokens for r in rs)
    assert d("moe_offload_prompt_tokens_total") == sum(r.usage.prompt_tokens for r in rs)
    for h in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
    ):
        assert d(f"moe_offload_{h}_count") == 3
    assert d("moe_offload_inter_token_latency_seconds_count") == sum(
        r.usage.completion_tokens - 1 for r in rs
    )
    # Engine counters carry exact values, not just names. The tiny model (2 MoE layers, top-2)
    # runs at cache 1.0 with fetch-all: every selected expert call is a hit, nothing moves.
    rows = sum(
        r.usage.prompt_tokens + r.usage.completion_tokens - 1 for r in rs
    )  # the last token is never fed back
    assert d("moe_offload_expert_calls_hit_total") == rows * 2 * 2
    for name in (
        "expert_calls_fetched_total",
        "expert_substitutions_total",
        "expert_substituted_gate_mass_total",
        "expert_bytes_transferred_total",
        "expert_evictions_total",
        "expert_stall_seconds_total",
    ):
        assert d("moe_offload_" + name) == 0, name
    layers = [dict(k[1])["layer"] for k in after if k[0] == "moe_offload_expert_cache_hits_total"]
    assert sorted(layers) == ["0", "1"] and all(
        d("moe_offload_expert_cache_hits_total", layer=layer) > 0 for layer in layers
    )
    hits = sum(
        after[("moe_offload_expert_cache_hits_total", (("layer", layer),))] for layer in layers
    )
    misses = sum(
        after[("moe_offload_expert_cache_misses_total", (("layer", layer),))] for layer in layers
    )
    assert after[("moe_offload_expert_cache_hit_ratio", ())] == pytest.approx(
        hits / (hits + misses)
    )
    assert {
        dict(k[1]).get("kind") for k in after if k[0] == "moe_offload_expert_transfers_total"
    } == {"demand", "prefetch", "admission"}
