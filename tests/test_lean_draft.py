"""The drafts run through the targets' lean forward and KV cache (engine/worker/lean_forward.py,
kv_cache.py), which gives transformers' logits on every dense draft architecture.

Same windows through both: packed prefills of different lengths, single-token steps, a
multi-token window after a crop (a rejected speculative tail), for each draft architecture: bit for
bit where decode rows attend through SDPA, to float rounding through the native decode attention
(as for the targets, tests/test_lean_forward.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from engine.native.loaded import native
from engine.speculative.draft import DraftProposer
from engine.weights.forward_support import DENSE_LEAN_MODEL_TYPES
from engine.worker.kv_cache import new_kv_cache
from engine.worker.lean_forward import LeanForward
from engine.worker.loader import load_dense_model
from engine.worker.packed_batch import packed_forward
from engine.worker.runner import ModelRunner, truncate_cache
from models import EMBEDDED_DRAFT
from policies.adaptive_k import AdaptiveK

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


def compare(model_dir: Path, vocab: int, native_attention: bool) -> None:
    lm = load_dense_model(model_dir, device="cpu", dtype="float32")
    assert LeanForward.supports(lm.model)
    runner = ModelRunner(lm)
    assert runner._lean is not None, "the draft's runner must take the lean forward"
    lean = LeanForward(lm.model, fused=False, native_attention=native_attention)
    # Each native norm returns its module's own result on its first call (it checks itself against
    # it, engine/native/layers.py): warm them up so both paths take the same kernels.
    warm = DynamicCache(config=lm.config)
    packed_forward(lm.model, [[3, 4, 5]], [0], [warm], [[2]], lm.device)
    packed_forward(lm.model, [[6]], [3], [warm], [[0]], lm.device)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (7, 12, 3)]
    lc = [new_kv_cache(lm.config) for _ in prompts]
    rc = [DynamicCache(config=lm.config) for _ in prompts]

    def both(
        windows: list[list[int]], starts: list[int], idx: list[int], keep: list[list[int]]
    ) -> None:
        for i, s in zip(
            idx, starts
        ):  # the caller crops a rejected tail, as the draft proposer does
            truncate_cache(lc[i], s)
            truncate_cache(rc[i], s)
        a = lean(windows, starts, [lc[i] for i in idx], keep, lm.device)
        b = packed_forward(lm.model, windows, starts, [rc[i] for i in idx], keep, lm.device)
        for x, y in zip(a, b, strict=True):
            if native_attention:  # the attention's sums in another order
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
            else:
                assert torch.equal(x, y), f"max |Δ| {(x - y).abs().max().item()}"

    both(prompts, [0, 0, 0], [0, 1, 2], [list(range(len(p))) for p in prompts])  # packed prefills
    lens = [len(p) for p in prompts]
    for step in range(3):  # single-token decode steps, all requests packed
        both([[step + 1], [step + 2], [step + 3]], [n + step for n in lens], [0, 1, 2], [[0]] * 3)
    both([[4]], [lens[2] + 3], [2], [[0]])  # one request alone: the single-request paths
    # A window of 3 after rejecting the last 2 positions of request 1, next to a decode of request 0.
    both([[40, 41, 42], [9]], [lens[1] + 1, lens[0] + 3], [1, 0], [[0, 1, 2], [0]])
    assert lc[1].get_seq_length() == lens[1] + 4 and lc[0].get_seq_length() == lens[0] + 4


def test_every_draft_architecture_has_a_parity_test() -> None:
    assert set(ARCH_OPTIONS) == DENSE_LEAN_MODEL_TYPES


@pytest.mark.parametrize("native_attention", [True, False])
@pytest.mark.parametrize("arch", sorted(ARCH_OPTIONS))
def test_lean_forward_matches_transformers(
    tmp_path: Path, arch: str, native_attention: bool
) -> None:
    compare(make_dense(tmp_path / arch, arch), 97, native_attention)


@pytest.mark.parametrize("native_attention", [True, False])
def test_lean_forward_matches_transformers_on_the_embedded_draft(native_attention: bool) -> None:
    compare(EMBEDDED_DRAFT, 8192, native_attention)


def test_the_draft_proposer_runs_the_lean_forward() -> None:
    lm = load_dense_model(EMBEDDED_DRAFT, device="cpu", dtype="float32")
    proposer = DraftProposer(lm, AdaptiveK(k_max=2), None)
    assert proposer.runner._lean is not None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", sorted(ARCH_OPTIONS))
def test_fused_decode_serves_the_drafts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str, dtype: str
) -> None:
    """A dense draft's decode steps and short windows take the fused native step (one call a layer,
    engine/worker/fused_decode.py, its dense layers as GLM-4-MoE's first ones): the same greedy tokens
    as the layer-by-layer lean forward, logits within rounding (f32: the projections' sums in another
    order; bf16: also the C library's expf in SiLU)."""
    if native() is None:
        pytest.skip("needs the native CPU kernels (a C compiler)")
    lm = load_dense_model(make_dense(tmp_path / arch, arch), device="cpu", dtype=dtype)
    lean = LeanForward(lm.model)
    assert lean._fused is not None
    cpu, tol = torch.device("cpu"), (3e-2 if dtype == "bfloat16" else 1e-5)
    prompts = [[3, 4, 5, 6, 7], [9, 8, 7]]

    def run(fused: bool) -> tuple[torch.Tensor, list[int]]:
        kept = lean._fused
        lean._fused = kept if fused else None
        try:
            caches = [new_kv_cache(lm.config) for _ in prompts]
            outs = lean(prompts, [0, 0], caches, [[len(p) - 1] for p in prompts], cpu)
            pos, steps = [len(p) for p in prompts], []
            for _ in range(5):  # both requests decode one token a step
                outs = lean([[int(o.argmax())] for o in outs], pos, caches, [[0], [0]], cpu)
                steps.append(torch.cat(outs))
                pos = [p + 1 for p in pos]
            truncate_cache(caches[0], pos[0] - 2)  # a rejected tail, then a window of 3 rows
            steps.append(lean([[20, 21, 22]], [pos[0] - 2], caches[:1], [[0, 1, 2]], cpu)[0])
            return torch.cat(steps), [c.get_seq_length() for c in caches]
        finally:
            lean._fused = kept

    run(False)  # the norms' first-call checks
    want, want_lengths = run(False)
    counting = CountingLib(native().lib)
    monkeypatch.setattr(native(), "lib", counting)  # the process's kernels: restored after the test
    got, got_lengths = run(True)
    assert lean._fused.state == "ready", lean._fused.why
    assert counting.calls == 6 * lm.config.num_hidden_layers  # every step after the prompts
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert torch.allclose(got.float(), want.float(), rtol=0, atol=tol), (
        (got.float() - want.float()).abs().max()
    )
    assert got_lengths == want_lengths == [len(prompts[0]) + 6, len(prompts[1]) + 5]


class CountingLib:
    """The native library with its decode_layer calls counted."""

    def __init__(self, lib: Any) -> None:
        self._lib, self.calls = lib, 0

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._lib, name)
        if name != "decode_layer":
            return fn

        def counted(*args: Any) -> Any:
            self.calls += 1
            return fn(*args)

        return counted


def test_sliding_window_models_keep_the_transformers_path(tmp_path: Path) -> None:
    path = make_dense(tmp_path / "m", "mistral")
    lm = load_dense_model(path, device="cpu", dtype="float32")
    lm.model.config.sliding_window = (
        4  # windowed attention: the lean path would attend too far back
    )
    assert not LeanForward.supports(lm.model)
    assert ModelRunner(lm)._lean is None
