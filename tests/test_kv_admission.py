"""Admission and preemption by the KV pool's blocks (engine/core/scheduler.py, engine/core/kv_blocks.py,
engine/memory/planner.py): a request waits, in order, until its first chunk's blocks are free; a running
request whose next window finds no block takes them from the most recently admitted one, which waits and
recomputes (before: the KV cache grew past the plan until the engine was killed); none errors, and each
request gets the tokens and logprobs it gets alone.
On a real scheduler with a fake runner, on the planner with a fake footprint, and on a tiny model."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from engine_helpers import tokens_and_logprobs

from engine.config import EngineConfig
from engine.core.engine_core import CoreLimits, EngineCore
from engine.core.kv_blocks import KVBlocks
from engine.core.messages import GenerateRequest
from engine.core.scheduler import Scheduler
from engine.core.step_types import SeqResult, StepOutput, StepPlan
from engine.launch import max_model_len_of
from engine.memory.footprint import Footprint
from engine.memory.planner import KvRequest, kv_reservation, kv_token_budget
from engine.worker.loader import load_model
from engine.worker.sampling import SamplingParams


class CharTok:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if i != 0)


def req(rid: str, n_prompt: int, max_tokens: int) -> GenerateRequest:
    """A prompt of its own (no prefix shared with another request's)."""
    first = 1 + 1000 * sum(map(ord, rid))
    return GenerateRequest(
        rid, list(range(first, first + n_prompt)), SamplingParams(max_tokens=max_tokens)
    )


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


def test_requests_over_the_pool_wait_in_order_and_all_finish() -> None:
    s = Scheduler(CharTok(), {0}, 8, 1000, max_model_len=64, blocks=KVBlocks(7, 16))
    for rid in "abcd":
        s.add(
            req(rid, n_prompt=40, max_tokens=20)
        )  # 3 blocks to start, 4 by the end: two start in 7
    running, finished = run(s)
    assert running[0] == {"a", "b"}
    assert max(len(r) for r in running) == 2
    assert finished == {rid: "length" for rid in "abcd"}
    # c starts only after a or b is done (FCFS: it was next in line).
    first = {rid: next(i for i, r in enumerate(running) if rid in r) for rid in "abcd"}
    assert first["a"] == first["b"] < first["c"] <= first["d"]
    # a and b both need a fourth block at position 48: one block is left, so b (admitted last) gave its
    # blocks back and waited, then recomputed its 40 + 8 positions and finished.
    assert s.preemptions >= 1
    assert s.blocks is not None and s.blocks.counts().in_use == 0


def test_admission_counts_what_is_held_not_max_tokens() -> None:
    """An agent's request asks for up to 32k tokens; admitting by that worst case would run its
    sessions one at a time. Admission counts the blocks of the positions held: prompt and output so far."""
    s = Scheduler(
        CharTok(), {0}, 8, 1000, max_model_len=40000, blocks=KVBlocks(11, 16)
    )  # 4 x 2, 3 to grow
    for rid in "abcd":
        s.add(req(rid, n_prompt=20, max_tokens=32000))
    assert s.schedule() is not None and set(s.running) == set("abcd")


def test_without_a_pool_every_request_runs_at_once() -> None:
    s = Scheduler(CharTok(), {0}, 8, 1000, max_model_len=64)
    for rid in "abcd":
        s.add(req(rid, n_prompt=20, max_tokens=20))
    running, _ = run(s)
    assert running[0] == set("abcd")


def test_a_preempted_request_resumes_from_its_cached_blocks() -> None:
    """A preempted request's whole blocks stay cached: resumed, it matches those still there and
    recomputes only the rest, and its decode goes on from its last token."""
    s = Scheduler(CharTok(), {0}, 8, 1000, max_model_len=200, blocks=KVBlocks(7, 16))
    s.add(req("a", n_prompt=40, max_tokens=20))  # 3 blocks, growing to 4
    s.add(req("b", n_prompt=40, max_tokens=20))
    running, finished = run(s)
    assert finished == {"a": "length", "b": "length"}
    assert (
        s.preemptions == 1
    )  # at position 48 both need a fourth block; one is left: b gave its back
    # b's 3 whole blocks (40 prompt + 8 output positions) were cached; a took one more; b found 2 again.
    assert s.blocks is not None and s.blocks.hit_tokens == 32


def test_the_lookahead_takes_blocks_or_shrinks_to_what_is_left() -> None:
    """A decode window asks for blocks for its proposals too; where none is left it gets the proposals its
    blocks cover instead of preempting another request."""
    s = Scheduler(CharTok(), {0}, 8, 1000, max_model_len=200, blocks=KVBlocks(5, 16), lookahead=4)
    s.add(req("a", n_prompt=30, max_tokens=100))
    s.add(req("b", n_prompt=30, max_tokens=100))
    plan = s.schedule()  # 2 + 2 blocks, one spare
    s.update(plan, StepOutput({w.request_id: SeqResult(sampled=[ord("a")]) for w in plan.work}))
    plan = s.schedule()  # decode at position 30: 1 + 4 proposals reach 35, past 32
    # a took the spare block (its window may propose up to what 48 positions hold); b's two blocks
    # cover position 31 only: one proposal.
    assert [(w.request_id, w.max_draft) for w in plan.work] == [("a", 17), ("b", 1)]
    assert s.preemptions == 0


def _fp(context: int, per_token: int = 16384) -> Footprint:
    return Footprint(
        dtype="bfloat16",
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
    s = Scheduler(CharTok(), {0}, 64, 4096, max_model_len=length, blocks=KVBlocks(budget // 16, 16))
    s.add(req("agent", n_prompt=20000, max_tokens=1000))
    s.add(req("chat", n_prompt=100, max_tokens=100))
    running, finished = run(s, max_steps=5000)
    assert finished == {"agent": "length", "chat": "length"}  # none refused, none errored
    assert {"agent", "chat"} in running  # 21,200 positions fit in 32,768: they ran together


def test_preempted_requests_get_the_tokens_and_logprobs_they_get_alone(tiny_ckpt) -> None:
    """Eight requests against a pool for about four: requests are preempted and recompute their
    positions, and each completes with the tokens and logprobs it gets alone, bit for bit."""
    om = load_model(tiny_ckpt("qwen3_moe"), EngineConfig(device="cpu", kv_tokens=60))
    assert om.kv_token_budget == 60
    prompts = [[(7 * i + j) % 200 + 3 for j in range(25)] for i in range(8)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)

    def generate(ps: list[list[int]], limits: CoreLimits) -> tuple[list[list[int]], int]:
        core = EngineCore.for_model(om, limits)
        reqs = [core.local_request(p, dataclasses.replace(params), logprobs=0) for p in ps]
        return tokens_and_logprobs(core, reqs), core.scheduler.preemptions

    # The pool: 60 positions planned, raised to one whole context (128) so a request alone always fits:
    # 8 blocks of 16. Each request starts with 2 blocks and needs a third at position 32.
    limits = CoreLimits(max_running=8, prefill_token_budget=256, max_model_len=128)
    together, preemptions = generate(prompts, limits)
    alone = [generate([p], limits)[0][0] for p in prompts]
    om.close()
    assert preemptions > 0
    assert together == alone and all(len(t) == 12 for t in together)  # tokens and logprobs, bitwise


def test_requests_sharing_a_prefix_in_flight_wait_to_share_it() -> None:
    """Eight sessions with one 64-token system prompt arrive together: the first prefills it, the others
    start once its blocks are computed and take them by reference: the pool holds the prefix once."""
    s = Scheduler(CharTok(), {0}, 8, 32, max_model_len=200, blocks=KVBlocks(40, 16))
    system = list(range(1, 65))
    for i in range(8):
        s.add(GenerateRequest(f"s{i}", system + [100 + i] * 8, SamplingParams(max_tokens=4)))
    running, finished = run(s)
    assert running[0] == {"s0"} and len(finished) == 8
    assert s.blocks is not None and s.blocks.hit_tokens == 7 * 64
