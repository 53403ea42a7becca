"""Reasoning output: the text of a `<think>` section goes to its own field.

Chat templates in the Qwen3, DeepSeek-R1 and GLM-4.5 style either open `<think>` in the
generation prompt (the output starts inside it) or let the model open it.  Whether a
template takes part at all is read from its source (`<think>` appears in it), so plain
templates are never split.  `ReasoningSplitter` cuts a streamed output into reasoning and
content: everything up to `</think>` while inside, the rest as content; a tag split across
two pieces is held back until it is resolved.

The template's own switch is `enable_thinking` (Qwen3, GLM-4.5); `reasoning_effort` "none"
(OpenAI) and `thinking.type` "disabled" (Anthropic) turn it off, other values on.  A template
without that switch ignores them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from server.tools import template_messages, template_tools

if TYPE_CHECKING:
    from server.protocol import ChatCompletionRequest
    from server.state import ServerState

OPEN, CLOSE = "<think>", "</think>"


def template_source(tokenizer: Any) -> str:
    t = getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):  # several named templates
        t = t.get("default") or next(iter(t.values()), "")
    return t if isinstance(t, str) else ""


def supports_reasoning(tokenizer: Any) -> bool:
    return OPEN in template_source(tokenizer)


def template_switch(tokenizer: Any, enable: bool | None) -> dict[str, Any]:
    """Extra chat-template variables for a request's thinking preference."""
    if enable is None or "enable_thinking" not in template_source(tokenizer):
        return {}
    return {"enable_thinking": enable}


def starts_inside(prompt_tail: str) -> bool:
    """Whether a prompt ending in `prompt_tail` leaves a <think> section open."""
    return prompt_tail.rfind(OPEN) > prompt_tail.rfind(CLOSE)


def _partial(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningSplitter:
    """feed(piece) -> (reasoning, content) released so far; finish() flushes what is held."""

    def __init__(self, inside: bool) -> None:
        self.inside = inside
        self.may_open = not inside  # the model may still open a section at the very start
        self.buf = ""
        self.after_close = False  # drop the newlines a template puts after </think>
        self.reasoning = ""
        self.content = ""

    def feed(self, piece: str) -> tuple[str, str]:
        self.buf += piece
        r, c = "", ""
        while self.buf:
            if self.may_open:
                head = self.buf.lstrip()
                if head.startswith(OPEN):
                    self.buf, self.inside, self.may_open = head[len(OPEN) :], True, False
                    continue
                if OPEN.startswith(head):  # still possibly "<think>": wait for more
                    break
                self.may_open = False
            if self.inside:
                at = self.buf.find(CLOSE)
                if at >= 0:
                    r += self.buf[:at]
                    self.buf, self.inside, self.after_close = (
                        self.buf[at + len(CLOSE) :],
                        False,
                        True,
                    )
                    continue
                keep = _partial(self.buf, CLOSE)
                r += self.buf[: len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep :]
                break
            if self.after_close:
                self.buf = self.buf.lstrip("\n")
                if not self.buf:
                    break
                self.after_close = False
            c += self.buf
            self.buf = ""
        self.reasoning += r
        self.content += c
        return r, c

    def finish(self) -> tuple[str, str]:
        rest, self.buf = self.buf, ""
        if self.inside:
            self.reasoning += rest
            return rest, ""
        self.content += rest
        return "", rest


def split_whole(text: str, inside: bool) -> tuple[str, str]:
    """(reasoning, content) of a finished output."""
    s = ReasoningSplitter(inside)
    s.feed(text)
    s.finish()
    return s.reasoning, s.content


def prompt_starts_inside(tokenizer: Any, prompt: list[int]) -> bool:
    """Whether the output of `prompt` begins inside a <think> section (blocking: decodes)."""
    return starts_inside(tokenizer.decode(prompt[-16:]))


def thinking_of_effort(effort: str | None) -> bool | None:
    """OpenAI's reasoning_effort as the template's switch: "none" is off, any other value on."""
    return None if effort is None else effort != "none"


async def reasoning_prompt(
    st: ServerState, body: ChatCompletionRequest, thinking: bool | None
) -> tuple[list[int], bool, bool]:
    """(prompt ids, whether outputs are split into reasoning, whether they start inside it)."""
    reasoning = supports_reasoning(st.tokenizer)
    extra = template_switch(st.tokenizer, thinking) if reasoning else {}
    prompt = await st.off_loop(st.chat_prompt, template_messages(body), template_tools(body), extra)
    inside = reasoning and await st.off_loop(prompt_starts_inside, st.tokenizer, prompt)
    return prompt, reasoning, inside
