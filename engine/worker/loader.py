"""Builds a transformers model whose routed experts live in the tiered expert store.

Steps: read config.json -> build the transformers model on the meta device (nothing is
allocated) -> swap every sparse MoE block for OffloadedMoeBlock (dropping the fused expert
parameters) -> plan memory, build slow tier, fast tier and transfer engine (the routed experts'
steps: engine/worker/expert_setup.py) -> materialize the rest on the compute device and fill it
from the safetensors files by name -> on the CPU, replace the norms and bf16 linears with their
native counterparts (engine/native/layers.py) -> attach MoE-SpAc's parts
(engine/worker/spac_setup.py) -> resolve the dispatcher's plan -> warm start.
What a load returns: engine/worker/loaded_model.py.
"""

from __future__ import annotations

import contextvars
import logging
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
)

from engine.config import EngineConfig
from engine.errors import CheckpointError
from engine.experts.formats.expert_source import read_dense
from engine.experts.route_log import RouteLog
from engine.experts.tiers.slow_tier import SlowTier
from engine.huge_pages import rehome_untouched
from engine.memory.footprint import Footprint
from engine.memory.measure import memory_probe, plan_for_model, print_plan
from engine.memory.planner import KvRequest, MemoryPlan, kv_token_budget
from engine.native.layers import accelerate
from engine.native.loaded import NativeChoice, active
from engine.native.quant_linear import narrow_dense, narrows_dense, quantize_dense
from engine.stats import EngineStats
from engine.weights.arch import arch_for, disk_names, text_config, unsupported
from engine.weights.checkpoint import TensorLocation, index_checkpoint
from engine.weights.disk_embedding import (
    DiskEmbedding,
    disk_embedding_source,
    input_embedding_name,
    resident_bytes,
)
from engine.weights.model_config import DENSE_ARCHS, read_config, resolve_device, resolve_dtype
from engine.weights.moe_hook import MoeSite, decoder_layers, find_moe_sites
from engine.worker.dispatch import ExecutionPlan, resolve_plan
from engine.worker.expert_setup import (
    Checkpoint,
    ExpertRuntime,
    RoutedExperts,
    expert_runtime,
    routed_experts,
    warm,
)
from engine.worker.loaded_model import LoadedModel, OffloadedModel
from engine.worker.packed_batch import use_packed_attention
from engine.worker.runner import ModelRunner
from engine.worker.spac_setup import attach_spac
from policies.registry import PolicyBundle

log = logging.getLogger(__name__)


def _tokenizer_and_generation_config(model_dir: Path) -> tuple[Any | None, GenerationConfig | None]:
    has_tok = (model_dir / "tokenizer_config.json").exists() or (
        model_dir / "tokenizer.json"
    ).exists()
    tokenizer = AutoTokenizer.from_pretrained(model_dir) if has_tok else None
    gen_cfg = (
        GenerationConfig.from_pretrained(model_dir)
        if (model_dir / "generation_config.json").exists()
        else None
    )
    return tokenizer, gen_cfg


def check_model_dir(model_dir: str | Path, need_tokenizer: bool = False) -> None:
    """Validate a model directory cheaply (config, supported architecture, weight files, tokenizer)
    so front ends can fail with one line before starting anything heavy."""
    model_dir = Path(model_dir)
    read_config(model_dir)
    index_checkpoint(model_dir)
    if need_tokenizer and not (
        (model_dir / "tokenizer.json").exists() or (model_dir / "tokenizer_config.json").exists()
    ):
        raise CheckpointError(
            f"{model_dir}: no tokenizer files (tokenizer.json / tokenizer_config.json); the server needs one"
        )


