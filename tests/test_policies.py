"""Every policy on hand-built scenarios: pure decisions on ids and numbers, no tensors."""

from __future__ import annotations

import pytest

from policies import DROPPED, make_policies
from policies.admission import BackgroundAdmission
from policies.frequency import FrequencyEviction
from policies.lru import LRUEviction
from policies.miss import FetchAll, FirstChoicePolicy, ThresholdPolicy
from policies.substitute import BestResident, DropRenormalize

E = 8
LOGITS = [[float(-e) for e in range(E)]]  # expert 0 scores best, then 1, 2, ...


def resident(*experts: int):
    s = set(experts)
    return lambda e: e in s


def test_fetch_all_fetches_every_miss() -> None:
    plan = FetchAll().plan(0, [[3, 5], [5, 6]], [[0.6, 0.4], [0.9, 0.1]], resident(5))
    assert plan.fetch == [3, 6] and plan.weights is None
    assert (plan.calls_hit, plan.calls_fetched) == (2, 2)


def test_threshold_always_fetches_the_first_choice() -> None:
    # The first choice is missing and has a tiny gate; every other expert is resident.
    pol = ThresholdPolicy(BestResident(), threshold=0.15)
    plan = pol.plan(0, [[7, 1]], [[0.05, 0.95]], resident(0, 1, 2), LOGITS)
    assert plan.fetch == [7] and plan.substituted == ()


@pytest.mark.parametrize("w, fetched", [(0.15, True), (0.1499, False), (0.3, True), (0.0, False)])
def test_threshold_boundary(w: float, fetched: bool) -> None:
    pol = ThresholdPolicy(BestResident(), threshold=0.15)
    plan = pol.plan(0, [[1, 6]], [[1.0 - w, w]], resident(0, 1), LOGITS)
    assert (plan.fetch == [6]) is fetched
    if not fetched:
        assert plan.experts == [[1, 0]]  # expert 0 is the best-scoring resident not already used
        assert plan.weights == [[1.0 - w, w]]  # it takes over the missed expert's gate weight
        assert list(plan.substituted) == [(6, pytest.approx(w))]


def test_threshold_uses_normalized_gates() -> None:
    # Unnormalized router weights (norm_topk_prob=False): 0.1 of a 0.5 total is 0.2 >= 0.15.
    plan = ThresholdPolicy(DropRenormalize()).plan(0, [[1, 6]], [[0.4, 0.1]], resident(1))
    assert plan.fetch == [6]


def test_first_choice_substitutes_everything_else() -> None:
    pol = FirstChoicePolicy(BestResident())
    plan = pol.plan(0, [[5, 6, 7]], [[0.5, 0.3, 0.2]], resident(0, 1, 2), LOGITS)
    assert plan.fetch == [5]
    assert plan.experts == [[5, 0, 1]]
    assert [e for e, _ in plan.substituted] == [6, 7]
    assert sum(m for _, m in plan.substituted) == pytest.approx(0.5)
    assert (plan.calls_hit, plan.calls_fetched) == (0, 1)


def test_best_resident_skips_experts_already_in_the_row() -> None:
    choice = BestResident()
    ranking = list(range(E))  # expert 0 best, then 1, 2, ...
    assert choice.choose([0, 6], 1, ranking, resident(0, 3)) == 3
    assert choice.choose([0, 6], 1, ranking, resident(0)) is None  # nothing can stand in


def test_drop_renormalizes_the_row() -> None:
    pol = FirstChoicePolicy(DropRenormalize())
    plan = pol.plan(0, [[1, 2, 3]], [[0.5, 0.3, 0.2]], resident(1, 2))
    assert plan.experts == [[1, 2, DROPPED]]
    assert plan.weights[0][0] == pytest.approx(0.625) and plan.weights[0][1] == pytest.approx(0.375)
    assert plan.weights[0][2] == 0.0
    assert sum(plan.weights[0]) == pytest.approx(1.0)


def test_rows_are_decided_independently() -> None:
    pol = ThresholdPolicy(BestResident())
    plan = pol.plan(0, [[1, 6], [6, 1]], [[0.9, 0.1], [0.9, 0.1]], resident(0, 1), [LOGITS[0]] * 2)
    assert plan.experts == [
        [1, 0],
        [6, 1],
    ]  # row 0 substitutes its minor miss; row 1 fetches its first choice
    assert plan.fetch == [6]


