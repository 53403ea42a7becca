"""Seed 004's experiments (bench/seed_004.py): the balancer's fixed-threshold ablation in the
policy, the engine's split and the simulator; the crossover grid's cost scaling; the page rendered
from a simulator-only run on a synthetic trace."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from engine.config import ConfigError, EngineConfig
from engine.experts.compute.cpu_split import CpuSplit
from engine.offline.sim_settings import manual_costs
from engine.offline.simulator import simulate
from engine.worker.loader import load_model
from policies.balancer import fixed_tau
from policies.base import ExpertPlan


def test_fixed_tau_copies_the_hot_misses_whatever_the_costs() -> None:
    # ranked as rank_misses does: in-flight first, then hottest first
    assert fixed_tau([3, 3, 2, 1, 0], threshold=2, capacity=10) == 3
    assert fixed_tau([3, 3, 2, 1, 0], threshold=0, capacity=10) == 5
    assert fixed_tau([3, 3, 2, 1, 0], threshold=2, capacity=2) == 2  # no room for the third
    # two in flight stay on the fast device even when cold, and even without room
    assert fixed_tau([0, 0, 3, 1], threshold=3, capacity=10, tau_min=2) == 3
    assert fixed_tau([0, 0, 3, 1], threshold=3, capacity=0, tau_min=2) == 2


def test_balancer_level_is_checked() -> None:
    assert EngineConfig(balancer_level=2).balancer_level == 2
    with pytest.raises(ConfigError):
        EngineConfig(balancer_level=4)


class _Store:
    def free_or_evictable(self) -> int:
        return 10


class _Transfers:
    workers = 1

    def in_flight(self, layer: int, e: int) -> bool:
        return False


class _Stats:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def record_balancer(self, copied: int, missed: int) -> None:
        self.calls.append((copied, missed))


class _Utility:
    def __init__(self, levels: dict[int, int]) -> None:
        self.levels = levels

    def level(self, layer: int, e: int) -> int:
        return self.levels.get(e, 0)


def test_the_engines_split_follows_a_fixed_level() -> None:
    stats = _Stats()
    split = CpuSplit(_Store(), _Transfers(), stats)  # type: ignore[arg-type]
    split.fixed_level = 2
    plan = ExpertPlan(experts=[[1, 2, 3, 4]], weights=None, fetch=[1, 2, 3, 4])
    levels = _Utility({1: 3, 2: 0, 3: 2, 4: 1})
    on_cpu = split.split(0, plan, [], [1, 2, 3, 4], "auto", None, levels, 2)  # type: ignore[arg-type]
    assert sorted(on_cpu) == [2, 4] and stats.calls == [(2, 4)]  # levels 3 and 2 copied


def _trace(N: int = 240, L: int = 2, E: int = 16, k: int = 4) -> dict:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(N, L, E)).astype(np.float32)
    logits[:, :, :4] += 2.0  # a few hot experts, so utility levels differ
    ids = np.argsort(-logits, axis=-1)[..., :k]
    w = np.take_along_axis(np.exp(logits), ids, -1)
    return {
        "ids": ids,
        "weights": (w / w.sum(-1, keepdims=True)).astype(np.float32),
        "logits": logits,
        "meta": {"num_experts": E, "top_k": k, "expert_nbytes": 100_000},
    }


def test_the_simulator_replays_a_fixed_level() -> None:
    costs = manual_costs(100.0, 1000.0, 100_000, 1e-3, 1e-4)
    pol = EngineConfig(prefetch="utility", eviction="utility", cpu_experts="auto").policies()
    spec = dict(speculative=True, adaptive=False, prefetch="utility", cpu_experts="auto")
    cpu = {
        lv: simulate(_trace(), pol, 0.25, costs, balancer_level=lv, **spec).cpu_expert_calls
        for lv in (0, 3)
    }
    assert cpu[0] < cpu[3]  # level 0 copies every miss it has room for; level 3 only the hottest


def test_scaled_costs_set_the_load_time_and_the_row_cost() -> None:
    from bench.seed004_sim import scaled_costs

    base = manual_costs(150.0, 8000.0, 49_152, 1e-3, 5e-5)
    c = scaled_costs(base, load_ms=2.0, row_share=0.5, draft_scale=0.1)
    assert c.copy_seconds() == pytest.approx(2e-3)
    assert c.d(1) == pytest.approx(base.d(1)) and c.g(1) == pytest.approx(base.g(1))
    assert c.d(5) - c.d(1) == pytest.approx(4 * 0.5 * base.d(1))
    assert c.draft_token_s == pytest.approx(base.draft_token_s * 0.1)
    free = scaled_costs(base, 2.0, 0.0, 1.0)
    assert free.d(5) == pytest.approx(free.d(1))  # rows free: a window costs one row


def test_crossover_compares_the_best_of_each_side() -> None:
    from bench.seed004_sim import crossover

    costs = manual_costs(150.0, 8000.0, 100_000, 1e-3, 1e-4)
    rows = crossover(_trace(), costs, [1.0], [0.0, 1.0], [(0.0, "bench")], 0.25, 96)
    assert [r["row_share"] for r in rows] == [0.0, 1.0]
    for r in rows:
        assert r["ratio"] == pytest.approx(r["best_spec_tok_s"] / r["best_plain_tok_s"])
        assert r["best_plain"] in ("plain", "plain reuse", "plain+cpu")
    # the draft free: speculation wins where a window's rows are free, loses where each costs a row
    assert rows[0]["ratio"] > 1.0 > rows[1]["ratio"]


def _rows(labels: list[str], ratio: float = 1.0) -> list[dict]:
    return [
        {
            "config": lb,
            "tok_s": 10.0,
            "vs_plain": ratio,
            "tokens_per_verification": 1.5,
            "loads_per_token": 2.0,
            "stall_share": 0.5,
            "cpu_calls_per_token": 1.0,
            "cache": 0.25,
            "tokens": 64,
        }
        for lb in labels
    ]


def _simulated_only() -> dict:
    """A simulator-only run's result, as bench/seed_004.py writes it."""
    from bench.seed004_sim import SIM_CONFIGS

    labels = [lb for lb in SIM_CONFIGS if lb != "plain"]
    cross = [
        {"panel": "p1", "row_share": s, "load_ms": x, "ratio": 1.2 if s == 0 else 0.8}
        for s in (0.0, 1.0)
        for x in (1.0, 8.0)
    ]
    return {
        "machine": "Machine: test.",
        "seconds": 60.0,
        "args": {"link": "hdd", "cache": "0.25", "profile": "p", "shape": "s", "proj_tokens": "64"},
        "measured": {},
        "simulated": {
            "here": _rows(labels),
            "projected": _rows(labels, 1.3),
            "projected_sweep": _rows(["spec+utility+cpu"]),
            "long": _rows(["spec+utility+cpu"]),
            "crossover": cross,
            "here_costs": {"load_ms": 8.3, "draft_ms": 2.3},
            "trace_tokens": 100,
        },
    }


