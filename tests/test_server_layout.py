"""server/ reads in one sitting (issue 41): no Python file there is over 400 lines."""

from __future__ import annotations

from server_fixtures import REPO


def test_server_files_are_at_most_400_lines() -> None:
    long = {
        p.name: n
        for p in sorted((REPO / "server").glob("*.py"))
        if (n := len(p.read_text().splitlines())) > 400
    }
    assert not long, f"split these server/ files (lines): {long}"
