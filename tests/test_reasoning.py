"""Reasoning output: a chat template that opens <think> (Qwen3 style, with an enable_thinking
switch) on a tiny checkpoint.  The <think> section's text goes to reasoning_content (chat),
a reasoning item (responses) and a thinking block (messages); the switch closes it."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import anthropic
import openai
import pytest
from server_fixtures import RunningServer, serve
from transformers import AutoTokenizer

from server.reasoning import ReasoningSplitter, split_whole, starts_inside

pytestmark = pytest.mark.timeout(300)
MODEL = "thinker"
THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n"
    "{% if enable_thinking is defined and enable_thinking is false %}\n</think>\n\n{% endif %}{% endif %}"
)
MSGS = [{"role": "user", "content": "Hello, how are you?"}]


@pytest.mark.parametrize(
    "pieces",
    [
        ["<think>a b</think>\n\nanswer"],
        ["<thi", "nk>a ", "b</th", "ink>", "\n", "\nans", "wer"],
        ["  <think>a b</think>answer"],
    ],
)
def test_splitter_model_opened_section_any_piece_boundaries(pieces: list[str]) -> None:
    s = ReasoningSplitter(inside=False)
    got = [s.feed(p) for p in pieces] + [s.finish()]
    assert "".join(r for r, _ in got) == "a b" and "".join(c for _, c in got) == "answer"


def test_splitter_prompt_opened_section_and_plain_text() -> None:
    assert split_whole("thinking...</think>\n\nhi", inside=True) == ("thinking...", "hi")
    assert split_whole("never closed <", inside=True) == ("never closed <", "")
    assert split_whole("no tags here", inside=False) == ("", "no tags here")
    assert split_whole("text then <think>late</think>", inside=False) == (
        "",
        "text then <think>late</think>",
    )  # only at the start
    assert starts_inside("<|im_start|>assistant\n<think>\n") and not starts_inside(
        "<think>\n\n</think>\n\n"
    )


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt, tmp_path_factory):
    d = tmp_path_factory.mktemp("thinker") / "model"
    shutil.copytree(tiny_ckpt(), d)
    tok = AutoTokenizer.from_pretrained(d)
    tok.chat_template = THINK_TEMPLATE
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def srv(ckpt, tmp_path_factory) -> Iterator[RunningServer]:
    with serve(
        ["--model", str(ckpt), "--served-model-name", MODEL],
        tmp_path_factory.mktemp("think-srv") / "server.log",
    ) as s:
        yield s


def _reference(oai: openai.OpenAI, ckpt, enable: bool) -> str:
    """The same prompt text through /v1/completions (no splitting): what the model wrote."""
    tok = AutoTokenizer.from_pretrained(ckpt)
    text = tok.apply_chat_template(
        MSGS, add_generation_prompt=True, tokenize=False, enable_thinking=enable
    )
    return (
        oai.completions.create(
            model=MODEL, prompt=text, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )


def test_reasoning_fields_in_all_three_apis(srv: RunningServer, ckpt) -> None:
    oai = openai.OpenAI(base_url=srv.v1, api_key="x", max_retries=0, timeout=60)
    ant = anthropic.Anthropic(base_url=srv.base_url, api_key="x", max_retries=0, timeout=60)
    thought = _reference(oai, ckpt, True)
    assert thought and "</think>" not in thought  # a random model never closes the section
    kw = {
        "model": MODEL,
        "messages": MSGS,
        "max_tokens": 16,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    r = oai.chat.completions.create(**kw)
    assert r.choices[0].message.reasoning_content == thought and not r.choices[0].message.content
    chunks = list(oai.chat.completions.create(**kw, stream=True))
    assert (
        "".join(
            getattr(c.choices[0].delta, "reasoning_content", None) or ""
            for c in chunks
            if c.choices
        )
        == thought
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""

    resp = oai.responses.create(
        model=MODEL, input=MSGS[0]["content"], max_output_tokens=16, temperature=0, store=False
    )
    assert resp.output[0].type == "reasoning" and resp.output[0].content[0].text.startswith(
        thought[:8]
    )
    m = ant.messages.create(
        model=MODEL, messages=MSGS, max_tokens=16, extra_body={"temperature": 0}
    )
    assert m.content[0].type == "thinking" and m.content[0].thinking.startswith(thought[:8])
    with ant.messages.stream(
        model=MODEL, messages=MSGS, max_tokens=16, extra_body={"temperature": 0}
    ) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == [b.type for b in m.content] and final.content[
        0
    ].thinking == m.content[0].thinking

    # The switch: reasoning off closes the section in the prompt, so the output is content.
    answer = _reference(oai, ckpt, False)
    off = oai.chat.completions.create(**kw, reasoning_effort="none")
    assert (
        off.choices[0].message.content == answer
        and off.choices[0].message.reasoning_content is None
    )
    m_off = ant.messages.create(
        model=MODEL,
        messages=MSGS,
        max_tokens=16,
        extra_body={"temperature": 0, "thinking": {"type": "disabled"}},
    )
    assert [b.type for b in m_off.content] == ["text"]
    n_on = ant.messages.count_tokens(model=MODEL, messages=MSGS)
    n_off = ant.messages.count_tokens(model=MODEL, messages=MSGS, thinking={"type": "disabled"})
    # Anthropic's usage splits the prompt: uncached input + prefix-cache reads + cache writes.
    prompt = (
        m.usage.input_tokens + m.usage.cache_read_input_tokens + m.usage.cache_creation_input_tokens
    )
    assert n_off.input_tokens > n_on.input_tokens == prompt
