"""The prefetchers and MoE-SpAc parts a load attaches to an OffloadedModel, as the settings ask:
`attach_spac` builds the utility estimator, the prefetchers the load plan names (engine/plan/prefetch.py)
and the CPU expert workers (engine/worker/loader.py calls it)."""

from __future__ import annotations

import logging

from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.experts.compute.cpu_experts import CpuExperts
from engine.experts.cost_meter import CostMeter
from engine.experts.formats.quant import ExpertFormat
from engine.experts.tiers.slow_tier import SlowTier
from engine.experts.tiers.utility_prefetch import UtilityPrefetcher
from engine.plan.prefetch import adapter_file
from engine.prefetch.adapter_prefetcher import AdapterPrefetcher
from engine.worker.loaded_model import OffloadedModel
from engine.worker.sensor import sensor_for
from policies.base import EvictionPolicy
from policies.utility import SpeculativeUtilityEstimator, UtilityEviction

log = logging.getLogger(__name__)


def attach_spac(
    om: OffloadedModel,
    cfg: EngineConfig,
    kinds: set[str],
    eviction: EvictionPolicy,
    tier: SlowTier,
    fmt: ExpertFormat,
    meter: CostMeter | None,
) -> None:
    """MoE-SpAc's parts, when the settings ask for them: one utility estimator fed by the
    speculative sensor, shared by utility prefetch, utility eviction and the CPU/GPU balancer's
    ranking; CPU workers for missed experts; and SpecPrefetch's adapter (`kinds`: the load plan's, engine/plan/prefetch.py)."""
    wants_utility = (
        "utility" in kinds or isinstance(eviction, UtilityEviction) or cfg.cpu_experts != "off"
    )
    if wants_utility:
        estimator = SpeculativeUtilityEstimator(om.num_experts)
        if isinstance(eviction, UtilityEviction):
            eviction.estimator = estimator
        prefetcher = UtilityPrefetcher(
            estimator, om.store, om.transfers, om.moe_layers, om.stats, prefetch="utility" in kinds
        )
        prefetcher.attach(om.bus)
        sensor_for(om).include_plain = True  # plain decode steps feed the estimator too
        om.utility = prefetcher
        om.executor.utility = estimator
        if "utility" in kinds:
            om.executor.after_layer = prefetcher.after_layer
    if "adapter" in kinds:
        assert meter is not None
        try:
            om.adapter_prefetcher = _adapter_prefetcher(om, cfg, meter)
            if cfg.prefetch == "auto":
                log.info(
                    "prefetch auto: SpecPrefetch's adapter is on (a partial fast tier; --prefetch none turns it off)"
                )
        except ConfigError as err:
            if cfg.prefetch != "auto":
                raise
            log.warning(
                "prefetch auto: no SpecPrefetch adapter (%s)", err
            )  # asked for nothing: serve without
            kinds = kinds - {"adapter"}
    om.prefetchers = tuple(sorted(kinds))
    if cfg.cpu_experts != "off":
        assert meter is not None
        om.cpu_experts = CpuExperts(tier, fmt, cfg.cpu_workers, meter, om.stats)
        om.executor.cpu, om.executor.cpu_mode, om.executor.meter = (
            om.cpu_experts,
            cfg.cpu_experts,
            meter,
        )
        om.executor.cpu_split.fixed_level = cfg.balancer_level


def _adapter_prefetcher(
    om: OffloadedModel, cfg: EngineConfig, meter: CostMeter
) -> AdapterPrefetcher:
    """SpecPrefetch: the adapter file (given, or beside the model), checked against this model."""
    from engine.prefetch.adapter import load_adapter
    from engine.prefetch.training import model_fingerprint, moe_blocks

    if len(om.moe_layers) < 2:
        raise ConfigError(
            f"{om.model_dir}: --prefetch adapter needs at least 2 MoE layers (it predicts layer l+1 from layer l)"
        )
    adapter = load_adapter(adapter_file(cfg, om.model_dir), model_fingerprint(om.model))
    adapter.to(om.device)
    prefetcher = AdapterPrefetcher(
        adapter,
        moe_blocks(om.model),
        om.store,
        transfers=om.transfers,
        moe_layers=om.moe_layers,
        top_k=om.top_k,
        meter=meter,
        stats=om.stats,
    )
    prefetcher.settled = cfg.settle_background
    prefetcher.attach(om.bus)
    return prefetcher