def _sampled_rows() -> list[dict]:
    """Section 6's rows: plain, spec+cpu without and with utility; greedy, seeded and unseeded."""
    ratios = {"plain": 1.0, "spec+cpu, no utility": 0.6, "spec+utility+cpu": 0.9}
    return [
        {
            "text": "models/embedded/data/test.txt",
            "decoding": mode,
            "config": lb,
            "tok_s": 10.0 * r,
            "ratio": r + (0.2 if mode == "greedy" else 0.0),
            "tokens_per_verification": 1.0 if lb == "plain" else tpv,
            "stall_share": 0.5,
            "hit_rate": 0.8,
            "cpu_calls_per_token": 2.0,
            "same_tokens_as_plain": None if mode.endswith("unseeded") else True,
        }
        for mode, tpv in (("greedy", 3.5), ("T = 0.8, seeded", 1.4), ("T = 0.8, unseeded", 2.0))
        for lb, r in ratios.items()
    ]


def test_the_page_renders_from_a_simulator_only_run(tmp_path: Path) -> None:
    from bench.seed004_page import render

    d = _simulated_only()
    out = tmp_path / "004.md"
    text = render(d, out)
    assert "2 of 4 crossover cells favour speculation" in text
    assert "| p1 | 0 | **1.20** | **1.20** |" in text
    assert "PROJECTED fixed level 1 1.30×" in text
    out.write_text(text + "\n## Why the results differ\n\nkept\n")
    assert render(d, out).endswith("kept\n")  # the hand-written analysis survives a rerun


