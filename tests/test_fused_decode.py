"""The fused decode step (engine/worker/fused_decode.py, engine/native/decode_layer.c): one native call
per decoder layer computes what the layer-by-layer lean forward computes (bf16: bit for bit; f32:
within rounding, its projections being the native gemv rather than torch's), and it declines, step by
step, wherever it does not apply."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.worker import lean_forward as lean_module
from engine.worker.kv_cache import new_kv_cache
from engine.worker.lean_forward import LeanForward
from engine.worker.loader import load_model
from engine.worker.runner import truncate_cache

pytestmark = pytest.mark.skipif(
    lean_module.native() is None, reason="needs the native CPU kernels (a C compiler)"
)


class CountingLib:
    """The native library with its decode_layer calls counted."""

    def __init__(self, lib) -> None:  # noqa: ANN001
        self._lib, self.calls = lib, 0

    def __getattr__(self, name: str):  # noqa: ANN204
        fn = getattr(self._lib, name)
        if name != "decode_layer":
            return fn

        def counted(*args):  # noqa: ANN002, ANN202
            self.calls += 1
            return fn(*args)

        return counted


def _decode(
    lean: LeanForward,
    config,
    fused: bool,
    tokens: int = 12,
    prompt: tuple[int, ...] = (3, 4, 5, 6, 7),
):  # noqa: ANN001
    """Greedy decode from `prompt` with the fused path allowed or not: (logits of every step [T, V], the cache)."""
    if not fused:
        kept, lean._fused = lean._fused, None
        try:
            return _decode(lean, config, True, tokens, prompt)
        finally:
            lean._fused = kept
    cache = new_kv_cache(config)
    out = lean([list(prompt)], [0], [cache], [[len(prompt) - 1]], torch.device("cpu"))[0]
    logits, pos = [out], len(prompt)
    for _ in range(tokens):
        out = lean([[int(out.argmax())]], [pos], [cache], [[0]], torch.device("cpu"))[0]
        logits.append(out)
        pos += 1
    return torch.cat(logits), cache


# qwen2_moe: q/k/v biases and a gated shared expert; glm4_moe: a dense first layer, the sigmoid router, a shared expert
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "glm4_moe"])
@pytest.mark.parametrize(
    ("dtype", "quant"), [("float32", "none"), ("bfloat16", "none"), ("bfloat16", "int8")]
)
def test_fused_decode_equals_the_layer_by_layer_path(
    tiny_ckpt, tmp_path, monkeypatch, arch: str, dtype: str, quant: str
) -> None:
    om = load_model(
        tiny_ckpt(arch),
        EngineConfig(
            cache_fraction=1.0, dtype=dtype, expert_quant=quant, quant_cache_dir=str(tmp_path)
        ),
    )
    try:
        lean = LeanForward(om.model)
        _decode(lean, om.config, fused=False)  # the norms' and the router's first-call checks
        before = sum(om.stats.hits)
        want, want_cache = _decode(lean, om.config, fused=False)
        hits_unfused, before = sum(om.stats.hits) - before, sum(om.stats.hits)
        counting = CountingLib(lean._fused.kernels.lib)
        monkeypatch.setattr(
            lean._fused.kernels, "lib", counting
        )  # the process's kernels: restored after the test
        got, got_cache = _decode(lean, om.config, fused=True)
        assert lean._fused.state == "ready", lean._fused.why
        layers = om.config.num_hidden_layers
        assert counting.calls == 12 * layers  # every decode step, one call a layer; not the prompt
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        if dtype == "bfloat16" and arch == "qwen3_moe":
            assert torch.equal(got, want)
            assert all(
                torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
                for a, b in zip(got_cache.layers, want_cache.layers)
            )
        elif (
            dtype == "bfloat16"
        ):  # SiLU, sigmoids and the f32 router: the C library's expf and sums against torch's
            assert torch.allclose(got.float(), want.float(), rtol=0, atol=3e-2), (
                (got.float() - want.float()).abs().max()
            )
        else:  # f32: the projections' sums in another order
            assert torch.allclose(got, want, rtol=0, atol=1e-5), (got - want).abs().max()
        assert got_cache.get_seq_length() == want_cache.get_seq_length() == 5 + 12
        assert (
            sum(om.stats.hits) - before == hits_unfused > 0
        )  # the same hit counts as the resident lane's
    finally:
        om.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_decode_adds_projection_biases(tiny_ckpt, dtype: str) -> None:
    """Attention projections with biases (Qwen3-MoE's attention_bias), set to random values here so that the
    adds show: the same tokens as the layer-by-layer path (bf16: the same logits)."""
    om = load_model(
        tiny_ckpt("qwen3_moe", attention_bias=True), EngineConfig(cache_fraction=1.0, dtype=dtype)
    )
    try:
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for layer in om.model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                    layer.self_attn.o_proj,
                ):
                    assert proj.bias is not None
                    proj.bias.copy_(torch.randn(proj.bias.shape, generator=g) * 0.5)
        lean = LeanForward(om.model)
        _decode(lean, om.config, fused=False)  # the first-call checks
        want, _ = _decode(lean, om.config, fused=False)
        got, _ = _decode(lean, om.config, fused=True)
        assert lean._fused.state == "ready", lean._fused.why
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        assert (
            torch.equal(got, want)
            if dtype == "bfloat16"
            else torch.allclose(got, want, rtol=0, atol=1e-5)
        )
    finally:
        om.close()


def test_fused_decode_declines_other_layers_and_says_why(tiny_ckpt) -> None:
    """A layer it cannot run (here a shared expert with another activation) keeps the whole model layer by layer."""
    om = load_model(tiny_ckpt("glm4_moe"), EngineConfig(cache_fraction=1.0, dtype="float32"))
    try:
        om.model.model.layers[1].mlp.shared_experts.act_fn = torch.nn.GELU()
        lean = LeanForward(om.model)
        _decode(lean, om.config, fused=True, tokens=3)
        assert (
            lean._fused.state == "off"
            and "shared expert is not a plain SwiGLU MLP" in lean._fused.why
        ), lean._fused.why
    finally:
        om.close()


def test_fused_decode_waits_while_experts_can_miss_or_someone_listens(tiny_ckpt) -> None:
    """A partial fast tier (experts can miss) and a routing listener each keep the layer-by-layer path."""
    om = load_model(
        tiny_ckpt("qwen3_moe"),
        EngineConfig(cache_fraction=0.25, dtype="float32", offload="ram", prefetch="none"),
    )
    try:
        lean = LeanForward(om.model)
        assert not om.store.complete
        _decode(lean, om.config, fused=True, tokens=4)
        assert lean._fused.state == "pending"  # never built: the store can miss
    finally:
        om.close()
    om = load_model(tiny_ckpt("qwen3_moe"), EngineConfig(cache_fraction=1.0, dtype="float32"))
    try:
        lean = LeanForward(om.model)
        seen: list[int] = []
        unsubscribe = om.bus.subscribe(lambda ev: seen.append(ev.layer))
        _decode(lean, om.config, fused=True, tokens=4)
        assert (
            lean._fused.state == "pending" and len(seen) == (4 + 1) * om.config.num_hidden_layers
        )  # every layer published
        unsubscribe()
        _decode(lean, om.config, fused=True, tokens=4)
        assert lean._fused.state == "ready"
    finally:
        om.close()


def test_fused_decode_hands_over_past_the_native_attention_range(tiny_ckpt, monkeypatch) -> None:
    """Past NATIVE_ATTENTION_MAX_POSITIONS cached positions the step goes back to the layer-by-layer path
    (SDPA); the tokens are those of a run that never fused."""
    monkeypatch.setattr(lean_module, "NATIVE_ATTENTION_MAX_POSITIONS", 10)
    om = load_model(tiny_ckpt("qwen3_moe"), EngineConfig(cache_fraction=1.0, dtype="bfloat16"))
    try:
        lean = LeanForward(om.model)
        _decode(lean, om.config, fused=False)
        want, _ = _decode(lean, om.config, fused=False, tokens=12)
        counting = CountingLib(lean._fused.kernels.lib)
        monkeypatch.setattr(
            lean._fused.kernels, "lib", counting
        )  # the process's kernels: restored after the test
        got, _ = _decode(lean, om.config, fused=True, tokens=12)
        # Steps at 5..9 cached positions fuse (the new row makes at most 10); from 10 on, SDPA.
        assert counting.calls == 5 * om.config.num_hidden_layers
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    finally:
        om.close()


def test_the_forward_follows_the_engine_config(tiny_ckpt) -> None:
    """--forward lean keeps every step layer by layer, --forward transformers uses transformers' forward; both
    say so in the plan and count their steps; the tokens are the default's."""
    from engine.core.completion import generate
    from engine.worker.runner import ModelRunner
    from engine.worker.sampling import SamplingParams

    tokens, steps = {}, {}
    for forward in ("auto", "lean", "transformers"):
        om = load_model(
            tiny_ckpt("qwen3_moe"),
            EngineConfig(cache_fraction=1.0, dtype="float32", forward=forward),
        )
        try:
            runner = ModelRunner(om)
            assert om.plan.forward == {"auto": "fused"}.get(forward, forward)
            assert (runner._lean is None) == (forward == "transformers")
            assert forward != "lean" or runner._lean._fused is None
            tokens[forward] = generate(om, [3, 4, 5, 6], SamplingParams(max_tokens=10)).token_ids
            steps[forward] = om.stats.snapshot()["steps"]["decode"]
        finally:
            om.close()
    assert tokens["lean"] == tokens["auto"] == tokens["transformers"]
    assert (
        steps["auto"].get("fused", 0) >= 7
        and set(steps["lean"]) == {"lean"}
        and set(steps["transformers"]) == {"transformers"}
    )


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe"])
def test_fused_decode_publishes_routing_to_deferred_listeners(
    tiny_ckpt, monkeypatch, arch: str
) -> None:
    """A listener that may see a step's routing after the forward (the speculative sensor's kind) does not keep
    the step off the fused path: the native call writes each layer's routing, published after it, the same
    experts in the same order as the layer-by-layer path publishes them."""
    om = load_model(tiny_ckpt(arch), EngineConfig(cache_fraction=1.0, dtype="bfloat16"))
    try:
        lean = LeanForward(om.model)
        _decode(lean, om.config, fused=False)  # the first-call checks
        events: dict[bool, list] = {False: [], True: []}
        for fused in (False, True):
            unsubscribe = om.bus.subscribe(events[fused].append, live=False)
            counting = CountingLib(lean._fused.kernels.lib)
            monkeypatch.setattr(lean._fused.kernels, "lib", counting)
            _decode(lean, om.config, fused=fused, tokens=6)
            unsubscribe()
            assert counting.calls == (6 * om.config.num_hidden_layers if fused else 0)
        want, got = events[False], events[True]
        assert [e.layer for e in got] == [e.layer for e in want] and len(got) > 6
        for a, b in zip(want, got):
            assert torch.equal(a.ids, b.ids), (a.layer, a.ids, b.ids)
            assert torch.allclose(a.weights.float(), b.weights.float(), atol=1e-2)
            assert torch.allclose(a.x.float(), b.x.float(), atol=3e-2)
            assert a.logits.shape == b.logits.shape
    finally:
        om.close()


def _with_fused(lean: LeanForward, fused: bool, run):  # noqa: ANN001, ANN202
    """run() with the fused path allowed or not."""
    kept = lean._fused
    if not fused:
        lean._fused = None
    try:
        return run()
    finally:
        lean._fused = kept


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "glm4_moe"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_step_takes_batched_decode_and_verification_windows(
    tiny_ckpt, monkeypatch, arch: str, dtype: str
) -> None:
    """Several requests' decode rows, and one request's verification window (rows at consecutive positions,
    attending causally, then rolled back), in one native call a layer: the same greedy tokens and logits
    within rounding as the layer-by-layer path, and the caches hold the same positions."""
    om = load_model(tiny_ckpt(arch), EngineConfig(cache_fraction=1.0, dtype=dtype))
    cpu, tol = torch.device("cpu"), (3e-2 if dtype == "bfloat16" else 1e-5)
    prompts = [(3, 4, 5, 6, 7), (9, 8, 7), (11, 12, 13, 14)]
    try:
        lean = LeanForward(om.model)
        _decode(lean, om.config, fused=False)  # the first-call checks

        def batched() -> tuple[torch.Tensor, list]:
            caches = [new_kv_cache(om.config) for _ in prompts]
            outs = [
                lean([list(p)], [0], [c], [[len(p) - 1]], cpu)[0] for p, c in zip(prompts, caches)
            ]
            pos, steps = [len(p) for p in prompts], []
            for _ in range(6):
                outs = lean(
                    [[int(o.argmax())] for o in outs], pos, caches, [[0]] * len(prompts), cpu
                )
                steps.append(torch.cat(outs))
                pos = [p + 1 for p in pos]
            return torch.stack(steps), caches

        def window() -> tuple[torch.Tensor, torch.Tensor]:
            cache = new_kv_cache(om.config)
            lean([list(prompts[0])], [0], [cache], [[4]], cpu)
            rows = lean([[20, 21, 22, 23]], [5], [cache], [[0, 1, 2, 3]], cpu)[
                0
            ]  # a window of 4 rows
            truncate_cache(cache, 7)  # two of its tokens kept: the rejected tail leaves the cache
            after = lean([[24]], [7], [cache], [[0]], cpu)[0]
            return rows, after

        counting = CountingLib(lean._fused.kernels.lib)
        monkeypatch.setattr(lean._fused.kernels, "lib", counting)
        (want, want_caches), (got, got_caches) = (
            _with_fused(lean, f, batched) for f in (False, True)
        )
        assert (
            counting.calls == 6 * om.config.num_hidden_layers
        )  # one call a layer for all three requests' rows
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        assert torch.allclose(got.float(), want.float(), rtol=0, atol=tol), (
            (got.float() - want.float()).abs().max()
        )
        assert (
            [c.get_seq_length() for c in got_caches]
            == [c.get_seq_length() for c in want_caches]
            == [11, 9, 10]
        )
        counting.calls = 0
        (want_rows, want_after), (got_rows, got_after) = (
            _with_fused(lean, f, window) for f in (False, True)
        )
        assert (
            counting.calls == 2 * om.config.num_hidden_layers
        )  # the window, then the row after the rollback
        assert torch.equal(got_rows.argmax(-1), want_rows.argmax(-1)) and int(
            got_after.argmax()
        ) == int(want_after.argmax())
        for a, b in ((want_rows, got_rows), (want_after, got_after)):
            assert torch.allclose(a.float(), b.float(), rtol=0, atol=tol), (
                (a.float() - b.float()).abs().max()
            )
    finally:
        om.close()
