"""Every architecture the generic MoE hook opens, against transformers on the same checkpoint:
fetch-all logits within 1e-4 (fp32) and identical greedy tokens at cache 1.0, 0.5 and 0.1 on
both slow tiers. Checkpoints are tiny and random, built once per session with save_pretrained
(what transformers writes), fused (3-D expert tensors, as in memory), or in the layout of the
released multimodal checkpoints ("hub": Qwen3.5/3.6 MoE under model.language_model.*, Llama 4
under language_model.*)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import ARCHS, NEW_ARCHS, load_reference

from engine.config import EngineConfig
from engine.core.completion import generate
from engine.errors import CheckpointError
from engine.experts.compute.moe_block import OffloadedMoeBlock
from engine.weights.arch_adapters import adapter_for
from engine.worker.loader import load_model
from engine.worker.parity import prompt_logits
from engine.worker.sampling import SamplingParams

SETTINGS = [(off, cf) for off in ("ram", "disk") for cf in (1.0, 0.5, 0.1)]
# save_pretrained already writes fused tensors for these (their released checkpoints are fused too).
FUSED_ONLY = ("gpt_oss", "llama4_text", "granitemoe")
CASES = (
    [(arch, "per-expert") for arch in NEW_ARCHS]
    + [(arch, "fused") for arch in NEW_ARCHS if arch not in FUSED_ONLY]
    + [("qwen3_5_moe_text", "hub"), ("llama4_text", "hub")]
)


def _prompt(vocab: int, n: int = 24) -> list[int]:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def _greedy(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    """The reference: n greedy tokens from transformers' generate."""
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("arch, layout", CASES)
def test_logits_and_greedy_match_transformers(tiny_ckpt, arch: str, layout: str) -> None:
    path = tiny_ckpt(arch, layout)
    ref = load_reference(path if layout != "hub" else tiny_ckpt(arch, "per-expert"))
    ids = _prompt(ref.config.vocab_size)
    with torch.no_grad():
        ref_logits = ref(torch.tensor([ids])).logits[0]
        ref_tokens = _greedy(ref, ids, 16)
    for offload, fraction in SETTINGS:
        om = load_model(path, EngineConfig(cache_fraction=fraction, offload=offload))
        try:
            assert not any(".experts." in n for n, _ in om.model.named_parameters()), (
                "routed experts must not be materialized"
            )
            # Through the engine's own runner (the one generation loop), not transformers' generate.
            diff = (prompt_logits(om, ids) - ref_logits).abs().max().item()
            assert diff <= 1e-4, f"{offload} cache={fraction}: max |Δlogit| = {diff}"
            # min_tokens bans EOS, as the reference's min_new_tokens does.
            got = generate(om, ids, SamplingParams(max_tokens=16, min_tokens=16)).token_ids
            assert got == ref_tokens, f"{offload} cache={fraction}: greedy tokens differ"
            snap = om.stats.snapshot()
            if fraction < 1.0:
                assert (
                    snap["misses"] > 0 and snap["evictions"] > 0
                )  # the small cache really was small
                assert snap["bytes_moved"] == snap["transfers"][
                    "demand"
                ] * om.transfers.tier.expert_nbytes(om.moe_layers[0], 0)
            else:
                assert snap["misses"] == 0
        finally:
            om.close()


def test_dense_parts_stay_dense(tiny_ckpt) -> None:
    """DeepSeek-V3: the first layer is a dense MLP and each MoE layer keeps its shared experts and its
    routing bias on the device; only routed experts move."""
    om = load_model(tiny_ckpt("deepseek_v3"), EngineConfig(cache_fraction=0.25))
    try:
        assert om.moe_layers == [1, 2]
        names = {n for n, _ in om.model.named_parameters()} | {
            n for n, _ in om.model.named_buffers()
        }
        assert "model.layers.0.mlp.gate_proj.weight" in names
        assert "model.layers.1.mlp.shared_experts.up_proj.weight" in names
        assert "model.layers.1.mlp.gate.e_score_correction_bias" in names
        bias = om.model.model.layers[1].mlp.gate.e_score_correction_bias
        assert bias.abs().sum() > 0  # loaded from the checkpoint, not left at its zero init
    finally:
        om.close()


def test_unknown_dense_part_is_refused_in_one_line(tiny_ckpt) -> None:
    """A sparse block with a part the engine would silently drop must fail, naming what is missing."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.weights.moe_hook import find_moe_sites

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_ckpt("qwen3_moe")))
    block = find_moe_sites(model)[0].block
    block.add_module("mystery", torch.nn.Linear(4, 4))
    with pytest.raises(CheckpointError) as err:
        adapter_for("qwen3_moe", block)
    assert "'mystery'" in str(err.value) and "\n" not in str(err.value)


def test_llama4_with_top2_is_refused(tiny_ckpt) -> None:
    with pytest.raises(CheckpointError, match="num_experts_per_tok=2 is not supported"):
        load_model(tiny_ckpt("llama4_text", num_experts_per_tok=2))


ROUTER_CASES = [(arch, "float32") for arch in sorted(set(ARCHS) | set(NEW_ARCHS))] + [
    (a, "bfloat16") for a in ("qwen3_moe", "glm4_moe", "deepseek_v3")
]


@pytest.mark.parametrize("arch, dtype", ROUTER_CASES)
def test_router_logits_alone_equal_the_routers(tiny_ckpt, arch: str, dtype: str) -> None:
    """The prefetcher's next-router guess (BlockAdapter.router_logits) skips route()'s top-k
    selection where the logits are the router's linear map (in its weight's dtype, or in float32
    as DeepSeek-V3-style routers compute them), and equals route()'s logits always."""
    om = load_model(tiny_ckpt(arch), EngineConfig(cache_fraction=0.5, dtype=dtype))
    try:
        blocks = [m for m in om.model.modules() if isinstance(m, OffloadedMoeBlock)]
        x = torch.randn(
            5, om.model.config.hidden_size, generator=torch.Generator().manual_seed(0)
        ).to(getattr(torch, dtype))
        with torch.no_grad():
            for block in blocks:
                ref = block.adapter.route(block, x)[0]
                for _ in range(
                    2
                ):  # the first call checks the shortcut, the second takes it (or not)
                    assert torch.allclose(
                        block.adapter.router_logits(block, x).float(),
                        ref.float(),
                        rtol=1e-4,
                        atol=1e-5,
                    )
        if arch in ("qwen3_moe", "glm4_moe", "deepseek_v3"):
            assert all(b.adapter._logits_are_linear for b in blocks), (
                "the shortcut should apply to this router"
            )
    finally:
        om.close()
