"""The engine on a CUDA GPU (issue 15 §6): what this project's CPU machines cannot run. Every test
here is marked `cuda` and runs only where torch sees a GPU (bench/gpu_check.sh runs them; CI has
none and deselects the mark). On the GPU the experts of the fast tier live in device memory, misses
cross the PCIe link on a side stream from pinned host memory, and CPU-run experts really run on a
different device than the rest of the layer: all paths the CPU tests cannot reach."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import settle
from tiny_models import ARCHS, NEW_ARCHS, load_reference

from engine.config import EngineConfig
from engine.core.completion import complete, generate
from engine.core.engine_core import CoreLimits, EngineCore
from engine.speculative.config import SpecConfig
from engine.speculative.factory import make_speculation
from engine.weights.forward_support import LEAN_MODEL_TYPES
from engine.worker.loader import load_model
from engine.worker.parity import prompt_logits
from engine.worker.runner import ModelRunner
from engine.worker.sampling import SamplingParams

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@torch.no_grad()
def _greedy(ref: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    """transformers' n greedy tokens after `ids`, on the GPU."""
    out = ref.generate(
        torch.tensor([ids], device="cuda"), max_new_tokens=n, min_new_tokens=n, do_sample=False
    )
    return out[0, len(ids) :].tolist()


def _prompt(vocab: int, n: int = 32, seed: int = 1234) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("arch", ARCHS + ("glm4_moe",))
def test_logits_and_greedy_tokens_match_transformers_on_the_gpu(tiny_ckpt, arch: str) -> None:
    """The correctness contract on the GPU: fetch-all at any cache size and either slow tier gives
    transformers' logits (both on the same GPU, f32) and its greedy tokens."""
    assert arch in ARCHS or arch in NEW_ARCHS
    path = tiny_ckpt(arch)
    ref = load_reference(path).to("cuda")
    ids = _prompt(ref.config.vocab_size)
    with torch.no_grad():
        ref_logits = ref(torch.tensor([ids], device="cuda")).logits[0].float()
        ref_tokens = _greedy(ref, ids, 16)
    for offload, fraction in (("ram", 1.0), ("ram", 0.25), ("disk", 0.25)):
        om = load_model(
            path,
            EngineConfig(cache_fraction=fraction, offload=offload, device="cuda", dtype="float32"),
        )
        try:
            assert om.store.slots.is_cuda, "the fast tier must live in GPU memory"
            diff = (prompt_logits(om, ids).float() - ref_logits).abs().max().item()
            assert diff <= 1e-3, f"{arch} {offload} cache={fraction}: max |Δlogit| = {diff}"
            assert (
                generate(om, ids, SamplingParams(max_tokens=16, ignore_eos=True)).tokens
                == ref_tokens
            ), f"{arch} {offload} {fraction}"
            snap = om.stats.snapshot()
            assert (snap["misses"] > 0) == (fraction < 1.0)
            if arch in LEAN_MODEL_TYPES:
                assert ModelRunner(om)._lean is not None, (
                    "the lean forward must serve this architecture on the GPU too"
                )
        finally:
            om.close()


@pytest.mark.parametrize("offload", ["ram", "disk"])
def test_misses_cross_the_link_from_pinned_memory_on_a_side_stream(tiny_ckpt, offload) -> None:
    """The RAM tier is pinned (so a copy can be asynchronous), the disk tier assembles each expert in
    a pinned staging row, and loads are issued on the transfer manager's own stream, so they
    overlap the default stream's compute (engine/experts/tiers/device_copy.py)."""
    om = load_model(
        tiny_ckpt("qwen3_moe"),
        EngineConfig(cache_fraction=0.25, offload=offload, device="cuda", dtype="float32"),
    )
    try:
        copier = om.transfers.copier
        assert copier is not None and copier.stream != torch.cuda.current_stream()
        assert copier.staging().is_pinned()
        if offload == "ram":
            assert om.transfers.tier.buffer.is_pinned()
        generate(om, _prompt(om.config.vocab_size), SamplingParams(max_tokens=8, ignore_eos=True))
        settle(om)
        snap = om.stats.snapshot()
        assert snap["misses"] > 0 and snap["bytes_moved"] > 0
        assert om.store.pinned_count() == 0
    finally:
        om.close()


