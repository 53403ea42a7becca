"""A fresh model's first forward computes the bits every later forward of the same rows computes.

Found with the paged KV pool's preemption test: the native attention fuses the per-head q/k norms, and
asked whether they were checked against the modules they replace before anything had run them, so a
fresh model's first forward took torch's attention and every later one the native kernel (engine/native/
layers.py `verified_kernels` now checks them on the spot). A request served first after a start then
differed from the same request served later, in the last bits of its logprobs."""

from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.worker.kv_cache import new_kv_cache
from engine.worker.loader import load_model


def test_a_fresh_models_first_forward_has_the_bits_of_a_later_one(tiny_ckpt) -> None:
    om = load_model(tiny_ckpt("qwen3_moe"), EngineConfig(device="cpu", forward="lean"))
    runner = om.make_runner()
    prompt = [(7 * j) % 200 + 3 for j in range(25)]

    def logits() -> torch.Tensor:
        cache = [new_kv_cache(om.config)]
        return runner.forward([prompt], [0], cache, [list(range(len(prompt)))], kind="prefill")[0]

    first, later = logits(), logits()
    om.close()
    assert torch.equal(first, later)
