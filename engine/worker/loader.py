"""Builds a transformers model whose routed experts live in the tiered expert store.

Steps: read config.json -> build the transformers model on the meta device (nothing is
allocated) -> swap every sparse MoE block for OffloadedMoeBlock (dropping the fused expert
parameters) -> plan memory, build slow tier, fast tier and transfer engine -> materialize the
rest on the compute device and fill it from the safetensors files by name -> on the CPU, replace
the norms and bf16 linears with their native counterparts (engine/native/layers.py) -> attach
MoE-SpAc's parts (engine/worker/spac_setup.py) -> resolve the dispatcher's plan -> warm start.
What a load returns: engine/worker/loaded_model.py.
"""

from __future__ import annotations

import contextvars
import logging
import math
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
)

from engine.config import EngineConfig
from engine.errors import CheckpointError
from engine.experts.cost_meter import CostMeter
from engine.experts.expert_kernels import make_kernel
from engine.experts.expert_source import expert_source, native_slot_dtype, read_dense
from engine.experts.expert_store import ExpertStore
from engine.experts.link import EmulatedLink, parse_link
from engine.experts.moe_block import OffloadedMoeBlock
from engine.experts.moe_executor import MoeExecutor
from engine.experts.read_faults import ReadFaults
from engine.experts.route_log import RouteLog
from engine.experts.routing_bus import RoutingBus
from engine.experts.slow_tier import DiskTier, RamTier, SlowTier
from engine.experts.transfers import TransferEngine
from engine.huge_pages import rehome_untouched
from engine.memory.measure import memory_probe, plan_for_model, print_plan
from engine.memory.planner import KvRequest, kv_token_budget
from engine.native.autotune import DecodeShapes
from engine.native.layers import accelerate
from engine.native.loaded import NativeChoice, activate, active, resolve_native_kernels
from engine.native.quant_linear import narrow_dense, narrows_dense, quantize_dense
from engine.read_fault_spec import parse_read_faults
from engine.stats import EngineStats
from engine.weights.arch import arch_for, disk_names, text_config, unsupported
from engine.weights.arch_adapters import adapter_for
from engine.weights.checkpoint import TensorLocation, index_checkpoint
from engine.weights.disk_embedding import (
    DiskEmbedding,
    disk_embedding_source,
    input_embedding_name,
    resident_bytes,
)
from engine.weights.expert_layout import ExpertShape
from engine.weights.model_config import DENSE_ARCHS, read_config, resolve_device, resolve_dtype
from engine.weights.moe_hook import decoder_layers, expert_geometry, find_moe_sites, verify_block
from engine.worker.dispatch import ExecutionPlan, resolve_plan
from engine.worker.loaded_model import LoadedModel, OffloadedModel
from engine.worker.packed_batch import use_packed_attention
from engine.worker.runner import ModelRunner
from engine.worker.spac_setup import attach_spac, prefetch_kinds
from policies.miss import SubstitutingPolicy
from policies.utility import protect_ticks

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
        model,
        model.config,
        tokenizer,
        gen_cfg,
        model_dir,
        dev,
        packed,
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
    config = read_config(model_dir)
    spec = arch_for(config.model_type)
    config = text_config(
        spec, config
    )  # multimodal wrappers (qwen3_5_moe, llama4): we run the text model
    tensors = index_checkpoint(model_dir)
    policies = cfg.policies()  # bad policy names fail here, before any weights are read
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, config, device)

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    layers = decoder_layers(model)
    sites = find_moe_sites(model)  # sparse blocks found by structure (engine/weights/moe_hook.py)
    moe_layers = [s.layer for s in sites]
    if not moe_layers:
        if spec.by_structure:
            raise unsupported(spec.model_type, str(model_dir / "config.json"))
        raise CheckpointError(
            f"{model_dir / 'config.json'}: no sparse MoE layers in this configuration"
        )
    native0 = sites[0].block
    E, H, I, top_k = expert_geometry(native0, transposed=spec.kernel != "swiglu")
    shape = ExpertShape(hidden=H, intermediate=I)
    # What an expert computes (kernel), how a slot stores it (float, MXFP4/FP8 as shipped, int8/int4) and where from.
    kernel = make_kernel(spec.kernel, native0.experts, H, I)
    slots = native_slot_dtype(
        spec, config, tensors, moe_layers, E, shape, kernel, cfg, dtype, device
    )  # what the native kernels would read the experts in: their measurement times that
    native = resolve_native_kernels(
        cfg.native_kernels if device.type == "cpu" else "off",
        decode_shapes(config, dtype, H, I, top_k, slots),
        cfg.native_build,
        cfg.native_build_limit,
    )
    activate(native)  # for the rest of the load (its own context): formats, layers, warm-up
    if (
        spec.by_structure
    ):  # not in the table: each kind of block is checked once against its own forward
        for block in {type(s.block): s.block for s in sites}.values():
            verify_block(block, adapter_for(spec.model_type, block), kernel, spec.model_type)
    fmt, locator = expert_source(
        spec, config, tensors, moe_layers, E, shape, kernel, cfg, dtype, device
    )

    stats = EngineStats(num_layers=len(layers))
    # The input embedding's rows stay in the checkpoint where they can (engine/weights/disk_embedding.py).
    embedding = disk_embedding_source(
        model, config, spec, tensors, dtype, device, cfg.embedding_on_disk
    )
    # The memory plan (engine/memory/): fast-tier size and slow tier where the flags leave them open.
    _fp, mplan = plan_for_model(
        model,
        [s.block.get_submodule("experts") for s in sites],
        config,
        dtype,
        fmt.slot_bytes,
        locator.nbytes_on_disk(moe_layers[0], 0),
        E,
        I,
        top_k,
        tensors,
        cfg,
        device,
        kv_request,
        embedding.nbytes - resident_bytes(embedding) if embedding else 0,
    )
    print_plan(mplan)
    link = EmulatedLink(parse_link(cfg.link)) if cfg.link else None
    tier: SlowTier
    if mplan.offload == "ram":
        tier = RamTier(
            locator,
            moe_layers,
            fmt.slot_dtype,
            pin=device.type == "cuda",
            link=link,
            huge_pages=cfg.huge_pages,
        )
    else:
        tier = DiskTier(locator, link=link, prefer_direct=cfg.direct_io)
    if cfg.expert_read_faults:
        tier.set_faults(ReadFaults(parse_read_faults(cfg.expert_read_faults)))
    n_slots = mplan.n_slots
    # Both tiers in host memory and every expert in the fast tier: the RAM tier's buffer *is* the
    # fast tier (zero-copy), instead of a second copy of every expert.
    ram = (
        tier
        if isinstance(tier, RamTier) and device.type == "cpu" and n_slots == len(moe_layers) * E
        else None
    )
    policies.eviction.bind(moe_layers, E)
    store = ExpertStore(
        n_slots,
        fmt.slot_numel,
        fmt.slot_dtype,
        device,
        policies.eviction,
        stats,
        protect_ticks=protect_ticks(len(moe_layers)),
        slots=ram.buffer if ram is not None else None,
        huge_pages=cfg.huge_pages,
    )
    if ram is not None:
        store.adopt({layer * E + e: ram.row(layer, e) for layer in moe_layers for e in range(E)})
    kinds = prefetch_kinds(
        cfg,
        model_dir,
        partial=n_slots < len(moe_layers) * E,
        moe_layers=len(moe_layers),
        pays=isinstance(policies.miss, SubstitutingPolicy) or device.type == "cuda",
    )
    meter = CostMeter() if cfg.cpu_experts != "off" or "adapter" in kinds else None
    transfers = TransferEngine(store, tier, stats, E, workers=cfg.transfer_workers, meter=meter)
    act_fn = getattr(native0.experts, "act_fn", None)
    executor = MoeExecutor(
        store, transfers, policies.miss, policies.admission, stats, shape, E, act_fn, fmt
    )
    executor.settle_background = cfg.settle_background
    executor.resident_lane = cfg.resident_lane
    bus = RoutingBus()
    for s in sites:
        setattr(
            s.parent,
            s.attr,
            OffloadedMoeBlock(
                s.block, s.layer, executor, bus, adapter_for(spec.model_type, s.block)
            ),
        )

    _materialize(model, config, spec, tensors, device, model_dir, cfg.huge_pages, embedding)
    # --dense-quant: before accelerate, which then leaves the quantized linears alone
    quantize_dense(model, cfg.dense_quant, cfg.huge_pages)
    if narrows_dense(cfg.bf16_dense, device):
        narrow_dense(model, cfg.huge_pages)  # f32 linears holding bf16 values: read as bf16
    if device.type == "cpu":
        accelerate(
            model
        )  # norms (and bf16 linears) through the native kernels (engine/native/layers.py)
    packed = use_packed_attention(model)
    tokenizer, gen_cfg = _tokenizer_and_generation_config(model_dir)
    om = OffloadedModel(
        model,
        config,
        tokenizer,
        gen_cfg,
        model_dir,
        device,
        packed,
        cfg,
        store,
        transfers,
        executor,
        stats,
        bus,
        moe_layers,
        E,
        top_k,
        runner_factory=ModelRunner,
        native=native,
    )
    om.memory_plan = mplan
    om.kv_token_budget = kv_token_budget(_fp, cfg, kv_request)  # the scheduler admits against it
    stats.memory_probe = memory_probe(
        mplan, om.model, store, tier
    )  # planned and used bytes per pool, for /metrics
    attach_spac(om, cfg, kinds, policies.eviction, tier, fmt, meter)
    if cfg.route_log is not None:
        om.route_log = RouteLog(cfg.route_log, bus, n_slots, E)
    om.plan = _plan(om, cfg, native.line, complete=n_slots == len(moe_layers) * E)
    if cfg.warm_start:
        _warm(om)
    _arm_faults(tier, ram is not None)
    return om


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
    """The plan's line for what multiplies a decode row's routed experts (engine/experts/expert_compute.py)."""
    fmt, moe = om.executor.fmt, om.executor.native_moe
    if moe is not None:
        return moe.describe(), f"{fmt.name} slots, every row: decode, verification and prompt"
    off = om.native is None or om.native.kernels is None
    why = "the native kernels are off" if off else "no native kernel reads these slots"
    return "torch", f"{fmt.name} slots through the format's torch path ({why})"


