"""Issue 32's memory acceptance, on a small bf16 checkpoint (the benchmark does the 821 MiB mid one):
- `generate` with defaults peaks at <= the weights + 600 MiB of RSS (the checkpoint's dtype, zero-copy tiers);
- under a memory cgroup of 600 MiB + 40 % of the checkpoint, `generate --offload disk` with no cache flag
  plans a fast tier that fits, finishes without being OOM-killed, and gives the unlimited run's tokens.
Runs in child processes, so the RSS and the cgroup are the command's own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.cgroup import MemoryCgroup
from models.tiny import make_tiny_checkpoint

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[1]
# 4 layers x 64 experts of 3 x 512 x 512 bf16: 384 MiB of experts, more than the cgroup below leaves for them
SHAPE = dict(
    num_layers=4,
    hidden=512,
    tokenizer_vocab=512,
    num_experts=64,
    num_experts_per_tok=4,
    moe_intermediate_size=512,
)


@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("bf16"), "qwen3_moe", dtype=torch.bfloat16, **SHAPE
    )


def _argv(model: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "cli",
        "generate",
        "--model",
        str(model),
        "--prompt",
        "Hello there, how are",
        "--max-tokens",
        "8",
        "--ignore-eos",
        "--json",
        *extra,
    ]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _peak_rss(argv: list[str]) -> tuple[dict, int]:
    """(the command's JSON, its peak RSS in bytes), measured by a wrapper whose only child it is."""
    wrapper = (
        "import json, resource, subprocess, sys; p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
        "print(json.dumps({'rc': p.returncode, 'out': p.stdout, 'err': p.stderr[-2000:], "
        "'peak': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))"
    )
    res = json.loads(
        subprocess.run(
            [sys.executable, "-c", wrapper, *argv],
            capture_output=True,
            text=True,
            env=_env(),
            timeout=600,
            cwd=ROOT,
            check=True,
        ).stdout
    )
    assert res["rc"] == 0, res["err"]
    return json.loads(res["out"]), int(res["peak"])


def _weights(model: Path) -> int:
    return sum(p.stat().st_size for p in model.glob("*.safetensors"))


def test_default_generate_peaks_within_the_weights_plus_600_mib(bf16_ckpt: Path) -> None:
    out, peak = _peak_rss(_argv(bf16_ckpt))
    assert peak <= _weights(bf16_ckpt) + 600 * MiB, (
        f"peak RSS {peak / MiB:.0f} MiB, weights {_weights(bf16_ckpt) / MiB:.0f} MiB"
    )
    assert (
        len(out["tokens"]) == 8 and out["fast_tier_slots"] == 4 * 64
    )  # cache 1.0, the RAM tier's buffer


@pytest.mark.skipif(
    MemoryCgroup.unavailable() is not None,
    reason=f"no memory cgroup here: {MemoryCgroup.unavailable()}",
)
def test_disk_offload_under_a_cgroup_plans_to_fit_and_keeps_the_tokens(bf16_ckpt: Path) -> None:
    reference, _ = _peak_rss(_argv(bf16_ckpt, "--offload", "disk"))
    limit = 600 * MiB + int(0.4 * _weights(bf16_ckpt))
    cg = MemoryCgroup(limit, name=f"moe-offload-test-{os.getpid()}")
    try:
        p = cg.run(_argv(bf16_ckpt, "--offload", "disk"), cold=[bf16_ckpt], timeout=600)
        killed = p.returncode < 0 or p.returncode == 137
        assert not killed and p.returncode == 0, (
            f"rc {p.returncode} under {limit / MiB:.0f} MiB (cgroup v{cg.version}): {p.stderr[-800:]}"
        )
        out = json.loads(p.stdout)
        assert out["tokens"] == reference["tokens"]
        assert out["fast_tier_slots"] < reference["fast_tier_slots"], (
            "the plan should have had to shrink the fast tier"
        )
        assert (
            f"cgroup v{cg.version} limit" in p.stderr
        )  # the plan saw the limit (the budget line of its table)
    finally:
        cg.close()
