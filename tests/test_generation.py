"""Sampling, stopping rules and the `generate` command."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from engine.config import EngineConfig
from engine.core.completion import generate
from engine.worker.loader import load_model
from engine.worker.sampling import SamplingParams, filter_logits, sample


@pytest.fixture(scope="module")
def om(tiny_ckpt):
    m = load_model(tiny_ckpt("qwen3_moe"), EngineConfig(cache_fraction=0.5))
    yield m
    m.close()


def _ids(om, text: str = "To be, or not to be") -> list[int]:
    return om.tokenizer(text)["input_ids"]


def test_seeded_sampling_is_reproducible(om) -> None:
    p = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    a, b = generate(om, _ids(om), p), generate(om, _ids(om), p)
    c = generate(
        om, _ids(om), SamplingParams(max_tokens=12, temperature=1.0, seed=8, ignore_eos=True)
    )
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens


def test_top_k_one_equals_greedy(om) -> None:
    greedy = generate(om, _ids(om), SamplingParams(max_tokens=10, ignore_eos=True))
    topk1 = generate(
        om,
        _ids(om),
        SamplingParams(max_tokens=10, temperature=0.8, top_k=1, seed=3, ignore_eos=True),
    )
    assert greedy.tokens == topk1.tokens


def test_filters() -> None:
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    k2 = filter_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.isinf(k2[2:]).all() and torch.isfinite(k2[:2]).all()
    p = filter_logits(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert torch.isfinite(p[0]) and torch.isinf(p[1:]).all()  # p(top1) ≈ 0.64 already covers 0.5
    g = torch.Generator().manual_seed(0)
    assert all(
        sample(logits, SamplingParams(temperature=1.0, top_p=0.5), g) == 0 for _ in range(20)
    )


def test_max_tokens_and_eos(om) -> None:
    res = generate(om, _ids(om), SamplingParams(max_tokens=5, ignore_eos=True))
    assert len(res.tokens) == 5 and res.finish_reason == "length"
    # Make a token the greedy model emits the EOS: generation must stop there, without it.
    first = generate(om, _ids(om), SamplingParams(max_tokens=8, ignore_eos=True)).tokens
    cut = next(i for i in range(1, 8) if first[i] not in first[:i])
    saved = (om.generation_config.eos_token_id, om.config.eos_token_id)
    om.generation_config.eos_token_id = om.config.eos_token_id = first[cut]
    try:
        res = generate(om, _ids(om), SamplingParams(max_tokens=8))
        assert res.finish_reason == "stop" and res.tokens == first[:cut]
        res = generate(om, _ids(om), SamplingParams(max_tokens=8, ignore_eos=True))
        assert res.finish_reason == "length" and len(res.tokens) == 8
        # min_tokens bans EOS until then: it is never emitted as an ordinary token.
        res = generate(om, _ids(om), SamplingParams(max_tokens=8, min_tokens=cut + 2))
        assert len(res.tokens) >= cut + 2 and first[cut] not in res.tokens[: cut + 2]
    finally:
        om.generation_config.eos_token_id, om.config.eos_token_id = saved


def test_stop_string_truncates(om) -> None:
    full = generate(om, _ids(om), SamplingParams(max_tokens=16, ignore_eos=True))
    assert len(full.text) > 4
    stop = full.text[3:5]
    cut = generate(om, _ids(om), SamplingParams(max_tokens=16, ignore_eos=True, stop=(stop,)))
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.find(stop)]


@pytest.mark.timeout(180)
def test_generate_cli_json(tiny_ckpt) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "cli",
            "generate",
            "--model",
            str(tiny_ckpt("qwen3_moe")),
            "--prompt",
            "Hello",
            "--max-tokens",
            "6",
            "--ignore-eos",
            "--cache-fraction",
            "0.25",
            "--offload",
            "disk",
            "--link",
            "nvme",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert len(out["tokens"]) == 6 and out["finish_reason"] == "length"
    stats = out["stats"]
    for key in (
        "hits",
        "misses",
        "bytes_moved",
        "stall_seconds",
        "per_layer",
        "transfers",
        "evictions",
    ):
        assert key in stats
    assert out["decode_tokens_per_s"] > 0
    assert stats["misses"] > 0 and stats["bytes_moved"] > 0
    assert len(stats["per_layer"]) == 2
