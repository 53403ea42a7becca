"""server/ and cli/ read in one sitting (issue 41): no Python file there is over 400 lines."""

from __future__ import annotations

from server_fixtures import REPO


def test_server_files_are_at_most_400_lines() -> None:
    long = {
        p.relative_to(REPO).as_posix(): n
        for p in sorted([*(REPO / "server").glob("*.py"), *(REPO / "cli").glob("*.py")])
        if (n := len(p.read_text().splitlines())) > 400
    }
    assert not long, f"split these server/ or cli/ files (lines): {long}"
