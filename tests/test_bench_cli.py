"""`python -m bench` (bench/__main__.py, bench/registry.py): every script of bench/ is a registered
benchmark, each one's --help runs through it, and docs/benchmarks/README.md indexes every page with
the registered command that made it, whose flags that benchmark's parser accepts."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.__main__ import cli
from bench.registry import BENCHMARKS

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"
PAGES = REPO / "docs" / "benchmarks"


def test_every_script_of_bench_is_registered() -> None:
    """A module of bench/ with a main() is a benchmark (the rest are its shared parts), as is a shell script."""
    scripts = {
        p.stem for p in BENCH.glob("*.py") if re.search(r"^def main\(", p.read_text(), re.M)
    } - {"__main__"}
    scripts |= {p.name for p in BENCH.glob("*.sh")}
    targets = [b.target for b in BENCHMARKS]
    assert scripts - set(targets) == set(), "scripts of bench/ that bench/registry.py does not name"
    assert set(targets) <= scripts, "bench/registry.py names a script that does not exist"
    names = [b.name for b in BENCHMARKS]
    assert len(set(names)) == len(names) and len(set(targets)) == len(targets)
    for b in BENCHMARKS:
        assert all((PAGES / p).exists() for p in b.pages), b.name


def test_list_names_every_benchmark_in_one_line_each() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "bench", "--list"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.splitlines()
    assert [line.split()[0] for line in out] == [b.name for b in BENCHMARKS]
    assert all(len(line.split()) > 3 for line in out)  # a summary beside each name


@pytest.mark.parametrize("name", [b.name for b in BENCHMARKS])
def test_every_benchmark_help_runs(name: str, capsys) -> None:
    try:
        code = cli([name, "--help"])
    except SystemExit as e:  # argparse's --help
        code = e.code
    out = capsys.readouterr().out
    assert code == 0 and out.startswith(f"usage: python -m bench {name}"), out[:300]


def test_an_unknown_benchmark_is_one_line_naming_the_fix(capsys) -> None:
    assert cli(["no-such-bench"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "python -m bench --list" in err


def _index_rows() -> dict[str, str]:
    """{page: its row} from the table of docs/benchmarks/README.md."""
    rows = {}
    for line in (PAGES / "README.md").read_text().splitlines():
        m = re.match(r"\| \[([\w.]+\.md)\]\(([\w.]+\.md)\) \|", line)
        if m:
            assert m[1] == m[2], line
            rows[m[1]] = line
    return rows


def test_the_index_names_every_page_and_its_registered_command() -> None:
    pages = {p.name for p in PAGES.glob("*.md")} - {"README.md"}
    rows = _index_rows()
    assert pages - set(rows) == set(), "pages of docs/benchmarks/ that its README.md does not index"
    assert set(rows) <= pages, "docs/benchmarks/README.md indexes a page that does not exist"
    registered = {b.name for b in BENCHMARKS}
    for page, row in rows.items():
        names = re.findall(r"`python -m bench ([\w-]+)", row)
        assert names and set(names) <= registered, f"{page}: no registered command in {row!r}"


def test_every_page_names_the_command_that_made_it() -> None:
    for page in PAGES.glob("*.md"):
        if page.name != "README.md":
            text = page.read_text()
            assert re.search(r"python -m bench[ .]\w|bash bench/\w", text), page.name


class _Parsed(Exception):
    """Raised once a benchmark's parser accepted the command line: nothing runs."""


def _index_commands() -> list[str]:
    cmds = []
    for row in _index_rows().values():
        cmds += re.findall(r"`(python -m bench [^`]+)`", row)
    return sorted(set(cmds))


@pytest.mark.parametrize("command", _index_commands())
def test_every_indexed_command_parses(command: str, monkeypatch) -> None:
    """The flags each page's command gives are flags its benchmark takes (parsed, not run)."""
    import argparse
    import shlex

    name, *args = shlex.split(command)[3:]
    if next(b for b in BENCHMARKS if b.name == name).is_script:
        assert args == [], command  # a shell benchmark takes no flags
        return
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, *a, **kw):
        parse(self, *a, **kw)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    with pytest.raises(_Parsed):
        cli([name, *args])
