from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for tiny_models

from tiny_models import make_tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """Factory: tiny_ckpt(arch, layout) -> directory, built once per session."""
    made: dict[tuple, Path] = {}

    def get(arch: str = "qwen3_moe", layout: str = "per-expert", **kw) -> Path:
        key = (arch, layout, tuple(sorted(kw.items())))
        if key not in made:
            made[key] = make_tiny_checkpoint(tmp_path_factory.mktemp(f"{arch}-{layout}"), arch, layout, **kw)
        return made[key]

    return get
