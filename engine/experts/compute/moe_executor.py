"""Runs the routed experts of one MoE layer for the T token rows of a step: planning, leases and
dispatch. The strategies: engine/experts/compute/expert_compute.py (what the slots compute), expert_streaming.py
(a plan through loads), cpu_split.py (which misses run on the CPU).

Order of work per layer:
1. the policy turns the router's choice into an ExpertPlan (pure decision);
2. resident experts are pinned, missing ones are requested as demand loads;
3. experts run as soon as their weights are present, each over all of its rows at once
   (grouped per expert; no Python loop over tokens), then are unpinned so their slot
   can take the next load when the layer needs more experts than there are slots;
4. each row's contributions are summed in ascending expert order, the same order in
   which transformers' reference accumulates, so the exact policy matches it within float
   rounding: bit for bit through torch's kernels, to the order of each dot product's sum
   through the native CPU kernels (engine/native/; logits within 1e-7-1e-6 in fp32).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.experts.compute.cpu_experts import CpuExperts
from engine.experts.compute.cpu_split import CpuSplit
from engine.experts.compute.device_lane import DeviceLane
from engine.experts.compute.executor_api import ExecutorCapabilities
from engine.experts.compute.expert_compute import ExpertCompute
from engine.experts.compute.expert_streaming import ExpertLoadError, ExpertStreamer
from engine.experts.compute.native_moe import NativeMoe, SlotPointers
from engine.experts.cost_meter import CostMeter
from engine.experts.formats.quant import ExpertFormat
from engine.experts.tiers.expert_store import ExpertLease, ExpertStore
from engine.experts.tiers.transfers import TransferEngine
from engine.stats import EngineStats
from engine.weights.expert_layout import ExpertShape
from policies.base import DROPPED, AdmissionPolicy, ExpertPlan, MissPolicy
from policies.utility import SpeculativeUtilityEstimator

__all__ = ["ExecutorCapabilities", "ExpertLoadError", "MoeExecutor"]


class MoeExecutor:
    def __init__(
        self,
        store: ExpertStore,
        transfers: TransferEngine,
        policy: MissPolicy,
        admission: AdmissionPolicy,
        stats: EngineStats,
        shape: ExpertShape,
        num_experts: int,
        act_fn: Callable[[torch.Tensor], torch.Tensor] | None,
        fmt: ExpertFormat | None = None,
    ) -> None:
        self.store, self.transfers, self.policy, self.admission, self.stats = (
            store,
            transfers,
            policy,
            admission,
            stats,
        )
        self.shape, self.num_experts = shape, num_experts
        self.compute = ExpertCompute(store, shape, num_experts, act_fn, fmt)
        self.fmt = self.compute.fmt
        self.streamer = ExpertStreamer(
            self.compute, store, transfers, stats, lambda key, x: self.expert(key, x)
        )
        self.cpu_split = CpuSplit(store, transfers, stats)
        # MoE-SpAc (set by the loader when enabled): CPU-run experts, the balancer's cost meter and
        # mode (auto: makespan-optimal split; all: every miss on the CPU, a diagnostic), the utility
        # estimator that ranks misses, and a hook run after each layer (the utility prefetcher's top-up).
        self.cpu: CpuExperts | None = None
        self.cpu_mode = "off"
        self.meter: CostMeter | None = None
        self.utility: SpeculativeUtilityEstimator | None = None
        self.after_layer: Callable[[int], None] | None = None
        # Deterministic residency (eval): background loads land before each plan, never mid-way.
        self.settle_background = False
        # EngineConfig.resident_lane: False sends every step through the per-layer plan (a diagnostic).
        self.resident_lane = True
        # On CUDA the resident lane keeps the router's choice on the device (no host read per layer).
        self.device_lane: DeviceLane | None = (
            DeviceLane(store, self.fmt.kernel, num_experts)  # type: ignore[arg-type]  # supports(): SwiGLU
            if store.slots.is_cuda and DeviceLane.supports(self.fmt)
            else None
        )

    # -- what other packages may read -------------------------------------------------------
    def capabilities(self) -> ExecutorCapabilities:
        lane = self.lane_open()
        return ExecutorCapabilities(
            self.store.complete,
            lane,
            self.store.complete and lane,
            native_lane=self.compute.native is not None,
            grouped=self.compute.grouped_ok,
            cpu_experts=self.cpu is not None,
            cpu_mode=self.cpu_mode,
        )

    def lane_open(self) -> bool:
        """Whether a one-row step may take the resident lane: every expert resident (store.complete:
        nothing can miss, so what plans around misses has nothing to decide: CPU experts and the
        balancer's meter see no miss, the utility estimator nothing to prefetch or evict, its
        per-layer hook nothing to top up), or none of those attached. The lane also needs
        store.complete, which the caller checks; a store that stops being complete (the KV pool
        borrowing slots) takes the planned path again."""
        return self.resident_lane and (
            self.store.complete
            or (
                self.cpu is None
                and self.meter is None
                and self.utility is None
                and self.after_layer is None
            )
        )

    def expert(self, key: int, x: torch.Tensor) -> torch.Tensor:
        """One resident expert's output for rows x (the compute strategy's; streaming and the lane call it)."""
        return self.compute.expert(key, x)

    @property
    def native_moe(self) -> NativeMoe | None:
        """The native kernel that runs a CPU row's experts from the slots, or None (torch runs them)."""
        return self.compute.native

    def expert_pointers(self, layer: int) -> list[SlotPointers]:
        """The native slot addresses of every expert of `layer`, in id order; only while
        store.complete (no slot can move) and native_moe is not None."""
        E = self.num_experts
        return [self.compute.pointers[self.store.slot_index(layer * E + e)] for e in range(E)]

    # -- one layer ----------------------------------------------------------------------------
    def run(
        self,
        layer: int,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        scores: torch.Tensor,
    ) -> torch.Tensor:
        """x: [T, H]; ids, weights: [T, k] from the native router, and scores [T, E], what it ranks to
        pick (its logits, or sigmoid + bias), read by policies that choose stand-ins. Returns [T, H]."""
        if ids.shape[0] == 1 and self.store.complete and self.lane_open():
            return self._resident_lane(layer, x, ids, weights)
        ids_list = ids.tolist()
        weight_rows = weights.tolist()
        logit_rows = scores.tolist() if self.policy.needs_logits else None
        if self.settle_background:
            self.transfers.settle(layer)
        self.store.begin_layer(layer)
        with self.store.lease() as lease:
            plan, needed, ready = self._plan_and_pin(
                layer, lease, ids_list, weight_rows, logit_rows
            )
            self.store.tick()
            self.stats.record_lookups(layer, len(ready), len(needed) - len(ready))
            self._account(plan)
            to_load = [e for e in needed if e not in ready]
            on_cpu = (
                self.cpu_split.split(
                    layer,
                    plan,
                    ready,
                    to_load=to_load,
                    mode=self.cpu_mode,
                    meter=self.meter,
                    utility=self.utility,
                    cpu_workers=self.cpu.workers,
                )
                if self.cpu is not None and to_load
                else []
            )
            try:
                out = self.streamer.run(
                    layer,
                    x,
                    ids,
                    weights=weights,
                    ids_list=ids_list,
                    plan=plan,
                    lease=lease,
                    ready=ready,
                    to_load=[e for e in to_load if e not in on_cpu],
                    on_cpu=on_cpu,
                    weight_rows=weight_rows,
                    meter=self.meter,
                    cpu=self.cpu,
                )
            except ExpertLoadError as err:
                # Which rows needed the expert that failed: the runner fails only their requests.
                err.rows = sorted({t for t, row in enumerate(plan.experts) if err.expert in row})
                raise
        if plan.substituted:
            self._admit(
                layer, plan
            )  # after compute, so admissions never evict what this layer used
        if self.after_layer is not None:
            self.after_layer(
                layer
            )  # this layer's slots are unpinned now: room for the next layer's prefetches
        return out

    def _plan_and_pin(
        self,
        layer: int,
        lease: ExpertLease,
        ids_list: list,
        weight_rows: list[list[float]],
        logit_rows: list[list[float]] | None,
    ) -> tuple[ExpertPlan, list[int], list[int]]:
        """The policy's plan for `layer`, the experts it needs (ascending) and those of them resident,
        which are pinned by `lease` and touched. Plan and pin under the store lock: no thread can evict
        an expert between the policy counting it as a hit (or choosing it as a stand-in) and this
        layer using it."""
        E = self.num_experts
        with self.store.lock:
            plan = self.policy.plan(
                layer,
                ids_list,
                weight_rows,
                lambda e: self.store.is_resident(layer * E + e),
                logit_rows,
            )
            fetch = set(plan.fetch)
            needed = sorted({e for row in plan.experts for e in row if e != DROPPED})
            if plan.experts is ids_list and not fetch:
                ready = needed  # the router's own choice, every expert found resident by the plan under this lock
            else:
                ready = [
                    e for e in needed if e not in fetch and self.store.is_resident(layer * E + e)
                ]
            keys = [layer * E + e for e in ready]
            lease.pin_all(keys)
            self.store.touch_all(keys)
        return plan, needed, ready

    def _resident_lane(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """One decode row when every expert of the model is resident for good (store.complete).

        What run() does there, less what cannot matter: a miss policy decides only about misses
        (policies/base.py), so its plan is the router's choice; no slot can be evicted or is
        prefetched, so nothing to pin, rank or expire. Left: the hit counters and the compute.
        On CUDA (device_lane) nothing of the router's choice is read to the host."""
        if self.device_lane is not None:
            self.stats.record_all_hits(layer, ids.shape[1])
            return self.device_lane.run(layer, x, ids, weights)
        row = ids.tolist()[0]  # no select op: [1, k] -> a list
        self.stats.record_all_hits(layer, len(row))
        return self.compute.resident(
            layer,
            x,
            sorted(row),
            slot_of={e: j for j, e in enumerate(row)},
            weights=weights,
            w_list=weights.tolist()[0],
            expert=self.expert,
        )

    def _account(self, plan: ExpertPlan) -> None:
        """Per-call counters: hit, fetched, substituted, and the substituted gate mass."""
        self.stats.add(
            calls_hit=plan.calls_hit,
            calls_fetched=plan.calls_fetched,
            substitutions=len(plan.substituted),
            substituted_mass=sum(m for _, m in plan.substituted),
        )

    def _admit(self, layer: int, plan: ExpertPlan) -> None:
        """Background admission of experts that keep being substituted (asynchronous: queued behind
        demand loads; compute never waits for it)."""
        admitted = sum(
            1
            for e in self.admission.observe(layer, plan.substituted)
            if self.transfers.submit(layer, e, "admission") is not None
        )
        if admitted:
            self.stats.add(admissions=admitted)
