"""The lean target forward (engine/worker/lean_forward.py) is transformers' packed forward without
its wrappers: the same logits bit for bit (all experts resident, so both take the same expert path), on every architecture it claims, in steps that mix
a prompt, plain decodes and a speculative window, in f32 and bf16."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from engine.config import EngineConfig
from engine.native.kernels import NativeKernels
from engine.weights.forward_support import MOE_LEAN_MODEL_TYPES
from engine.worker.kv_cache import new_kv_cache
from engine.worker.lean_forward import LeanForward
from engine.worker.loader import load_model
from engine.worker.packed_batch import packed_forward


def _steps(vocab: int) -> list[tuple[list[list[int]], list[list[int]]]]:
    """Five packed steps for three requests: (windows, rows kept). Step 0 is each request's
    prompt; then twice request 0 decodes one token, 1 verifies a window of 4, 2 decodes one; then
    twice all three decode one; then one of them is a chunk of prompt whose logits nobody needs."""
    g = torch.Generator().manual_seed(7)
    tok = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    prompts = [tok(9), tok(5), tok(260)]  # the third past the first rotary table (256 positions)
    steps = [(prompts, [[len(p) - 1] for p in prompts])]
    for _ in range(2):
        wins = [tok(1), tok(4), tok(1)]
        steps.append((wins, [[0], [0, 1, 2, 3], [0]]))
    for _ in range(2):  # all three decoding: the attention path of plain decode steps
        steps.append(([tok(1), tok(1), tok(1)], [[0], [0], [0]]))
    steps.append(
        ([tok(3), tok(2), tok(1)], [[], [1], [0]])
    )  # a prefill chunk whose logits nobody needs
    return steps


@pytest.mark.parametrize("arch", sorted(MOE_LEAN_MODEL_TYPES))  # dense: tests/test_lean_draft.py
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lean_forward_equals_packed_forward(tiny_ckpt, arch: str, dtype: str) -> None:
    om = load_model(tiny_ckpt(arch), EngineConfig(cache_fraction=1.0, dtype=dtype))
    try:
        assert LeanForward.supports(om.model), f"{arch} should take the lean forward"
        lean = LeanForward(om.model)
        # Each native norm and router returns its module's own result on its first call (it checks
        # itself against it, engine/native/): warm them up so both paths take the same kernels.
        warm = DynamicCache(config=om.config)
        packed_forward(om.model, [[3, 4, 5]], [0], [warm], [[2]], om.device)
        packed_forward(om.model, [[6]], [3], [warm], [[0]], om.device)
        ours, ref = (
            [DynamicCache(config=om.config) for _ in range(3)],
            [DynamicCache(config=om.config) for _ in range(3)],
        )
        starts = [0, 0, 0]
        for windows, keep in _steps(om.config.vocab_size):
            got = lean(windows, starts, ours, keep, om.device)
            want = packed_forward(om.model, windows, starts, ref, keep, om.device)
            for g, w in zip(got, want):
                assert g.shape == w.shape and torch.equal(g, w), (
                    f"{arch} {dtype}: max |Δ| {(g - w).abs().max().item()}"
                )
            for c, r in zip(ours, ref):
                assert torch.equal(c.layers[0].keys, r.layers[0].keys)
            starts = [s + len(w) for s, w in zip(starts, windows)]
    finally:
        om.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lean_decode_steps_equal_packed_forward(tiny_ckpt, monkeypatch, dtype: str) -> None:
    """One request decoding token by token: the path of the fused native calls (q/k norm + rotary,
    residual add + norm)."""
    om = load_model(tiny_ckpt("qwen3_moe"), EngineConfig(cache_fraction=1.0, dtype=dtype))
    try:
        calls = {"qk_norm_rope": 0, "add_rmsnorm": 0}
        for name in calls:
            original = getattr(NativeKernels, name)

            def counted(self, *args, _name=name, _original=original, **kwargs):  # noqa: ANN001, ANN202, ANN003
                calls[_name] += 1
                return _original(self, *args, **kwargs)

            monkeypatch.setattr(NativeKernels, name, counted)
        lean = LeanForward(om.model)
        warm = DynamicCache(config=om.config)  # the norms' and the router's first calls (see above)
        packed_forward(om.model, [[3, 4, 5]], [0], [warm], [[2]], om.device)
        packed_forward(om.model, [[6]], [3], [warm], [[0]], om.device)
        ours, ref = DynamicCache(config=om.config), DynamicCache(config=om.config)
        window, start = [5, 9, 11, 7, 6, 3], 0
        for step in range(6):
            got = lean([window], [start], [ours], [[len(window) - 1]], om.device)[0]
            want = packed_forward(
                om.model, [window], [start], [ref], [[len(window) - 1]], om.device
            )[0]
            assert torch.equal(got, want), f"step {step}: max |Δ| {(got - want).abs().max().item()}"
            start += len(window)
            window = [int(got.argmax())]
        layers = om.config.num_hidden_layers
        assert calls["qk_norm_rope"] == 6 * layers, (
            "every step, the 6-row prompt too, should take the fused q/k call"
        )
        assert calls["add_rmsnorm"] == 6 * 2 * layers, (
            "and the fused residual add + norm (the 6-row prompt too)"
        )
    finally:
        om.close()


def test_other_architectures_keep_transformers_forward(tiny_ckpt) -> None:
    om = load_model(tiny_ckpt("mixtral"), EngineConfig())
    try:
        assert not LeanForward.supports(om.model)
    finally:
        om.close()


def test_lean_single_request_without_rows(tiny_ckpt) -> None:
    """A prompt chunk that keeps no logits (chunked prefill): an empty result, the cache filled."""
    om = load_model(tiny_ckpt("qwen3_moe"), EngineConfig(cache_fraction=1.0))
    try:
        cache = DynamicCache(config=om.config)
        out = LeanForward(om.model)([[5, 6, 7]], [0], [cache], [[]], om.device)
        assert len(out) == 1 and out[0].shape == (0, om.config.vocab_size)
        assert cache.get_seq_length() == 3
    finally:
        om.close()


def _count_native_attention(monkeypatch) -> list[int]:
    """A one-element list counting NativeKernels.decode_attention calls from now on."""
    calls = [0]
    original = NativeKernels.decode_attention

    def counted(self, *args, **kwargs):  # noqa: ANN001, ANN202, ANN003
        calls[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(NativeKernels, "decode_attention", counted)
    return calls


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "glm4_moe"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_decode_attention_agrees_with_packed_forward(
    tiny_ckpt, monkeypatch, arch: str, dtype: str
) -> None:
    """With the engine's in-place KV cache a decode row's attention is one native call (q/k norms,
    rotary, KV append, softmax attention): its sums run in another order than SDPA's, so the logits
    agree to rounding (f32: 1e-6; bf16: 1e-2, about one of its ulps) and the greedy tokens are the same."""
    om = load_model(tiny_ckpt(arch), EngineConfig(cache_fraction=1.0, dtype=dtype))
    try:
        calls = _count_native_attention(monkeypatch)
        lean = LeanForward(
            om.model, fused=False
        )  # the layer-by-layer path (the fused one: tests/test_fused_decode.py)
        warm = new_kv_cache(om.config)  # the norms' and the router's first calls check themselves
        lean([[3, 4, 5]], [0], [warm], [[2]], om.device)
        lean([[6]], [3], [warm], [[0]], om.device)
        calls[0] = 0
        ours, ref = new_kv_cache(om.config), DynamicCache(config=om.config)
        window, start = [5, 9, 11, 7, 6, 3], 0
        tol = (
            1e-6 if dtype == "float32" else 1e-2
        )  # measured: at most 1.5e-7 and 3.9e-3 (one bf16 ulp near 1)
        for step in range(8):
            got = lean([window], [start], [ours], [[len(window) - 1]], om.device)[0]
            want = packed_forward(
                om.model, [window], [start], [ref], [[len(window) - 1]], om.device
            )[0]
            assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol), (
                f"step {step}: max |Δ| {(got - want).abs().max().item()}"
            )
            assert int(got.argmax()) == int(want.argmax())
            start += len(window)
            window = [int(want.argmax())]
        assert calls[0] == 8 * om.config.num_hidden_layers, (
            "every step's layers, the prompt's too, take the native attention"
        )
        assert ours.get_seq_length() == ref.get_seq_length() == start
        for a, b in zip(ours.layers, ref.layers):  # the cache holds the same keys and values
            assert torch.allclose(a.keys.float(), b.keys.float(), atol=tol, rtol=tol)
            assert torch.allclose(a.values.float(), b.values.float(), atol=tol, rtol=tol)
    finally:
        om.close()


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "glm4_moe"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_compute_alike_whatever_the_chunking(tiny_ckpt, arch: str, dtype: str) -> None:
    """Batch invariance of the layer-by-layer path: a sequence fed as one prompt chunk, in chunks of 3
    (chunked prefill, a verification window), or token by token (decode), and beside another request's
    rows, gives every position bit-identical logits and KV: each row's attention, linears, norms, router
    and experts compute as the row alone would."""
    om = load_model(tiny_ckpt(arch), EngineConfig(cache_fraction=1.0, dtype=dtype))
    try:
        lean = LeanForward(om.model, fused=False)
        seq = [
            5,
            9,
            11,
            7,
            6,
            3,
            12,
            8,
            4,
            10,
            2,
            13,
            5,
            6,
            9,
            11,
            3,
            7,
            8,
            12,
            4,
        ]  # > 16: attention blocks
        lean([[3, 4, 5]], [0], [new_kv_cache(om.config)], [[2]], om.device)  # first-call checks

        def run(chunks: list[int], beside: bool) -> tuple[torch.Tensor, list]:
            cache, other, start, rows = new_kv_cache(om.config), new_kv_cache(om.config), 0, []
            for n in chunks:
                window = seq[start : start + n]
                keep = list(range(n))
                if beside:  # another request's two rows in the same step
                    at = other.get_seq_length()
                    out = lean(
                        [window, [7, 8]], [start, at], [cache, other], [keep, [1]], om.device
                    )[0]
                else:
                    out = lean([window], [start], [cache], [keep], om.device)[0]
                rows.append(out)
                start += n
            return torch.cat(rows), [
                (layer.keys.clone(), layer.values.clone()) for layer in cache.layers
            ]

        ref_logits, ref_kv = run([len(seq)], beside=False)
        for chunks, beside in (([1] * len(seq), False), ([3] * 7, False), ([4, 1, 16], True)):
            logits, kv = run(chunks, beside)
            assert torch.equal(logits, ref_logits), (
                f"{chunks}: max |Δ| {(logits - ref_logits).abs().max()}"
            )
            assert all(
                torch.equal(a, b) and torch.equal(c, d) for (a, c), (b, d) in zip(kv, ref_kv)
            )
    finally:
        om.close()


def test_native_decode_attention_for_several_requests(tiny_ckpt, monkeypatch) -> None:
    """A batched decode step (one row for each of two requests at different lengths): one native call each."""
    om = load_model(tiny_ckpt("qwen3_moe"), EngineConfig(cache_fraction=1.0, dtype="float32"))
    try:
        calls = _count_native_attention(monkeypatch)
        lean = LeanForward(
            om.model, fused=False
        )  # the layer-by-layer path (the fused one: tests/test_fused_decode.py)
        warm = new_kv_cache(om.config)  # the norms' first calls check themselves
        lean([[3, 4, 5]], [0], [warm], [[2]], om.device)
        lean([[6]], [3], [warm], [[0]], om.device)
        ours = [new_kv_cache(om.config), new_kv_cache(om.config)]
        refs = [DynamicCache(config=om.config), DynamicCache(config=om.config)]
        prompts = [[5, 9, 11, 7], [8, 2]]
        for c, r, p in zip(ours, refs, prompts):
            lean([p], [0], [c], [[len(p) - 1]], om.device)
            packed_forward(om.model, [p], [0], [r], [[len(p) - 1]], om.device)
        starts, rows = [4, 2], [[12], [13]]
        calls[0] = 0
        for _ in range(3):
            got = lean(rows, starts, ours, [[0], [0]], om.device)
            want = packed_forward(om.model, rows, starts, refs, [[0], [0]], om.device)
            for g, w in zip(got, want):
                assert torch.allclose(g, w, atol=1e-6, rtol=1e-6)
            assert all(
                layer.keys.shape[-2] == s + 1 for c, s in zip(ours, starts) for layer in c.layers
            )
            starts = [s + 1 for s in starts]
            rows = [[int(w.argmax())] for w in want]
        assert calls[0] == 3 * 2 * om.config.num_hidden_layers
    finally:
        om.close()
