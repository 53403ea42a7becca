"""`resolve`: every decision of a load, with its reason, before anything is allocated.

From config.json and the safetensors headers (no model built: engine/plan/survey.py)
and the machine (engine/memory/machine.py `Machine`): the architecture, the experts' format and slot
dtype, the native kernels' build (the widest this CPU runs; its speed beside torch's measured once per
CPU and shape, and cached), the memory split (fast tier, slow tier, dense, KV), the execution path and
the prefetchers. A combination that cannot run or fit fails here in one line. The loader builds to the
plan (engine/worker/loader.py `build`); `moe-offload plan` prints it and `serve` checks with it."""

from __future__ import annotations

from pathlib import Path

from engine.config import EngineConfig
from engine.experts.formats.checkpoint_experts import native_slot_dtype, slot_format
from engine.experts.formats.native_path import native_experts_line
from engine.experts.formats.slot_layout import SlotLayout
from engine.memory.footprint import Footprint
from engine.memory.machine import Machine, this_machine
from engine.memory.planner import KvRequest, MemoryPlan, kv_token_budget, plan_memory
from engine.native.decode_shapes import decode_shapes
from engine.plan.execution import (
    ExecutionPlan,
    expert_kernel,
    lean_declined,
    prefetch_choice,
    resolve_plan,
    router_line,
)
from engine.plan.load_plan import ArchChoice, ExpertSlots, KernelBuild, LoadPlan
from engine.plan.prefetch import prefetch_kinds
from engine.plan.survey import Survey, survey, survey_footprint
from engine.weights.forward_support import PACKED_MODEL_TYPES
from engine.weights.model_config import device_type, resolve_device
from policies.miss import SubstitutingPolicy


def resolve(
    model_dir: str | Path, cfg: EngineConfig, machine: Machine, kv_request: KvRequest = KvRequest()
) -> LoadPlan:
    """The plan of loading `model_dir` as `cfg` says on `machine`; `kv_request`: the context length and
    sequences the KV reservation covers (the stated defaults where open)."""
    return decide(survey(model_dir, cfg, machine.device), cfg, machine, kv_request)


def machine_ahead(cfg: EngineConfig) -> Machine:
    """This machine, measured now, for a plan made ahead of the load of `cfg` (serve's check before it
    listens, `moe-offload plan`): no runtime listed; the free disk where --expert-quant writes its file."""
    from engine.experts.formats.quant_cache import default_cache_dir

    quant_dir = (cfg.quant_cache_dir or default_cache_dir()) if cfg.expert_quant != "none" else None
    return this_machine(str(resolve_device(cfg.device)), at_load=False, quant_dir=quant_dir)


def decide(sv: Survey, cfg: EngineConfig, machine: Machine, kv_request: KvRequest) -> LoadPlan:
    """The plan for the surveyed checkpoint `sv` (resolve's second half; the loader surveys once for both)."""
    ck, ex = sv.ck, sv.experts
    native = kernel_choice(sv, cfg, machine)
    on_cpu, runs = device_type(ck.device) == "cpu", native.build is not None
    # The slots' dtype and the native expert path follow the chosen kernels.
    fmt, locator = slot_format(ex, cfg, runs)
    shape = ex.shape
    moe = native_experts_line(fmt, shape.hidden, shape.intermediate) if on_cpu and runs else None
    quantizes = cfg.expert_quant != "none"
    # The disk tier reads a quantized sidecar's rows (one slot each), else the checkpoint's bytes.
    disk = fmt.slot_bytes if quantizes else locator.nbytes_on_disk(ex.moe_layers[0], 0)
    fp = survey_footprint(sv, cfg, fmt.slot_bytes, disk, runs)
    sidecar = len(ex.moe_layers) * ex.num_experts * fmt.slot_bytes if quantizes else 0
    memory = _memory(fp, cfg, ck.device, machine, kv_request, sidecar)
    complete = memory.n_slots == len(ex.moe_layers) * ex.num_experts
    kinds = prefetch_kinds(
        cfg,
        ck.model_dir,
        partial=not complete,
        moe_layers=len(ex.moe_layers),
        pays=isinstance(sv.policies.miss, SubstitutingPolicy) or device_type(ck.device) == "cuda",
    )
    prefetch = tuple(sorted(kinds))
    execution = _execution(sv, cfg, native, complete).with_choice(
        "expert kernel",
        *expert_kernel(fmt.name, moe, runs),
    )
    return LoadPlan(
        model_dir=str(ck.model_dir),
        device=ck.device,
        dtype=ck.dtype,
        arch=_arch(sv),
        experts=_slots(sv, cfg, fmt, disk),
        kernels=native,
        memory=memory,
        kv_token_budget=kv_token_budget(fp, cfg, kv_request),
        execution=execution.with_choice(
            "prefetch", *prefetch_choice(cfg, prefetch, complete, on_cpu)
        ),
        prefetch=prefetch,
    )


