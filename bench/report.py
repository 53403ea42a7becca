"""Writing a benchmark's report: header and table to stdout, and to `out` (.md) with the numbers
as JSON beside it. Hand-written analysis below the table (from a line starting `Command:` or `Command (` on)
and the summary a page opens with are kept when a rerun rewrites the table."""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from engine import cpu_model, portable_path

ANALYSIS_STARTS = (
    "\nCommand:",
    "\nCommand (",
)  # "Command (what it covers; how long):" opens some pages' analysis


# A page opens with a hand-written summary (docs/benchmarks/README.md): a title, then bullets from
# "- **Result:**" to "- **Limit:**" and a blank line. A rerun keeps it above the new header.
SUMMARY_START, SUMMARY_LAST = "- **Result:**", "- **Limit:**"


def opening(old: str, header: str) -> str:
    """The title and summary a rewritten page starts with, then the new header: the title is the
    header's own where it has one ("# ..."), else the old page's; no summary in `old`, just the header."""
    start, last = old.find(SUMMARY_START), old.find(SUMMARY_LAST)
    if start < 0 or last < start:
        return header
    end = old.find("\n\n", last)
    summary = old[start : end if end >= 0 else len(old)].rstrip("\n")
    first, _, rest = header.partition("\n")
    if first.startswith("# "):
        title, header = first, rest.lstrip("\n")
    else:
        title = old.split("\n", 1)[0] if old.startswith("# ") else ""
    return "\n\n".join(part for part in (title, summary, header) if part)


def args_payload(args: argparse.Namespace) -> dict[str, str]:
    """A run's flags as text for its JSON, paths made portable: no machine paths in a committed report."""
    return {k: portable_path(v) if isinstance(v, Path) else str(v) for k, v in vars(args).items()}


def write_report(out: Path | None, header: str, lines: list[str], payload: dict[str, Any]) -> None:
    print(header)
    print("\n".join(lines))
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"header": header, **payload}, indent=2))
    old = out.read_text() if out.exists() else ""
    out.write_text(f"{opening(old, header)}\n\n" + "\n".join(lines) + "\n" + _analysis(old, header))


def _analysis(old: str, header: str) -> str:
    """The hand-written part of `old` below its tables: from the first analysis opening, skipping the old
    generated header where the benchmark's header itself opens like one ("Command: ...")."""
    starts = sorted(i for m in ANALYSIS_STARTS for i in _occurrences(old, m))
    body = header.split("\n", 1)[1].lstrip("\n") if header.startswith("# ") else header
    if body.startswith(tuple(m.lstrip("\n") for m in ANALYSIS_STARTS)):
        first = _header_start(old)  # the old generated header starts there: not analysis
        starts = [i for i in starts if i >= first]
    return old[starts[0] :] if starts else ""


def _header_start(old: str) -> int:
    """Where the generated header of page `old` starts: after its summary, else after its title, else at 0."""
    at = old.find(SUMMARY_LAST)
    if at < 0 and not old.startswith("# "):
        return 0
    gap = old.find("\n\n", max(at, 0))
    return gap + 2 if gap >= 0 else len(old)


def _occurrences(text: str, marker: str) -> list[int]:
    found, at = [], text.find(marker)
    while at >= 0:
        found.append(at)
        at = text.find(marker, at + 1)
    return found


def cut_prompts(tokenizer: Any, data: str | Path, n: int, length: int) -> list[list[int]]:
    """n prompts of `length` tokens, cut from evenly spaced places in the text file `data`."""
    ids = tokenizer(Path(data).read_text(encoding="utf-8"))["input_ids"]
    stride = len(ids) // (n + 1)
    return [ids[i * stride : i * stride + length] for i in range(n)]


def interleaved(
    cells: Sequence[Hashable], rounds: int, run: Callable[[Any], dict]
) -> dict[Any, list[dict]]:
    """Run every cell once per round, a warm-up round first (discarded), so the measured rounds
    of all cells share the machine's load; returns each cell's measured results in round order."""
    res: dict[Any, list[dict]] = {cell: [] for cell in cells}
    for rnd in tqdm(range(rounds + 1), desc="rounds (first is warm-up)"):
        for cell in tqdm(cells, desc=f"round {rnd}", leave=False):
            r = run(cell)
            if rnd:
                res[cell].append(r)
    return res


def summarize(
    res: dict[Any, list[dict]], cell: Any, baseline: Any, keys: Sequence[str]
) -> dict[str, float]:
    """Medians of `keys` over a cell's rounds, and `ratio`: the median over rounds of the cell's
    tok/s divided by the baseline cell's in the same round (both ran under the same load)."""
    runs = res[cell]
    ratio = statistics.median(a["tok_s"] / b["tok_s"] for a, b in zip(runs, res[baseline]))
    return {"ratio": ratio, **{k: statistics.median(r[k] for r in runs) for k in keys}}


def machine_line(threads: int, device: str = "") -> str:
    """The first words of every report: what ran it (CPU model, cores, threads, versions, date)."""
    import datetime
    import os
    import platform

    import torch

    return (
        f"Machine: {cpu_model()} ({platform.machine()}, {os.cpu_count()} logical CPUs), "
        f"{threads} torch thread(s), torch {torch.__version__}, Python {platform.python_version()}, "
        f"{datetime.date.today().isoformat()}" + (f", {device}" if device else "") + "."
    )


def prompts_line(prompt_tokens: int, data: str | Path, tokens: int, rounds: int, link: str) -> str:
    from engine import portable_path

    return (
        f"Prompts: {prompt_tokens} tokens cut from {portable_path(data)}; {tokens} greedy tokens per request; medians of "
        f"{rounds} interleaved rounds after a warm-up round; link `{link}` emulated."
    )


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (argparse turns the error into one line and exit status 2)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def add_common_flags(ap: argparse.ArgumentParser, out_help: str = "", threads: bool = True) -> None:
    """The flags every benchmark shares: --out (the Markdown report; JSON beside it) and --threads."""
    if threads:
        ap.add_argument(
            "--threads",
            type=positive_int,
            default=1,
            help="torch threads (default 1: steadier on a shared machine)",
        )
    ap.add_argument(
        "--out",
        type=Path,
        help=out_help or "write a markdown report here (and the numbers as JSON beside it)",
    )


def add_run_flags(
    ap: argparse.ArgumentParser, prompt_tokens: int, tokens: int, rounds: int, link: str
) -> None:
    """The flags every decode benchmark shares: prompts, length, rounds, the emulated link, threads, output."""
    ap.add_argument(
        "--data",
        default="models/embedded/data/test.txt",
        help="text the prompts are cut from (default: the test split)",
    )
    ap.add_argument(
        "--prompt-tokens",
        type=positive_int,
        default=prompt_tokens,
        help=f"tokens per prompt (default {prompt_tokens})",
    )
    ap.add_argument(
        "--tokens",
        type=positive_int,
        default=tokens,
        help=f"tokens generated per request (default {tokens})",
    )
    ap.add_argument(
        "--rounds",
        type=positive_int,
        default=rounds,
        help=f"measured rounds after one warm-up round (default {rounds})",
    )
    ap.add_argument(
        "--link", default=link, help=f"the emulated link of the slow-link setting (default {link})"
    )
    add_common_flags(ap)
