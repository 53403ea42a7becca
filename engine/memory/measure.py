"""A load's bytes measured: once loaded, its planned bytes beside the used ones."""

from __future__ import annotations

import torch
from torch import nn

from engine.memory.planner import MemoryPlan


def memory_probe(plan: MemoryPlan, model: nn.Module, store: object, tier: object):
    """A callable returning {pool: {"planned": bytes, "used": bytes}}: the plan beside what the
    process holds now. Used bytes are measured where one object holds the pool (dense parameters,
    the fast tier's slots, the RAM tier's buffers) and, for the whole process, its resident set
    and (on a GPU) the bytes torch has allocated."""
    from engine.memory.machine import rss_bytes

    planned = plan.planned()
    dense = sum(
        p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values()
    )
    slots = getattr(store, "slots", None)
    fast = 0 if plan.zero_copy or slots is None else slots.numel() * slots.element_size()
    slow = int(getattr(tier, "nbytes", 0))

    def probe() -> dict[str, dict[str, int]]:
        out = {name: {"planned": b} for name, b in planned.items()}
        out["dense"]["used"] = dense
        out["fast_tier"]["used"] = fast
        out["slow_tier"]["used"] = slow
        out["slow_tier_pageable"] = {"planned": 0, "used": int(getattr(tier, "pageable_bytes", 0))}
        out["host_total"] = {"planned": plan.total("host"), "used": rss_bytes()}
        if plan.device_budget is not None:
            out["device_total"] = {
                "planned": plan.total("device"),
                "used": int(torch.cuda.memory_allocated()),
            }
        return out

    return probe
