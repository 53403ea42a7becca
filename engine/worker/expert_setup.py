"""The routed experts' part of an offloaded load (engine/worker/loader.py runs the steps in order):
their slot format and locator, and what they run through as the load plan sizes it (slow tier, fast
tier, transfer engine, executor); after the load, the fast tier's warm start."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from engine.config import EngineConfig
from engine.experts.compute.moe_block import OffloadedMoeBlock
from engine.experts.compute.moe_executor import MoeExecutor
from engine.experts.cost_meter import CostMeter
from engine.experts.formats.expert_source import expert_source
from engine.experts.formats.quant import ExpertFormat
from engine.experts.routing_bus import RoutingBus
from engine.experts.tiers.expert_store import ExpertStore
from engine.experts.tiers.link import EmulatedLink, parse_link
from engine.experts.tiers.read_faults import ReadFaults
from engine.experts.tiers.slow_tier import DiskTier, RamTier, SlowTier
from engine.experts.tiers.transfers import TransferEngine
from engine.native.loaded import NativeChoice
from engine.plan.load_plan import LoadPlan
from engine.plan.survey import Checkpoint, Survey
from engine.read_fault_spec import parse_read_faults
from engine.stats import EngineStats
from engine.weights.arch_adapters import adapter_for
from engine.weights.expert_layout import ExpertShape, SegmentLocator
from engine.weights.moe_hook import MoeSite, verify_block
from engine.worker.loaded_model import OffloadedModel
from policies.base import EvictionPolicy
from policies.registry import PolicyBundle
from policies.utility import protect_ticks


@dataclass(frozen=True)
class RoutedExperts:
    """The model's routed experts: their sparse blocks and geometry, and the format and locator
    its slots are filled from; `native`: the native kernels the load chose for them (and the rest)."""

    sites: list[MoeSite]
    moe_layers: list[int]
    E: int
    I: int
    top_k: int
    shape: ExpertShape
    fmt: ExpertFormat
    locator: SegmentLocator
    native: NativeChoice


@dataclass(frozen=True)
class ExpertRuntime:
    """What the routed experts run through, built to the memory plan; `zero_copy`: the RAM tier's
    buffer is the fast tier. `kinds` and `meter` are what MoE-SpAc's parts are attached with."""

    tier: SlowTier
    store: ExpertStore
    zero_copy: bool
    kinds: set[str]
    meter: CostMeter | None
    transfers: TransferEngine
    executor: MoeExecutor
    bus: RoutingBus


def routed_experts(
    sv: Survey, sites: list[MoeSite], cfg: EngineConfig, plan: LoadPlan, native: NativeChoice
) -> RoutedExperts:
    """The experts' geometry and kernel (`sv.experts`: the built model's), its sparse blocks (`sites`) run by
    structure checked, and the format and locator of the experts' slots (a quantized sidecar written once where --expert-quant asks), as `plan` sized
    them; `native`: the plan's native kernels, active for the rest of the load."""
    ck, experts = sv.ck, sv.experts
    if ck.spec.by_structure:
        # Not in the table: each kind of block is checked once against its own forward.
        for block in {type(s.block): s.block for s in sites}.values():
            verify_block(
                block, adapter_for(ck.spec.model_type, block), experts.kernel, ck.spec.model_type
            )
    # What an expert computes (kernel), how a slot stores it (float, MXFP4/FP8 as shipped, int8/int4) and where from.
    fmt, locator = expert_source(experts, cfg, native.kernels is not None)
    planned = plan.experts
    # The plan decided the format from the same headers: the slots it sized are the ones built.
    built = (fmt.name, fmt.slot_dtype, fmt.slot_bytes)
    assert built == (planned.format, planned.slot_dtype, planned.slot_bytes), (built, planned)
    assert locator.nbytes_on_disk(experts.moe_layers[0], 0) == planned.disk_bytes
    return RoutedExperts(
        sites=sites,
        moe_layers=experts.moe_layers,
        E=experts.num_experts,
        I=experts.shape.intermediate,
        top_k=experts.top_k,
        shape=experts.shape,
        fmt=fmt,
        locator=locator,
        native=native,
    )


