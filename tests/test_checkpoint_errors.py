"""Bad checkpoints give one clear line that names the file and the problem — never a hang."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from server_fixtures import free_port

from engine.config import EngineConfig
from engine.errors import CheckpointError
from engine.worker.loader import load_model


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.timeout(60)
@pytest.mark.parametrize("offload", ["ram", "disk"])
def test_truncated_safetensors_is_a_clear_error(tiny_ckpt, tmp_path, offload: str) -> None:
    path = _copy(tiny_ckpt("qwen3_moe"), tmp_path / "m")
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated"):
        load_model(path, EngineConfig(offload=offload))


def test_corrupt_header(tiny_ckpt, tmp_path) -> None:
    path = _copy(tiny_ckpt("qwen3_moe"), tmp_path / "m")
    f = path / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:20] = b"not json!!!!"
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt"):
        load_model(path)


def test_missing_weights_and_config(tiny_ckpt, tmp_path) -> None:
    path = _copy(tiny_ckpt("qwen3_moe"), tmp_path / "m")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_model(path)
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json: missing"):
        load_model(path)
    with pytest.raises(CheckpointError, match="not found"):
        load_model(tmp_path / "nowhere")


def test_missing_shard_listed_in_index(tiny_ckpt, tmp_path) -> None:
    path = _copy(tiny_ckpt("qwen3_moe", max_shard_size="100KB"), tmp_path / "m")
    shard = sorted(path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"{shard.name}: missing shard"):
        load_model(path)


def test_unsupported_architecture(tiny_ckpt, tmp_path) -> None:
    path = _copy(tiny_ckpt("qwen3_moe"), tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "llama"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unsupported architecture model_type='llama'"):
        load_model(path)


def test_missing_expert_tensor(tiny_ckpt, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    path = _copy(tiny_ckpt("mixtral"), tmp_path / "m")
    state = load_file(path / "model.safetensors")
    del state["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"experts\.3\.w2\.weight \(layer 1, expert 3\)"):
        load_model(path)


@pytest.mark.timeout(120)
def test_cli_reports_one_line(tiny_ckpt, tmp_path) -> None:
    path = _copy(tiny_ckpt("qwen3_moe"), tmp_path / "m")
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    proc = subprocess.run(
        [sys.executable, "-m", "cli", "generate", "--model", str(path), "--prompt", "hi"],
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 2
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "model.safetensors" in lines[0] and "Traceback" not in proc.stderr, (
        proc.stderr
    )
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "cli",
            "generate",
            "--model",
            str(tiny_ckpt("qwen3_moe")),
            "--prompt",
            "hi",
            "--cache-fraction",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert (
        bad.returncode == 2
        and "cache_fraction must be in (0, 1]" in bad.stderr
        and "Traceback" not in bad.stderr
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "argv, message",
    [
        (["serve", "--model", "/nonexistent-model", "--port", "1"], "model directory not found"),
        (["serve", "--policy", "nope", "--port", "1"], "unknown miss policy 'nope'"),
        (["generate", "--prompt", "hi", "--link", "warp-speed"], "bad --link"),
        (["simulate", "--trace", "/nonexistent.npz"], "trace file not found"),
        (["eval", "--data", "/nonexistent.txt"], "data file not found"),
        (["generate", "--prompt", "hi", "--config", "/nonexistent.yaml"], "cannot read config"),
        # Every setting is checked before the server starts its engine or listens.
        (["serve", "--link", "warp-speed"], "bad --link"),
        (["serve", "--device", "tpu"], "bad device"),
        (["serve", "--cache-fraction", "0"], "cache_fraction must be in (0, 1]"),
        (["serve", "--eviction", "random"], "unknown eviction policy"),
    ],
)
def test_cli_bad_input_is_one_line(argv: list[str], message: str) -> None:
    if argv[0] == "serve":
        port = free_port()
        argv = [*argv, "--port", str(port)] if "--port" not in argv else argv
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "cli", *argv], capture_output=True, text=True, timeout=110
    )
    if argv[0] == "serve":
        assert time.monotonic() - t0 < 60, "a bad setting must fail fast, before any engine starts"
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert p.returncode == 2 and message in p.stderr, p.stderr[-1500:]
    assert "Traceback" not in p.stderr and len(lines) == 1, p.stderr[-1500:]
