"""The shipped embedded model pair: configs, sizes, tokenizer, chat template, and generation through the engine."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from engine_helpers import greedy_in_engine_and_transformers
from transformers import AutoTokenizer

from engine.core.completion import generate
from engine.worker.loader import load_dense_model, load_model
from engine.worker.sampling import SamplingParams
from models import EMBEDDED_DIR, EMBEDDED_DRAFT, EMBEDDED_TARGET


def _cfg(path) -> dict:
    return json.loads((path / "config.json").read_text())


def active_flops_per_token(cfg: dict) -> float:
    """2 x active parameters in matmuls: attention projections, active experts, lm_head."""
    H, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    hd = cfg.get("head_dim") or H // cfg["num_attention_heads"]
    attn = H * hd * (2 * cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"])
    if "n_routed_experts" in cfg:  # glm4_moe: routed experts + router + an ungated shared expert
        mlp = (
            cfg["num_experts_per_tok"] * 3 * H * cfg["moe_intermediate_size"]
            + cfg["n_routed_experts"] * H
        )
        mlp += 3 * H * cfg["n_shared_experts"] * cfg["moe_intermediate_size"]
    elif (
        "num_experts" in cfg
    ):  # routed experts + router, + the shared expert and its gate (qwen2_moe)
        mlp = (
            cfg["num_experts_per_tok"] * 3 * H * cfg["moe_intermediate_size"]
            + cfg["num_experts"] * H
        )
        shared = cfg.get("shared_expert_intermediate_size") or 0
        mlp += (3 * H * shared + H) if shared else 0
    else:
        mlp = 3 * H * cfg["intermediate_size"]
    return 2.0 * (L * (attn + mlp) + cfg["vocab_size"] * H)


def test_target_config_and_size() -> None:
    """v2 (issue 16): glm4_moe (DeepSeek-V3-style routing), >= 128 fine-grained routed experts at top-8 plus a
    shared expert, every one of >= 4 layers sparse, <= 40 MB."""
    cfg = _cfg(EMBEDDED_TARGET)
    assert cfg["model_type"] == "glm4_moe"
    assert (
        cfg["first_k_dense_replace"] == 0 and cfg["num_hidden_layers"] >= 4
    )  # every layer is a MoE layer
    assert cfg["n_routed_experts"] >= 128
    assert cfg["num_experts_per_tok"] == 8
    assert cfg["n_shared_experts"] >= 1
    assert (EMBEDDED_TARGET / "model.safetensors").stat().st_size <= 40_000_000
    assert (
        "experts_implementation" not in cfg
    )  # a training-speed choice, not part of the shipped model


def test_draft_config_and_flops_budget() -> None:
    t, d = _cfg(EMBEDDED_TARGET), _cfg(EMBEDDED_DRAFT)
    assert d["model_type"] == "qwen3" and d["vocab_size"] == t["vocab_size"]
    assert active_flops_per_token(d) <= active_flops_per_token(t) / 8


def test_both_models_share_one_tokenizer_that_round_trips() -> None:
    tt, td = (
        AutoTokenizer.from_pretrained(EMBEDDED_TARGET),
        AutoTokenizer.from_pretrained(EMBEDDED_DRAFT),
    )
    for text in (
        "To be, or not to be: that is the question.",
        "The :mod:`asyncio` module provides `async def` coroutines.\n",
        "naïve café — ünïcödé ✓",
    ):
        ids = tt(text)["input_ids"]
        assert ids == td(text)["input_ids"]
        assert tt.decode(ids) == text
    assert len(tt) == 8192
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>", "<|bos|>"):
        assert len(tt(special, add_special_tokens=False)["input_ids"]) == 1, special


def test_chat_template() -> None:
    tok = AutoTokenizer.from_pretrained(EMBEDDED_TARGET)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert (
        text
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    )
    gen = json.loads((EMBEDDED_TARGET / "generation_config.json").read_text())
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert im_end in (
        gen["eos_token_id"] if isinstance(gen["eos_token_id"], list) else [gen["eos_token_id"]]
    )


def test_target_generates_through_the_engine_like_transformers() -> None:
    tok = AutoTokenizer.from_pretrained(EMBEDDED_TARGET)
    ids = tok("ROMEO. But soft, what light")["input_ids"]
    res, expect = greedy_in_engine_and_transformers(EMBEDDED_TARGET, ids, 16)
    assert res.tokens == expect
    assert len(res.text) > 10


def test_draft_loads_through_the_engine_and_generates() -> None:
    dm = load_dense_model(EMBEDDED_DRAFT)
    ids = dm.tokenizer("def main():")["input_ids"]
    res = generate(dm, ids, SamplingParams(max_tokens=8, ignore_eos=True))
    assert len(res.tokens) == 8 and res.text
    with pytest.raises(Exception, match="unsupported architecture model_type='qwen3'"):
        load_model(EMBEDDED_DRAFT)


def test_model_card_matches_its_measurements() -> None:
    """The card's headline figures are the ones in eval.json (a stale card fails), and they
    hold the properties the model was trained for."""
    card = (EMBEDDED_DIR / "README.md").read_text()
    ev = json.loads((EMBEDDED_DIR / "eval.json").read_text())
    ppl = ev["perplexity"]
    for who in ("target", "draft"):
        assert f"{ppl[who]['all']['ppl']:.2f}" in card, (
            f"{who} perplexity in the card differs from eval.json"
        )
    spec = ev["speculative"]
    assert f"{spec['mean_tokens_per_verification_incl_bonus']:.3f}" in card
    assert ppl["target"]["all"]["ppl"] < 0.8 * ppl["draft"]["all"]["ppl"]  # target clearly stronger
    assert all(p >= 95.0 for p in ev["no_dead_experts"]["pct_per_layer"])
    assert spec["k"] == 4 and spec["mean_tokens_per_verification_incl_bonus"] >= 1.5
    # v2 was trained to route with locality (issue 16): measured in the same run against v1, it must be
    # clearly stickier and cache-friendlier than v1, and the card must show both.
    v1 = ev["compare"]
    assert v1["label"] == "v1" and f"{v1['perplexity']['target']['all']['ppl']:.2f}" in card
    assert (
        ev["locality"]["consecutive_overlap_mean"]
        >= 1.5 * v1["locality"]["consecutive_overlap_mean"]
    )
    lru, lru1 = (
        ev["cache"]["all"]["fetch_all_hit_rate_lru"],
        v1["cache"]["all"]["fetch_all_hit_rate_lru"],
    )
    assert lru >= lru1 + 0.1 and f"**{lru:.3f}**" in card


@pytest.mark.timeout(180)
def test_generate_without_model_uses_the_embedded_model() -> None:
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "cli",
            "generate",
            "--prompt",
            "To be, or not to be",
            "--max-tokens",
            "8",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout)
    cfg = _cfg(EMBEDDED_TARGET)
    assert (
        len(out["tokens"]) >= 1
        and out["fast_tier_slots"] == cfg["num_hidden_layers"] * cfg["n_routed_experts"]
    )  # cache 1.0


def test_target_logits_equal_under_the_training_kernel() -> None:
    """The target was trained with transformers' grouped_mm experts kernel; the shipped checkpoint must give
    the same logits through the plain per-expert loop (eager), so training and serving see one model."""
    from transformers import AutoModelForCausalLM

    ids = AutoTokenizer.from_pretrained(EMBEDDED_TARGET)(
        "ROMEO. But soft, what light through yonder window breaks?"
    )["input_ids"]
    x = torch.tensor([ids])
    logits = {}
    for impl in ("eager", "grouped_mm"):
        m = AutoModelForCausalLM.from_pretrained(
            EMBEDDED_TARGET, dtype=torch.float32, experts_implementation=impl
        ).eval()
        with torch.no_grad():
            logits[impl] = m(input_ids=x).logits
    assert torch.allclose(logits["eager"], logits["grouped_mm"], atol=1e-4, rtol=1e-4)
    assert torch.equal(logits["eager"].argmax(-1), logits["grouped_mm"].argmax(-1))