def kernel_choice(sv: Survey, cfg: EngineConfig, machine: Machine) -> KernelBuild:
    """--native-kernels, --native-build and --native-build-limit resolved for this model (the CPU's widest
    build; never on a GPU), measured beside torch's kernels at its decode shapes for the plan line. The
    machine answers (`Machine.kernels`: built, loaded and measured by whoever gathered its facts, cached
    per CPU and shape); the plan only asks, with the model's decode shapes, so it loads no kernels."""
    ck, ex = sv.ck, sv.experts
    # What the native kernels would read the experts in: their measurement times that.
    slots = native_slot_dtype(ex, cfg)
    shapes = decode_shapes(
        ck.config,
        ck.dtype,
        ex.shape.hidden,
        ex.shape.intermediate,
        ex.top_k,
        slots,
    )
    mode = cfg.native_kernels if device_type(ck.device) == "cpu" else "off"
    return KernelBuild(*machine.kernels(mode, shapes, cfg.native_build, cfg.native_build_limit))


def _memory(
    fp: Footprint,
    cfg: EngineConfig,
    device: str,
    machine: Machine,
    kv_request: KvRequest,
    sidecar: int,
) -> MemoryPlan:
    """The memory plan (engine/memory/planner.py) on `machine`: a plan ahead of the load lists the
    quantized-expert file (`sidecar` bytes) still to be written; a load's lists the process's runtime."""
    sidecar = sidecar if machine.ahead else 0
    return plan_memory(
        fp,
        cfg,
        device if device.startswith("cuda") else "cpu",
        machine.host,
        device_free=machine.device_free,
        sidecar_bytes=sidecar,
        sidecar_disk_free=machine.quant_disk_free if sidecar else None,
        runtime_bytes=machine.runtime_bytes,
        kv_request=kv_request,
    )


def _execution(sv: Survey, cfg: EngineConfig, native: KernelBuild, complete: bool) -> ExecutionPlan:
    """The paths this model's steps may take (engine/plan/execution.py), with the reasons."""
    model_type, on_cpu = sv.ck.config.model_type, device_type(sv.ck.device) == "cpu"
    lean_ok = lean_declined(model_type, model_type in PACKED_MODEL_TYPES, sv.layout.lean)
    return resolve_plan(
        cfg,
        lean_ok=lean_ok,
        kernels=native.line,
        on_cpu=on_cpu,
        complete=complete,
        router=router_line(on_cpu, native.line),
    )


def _arch(sv: Survey) -> ArchChoice:
    spec = sv.ck.spec
    if spec.by_structure:
        why = "outside the architecture table: its MoE blocks matched by structure, each kind checked against its own forward at load"
    else:
        why = "in the architecture table (engine/weights/arch.py)" + (
            "; config.json is a multimodal wrapper: its text model runs" if spec.text_config else ""
        )
    return ArchChoice(str(sv.ck.config.model_type), spec.by_structure, why)


def _slots(sv: Survey, cfg: EngineConfig, fmt: SlotLayout, disk: int) -> ExpertSlots:
    """The experts' slots as the plan holds them, and why that format."""
    ck, ex = sv.ck, sv.experts
    if ex.shipped() is not None:
        why = "quantized in the checkpoint: slots hold the shipped bytes"
    elif cfg.expert_quant != "none":
        why = f"--expert-quant {cfg.expert_quant}: quantized once into a sidecar file (--quant-cache-dir), read from it"
    elif fmt.slot_dtype != ck.dtype:
        why = "every expert is bf16 in the checkpoint: bf16 slots, widened exactly as the native kernels read them"
    else:
        why = "float experts in the compute dtype (--expert-quant none)"
    return ExpertSlots(
        format=fmt.name,
        slot_dtype=fmt.slot_dtype,
        slot_bytes=fmt.slot_bytes,
        disk_bytes=disk,
        moe_layers=tuple(ex.moe_layers),
        num_experts=ex.num_experts,
        top_k=ex.top_k,
        hidden=ex.shape.hidden,
        intermediate=ex.shape.intermediate,
        why=why,
    )
