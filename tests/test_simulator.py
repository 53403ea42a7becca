"""The router-trace simulator drives the engine's own policies over a recorded trace; its hardware
profiles cite a source for every number; projections have the target model's shape."""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import yaml

from engine.config import EngineConfig
from engine.offline.belady import flatten, min_loads
from engine.offline.hardware import (
    SHAPES,
    ModelShape,
    ProfileError,
    check_sources,
    costs_for,
    list_profiles,
    load_profile,
)
from engine.offline.projection import project_trace
from engine.offline.simulator import (
    Acceptance,
    OraclePredictor,
    SimSettings,
    Simulator,
    manual_costs,
    simulate,
)
from policies.utility import UtilityEviction


def synthetic_trace(
    N: int = 200, L: int = 2, E: int = 16, k: int = 4, seed: int = 0, topics: int = 2
) -> dict:
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(N, L, E)).astype(np.float32)
    block = N // topics
    for i in range(topics):  # each topic prefers its own 4 experts: sticky, skewed routing
        logits[i * block : (i + 1) * block, :, (4 * i) % E : (4 * i) % E + 4] += 3.0
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    ids = np.argsort(-probs, axis=-1)[..., :k]
    w = np.take_along_axis(probs, ids, -1)
    return {
        "ids": ids,
        "weights": w / w.sum(-1, keepdims=True),
        "logits": logits,
        "meta": {"num_experts": E, "top_k": k, "expert_nbytes": 1_000_000},
    }


HW = manual_costs(100.0, 100.0, expert_bytes=1_000_000, layer_compute_s=1e-3, expert_compute_s=1e-4)


def run(
    policy: str,
    fraction: float = 0.25,
    trace: dict | None = None,
    costs=HW,
    settings: dict | None = None,
    **kw,
) -> dict:
    return simulate(
        trace or synthetic_trace(),
        EngineConfig(policy=policy, **kw).policies(),
        fraction,
        costs,
        **(settings or {}),
    ).to_dict()


# -- the classic replay ------------------------------------------------------------------------
def test_all_resident_has_no_stall() -> None:
    r = run("fetch-all", fraction=1.0)
    assert (
        r["simulated"] and r["stall_s"] == 0.0 and r["hit_share"] == 1.0 and r["demand_loads"] == 0
    )


def test_fetch_all_accounts_every_call_and_stalls() -> None:
    r = run("fetch-all")
    assert r["calls"] == 200 * 2 * 4 == r["calls_hit"] + r["calls_fetched"]
    assert r["calls_substituted"] == 0 and r["stall_s"] > 0
    # One row per step: every fetched call is one demand load, and each costs ~10 ms on a
    # 100 MB/s link; two workers overlap only the 0.1 ms latency, so stall ≈ loads x 10 ms.
    assert r["demand_loads"] == r["calls_fetched"]
    assert r["stall_s"] == pytest.approx(r["demand_loads"] * HW.copy_seconds(), rel=0.25)


