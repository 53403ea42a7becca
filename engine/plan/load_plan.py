"""A load's decisions, each with its reason: plain data (no torch; dtypes are their names).

`resolve` (engine/plan/resolve.py) makes a `LoadPlan` from config.json, the safetensors headers and
the machine; the loader (engine/worker/loader.py `build`) allocates to it without deciding again;
`moe-offload plan` prints it and `serve` and `generate` print the same text at start (`describe`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from engine.budget import fmt_bytes

if TYPE_CHECKING:
    from engine.memory.planner import MemoryPlan
    from engine.plan.execution import ExecutionPlan


@dataclass(frozen=True)
class ArchChoice:
    """The architecture the checkpoint runs as (engine/weights/arch.py) and why."""

    model_type: str  # the text model's (multimodal wrappers: their text_config)
    by_structure: bool  # outside the architecture table: its MoE blocks are checked at load
    why: str


@dataclass(frozen=True)
class ExpertSlots:
    """The routed experts as the tiers hold them: geometry, format and slot dtype, and why that format."""

    format: str  # the slot format's name, e.g. "float32", "bf16 slots", "int8", "mxfp4"
    slot_dtype: str  # the slots' torch dtype, by name ("float32", "bfloat16", "uint8")
    slot_bytes: int  # one expert as a slot holds it
    disk_bytes: (
        int  # one expert as the disk tier reads it (the quantized sidecar's row where there is one)
    )
    moe_layers: tuple[int, ...]
    num_experts: int  # per MoE layer
    top_k: int
    hidden: int
    intermediate: int
    why: str

    @property
    def total(self) -> int:
        return len(self.moe_layers) * self.num_experts


@dataclass(frozen=True)
class KernelBuild:
    """The native kernels' build the engine runs (engine/native/loaded.py): its variant, None where torch's
    kernels run; `line`: "on: <build>; <measurement, cached per CPU>" or "off: <why>"."""

    build: str | None
    line: str


@dataclass(frozen=True)
class LoadPlan:
    """Every decision of one load, with its reason: architecture, experts' format, native kernels' build,
    memory split (fast tier, dense, KV), execution path and prefetchers."""

    model_dir: str
    device: str  # "cpu" or "cuda[:N]"
    dtype: str  # the compute dtype, by name
    arch: ArchChoice
    experts: ExpertSlots
    kernels: KernelBuild
    memory: MemoryPlan
    kv_token_budget: int  # KV positions the memory plan reserves; the scheduler admits by them
    execution: ExecutionPlan
    prefetch: tuple[str, ...]  # the prefetchers --prefetch resolves to (engine/plan/resolve.py)

    @property
    def complete(self) -> bool:
        """Every routed expert fits the fast tier."""
        return self.memory.n_slots == self.experts.total

    def with_speculation(self, mode: str, why: str) -> LoadPlan:
        """The plan with the speculation the front end resolved (its execution plan's last line)."""
        return replace(self, execution=self.execution.with_speculation(mode, why))

    def lines(self) -> list[str]:
        """The plan as text, a line each: what `moe-offload plan` prints and `serve` logs at start."""
        ex = self.experts
        lines = [
            f"load plan for {self.model_dir}: {self.arch.model_type}, {len(ex.moe_layers)} MoE layers x "
            f"{ex.num_experts} experts (top-{ex.top_k}), compute {self.dtype} on {self.device}",
            f"  architecture  {self.arch.model_type}: {self.arch.why}",
            f"  experts       {'float' if ex.format == 'none' else ex.format} experts, {ex.slot_dtype} slots of {fmt_bytes(ex.slot_bytes)} "
            f"({fmt_bytes(ex.slot_bytes * ex.total)} in all), {fmt_bytes(ex.disk_bytes)} a disk read; {ex.why}",
        ]
        lines += self.memory.table().splitlines()
        lines.append("execution plan:")
        lines += ["  " + line for line in self.execution.lines()]
        return lines

    def describe(self) -> str:
        return "\n".join(self.lines())
