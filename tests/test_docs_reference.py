"""The docs read as reference, not as a diary (issues 41 and 52).

- Every relative link of README.md and docs/ resolves inside the repository (a file that exists, a heading that
  exists).
- README.md stays a page a newcomer reads at once: under 12 KB, opening with the set-up commands; its opening
  claims link measured pages, and the unmeasured goal says "projected".
- docs/architecture.md is a map that fits in 20 KB.
- Every benchmark page opens with its current result, command, machine and physical limit, and keeps no History
  section (git keeps the past)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")  # [text](target)
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"```.*?```", re.S)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}


def broken_links(page: Path, root: Path = REPO) -> list[str]:
    text = FENCE.sub("", page.read_text())
    bad = []
    for target in LINK.findall(text) + IMAGE.findall(text):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not this repository's
            continue
        path, _, frag = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists() or root not in (dest, *dest.parents):
            bad.append(f"{target} (no such file in the repository)")
        elif frag and dest.suffix == ".md" and frag not in anchors(dest):
            bad.append(f"{target} (no such heading)")
    return bad


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def test_every_link_resolves_inside_the_repository() -> None:
    bad = {p.relative_to(REPO).as_posix(): b for p in pages() if (b := broken_links(p))}
    assert bad == {}


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# Top\n\n## Two words\n")
    page = tmp_path / "b.md"
    page.write_text(
        "[ok](a.md#two-words) [x](missing.md) [out](../outside.md) [y](a.md#nowhere) [z](#top) [w](https://example.org)\n"
        "```\n[in a code block](ignored.md)\n```\n# Top\n"
    )
    assert [b.split(" ")[0] for b in broken_links(page, tmp_path)] == [
        "missing.md",
        "../outside.md",
        "a.md#nowhere",
    ]


def test_the_readme_fits_and_opens_with_the_setup_commands() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.encode()) < 12 * 1024
    first_block = readme.split("```bash\n", 1)[1].split("```", 1)[0]
    assert (
        "python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e . && .venv/bin/moe-offload serve"
        in first_block
    )
    assert '.venv/bin/pip install -e ".[test]" && .venv/bin/python -m pytest -q' in first_block


BENCH = REPO / "docs" / "benchmarks"
OPENING = ("Result", "Command", "Machine", "Limit")


def benchmark_pages() -> list[Path]:
    return sorted(p for p in BENCH.glob("*.md") if p.name != "README.md")


def headings(page: Path) -> list[str]:
    return re.findall(r"^#+ (.*)$", FENCE.sub("", page.read_text()), re.M)


def opening_labels(page: Path) -> list[str]:
    """The bold labels of the bullets that open the page, right after its title."""
    lines = page.read_text().split("\n")
    assert lines[0].startswith("# "), f"{page.name}: no title on the first line"
    labels = []
    for line in lines[1:]:
        if not line.strip():
            if labels:
                break
            continue
        m = re.match(r"- \*\*(\w+):\*\* \S", line)
        if m is None:
            break
        labels.append(m.group(1))
    return labels


def test_architecture_is_a_map_of_at_most_20_kb() -> None:
    page = REPO / "docs" / "architecture.md"
    assert len(page.read_bytes()) <= 20 * 1024
    # The map's two halves, and the section configuration.md links to.
    assert {"The life of a step", "The rooms", "The dispatcher"} <= set(headings(page))


def test_no_benchmark_page_keeps_a_history_section() -> None:
    with_history = {
        p.name: h for p in benchmark_pages() for h in headings(p) if re.match(r"history\b", h, re.I)
    }
    assert with_history == {}


def test_every_benchmark_page_opens_with_result_command_machine_and_limit() -> None:
    assert len(benchmark_pages()) >= 20  # the glob found the pages
    wrong = {
        p.name: labels for p in benchmark_pages() if (labels := opening_labels(p)) != list(OPENING)
    }
    assert wrong == {}


def test_the_opening_check_catches_a_page_without_its_limit(tmp_path: Path) -> None:
    page = tmp_path / "x.md"
    page.write_text("# X\n\n- **Result:** 2×\n- **Command:** `c`\n- **Machine:** m\n\n| table |\n")
    assert opening_labels(page) == ["Result", "Command", "Machine"]


def test_readme_opening_claims_link_measured_pages_and_the_goal_says_projected() -> None:
    readme = (REPO / "README.md").read_text()
    opening = readme.split("```", 1)[0]  # the text above the first commands
    assert "24 GB GPU" in opening and "projected" in opening
    linked = re.findall(r"\]\((docs/benchmarks/[\w.]+\.md)\)", opening)
    assert "docs/benchmarks/peers_memory.md" in linked  # the measured bigger-than-RAM claim
    assert "docs/benchmarks/simulator.md" in linked  # the projection it comes from
