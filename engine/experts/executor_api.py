"""What MoeExecutor publishes to other packages (its capabilities), and the private names that
engine/worker/fused_decode.py and tests read today, kept as thin aliases until they use the
public ones (MoeExecutor.capabilities, lane_open, native_moe, expert_pointers)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from engine.experts.expert_compute import ExpertCompute
    from engine.experts.native_moe import NativeMoe, SlotPointers


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


class PrivateAliases:
    """Old private names of MoeExecutor, forwarding to the public ones or to its compute strategies.
    `_lane_open` and `_expert` stay the names the executor itself calls: tests patch them."""

    compute: ExpertCompute

    def lane_open(self) -> bool:
        raise NotImplementedError

    def _lane_open(self) -> bool:
        return self.lane_open()

    def _expert(self, key: int, x: torch.Tensor) -> torch.Tensor:
        return self.compute.expert(key, x)

    @property
    def _native(self) -> NativeMoe | None:
        return self.compute.native

    @_native.setter
    def _native(self, value: NativeMoe | None) -> None:
        self.compute.native = value

    @property
    def _pointers(self) -> list[SlotPointers]:
        return self.compute.pointers

    @property
    def _grouped_ok(self) -> bool:
        return self.compute.grouped_ok

    @_grouped_ok.setter
    def _grouped_ok(self, value: bool) -> None:
        self.compute.grouped_ok = value