def load_dense_model(
    model_dir: str | Path,
    device: str = "auto",
    dtype: str = "auto",
    native: NativeChoice | None = None,
) -> LoadedModel:
    """A small dense model (a speculative-decoding draft) kept whole on the compute device. `native`: the
    native kernels it runs (a draft: its target's); None: whatever choice is active where it runs."""
    model_dir = Path(model_dir)
    config = read_config(model_dir)
    if config.model_type not in DENSE_ARCHS:
        raise CheckpointError(
            f"{model_dir / 'config.json'}: model_type={config.model_type!r} is not a dense architecture ({', '.join(DENSE_ARCHS)})"
        )
    index_checkpoint(model_dir)  # same one-line errors for missing or truncated weights
    dev = resolve_device(device)
    # Ignored: transformers types the decorated PreTrainedModel.to without its bound self.
    model = (
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=resolve_dtype(dtype, config, dev))
        .to(dev)  # type: ignore[arg-type]
        .eval()
    )
    if dev.type == "cpu":
        # Native norms (and bf16 linears) for every row, as the target's (engine/native/layers.py):
        # what the lean forward fuses, and what its fused decode step needs (engine/worker/fused_decode.py).
        with active(native):
            accelerate(model)
    packed = use_packed_attention(model)
    tokenizer, gen_cfg = _tokenizer_and_generation_config(model_dir)
    return LoadedModel(
        model=model,
        config=model.config,
        tokenizer=tokenizer,
        generation_config=gen_cfg,
        model_dir=model_dir,
        device=dev,
        packed=packed,
        runner_factory=ModelRunner,
        native=native,
    )


def load_model(
    model_dir: str | Path, cfg: EngineConfig = EngineConfig(), kv_request: KvRequest = KvRequest()
) -> OffloadedModel:
    """Load `model_dir` offloaded as `cfg` says, to the memory plan; `kv_request`: the context
    length and sequences its KV reservation covers (the stated defaults where open)."""
    # In a copy of the caller's context: the native kernels the load chooses are active for the load's
    # own ops (engine/native/loaded.py) and end with it; the model holds them for its steps.
    return contextvars.copy_context().run(_load_model, Path(model_dir), cfg, kv_request)


def _load_model(model_dir: Path, cfg: EngineConfig, kv_request: KvRequest) -> OffloadedModel:
    """The load's steps (the module docstring outlines them), in load_model's copy of the context."""
    ck, policies = _read_checkpoint(model_dir, cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(ck.config, dtype=ck.dtype)
    layers = decoder_layers(model)
    ex = routed_experts(ck, _moe_sites(model, ck), cfg)
    stats = EngineStats(num_layers=len(layers))
    # The input embedding's rows stay in the checkpoint where they can (engine/weights/disk_embedding.py).
    embedding = disk_embedding_source(
        model, ck.config, ck.spec, ck.tensors, ck.dtype, ck.device, enabled=cfg.embedding_on_disk
    )
    fp, mplan = _memory_plan(model, ck, ex, cfg, kv_request, embedding)
    rt = expert_runtime(ck, ex, cfg, mplan, policies, stats)
    _materialize(model, ck, cfg.huge_pages, embedding)
    _finish_dense(model, cfg, ck.device)
    om = _offloaded_model(model, ck, cfg, ex, rt, stats)
    om.memory_plan = mplan
    om.kv_token_budget = kv_token_budget(fp, cfg, kv_request)  # the scheduler admits against it
    # Planned and used bytes per pool, for /metrics.
    stats.memory_probe = memory_probe(mplan, om.model, rt.store, rt.tier)
    attach_spac(om, cfg, rt.kinds, policies.eviction, rt.tier, ex.fmt, meter=rt.meter)
    if cfg.route_log is not None:
        om.route_log = RouteLog(cfg.route_log, rt.bus, mplan.n_slots, ex.E)
    complete = mplan.n_slots == len(ex.moe_layers) * ex.E
    om.plan = _plan(om, cfg, ex.native.line, complete=complete)
    if cfg.warm_start:
        warm(om)
    _arm_faults(rt.tier, rt.zero_copy)
    return om


def _read_checkpoint(model_dir: Path, cfg: EngineConfig) -> tuple[Checkpoint, PolicyBundle]:
    """config.json, the architecture, the tensor index, the policies `cfg` names, and the device and
    dtype the model runs in: what fails with one line before any weight is read."""
    config = read_config(model_dir)
    spec = arch_for(config.model_type)
    # Multimodal wrappers (qwen3_5_moe, llama4): we run the text model.
    config = text_config(spec, config)
    tensors = index_checkpoint(model_dir)
    policies = cfg.policies()  # bad policy names fail here, before any weights are read
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, config, device)
    return Checkpoint(model_dir, config, spec, tensors, device, dtype), policies


