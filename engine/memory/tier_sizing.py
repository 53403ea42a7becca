"""The memory plan's choice of the expert tiers (engine/memory/planner.py): the slow tier (host RAM
or the checkpoint on disk) and the fast tier's slots, within what the budget leaves after the
dense part, the KV reservation, the scratch and the headroom.

Explicit flags (--cache-fraction / --cache-bytes, --offload ram|disk) win; a combination that
cannot fit raises ConfigError with one line saying what does not fit and by how much.
"""

from __future__ import annotations

from engine.budget import fmt_bytes
from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.memory.footprint import Footprint


def short_of(what: str, need: int, have: int, hint: str) -> ConfigError:
    """The error for `what`, needing `need` bytes where the budget leaves `have`: by how much, and `hint`."""
    return ConfigError(
        f"memory plan: {what} needs {fmt_bytes(need)} but the budget leaves {fmt_bytes(max(0, have))} "
        f"(short by {fmt_bytes(need - max(0, have))}); {hint}"
    )


def is_explicit(cfg: EngineConfig) -> bool:
    """Whether --cache-bytes or --cache-fraction sizes the fast tier (else the plan does)."""
    return cfg.cache_bytes is not None or cfg.cache_fraction is not None


def explicit_slots(cfg: EngineConfig, total: int, slot_bytes: int) -> int:
    """Fast-tier slots --cache-bytes or --cache-fraction ask for (at least 1, at most every expert)."""
    n = (
        cfg.cache_bytes // slot_bytes
        if cfg.cache_bytes is not None
        else round((cfg.cache_fraction or 1.0) * total)
    )
    return int(min(total, max(1, n)))


def gpu_tiers(
    cfg: EngineConfig, total: int, slot: int, left: int, host_left: int
) -> tuple[str, int]:
    """(slow tier, fast-tier slots) beside a GPU: the fast tier is device memory (`left` bytes after
    the fixed pools), the RAM tier pinned host memory (`host_left`: the host budget less headroom)."""
    offload = cfg.offload
    if is_explicit(cfg):
        n = explicit_slots(cfg, total, slot)
        if n * slot > left:
            raise short_of(
                f"the fast tier ({n} experts)",
                n * slot,
                left,
                "lower --cache-fraction / --cache-bytes or raise --device-memory",
            )
    else:
        n = min(total, left // slot)
    if offload == "auto":
        offload = "ram" if total * slot <= host_left else "disk"
    elif offload == "ram" and total * slot > host_left:
        raise short_of(
            "the RAM tier (every expert, pinned)",
            total * slot,
            host_left,
            "use --offload disk or raise --host-memory",
        )
    return offload, n


def cpu_tiers(cfg: EngineConfig, total: int, slot: int, left: int) -> tuple[str, int]:
    """(slow tier, fast-tier slots) on a CPU: both tiers share the host's `left` bytes (after the
    fixed pools); a fast tier of every expert over a RAM tier is the RAM tier itself (zero-copy)."""
    offload = cfg.offload
    all_ram = total * slot
    if is_explicit(cfg):
        n = explicit_slots(cfg, total, slot)
        ram_need = all_ram + (0 if n == total else n * slot)
        if offload == "auto":
            offload = "ram" if ram_need <= left else "disk"
        need = ram_need if offload == "ram" else n * slot
        if need > left:
            what = (
                f"the RAM tier and a {n}-expert fast tier"
                if offload == "ram"
                else f"the fast tier ({n} experts)"
            )
            raise short_of(
                what,
                need,
                left,
                "lower --cache-fraction / --cache-bytes, use --offload disk, or raise --host-memory",
            )
    elif offload in ("auto", "ram") and all_ram <= left:
        offload, n = "ram", total
    elif offload == "ram":
        raise short_of(
            "every expert in RAM",
            all_ram,
            left,
            "use --offload disk (the fast tier is then sized to the budget) or raise --host-memory",
        )
    else:
        offload, n = "disk", min(total, left // slot)
    return offload, n


def room_left(fixed_bytes: int, budget: int, on_gpu: bool) -> int:
    """Bytes `budget` leaves the expert tiers after the fixed pools' `fixed_bytes` (the dense part, the KV
    reservation, the scratch and the headroom); raises where nothing is left."""
    left = budget - fixed_bytes
    if left <= 0:
        raise short_of(
            "the dense part, KV reservation, scratch and headroom",
            fixed_bytes,
            budget,
            "raise --device-memory / --host-memory or lower --max-model-len / --max-running / --kv-tokens"
            if on_gpu
            else "raise --host-memory or lower --max-model-len / --max-running / --kv-tokens",
        )
    return left


def check_min_slots(fp: Footprint, cfg: EngineConfig, n: int, left: int, on_gpu: bool) -> None:
    """Raises where the planner's own fast tier of `n` slots holds less than one token's top-k."""
    min_slots = min(fp.total_experts, fp.top_k)
    if n < min_slots and not is_explicit(
        cfg
    ):  # an explicit size below one token's top-k streams; the planner never picks one
        raise short_of(
            f"the fast tier's minimum ({min_slots} experts: one token's top-k)",
            min_slots * fp.slot_bytes,
            left,
            "raise --device-memory / --host-memory" if on_gpu else "raise --host-memory",
        )
