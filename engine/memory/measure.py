"""A load's bytes measured: the dense bytes its narrower dense weights save (what the load plan's
footprint subtracts: engine/plan/survey.py) and, once loaded, its planned bytes beside the used ones."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.config import EngineConfig
from engine.memory.planner import MemoryPlan
from engine.native.decode_shapes import dtype_name
from engine.native.dense_names import DenseLinear, dense_bytes_saved, narrows_dense
from engine.weights.safetensors_index import TensorLocation


def dense_saved(
    linears: Iterable[DenseLinear],
    tensors: dict[str, TensorLocation],
    cfg: EngineConfig,
    device: torch.device,
    dtype: str,
    native: bool,
) -> int:
    """Dense bytes the load will not hold in the compute `dtype` (torch's name for it): --dense-quant int8 codes, and an f32
    model's bf16 dense weights where the native kernels read them (`native`: the plan's kernel answer; the
    loader's rule for narrow_dense, dense_names.narrows_dense);
    `linears`: the dense linears as the checkpoint's headers name them (engine/weights/header_survey.py)."""
    dtypes = {name: dtype_name(t.dtype) for name, t in tensors.items()}
    narrow = narrows_dense(cfg.bf16_dense, device.type, native)
    return dense_bytes_saved(linears, dtype, dtypes, cfg.dense_quant, narrow)


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
