"""The native kernels' builds (engine/native/variants.py) and the measurement that picks one
(engine/native/autotune.py): every build compiles on any x86-64 machine; every build this CPU runs
computes attention as SDPA does (the matrix kernels: tests/test_native_kernels.py, once per build);
the dispatcher picks the fastest candidate it measures, never a build that loses to torch under auto,
and caches what it measured."""

from __future__ import annotations

import ctypes
import math

import pytest
import torch
import torch.nn.functional as F

from engine.config import BUILDS, EngineConfig
from engine.errors import ConfigError
from engine.native import autotune, loaded
from engine.native import build as native_build
from engine.native.autotune import Measurement, measure, measured
from engine.native.decode_shapes import DecodeShapes
from engine.native.loaded import load_build, native, resolve_native_kernels
from engine.native.variants import VARIANTS, buildable, by_name, runnable

needs_cc = pytest.mark.skipif(native_build.compiler() is None, reason="needs a C compiler")
SHAPES = DecodeShapes("float32", ((128, 64), (64, 64)))


@needs_cc
@pytest.mark.parametrize("name", [v.name for v in buildable()])
def test_every_build_compiles_here(name: str) -> None:
    """Each variant's flags are explicit (no -march=native), so this machine builds all of them, including
    those its CPU cannot run; the library loads and exports the kernels."""
    lib, why = native_build.build(by_name(name))
    assert lib is not None, why
    for symbol in (
        "gemv_call",
        "gemv_sweep_call",
        "gemv_q4_call",
        "moe_swiglu_rows_call",
        "attention_rows_call",
        "decode_layer",
    ):
        assert isinstance(getattr(lib, symbol), ctypes._CFuncPtr)


def test_the_portable_build_runs_everywhere_and_widest_comes_first() -> None:
    assert runnable(frozenset())[-1].name == "portable"
    assert [v.name for v in runnable(frozenset())] == ["portable"]
    avx2_only = frozenset({"avx2", "fma", "f16c", "bmi2", "movbe", "sse4_2"})
    if any(v.x86_only for v in buildable()):
        assert [v.name for v in runnable(avx2_only)] == ["avx2", "portable"]
        everything = frozenset(f for v in VARIANTS for f in v.needs)
        assert [v.name for v in runnable(everything)] == [v.name for v in VARIANTS]
        # --native-build-limit: a wide CPU chooses among what a narrower one runs
        assert [v.name for v in runnable(everything, "avx2")] == ["avx2", "portable"]
        assert [v.name for v in runnable(avx2_only, "avx512")] == ["avx2", "portable"]
    assert [v.name for v in runnable(frozenset(), "portable")] == ["portable"]


def test_the_config_names_every_build() -> None:
    assert BUILDS == ("auto", *(v.name for v in VARIANTS))
    with pytest.raises(ConfigError, match="native_build_limit"):
        EngineConfig(native_build_limit="sse9")
    with pytest.raises(ConfigError, match="wider than --native-build-limit"):
        EngineConfig(native_build="avx512", native_build_limit="avx2")


@needs_cc
@pytest.mark.parametrize("name", [v.name for v in runnable()])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_build_attends_as_sdpa(name: str, dtype: torch.dtype) -> None:
    """One decode row's attention over a cache of 40 positions (grouped-query, no norms or rotary) against
    SDPA: f32 within 1e-5, bf16 within one of its ulps."""
    nk, why = load_build(name)
    assert nk is not None, why
    g = torch.Generator().manual_seed(7)
    hq, hk, d, at, cap = 8, 2, 64, 40, 64
    keys = torch.randn(1, hk, cap, d, generator=g).to(dtype)
    values = torch.randn(1, hk, cap, d, generator=g).to(dtype)
    q = torch.randn(hq, d, generator=g).to(dtype)
    k, v = torch.randn(hk, d, generator=g).to(dtype), torch.randn(hk, d, generator=g).to(dtype)
    scale = 1 / math.sqrt(d)
    kb, vb = keys.clone(), values.clone()
    got = nk.decode_attention(
        q.clone(),
        k.clone(),
        v.clone(),
        norms=None,
        cos=None,
        sin=None,
        key_buffer=kb,
        value_buffer=vb,
        at=at,
        scale=scale,
    )
    kb_ref, vb_ref = keys.clone(), values.clone()
    kb_ref[0, :, at], vb_ref[0, :, at] = k, v
    # the new key and value appended in place
    assert torch.equal(kb, kb_ref) and torch.equal(vb, vb_ref)
    ref = F.scaled_dot_product_attention(
        q.float().view(1, hq, 1, d),
        kb_ref[:, :, : at + 1].float(),
        vb_ref[:, :, : at + 1].float(),
        scale=scale,
        enable_gqa=True,
    ).reshape(1, hq * d)
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got.float(), ref, rtol=tol, atol=tol)


