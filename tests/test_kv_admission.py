"""Admission by the KV token budget (engine/core/scheduler.py, engine/memory/planner.py): a request whose
prompt would overflow, beside the positions the running requests hold, the KV positions the memory plan
reserved waits in order instead of running (and, before, growing the KV cache past the plan until the
engine was killed); none errors.
On a real scheduler with a fake runner, on the planner with a fake footprint, and on a tiny model."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.core.completion import request
from engine.core.engine_core import CoreLimits, EngineCore
from engine.core.messages import GenerateRequest
from engine.core.scheduler import Scheduler, SeqResult, StepOutput, StepPlan
from engine.launch import max_model_len_of
from engine.memory.footprint import Footprint
from engine.memory.planner import KvRequest, kv_reservation, kv_token_budget
from engine.worker.loader import load_model
from engine.worker.sampling import SamplingParams


class CharTok:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if i != 0)


def req(rid: str, n_prompt: int, max_tokens: int) -> GenerateRequest:
    return GenerateRequest(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens))


def run(s: Scheduler, max_steps: int = 1000) -> tuple[list[set[str]], dict[str, str]]:
    """Step a scheduler with a fake runner to the end: the running set after each step, and each
    request's finish reason."""
    running, finished = [], {}
    for _ in range(max_steps):
        if not s.has_work():
            break
        plan: StepPlan = s.schedule()
        out = StepOutput({w.request_id: SeqResult(sampled=[ord("a")]) for w in plan.work})
        for o in s.update(plan, out):
            assert o.error is None
            if o.finish_reason is not None:
                finished[o.request_id] = o.finish_reason
        running.append(set(s.running))
    return running, finished


def test_requests_over_the_budget_wait_in_order_and_all_finish() -> None:
    s = Scheduler(CharTok(), {0}, 8, 1000, max_model_len=64, kv_token_budget=100)
    for rid in "abcd":
        s.add(req(rid, n_prompt=40, max_tokens=20))  # 40 prompt positions each: two fit in 100
    running, finished = run(s)
    assert running[0] == {"a", "b"}
    assert max(len(r) for r in running) == 2  # never three at once: 120 > 100
    assert finished == {rid: "length" for rid in "abcd"}
    # c starts only after a or b is done (FCFS: it was next in line).
    first = {rid: next(i for i, r in enumerate(running) if rid in r) for rid in "abcd"}
    assert first["a"] == first["b"] < first["c"] <= first["d"]


def test_admission_counts_what_is_held_not_max_tokens() -> None:
    """An agent's request asks for up to 32k tokens; admitting by that worst case would run its
    sessions one at a time. The budget counts the positions held: prompt and output so far."""
    s = Scheduler(CharTok(), {0}, 8, 1000, max_model_len=40000, kv_token_budget=100)
    for rid in "abcd":
        s.add(req(rid, n_prompt=20, max_tokens=32000))
    assert s.schedule() is not None and set(s.running) == set("abcd")


def test_without_a_budget_every_request_runs_at_once() -> None:
    s = Scheduler(CharTok(), {0}, 8, 1000, max_model_len=64)
    for rid in "abcd":
        s.add(req(rid, n_prompt=20, max_tokens=20))
    running, _ = run(s)
    assert running[0] == set("abcd")


def test_a_request_longer_than_the_budget_runs_alone_and_blocks_those_behind() -> None:
    s = Scheduler(CharTok(), {0}, 8, 1000, max_model_len=500, kv_token_budget=100)
    s.add(req("big", n_prompt=150, max_tokens=10))  # 160 > 100: still admitted, alone
    s.add(req("small", n_prompt=5, max_tokens=5))  # fits beside nothing larger than 90
    running, finished = run(s)
    assert running[0] == {"big"} and "small" not in set().union(*running[:9])
    assert finished == {"big": "length", "small": "length"}


def _fp(context: int, per_token: int = 16384) -> Footprint:
    return Footprint(
        dtype=torch.bfloat16,
        dense_bytes=1 << 20,
        slot_bytes=1 << 20,
        expert_disk_bytes=1 << 20,
        moe_layers=8,
        experts_per_layer=16,
        top_k=2,
        kv_bytes_per_token=per_token,
        sliding_kv_bytes_per_token=0,
        sliding_window=0,
        context=context,
        hidden=512,
        intermediate=512,
        vocab=1000,
        checkpoint_bytes=1 << 28,
    )


def test_the_budget_is_the_reservation_in_tokens() -> None:
    fp, cfg = _fp(context=32768), EngineConfig()
    for kv in (KvRequest(), KvRequest(max_model_len=4096, max_running=6), KvRequest(1 << 20, 2)):
        nbytes, _ = kv_reservation(fp, cfg, kv)
        assert kv_token_budget(fp, cfg, kv) * fp.kv_bytes_per_token == nbytes
    assert kv_token_budget(fp, cfg, KvRequest()) == 4 * 8192  # open flags: 4 x min(context, 8192)
    assert kv_token_budget(fp, cfg, KvRequest(1 << 20, 2)) == 2 * 32768  # capped at the context
    assert kv_token_budget(fp, EngineConfig(kv_tokens=5000), KvRequest()) == 5000


def test_a_32k_model_takes_a_20k_request_by_default(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "qwen3_moe", "max_position_embeddings": 32768})
    )
    length = max_model_len_of(tmp_path, None)  # serve's default context: the model's own
    assert length == 32768
    budget = kv_token_budget(_fp(context=32768), EngineConfig(), KvRequest())
    s = Scheduler(CharTok(), {0}, 64, 4096, max_model_len=length, kv_token_budget=budget)
    s.add(req("agent", n_prompt=20000, max_tokens=1000))
    s.add(req("chat", n_prompt=100, max_tokens=100))
    running, finished = run(s, max_steps=5000)
    assert finished == {"agent": "length", "chat": "length"}  # none refused, none errored
    assert {"agent", "chat"} in running  # 21,200 positions fit in 32,768: they ran together


def test_a_tiny_model_under_a_small_budget_gives_every_request_its_own_tokens(tiny_ckpt) -> None:
    """Eight requests against KV for about two: each completes with the tokens it gets alone."""
    om = load_model(tiny_ckpt("qwen3_moe"), EngineConfig(device="cpu", kv_tokens=60))
    assert om.kv_token_budget == 60
    prompts = [[(7 * i + j) % 200 + 3 for j in range(25)] for i in range(8)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)

    def generate(ps: list[list[int]], limits: CoreLimits) -> tuple[list[list[int]], int]:
        core = EngineCore.for_model(om, limits)
        reqs = [request(p, dataclasses.replace(params)) for p in ps]
        for r in reqs:
            core.add(r)
        out: dict[str, list[int]] = {r.request_id: [] for r in reqs}
        most = 0
        while core.has_work():
            for o in core.step():
                assert o.error is None
                out[o.request_id] += o.token_ids
            most = max(most, len(core.scheduler.running))
        return [out[r.request_id] for r in reqs], most

    limits = CoreLimits(max_running=8, prefill_token_budget=256, max_model_len=128)
    together, most = generate(prompts, limits)
    alone = [generate([p], limits)[0][0] for p in prompts]
    om.close()
    assert most == 2  # 25 prompt positions each: two fit in 60, three do not
    assert together == alone and all(len(t) == 12 for t in together)