def expert_runtime(
    ck: Checkpoint,
    ex: RoutedExperts,
    cfg: EngineConfig,
    plan: LoadPlan,
    policies: PolicyBundle,
    stats: EngineStats,
) -> ExpertRuntime:
    """Slow tier, fast tier, transfer engine and executor, as `plan`'s memory plan sizes them; every
    sparse block of the model swapped for an OffloadedMoeBlock that runs through them."""
    mplan = plan.memory
    device = torch.device(ck.device)
    tier = _slow_tier(ex, cfg, mplan.offload, device)
    store, zero_copy = _fast_tier(
        ex, cfg, mplan.n_slots, tier, device, eviction=policies.eviction, stats=stats
    )
    kinds = set(plan.prefetch)
    meter = CostMeter() if cfg.cpu_experts != "off" or "adapter" in kinds else None
    transfers = TransferEngine(store, tier, stats, ex.E, workers=cfg.transfer_workers, meter=meter)
    executor = MoeExecutor(
        store=store,
        transfers=transfers,
        policy=policies.miss,
        admission=policies.admission,
        stats=stats,
        shape=ex.shape,
        num_experts=ex.E,
        act_fn=getattr(ex.sites[0].block.experts, "act_fn", None),
        fmt=ex.fmt,
    )
    executor.settle_background = cfg.settle_background
    executor.resident_lane = cfg.resident_lane
    bus = RoutingBus()
    for s in ex.sites:
        block = OffloadedMoeBlock(
            s.block, s.layer, executor, bus, adapter_for(ck.spec.model_type, s.block)
        )
        setattr(s.parent, s.attr, block)
    return ExpertRuntime(
        tier=tier,
        store=store,
        zero_copy=zero_copy,
        kinds=kinds,
        meter=meter,
        transfers=transfers,
        executor=executor,
        bus=bus,
    )


def _slow_tier(
    ex: RoutedExperts, cfg: EngineConfig, offload: str, device: torch.device
) -> SlowTier:
    """Where every expert is read from (`offload`: the plan's ram or disk), behind the emulated link
    and with the injected read faults the flags ask for (armed once the load is done)."""
    link = EmulatedLink(parse_link(cfg.link)) if cfg.link else None
    tier: SlowTier
    if offload == "ram":
        tier = RamTier(
            ex.locator,
            ex.moe_layers,
            getattr(torch, ex.fmt.slot_dtype),
            pin=device.type == "cuda",
            link=link,
            huge_pages=cfg.huge_pages,
        )
    else:
        tier = DiskTier(ex.locator, link=link, prefer_direct=cfg.direct_io)
    if cfg.expert_read_faults:
        tier.set_faults(ReadFaults(parse_read_faults(cfg.expert_read_faults)))
    return tier


def _fast_tier(
    ex: RoutedExperts,
    cfg: EngineConfig,
    n_slots: int,
    tier: SlowTier,
    device: torch.device,
    eviction: EvictionPolicy,
    stats: EngineStats,
) -> tuple[ExpertStore, bool]:
    """The expert store of `n_slots` slots, `eviction` bound to the MoE layers; and whether
    it is zero-copy (it adopted every row of the RAM tier)."""
    E, moe_layers = ex.E, ex.moe_layers
    # Both tiers in host memory and every expert in the fast tier: the RAM tier's buffer *is* the
    # fast tier (zero-copy), instead of a second copy of every expert.
    ram = (
        tier
        if isinstance(tier, RamTier) and device.type == "cpu" and n_slots == len(moe_layers) * E
        else None
    )
    eviction.bind(moe_layers, E)
    store = ExpertStore(
        n_slots,
        ex.fmt.slot_numel,
        getattr(torch, ex.fmt.slot_dtype),
        device,
        eviction,
        stats,
        protect_ticks=protect_ticks(len(moe_layers)),
        slots=ram.buffer if ram is not None else None,
        huge_pages=cfg.huge_pages,
    )
    if ram is not None:
        store.adopt({layer * E + e: ram.row(layer, e) for layer in moe_layers for e in range(E)})
    return store, ram is not None


def warm(om: OffloadedModel) -> None:
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
