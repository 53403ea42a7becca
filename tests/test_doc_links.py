"""README.md and docs/: every relative link resolves inside the repository (a file that exists, a heading
that exists), and the README stays a page a newcomer reads at once (issue 41): under 12 KB, opening
with the set-up commands."""

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