def _moe_sites(model: PreTrainedModel, ck: Checkpoint) -> list[MoeSite]:
    """The meta model's sparse MoE blocks, found by structure (engine/weights/moe_hook.py); fails with
    one line where there are none."""
    sites = find_moe_sites(model)
    if not sites:
        if ck.spec.by_structure:
            raise unsupported(ck.spec.model_type, str(ck.model_dir / "config.json"))
        raise CheckpointError(
            f"{ck.model_dir / 'config.json'}: no sparse MoE layers in this configuration"
        )
    return sites


def _memory_plan(
    model: PreTrainedModel,
    ck: Checkpoint,
    ex: RoutedExperts,
    cfg: EngineConfig,
    kv_request: KvRequest,
    embedding: TensorLocation | None,
) -> tuple[Footprint, MemoryPlan]:
    """The memory plan (engine/memory/): fast-tier size and slow tier where the flags leave them
    open, printed; and the footprint it was planned from."""
    fp, mplan = plan_for_model(
        model=model,
        experts=[s.block.get_submodule("experts") for s in ex.sites],
        config=ck.config,
        dtype=ck.dtype,
        slot_bytes=ex.fmt.slot_bytes,
        expert_disk_bytes=ex.locator.nbytes_on_disk(ex.moe_layers[0], 0),
        E=ex.E,
        I=ex.I,
        top_k=ex.top_k,
        tensors=ck.tensors,
        cfg=cfg,
        device=ck.device,
        kv_request=kv_request,
        dense_on_disk_bytes=embedding.nbytes - resident_bytes(embedding) if embedding else 0,
    )
    print_plan(mplan)
    return fp, mplan


def _finish_dense(model: PreTrainedModel, cfg: EngineConfig, device: torch.device) -> None:
    """The filled dense weights as the settings ask them run: quantized (--dense-quant), f32 linears
    holding bf16 values read as bf16 (unless --no-bf16-dense), and on the CPU the native kernels."""
    # --dense-quant: before accelerate, which then leaves the quantized linears alone
    quantize_dense(model, cfg.dense_quant, cfg.huge_pages)
    if narrows_dense(cfg.bf16_dense, device):
        narrow_dense(model, cfg.huge_pages)  # f32 linears holding bf16 values: read as bf16
    if device.type == "cpu":
        # Norms (and bf16 linears) through the native kernels (engine/native/layers.py).
        accelerate(model)


def _offloaded_model(
    model: PreTrainedModel,
    ck: Checkpoint,
    cfg: EngineConfig,
    ex: RoutedExperts,
    rt: ExpertRuntime,
    stats: EngineStats,
) -> OffloadedModel:
    """The loaded model: its module, tokenizer and generation config, and its experts' runtime."""
    packed = use_packed_attention(model)
    tokenizer, gen_cfg = _tokenizer_and_generation_config(ck.model_dir)
    return OffloadedModel(
        model=model,
        config=ck.config,
        tokenizer=tokenizer,
        generation_config=gen_cfg,
        model_dir=ck.model_dir,
        device=ck.device,
        packed=packed,
        engine_config=cfg,
        store=rt.store,
        transfers=rt.transfers,
        executor=rt.executor,
        stats=stats,
        bus=rt.bus,
        moe_layers=ex.moe_layers,
        num_experts=ex.E,
        top_k=ex.top_k,
        runner_factory=ModelRunner,
        native=ex.native,
    )


