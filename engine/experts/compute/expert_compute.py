"""What the fast tier's slots compute: one expert over its rows, a decode row through a set of
resident experts (one native call on the CPU, else a loop of torch calls), and the grouped GEMM
of a batched step's resident experts.

Every result keeps transformers' summation order (ascending expert ids), so the exact policy
matches the reference within float rounding (see engine/experts/compute/moe_executor.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import accumulate

import torch

from engine.experts.compute.native_moe import NativeMoe, SlotPointers
from engine.experts.compute.native_mxfp4 import native_experts
from engine.experts.formats.expert_kernels import SwiGLUKernel
from engine.experts.formats.quant import ExpertFormat, PlainFormat
from engine.experts.tiers.expert_store import ExpertStore
from engine.native.decode_shapes import dtype_name
from engine.weights.expert_layout import ExpertShape

GROUPED_MAX_SLOT_BYTES = (
    256 * 1024
)  # above this, a slot costs more to gather than a Python call (see grouped_ok)

ExpertFn = Callable[
    [int, torch.Tensor], torch.Tensor
]  # (key, rows [n, H]) -> unscaled output [n, H]


class ExpertCompute:
    def __init__(
        self,
        store: ExpertStore,
        shape: ExpertShape,
        num_experts: int,
        act_fn: Callable[[torch.Tensor], torch.Tensor] | None,
        fmt: ExpertFormat | None = None,
    ) -> None:
        self.store, self.shape, self.num_experts = store, shape, num_experts
        # What an expert computes and how a slot encodes it (engine/experts/formats/quant.py); default: SwiGLU in
        # floats, with the experts' act_fn (None only where a format is given).
        if fmt is None:
            assert act_fn is not None, "the default SwiGLU format needs the experts' act_fn"
            fmt = PlainFormat(
                SwiGLUKernel(shape.hidden, shape.intermediate, act_fn),
                dtype_name(store.slots.dtype),
            )
        self.fmt = fmt
        # Per-slot weight views, made once: windows onto each contiguous slot ([2I, H] and [H, I] for SwiGLU).
        self.views = [self.fmt.views(row) for row in store.slots]
        # One-token steps on the CPU run their experts in one native call (engine/experts/compute/native_moe.py)
        # from each slot's memory; None where the format or machine does not allow it.
        on_cpu = store.slots.device.type == "cpu"
        self.native: NativeMoe | None = (
            native_experts(self.fmt, shape.hidden, shape.intermediate) if on_cpu else None
        )
        self.pointers: list[SlotPointers] = (
            [self.native.pointers(v) for v in self.views] if self.native is not None else []
        )
        # The grouped path reads slots as plain [gate | up | down] float matrices: SwiGLU, unquantized,
        # with torch's grouped GEMM (a private op, hence the feature check).
        # It gathers the slots it uses first, which pays only for small experts: a gather copies
        # each expert once more, about 12 us per 100 KB here, against 40-50 us of Python and
        # dispatch per expert in the loop. For the mid peers checkpoint (6.3 MB f32 experts) a
        # 16-token prefill spent about 80 ms per layer gathering, far more than the loop costs.
        self.grouped_ok = (
            isinstance(self.fmt, PlainFormat)
            and type(self.fmt.kernel) is SwiGLUKernel
            and hasattr(torch, "_grouped_mm")
            and store.slots.dtype in (torch.float32, torch.bfloat16)
            and self.fmt.slot_bytes <= GROUPED_MAX_SLOT_BYTES
        )

    def expert(self, key: int, x: torch.Tensor) -> torch.Tensor:
        """One expert over its rows x [n, H] -> [n, H], unscaled (dequantizing its slot first if quantized)."""
        slot = self.store.slot_index(key)
        if self.native is not None and self.native.accepts(x):
            return self.native.rows(x, self.pointers[slot])
        return self.fmt.forward(self.views[slot], x)

    def native_rows(self, x: torch.Tensor) -> bool:
        """Whether rows x run through the native kernels, each row as it would alone (decode and
        verification rows on the CPU): then the grouped GEMM, whose result for a row depends on the
        rows beside it, must not run them."""
        return self.native is not None and self.native.accepts(x)

    def resident(
        self,
        layer: int,
        x: torch.Tensor,
        ready: list[int],
        slot_of: dict[int, int],
        weights: torch.Tensor,
        w_list: list[float],
        expert: ExpertFn,
    ) -> torch.Tensor:
        """x [1, H] through the resident experts `ready` (ascending: transformers' summation order), each
        scaled by its weight (row slot slot_of[e] of weights [1, k] / its float w_list): one native call
        on the CPU, else a loop of `expert` calls."""
        E = self.num_experts
        if self.native is not None and ready and x.shape[0] == 1 and self.native.accepts(x):
            return self.native.run(
                x,
                [self.pointers[self.store.slot_index(layer * E + e)] for e in ready],
                [w_list[slot_of[e]] for e in ready],
            )
        w = weights[0].unbind(0)
        out: torch.Tensor | None = None
        for e in ready:
            y = (expert(layer * E + e, x) * w[slot_of[e]]).to(x.dtype)
            out = y if out is None else out.add_(y)
        return out if out is not None else torch.zeros_like(x)  # every expert dropped by the policy

    def resident_rows(
        self,
        layer: int,
        x: torch.Tensor,
        experts: list[int],
        rows: Sequence[Sequence[int]],
        weight_rows: list[list[float]],
    ) -> torch.Tensor:
        """Rows x [T, H] (native rows) through their resident experts in one native call: row t takes
        the distinct experts rows[t], scaled by weight_rows[t], summed in ascending id (transformers'
        order). `experts`: every expert the rows name, all pinned. Each row's bits are those of the row
        alone (decode's moe_swiglu is the same kernel with one row), so this replaces one call per
        expert for a prompt chunk or a batched step: a short prompt on a small model paid about 100
        ctypes calls a layer. Only where native_rows(x) holds."""
        assert self.native is not None
        order = sorted(experts)
        index = {e: i for i, e in enumerate(order)}
        E = self.num_experts
        table = [self.pointers[self.store.slot_index(layer * E + e)] for e in order]
        ids = [index[e] for row in rows for e in row]
        weights = [w for row in weight_rows for w in row]
        return self.native.rows_routed(x, table, ids, weights)

    def grouped(
        self,
        layer: int,
        x: torch.Tensor,
        groups: dict[int, torch.Tensor],
        w_flat: torch.Tensor,
        experts: list[int],
        contrib: torch.Tensor,
        k: int,
    ) -> None:
        """SwiGLU of the resident `experts` (ascending) over all their rows, into contrib [T*k, H]: one
        grouped GEMM per projection over just the slots this step uses, gathered from the slot pool
        (one group per expert). groups[e]: the flat row-slot indices routed to e.

        Why gather: torch._grouped_mm costs time per group even when a group is empty, so a
        GEMM straight over the whole pool (512 slots at cache 1.0) cost about 1.3 ms per layer
        whatever the rows; copying the 8-60 slots a step needs costs a fraction of that. The
        arithmetic per row is the same kernel either way, so results are bit-identical. Group
        sizes and slot ids are host lists: on a GPU, no sync per group."""
        H, I = x.shape[1], self.shape.intermediate
        E = self.num_experts
        slots = torch.tensor(
            [self.store.slot_index(layer * E + e) for e in experts],
            dtype=torch.long,
            device=x.device,
        )
        rows = torch.cat([groups[e] for e in experts])  # flat row-slot indices, grouped by expert
        offs = torch.tensor(
            list(accumulate(len(groups[e]) for e in experts)), dtype=torch.int32, device=x.device
        )  # [G]
        pool = self.store.slots.index_select(0, slots).to(
            x.dtype
        )  # [G, 3*I*H]: [gate | up] rows, then down, per slot (bf16 slots of an f32 model widened)
        G = len(experts)
        gate_up = pool[:, : 2 * I * H].view(G, 2 * I, H).transpose(1, 2)  # [G, H, 2I]
        down = pool[:, 2 * I * H :].view(G, H, I).transpose(1, 2)  # [G, I, H]
        gate, up = torch._grouped_mm(
            x[torch.div(rows, k, rounding_mode="floor")], gate_up, offs=offs
        ).chunk(2, dim=-1)  # [M, I]
        kernel = self.fmt.kernel
        assert isinstance(kernel, SwiGLUKernel)  # grouped_ok
        y = torch._grouped_mm(kernel.act_fn(gate) * up, down, offs=offs)  # [M, H]
        contrib[rows] = (y * w_flat[rows, None]).to(contrib.dtype)
