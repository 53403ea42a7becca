"""Prompt caching through the real server (embedded model, fp32), speculation off and on: an
agent's second turn with the same ~840-token system prompt reads >= 80 % of its prompt from the
cache in all three APIs, and a cache hit gives the tokens and logprobs of a cold request."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import openai
import pytest
from server_fixtures import RunningServer, serve
from transformers import AutoTokenizer

from models import EMBEDDED_DIR, EMBEDDED_TARGET

pytestmark = pytest.mark.timeout(300)
MODEL = "emb"
LOGPROB_TOL = 2e-5


@pytest.fixture(scope="module")
def system_prompt() -> str:
    tok = AutoTokenizer.from_pretrained(EMBEDDED_TARGET)
    text = (EMBEDDED_DIR / "data" / "valid_shakespeare.txt").read_text()
    return tok.decode(tok(text)["input_ids"][:840])


@pytest.fixture(scope="module", params=["off", "draft"])
def srv(request, tmp_path_factory) -> Iterator[RunningServer]:
    spec = (
        ["--speculative", "off"]
        if request.param == "off"
        else ["--speculative", "draft", "--num-speculative-tokens", "4", "--no-adaptive-k"]
    )
    with serve(
        ["--served-model-name", MODEL, "--dtype", "float32", *spec],
        tmp_path_factory.mktemp(f"prefix-{request.param}") / "server.log",
        ready_timeout=240,
    ) as s:
        s.spec = request.param  # type: ignore[attr-defined]
        yield s


def test_hit_equals_cold_request_tokens_and_logprobs(
    srv: RunningServer, system_prompt: str
) -> None:
    oai = openai.OpenAI(base_url=srv.v1, api_key="x", max_retries=0, timeout=120)
    msgs = [
        {"role": "system", "content": system_prompt},
        {"role": "user", "content": f"Speculation {srv.spec}: who speaks next?"},
    ]  # type: ignore[attr-defined]
    kw = {
        "model": MODEL,
        "messages": msgs,
        "max_tokens": 16,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        "extra_body": {"ignore_eos": True},
    }
    cold = oai.chat.completions.create(**kw)
    hit = oai.chat.completions.create(**kw)
    n = cold.usage.prompt_tokens
    assert n > 840 and cold.usage.prompt_tokens_details.cached_tokens == 0
    assert (
        hit.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16
    )  # all but the last (partial) block
    a, b = cold.choices[0].logprobs.content, hit.choices[0].logprobs.content
    assert [t.token for t in a] == [t.token for t in b] and cold.choices[
        0
    ].message.content == hit.choices[0].message.content
    assert max(abs(x.logprob - y.logprob) for x, y in zip(a, b)) < LOGPROB_TOL
    m = srv.metrics()
    assert (
        m[("moe_offload_prefix_cache_hit_tokens_total", ())]
        >= hit.usage.prompt_tokens_details.cached_tokens
    )
    assert (
        m[("moe_offload_prefix_cache_bytes", ())] > 0
        and m[("moe_offload_prefix_cache_blocks", ())] >= n // 16
    )


def test_agent_second_turn_is_mostly_cached_in_every_api(
    srv: RunningServer, system_prompt: str
) -> None:
    oai = openai.OpenAI(base_url=srv.v1, api_key="x", max_retries=0, timeout=120)
    ant = anthropic.Anthropic(base_url=srv.base_url, api_key="x", max_retries=0, timeout=120)
    first = oai.responses.create(
        model=MODEL,
        instructions=system_prompt,
        input="Turn one: what is this play?",
        max_output_tokens=8,
        temperature=0,
    )
    second = oai.responses.create(
        model=MODEL,
        instructions=system_prompt,
        input="Turn two: and who wrote it?",
        max_output_tokens=8,
        temperature=0,
    )
    assert second.usage.input_tokens_details.cached_tokens >= 0.8 * second.usage.input_tokens
    m = ant.messages.create(
        model=MODEL,
        system=system_prompt,
        messages=[{"role": "user", "content": "Turn three: when?"}],
        max_tokens=8,
        extra_body={"temperature": 0},
    )
    total = m.usage.input_tokens + m.usage.cache_read_input_tokens
    assert m.usage.cache_read_input_tokens >= 0.8 * total
    assert (
        ant.messages.count_tokens(
            model=MODEL,
            system=system_prompt,
            messages=[{"role": "user", "content": "Turn three: when?"}],
        ).input_tokens
        == total
    )
    with ant.messages.stream(
        model=MODEL,
        system=system_prompt,
        messages=[{"role": "user", "content": "Turn four: where?"}],
        max_tokens=8,
        extra_body={"temperature": 0},
    ) as s:
        start = next(e for e in s if e.type == "message_start")
        final = s.get_final_message()
    assert start.message.usage.cache_read_input_tokens >= 0.8 * (
        start.message.usage.input_tokens + start.message.usage.cache_read_input_tokens
    )
    assert final.usage.cache_read_input_tokens == start.message.usage.cache_read_input_tokens
    chunks = list(
        oai.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "system", "content": system_prompt},
                {"role": "user", "content": "Turn five"},
            ],
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    u = chunks[-1].usage
    assert u.prompt_tokens_details.cached_tokens >= 0.8 * u.prompt_tokens
    assert (
        first.usage.input_tokens_details.cached_tokens >= 0.8 * first.usage.input_tokens
    )  # the previous test's system prompt