def lru_reference_loads(trace: dict, n_slots: int) -> int:
    """An independent model of the engine's fast tier under fetch-all + LRU, one token per step:
    warm start round-robin across layers, hits touched in id order, misses loaded in id order, the least
    recently used expert not used by the current layer evicted."""
    ids = trace["ids"]
    N, L, _ = ids.shape
    E = trace["meta"]["num_experts"]
    order: OrderedDict[int, None] = OrderedDict()
    for e in range(-(-n_slots // L)):
        for layer in range(L):
            if len(order) < n_slots:
                order[layer * E + e] = None
    loads = 0
    for t in range(N):
        for layer in range(L):
            need = {layer * E + int(e) for e in ids[t, layer]}
            for key in sorted(need & order.keys()):
                order.move_to_end(key)
            for key in sorted(need - order.keys()):
                if len(order) >= n_slots:
                    victim = next(k for k in order if k not in need)
                    del order[victim]
                order[key] = None
                loads += 1
    return loads


@pytest.mark.parametrize("fraction", [0.25, 0.5])
def test_fetch_all_replay_counts_exactly_the_loads_of_an_lru_store(fraction: float) -> None:
    tr = synthetic_trace(N=300, L=3, E=16, k=4, seed=3)
    r = run("fetch-all", fraction=fraction, trace=tr, eviction="lru")
    assert r["demand_loads"] == lru_reference_loads(tr, round(fraction * 3 * 16))


def test_reuse_eviction_replay_lies_between_belady_and_lru() -> None:
    tr = synthetic_trace(N=300, L=3, E=16, k=4, seed=3)
    n_slots = round(0.25 * 3 * 16)
    accesses = [
        [layer * 16 + int(e) for e in tr["ids"][t, layer]] for t in range(300) for layer in range(3)
    ]
    bound = min_loads(flatten(accesses), n_slots)
    ours = run("fetch-all", trace=tr, eviction="reuse")["demand_loads"]
    assert bound <= ours <= lru_reference_loads(tr, n_slots)


def test_substitution_trades_fetches_for_mass() -> None:
    fa, thr, fc = run("fetch-all"), run("threshold"), run("first-choice")
    assert fc["fetched_per_token"] < thr["fetched_per_token"] < fa["fetched_per_token"]
    assert fc["tokens_per_s"] > thr["tokens_per_s"] > fa["tokens_per_s"]
    assert 0 < thr["mean_substituted_mass"] < fc["mean_substituted_mass"]


def test_admission_loads_substituted_experts_in_the_background() -> None:
    plain, adm = (
        run("first-choice", eviction="frequency"),
        run("first-choice", eviction="frequency", admission="background"),
    )
    assert plain["admissions"] == 0 and adm["admissions"] > 0
    assert adm["evictions"] > plain["evictions"]


def test_frequency_eviction_survives_a_topic_shift() -> None:
    """Dynamic aging: after the shift, the new topic's experts must win slots (not churn)."""
    r = run("first-choice", eviction="frequency")
    assert r["hit_share"] > 0.85 and r["fetched_per_token"] < 0.2


def test_best_resident_needs_logits() -> None:
    tr = synthetic_trace()
    del tr["logits"]
    with pytest.raises(ValueError, match="--logits"):
        simulate(tr, EngineConfig(policy="threshold").policies(), 0.25, HW)
    r = simulate(tr, EngineConfig(policy="threshold", substitute="drop").policies(), 0.25, HW)
    assert r.calls_substituted > 0


# -- speculative windows, utility, CPU-run experts, the predictor hook ----------------------------
def test_speculative_windows_follow_the_acceptance_model() -> None:
    tr = synthetic_trace(N=101)
    costs = manual_costs(100.0, 100.0, 1_000_000, 1e-3, 1e-4)
    costs = type(costs)(**{**vars(costs), "draft_token_s": 2e-3})
    all_in = Simulator(
        tr,
        EngineConfig().policies(),
        costs,
        SimSettings(
            speculative=True, k=4, adaptive=False, acceptance=Acceptance((1.0, 1.0, 1.0, 1.0))
        ),
    ).run()
    assert (
        all_in.tokens == 101 and all_in.steps == 21
    )  # 20 windows of 5 rows, then the last token alone
    assert all_in.to_dict()["tokens_per_verification"] == 5.0
    assert all_in.draft_s == pytest.approx(20 * 4 * 2e-3)
    assert all_in.token_layers == 101 * 2  # every row of every window, in both layers
    none_in = Simulator(
        tr,
        EngineConfig().policies(),
        costs,
        SimSettings(speculative=True, k=4, adaptive=False, acceptance=Acceptance((0.0,))),
    ).run()
    assert none_in.steps == 101 and none_in.to_dict()["tokens_per_verification"] == 1.0
    # Rejected rows are still verified: 97 windows of 5 rows, then 4, 3, 2, 1 rows at the trace's end.
    assert none_in.token_layers == (97 * 5 + 4 + 3 + 2 + 1) * 2


def test_requests_end_together_and_windows_never_cross_them() -> None:
    tr = synthetic_trace(N=100)
    costs = type(HW)(**{**vars(HW), "draft_token_s": 1e-3})
    r = Simulator(
        tr,
        EngineConfig().policies(),
        costs,
        SimSettings(
            speculative=True,
            k=4,
            adaptive=False,
            request_tokens=10,
            acceptance=Acceptance((1.0, 1.0, 1.0, 1.0)),
        ),
    ).run()
    assert r.tokens == 100 and r.steps == 20  # each 10-token request: two full windows of 5


def test_prompts_are_prefilled_in_one_untimed_step() -> None:
    # Two requests of a 20-token prompt and 30 decoded tokens; the first uses experts 0-3 of each
    # layer (resident from the warm start), the second experts 4-7. Its prompt brings those in
    # before its decode starts, and, as the benchmarks' decode clocks start after the prefill,
    # the prompts count in no figure.
    N, L, E, k = 100, 2, 16, 4
    ids = np.zeros((N, L, k), dtype=np.int64)
    ids[:50], ids[50:] = np.arange(4), np.arange(4, 8)
    logits = np.zeros((N, L, E), dtype=np.float32)
    np.put_along_axis(logits, ids, 5.0, axis=-1)
    tr = {
        "ids": ids,
        "weights": np.full((N, L, k), 1 / k),
        "logits": logits,
        "meta": {"num_experts": E, "top_k": k, "expert_nbytes": 1_000_000},
    }
    r = Simulator(
        tr, EngineConfig().policies(), HW, SimSettings(request_tokens=30, prompt_tokens=20)
    ).run()
    assert (
        r.tokens == 60
        and r.steps == 60
        and r.calls == 60 * L * k == r.calls_hit
        and r.demand_loads == 0
        and r.stall_s == 0
    )
    assert r.token_layers == N * L  # the replay's own work includes the prompts' rows
    keep = np.r_[20:50, 70:100]  # the same decode tokens without their prompts
    cold = Simulator(
        {**{key: tr[key][keep] for key in ("ids", "weights", "logits")}, "meta": tr["meta"]},
        EngineConfig().policies(),
        HW,
        SimSettings(request_tokens=30),
    ).run()
    assert cold.tokens == 60 and cold.demand_loads == 4 * L and cold.stall_s > 0


def test_utility_prefetch_and_eviction_use_the_engines_estimator() -> None:
    tr = synthetic_trace(N=400, topics=4)
    pol = EngineConfig(eviction="utility").policies()
    sim = Simulator(
        tr,
        pol,
        HW,
        SimSettings(speculative=True, prefetch="utility", acceptance=Acceptance((0.6, 0.4))),
    )
    r = sim.run().to_dict()
    assert isinstance(pol.eviction, UtilityEviction) and pol.eviction.estimator is sim.utility
    assert sim.utility.windows == r["steps"] and r["prefetch_issued"] > 0 and r["prefetch_used"] > 0
    assert (
        r["prefetch_used"] + r["prefetch_wasted"] + r["prefetch_cancelled"] <= r["prefetch_issued"]
    )


@pytest.mark.parametrize("cpu_cost, expect_cpu", [(1e-6, True), (10.0, False)])
def test_cpu_experts_follow_the_balancer(cpu_cost: float, expect_cpu: bool) -> None:
    costs = type(HW)(**{**vars(HW), "cpu": (cpu_cost, 0.0)})
    r = run("fetch-all", costs=costs, settings={"cpu_experts": "auto"})
    assert (r["cpu_expert_calls"] > 0) == expect_cpu
    if expect_cpu:  # a nearly free CPU takes (almost) every miss: few copies over the link
        assert r["demand_loads"] < 0.2 * r["calls_fetched"]
    else:
        assert r["demand_loads"] == r["calls_fetched"]


def test_cpu_experts_all_sends_every_miss_to_the_cpu() -> None:
    r = run("fetch-all", settings={"cpu_experts": "all"})
    assert r["demand_loads"] == 0 and r["cpu_expert_calls"] == r["calls_fetched"]


class GarbagePredictor:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def predict(self, token: int, layer: int) -> list[int]:
        self.calls.append((token, layer))
        return [15, 14, 13, 12]  # experts the synthetic trace's first topic rarely uses


def test_predictor_hook_prefetches_the_next_layer() -> None:
    tr = synthetic_trace(N=200, L=3)
    base = run("fetch-all", trace=tr)
    oracle = run("fetch-all", trace=tr, settings={"predictor": OraclePredictor(tr)})
    assert oracle["prefetch_used"] > 0 and oracle["prefetch_precision"] > 0.9
    assert (
        oracle["demand_loads"] < base["demand_loads"]
        and oracle["tokens_per_s"] > base["tokens_per_s"]
    )
    garbage = GarbagePredictor()
    bad = run("fetch-all", trace=tr, settings={"predictor": garbage})
    assert {layer for _, layer in garbage.calls} == {0, 1}  # never asked past the last layer
    assert bad["prefetch_wasted"] > bad["prefetch_used"]


# -- hardware profiles --------------------------------------------------------------------------
REQUIRED = {
    "rtx3090-pcie4",
    "rtx4090-pcie4",
    "h200-pcie5",
    "phone-ufs31",
    "this-machine-disk",
    "this-machine-disk-hdd",
}


def test_every_profile_parses_and_every_number_has_a_source() -> None:
    assert REQUIRED <= set(list_profiles())
    for name in list_profiles():
        prof = load_profile(name)
        assert check_sources(prof, name) >= 8
        for shape in SHAPES:
            c = costs_for(name, shape)
            assert (
                c.link_mb_per_s > 0
                and c.copy_seconds() > 0
                and c.g(1) > 0
                and c.h(1) > 0
                and c.d(1) > 0
            )
            assert c.g(8) >= c.g(1) and c.d(8) >= c.d(1)


def test_measured_dense_time_is_interpolated_between_its_points() -> None:
    c = costs_for("this-machine-disk", "embedded")
    raw = yaml.safe_load(
        (
            Path(__file__).resolve().parents[1] / "configs/hardware/this-machine-disk.yaml"
        ).read_text()
    )
    pts = {rows: us * 1e-6 for rows, us in raw["measured"]["embedded"]["dense_us_by_rows"]["value"]}
    assert c.d(1) == pytest.approx(pts[1]) and c.d(16) == pytest.approx(pts[16])
    assert c.d(6) == pytest.approx((pts[4] + pts[8]) / 2)  # halfway between the 4- and 8-row points
    assert c.cpu_is_fast_device and c.cpu_reads_over_link and c.per_load_s > 0


def test_a_number_without_a_source_is_refused(tmp_path: Path) -> None:
    prof = yaml.safe_load((Path("configs/hardware") / "rtx3090-pcie4.yaml").read_text())
    prof["link"]["mb_per_s"] = {"value": 1.0, "source": " "}
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(prof))
    with pytest.raises(ProfileError, match="no source"):
        load_profile(tmp_path / "a.yaml")
    prof["link"]["mb_per_s"] = 1.0
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(prof))
    with pytest.raises(ProfileError, match="bare number"):
        load_profile(tmp_path / "b.yaml")


