"""Counting the reads of tensor values to the host, on any device: the CPU stand-in for counting
host-device synchronizations.

On a GPU, `t.item()`, `t.tolist()`, `int(t)`, `bool(t)`, `t.cpu()` and the ops whose output size
depends on the values (`nonzero`, `unique`, boolean-mask indexing) each make the host wait until
the device has computed `t`: a synchronization that stops the host from queueing the next kernels.
On a CPU those calls cost nothing special, so a CPU test cannot see them in a profile; this
TorchFunctionMode counts them by name instead, and by the engine source line that made them, so a
test can bound them per decode step and say where they come from. It counts every such call, on
any tensor (some read tensors that live on the host even on a GPU): an upper bound of the
synchronizations a GPU would make.
"""

from __future__ import annotations

import sys
from collections import Counter
from types import FrameType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# Tensor methods and functions that return host values (or shapes only the values decide).
_READS: dict[Any, str] = {
    torch.Tensor.item: "item",
    torch.Tensor.tolist: "tolist",
    torch.Tensor.numpy: "numpy",
    torch.Tensor.cpu: "cpu",
    torch.Tensor.__bool__: "bool",
    torch.Tensor.__int__: "int",
    torch.Tensor.__float__: "float",
    torch.Tensor.__index__: "index",
    torch.Tensor.nonzero: "nonzero",
    torch.nonzero: "nonzero",
    torch.Tensor.unique: "unique",
    torch.unique: "unique",
    torch.masked_select: "masked_select",
    torch.Tensor.masked_select: "masked_select",
}


class HostReads(TorchFunctionMode):
    """`with HostReads() as reads: ...`; then `reads.total`, `reads.by_kind` and `reads.by_line`
    ("path:line" of the innermost frame under engine/, policies/ or server/ that made the read)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_kind: Counter[str] = Counter()
        self.by_line: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    def reset(self) -> None:
        self.by_kind.clear()
        self.by_line.clear()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kind = _READS.get(func)
        if kind is None and func is torch.Tensor.to and _to_host(args, kwargs or {}):
            kind = "to(cpu)"
        if kind is None and func is torch.Tensor.__getitem__ and _mask_index(args):
            kind = "mask index"
        if kind is not None:
            self.by_kind[kind] += 1
            self.by_line[_caller()] += 1
        return func(*args, **(kwargs or {}))


def _to_host(args: tuple, kwargs: dict) -> bool:
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    if isinstance(target, torch.Tensor):
        target = target.device
    return (
        isinstance(target, (str, torch.device))
        and torch.device(target).type == "cpu"
        and isinstance(args[0], torch.Tensor)
    )


def _mask_index(args: tuple) -> bool:
    idx = args[1] if len(args) > 1 else None
    items = idx if isinstance(idx, tuple) else (idx,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _caller() -> str:
    """The innermost project frame above this module ("engine/x.py:12"), else the innermost frame."""
    frame: FrameType | None = sys._getframe(2)
    first = None
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        for root in ("/engine/", "/policies/", "/server/"):
            if root in path and not path.endswith("host_reads.py"):
                return f"{root[1:]}{path.rsplit(root, 1)[1]}:{frame.f_lineno}"
        first = first or f"{path.rsplit('/', 1)[-1]}:{frame.f_lineno}"
        frame = frame.f_back
    return first or "?"