def _plan(om: OffloadedModel, cfg: EngineConfig, kernels: str, complete: bool) -> ExecutionPlan:
    """The paths this model's steps may take (engine/worker/dispatch.py), with the reasons."""
    from engine.worker.lean_forward import LeanForward

    if not om.packed:
        lean_ok: str | None = (
            f"{om.config.model_type} runs one forward per request (no packed attention)"
        )
    elif not LeanForward.supports(om.model):
        lean_ok = f"{om.config.model_type} is not among the lean forward's architectures"
    else:
        lean_ok = None
    on_cpu = om.device.type == "cpu"
    router = (
        "native: softmax top-k routers in C once their first call matches the module's (others: the module's own)"
        if on_cpu and kernels.startswith("on")
        else "module: the model's own router"
    )
    plan = resolve_plan(
        cfg, lean_ok=lean_ok, kernels=kernels, on_cpu=on_cpu, complete=complete, router=router
    )
    plan = plan.with_choice("expert kernel", *_expert_kernel(om))
    running = ",".join(om.prefetchers) or "none"
    if cfg.prefetch != "auto":
        why = f"--prefetch {cfg.prefetch}"
    elif om.prefetchers:
        why = "auto: a partial fast tier, a SpecPrefetch adapter beside the model, and a substituting policy or a GPU"
    elif complete:
        why = "auto: every routed expert is resident, nothing to prefetch"
    else:
        why = (
            (
                "auto: on a CPU with an exact policy the adapter measured slower than none (docs/benchmarks/policies.md);"
                " or no adapter file"
            )
            if on_cpu
            else "auto: no SpecPrefetch adapter file beside the model"
        )
    return plan.with_choice("prefetch", running, why)


def _expert_kernel(om: OffloadedModel) -> tuple[str, str]:
    """The plan's line for what multiplies a decode row's routed experts (engine/experts/compute/expert_compute.py)."""
    fmt, moe = om.executor.fmt, om.executor.native_moe
    if moe is not None:
        return moe.describe(), f"{fmt.name} slots, every row: decode, verification and prompt"
    off = om.native is None or om.native.kernels is None
    why = "the native kernels are off" if off else "no native kernel reads these slots"
    return "torch", f"{fmt.name} slots through the format's torch path ({why})"


def _materialize(
    model: PreTrainedModel,
    ck: Checkpoint,
    huge_pages: bool = False,
    embedding: TensorLocation | None = None,
) -> None:
    """Allocate the non-expert weights on `ck.device` and fill them from `ck` (on the CPU, large
    ones in huge pages where `huge_pages`: engine/huge_pages.py); `embedding`: where the input
    embedding's rows are read from instead of a copy (a DiskEmbedding), or None."""
    config, spec, tensors, device = ck.config, ck.spec, ck.tensors, ck.device
    on_disk = input_embedding_name(model) if embedding is not None else None
    model.to_empty(device=device)
    if huge_pages and device.type == "cpu":
        for p in model.parameters():
            p.data = rehome_untouched(p.data)  # still unfilled: the copy below faults huge pages in
    tied = bool(getattr(config, "tie_word_embeddings", False))
    state = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, param in tqdm(
            state.items(), desc="loading dense weights", unit="tensor", leave=False
        ):
            candidates = disk_names(spec, name)
            key = next((n for n in candidates if n in tensors), candidates[0])
            loc = tensors.get(key)
            if loc is None:
                if tied and name == "lm_head.weight":
                    continue  # shares storage with the input embedding
                raise CheckpointError(f"{ck.model_dir}: checkpoint is missing tensor {key}")
            if tuple(loc.shape) != tuple(param.shape):
                raise CheckpointError(
                    f"{loc.path}: tensor {key} has shape {tuple(loc.shape)}, model expects {tuple(param.shape)}"
                )
            if name == on_disk:
                continue  # replaced below; its allocation was never touched
            param.copy_(
                read_dense(tensors, loc, config)
            )  # FP8 checkpoints: dequantized with their scales
        # Non-persistent buffers (rotary inverse frequencies) are not in the checkpoint: rebuild them.
        for parent in [model.model]:
            rotary = getattr(parent, "rotary_emb", None)
            if rotary is not None:
                parent.rotary_emb = type(rotary)(config=rotary.config).to(device)
    if tied:
        model.tie_weights()
    if embedding is not None:
        padding = getattr(model.get_input_embeddings(), "padding_idx", None)
        model.set_input_embeddings(DiskEmbedding(embedding, padding))
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        assert not t.is_meta, f"{name} was left on the meta device"
    model.eval()


def _arm_faults(tier: SlowTier, zero_copy: bool) -> None:
    """Injected read faults start once the model is loaded: a warm-up never meets one."""
    if tier.faults is None:
        return
    if zero_copy:
        log.warning(
            "--expert-read-faults: every expert is resident in the RAM tier, so none is ever read "
            "and no fault can fire; give --offload disk or a smaller --cache-fraction"
        )
    tier.faults.arm()
