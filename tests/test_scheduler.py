"""Scheduler and detokenizer on CPU, without a model: the runner is faked with plain data."""

from __future__ import annotations

from dataclasses import replace

from engine.core.detokenizer import IncrementalDetokenizer
from engine.core.messages import GenerateRequest
from engine.core.scheduler import Scheduler
from engine.core.step_types import SeqResult, StepOutput, StepPlan
from engine.worker.sampling import SamplingParams


class CharTok:
    """Token i decodes to chr(i); enough for stop-string and streaming logic."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if i != 0)


def fake_execute(plan: StepPlan, next_tok: int = ord("a")) -> StepOutput:
    return StepOutput(
        {w.request_id: SeqResult(sampled=[next_tok + len(w.output_ids)]) for w in plan.work}
    )


def req(rid: str, n_prompt: int = 3, **kw: object) -> GenerateRequest:
    return GenerateRequest(rid, list(range(1, n_prompt + 1)), SamplingParams(**kw))  # type: ignore[arg-type]


def test_decodes_interleave_and_long_prompts_prefill_in_chunks() -> None:
    s = Scheduler(CharTok(), {0}, max_running=8, prefill_token_budget=5, max_model_len=100)
    for r in ("a", "b", "c"):
        s.add(req(r, n_prompt=3, max_tokens=3))
    plan = s.schedule()
    # a fits whole; b gets the 2 tokens left of the budget, a chunk that does not sample yet.
    assert [(w.request_id, w.input_ids, w.start_pos, w.samples) for w in plan.work] == [
        ("a", [1, 2, 3], 0, True),
        ("b", [1, 2], 0, False),
    ]
    outs = s.update(plan, fake_execute(plan))
    assert [o.request_id for o in outs] == ["a"] and s.running["b"].num_computed == 2
    plan = s.schedule()
    assert [(w.request_id, w.input_ids, w.start_pos, w.samples) for w in plan.work] == [
        ("a", [ord("a")], 3, True),
        ("b", [3], 2, True),
        ("c", [1, 2, 3], 0, True),
    ]
    outs = s.update(plan, fake_execute(plan))
    assert [o.text for o in outs] == ["b", "a", "a"]


def test_rollback_advances_by_kept_positions() -> None:
    """A verification window [last, d1, d2, d3] that keeps 2 positions (1 draft accepted) emits
    2 tokens and advances the position count by 2, not by the window's length."""
    s = Scheduler(CharTok(), {0}, max_running=8, prefill_token_budget=100, max_model_len=100)
    s.add(req("r", n_prompt=3, max_tokens=10))
    plan = s.schedule()
    s.update(plan, fake_execute(plan))
    w = s.schedule().work[0]
    assert w.max_draft == 8  # 9 more tokens allowed, the window's own sample is one of them
    window = StepPlan([replace(w, input_ids=w.input_ids + [98, 99, 100], num_draft=3)])
    outs = s.update(window, StepOutput({"r": SeqResult(sampled=[98, 120], num_kept=2)}))
    seq = s.running["r"]
    assert outs[0].token_ids == [98, 120] and seq.num_computed == 3 + 2 and len(seq.output_ids) == 3
    nxt = s.schedule().work[0]
    assert nxt.input_ids == [120] and nxt.start_pos == 5


def test_stop_inside_a_window_emits_nothing_after_it() -> None:
    s = Scheduler(CharTok(), {0}, max_running=8, prefill_token_budget=100, max_model_len=100)
    s.add(req("r", n_prompt=3, max_tokens=10, stop=("yz",)))
    plan = s.schedule()
    s.update(plan, fake_execute(plan))
    w = s.schedule().work[0]
    outs = s.update(
        StepPlan([w]), StepOutput({"r": SeqResult(sampled=[ord(c) for c in "xyzw"], num_kept=4)})
    )
    # "w" after the stop string is dropped; usage counts the tokens up to the stop (as vLLM does).
    assert (
        outs[0].finish_reason == "stop"
        and outs[0].text == "x"
        and outs[0].token_ids == [120, 121, 122]
        and outs[0].num_output_tokens == 4
    )


def test_context_cap_inside_a_window() -> None:
    s = Scheduler(CharTok(), {0}, max_running=8, prefill_token_budget=100, max_model_len=6)
    s.add(req("r", n_prompt=3, max_tokens=50))
    plan = s.schedule()
    s.update(plan, fake_execute(plan))
    w = s.schedule().work[0]
    assert w.max_draft == 1  # 6 - (3 prompt + 1 output) - 1
    outs = s.update(StepPlan([w]), StepOutput({"r": SeqResult(sampled=[98, 99, 100], num_kept=3)}))
    assert (
        outs[0].finish_reason == "length" and outs[0].num_output_tokens == 3
    )  # 3 + 3 = max_model_len


def test_length_stop_and_abort_free_caches() -> None:
    s = Scheduler(CharTok(), {0}, max_running=8, prefill_token_budget=100, max_model_len=100)
    s.add(req("x", max_tokens=2))
    s.add(req("y", max_tokens=50))
    texts: dict[str, str] = {"x": "", "y": ""}
    finish: dict[str, str | None] = {}
    for _ in range(2):
        plan = s.schedule()
        for o in s.update(plan, fake_execute(plan)):
            texts[o.request_id] += o.text
            finish[o.request_id] = o.finish_reason
    assert texts["x"] == "ab" and finish["x"] == "length"
    assert s.schedule().free_ids == ["x"]
    o = s.abort("y")
    assert (
        o is not None
        and o.finish_reason == "abort"
        and s.schedule().free_ids == ["y"]
        and not s.has_work()
    )


def test_detokenizer_holds_back_stop_prefix() -> None:
    d = IncrementalDetokenizer(CharTok(), ("cd",))
    out = ""
    for ch in "abcxabcd":
        d.append([ord(ch)])
        out += d.release(final=d.stopped)
        if d.stopped:
            break
    assert out == "abcxab" and d.stopped


def test_eos_ends_without_counting() -> None:
    s = Scheduler(CharTok(), {ord("b")}, max_running=8, prefill_token_budget=100, max_model_len=100)
    s.add(req("z", max_tokens=10))
    outs = []
    for _ in range(2):
        plan = s.schedule()
        outs += s.update(plan, fake_execute(plan))
    assert outs[-1].finish_reason == "stop" and outs[-1].num_output_tokens == 1
