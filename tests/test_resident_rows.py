"""A step of many rows runs its resident experts in one native call a layer, with each row's bits.

A prompt chunk or a batched decode step names most of a layer's experts. They ran one native call an
expert (plus the Python around each), which took about half of an 80-token prefill of the embedded
model. With every expert the step needs resident, engine/experts/compute/expert_streaming.py now hands all rows
and their experts to one moe_swiglu_rows call (engine/experts/compute/expert_compute.py `resident_rows`). These
tests pin both halves: the call count, and that a row's logits are those it gets alone."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.native.kernels import NativeKernels
from engine.worker.kv_cache import new_kv_cache
from engine.worker.loader import load_model

PROMPT = [(7 * j) % 200 + 3 for j in range(40)]


def _prefill(om, prompt: list[int]) -> torch.Tensor:
    runner = om.make_runner()
    cache = [new_kv_cache(om.config)]
    return runner.forward([prompt], [0], cache, [list(range(len(prompt)))], kind="prefill")[0]


def _count_calls(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    calls = [0]
    real = getattr(NativeKernels, name)

    def counted(self, *a, **kw):
        calls[0] += 1
        return real(self, *a, **kw)

    monkeypatch.setattr(NativeKernels, name, counted)
    return calls


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_prompt_chunk_runs_each_layers_experts_in_one_call(
    tiny_ckpt, monkeypatch: pytest.MonkeyPatch, dtype: str
) -> None:
    om = load_model(tiny_ckpt("qwen3_moe"), EngineConfig(device="cpu", forward="lean", dtype=dtype))
    calls = _count_calls(monkeypatch, "moe_rows")
    _prefill(om, PROMPT)
    layers = om.config.num_hidden_layers
    om.close()
    assert calls[0] == layers  # one call a layer, not one an expert


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_each_prompt_row_has_the_logits_of_a_decode_row_alone(tiny_ckpt, dtype: str) -> None:
    """The last prompt row, computed inside a 40-row chunk, against the same position decoded alone
    after a 39-token prefill: the same kernels, so the same bits."""
    om = load_model(tiny_ckpt("qwen3_moe"), EngineConfig(device="cpu", forward="lean", dtype=dtype))
    runner = om.make_runner()
    whole = _prefill(om, PROMPT)[-1]
    cache = [new_kv_cache(om.config)]
    head = PROMPT[:-1]
    runner.forward([head], [0], cache, [list(range(len(head)))], kind="prefill")
    alone = runner.forward([PROMPT[-1:]], [len(head)], cache, [[0]], kind="decode")[0]
    om.close()
    assert torch.equal(whole, alone.reshape(whole.shape))


def test_a_step_with_an_expert_missing_streams_expert_by_expert(
    tiny_ckpt, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where a needed expert must be loaded, the step keeps the streaming loop (compute what is
    resident while the loads land), so it makes more calls than one a layer, with the same logits."""
    full = load_model(tiny_ckpt("qwen3_moe"), EngineConfig(device="cpu", forward="lean"))
    want = _prefill(full, PROMPT)
    full.close()
    om = load_model(
        tiny_ckpt("qwen3_moe"),
        EngineConfig(device="cpu", forward="lean", cache_fraction=0.25, warm_start=False),
    )
    # every routed-experts call: a missed expert's rows too
    calls = _count_calls(monkeypatch, "_run_experts")
    got = _prefill(om, PROMPT)
    layers = om.config.num_hidden_layers
    om.close()
    assert calls[0] > layers
    assert torch.equal(got, want)
