"""The house's size limits (issues 41 and 52): a file, a function and a call a newcomer reads in one sitting.

- no Python file in engine/, server/, cli/ or models/ over 400 lines;
- no function in engine/, server/ or cli/ over 80 lines;
- no call in engine/ with more than 6 positional arguments (the native kernels take descriptor structs).
"""

from __future__ import annotations

import ast
from pathlib import Path

from server_fixtures import REPO

MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80
MAX_POSITIONAL = 6


def _sources(*rooms: str) -> list[Path]:
    return sorted(p for room in rooms for p in (REPO / room).rglob("*.py"))


def _name(p: Path) -> str:
    return p.relative_to(REPO).as_posix()


def test_files_are_at_most_400_lines() -> None:
    long = {
        _name(p): n
        for p in _sources("engine", "server", "cli", "models")
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert not long, f"split these files (lines): {long}"


def test_functions_are_at_most_80_lines() -> None:
    long = {
        f"{_name(p)}:{node.name}": node.end_lineno - node.lineno + 1
        for p in _sources("engine", "server", "cli")
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    }
    assert not long, f"split these functions (lines): {long}"


def test_engine_calls_take_at_most_6_positional_arguments() -> None:
    many = {
        f"{_name(p)}:{node.lineno} {ast.unparse(node.func)}": n
        for p in _sources("engine")
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.Call)
        and (n := sum(not isinstance(a, ast.Starred) for a in node.args)) > MAX_POSITIONAL
    }
    assert not many, f"pass these by keyword or a descriptor (positional arguments): {many}"
