"""bench/report.py: a rerun rewrites a page's tables and keeps the hand-written analysis below them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.report import write_report


@pytest.mark.parametrize(
    "opening", ["Command: `python -m bench.x`", "Command (validation; about 20 minutes):"]
)
def test_a_rerun_keeps_the_analysis_and_replaces_the_table(tmp_path: Path, opening: str) -> None:
    out = tmp_path / "page.md"
    write_report(out, "header v1", ["| a |", "| 1 |"], {"rows": [1]})
    out.write_text(out.read_text() + f"\n{opening}\n\nWhy the numbers are what they are.\n")
    write_report(out, "header v2", ["| a |", "| 2 |"], {"rows": [2]})
    text = out.read_text()
    assert text.startswith("header v2\n\n| a |\n| 2 |\n")
    assert "| 1 |" not in text and "header v1" not in text
    assert text.endswith(f"\n{opening}\n\nWhy the numbers are what they are.\n")
    assert json.loads(out.with_suffix(".json").read_text()) == {"header": "header v2", "rows": [2]}


@pytest.mark.parametrize("generated_title", [False, True])
def test_a_rerun_keeps_the_title_and_opening_summary(tmp_path: Path, generated_title: bool) -> None:
    """A page opens with its title and a hand-written summary (docs/benchmarks/README.md); a rerun keeps
    both above the new header, once, whether or not the benchmark writes the title itself."""
    out = tmp_path / "page.md"
    summary = (
        "- **Result:** 2×\n- **Command:** `c`\n- **Machine:** m\n- **Limit:** the disk, 1 GB/s"
    )
    title = "# A page"
    header = f"{title}\n\nMachine line v2" if generated_title else "Machine line v2"
    out.write_text(f"{title}\n\n{summary}\n\nMachine line v1\n\n| 1 |\n\nCommand: `c`\n\nWhy.\n")
    write_report(out, header, ["| 2 |"], {})
    assert (
        out.read_text()
        == f"{title}\n\n{summary}\n\nMachine line v2\n\n| 2 |\n\nCommand: `c`\n\nWhy.\n"
    )


def test_a_header_that_opens_like_an_analysis_is_replaced_not_kept(tmp_path: Path) -> None:
    """A benchmark whose generated header itself starts "Command: ..." (bench exactness): a rerun replaces
    the old header and table and keeps only the hand-written part below them."""
    out = tmp_path / "page.md"
    write_report(out, "Command: `x` v1", ["| 1 |"], {})
    out.write_text(out.read_text() + "\nCommand (the lm-eval check):\n\nWhy.\n")
    write_report(out, "Command: `x` v2", ["| 2 |"], {})
    assert out.read_text() == "Command: `x` v2\n\n| 2 |\n\nCommand (the lm-eval check):\n\nWhy.\n"
