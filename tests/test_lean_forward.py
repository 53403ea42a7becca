"""The lean target forward (engine/worker/lean_forward.py) is transformers' packed forward without
its wrappers: the same logits bit for bit (all experts resident, so both take the same expert path), on every architecture it claims, in steps that mix
a prompt, plain decodes and a speculative window, in f32 and bf16."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from engine.config import EngineConfig
from engine.worker.lean_forward import LEAN_MODEL_TYPES, LeanForward
from engine.worker.loader import load_model
from engine.worker.packed_batch import packed_forward


def _steps(vocab: int) -> list[tuple[list[list[int]], list[list[int]]]]:
    """Three packed steps for three requests: (windows, rows kept). Step 0 is each request's
    prompt; then request 0 decodes one token, 1 verifies a window of 4, 2 decodes one."""
    g = torch.Generator().manual_seed(7)
    tok = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    prompts = [tok(9), tok(5), tok(12)]
    steps = [(prompts, [[len(p) - 1] for p in prompts])]
    for _ in range(2):
        wins = [tok(1), tok(4), tok(1)]
        steps.append((wins, [[0], [0, 1, 2, 3], [0]]))
    return steps


@pytest.mark.parametrize("arch", sorted(LEAN_MODEL_TYPES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lean_forward_equals_packed_forward(tiny_ckpt, arch: str, dtype: str) -> None:
    om = load_model(tiny_ckpt(arch), EngineConfig(cache_fraction=1.0, dtype=dtype))
    try:
        assert LeanForward.supports(om.model), f"{arch} should take the lean forward"
        lean = LeanForward(om.model)
        # Each native norm returns its module's own result on its first call (it checks itself
        # against it, engine/native/layers.py): warm them up so both paths take the same kernels.
        packed_forward(om.model, [[3, 4, 5]], [0], [DynamicCache(config=om.config)], [[2]], om.device)
        ours, ref = [DynamicCache(config=om.config) for _ in range(3)], [DynamicCache(config=om.config) for _ in range(3)]
        starts = [0, 0, 0]
        for windows, keep in _steps(om.config.vocab_size):
            got = lean(windows, starts, ours, keep, om.device)
            want = packed_forward(om.model, windows, starts, ref, keep, om.device)
            for g, w in zip(got, want):
                assert g.shape == w.shape and torch.equal(g, w), f"{arch} {dtype}: max |Δ| {(g - w).abs().max().item()}"
            for c, r in zip(ours, ref):
                assert torch.equal(c.layers[0].keys, r.layers[0].keys)
            starts = [s + len(w) for s, w in zip(starts, windows)]
    finally:
        om.close()


def test_other_architectures_keep_transformers_forward(tiny_ckpt) -> None:
    om = load_model(tiny_ckpt("mixtral"), EngineConfig())
    try:
        assert not LeanForward.supports(om.model)
    finally:
        om.close()
