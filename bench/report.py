"""Writing a benchmark's report: header and table to stdout, and to `out` (.md) with the numbers
as JSON beside it. Hand-written analysis below the table (from a line starting `Command:` on)
is kept when a rerun rewrites the table."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ANALYSIS_START = "\nCommand:"


def write_report(out: Path | None, header: str, lines: list[str], payload: dict[str, Any]) -> None:
    print(header)
    print("\n".join(lines))
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"header": header, **payload}, indent=2))
    old = out.read_text() if out.exists() else ""
    analysis = old[old.index(ANALYSIS_START):] if ANALYSIS_START in old else ""
    out.write_text(f"{header}\n\n" + "\n".join(lines) + "\n" + analysis)