def test_faster_hardware_is_faster_on_a_projected_shape() -> None:
    pt = project_trace(synthetic_trace(N=24, L=4, E=64, k=8), "qwen3-30b-a3b")
    pol = lambda: EngineConfig().policies()  # noqa: E731
    tps = {
        p: Simulator(pt, pol(), costs_for(p, "qwen3-30b-a3b"), SimSettings())
        .run()
        .to_dict()["tokens_per_s"]
        for p in ("phone-ufs31", "rtx3090-pcie4", "h200-pcie5")
    }
    assert tps["phone-ufs31"] < tps["rtx3090-pcie4"] < tps["h200-pcie5"]


# -- projection ---------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", ["qwen3-30b-a3b", "qwen3-next-80b-a3b"])
def test_projection_has_the_target_shape_and_keeps_the_parents(shape: str) -> None:
    tr = synthetic_trace(N=50, L=4, E=64, k=8)
    sh = SHAPES[shape]
    pt = project_trace(tr, shape)
    assert pt["ids"].shape == (50, sh.layers, sh.top_k) and "logits" not in pt
    assert pt["meta"]["num_experts"] == sh.experts and pt["meta"]["projected"] == shape
    assert pt["ids"].min() >= 0 and pt["ids"].max() < sh.experts
    assert np.allclose(pt["weights"].sum(-1), 1.0, atol=1e-5)
    m = sh.experts // 64
    parents = pt["ids"].astype(np.int64) // m
    for layer in (0, 5, 47):  # projected layer l replays traced layer l mod 4, best logits first
        src = np.argsort(-tr["logits"][:, layer % 4], axis=-1, kind="stable")[:, : sh.top_k]
        assert (parents[:, layer] == src).all()
    assert all(len(set(row)) == sh.top_k for row in pt["ids"][:, 7].tolist())


