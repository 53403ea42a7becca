"""Builds a transformers model whose routed experts live in the tiered expert store.

Steps: survey the checkpoint (config.json and the safetensors headers alone) and resolve its load plan
(engine/plan/: architecture, expert format, native kernels, memory split, execution path, prefetchers)
-> `build` to the plan: the transformers model built on the meta device (nothing is allocated) and
checked to be the one the plan was sized for (engine/worker/built.py), swap every sparse MoE block for OffloadedMoeBlock (dropping the fused expert parameters), build slow
tier, fast tier and transfer engine (the routed experts' steps: engine/worker/expert_setup.py) ->
materialize the rest on the compute device and fill it from the safetensors files by name -> on the
CPU, replace the norms and bf16 linears with their native counterparts (engine/native/layers.py) ->
attach MoE-SpAc's parts (engine/worker/spac_setup.py) -> warm start.
What a load returns: engine/worker/loaded_model.py.
"""

from __future__ import annotations

import contextvars
import logging
from dataclasses import replace
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
from engine.memory.machine import this_machine
from engine.memory.measure import memory_probe
from engine.memory.planner import KvRequest
from engine.native.dense_names import narrows_dense
from engine.native.layers import accelerate
from engine.native.loaded import NativeChoice, activate, active, chosen
from engine.native.quant_linear import narrow_dense, quantize_dense
from engine.plan.execution import prefetch_choice
from engine.plan.load_plan import LoadPlan
from engine.plan.resolve import decide
from engine.plan.survey import Checkpoint, Survey, survey
from engine.stats import EngineStats
from engine.weights.arch import disk_names
from engine.weights.checkpoint import torch_dtype
from engine.weights.disk_embedding import DiskEmbedding, input_embedding_name
from engine.weights.model_config import DENSE_ARCHS, read_config, resolve_device, resolve_dtype
from engine.weights.moe_hook import decoder_layers
from engine.weights.safetensors_index import TensorLocation, index_checkpoint
from engine.worker.built import build_meta
from engine.worker.expert_setup import (
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
        AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch_dtype(resolve_dtype(dtype, config))
        )
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
    """The checkpoint surveyed, its plan resolved on this machine as it is now (engine/plan/), and the
    model built to it, in load_model's copy of the context."""
    device = str(resolve_device(cfg.device))
    sv = survey(model_dir, cfg, device)
    plan = decide(sv, cfg, this_machine(device, at_load=True), kv_request)
    return build(plan, sv, cfg)


def build(plan: LoadPlan, sv: Survey, cfg: EngineConfig) -> OffloadedModel:
    """Allocate and fill the surveyed model `sv` as `plan` decided, in one pass (the module docstring
    outlines the steps); nothing here decides again."""
    # The model itself, on the meta device: checked to be the one the plan was sized for.
    built = build_meta(sv)
    ck, model = sv.ck, built.model
    native = chosen(plan.kernels.build, plan.kernels.line)
    activate(native)  # for the rest of the load (its own context): formats, layers, warm-up
    ex = routed_experts(replace(sv, experts=built.experts), built.sites, cfg, plan, native)
    stats = EngineStats(num_layers=len(decoder_layers(model)))
    rt = expert_runtime(ck, ex, cfg, plan, sv.policies, stats)
    _materialize(model, ck, cfg.huge_pages, sv.embedding)
    _finish_dense(model, cfg, torch.device(ck.device), plan.kernels.build is not None)
    om = _offloaded_model(model, ck, cfg, ex, rt, stats)
    om.memory_plan = plan.memory
    om.kv_token_budget = plan.kv_token_budget  # the scheduler admits against it
    # Planned and used bytes per pool, for /metrics.
    stats.memory_probe = memory_probe(plan.memory, om.model, rt.store, rt.tier)
    attach_spac(om, cfg, set(plan.prefetch), sv.policies.eviction, rt.tier, ex.fmt, meter=rt.meter)
    if cfg.route_log is not None:
        om.route_log = RouteLog(cfg.route_log, rt.bus, plan.memory.n_slots, ex.E)
    om.load_plan = _as_built(plan, om, cfg)
    om.plan = om.load_plan.execution
    if cfg.warm_start:
        warm(om)
    _arm_faults(rt.tier, rt.zero_copy)
    return om


def _as_built(plan: LoadPlan, om: OffloadedModel, cfg: EngineConfig) -> LoadPlan:
    """`plan` as the load built it: where SpecPrefetch's adapter was declined as it was attached (a
    file for another model, logged as a warning), the prefetch line says what runs instead."""
    if om.prefetchers == plan.prefetch:
        return plan
    ex = plan.execution
    execution = replace(ex, choices=tuple(c for c in ex.choices if c.what != "prefetch"))
    line = prefetch_choice(cfg, om.prefetchers, plan.complete, om.device.type == "cpu")
    return replace(
        plan, execution=execution.with_choice("prefetch", *line), prefetch=om.prefetchers
    )


def _finish_dense(
    model: PreTrainedModel, cfg: EngineConfig, device: torch.device, native: bool
) -> None:
    """The filled dense weights as the settings ask them run: quantized (--dense-quant), f32 linears
    holding bf16 values read as bf16 where the plan's native kernels run (`native`; unless
    --no-bf16-dense), and on the CPU the native kernels."""
    # --dense-quant: before accelerate, which then leaves the quantized linears alone
    quantize_dense(model, cfg.dense_quant, cfg.huge_pages)
    if narrows_dense(cfg.bf16_dense, device.type, native):
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
        device=torch.device(ck.device),
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


def _materialize(
    model: PreTrainedModel,
    ck: Checkpoint,
    huge_pages: bool = False,
    embedding: TensorLocation | None = None,
) -> None:
    """Allocate the non-expert weights on `ck.device` and fill them from `ck` (on the CPU, large
    ones in huge pages where `huge_pages`: engine/huge_pages.py); `embedding`: where the input
    embedding's rows are read from instead of a copy (a DiskEmbedding), or None."""
    config, spec, tensors, device = ck.config, ck.spec, ck.tensors, torch.device(ck.device)
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
