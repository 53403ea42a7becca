"""Seed 000's experiments (bench/seed_000.py): experiment B's equal-mass selection
(policies/composition.py), the matching of substitution shares and the correlations
(bench/seed000_stats.py), and the command end to end on a tiny checkpoint."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest

from bench.seed000_stats import (
    across_input_r,
    cutoff_for_measured_share,
    cutoff_for_share,
    mass_r,
    normalized_gates,
    protected_gate_share,
    unprotected_gate_share,
    within_input_r,
)
from policies.composition import CompositionPolicy, composed_slots, light_slots

ROW = [0.30, 0.20, 0.14, 0.12, 0.09, 0.07, 0.05, 0.03]  # normalized, router order


def test_light_slots_take_the_lightest_up_to_the_target_mass() -> None:
    # 0.03, 0.05, 0.07, 0.09 sum to 0.24, 0.04 from 0.20 (0.15 was 0.05 away); adding 0.12 moves away
    assert light_slots(ROW, 0.20, exclude={0, 1}) == [7, 6, 5, 4]
    assert light_slots(ROW, 0.10, exclude={0, 1}) == [7, 6]
    assert light_slots(ROW, 0.0, exclude={0}) == []


def test_heavy_and_light_substitute_about_the_same_mass_in_the_same_rows() -> None:
    heavy = composed_slots(ROW, "heavy", heavy_rank=1)
    light = composed_slots(ROW, "light", heavy_rank=1)
    assert heavy == [1] and len(light) >= 2 and 0 not in light and 1 not in light
    assert sum(ROW[j] for j in light) == pytest.approx(ROW[1], rel=0.25)
    # A flat row has no light set near its heavy slot's mass within 25 %: neither mode touches it.
    flat = [0.125] * 8
    assert composed_slots(flat, "heavy") == [] == composed_slots(flat, "light")
    first = composed_slots(ROW, "light", heavy_rank=0)
    assert 0 not in first and sum(ROW[j] for j in first) == pytest.approx(ROW[0], rel=0.25)
    with pytest.raises(ValueError):
        composed_slots(ROW, "medium")


def test_composition_policy_plans_stand_ins_outside_the_row() -> None:
    experts = [[10, 11, 12, 13, 14, 15, 16, 17]]
    weights = [[w * 2 for w in ROW]]  # unnormalized: the policy normalizes
    logits = [[float(-e) for e in range(32)]]  # the router ranks expert 0 first, then 1, ...
    resident = set(range(0, 32, 2))
    plans = {
        mode: CompositionPolicy(mode, 1).plan(0, experts, weights, resident.__contains__, logits)
        for mode in ("heavy", "light")
    }
    for plan in plans.values():
        stand_ins = [e for e in plan.experts[0] if e not in experts[0]]
        assert stand_ins == sorted(stand_ins) and stand_ins[0] == 0  # best-ranked first
        assert len(stand_ins) == len(plan.substituted)
        assert plan.calls_hit + plan.calls_fetched + len(plan.substituted) == 8
        assert all(e in plan.fetch for e in stand_ins if e not in resident)  # loaded, not hits
    mass = {m: sum(w for _, w in p.substituted) for m, p in plans.items()}
    assert len(plans["heavy"].substituted) == 1 < len(plans["light"].substituted)
    assert mass["light"] == pytest.approx(mass["heavy"], rel=0.25)


def _gates(n: int = 4000, k: int = 8, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    g = normalized_gates(rng.dirichlet(np.ones(k) * 2, size=n))
    return -np.sort(-g, axis=-1)  # router order: heaviest first


def test_cutoff_for_share_and_the_eligible_shares() -> None:
    g = _gates()
    for share in (0.1, 0.35, 0.7):
        assert unprotected_gate_share(g, cutoff_for_share(g, share)) == pytest.approx(
            share, abs=0.01
        )
    # the protected rule never counts the first choice
    assert protected_gate_share(g, 1.01) == pytest.approx(7 / 8)
    assert unprotected_gate_share(g, 1.01) == 1.0


def test_matched_cutoff_reproduces_the_protected_share_under_random_misses() -> None:
    """Calls miss at random (rate 0.4): the protected rule's measured share gives the miss factor,
    and the cutoff found from it makes the unprotected rule substitute the same share."""
    g = _gates()
    rng = np.random.default_rng(1)
    missed = rng.random(g.shape) < 0.4
    prot = float((missed[:, 1:] & (g[:, 1:] < 0.15)).sum()) / g.size
    t = cutoff_for_measured_share(g, prot, prot, protected_gate_share(g, 0.15))
    unprot = float((missed & (g < t)).sum()) / g.size
    assert unprot == pytest.approx(prot, abs=0.01)


def test_correlations() -> None:
    rows = [{"mean_substituted_mass": m, "delta_ppl_pct": 2 * m + 0.1} for m in (0.1, 0.2, 0.4)]
    assert mass_r(rows) == pytest.approx(1.0)
    assert np.isnan(mass_r(rows[:2]))
    mass = [[0.1, 0.3], [0.2, 0.2], [0.3, 0.1]]  # mass[policy][window]
    dnll = [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]  # window 0: r = 1; window 1: r = -1
    assert within_input_r(mass, dnll) == pytest.approx([1.0, -1.0])
    rng = random.Random(2)
    xs = [rng.random() for _ in range(5)]
    assert across_input_r(xs, [-x for x in xs]) == pytest.approx(-1.0)


@pytest.mark.slow  # 45-60 s on 2 cores: every policy run of the page on a tiny checkpoint
def test_the_command_runs_end_to_end_on_a_tiny_checkpoint(tiny_ckpt, tmp_path) -> None:
    from bench.__main__ import cli

    ckpt = tiny_ckpt("qwen3_moe", "per-expert", num_experts=16, num_experts_per_tok=4)
    a = "To be, or not to be, that is the question of the play. " * 12
    b = "The list type supports append and pop; a dict maps keys to values. " * 12
    for name, text in {"test_a.txt": a, "test_b.txt": b, "test.txt": a + b}.items():
        (tmp_path / name).write_text(text)
    out = tmp_path / "page" / "000.md"
    args = ["--model", str(ckpt), "--data", str(tmp_path / "test.txt"), "--tokens", "64"]
    args += ["--window", "32", "--shift", "a,b", "--shift-windows", "2", "--shift-window", "16"]
    args += ["--speed-windows", "1", "--speed-window", "8", "--match-tries", "2", "--out", str(out)]
    args += ["--gen-prompts", "2", "--gen-tokens", "8"]
    assert cli(["seed-000", *args]) == 0
    d = json.loads(out.with_suffix(".json").read_text())
    labels = {r["label"] for r in d["table"]}
    assert {"fetch-all", "threshold", "quality-first", "speed-first"} <= labels
    assert d["contrast"]["threshold"] and len(d["experiment_b"]) == 2
    for workload in ("teacher-forced", "generate"):
        assert {r["label"] for r in d["speed"][workload]} >= {"fetch-all", "speed-first"}
    text = out.read_text()
    assert "## 2. The protection contrast at matched substitution shares" in text
    assert (out.parent / "000-shift.png").exists() and (out.parent / "000-mass.png").exists()
    gen = {r["label"]: r for r in d["generation"]["rows"]}
    assert set(gen) == {"fetch-all", "threshold", "first-choice", "quality-first", "speed-first"}
    assert gen["fetch-all"]["token_match"] == 1.0 and gen["fetch-all"]["identical_prompts"] == 2
    assert "## 9. Generation" in text
    # The contrast at another cutoff, measured on its own and merged into the JSON and the page.
    assert cli(["seed-000", *args, "--only-contrast", "--contrast-cutoffs", "0.12"]) == 0
    d = json.loads(out.with_suffix(".json").read_text())
    assert d["contrast"]["threshold@0.12"] and d["contrast"]["threshold"]
    assert d["contrast_protected"]["threshold@0.12"]["label"] == "threshold@0.12"
    assert "| threshold@0.12 |" in out.read_text() and "threshold@0.12 at " in out.read_text()
    with pytest.raises(SystemExit, match="give the --data, --tokens and --window"):
        other = [*args[:5], "48", *args[6:]]  # --tokens 48: other windows than the JSON's
        cli(["seed-000", *other, "--only-contrast", "--contrast-cutoffs", "0.12"])


def test_bracketing_tries_interpolate_the_matched_row() -> None:
    from bench.seed000_stats import at_share, bracket, interpolate_cutoff

    tries = [
        {"cutoff": 0.138, "substitution_share": 0.375, "delta_ppl_pct": 2.05},
        {"cutoff": 0.132, "substitution_share": 0.286, "delta_ppl_pct": 0.82},
        {"cutoff": 0.140, "substitution_share": 0.401, "delta_ppl_pct": 2.24},
    ]
    lo, hi = bracket(tries, 0.333)
    assert (lo["cutoff"], hi["cutoff"]) == (0.132, 0.138)  # the nearest on each side
    assert 0.132 < interpolate_cutoff(lo, hi, 0.333) < 0.138
    assert at_share(tries, 0.286) == pytest.approx(0.82)
    assert 0.82 < at_share(tries, 0.333) < 2.05
    assert at_share(tries, 0.5) is None and bracket(tries[:1], 0.333) is None


def test_expert_bytes_count_the_routed_experts_only(tiny_ckpt) -> None:
    from bench.seed000_llama import expert_bytes, read_bytes

    ckpt = tiny_ckpt("qwen3_moe")
    cfg = json.loads((ckpt / "config.json").read_text())
    per = 3 * cfg["moe_intermediate_size"] * cfg["hidden_size"] * 4  # f32: gate, up, down
    experts = cfg.get("num_experts") or cfg["num_local_experts"]
    assert expert_bytes(ckpt) == cfg["num_hidden_layers"] * experts * per
    assert read_bytes(os.getpid()) >= 0


def _llama(vs: float) -> dict:
    systems = ["fetch-all", "threshold", "quality-first", "speed-first"]
    systems += [
        "llama-server, memory = dense + the engine's expert share",
        "llama-server, whole model in memory",
    ]
    speed = [
        {"system": n, "vs_llama_limited": vs if i < 4 else (1.0 if i == 4 else 50.0), "round_ratios": [1.0, 2.0, 3.0],
         "tok_s": 100.0, "read_MB_per_token": 0.1 if i < 4 else 100.0}
        for i, n in enumerate(systems)
    ]  # fmt: skip
    mem = {"expert_bytes": 24 << 20, "gguf_bytes": 32 << 20, "weight_budget": 14 << 20, "llama_anon": 11 << 20,
           "limit": 27 << 20, "llama_peak": 40 << 20, "engine_fast_tier": 6 << 20}  # fmt: skip
    return {
        "speed": speed, "memory": mem, "machine": "Machine: test.", "seconds": 60.0, "load_average": 2.0,
        "ppl": {"engine": {n: 50.0 + i for i, n in enumerate(systems[:4])}, "llama.cpp": 50.1, "tokens": 381},
        "disk_mb_s": {"O_DIRECT 48 KiB": 240.0, "O_DIRECT 1024 KiB": 640.0}, "read_ahead_kb": 8192,
        "args": {"llama_cpp": "DIR", "llama_tokens": "64", "llama_rounds": "8", "llama_ppl_window": "128"},
    }  # fmt: skip


def test_the_llama_cpp_run_fills_the_last_claim_and_its_section(tmp_path) -> None:
    from bench.seed000_page import render

    d = json.loads(Path("docs/seeds/000-substitution.json").read_text())
    d.pop("llama", None)
    page = render(d, tmp_path / "p.md")
    assert "not run (`--llama-cpp DIR`" in page and "## 8." not in page
    page = render({**d, "llama": _llama(25.0)}, tmp_path / "p.md")
    claims = page[page.index("## The paper's claims") : page.index("## 1.")]
    assert (
        "the 0.15 rule 25.0× llama-server" in claims
        and "+0.20 %" in claims
        and "50× its limited self" in claims
    )
    section = page[page.index("## 8.") :]
    assert "| this engine, threshold | 100.0 | 25.00× | 1.00-3.00 | 0.100 | 10 |" in section
    assert (
        "| llama.cpp | 50.10 | +0.20 % |" in section
        and "640 MB/s O_DIRECT 1024 KiB" in section
        and "(8,192 KiB" in section
    )
