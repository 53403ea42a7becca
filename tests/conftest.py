from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for tiny_models

from tiny_models import make_tiny_checkpoint  # noqa: E402

# One intra-op thread for the in-process engines: the test models are tiny (per-op overhead, not
# arithmetic), and the engine runs its own transfer and CPU-expert threads beside the compute
# thread, so two OpenMP threads on a 2-core machine oversubscribe it; measured here, an embedded
# speculation test took 40 s, 92 s and 537 s in three runs with 2 threads (other load varied), 11 s with 1.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """Factory: tiny_ckpt(arch, layout) -> directory, built once per session."""
    made: dict[tuple, Path] = {}

    def get(arch: str = "qwen3_moe", layout: str = "per-expert", **kw) -> Path:
        key = (arch, layout, tuple(sorted(kw.items())))
        if key not in made:
            made[key] = make_tiny_checkpoint(
                tmp_path_factory.mktemp(f"{arch}-{layout}"), arch, layout, **kw
            )
        return made[key]

    return get
