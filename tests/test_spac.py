"""MoE-SpAc: the speculative utility estimator, the CPU/GPU workload balancer, utility prefetch
and eviction, and CPU-run experts, which must all leave exact configurations exact."""

from __future__ import annotations

import random

import pytest
import torch
from engine_helpers import settle
from tiny_models import ARCHS

from engine.config import EngineConfig
from engine.core.completion import complete
from engine.core.engine_core import CoreLimits, EngineCore
from engine.speculative.config import SpecConfig
from engine.speculative.factory import make_speculation
from engine.worker.loader import load_model
from engine.worker.sampling import SamplingParams
from policies.balancer import LayerCosts, choose_tau, makespan
from policies.utility import SpeculativeUtilityEstimator, UtilityEviction

E = 8


def _window(hot: dict[int, int], rows: int | None = None) -> dict[int, tuple[list[int], list[int]]]:
    """Layer 0's counts: expert -> count, all rows accepted."""
    counts = [hot.get(e, 0) for e in range(E)]
    return {0: (counts, counts)}


# -- the estimator ---------------------------------------------------------------------------


def _calibrated() -> SpeculativeUtilityEstimator:
    est = SpeculativeUtilityEstimator(E)
    # Typical windows: counts 1..4 over the experts, so boundaries settle around 2 and 3.
    for _ in range(30):
        est.observe(_window({0: 1, 1: 2, 2: 3, 3: 4, 4: 2}))
    return est


def test_a_one_window_spike_does_not_move_a_level() -> None:
    est = _calibrated()
    assert est.level(0, 7) == 0
    est.observe(_window({0: 1, 1: 2, 2: 3, 3: 4, 4: 2, 7: 4}))  # expert 7 spikes once
    assert est.level(0, 7) == 0
    est.observe(_window({0: 1, 1: 2, 2: 3, 3: 4, 4: 2}))
    assert est.level(0, 7) == 0
    hot_before = est.level(0, 3)
    est.observe(_window({0: 1, 1: 2, 2: 3, 4: 2}))  # a hot expert missing from one window
    assert est.level(0, 3) == hot_before > 0


def test_sustained_change_moves_levels_up_and_down() -> None:
    est = _calibrated()
    for _ in range(2):
        est.observe(_window({0: 1, 1: 2, 2: 3, 3: 4, 4: 2, 7: 4}))
    assert est.level(0, 7) == est.levels - 1  # two windows at the top count: hot
    assert est.ranked(0)[0] in (3, 7)
    for _ in range(2):
        est.observe(_window({0: 1, 1: 2, 2: 3, 4: 2}))
    assert est.level(0, 3) == 0 and est.level(0, 7) == 0  # two windows without them: cold


def test_a_rise_moves_only_to_the_most_conservative_target_of_the_run() -> None:
    est = _calibrated()
    lo = est.target(1)
    est.observe(_window({0: 1, 1: 2, 2: 3, 3: 4, 4: 2, 7: 4}))
    est.observe(_window({0: 1, 1: 2, 2: 3, 3: 4, 4: 2, 7: 1}))
    assert est.level(0, 7) == lo < est.target(4)


def test_boundaries_recalibrate_to_the_workload() -> None:
    est = _calibrated()
    before = list(est.boundaries)
    assert est.target(4) == est.levels - 1
    for _ in range(60):  # 8 concurrent requests: every count is 8x larger
        est.observe(_window({0: 8, 1: 16, 2: 24, 3: 32, 4: 16}))
    assert all(a > 2 * b for a, b in zip(est.boundaries, before))
    assert est.target(4) == 1  # what was hot for one request is merely warm now


def test_rejected_rows_count_less_than_accepted_ones() -> None:
    est = _calibrated()
    est.observe({0: ([0] * 7 + [4], [0] * 8)})  # 4 activations, all on rejected rows
    est.observe({0: ([0] * 7 + [4], [0] * 8)})
    accepted = _calibrated()
    accepted.observe(_window({7: 4}))
    accepted.observe(_window({7: 4}))
    assert est.level(0, 7) < accepted.level(0, 7)


def test_utility_eviction_takes_the_coldest_then_the_farthest_reuse() -> None:
    est = _calibrated()
    ev = UtilityEviction(est)
    ev.bind([0], est.num_experts)
    ev.on_layer(0)
    for key in (3, 0, 5, 6):  # layer 0: 3 is hot, 0 is warm, 5 and 6 are cold
        ev.on_insert(key)
    ev.on_layer(0)
    ev.on_access(5)  # 5 is used again in the next forward, 6 is not
    assert ev.victim([3, 0, 5, 6]) == 6  # the cold ones first; of them, the one used less regularly
    assert ev.victim([3, 0, 5]) == 5  # a cold expert goes before a warm one, however regular
    assert ev.victim([3, 0]) == 0


