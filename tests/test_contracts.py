"""The named contracts of engine/core/contracts.py: the core runs on anything that implements them
(no worker/ import), and every model forward of the engine answers ModelForward's call."""

from __future__ import annotations

import inspect
from functools import partial

import torch

from engine.config import EngineConfig
from engine.core.contracts import ModelForward, RunnableModel, Runner
from engine.core.engine_core import CoreLimits, EngineCore
from engine.core.messages import GenerateRequest
from engine.core.sampling_params import SamplingParams
from engine.core.step_types import SeqResult, StepOutput, StepPlan
from engine.worker.kv_cache import new_kv_cache
from engine.worker.lean_forward import LeanForward
from engine.worker.loader import load_model
from engine.worker.packed_batch import one_by_one_forward, packed_forward


class CharTok:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


class CountingRunner:
    """Samples 'a', 'b', 'c', ... per request; plain data only."""

    def __init__(self) -> None:
        self.plans: list[StepPlan] = []

    def execute(self, plan: StepPlan) -> StepOutput:
        self.plans.append(plan)
        return StepOutput(
            {w.request_id: SeqResult(sampled=[ord("a") + len(w.output_ids)]) for w in plan.work}
        )


class FakeModel:
    def __init__(self) -> None:
        self.tokenizer = CharTok()
        self.runner = CountingRunner()

    @property
    def eos_token_ids(self) -> set[int]:
        return {0}

    def make_runner(self) -> Runner:
        return self.runner


def test_the_core_runs_any_runnable_model() -> None:
    lm: RunnableModel = FakeModel()
    core = EngineCore.for_model(lm, CoreLimits(max_running=2, max_model_len=64))
    reqs = [
        GenerateRequest(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
        for i in range(2)
    ]
    text: dict[str, str] = {}
    finished: dict[str, str | None] = {}
    for o in core.generate(reqs):
        text[o.request_id] = text.get(o.request_id, "") + o.text
        finished[o.request_id] = o.finish_reason
    assert text == {"r0": "abc", "r1": "abc"} and finished == {"r0": "length", "r1": "length"}
    plans = (
        lm.runner.plans
    )  # both requests in every step (a prefill + sample, two decodes), then their caches freed
    assert [len(p.work) for p in plans] == [2, 2, 2, 0] and sorted(plans[-1].free_ids) == [
        "r0",
        "r1",
    ]


def _call(
    fwd: ModelForward,
    windows: list[list[int]],
    starts: list[int],
    caches: list,
    keep: list[list[int]],
) -> list[torch.Tensor]:
    return fwd(windows, starts, caches, keep)


def test_every_model_forward_answers_the_contract(tiny_ckpt) -> None:
    """The same two-request prefill through each forward, called as a ModelForward: one [len(keep[r]), V]
    tensor per request, caches advanced by each window, and the same logits (f32)."""
    om = load_model(
        tiny_ckpt("qwen3_moe"), EngineConfig(cache_fraction=1.0, offload="ram", device="cpu")
    )
    try:
        forwards: dict[str, ModelForward] = {
            "runner": om.make_runner().forward,  # type: ignore[attr-defined]
            "packed": partial(packed_forward, om.model, device=om.device),
            "one_by_one": partial(one_by_one_forward, om.model, device=om.device),
        }
        if LeanForward.supports(om.model):
            forwards["lean"] = partial(LeanForward(om.model), device=om.device)
        params = list(inspect.signature(ModelForward.__call__).parameters)[1:]
        windows, starts, keep = [[5, 6, 7], [8, 9]], [0, 0], [[2], [0, 1]]
        ref: list[torch.Tensor] | None = None
        for name, fwd in forwards.items():
            sig = inspect.signature(fwd)
            assert list(sig.parameters)[: len(params)] == params, name
            caches = [new_kv_cache(om.config) for _ in windows]
            out = _call(fwd, windows, starts, caches, keep)
            assert [tuple(t.shape) for t in out] == [
                (len(k), om.config.vocab_size) for k in keep
            ], name
            assert [c.get_seq_length() for c in caches] == [len(w) for w in windows], name
            if ref is None:
                ref = out
            for a, b in zip(ref, out):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
    finally:
        om.close()
