"""Experts that ship quantized: gpt-oss MXFP4 and FP8 block-quantized (DeepSeek-V3 names). The engine
reads, moves and caches their own bytes and must equal transformers running the dequantized weights
(dequantized, for MXFP4, by transformers' own converter)."""

from __future__ import annotations

import json
import math

import torch
from safetensors.torch import load_file, save_file
from tiny_models import load_reference

from engine.config import EngineConfig
from engine.core.completion import generate
from engine.worker.loader import load_model
from engine.worker.parity import prompt_logits
from engine.worker.sampling import SamplingParams


def _copy_dir(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _compare(quant_dir, float_dir, expect_format: str) -> None:
    ref = load_reference(float_dir)
    ids = torch.randint(
        3, ref.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(3)
    )
    with torch.no_grad():
        ref_logits = ref(ids).logits[0]
        ref_tokens = ref.generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=False)[
            0, 24:
        ].tolist()
    for offload in ("ram", "disk"):
        om = load_model(quant_dir, EngineConfig(cache_fraction=0.5, offload=offload))
        try:
            assert om.executor.fmt.name == expect_format
            diff = (
                (prompt_logits(om, ids[0].tolist()) - ref_logits).abs().max().item()
            )  # through the engine's runner
            assert diff <= 1e-4, f"{offload}: max |Δlogit| = {diff}"
            assert (
                generate(
                    om, ids[0].tolist(), SamplingParams(max_tokens=10, min_tokens=10)
                ).token_ids
                == ref_tokens
            )
            snap = om.stats.snapshot()
            nbytes = om.transfers.tier.expert_nbytes(om.moe_layers[0], 0)
            assert (
                nbytes == om.store.slot_bytes
                and snap["bytes_moved"] == snap["transfers"]["demand"] * nbytes > 0
            )
        finally:
            om.close()


def mxfp4_checkpoints(tiny_ckpt, tmp_path):  # noqa: ANN001, ANN201
    """A tiny gpt-oss checkpoint with random MXFP4 experts under the released names, and the same model with
    those experts dequantized by transformers' own converter: (mxfp4 dir, float dir)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    # H = 96 and I = 32 keep [H, 2I] non-square, so a transposition mistake cannot pass.
    src = tiny_ckpt("gpt_oss", hidden=96, intermediate_size=32)
    state = load_file(src / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    E, H, I = cfg["num_local_experts"], cfg["hidden_size"], cfg["intermediate_size"]
    g = torch.Generator().manual_seed(0)
    quant, dense = dict(state), dict(state)
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp.experts"
        for name, rows, cols in (("gate_up_proj", 2 * I, H), ("down_proj", H, I)):
            blocks = torch.randint(
                0, 256, (E, rows, cols // 32, 16), generator=g, dtype=torch.uint8
            )
            scales = torch.randint(119, 125, (E, rows, cols // 32), generator=g, dtype=torch.uint8)
            del quant[f"{p}.{name}"]
            quant[f"{p}.{name}_blocks"], quant[f"{p}.{name}_scales"] = (
                blocks,
                scales,
            )  # released gpt-oss names
            dense[f"{p}.{name}"] = convert_moe_packed_tensors(
                blocks, scales, dtype=torch.float32
            ).contiguous()
        for b in ("gate_up_proj_bias", "down_proj_bias"):
            quant[f"{p}.{b}"] = state[f"{p}.{b}"].to(torch.bfloat16)  # biases ship in bf16
            dense[f"{p}.{b}"] = quant[f"{p}.{b}"].float()
    qdir, fdir = _copy_dir(src, tmp_path / "mxfp4"), _copy_dir(src, tmp_path / "dense")
    save_file(quant, str(qdir / "model.safetensors"), metadata={"format": "pt"})
    save_file(dense, str(fdir / "model.safetensors"), metadata={"format": "pt"})
    return qdir, fdir


def test_gpt_oss_mxfp4(tiny_ckpt, tmp_path) -> None:
    qdir, fdir = mxfp4_checkpoints(tiny_ckpt, tmp_path)
    _compare(qdir, fdir, "mxfp4")


def _fp8(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block-quantize like the released FP8 checkpoints: (fp8 weight, scale_inv, dequantized weight)."""
    rows, cols = w.shape
    sr, sc = math.ceil(rows / block), math.ceil(cols / block)
    pad = torch.zeros(sr * block, sc * block)
    pad[:rows, :cols] = w
    amax = pad.view(sr, block, sc, block).abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale_inv = amax / 448.0
    full = scale_inv.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    q = (w / full).to(torch.float8_e4m3fn)
    return q, scale_inv, q.float() * full


def test_deepseek_fp8_block(tiny_ckpt, tmp_path) -> None:
    src = tiny_ckpt("deepseek_v3")
    state = load_file(src / "model.safetensors")
    block = 16  # released checkpoints use 128; 16 gives these tiny matrices several blocks each
    quant, dense = {}, {}
    for name, w in state.items():
        fp8 = (
            ".experts." in name or ".shared_experts." in name or ".self_attn." in name
        ) and name.endswith("proj.weight")
        if fp8 and w.dim() == 2:
            q, s, dq = _fp8(w, block)
            quant[name], quant[name + "_scale_inv"], dense[name] = q, s, dq
        else:
            quant[name] = dense[name] = w
    qdir, fdir = _copy_dir(src, tmp_path / "fp8"), _copy_dir(src, tmp_path / "dense")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [block, block],
    }
    (qdir / "config.json").write_text(json.dumps(cfg))
    save_file(quant, str(qdir / "model.safetensors"), metadata={"format": "pt"})
    save_file(dense, str(fdir / "model.safetensors"), metadata={"format": "pt"})
    _compare(qdir, fdir, "fp8-block")


def test_mxfp4_dequant_is_each_code_times_its_power_of_two() -> None:
    """The table dequant equals e2m1 value x 2^(scale - 127) computed directly, for every code and
    every finite scale (255 is NaN in the OCP MX spec), in bf16 and f32."""
    from engine.experts.formats.native_quant import _FP4, dequant_mxfp4

    blocks = torch.arange(256, dtype=torch.uint8).repeat(255, 1).view(255, 16, 16)  # every byte
    scales = torch.arange(255, dtype=torch.uint8).view(255, 1).expand(255, 16).contiguous()
    lo, hi = blocks & 15, blocks >> 4
    codes = torch.stack((lo, hi), dim=-1).flatten(-2).long()  # [255, 16, 32], low nibble first
    for dt in (torch.bfloat16, torch.float32):
        want = (
            torch.tensor(_FP4, dtype=torch.float64)[codes]
            * torch.exp2(scales.double() - 127).unsqueeze(-1)
        ).to(dt)
        got = dequant_mxfp4(blocks, scales, dt)
        assert got.dtype == dt and torch.equal(got, want.flatten(-2))
