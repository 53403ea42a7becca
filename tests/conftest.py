from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for tiny_models

from server_fixtures import RunningServer, serve  # noqa: E402
from tiny_models import make_tiny_checkpoint  # noqa: E402

# One intra-op thread for the in-process engines: the test models are tiny (per-op overhead, not
# arithmetic), and the engine runs its own transfer and CPU-expert threads beside the compute
# thread, so two OpenMP threads on a 2-core machine oversubscribe it; measured here, an embedded
# speculation test took 40 s, 92 s and 537 s in three runs with 2 threads (other load varied), 11 s with 1.
torch.set_num_threads(1)
# The same for the processes the tests start (the CLI, bench scripts; the servers set it
# themselves): beside the other xdist worker, a second OpenMP thread only spins at barriers.
os.environ.setdefault("OMP_NUM_THREADS", "1")


# Files that start first: with `--dist loadfile` a file is one worker's, and the two-minute CI
# soak (tests/test_soak.py) handed out last would run alone at the end while the other worker idles.
START_FIRST = ("test_soak.py",)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.path.name not in START_FIRST)  # stable: the rest keep order


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


@pytest.fixture(scope="session")
def long_tiny_ckpt(tiny_ckpt, tmp_path_factory) -> Path:
    """The tiny checkpoint with a 65,536-token context (RoPE positions: any length runs): for agent
    clients' long prompts, and for generations that cannot finish before a test kills the engine."""
    dst = tmp_path_factory.mktemp("long") / "model"
    shutil.copytree(tiny_ckpt(), dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["max_position_embeddings"] = 65536
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


# Servers shared by every test file that asks for the same flags: one per xdist worker, started the
# first time a file there needs it (each start costs two processes' imports and a model load).
# So a test on one asserts on what its own requests changed (metric deltas), never on the state
# of a fresh server.


@pytest.fixture(scope="session")
def tiny_server(tiny_ckpt, tmp_path_factory) -> Iterator[RunningServer]:
    """`moe-offload serve` on the tiny checkpoint, served as "tiny", default settings."""
    with serve(
        ["--model", str(tiny_ckpt()), "--served-model-name", "tiny"],
        tmp_path_factory.mktemp("tiny-server") / "server.log",
    ) as s:
        yield s


@pytest.fixture(scope="session")
def fuzz_server(tiny_ckpt, tmp_path_factory) -> Iterator[RunningServer]:
    """The same with a 64-token context: every generated request is short, so hundreds of fuzzed
    ones run in seconds."""
    with serve(
        ["--model", str(tiny_ckpt()), "--served-model-name", "tiny", "--max-model-len", "64"],
        tmp_path_factory.mktemp("fuzz-server") / "server.log",
    ) as s:
        yield s


@pytest.fixture(scope="module")
def fuzz_client(fuzz_server: RunningServer) -> Iterator[httpx.Client]:
    """An HTTP client to the fuzz server (paths from its root: /v1/..., /tokenize)."""
    with httpx.Client(base_url=fuzz_server.base_url, timeout=60) as c:
        yield c


# Under CI (.ci/run exports CI=true) a skip hides a test that should have run: only the tests that need a
# CUDA GPU may skip there, since CI has none. Everything else that skips fails, with its reason.
ALLOWED_CI_SKIP = "CUDA"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if not (report.skipped and os.environ.get("CI")) or hasattr(report, "wasxfail"):
        return
    reason = (
        str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
    )
    if ALLOWED_CI_SKIP not in reason:
        report.outcome = "failed"
        report.longrepr = f"skipped under CI, which must run it: {reason}"
