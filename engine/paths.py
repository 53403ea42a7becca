"""Paths written into committed files (JSON, .npz metadata, docs) must not carry this machine's layout."""

from __future__ import annotations

from pathlib import Path


def portable_path(path: str | Path) -> str:
    """Relative to the working directory when inside it, else just the last component."""
    p = Path(path).resolve()
    try:
        return p.relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return p.name
