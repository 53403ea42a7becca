"""The memory plan counts the dense linears in the bytes the load holds them in: an f32 model's bf16
dense weights (narrow_dense) and --dense-quant int8's codes (quantize_dense). Why it can fail: a plan
sizing them in the compute dtype gives the fast tier up to half of the dense part less than it could
have; a plan saving bytes the load does not (a tied head, a weight of non-bf16 values) overcommits."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.config import EngineConfig
from engine.native.dense_names import QUANTIZED_NAMES
from engine.native.loaded import native
from engine.native.quant_linear import QuantLinear
from engine.plan.probe import probe_checkpoint
from engine.worker.loader import load_model


def _f32_and_held(model: nn.Module, tied: bool) -> tuple[int, int]:
    """(bytes of the dense linears in f32, as a plan without narrowing counts them; bytes the loaded model
    holds them in). A head tied to the embedding is the embedding's weight: in neither, but int8 codes made
    from it are held beside the table."""
    table = model.get_input_embeddings().weight
    linears = {
        id(m): m
        for name, m in model.named_modules()
        if ".experts" not in f".{name}"
        and name.rsplit(".", 1)[-1] in (*QUANTIZED_NAMES, "lm_head")
        and isinstance(m, nn.Linear | QuantLinear)  # nn.Linear: NativeLinear too, after accelerate
    }
    f32 = held = 0
    for child in linears.values():
        if isinstance(child, QuantLinear):
            held += child.qweight.nbytes + child.scale.nbytes
            f32 += 0 if tied and child is model.lm_head else child.qweight.numel() * 4
        elif child.weight is not table:
            held += child.weight.nbytes
            f32 += child.weight.numel() * 4
    return f32, held


@pytest.mark.parametrize(
    "fields",
    [dict(), dict(dense_quant="int8"), dict(bf16_dense=False)],
    ids=["bf16-dense", "int8-dense", "f32-dense"],
)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_plan_saves_what_the_load_holds(tiny_ckpt, fields: dict, tied: bool) -> None:
    path = tiny_ckpt("qwen3_moe", "per-expert", dtype=torch.bfloat16, tie_word_embeddings=tied)
    cfg = EngineConfig(dtype="float32", **fields)
    if native() is None and "dense_quant" not in fields:
        pytest.skip("bf16 dense weights need the native kernels (no C compiler here)")
    wide = probe_checkpoint(path, EngineConfig(dtype="float32", bf16_dense=False)).footprint
    planned = probe_checkpoint(path, cfg).footprint
    om = load_model(path, cfg)
    try:
        f32, held = _f32_and_held(om.model, tied)
    finally:
        om.close()
    assert planned.dense_saved_bytes == f32 - held
    assert wide.dense_bytes - planned.dense_bytes == f32 - held
    if "bf16_dense" in fields:
        assert held == f32  # nothing narrowed, nothing saved
    else:
        assert held < f32