def test_projection_onto_fewer_experts_merges_groups_by_summed_probability() -> None:
    """gpt-oss-20b's 32 experts from a 64-expert trace: pairs merge, ranked by their summed softmax."""
    tr = synthetic_trace(N=40, L=4, E=64, k=8)
    shape = ModelShape("oss-like", layers=6, experts=32, top_k=4, hidden=64, moe_intermediate=32)
    pt = project_trace(tr, shape)
    assert pt["ids"].shape == (40, 6, 4) and pt["meta"]["num_experts"] == 32
    probs = np.exp(tr["logits"]) / np.exp(tr["logits"]).sum(-1, keepdims=True)
    pair = probs.reshape(40, 4, 32, 2).sum(-1)  # [N, traced layer, merged expert]
    for layer in (0, 5):
        want = np.argsort(-pair[:, layer % 4], axis=-1, kind="stable")[:, :4]
        assert (pt["ids"][:, layer] == want).all()
        chosen = np.take_along_axis(pair[:, layer % 4], want, -1)
        assert np.allclose(
            pt["weights"][:, layer], chosen / chosen.sum(-1, keepdims=True), atol=1e-5
        )
    del tr["logits"]
    with pytest.raises(ValueError, match="merging 64 experts into 32 needs router logits"):
        project_trace(tr, shape)
    odd = ModelShape("odd", layers=2, experts=48, top_k=4, hidden=64, moe_intermediate=32)
    with pytest.raises(ValueError, match="neither divides"):
        project_trace(synthetic_trace(N=4, L=4, E=64, k=8), odd)