def test_utility_eviction_sees_levels_change_between_windows() -> None:
    est = _calibrated()
    ev = UtilityEviction(est)
    ev.bind([0], est.num_experts)
    ev.on_layer(0)
    for key in (3, 0):
        ev.on_insert(key)
    assert ev.victim([3, 0]) == 0  # 3 is hot (and the hot set is now cached for this window)
    for _ in range(10):  # expert 3 stops being used: its level falls to 0, below warm 0's
        est.observe(_window({0: 1, 1: 2, 2: 3, 4: 2}))
    assert est.level(0, 3) == 0 < est.level(0, 0)
    assert ev.victim([3, 0]) == 3


# -- the balancer ---------------------------------------------------------------------------


def _random_costs(rng: random.Random) -> LayerCosts:
    return LayerCosts(
        resident_seconds=rng.uniform(0, 2e-3),
        copy_seconds=rng.uniform(1e-5, 5e-3),
        fast=(rng.uniform(1e-6, 1e-4), rng.uniform(0, 2e-5)),
        cpu=(rng.uniform(1e-5, 2e-3), rng.uniform(0, 2e-4)),
        transfer_workers=rng.randint(1, 4),
        cpu_workers=rng.randint(1, 4),
    )


def test_balancer_tau_is_the_brute_force_optimum() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        costs = _random_costs(rng)
        rows = sorted((rng.randint(1, 40) for _ in range(rng.randint(0, 12))), reverse=True)
        capacity, tau_min = rng.randint(0, 14), rng.randint(0, 3)
        tau_min = min(tau_min, len(rows))
        tau = choose_tau(rows, costs, capacity, tau_min)
        feasible = list(range(tau_min, max(tau_min, min(len(rows), capacity)) + 1))
        # Brute force: every cut evaluated from scratch with the direct formula.
        best = min(makespan(t, rows, costs) for t in feasible)
        assert tau in feasible
        assert makespan(tau, rows, costs) == pytest.approx(best, rel=1e-9, abs=1e-15)


def test_balancer_extremes() -> None:
    rows = [8, 4, 2, 1]
    slow_cpu = LayerCosts(0.0, 1e-4, (1e-5, 0.0), (1.0, 0.0))
    assert choose_tau(rows, slow_cpu, capacity=10) == 4  # the CPU is hopeless: copy everything
    assert choose_tau(rows, slow_cpu, capacity=2) == 2  # ... as far as the free slots allow
    slow_link = LayerCosts(0.0, 1.0, (1e-5, 0.0), (1e-4, 0.0))
    assert choose_tau(rows, slow_link, capacity=10) == 0  # the link is hopeless: all on the CPU
    assert (
        choose_tau(rows, slow_link, capacity=10, tau_min=1) == 1
    )  # an expert already on its way stays
    even = LayerCosts(0.0, 1e-3, (0.0, 0.0), (1e-3, 0.0), transfer_workers=1, cpu_workers=1)
    assert choose_tau(rows, even, capacity=10) == 2  # equal costs: split the work in half


# -- exactness in the engine ----------------------------------------------------------------

SPAC_CONFIGS = {
    "utility prefetch + eviction": dict(prefetch="utility", eviction="utility"),
    "+ cpu experts": dict(prefetch="utility", eviction="utility", cpu_experts="auto"),
    "every miss on the cpu": dict(cpu_experts="all"),
}


def _prompts(vocab: int, n: int = 8) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (4 + 3 * i,), generator=g).tolist() for i in range(n)]


def _run(om, prompts: list[list[int]], spec: SpecConfig, max_tokens: int) -> list[list[int]]:
    proposer, observers = make_speculation(spec.resolve(om.model_dir), om)
    core = EngineCore.for_model(
        om,
        CoreLimits(max_running=len(prompts), prefill_token_budget=256, max_model_len=2048),
        proposer,
        observers,
    )
    outs = complete(
        core,
        [
            core.local_request(
                p, SamplingParams(max_tokens=max_tokens + 2 * (i % 3), ignore_eos=True)
            )
            for i, p in enumerate(prompts)
        ],
    )
    assert all(o.error is None for o in outs), [o.error for o in outs if o.error]
    settle(om)
    assert om.store.pinned_count() == 0  # only in-flight loads pin a slot once requests are done
    return [o.token_ids for o in outs]


