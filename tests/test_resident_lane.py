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
from engine.experts.compute.moe_executor import MoeExecutor
from engine.worker.kv_cache import new_kv_cache
from engine.worker.loader import load_model
from engine.worker.parity import prompt_logits
from engine.worker.runner import ModelRunner
from engine.worker.sampling import SamplingParams
from policies.registry import POLICY_NAMES, SUBSTITUTES, make_miss_policy


def _decode(path, monkeypatch, lane: bool, native_kernels: str) -> tuple[list[int], dict, int, int]:
    """Greedy tokens of a prompt + 8 tokens (7 decode steps after the prefill), the stats, and how
    many layer runs took the lane and the MoE layers, with the lane on or off (--no-resident-lane)."""
    om = load_model(
        path,
        EngineConfig(
            forward="lean",
            cache_fraction=1.0,
            offload="ram",
            device="cpu",
            native_kernels=native_kernels,
            resident_lane=lane,
        ),
    )
    taken = [0]
    real = MoeExecutor._resident_lane

    def counting(self, *a):
        taken[0] += 1
        return real(self, *a)

    monkeypatch.setattr(MoeExecutor, "_resident_lane", counting)  # counts calls; changes nothing
    try:
        assert om.store.complete and om.executor.capabilities().resident_lane == lane
        assert om.plan.to_dict()["experts"]["chosen"] == ("resident lane" if lane else "planned")
        assert (om.executor.native_moe is not None) == (native_kernels == "auto")
        out = generate(om, [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True))
        return list(out.token_ids), om.stats.snapshot(), taken[0], len(om.moe_layers)
    finally:
        monkeypatch.undo()
        om.close()


@pytest.mark.parametrize("native_kernels", ["auto", "off"])
def test_the_lane_matches_the_full_path_at_cache_one(
    tiny_ckpt, monkeypatch, native_kernels: str
) -> None:
    """With the native kernels (one call for the layer's experts) and without (torch's loop, as on a GPU)."""
    path = tiny_ckpt("qwen3_moe")
    tokens_lane, stats_lane, taken, moe_layers = _decode(path, monkeypatch, True, native_kernels)
    tokens_full, stats_full, taken_full, _ = _decode(path, monkeypatch, False, native_kernels)
    assert (
        taken == 7 * moe_layers and taken_full == 0
    )  # every decode step's layers; not the prefill
    assert tokens_lane == tokens_full
    for key in ("hits", "misses", "calls_hit", "calls_fetched", "substitutions"):
        assert stats_lane[key] == stats_full[key], key
    assert stats_lane["hits"] > 0 and stats_lane["misses"] == 0


def test_the_lane_logits_are_the_full_paths_bit_for_bit(tiny_ckpt) -> None:
    ids = [5, 6, 7, 8, 9]

    def step_logits(om) -> torch.Tensor:  # one row a step through the runner, as decoding runs
        runner, cache = ModelRunner(om), new_kv_cache(om.config)
        return torch.cat([runner.forward([[t]], [i], [cache], [[0]])[0] for i, t in enumerate(ids)])

    logits = {}
    for lane in (True, False):
        om = load_model(
            tiny_ckpt("qwen3_moe"),
            EngineConfig(
                forward="lean", cache_fraction=1.0, offload="ram", device="cpu", resident_lane=lane
            ),
        )
        try:
            step_logits(
                om
            )  # first calls: the native router and norms check themselves against their modules
            logits[lane] = step_logits(om)
            if lane:
                assert torch.allclose(
                    logits[lane], prompt_logits(om, ids), atol=1e-5, rtol=1e-5
                )  # and the packed prefill agrees
        finally:
            om.close()
    assert torch.equal(logits[True], logits[False])


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