def test_projection_to_a_wider_top_k_needs_logits() -> None:
    tr = synthetic_trace(N=10, L=4, E=64, k=8)
    del tr["logits"]
    with pytest.raises(ValueError, match="--logits"):
        project_trace(tr, "qwen3-next-80b-a3b")
    assert project_trace(tr, "qwen3-30b-a3b")["ids"].shape == (10, 48, 8)


# -- the command line ---------------------------------------------------------------------------
def test_simulate_cli_labels_simulated_and_projected(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from cli.main import main

    tr = synthetic_trace(N=40, L=4, E=64, k=8)
    path = tmp_path / "t.npz"
    np.savez(
        path,
        ids=tr["ids"].astype(np.int16),
        weights=tr["weights"].astype(np.float32),
        logits=tr["logits"].astype(np.float16),
        meta=np.asarray(
            json.dumps(
                {"num_experts": 64, "top_k": 8, "moe_layers": [0, 1, 2, 3], "expert_nbytes": 98304}
            )
        ),
    )
    out_json = tmp_path / "o.json"
    assert (
        main(
            [
                "simulate",
                "--trace",
                str(path),
                "--hardware",
                "this-machine-disk",
                "--policy",
                "speed-first",
                "--speculative",
                "draft",
                "--prefetch",
                "utility",
                "--cpu-experts",
                "auto",
                "--out-json",
                str(out_json),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert text.startswith("SIMULATED: profile this-machine-disk") and "speed-first" in text
    assert json.loads(out_json.read_text())["rows"][0]["simulated"] is True
    assert (
        main(
            [
                "simulate",
                "--trace",
                str(path),
                "--hardware",
                "h200-pcie5",
                "--project-to",
                "qwen3-next-80b-a3b",
                "--max-tokens",
                "8",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.startswith(
        "PROJECTED + SIMULATED: profile h200-pcie5, shape qwen3-next-80b-a3b"
    )


# -- against the engine itself ------------------------------------------------------------------
@pytest.mark.timeout(300)
@pytest.mark.parametrize("fraction", [0.25, 0.5])
def test_replay_counts_exactly_the_engines_demand_loads(tiny_ckpt, fraction: float) -> None:
    """Teacher-forced decoding (one token per step) through the engine at fetch-all + LRU, its
    routing recorded from the routing bus as it ran, then replayed by the simulator: the same
    number of demand loads, to the load."""
    from transformers import AutoTokenizer

    from engine.offline.evaluation import teacher_forced_eval
    from engine.worker.loader import load_model

    ckpt = tiny_ckpt("qwen3_moe", "per-expert", num_experts=16, num_experts_per_tok=4)
    text = (
        "To be, or not to be, that is the question. Mixture-of-Experts models route each token to a few experts. "
        * 6
    )
    ids = AutoTokenizer.from_pretrained(ckpt)(text)["input_ids"][:160]
    om = load_model(ckpt, EngineConfig(cache_fraction=fraction))
    routed: dict[int, list[np.ndarray]] = {}
    try:
        while (
            om.transfers.pending()
        ):  # the warm start's loads land first, as the simulator's warm start assumes
            time.sleep(0.01)
        unsubscribe = om.bus.subscribe(
            lambda ev: routed.setdefault(ev.layer, []).append(ev.ids.cpu().numpy())
        )
        teacher_forced_eval(om, ids, window=64, progress=False)
        unsubscribe()
        engine_loads = om.stats.snapshot()["transfers"].get("demand", 0)
        layers, E = om.moe_layers, om.num_experts
    finally:
        om.close()
    trace_ids = np.stack([np.concatenate(routed[layer]) for layer in layers], axis=1)  # [N, L, k]
    assert trace_ids.shape == (157, 2, 4)  # 63 + 63 + 31 predicted tokens, one step each
    tr = {
        "ids": trace_ids,
        "weights": np.full(trace_ids.shape, 0.25, np.float32),
        "meta": {"num_experts": E},
    }
    sim = Simulator(
        tr,
        EngineConfig(cache_fraction=fraction).policies(),
        HW,
        SimSettings(cache_fraction=fraction),
    ).run()
    if fraction == 0.25:
        assert sim.demand_loads == engine_loads > 0
    else:
        # At 0.5 the engine itself varies by a load or two between runs (512-516 of ~514 seen: a
        # timing-dependent eviction in the threaded store, not yet tracked down); the replay is
        # deterministic and sits inside that spread.
        assert engine_loads > 0 and abs(sim.demand_loads - engine_loads) <= 0.01 * engine_loads


def test_projection_ranks_a_biased_sigmoid_router_as_it_routes() -> None:
    """glm4_moe-style traces carry the router's balancing bias: projected choices follow sigmoid + bias."""
    tr = synthetic_trace(N=20, L=4, E=64, k=8)
    bias = np.zeros((4, 64), np.float32)
    bias[:, 50:60] = 5.0  # lifts experts 50..59 above any sigmoid score
    tr["meta"] = {**tr["meta"], "score_bias": bias.tolist()}
    pt = project_trace(tr, "qwen3-next-80b-a3b")
    m = SHAPES["qwen3-next-80b-a3b"].experts // 64
    parents = pt["ids"].astype(np.int64) // m
    assert set(np.unique(parents).tolist()) == set(range(50, 60))
    assert np.allclose(pt["weights"].sum(-1), 1.0, atol=1e-5)
