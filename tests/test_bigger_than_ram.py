"""The bigger-than-memory benchmark's summary: ratios per round, Belady and dd shares, token checks."""

from __future__ import annotations

from bench.bigger_than_ram import Cell, cells, render, summarize


def _engine(tps: float, tokens: list[int]) -> dict:
    return {
        "decode_tps": tps,
        "bytes_per_token": 130.0,
        "min_bytes_per_token": 100.0,
        "min_loads_per_token": 10.0,
        "lru_loads_per_token": 16.0,
        "uniform_online_loads_per_token": 15.0,
        "read_gb_s": 0.7,
        "dd_gb_s": 1.0,  # the dd run right after this round's engine cell
        "n_slots": 5,
        "total_experts": 20,
        "tokens": tokens,
        "cgroup_peak": 2**30,
    }


def test_cells_pair_equal_bits_per_limit() -> None:
    got = cells([4, 6], 6)
    assert [(c.model, c.limit_gib, c.engine, c.gguf) for c in got] == [
        ("qwen3-30b-a3b", 4, "bf16", "bf16"),
        ("qwen3-30b-a3b", 4, "int8", "q8_0"),
        ("qwen3-30b-a3b", 6, "bf16", "bf16"),
        ("qwen3-30b-a3b", 6, "int8", "q8_0"),
        ("gpt-oss-20b", 6, "mxfp4", "mxfp4"),
    ]
    assert cells([4], None) == cells([4], 0) == got[:2]
    assert cells([4, 6], 6, ("bf16", "mxfp4")) == [got[0], got[2], got[4]]


def test_summary_is_per_round_ratio_then_median_and_flags_token_mismatch() -> None:
    c = Cell("qwen3-30b-a3b", 4, "bf16", "bf16")
    m = {
        "cells": {
            c.name: {
                "engine": [_engine(2.0, [1, 2]), _engine(3.0, [1, 3])],
                "llama": [
                    {"decode_tps": 1.0, "cgroup_peak": 2**31},
                    {"decode_tps": 3.0, "cgroup_peak": 2**30, "bytes_per_token": 400.0},
                ],
            }
        },
        "references": {"qwen3-30b-a3b bf16": {"tokens": [1, 2], "n_slots": 9}},
        "plans": {c.name: {"projected_tps": 3.0}},
        "plans_own_trace": {c.name: {"projected_tps": 2.0}},
        "dd": {"expert": 1.0, "1MiB": 0.5, "expert_bytes": 10},
    }
    (row,) = summarize(m, [c])
    assert row["per_round"] == [2.0, 1.0] and row["ratio"] == 1.5
    assert row["engine_tps"] == 2.5 and row["llama_tps"] == 2.0
    assert row["bytes_over_min"] == 1.3 and row["read_share_of_dd"] == 0.7
    assert row["llama_bytes_per_token"] == 400.0
    assert row["lru_over_min"] == 1.6 and row["uniform_online_over_min"] == 1.5
    assert row["projected_over_measured"] == 3.0 / 2.5
    assert row["own_trace_over_measured"] == 2.0 / 2.5 and row["dd_gb_s"] == 1.0
    assert row["tokens_equal_reference"] is False  # the second round's tokens differ
    assert row["llama_peak"] == 2**31
    text = "\n".join(render([row], m))
    assert "**1.50×**" in text and "**no**" in text and "5 of 20" in text
    assert "| 1.30× | 1.60× | 1.50× |" in text  # engine, LRU and uniform-online loads over MIN