def _check_exact(
    model_dir,
    prompts_of,
    spec: SpecConfig,
    max_tokens: int,
    configs: dict[str, dict] = SPAC_CONFIGS,
) -> None:
    base = load_model(model_dir, EngineConfig(cache_fraction=0.25, offload="disk", dtype="float32"))
    try:
        prompts = prompts_of(base)
        reference = _run(base, prompts, SpecConfig(speculative="off"), max_tokens)
    finally:
        base.close()
    for name, kw in configs.items():
        om = load_model(
            model_dir, EngineConfig(cache_fraction=0.25, offload="disk", dtype="float32", **kw)
        )
        try:
            assert _run(om, prompts, spec, max_tokens) == reference, name
            s = om.stats.snapshot()
            if "adapter" in kw.get("prefetch", ""):
                assert s["prefetch_used"] > 0, name
            if kw.get("cpu_experts") == "all":
                assert s["cpu_expert_calls"] > 0 and s["transfers"]["demand"] == 0, name
            if "utility" in kw.get("prefetch", ""):
                assert (
                    s["utility_levels"]
                    and sum(s["utility_levels"]) == len(om.moe_layers) * om.num_experts
                )
        finally:
            om.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_spac_configurations_are_exact_on_every_architecture(tiny_ckpt, arch: str) -> None:
    _check_exact(
        tiny_ckpt(arch),
        lambda om: _prompts(om.config.vocab_size),
        SpecConfig(speculative="ngram", adaptive=False),
        12,
    )


@pytest.mark.timeout(600)
def test_spac_configurations_are_exact_on_the_embedded_pair() -> None:
    from models import EMBEDDED_TARGET

    def prompts_of(om) -> list[list[int]]:
        ids = om.tokenizer(
            (EMBEDDED_TARGET.parent / "data" / "test.txt").read_text(encoding="utf-8")[:40000]
        )["input_ids"]
        return [ids[i * 900 : i * 900 + 16 + 4 * i] for i in range(8)]

    # With the embedded model's own SpecPrefetch adapter too (issue 11: prefetching never changes the output).
    configs = {
        **SPAC_CONFIGS,
        "adapter + utility prefetch": dict(prefetch="adapter,utility", eviction="utility"),
    }
    _check_exact(
        EMBEDDED_TARGET, prompts_of, SpecConfig(speculative="draft", adaptive=False), 16, configs
    )
    _check_exact(
        EMBEDDED_TARGET,
        prompts_of,
        SpecConfig(speculative="off"),
        16,
        {"adapter prefetch": dict(prefetch="adapter")},
    )


def test_utility_prefetch_counts_wasted_predictions(tiny_ckpt) -> None:
    """A prediction that nothing uses is counted as wasted once its protection expires."""
    om = load_model(
        tiny_ckpt("qwen3_moe"),
        EngineConfig(cache_fraction=0.5, prefetch="utility", eviction="utility", warm_start=False),
    )
    try:
        est, layer = om.utility.estimator, om.moe_layers[0]
        # Two windows in which experts 0 and 1 are hot: the estimator predicts them.
        for _ in range(3):
            est.observe(
                {
                    la: (
                        [4, 4] + [1] * 6 + [0] * (om.num_experts - 8),
                        [4, 4] + [1] * 6 + [0] * (om.num_experts - 8),
                    )
                    for la in om.moe_layers
                }
            )
        assert est.level(layer, 0) >= 2
        om.utility.top_up(layer)  # may stop early: prefetches go only to idle transfer workers
        issued = om.stats.snapshot()["prefetch_issued"]
        assert issued >= 2
        settle(om)
        for _ in range(om.store.protect_ticks):
            om.store.tick()  # no layer ever used them
        s = om.stats.snapshot()
        assert s["prefetch_wasted"] == issued and s["prefetch_used"] == 0
    finally:
        om.close()


def test_utility_prefetch_waits_for_an_idle_transfer_worker(tiny_ckpt) -> None:
    """On a busy link a guess would delay the next demand load: while every transfer worker is
    busy, no further prefetch is queued, and topping up resumes once one is idle."""
    import threading

    om = load_model(
        tiny_ckpt("qwen3_moe"),
        EngineConfig(cache_fraction=0.5, prefetch="utility", eviction="utility", warm_start=False),
    )
    gate = threading.Event()
    fetch = om.transfers.tier._fetch

    def slow(layer: int, e: int, into=None):
        gate.wait(10)
        return fetch(layer, e, into)

    om.transfers.tier._fetch = slow  # type: ignore[method-assign]
    try:
        est, layer = om.utility.estimator, om.moe_layers[0]
        for _ in range(3):
            est.observe(
                {
                    la: ([4] * 6 + [0] * (om.num_experts - 6), [4] * 6 + [0] * (om.num_experts - 6))
                    for la in om.moe_layers
                }
            )
        assert len(est.ranked(layer)) == 6
        assert om.utility.top_up(layer) is False
        assert (
            om.stats.snapshot()["prefetch_issued"]
            == om.utility.max_pending
            == om.transfers.workers
            == om.transfers.pending()
        )
        gate.set()
        settle(om)
        om.utility.top_up(layer)
        assert om.stats.snapshot()["prefetch_issued"] > om.transfers.workers
    finally:
        gate.set()
        om.close()


