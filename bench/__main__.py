"""`python -m bench --list`: every benchmark, one line each; `python -m bench NAME [args]`: run one
(`python -m bench NAME --help` for its flags). The names are in bench/registry.py."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

from bench.registry import BENCHMARKS, Benchmark, find

BENCH = Path(__file__).resolve().parent
USAGE = "usage: python -m bench --list | python -m bench NAME [args] (NAME --help for its flags)"


def listing() -> str:
    width = max(len(b.name) for b in BENCHMARKS)
    return "\n".join(f"{b.name:<{width}}  {b.summary}" for b in BENCHMARKS)


def script_help(b: Benchmark) -> str:
    """A shell benchmark's help: the comment block at the top of its script."""
    lines = (BENCH / b.target).read_text().splitlines()[1:]
    head = [
        ln[1:].strip()
        for ln in lines[
            : next((i for i, ln in enumerate(lines) if not ln.startswith("#")), len(lines))
        ]
    ]
    return f"usage: python -m bench {b.name} (runs bench/{b.target})\n\n" + "\n".join(head)


def run(b: Benchmark, args: list[str]) -> int:
    if b.is_script:
        if args in (["-h"], ["--help"]):
            print(script_help(b))
            return 0
        return subprocess.call(["bash", str(BENCH / b.target), *args])
    main = importlib.import_module(f"bench.{b.target}").main
    argv = sys.argv
    sys.argv = [f"python -m bench {b.name}", *args]  # argparse names the command in its messages
    try:
        code = main()
    finally:
        sys.argv = argv
    return code if isinstance(code, int) else 0


def cli(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(f"{USAGE}\n\nbenchmarks:\n{listing()}")
        return 0 if argv else 2
    if argv[0] == "--list":
        print(listing())
        return 0
    b = find(argv[0])
    if b is None:
        print(
            f"python -m bench: no benchmark {argv[0]!r}; `python -m bench --list` names them",
            file=sys.stderr,
        )
        return 2
    return run(b, argv[1:])


if __name__ == "__main__":
    raise SystemExit(cli(sys.argv[1:]))