def test_admission_fires_exactly_when_mass_crosses_beta() -> None:
    adm = BackgroundAdmission(beta=0.5)
    assert adm.observe(0, [(3, 0.2)]) == []
    assert adm.observe(0, [(3, 0.2), (4, 0.49)]) == []
    assert adm.observe(1, [(3, 0.45)]) == []  # other layer, separate account
    assert adm.observe(0, [(3, 0.1)]) == [3]  # 0.2 + 0.2 + 0.1 = 0.5 >= beta
    assert adm.observe(0, [(3, 0.2)]) == []  # starts over after admission
    assert adm.observe(0, [(4, 0.01)]) == [4]


def test_frequency_eviction_keeps_hot_experts() -> None:
    ev = FrequencyEviction(decay=0.99)
    for k in ("hot", "warm", "cold"):
        ev.on_insert(k)
    for _ in range(10):
        ev.on_access("hot")
    ev.on_access("warm")
    assert ev.victim(["hot", "warm", "cold"]) == "cold"
    assert ev.victim(["hot", "warm"]) == "warm"
    # Decay: after a long burst on "new", the old hot expert cools below it.
    ev.on_insert("new")
    for _ in range(400):
        ev.on_access("new")
    assert ev.score("hot") < 1.0 < ev.score("new")
    assert ev.victim(["hot", "new"]) == "hot"


def test_lru_differs_from_frequency() -> None:
    lru, freq = LRUEviction(), FrequencyEviction(decay=1.0)
    for ev in (lru, freq):
        ev.on_insert("a")
        for _ in range(5):
            ev.on_access("a")
        ev.on_insert("b")
    assert lru.victim(["a", "b"]) == "a"  # least recently used
    assert freq.victim(["a", "b"]) == "b"  # least frequently used


def test_presets() -> None:
    q = make_policies("quality-first")
    assert isinstance(q.miss, ThresholdPolicy) and q.miss.threshold == 0.15
    assert isinstance(q.eviction, FrequencyEviction) and q.admission.beta == 0.5
    s = make_policies("speed-first")
    assert isinstance(s.miss, FirstChoicePolicy) and isinstance(s.eviction, FrequencyEviction)
    assert s.admission.beta == 0.5
    plain = make_policies("threshold", eviction="lru")
    assert isinstance(plain.eviction, LRUEviction) and plain.admission.name == "none"
    with pytest.raises(ValueError, match="unknown miss policy"):
        make_policies("fastest")


def test_unprotected_threshold_substitutes_light_first_choices() -> None:
    pol = make_policies("threshold-noprotect").miss
    plan = pol.plan(0, [[6, 1]], [[0.1, 0.9]], resident(0, 1), LOGITS)
    assert plan.fetch == [] and plan.experts == [[0, 1]]


def test_stand_ins_are_ranked_as_a_bias_router_ranks(tiny_ckpt) -> None:
    """For a DeepSeek-V3-style router (glm4_moe: top-k of sigmoid(logits) + a balancing bias), the
    policy ranks stand-ins by those selection scores, not by the raw logits: the resident expert the
    router would have picked next. A bias that reverses the logits' order must reach the policy."""
    import torch

    from engine.config import EngineConfig
    from engine.core.completion import generate
    from engine.worker.loader import load_model
    from engine.worker.sampling import SamplingParams

    om = load_model(
        tiny_ckpt("glm4_moe"), EngineConfig(cache_fraction=0.25, policy="quality-first")
    )
    try:
        block = om.model.get_submodule(f"model.layers.{om.moe_layers[0]}.mlp")
        bias = block.adapter.selection_bias(block)
        assert bias is not None
        bias.copy_(
            torch.linspace(2.0, -2.0, bias.numel())
        )  # a bias far larger than sigmoid's range of 1
        seen: list[tuple[torch.Tensor, torch.Tensor]] = []
        run = block.executor.run
        block.executor.run = lambda layer, x, ids, w, scores: (
            seen.append((layer, scores.clone())) or run(layer, x, ids, w, scores)
        )
        logits_seen: list[torch.Tensor] = []
        block.bus.subscribe(
            lambda ev: logits_seen.append(ev.logits.clone()) if ev.layer == block.layer else None
        )
        generate(om, list(range(3, 11)), SamplingParams(max_tokens=2, ignore_eos=True))
        scores = [s for layer, s in seen if layer == block.layer]
        assert scores and len(scores) == len(logits_seen)
        for got, logits in zip(scores, logits_seen):
            torch.testing.assert_close(got, torch.sigmoid(logits.float()) + bias)
    finally:
        om.close()
