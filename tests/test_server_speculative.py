"""The server with speculative decoding on (the embedded pair, draft proposer, fixed k=4):
the same text, usage, logprobs and stop behaviour as plain decoding, and real spec counters."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from server_fixtures import RunningServer, serve

from engine.config import EngineConfig
from engine.core.completion import generate
from engine.worker.loader import load_model
from engine.worker.sampling import SamplingParams
from models import EMBEDDED_TARGET

pytestmark = pytest.mark.timeout(300)
PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?\n"


@pytest.fixture(scope="module")
def srv(tmp_path_factory) -> Iterator[RunningServer]:
    args = [
        "--served-model-name",
        "pair",
        "--speculative",
        "draft",
        "--num-speculative-tokens",
        "4",
        "--no-adaptive-k",
        "--dtype",
        "float32",
    ]
    with serve(args, tmp_path_factory.mktemp("spec") / "server.log", ready_timeout=240) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.v1, api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def plain() -> tuple[list[int], str]:
    """Speculation off, in-process: the reference tokens and text for PROMPT."""
    om = load_model(EMBEDDED_TARGET, EngineConfig(dtype="float32"))
    try:
        ids = om.tokenizer(PROMPT)["input_ids"]
        c = generate(om, ids, SamplingParams(max_tokens=40, ignore_eos=True))
        return c.token_ids, c.text
    finally:
        om.close()


def test_same_text_usage_and_logprobs_as_plain_decoding(
    client: openai.OpenAI, plain: tuple[list[int], str]
) -> None:
    tokens, text = plain
    r = client.completions.create(
        model="pair",
        prompt=PROMPT,
        max_tokens=40,
        temperature=0,
        logprobs=1,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].text == text
    assert (
        r.usage.completion_tokens == 40 == len(tokens)
    )  # max_tokens is exact even when a window overshoots
    assert len(r.choices[0].logprobs.tokens) == 40 and all(
        lp <= 0 for lp in r.choices[0].logprobs.token_logprobs
    )
    chunks = list(
        client.completions.create(
            model="pair",
            prompt=PROMPT,
            max_tokens=40,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == 40


def test_stop_string_across_windows(client: openai.OpenAI, plain: tuple[list[int], str]) -> None:
    _, text = plain
    stop = text[
        len(text) // 2 : len(text) // 2 + 7
    ]  # several tokens long: it spans proposals and windows
    r = client.completions.create(
        model="pair",
        prompt=PROMPT,
        max_tokens=40,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.find(stop)]


def test_n2_sampled_and_counters(srv: RunningServer, client: openai.OpenAI) -> None:
    kw = dict(model="pair", prompt=PROMPT, max_tokens=16, temperature=0.9, n=2, seed=5)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert len(a.choices) == 2 and [c.text for c in a.choices] == [
        c.text for c in b.choices
    ]  # seeded: reproducible
    assert a.choices[0].text != a.choices[1].text  # two distinct samples
    m = srv.metrics()
    drafts = m[("moe_offload_spec_drafts_total", ())]
    proposed = m[("moe_offload_spec_draft_tokens_total", ())]
    accepted = m[("moe_offload_spec_accepted_tokens_total", ())]
    assert (
        drafts > 0 and drafts < proposed <= 4 * drafts
    )  # k=4, fewer only where max_tokens leaves less room
    assert 0 < accepted < proposed
    first = m[("moe_offload_spec_proposed_at_position_total", (("position", "1"),))]
    assert (
        first == drafts
        and m[("moe_offload_spec_accepted_at_position_total", (("position", "1"),))] <= first
    )
    assert m[("moe_offload_spec_mean_accepted_length", ())] == pytest.approx(accepted / drafts)
    assert all(
        m[("moe_offload_spec_distinct_experts_per_window", (("layer", str(i)),))] >= 8
        for i in range(4)
    )


def test_log_mentions_no_error(srv: RunningServer) -> None:
    assert "Traceback" not in Path(srv.log_path).read_text(errors="replace")


def test_eight_concurrent_requests_equal_solo(client: openai.OpenAI) -> None:
    import asyncio

    prompts = [
        f"{PROMPT}{w}"
        for w in (
            "JULIET:",
            "HAMLET:",
            "The file",
            "def main",
            "KING:",
            "To be",
            "import os",
            "Enter",
        )
    ]
    solo = [
        client.completions.create(
            model="pair",
            prompt=p,
            max_tokens=12 + i,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
        for i, p in enumerate(prompts)
    ]

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(
            base_url=client.base_url, api_key="x", max_retries=0, timeout=120
        ) as ac:
            rs = await asyncio.gather(
                *(
                    ac.completions.create(
                        model="pair",
                        prompt=p,
                        max_tokens=12 + i,
                        temperature=0,
                        extra_body={"ignore_eos": True},
                    )
                    for i, p in enumerate(prompts)
                )
            )
            return [r.choices[0].text for r in rs]

    assert asyncio.run(main()) == solo
