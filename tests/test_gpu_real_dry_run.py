"""`bash bench/gpu_real.sh --dry-run` (issue 40): the GPU measurement's script on a CPU at toy sizes,
through every step a CPU can run, so the script cannot rot before a GPU is lent. Slow (about a
minute and a half on 2 cores): CI's full run only."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_dry_run_writes_the_gpu_json_schema(tmp_path: Path) -> None:
    out = tmp_path / "gpu_real.json"
    proc = subprocess.run(
        [
            "bash",
            "bench/gpu_real.sh",
            "--dry-run",
            "--out",
            str(out),
            "--work",
            str(tmp_path / "w"),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=1100,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["device"] == "cpu (dry run)"
    targets = doc["targets"]
    assert set(targets) == {
        "cache 1.0 vs transformers",
        "24 GiB: fetch-all vs accelerate offload",
        "24 GiB: speed-first vs fetch-all",
        "24 GiB share: MoE-SpAc vs fetch-all",
        "24 GiB share: SpecPrefetch vs fetch-all",
    }
    for name, t in targets.items():
        assert set(t) >= {"measured", "target", "met"}, name
        assert t["measured"] > 0 and math.isfinite(t["measured"]), name
        assert t["met"] == (t["measured"] >= t["target"]), name
    by_name = {c["name"]: c for c in doc["cells"]}
    for name, t in targets.items():
        for cell in (t["cell"], t["baseline"]):
            assert by_name[cell]["figures"]["tok_s"] > 0, (name, cell)
    for c in doc["cells"]:
        assert "error" not in c, c
        assert c["command"] and c["figures"], c["name"]
        # No path of this machine but the test's own --out/--work folder: not the checkout's parent, not home.
        command = c["command"].replace(str(tmp_path), "TMP")
        for here in (ROOT.parent, Path.home()):
            assert f"{here}/" not in command, c["command"]
    # Every cell of a CUDA-only step says what stood in for it on the CPU.
    for name in (
        "cuda tests",
        "copy bandwidth",
        "host syncs per token",
        "q30@24GiB accelerate offload",
    ):
        assert by_name[name]["cpu_equivalent"], name
    syncs = by_name["host syncs per token"]["figures"]
    assert syncs["q30 engine cache 1.0"]["host_reads_per_decode_token"] == 1  # the sampled token
    assert by_name["cuda tests"]["figures"]["failed"] == 0
    assert 0 < doc["budget"]["share"] < 1
