"""The resident lane: a decode step whose every expert is resident for good skips the offload bookkeeping.

It must change nothing observable but time: the same tokens and bit-identical logits as the full
path (MoeExecutor.run's plan, pins and scheduling), the same hit counters; and it must only open
where no expert can miss (store.complete)."""

from __future__ import annotations

import random

import pytest
import torch

from engine.config import EngineConfig
from engine.core.completion import generate
from engine.experts.moe_executor import MoeExecutor
from engine.worker.kv_cache import new_kv_cache
from engine.worker.loader import load_model
from engine.worker.runner import ModelRunner, prompt_logits
from engine.worker.sampling import SamplingParams
from policies.registry import POLICY_NAMES, SUBSTITUTES, make_miss_policy


def _decode(om, monkeypatch, lane: bool) -> tuple[list[int], dict, int]:
    """Greedy tokens of a prompt + 8 tokens (7 decode steps after the prefill), the stats, and how
    many layer runs took the lane."""
    taken = [0]
    real = MoeExecutor._resident_lane

    def counting(self, *a):
        taken[0] += 1
        return real(self, *a)

    monkeypatch.setattr(MoeExecutor, "_resident_lane", counting)
    if not lane:
        monkeypatch.setattr(MoeExecutor, "_lane_open", lambda self: False)
    om.stats.reset()
    out = generate(om, [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True))
    stats = om.stats.snapshot()
    monkeypatch.undo()
    return list(out.token_ids), stats, taken[0]


@pytest.mark.parametrize("native_kernels", [True, False])
def test_the_lane_matches_the_full_path_at_cache_one(
    tiny_ckpt, monkeypatch, native_kernels: bool
) -> None:
    """With the native kernels (one call for the layer's experts) and without (torch's loop, as on a GPU)."""
    om = load_model(
        tiny_ckpt("qwen3_moe"),
        EngineConfig(forward="lean", cache_fraction=1.0, offload="ram", device="cpu"),
    )
    try:
        assert om.store.complete
        if not native_kernels:
            om.executor._native = None
        tokens_lane, stats_lane, taken = _decode(om, monkeypatch, lane=True)
        tokens_full, stats_full, taken_full = _decode(om, monkeypatch, lane=False)
        assert (
            taken == 7 * len(om.moe_layers) and taken_full == 0
        )  # every decode step's layers; not the prefill
        assert tokens_lane == tokens_full
        for key in ("hits", "misses", "calls_hit", "calls_fetched", "substitutions"):
            assert stats_lane[key] == stats_full[key], key
        assert stats_lane["hits"] > 0 and stats_lane["misses"] == 0
    finally:
        om.close()


def test_the_lane_logits_are_the_full_paths_bit_for_bit(tiny_ckpt, monkeypatch) -> None:
    om = load_model(
        tiny_ckpt("qwen3_moe"),
        EngineConfig(forward="lean", cache_fraction=1.0, offload="ram", device="cpu"),
    )
    try:
        ids = [5, 6, 7, 8, 9]

        def step_logits() -> torch.Tensor:  # one row a step through the runner, as decoding runs
            runner, cache = ModelRunner(om), new_kv_cache(om.config)
            return torch.cat(
                [runner.forward([[t]], [i], [cache], [[0]])[0] for i, t in enumerate(ids)]
            )

        step_logits()  # first calls: the native router and norms check themselves against their modules (and return those)
        lane = step_logits()
        monkeypatch.setattr(MoeExecutor, "_lane_open", lambda self: False)
        full = step_logits()
        assert torch.equal(lane, full)
        assert torch.allclose(
            lane, prompt_logits(om, ids), atol=1e-5, rtol=1e-5
        )  # and the packed prefill agrees
    finally:
        om.close()


@pytest.mark.parametrize(
    "fraction, offload, complete", [(0.5, "ram", False), (1.0, "disk", True), (0.5, "disk", False)]
)
def test_the_store_is_complete_only_when_every_expert_is_resident_for_good(
    tiny_ckpt, fraction, offload, complete
) -> None:
    om = load_model(
        tiny_ckpt("qwen3_moe"),
        EngineConfig(forward="lean", cache_fraction=fraction, offload=offload, device="cpu"),
    )
    try:
        assert om.store.complete is complete
        generate(om, [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
        assert om.store.complete is complete
    finally:
        om.close()


@pytest.mark.parametrize("name", POLICY_NAMES)
@pytest.mark.parametrize("substitute", SUBSTITUTES)
def test_every_miss_policy_keeps_the_routers_choice_when_nothing_misses(name, substitute) -> None:
    """The contract the lane relies on (policies/base.py): a miss policy decides only about misses."""
    policy = make_miss_policy(name, substitute)
    rng = random.Random(0)
    for _ in range(50):
        rows = [rng.sample(range(64), 8) for _ in range(rng.randint(1, 3))]
        weights = [sorted((rng.random() for _ in range(8)), reverse=True) for _ in rows]
        logits = [[rng.gauss(0, 1) for _ in range(64)] for _ in rows]
        plan = policy.plan(0, rows, weights, lambda e: True, logits)
        assert [list(r) for r in plan.experts] == rows and not plan.fetch and not plan.substituted
        assert plan.weights is None or [list(w) for w in plan.weights] == weights
        assert plan.calls_hit == 8 * len(rows) and plan.calls_fetched == 0