def test_only_sampled_merges_its_section_and_the_page_reports_it(
    tmp_path: Path, monkeypatch
) -> None:
    import bench.seed004_runs
    from bench.__main__ import cli

    d = _simulated_only()
    d["measured"] = {"main": [], "sweep": [], "long": [], "llama": False}
    out = tmp_path / "004.md"
    out.with_suffix(".json").write_text(json.dumps(d))
    seen = {}

    def fake(args, texts):  # the engine's cells stand in: only the merge and the page are tested
        seen.update(texts=list(texts), temperature=args.temperature)
        return _sampled_rows()

    monkeypatch.setattr(bench.seed004_runs, "sampled_table", fake)
    data = "models/embedded/data/test.txt"
    assert cli(["seed-004", "--only-sampled", "--sampled-data", data, "--out", str(out)]) == 0
    assert seen == {"texts": [data], "temperature": 0.8}
    merged = json.loads(out.with_suffix(".json").read_text())
    assert merged["measured"]["sampled"] == _sampled_rows()
    assert merged["simulated"] == d["simulated"] and "sampled_run" in merged
    text = out.read_text()
    assert "## 6. Sampled text" in text and "`python -m bench seed-004 --only-sampled`" in text
    assert (
        "on seeded sampled text (T = 0.8, section 6: every configuration generates plain's tokens) "
        "spec+utility+cpu, × plain, is 0.90× on test.txt at 1.40 tokens a verification (greedy in the same "
        "run: 1.10× on test.txt), and the best exact configuration there is plain (1.00× on test.txt, 1.00 "
        "tokens a verification); unseeded (2.00 tokens a verification, each cell its own text) 0.90× on test.txt"
        in text
    )
    assert (
        "test.txt, greedy: without 0.80× vs with 1.10×; test.txt, T = 0.8, seeded: without 0.60× vs with 0.90×"
        in text
    )
    assert "PROJECTED without 1.30× vs with 1.30×" in text  # the simulator's ablation label
    assert "| test.txt | T = 0.8, seeded | spec+cpu, no utility | 6.0 | 0.60× | 1.40 |" in text
    assert (
        "| test.txt | T = 0.8, unseeded | plain | 10.0 | 1.00× | 1.00 | 50% | 80% | 2.0 | – |"
        in text
    )
    assert "every greedy and seeded configuration generated plain's tokens" in text


@pytest.mark.slow  # 10-20 s on 2 cores: every simulated table on a small synthetic trace
def test_the_command_runs_simulator_only(tmp_path: Path) -> None:
    from bench.__main__ import cli

    tr = _trace(N=400, E=16)
    npz = tmp_path / "trace.npz"
    np.savez(
        npz, ids=tr["ids"], weights=tr["weights"], logits=tr["logits"], meta=json.dumps(tr["meta"])
    )
    out = tmp_path / "004.md"
    args = ["--no-measure", "--trace", str(npz), "--sim-tokens", "64", "--proj-tokens", "16"]
    args += ["--shape", "embedded"]  # 4 layers: Qwen3-30B's 48 make utility eviction slow to replay
    args += [
        "--grid-loads",
        "1,8",
        "--grid-rows",
        "0",
        "--grid-panels",
        "1:bench",
        "--grid-tokens",
        "32",
    ]
    args += ["--long-sim", "32,64", "--caches", "0.25", "--out", str(out)]
    assert cli(["seed-004", *args]) == 0
    d = json.loads(out.with_suffix(".json").read_text())
    assert len(d["simulated"]["crossover"]) == 2 and d["measured"] == {}
    assert (tmp_path / "004-crossover.png").exists() and (tmp_path / "004-cache.png").exists()
    assert Counter(r["tokens"] for r in d["simulated"]["long"]) == {32: 3, 64: 3}
    # simulate again keeping the measured tables of an earlier run
    d["measured"] = {"main": [], "sweep": [], "long": [], "llama": False}
    d["machine"] = "Machine: earlier."
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps(d))
    assert cli(["seed-004", *args[1:], "--measured-from", str(earlier)]) == 0
    again = json.loads(out.with_suffix(".json").read_text())
    assert again["measured"] == d["measured"] and again["machine"] == "Machine: earlier."


