"""The native kernel choice belongs to an engine, not to the process (engine/native/loaded.py).

Two engines in one process, one with `native_kernels="off"` (torch's kernels) and one with "on", each
run their own kernels whatever the order they were loaded in and however their steps interleave: each
one's logits equal the same engine's loaded alone, bit for bit. Why it can fail: a choice kept per
process (the last load's) runs the first engine's ops on the second one's kernels; the two families
round differently in bf16, so the leak shows in the logits, and the native library's calls are counted
per engine and per thread besides. CPU-run experts compute on pool threads (engine/experts/compute/cpu_experts.py):
those must see their engine's choice too, not the widest build a thread without one would get.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.core.completion import generate
from engine.core.sampling_params import SamplingParams
from engine.native.loaded import load_build, native
from engine.native.variants import runnable
from engine.worker.kv_cache import new_kv_cache
from engine.worker.loaded_model import OffloadedModel
from engine.worker.loader import load_model
from engine.worker.runner import ModelRunner

pytestmark = pytest.mark.skipif(
    native() is None, reason="needs the native CPU kernels (a C compiler)"
)

PROMPT = [5, 17, 3, 42, 9, 28, 11, 7, 30, 14, 21, 6]


class Counter:
    """Native library calls, counted by the thread that made them (its name)."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self._lock = threading.Lock()

    def count(self) -> None:
        with self._lock:
            who = threading.current_thread().name
            self.calls[who] = self.calls.get(who, 0) + 1

    def total(self) -> int:
        with self._lock:
            return sum(self.calls.values())


class CountingLib:
    """A build's native library whose calls `counter` counts."""

    def __init__(self, lib: Any, counter: Counter) -> None:
        self._lib, self._counter = lib, counter

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._lib, name)

        def counted(*args: Any) -> Any:
            self._counter.count()
            return fn(*args)

        return counted


@pytest.fixture
def counting(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Every build this CPU runs calls through one counter (an engine's measurement may pick any)."""
    counter = Counter()
    for v in runnable():
        kernels, _ = load_build(v.name)
        if kernels is not None:
            monkeypatch.setattr(kernels, "lib", CountingLib(kernels.lib, counter))
    return counter


def _load(path: Any, kernels: str, **kw: Any) -> OffloadedModel:
    return load_model(
        path, EngineConfig(cache_fraction=1.0, dtype="bfloat16", native_kernels=kernels, **kw)
    )


def _steps(om: OffloadedModel, n: int = 4) -> Iterator[torch.Tensor]:
    """The model's logits step by step: the prompt's rows, then n greedy decode rows, then a window of
    three rows (a verification's shape). Its runner is built on the first step."""
    runner, cache = ModelRunner(om), new_kv_cache(om.config)
    logits = runner.forward([PROMPT], [0], [cache], [list(range(len(PROMPT)))])[0]
    yield logits
    pos = len(PROMPT)
    for _ in range(n):
        token = int(logits[-1].argmax())
        logits = runner.forward([[token]], [pos], [cache], [[0]])[0]
        pos += 1
        yield logits
    yield runner.forward([[3, 4, 5]], [pos], [cache], [[0, 1, 2]])[0]


def _alone(path: Any, kernels: str) -> list[torch.Tensor]:
    om = _load(path, kernels)
    try:
        return list(_steps(om))
    finally:
        om.close()


@pytest.mark.parametrize("order", [("off", "on"), ("on", "off")])
def test_two_engines_in_one_process_each_run_their_own_kernels(
    tiny_ckpt, counting: Counter, order: tuple[str, str]
) -> None:
    path = tiny_ckpt("qwen3_moe")
    want = {k: _alone(path, k) for k in ("off", "on")}
    # The families differ in the last bits: a leak from one engine to the other would show.
    assert any(not torch.equal(a, b) for a, b in zip(want["off"], want["on"]))
    first, second = (_load(path, k) for k in order)
    engines = dict(zip(order, (first, second)))
    try:
        steps = {k: _steps(om) for k, om in engines.items()}
        got: dict[str, list[torch.Tensor]] = {"off": [], "on": []}
        for _ in want["off"]:  # interleaved: one step of each engine in turn
            for k in order:
                before = counting.total()
                got[k].append(next(steps[k]))
                calls = counting.total() - before
                assert (calls > 0) == (k == "on"), f"{k} engine: {calls} native calls"
        for k in ("off", "on"):
            assert len(got[k]) == len(want[k])
            for step, (g, w) in enumerate(zip(got[k], want[k])):
                assert torch.equal(g, w), f"{k} engine, step {step}: {(g - w).abs().max()}"
        assert first.native is not None and second.native is not None
        assert engines["off"].native.kernels is None  # type: ignore[union-attr]
        assert engines["on"].native.kernels is not None  # type: ignore[union-attr]
        assert engines["off"].plan.to_dict()["native kernels"]["chosen"] == "off"
        assert engines["on"].plan.to_dict()["native kernels"]["chosen"] == "on"
    finally:
        first.close()
        second.close()
    # No model active: the widest build this CPU runs, as before any load.
    assert native() is not None


def test_cpu_expert_workers_of_an_off_engine_run_torch_kernels(
    tiny_ckpt, counting: Counter
) -> None:
    """An "off" engine's missed experts run on CPU worker threads, beside an "on" engine loaded after it:
    not one native call from any thread during its request, the same tokens and logprobs as loaded
    alone; the "on" engine's own request does call the native kernels."""
    path = tiny_ckpt("qwen3_moe")
    cells = dict(cache_fraction=0.25, cpu_experts="all")
    params = SamplingParams(max_tokens=6)

    def run(om: OffloadedModel) -> tuple[list[int], list[float]]:
        out = generate(om, PROMPT, params, logprobs=0)
        assert out.error is None
        return out.token_ids, [lp.logprob for lp in out.logprobs]

    off = load_model(path, EngineConfig(dtype="bfloat16", native_kernels="off", **cells))
    try:
        want = run(off)
    finally:
        off.close()
    off = load_model(path, EngineConfig(dtype="bfloat16", native_kernels="off", **cells))
    on = load_model(path, EngineConfig(dtype="bfloat16", native_kernels="on", **cells))
    try:
        # The "on" engine runs (its workers too) between the "off" engine's load and its request.
        run(on)
        assert counting.total() > 0
        counting.calls.clear()
        off.stats.reset()
        assert run(off) == want
        assert off.stats.snapshot()["cpu_expert_calls"] > 0
        assert counting.calls == {}, f"native calls by thread: {counting.calls}"
        run(on)
        workers = {t for t in counting.calls if t.startswith("cpu-expert")}
        assert workers, f"the on engine's CPU workers called nothing natively: {counting.calls}"
    finally:
        off.close()
        on.close()
