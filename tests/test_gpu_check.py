"""bench/gpu_check.py must run the day a GPU is lent: here its whole path runs on the CPU (--device cpu)
on the tiny peers shape, and its report says what it measured."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow  # the GPU script run through on the CPU, as test_gpu_real_dry_run.py (CI: 10 minutes)
def test_gpu_check_runs_end_to_end_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.md"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.gpu_check",
            "--device",
            "cpu",
            "--shape",
            "tiny",
            "--work",
            str(tmp_path),
            "--tokens",
            "4",
            "--rounds",
            "1",
            # Small copies and matmuls: the same code, without a minute of CPU matmuls.
            "--copy-mib",
            "8",
            "--matmul-dim",
            "256",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    text = out.read_text()
    assert "## Transfers" in text and "| engine cache 0.25 (disk) |" in text
    assert "| H2D, pinned, 8 MiB copies" in text
    # Exact in f32 (the contract): every greedy token shared with transformers.
    assert "| float32 | 4 of 4 |" in text, text
    assert "## CUDA graphs for the dense part" in text
    assert out.with_suffix(".json").exists()


def test_gpu_check_refuses_without_a_gpu_in_one_line() -> None:
    import torch

    if torch.cuda.is_available():
        return  # a GPU box: the refusal cannot happen there
    res = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check"], capture_output=True, text=True, timeout=120
    )
    assert res.returncode != 0
    assert res.stderr.strip().splitlines()[-1].startswith("gpu_check: no CUDA GPU visible")
    assert "Traceback" not in res.stderr


@pytest.mark.slow  # the GPU script run through on the CPU, as test_gpu_real_dry_run.py (CI: 10 minutes)
def test_gpu_profile_runs_end_to_end_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu_profile.md"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.gpu_profile",
            "--device",
            "cpu",
            "--shape",
            "tiny",
            "--work",
            str(tmp_path),
            "--tokens",
            "4",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    text = out.read_text()
    assert (
        "| wall time |" in text
        and "Host operators with the most self time, engine cache 1.0" in text
    )
    assert "`aten::mm`" in text  # the profiler saw the models' matrix products
