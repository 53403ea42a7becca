"""The seed pages' real-shape section (bench/seed_real_shape.py, bench/seed_real_shape_page.py):
the ratio math, the figures taken from a cell, the rendering (RANDOM WEIGHTS on every heading and
row), the merge into each seed's JSON, and one tiny engine run end to end."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from bench.seed_real_shape import SECTIONS, add_real_shape_flags, figures, measure, rows
from bench.seed_real_shape_page import RANDOM, claim_row, section

PAGES = {"000": "000-substitution", "003": "003-specprefetch", "004": "004-spac"}
NUMBER = {"000": 10, "003": 5, "004": 7}


def test_ratios_are_medians_of_per_round_ratios() -> None:
    res = {
        "a": [{"tok_s": 10.0, "x": 1.0}, {"tok_s": 20.0, "x": 3.0}, {"tok_s": 30.0, "x": 2.0}],
        "b": [{"tok_s": 20.0, "x": 5.0}, {"tok_s": 20.0, "x": 7.0}, {"tok_s": 15.0, "x": 6.0}],
    }
    a, b = rows(res, "a")
    assert a == {
        "config": "a",
        "ratio": 1.0,
        "round_ratios": [1.0, 1.0, 1.0],
        "tok_s": 20.0,
        "x": 2.0,
    }
    # per round 2.0, 1.0, 0.5: the median is 1.0, not the ratio of medians (20 / 20) by chance alone
    assert b["round_ratios"] == [2.0, 1.0, 0.5] and b["ratio"] == 1.0
    assert b["tok_s"] == 20.0 and b["x"] == 6.0


def test_figures_add_the_substituted_share_and_drop_precision() -> None:
    stats = {
        "transfers": {"demand": 30},
        "hit_rate": 0.75,
        "prefetch_used": 10,
        "prefetch_wasted": 0,
        "cpu_expert_calls": 8,
        "calls_hit": 60,
        "calls_fetched": 30,
        "substitutions": 10,
        "bytes_moved": 12e9,
        "transfer_seconds": {"demand": 3.0, "prefetch": 1.0},
    }
    r = {
        "stats": stats,
        "tok_s": 5.0,
        "stall_share": 0.2,
        "bytes_per_token": 3e6,
        "produced": 4,
        "tokens_per_verification": 1.5,
    }
    f = figures(r)
    assert "precision" not in f
    assert f["substituted_share"] == 0.1 and f["recall"] == 0.25 and f["cpu_calls_per_token"] == 2.0
    assert f["tok_s"] == 5.0 and f["bytes_per_token"] == 3e6 and f["tokens_per_verification"] == 1.5
    assert f["read_gb_s"] == 3.0


def _row(config: str, ratio: float) -> dict[str, Any]:
    return {
        "config": config,
        "ratio": ratio,
        "round_ratios": [ratio],
        "tok_s": 8.0 * ratio,
        "stall_share": 0.25,
        "hit_rate": 0.8,
        "recall": 0.5,
        "bytes_per_token": 5e7,
        "cpu_calls_per_token": 3.0,
        "tokens_per_verification": 1.25,
        "substituted_share": 0.125,
        "read_gb_s": 1.5,
    }


def _real_shape(seed: str) -> dict[str, Any]:
    adapter = {"tokens": 4096, "data": "valid.txt", "steps": 1500, "heldout_recall": 0.6}
    return {
        "rows": [_row(c, 1.0 + i / 10) for i, c in enumerate(SECTIONS[seed])],
        "disk_reads": ["O_DIRECT"],
        "shape": {"layers": 4, "experts": 128, "top_k": 8, "n_slots": 128, "total_experts": 512},
        "machine": "Machine: a CPU, 1 torch thread(s).",
        "note": "other work running",
        "checkpoint": {"model": "qwen3-30b-a3b", "path": ".cache/real/q30-4l", "bytes": 6.2e9},
        "cache": 0.25,
        "prompt_tokens": 16,
        "tokens": 32,
        "rounds": 6,
        "adapter": {**adapter, "heldout_recall_fate": 0.3} if seed == "003" else None,
        "load_average": {"before": 1.0, "after": 1.5},
        "seconds": 120.0,
    }


@pytest.mark.parametrize("seed", sorted(SECTIONS))
def test_every_heading_and_row_says_random_weights(seed: str) -> None:
    d = {"real_shape": _real_shape(seed)}
    lines = section(d, seed, NUMBER[seed], f"seed-{seed}")
    heads = [ln for ln in lines if ln.startswith("#")]
    table = [ln for ln in lines if ln.startswith("| ") and not ln.startswith("| configuration")]
    assert len(heads) == 1 and RANDOM in heads[0] and heads[0].startswith(f"## {NUMBER[seed]}.")
    assert len(table) == len(SECTIONS[seed]) and all(RANDOM in ln for ln in table)
    assert table[1].split(" | ")[2] == "1.10×"  # the ratio column, after tok/s
    text = "\n".join(lines)
    assert (
        "O_DIRECT (which bypasses the page cache" in text
        and "at 1.50 GB/s" in text
        and "1 torch thread(s), other work running. Load" in text
    )
    assert f"`python -m bench seed-{seed} --only-real-shape`" in text
    spec = [ln for ln in table if ln.startswith("| spec")]
    assert all("n-gram proposer standing in for the draft" in ln for ln in spec)
    assert bool(spec) == (seed == "004")
    assert ("fitted here on 4096 tokens" in text) == (seed == "003")
    (claim,) = claim_row(d, seed, NUMBER[seed])
    assert RANDOM in claim and claim.count(" | ") == (4 if seed == "004" else 3)
    assert claim.endswith(f"| {NUMBER[seed]} |")
    assert ("n-gram proposer standing in for the draft" in claim) == (seed == "004")


def test_no_run_no_section() -> None:
    assert section({}, "000", 10, "seed-000") == [] and claim_row({}, "004", 7) == []


def test_the_flags_and_their_defaults() -> None:
    ap = argparse.ArgumentParser()
    add_real_shape_flags(ap)
    a = ap.parse_args([])
    assert not a.only_real_shape and a.real_shape_tokens == 32 and a.real_shape_rounds == 8
    assert a.real_shape_dir == Path(".cache/real/q30-4l") and a.real_shape_note == ""
    assert all("help" in vars(x) and x.help for x in ap._actions[1:])


@pytest.mark.parametrize("seed", sorted(SECTIONS))
def test_only_real_shape_merges_its_section_and_rewrites_the_page(
    seed: str, tmp_path: Path, monkeypatch
) -> None:
    import bench.seed_real_shape
    from bench.__main__ import cli

    out = tmp_path / f"{PAGES[seed]}.md"
    shutil.copy(Path("docs/seeds") / f"{PAGES[seed]}.json", out.with_suffix(".json"))
    before = json.loads(out.with_suffix(".json").read_text())
    seen = []

    def fake(s: str, args: argparse.Namespace) -> dict[str, Any]:  # the engine's cells stand in
        seen.append((s, args.real_shape_tokens))
        return _real_shape(s)

    monkeypatch.setattr(bench.seed_real_shape, "real_shape_run", fake)
    argv = [f"seed-{seed}", "--only-real-shape", "--real-shape-tokens", "4", "--out", str(out)]
    assert cli(argv) == 0
    assert seen == [(seed, 4)]
    merged = json.loads(out.with_suffix(".json").read_text())
    assert merged.pop("real_shape") == _real_shape(seed)
    before.pop("real_shape", None)
    assert merged == before  # nothing else measured again
    page = out.read_text()
    assert f"## {NUMBER[seed]}. Real shapes ({RANDOM})" in page
    assert page.count("the same designs at Qwen3-30B-A3B's layer shape") == 1


def test_one_section_runs_end_to_end_on_a_tiny_checkpoint(tiny_ckpt) -> None:
    m = measure("004", tiny_ckpt(), tokens=3, rounds=1)
    assert [r["config"] for r in m["rows"]] == list(SECTIONS["004"])
    assert m["rows"][0]["ratio"] == 1.0 and all(r["tok_s"] > 0 for r in m["rows"])
    assert m["disk_reads"] and set(m["disk_reads"]) <= {"O_DIRECT", "pread+DONTNEED"}
    assert m["shape"]["n_slots"] < m["shape"]["total_experts"]


def test_a_full_run_keeps_the_real_shape_section_it_did_not_measure(tmp_path: Path) -> None:
    from bench.seed_real_shape import carry_real_shape

    out = tmp_path / "page.md"
    fresh: dict = {"measured": {}}
    carry_real_shape(out, fresh)  # no JSON yet: nothing to keep
    assert fresh == {"measured": {}}
    out.with_suffix(".json").write_text(
        json.dumps({"measured": {"old": 1}, "real_shape": {"rows": [1]}})
    )
    carry_real_shape(out, fresh)
    assert fresh == {"measured": {}, "real_shape": {"rows": [1]}}
    remeasured = {"real_shape": {"rows": [2]}}
    carry_real_shape(out, remeasured)  # a section of its own wins
    assert remeasured == {"real_shape": {"rows": [2]}}
