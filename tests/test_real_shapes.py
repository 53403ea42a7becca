"""bench/real_shapes.py's builder at a tiny width and depth (the real shapes are for the benchmark only):
released names and dtypes that transformers and the engine both load, streamed shard by shard."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from bench.real_shapes import RELEASED, TINY_WIDTHS, config_for, entries, write_checkpoint
from engine.config import EngineConfig
from engine.core.completion import generate
from engine.weights.safetensors_index import index_checkpoint
from engine.worker.loader import load_model
from engine.worker.parity import prompt_logits
from engine.worker.sampling import SamplingParams


def test_released_sizes_are_the_real_ones() -> None:
    """The full configs' tensors add up to the released checkpoints' sizes (from the headers they would have)."""
    sizes = {m: sum(e.nbytes for e in entries(config_for(m))) / 1e9 for m in RELEASED}
    assert 60.5 < sizes["qwen3-30b-a3b"] < 61.5  # 61.1 GB released, bf16
    assert 13.5 < sizes["gpt-oss-20b"] < 14.0  # 13.8 GB, MXFP4 experts
    assert 158 < sizes["qwen3-next-80b-a3b"] < 161  # 159 GB, bf16


@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "qwen3-next-80b-a3b"])
def test_tiny_builds_match_transformers(tmp_path, model: str) -> None:
    path = write_checkpoint(
        tmp_path / model,
        model,
        layers=4 if "next" in model else 2,
        shard_bytes=200_000,
        progress=False,
        **TINY_WIDTHS[model],
    )
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # several shards, as released
    tensors = index_checkpoint(path)
    assert all(t.dtype == "bfloat16" for t in tensors.values())
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in tensors
    ref, info = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = list(range(3, 19))
    with torch.no_grad():
        want = ref.eval()(torch.tensor([ids])).logits[0]
        greedy = ref.generate(
            torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False
        )[0, len(ids) :].tolist()
    om = load_model(path, EngineConfig(dtype="float32", cache_fraction=0.25, offload="disk"))
    try:
        assert (prompt_logits(om, ids) - want).abs().max().item() <= 1e-4
        assert generate(om, ids, SamplingParams(max_tokens=8, min_tokens=8)).token_ids == greedy
    finally:
        om.close()


def test_tiny_gpt_oss_has_mxfp4_experts_as_released(tmp_path, capsys) -> None:
    from cli.main import main

    path = write_checkpoint(
        tmp_path / "oss", "gpt-oss-20b", layers=2, progress=False, **TINY_WIDTHS["gpt-oss-20b"]
    )
    tensors = index_checkpoint(path)
    blocks, scales = (
        tensors["model.layers.1.mlp.experts.gate_up_proj_blocks"],
        tensors["model.layers.1.mlp.experts.down_proj_scales"],
    )
    assert (blocks.dtype, blocks.shape) == ("uint8", (4, 64, 2, 16)) and (
        scales.dtype,
        scales.shape,
    ) == ("uint8", (4, 64, 1))
    assert tensors["model.layers.1.mlp.experts.gate_up_proj_bias"].dtype == "bfloat16"
    om = load_model(path, EngineConfig(cache_fraction=0.5, offload="disk"))
    try:
        assert om.executor.fmt.name == "mxfp4"  # the slots hold the released bytes
        out = generate(om, list(range(3, 11)), SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(out.token_ids) == 4
        assert torch.isfinite(prompt_logits(om, list(range(3, 11)))).all()
    finally:
        om.close()
    capsys.readouterr()
    assert main(["plan", "--model", str(path), "--device", "cpu"]) == 0
    assert "experts mxfp4" in capsys.readouterr().out


def test_sparse_build_writes_headers_only(tmp_path) -> None:
    path = write_checkpoint(
        tmp_path / "s",
        "qwen3-30b-a3b",
        layers=2,
        progress=False,
        sparse=True,
        **TINY_WIDTHS["qwen3-30b-a3b"],
    )
    tensors = index_checkpoint(path)  # sizes check out against the headers
    assert sum(t.nbytes for t in tensors.values()) == sum(
        e.nbytes for e in entries(config_for("qwen3-30b-a3b", 2, **TINY_WIDTHS["qwen3-30b-a3b"]))
    )