def _long_rows() -> list[dict]:
    """Section 4's rows: two lengths, one engine configuration and llama-server -md."""
    return [
        {
            "tokens": n,
            "config": "spec+utility+cpu",
            "tok_s": 40.0,
            "ratio": 1.0 if n == 64 else 1.25,
            "tokens_per_verification": 3.0,
            "stall_share": 0.4,
            "hit_rate": 0.9,
        }
        for n in (64, 2048)
    ] + [{"tokens": 2048, "config": "llama-server -md", "tok_s": 100.0, "ratio": 0.5}]


def test_only_long_merges_its_section_on_the_long_pair(tmp_path: Path, monkeypatch) -> None:
    import bench.seed004_runs
    from bench.__main__ import cli

    d = _simulated_only()
    d["measured"] = {"main": [], "sweep": [], "long": [], "llama": False}
    out = tmp_path / "004.md"
    out.with_suffix(".json").write_text(json.dumps(d))
    seen = {}

    def fake(
        args, prompts, llama
    ):  # the engine's cells stand in: the merge and the page are tested
        seen.update(model=args.long_model, lengths=args.long, llama=llama)
        return _long_rows()

    monkeypatch.setattr(bench.seed004_runs, "long_runs", fake)
    assert cli(["seed-004", "--only-long", "--long", "64,2048", "--out", str(out)]) == 0
    assert seen == {"model": "models/embedded/long/target", "lengths": [64, 2048], "llama": None}
    merged = json.loads(out.with_suffix(".json").read_text())
    assert merged["measured"]["long"] == _long_rows() and "long_run" in merged
    text = out.read_text()
    assert "on `models/embedded/long/target` and its draft" in text
    assert "`python -m bench seed-004 --only-long`" in text
    assert "section 4 was measured apart, `python -m bench seed-004 --only-long` (" in text
    assert "| 2048 | spec+utility+cpu | 40.0 | 1.25× | 3.00 | 40% | 90% |" in text
    assert (
        "at 2048 tokens (the long-context pair) × the shortest run: spec+utility+cpu 1.25×" in text
    )


def test_long_lengths_beyond_the_long_pairs_context_fail_in_one_line() -> None:
    from types import SimpleNamespace

    from bench.seed004_runs import long_runs

    args = SimpleNamespace(
        long_model="models/embedded/long/target", long=[64, 4096], prompt_tokens=64
    )
    with pytest.raises(SystemExit, match="do not fit .*4096-token context: use at most 4027"):
        long_runs(args, [], None)


def test_a_measured_cell_runs_to_its_length_within_the_models_context(tiny_ckpt) -> None:
    """run_cell takes the model's context (not a fixed 2048) and refuses to report a request the
    context cut short: a 4000-token cell once measured about 2000 tokens."""
    from bench.spec_bench import run_cell
    from engine.speculative.config import SpecConfig

    long = load_model(tiny_ckpt(max_position_embeddings=4096), EngineConfig())
    try:
        r = run_cell(long, SpecConfig(speculative="off"), [[5, 6, 7]], 2100)
        assert r["produced"] == 2100 - 1 and len(r["token_ids"][0]) == 2100
    finally:
        long.close()
    short = load_model(tiny_ckpt(max_position_embeddings=64), EngineConfig())
    try:
        with pytest.raises(RuntimeError, match="stopped after .* of 100 tokens.*64-token context"):
            run_cell(short, SpecConfig(speculative="off"), [[5, 6, 7]], 100)
    finally:
        short.close()