def _materialize(
    model: PreTrainedModel,
    config: PretrainedConfig,
    spec,
    tensors,
    device: torch.device,
    model_dir: Path,
    huge_pages: bool = False,
    embedding: TensorLocation | None = None,
) -> None:
    """Allocate the non-expert weights on `device` and fill them from the checkpoint (on the CPU, large
    ones in huge pages where `huge_pages`: engine/huge_pages.py); `embedding`: where the input
    embedding's rows are read from instead of a copy (a DiskEmbedding), or None."""
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
                raise CheckpointError(f"{model_dir}: checkpoint is missing tensor {key}")
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


def _warm(om: OffloadedModel) -> None:
    """Fill the fast tier round-robin across layers so the first tokens do not all miss."""
    per_layer = math.ceil(om.store.n_slots / len(om.moe_layers))
    pending = []
    order = [(layer, e) for e in range(min(per_layer, om.num_experts)) for layer in om.moe_layers][
        : om.store.n_slots
    ]
    for layer, e in order:
        t = om.transfers.submit(layer, e, "prefetch")
        if t is not None:
            pending.append(t)
    for t in tqdm(pending, desc="warming expert cache", unit="expert", leave=False):
        t.done.wait()
        if t.error is not None:
            raise t.error
    om.store.mark_complete(
        len(om.moe_layers) * om.num_experts
    )  # a fast tier as big as the model, now full
    om.stats.reset()  # warm-up transfers are not part of any run


def decode_shapes(
    config: Any,
    dtype: torch.dtype,
    H: int,
    I: int,
    top_k: int,
    expert_dtype: torch.dtype | None = None,
) -> DecodeShapes | None:
    """The matrices a decode step of this model streams (an expert's gate_up and down, the q projection)
    and its experts a token, for the native kernels' measurement (engine/native/autotune.py); None for a
    dtype they do not read. `expert_dtype`: the experts' slots under the native kernels where they differ
    from `dtype` (bf16 slots of an f32 model)."""
    if dtype not in (torch.float32, torch.bfloat16):
        return None
    heads = getattr(config, "num_attention_heads", 0) or 1
    head_dim = getattr(config, "head_dim", None) or H // heads
    return DecodeShapes(
        str(dtype).removeprefix("torch."),
        ((2 * I, H), (H, I), (heads * head_dim, H)),
        top_k,
        str(expert_dtype).removeprefix("torch.") if expert_dtype else "",
    )
