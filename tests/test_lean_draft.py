"""The drafts' lean forward (engine/speculative/lean_dense.py) gives transformers' logits.

Same windows through both: packed prefills of different lengths, single-token steps, a
multi-token window after a crop (a rejected speculative tail), for each draft architecture.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from engine.speculative.lean_dense import LeanDenseModel
from engine.worker.loader import load_dense_model
from engine.worker.runner import ModelRunner, truncate_cache
from models import EMBEDDED_DRAFT

ARCH_OPTIONS = {
    "qwen3": {"head_dim": 16},  # q/k norms
    "qwen2": {},  # q/k/v biases
    "llama": {"head_dim": 16},
    "mistral": {"head_dim": 16, "sliding_window": None},
}


def make_dense(path: Path, arch: str) -> Path:
    cfg = AutoConfig.for_model(
        arch,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=97,
        max_position_embeddings=256,
        **ARCH_OPTIONS[arch],
    )
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # random biases and norm weights, so a dropped term would show
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(0.5 if "norm" in name else 0.0, 0.2)
    model.save_pretrained(path)
    return path


def compare(model_dir: Path, vocab: int) -> None:
    lm = load_dense_model(model_dir, device="cpu", dtype="float32")
    assert LeanDenseModel.supports(lm.model)
    lean, ref = LeanDenseModel(lm.model), ModelRunner(lm)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (7, 12, 3)]
    lc = [lean.new_cache() for _ in prompts]
    rc = [DynamicCache(config=lm.config) for _ in prompts]

    def both(
        windows: list[list[int]], starts: list[int], idx: list[int], keep: list[list[int]]
    ) -> None:
        for i, s in zip(
            idx, starts
        ):  # the caller crops a rejected tail, as the draft proposer does
            lc[i].crop(s)
            truncate_cache(rc[i], s)
        a = lean.forward(windows, starts, [lc[i] for i in idx], keep)
        b = ref.forward(windows, starts, [rc[i] for i in idx], keep)
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)

    both(prompts, [0, 0, 0], [0, 1, 2], [list(range(len(p))) for p in prompts])  # packed prefills
    lens = [len(p) for p in prompts]
    for step in range(3):  # single-token decode steps, all requests packed
        both([[step + 1], [step + 2], [step + 3]], [n + step for n in lens], [0, 1, 2], [[0]] * 3)
    # A window of 3 after rejecting the last 2 positions of request 1, next to a decode of request 0.
    both([[40, 41, 42], [9]], [lens[1] + 1, lens[0] + 3], [1, 0], [[0, 1, 2], [0]])
    assert lc[1].length == lens[1] + 4 and lc[0].length == lens[0] + 4


@pytest.mark.parametrize("arch", sorted(ARCH_OPTIONS))
def test_lean_forward_matches_transformers(tmp_path: Path, arch: str) -> None:
    compare(make_dense(tmp_path / arch, arch), 97)


def test_lean_forward_matches_transformers_on_the_embedded_draft() -> None:
    compare(EMBEDDED_DRAFT, 8192)


def test_sliding_window_models_keep_the_transformers_path(tmp_path: Path) -> None:
    path = make_dense(tmp_path / "m", "mistral")
    lm = load_dense_model(path, device="cpu", dtype="float32")
    lm.model.config.sliding_window = (
        4  # windowed attention: the lean path would attend too far back
    )
    assert not LeanDenseModel.supports(lm.model)
