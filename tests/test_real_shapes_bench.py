"""bench/real_shapes_bench.py's pure summaries: per-round ratios, which rows exist, the table."""

from __future__ import annotations

import pytest

from bench.real_shapes_bench import paired, ratio_rows, render


def test_paired_ratio_is_per_round_then_median() -> None:
    per, med = paired([10.0, 30.0, 8.0], [5.0, 10.0, 8.0])
    assert per == [2.0, 3.0, 1.0]
    assert med == 2.0  # not 48/23, the ratio of the sums
    with pytest.raises(ValueError):
        paired([1.0], [1.0, 2.0])
    with pytest.raises(ValueError):
        paired([], [])


def test_ratio_rows_skip_unmeasured_pairs_and_render() -> None:
    res = {"e|1": [4.0, 6.0], "l|1": [2.0, 4.0], "e|2": [1.0, 1.0]}
    rows = ratio_rows(res, [("a", "e|1", "l|1"), ("b", "e|2", "l|2")])
    assert [r["what"] for r in rows] == ["a"]
    assert rows[0]["engine"] == 5.0 and rows[0]["llama"] == 3.0
    assert rows[0]["per_round"] == [2.0, 1.5] and rows[0]["ratio"] == 1.75
    table = render(rows, "tok/s")
    assert table[0].startswith("| cell | engine tok/s | llama.cpp tok/s")
    assert table[2] == "| a | 5.00 | 3.00 | 2.00, 1.50 | **1.75×** |"