def _core_run(om, spec: SpecConfig, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    proposer, observers = make_speculation(spec.resolve(om.model_dir), om)
    core = EngineCore.for_model(
        om, CoreLimits(max_running=len(prompts), max_model_len=2048), proposer, observers
    )
    outs = complete(
        core,
        [
            core.local_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            for p in prompts
        ],
    )
    assert all(o.error is None for o in outs), [o.error for o in outs if o.error]
    settle(om)
    assert om.store.pinned_count() == 0
    return [o.token_ids for o in outs]


@pytest.mark.timeout(300)
def test_speculation_utility_prefetch_and_cpu_experts_are_exact_on_the_gpu() -> None:
    """The embedded pair on the GPU at cache 0.25 (RAM tier over PCIe): the draft's speculation,
    MoE-SpAc's utility prefetch and eviction, and CPU-run experts (computed on the host from the
    pinned tier and their output copied to the GPU) leave every greedy token unchanged."""
    from models import EMBEDDED_TARGET

    def load(**kw):
        return load_model(
            EMBEDDED_TARGET,
            EngineConfig(cache_fraction=0.25, offload="ram", device="cuda", dtype="float32", **kw),
        )

    om = load()
    try:
        ids = om.tokenizer(
            (EMBEDDED_TARGET.parent / "data" / "test.txt").read_text(encoding="utf-8")[:30000]
        )["input_ids"]
        prompts = [ids[i * 700 : i * 700 + 16 + 4 * i] for i in range(6)]
        plain = _core_run(om, SpecConfig(speculative="off"), prompts, 24)
        om.stats.reset()
        assert _core_run(om, SpecConfig(speculative="draft", adaptive=False), prompts, 24) == plain
        s = om.stats.snapshot()
        assert s["spec_drafts"] > 0 and 0 < s["spec_accepted_tokens"] < s["spec_draft_tokens"]
    finally:
        om.close()
    for name, kw in {
        "utility prefetch + eviction + cpu experts": dict(
            prefetch="utility", eviction="utility", cpu_experts="auto"
        ),
        "every miss on the cpu": dict(cpu_experts="all"),
    }.items():
        om = load(**kw)
        try:
            assert (
                _core_run(om, SpecConfig(speculative="draft", adaptive=False), prompts, 24) == plain
            ), name
            s = om.stats.snapshot()
            if kw.get("cpu_experts") == "all":
                assert s["cpu_expert_calls"] > 0 and s["transfers"]["demand"] == 0, name
        finally:
            om.close()


def test_resident_lane_reads_nothing_to_the_host_on_the_gpu(tiny_ckpt) -> None:
    """At cache 1.0 on CUDA the executor takes the device lane: a decode step reads one value to the
    host (the sampled token), none in an MoE layer, and the tokens are transformers'."""
    from engine.worker.host_reads import HostReads

    path = tiny_ckpt("qwen3_moe")
    om = load_model(path, EngineConfig(cache_fraction=1.0, device="cuda", dtype="float32"))
    try:
        assert om.executor.device_lane is not None and om.executor.store.complete
        ids = _prompt(om.config.vocab_size)
        ref_tokens = _greedy(load_reference(path).to("cuda"), ids, 8)
        assert generate(om, ids, SamplingParams(max_tokens=8, ignore_eos=True)).tokens == ref_tokens
        with HostReads() as one:
            generate(om, ids, SamplingParams(max_tokens=1, ignore_eos=True))
        with HostReads() as reads:
            generate(om, ids, SamplingParams(max_tokens=7, ignore_eos=True))
        assert (reads.total - one.total) / 6 == 1, reads.by_line - one.by_line
    finally:
        om.close()


def test_memory_plan_sizes_the_fast_tier_to_the_device_budget() -> None:
    """--device-memory on a real GPU: the plan reads the free memory (torch.cuda.mem_get_info), the
    fast tier takes what the budget leaves, and the memory probe reports the bytes torch holds."""
    from models import EMBEDDED_TARGET

    om = load_model(EMBEDDED_TARGET, EngineConfig(device="cuda", device_memory="0.5"))
    try:
        plan = om.memory_plan
        assert plan.device.startswith("cuda") and plan.device_budget > 0
        assert om.executor.store.slots.is_cuda
        report = om.stats.memory_probe()
        assert 0 < report["device_total"]["used"] <= plan.device_budget
    finally:
        om.close()
