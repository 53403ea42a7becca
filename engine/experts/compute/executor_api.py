"""What MoeExecutor publishes to other packages: its capabilities, a snapshot the dispatcher and the
plan read (the executor's methods lane_open, native_moe and expert_pointers are the rest)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExecutorCapabilities:
    """What the executor can do now. A snapshot: the loader attaches CPU experts, the balancer's
    meter, the utility estimator and the per-layer hook after construction."""

    store_complete: bool  # every expert of the model resident for good: nothing can miss
    lane_open: bool  # nothing that plans around misses is attached (see MoeExecutor.lane_open)
    resident_lane: bool  # a one-row step takes the resident lane (store_complete and lane_open)
    native_lane: bool  # a CPU row's resident experts run in one native call from the slots
    grouped: bool  # a batched step's resident experts may run in one grouped GEMM per projection
    cpu_experts: bool  # missed experts may run on CPU workers (MoE-SpAc's split)
    cpu_mode: str  # off | auto | all
