"""Scheduler and detokenizer on CPU, without a model: the runner is faked with plain data."""
from __future__ import annotations

from engine.core.detokenizer import IncrementalDetokenizer
from engine.core.messages import GenerateRequest
from engine.worker.sampling import SamplingParams
from engine.core.scheduler import Scheduler, SeqResult, StepOutput, StepPlan


class CharTok:
    """Token i decodes to chr(i); enough for stop-string and streaming logic."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if i != 0)


def fake_execute(plan: StepPlan, next_tok: int = ord("a")) -> StepOutput:
    return StepOutput({w.request_id: SeqResult(sampled=[next_tok + len(w.output_ids)]) for w in plan.work})


def req(rid: str, n_prompt: int = 3, **kw: object) -> GenerateRequest:
    return GenerateRequest(rid, list(range(1, n_prompt + 1)), SamplingParams(**kw))  # type: ignore[arg-type]


def test_decodes_interleave_and_prefills_respect_budget() -> None:
    s = Scheduler(CharTok(), {0}, max_running=8, prefill_token_budget=5, max_model_len=100)
    for r in ("a", "b", "c"):
        s.add(req(r, n_prompt=3, max_tokens=3))
    plan = s.schedule()
    assert [(w.request_id, w.is_prefill) for w in plan.work] == [("a", True)]  # b would exceed the budget
    s.update(plan, fake_execute(plan))
    plan = s.schedule()
    assert [(w.request_id, w.is_prefill, w.start_pos) for w in plan.work] == [("a", False, 3), ("b", True, 0)]
    outs = s.update(plan, fake_execute(plan))
    assert [o.text for o in outs] == ["b", "a"]


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
    assert o is not None and o.finish_reason == "abort" and s.schedule().free_ids == ["y"] and not s.has_work()


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
