"""What a load returns: the model with its tokenizer and device, and, for a MoE model, the expert
store, transfers and executor its routed experts run through (engine/worker/loader.py builds them).

Plain data: this module imports nothing of engine/worker/. The runner that executes its steps is
named by the loader (`runner_factory`), so the data does not import the runner that reads it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, PretrainedConfig, PreTrainedModel

from engine.config import EngineConfig
from engine.core.contracts import Runner
from engine.experts.compute.moe_executor import MoeExecutor
from engine.experts.routing_bus import RoutingBus
from engine.experts.tiers.expert_store import ExpertStore
from engine.experts.tiers.transfers import TransferEngine
from engine.native.loaded import NativeChoice
from engine.stats import EngineStats


@dataclass
class LoadedModel:
    """What generation needs from any model: the module, its config, tokenizer and device."""

    model: PreTrainedModel
    config: PretrainedConfig
    tokenizer: (
        Any | None
    )  # a transformers tokenizer (used by duck typing), None where the checkpoint has none
    generation_config: GenerationConfig | None
    model_dir: Path
    device: torch.device
    packed: bool  # requests of a step share one packed forward (else one forward per request)
    # What runs its steps: engine/worker/runner.py ModelRunner, as the loader composes it.
    runner_factory: Callable[[LoadedModel], Runner] = field(kw_only=True)
    # The native kernels its ops run (engine/native/loaded.py), made active around everything that runs its
    # tensors (its load, its runner's steps and forwards). None: whatever choice is active where it runs.
    native: NativeChoice | None = field(default=None, kw_only=True)

    @property
    def eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        for src in (self.generation_config, self.config):
            eos = getattr(src, "eos_token_id", None) if src is not None else None
            if eos is not None:
                ids.update([eos] if isinstance(eos, int) else eos)
        return ids

    def close(self) -> None:
        pass

    def make_runner(self) -> Runner:
        """The runner that executes engine steps on this model (EngineCore.for_model asks for it)."""
        return self.runner_factory(self)


@dataclass
class OffloadedModel(LoadedModel):
    """A MoE model whose routed experts live in the tiered expert store."""

    engine_config: EngineConfig
    store: ExpertStore
    transfers: TransferEngine
    executor: MoeExecutor
    stats: EngineStats
    bus: RoutingBus
    moe_layers: list[int]
    num_experts: int
    top_k: int
    sensor: Any = (
        None  # the speculative sensor (engine/worker/sensor.py), shared by speculation and utility
    )
    utility: Any = (
        None  # the utility prefetcher (engine/experts/tiers/utility_prefetch.py), when enabled
    )
    cpu_experts: Any = (
        None  # CPU worker threads for missed experts (engine/experts/compute/cpu_experts.py)
    )
    adapter_prefetcher: Any = (
        None  # SpecPrefetch (engine/prefetch/adapter_prefetcher.py), when enabled
    )
    prefetchers: tuple[
        str, ...
    ] = ()  # the prefetchers running (--prefetch resolved: auto's choice, for reports)
    load_plan: Any = (
        None  # every decision of its load, with reasons (engine/plan/load_plan.py LoadPlan)
    )
    plan: Any = (
        None  # the paths its steps may take: load_plan's ExecutionPlan (engine/plan/execution.py)
    )
    memory_plan: Any = None  # the memory plan it was built to (engine/memory/planner.py MemoryPlan)
    kv_token_budget: int | None = None  # KV positions the plan reserved; the scheduler admits by it
    route_log: Any = None  # --route-log's writer (engine/experts/route_log.py), when asked for

    def parameter_count(self) -> int:
        """Dense parameters on the device plus every routed expert's (counted as weights, whatever
        format the tiers store them in)."""
        dense = sum(p.numel() for p in self.model.parameters()) + sum(
            getattr(m, "stored_numel", 0) for m in self.model.modules()
        )  # a table left in the checkpoint (engine/weights/disk_embedding.py) counts too
        return dense + len(self.moe_layers) * self.num_experts * self.executor.fmt.kernel.numel

    @property
    def step_observers(self) -> tuple[Any, ...]:
        """What every engine core of this model runs after each step (the sensor, if any)."""
        return (self.sensor,) if self.sensor is not None else ()

    def close(self) -> None:
        self.transfers.close()
        if self.cpu_experts is not None:
            self.cpu_experts.close()
        if self.route_log is not None:
            self.route_log.close()