@needs_cc
@pytest.mark.parametrize("name", [v.name for v in runnable()])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("hq", "hk", "d", "at", "rows"), [(4, 2, 128, 0, 37), (8, 2, 64, 21, 50), (2, 2, 48, 5, 16)]
)
def test_each_build_attends_a_prompt_chunk_as_its_rows_alone(
    name: str, dtype: torch.dtype, hq: int, hk: int, d: int, at: int, rows: int
) -> None:
    """A chunk of prompt rows (the key-tiled path from 16 rows on, where the build has one) gives each row the bits
    that row gets attended alone, one call a row: partial key tiles, grouped queries, q/k norms and rotary."""
    nk, why = load_build(name)
    assert nk is not None, why
    g = torch.Generator().manual_seed(11)
    cap = 1 << (at + rows + 3).bit_length()  # a power of two, as every KV buffer's capacity
    prefix = torch.randn(2, 1, hk, cap, d, generator=g).to(dtype)
    q = torch.randn(rows, hq, d, generator=g).to(dtype)
    k, v = (
        torch.randn(rows, hk, d, generator=g).to(dtype),
        torch.randn(rows, hk, d, generator=g).to(dtype),
    )
    norms = (
        torch.rand(d, generator=g).to(dtype) + 0.5,
        torch.rand(d, generator=g).to(dtype) + 0.5,
        1e-6,
        1e-6,
    )
    angle = torch.rand(rows, d // 2, generator=g) * 3
    cos, sin = torch.cos(angle).to(dtype).contiguous(), torch.sin(angle).to(dtype).contiguous()
    kb, vb = prefix[0].clone(), prefix[1].clone()
    chunk = nk.decode_attention(
        q.clone(),
        k.clone(),
        v.clone(),
        norms=norms,
        cos=cos,
        sin=sin,
        key_buffer=kb,
        value_buffer=vb,
        at=at,
        scale=0.1,
    )
    kb1, vb1 = prefix[0].clone(), prefix[1].clone()
    alone = torch.cat(
        [
            nk.decode_attention(
                q[r : r + 1].clone(),
                k[r : r + 1].clone(),
                v[r : r + 1].clone(),
                norms=norms,
                cos=cos[r : r + 1],
                sin=sin[r : r + 1],
                key_buffer=kb1,
                value_buffer=vb1,
                at=at + r,
                scale=0.1,
            )
            for r in range(rows)
        ]
    )
    assert torch.equal(kb, kb1) and torch.equal(vb, vb1)
    assert torch.equal(
        chunk.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
        alone.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
    )


class _Slowed:
    """A build that does its sweep `times` times over: a stand-in for a build slow on this CPU (it burns
    CPU time, which is what the measurement counts; a sleep would not)."""

    def __init__(self, kernels: object, times: int) -> None:
        self.kernels, self.times = kernels, times

    def gemv_sweep(self, x: torch.Tensor, ws: list[torch.Tensor]) -> None:
        for _ in range(self.times):
            self.kernels.gemv_sweep(x, ws)  # type: ignore[attr-defined]


@needs_cc
def test_the_measurement_picks_the_fast_build_and_declines_slow_ones() -> None:
    fast, _ = load_build("portable")
    assert fast is not None
    m = measure(SHAPES, {"slow": _Slowed(fast, 4), "portable": fast})  # type: ignore[dict-item]
    assert m.chosen == "portable" and m.gbps["slow"] < m.gbps["portable"], m
    # Every build slowed far past torch's F.linear and its per-layer calls: torch wins, so auto leaves
    # the native kernels off.
    m = measure(SHAPES, {"slow": _Slowed(fast, 400)})  # type: ignore[dict-item]
    assert m.chosen == "torch" and set(m.gbps) == {"slow", "torch"}, m
    assert "torch" in m.line() and "slow" in m.line() and "a decode layer" in m.line()
    assert m.layer_ms is not None and m.layer_ms["torch"] < m.layer_ms["slow"]


@needs_cc
def test_the_measurement_times_bf16_expert_slots_where_the_native_kernels_would_read_them() -> None:
    """An f32 model's bf16 expert slots: each build streams the experts in bf16 (half the bytes, the layer
    estimate with them), torch's path in f32, as each would run them; a candidate's GB/s counts its own
    bytes."""
    mixed = DecodeShapes(
        "float32", ((128, 64), (64, 64), (64, 64)), top_k=2, expert_dtype="bfloat16"
    )
    plain = DecodeShapes("float32", mixed.mats, top_k=2)
    assert mixed.weight_dtypes(native=True) == ["bfloat16", "bfloat16", "float32"]
    assert mixed.weight_dtypes(native=False) == ["float32"] * 3
    attention = 4 * 64 * 64 * 4
    assert mixed.layer_bytes(True) - attention == (plain.layer_bytes() - attention) // 2
    assert mixed.layer_bytes(False) == plain.layer_bytes()
    fast, _ = load_build("portable")
    assert fast is not None
    calls: list[tuple[torch.dtype, torch.dtype]] = []

    class Recording:
        def gemv_sweep(self, x: torch.Tensor, ws: list[torch.Tensor]) -> None:
            calls.append((x.dtype, ws[0].dtype))
            fast.gemv_sweep(x, ws)

    m = measure(mixed, {"portable": Recording()})  # type: ignore[dict-item]
    assert set(m.gbps) == {"portable", "torch"} and m.layer_ms is not None
    assert set(calls) == {(torch.float32, torch.bfloat16), (torch.float32, torch.float32)}


@needs_cc
def test_the_measurement_is_cached_per_machine_and_build(tmp_path) -> None:
    fast, _ = load_build("portable")
    assert fast is not None
    cache = tmp_path / "autotune.json"
    first = measured(SHAPES, {"portable": fast}, {"portable": "lib-a.so"}, cache)
    again = measured(SHAPES, {"portable": fast}, {"portable": "lib-a.so"}, cache)
    assert not first.cached and again.cached and again.chosen == first.chosen
    assert again.gbps == pytest.approx(first.gbps)
    # Another library (its source changed) is measured anew.
    assert not measured(SHAPES, {"portable": fast}, {"portable": "lib-b.so"}, cache).cached


@needs_cc
def test_auto_runs_the_widest_build_whatever_the_timing(monkeypatch) -> None:
    """auto and on run the widest build this CPU runs, never one a measurement prefers: builds compute
    different bits, so two loads of one model on one machine must not get two families by the machine's
    load (issue 55). Where torch measures faster the plan line says so and how to run it; off needs no
    measurement. A choice changes nothing by being made: the kernels outside any model stay the widest."""
    widest = runnable()[0].name
    slow = Measurement({widest: 1.0, "torch": 9.0}, "torch")
    monkeypatch.setattr(loaded, "measured", lambda *a: slow)
    for mode in ("auto", "on"):
        choice = resolve_native_kernels(mode, SHAPES)
        assert choice.kernels is not None and choice.kernels.variant == widest, choice.line
        assert "torch's kernels measured faster" in choice.line and "torch 9.0" in choice.line
    times = iter(
        [
            Measurement({widest: 1.0, "torch": 0.5}, widest),
            Measurement({widest: 1.0, "torch": 0.5}, "portable"),
        ]
    )
    monkeypatch.setattr(loaded, "measured", lambda *a: next(times))
    assert resolve_native_kernels("auto", SHAPES).kernels.variant == widest  # type: ignore[union-attr]
    assert resolve_native_kernels("auto", SHAPES).kernels.variant == widest  # type: ignore[union-attr]
    monkeypatch.setattr(autotune, "measure", lambda *a: pytest.fail("off measures nothing"))
    choice = resolve_native_kernels("off", SHAPES)
    assert choice.line.startswith("off: --native-kernels off") and choice.kernels is None
    with loaded.active(choice):
        assert native() is None
    assert native() is not None


@needs_cc
def test_a_named_build_runs_or_fails_in_one_line() -> None:
    assert "build portable" in resolve_native_kernels("on", None, "portable").line
    choice = resolve_native_kernels("on", SHAPES, "auto", "portable")
    assert "build portable" in choice.line
    with loaded.active(choice):
        assert native() is not None and native().variant == "portable"  # type: ignore[union-attr]
    missing = [v for v in buildable() if v not in runnable()]
    if missing:  # a build this CPU lacks the instructions for: refused before it could fault
        with pytest.raises(ConfigError, match="this CPU lacks"):
            resolve_native_kernels("auto", None, missing[0].name)