def test_cpu_expert_failure_fails_only_that_request_and_frees_slots(tiny_ckpt) -> None:
    om = load_model(
        tiny_ckpt("qwen3_moe"),
        EngineConfig(cache_fraction=0.25, offload="disk", cpu_experts="all", warm_start=False),
    )
    try:
        fetch = om.transfers.tier._fetch

        def flaky(layer: int, e: int, into=None):
            if e == 1:
                raise OSError(5, "injected read error")
            return fetch(layer, e, into)

        om.transfers.tier._fetch = flaky  # type: ignore[method-assign]
        core = EngineCore.for_model(om, CoreLimits(max_running=4, max_model_len=256))
        outs = complete(
            core,
            [
                core.local_request(p, SamplingParams(max_tokens=4, ignore_eos=True))
                for p in _prompts(om.config.vocab_size, 4)
            ],
        )
        assert any(o.error and "expert 1" in o.error for o in outs)
        assert om.store.pinned_count() == 0
        om.transfers.tier._fetch = fetch  # type: ignore[method-assign]
        ok = complete(
            core, [core.local_request([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))]
        )
        assert ok[0].error is None and len(ok[0].token_ids) == 4
    finally:
        om.close()


def test_stale_utility_prefetches_are_cancelled(tiny_ckpt) -> None:
    """Prefetches still queued when their expert's utility falls are cancelled, not loaded."""
    om = load_model(
        tiny_ckpt("qwen3_moe"),
        EngineConfig(
            cache_fraction=0.5,
            offload="disk",
            link="1:300000",
            prefetch="utility",
            eviction="utility",
            warm_start=False,
        ),
    )
    try:
        est, layer, E = om.utility.estimator, om.moe_layers[0], om.num_experts
        om.utility.max_pending = 64  # a deep queue (the default queues only into idle workers)
        hot = [4] * 6 + [1] * 2 + [0] * (E - 8)
        for _ in range(3):
            est.observe({la: (hot, hot) for la in om.moe_layers})
        assert om.utility.top_up(layer)
        queued = om.transfers.queued("prefetch")
        assert queued, "the slow link keeps most prefetches queued"
        cold = [0] * 8 + [1] * 2 + [0] * (E - 10)  # experts 0-7 are not used any more
        for _ in range(est.patience):
            est.observe({la: (cold, cold) for la in om.moe_layers})
        om.utility.cancel_stale()
        assert om.transfers.queued("prefetch") == []
        assert om.stats.snapshot()["transfers_cancelled"] >= len(queued)
    finally:
        om.close()


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_cpu_run_quantized_experts_equal_the_copied_path(tiny_ckpt, tmp_path, quant: str) -> None:
    """The CPU path reads the host tier's encoded bytes and dequantizes as a slot would."""
    outs = {}
    for mode in ("off", "all"):
        om = load_model(
            tiny_ckpt("qwen2_moe"),
            EngineConfig(
                cache_fraction=0.25,
                offload="ram",
                expert_quant=quant,
                cpu_experts=mode,
                quant_cache_dir=str(tmp_path),
            ),
        )
        try:
            outs[mode] = _run(
                om, _prompts(om.config.vocab_size, 4), SpecConfig(speculative="off"), 8
            )
            if mode == "all":
                assert om.stats.snapshot()["cpu_expert_calls"] > 0
        finally:
            om.close()
    assert outs["all"] == outs["off"]


def test_cpu_run_experts_take_bf16_rows_on_a_cpu(tiny_ckpt) -> None:
    """A bf16 engine on a CPU with torch's kernels: CPU-run experts compute in the slots' bf16 from bf16 rows
    (they once met fp32 weights with bf16 rows and failed every request: bench/gpu_real.sh --dry-run)."""
    om = load_model(
        tiny_ckpt("qwen3_moe"),
        EngineConfig(
            cache_fraction=0.25, dtype="bfloat16", cpu_experts="all", native_kernels="off"
        ),
    )
    try:
        core = EngineCore.for_model(om, CoreLimits(max_running=1, max_model_len=256))
        (out,) = complete(
            core, [core.local_request(list(range(3, 19)), SamplingParams(max_tokens=6))]
        )
        assert out.error is None and len(out.token_ids) == 6
        assert om.stats.snapshot()["cpu_expert_calls"] > 0
    finally:
        om.close()
