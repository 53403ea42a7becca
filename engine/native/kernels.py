"""Typed wrappers over the native CPU kernels (engine/native/cpu_gemv.c, decode_layer.c).

`NativeKernels` wraps one loaded build (engine/native/variants.py) of the library: the matrix kernels
here, the routers in engine/native/route_kernels.py, the row-wise ones (norms, rotary, attention) in
engine/native/row_ops.py. The process's one
instance, and whether the kernels run at all, are engine/native/loaded.py's (`native()`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Sequence

import torch

from engine.native.limits import MAX_ROWS, MAX_TOPK
from engine.native.route_kernels import RouteKernels
from engine.native.row_ops import W_CODES, X_CODES
from engine.native.structs import Experts, Routes, Rows, Weight

__all__ = ["MAX_ROWS", "W_CODES", "X_CODES", "NativeKernels"]
_P = ctypes.c_void_p


def _address_tables(
    slots: Sequence[Sequence[int]], columns: Iterable[int]
) -> dict[int, ctypes.Array]:
    """An address table (a C array, one entry a slot) for each slot column in `columns`: only those the
    kernel reads, each built per call on the decode's path."""
    return {j: (_P * len(slots))(*(s[j] for s in slots)) for j in columns}


def _swiglu_experts(
    slots: Sequence[Sequence[int]], weight_dtype: torch.dtype, hidden: int, intermediate: int
) -> Experts:
    """The descriptor of SwiGLU experts at `slots` (each: gate_up, its int8 scales, down, its scales; 0:
    none): their address tables (the scales' only for int8 slots) and their form."""
    table = _address_tables(slots, (0, 1, 2, 3) if weight_dtype == torch.int8 else (0, 2))
    return Experts(
        gate_up=table[0],
        gate_up_scale=table.get(1),
        down=table[2],
        down_scale=table.get(3),
        wtype=W_CODES[weight_dtype],
        H=hidden,
        I=intermediate,
    )


class NativeKernels(RouteKernels):
    def __init__(self, lib: ctypes.CDLL, variant: str = "portable") -> None:
        super().__init__(lib)
        self.variant = variant  # which build (engine/native/variants.py)
        caps = lib.capabilities()
        self.avx512, self.bf16_dot, self.vnni = bool(caps & 1), bool(caps & 2), bool(caps & 4)
        self.avx2 = bool(caps & 8)

    def describe(self) -> str:
        isa = (
            "AVX-512" + (" with BF16 and VNNI dot products" if self.bf16_dot else "")
            if self.avx512
            else "AVX2 + FMA"
            if self.avx2
            else "plain C, vectorised by the compiler"
        )
        return f"native CPU kernels, build {self.variant} ({isa})"

    @staticmethod
    def _routes(x: torch.Tensor, ids: Sequence[int], weights: Sequence[float]) -> Routes:
        """The routes of rows x: R rows, k experts a row, the ids and weights as C arrays."""
        R, n = x.shape[0], len(ids)
        ids_c, weights_c = (ctypes.c_int64 * n)(*ids), (ctypes.c_float * n)(*weights)
        return Routes(ids=ids_c, w=weights_c, R=R, k=n // max(R, 1))

    def _routing(
        self,
        x: torch.Tensor,
        slots: Sequence[Sequence[int]],
        ids: Sequence[int],
        weights: Sequence[float],
        columns: Iterable[int],
    ) -> tuple[Routes, dict[int, ctypes.Array]]:
        """The routed expert kernels' common arguments: the routes and an address table for each slot
        column in `columns`."""
        return self._routes(x, ids, weights), _address_tables(slots, columns)

    def _run_experts(
        self,
        fn: str,
        experts: Experts,
        routes: Routes,
        x: torch.Tensor,
        out: torch.Tensor,
        size_fn: str,
    ) -> int:
        """Rows x through the library's routed-experts entry point `fn` into out, with scratch of `size_fn`."""
        rows = Rows(
            x=x.data_ptr(), out=out.data_ptr(), m=x.shape[0], n=x.shape[-1], xtype=X_CODES[x.dtype]
        )
        work = self._work(self._scratch(size_fn, experts.H, experts.I, x.shape[0]))
        return getattr(self.lib, fn)(
            experts,
            routes,
            rows,
            work,
            torch.get_num_threads(),
        )

    def gemv(
        self, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [m, cols] (any m >= 1) times w [rows, cols]^T -> [m, rows] in x's dtype. w in f32, bf16, or
        int8 with `scale` [rows] in fp16 (y = (x . q_r) * s_r). Both contiguous, on the CPU. Each row's
        result is bit for bit the one that row gets alone (m = 1): up to MAX_ROWS rows share each weight row's
        loads (a decode batch, a window), more go through gemm.c's register tiles (a prompt)."""
        return self.gemv_with(self.weight_of(w, scale), x)

    def gemv_with(self, weight: Weight, x: torch.Tensor) -> torch.Tensor:
        """gemv's product for x [m, weight.cols] (contiguous, on the CPU, a dtype of X_CODES) and the
        weight `weight` describes (weight_of): a layer that keeps its descriptor skips rebuilding it."""
        m, cols = x.shape
        rows = weight.rows
        if cols != weight.cols:
            raise ValueError(f"native gemv: rows of {cols} for a weight of {weight.cols} columns")
        y = torch.empty((m, rows), dtype=x.dtype)
        xs = Rows(x=x.data_ptr(), out=y.data_ptr(), m=m, n=cols, xtype=X_CODES[x.dtype])
        work = self._work(self._scratch("gemv_work_bytes", rows, cols, m))
        rc = self.lib.gemv_call(weight, xs, work, torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"native gemv takes at least one row, got {m}")
        return y

    def gemv_sweep(self, x: torch.Tensor, ws: Sequence[torch.Tensor]) -> None:
        """x [1, cols] through every weight in `ws` ([rows, cols], one shape and dtype, contiguous) in one
        call, results discarded: how fast gemv streams weights, with no per-call overhead."""
        rows, cols = ws[0].shape
        y = torch.empty((1, rows), dtype=x.dtype)
        shape = Weight(rows=rows, cols=cols, wtype=W_CODES[ws[0].dtype])
        xs = Rows(x=x.data_ptr(), out=y.data_ptr(), m=1, n=cols, xtype=X_CODES[x.dtype])
        rc = self.lib.gemv_sweep_call(
            (_P * len(ws))(*(w.data_ptr() for w in ws)),
            len(ws),
            shape,
            xs,
            self._work(self._scratch("gemv_work_bytes", rows, cols, 1)),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise ValueError("native gemv_sweep: bad shape")

    def moe_swiglu(
        self,
        x: torch.Tensor,
        weight_dtype: torch.dtype,
        hidden: int,
        intermediate: int,
        gate_up: Sequence[int],
        down: Sequence[int],
        weights: Sequence[float],
        gate_up_scale: Sequence[int] | None = None,
        down_scale: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """One token x [1, H] through the SwiGLU experts whose weight addresses are given (gate_up
        [2I, H], down [H, I]; int8 with fp16 row-scale addresses), scaled by `weights` and summed in
        the order given. Returns [1, H] in x's dtype."""
        m = len(gate_up)
        out = torch.empty((1, hidden), dtype=x.dtype)
        ptrs = _P * m
        experts = Experts(
            gate_up=ptrs(*gate_up),
            gate_up_scale=None if gate_up_scale is None else ptrs(*gate_up_scale),
            down=ptrs(*down),
            down_scale=None if down_scale is None else ptrs(*down_scale),
            wtype=W_CODES[weight_dtype],
            H=hidden,
            I=intermediate,
        )
        routes = Routes(w=(ctypes.c_float * m)(*weights), R=1, k=m)
        rows = Rows(x=x.data_ptr(), out=out.data_ptr(), m=1, n=hidden, xtype=X_CODES[x.dtype])
        work = self._work(self._scratch("moe_work_bytes", hidden, intermediate))
        rc = self.lib.moe_swiglu_call(
            experts,
            routes,
            rows,
            work,
            torch.get_num_threads(),
        )
        if rc != 0:
            raise ValueError(f"native moe_swiglu takes 1 to {MAX_TOPK} experts, got {m}")
        return out

    def expert_rows(
        self,
        x: torch.Tensor,
        weight_dtype: torch.dtype,
        hidden: int,
        intermediate: int,
        slot: tuple[int, ...],
    ) -> torch.Tensor:
        """Rows x [n, H] (any n >= 1) through one SwiGLU expert at `slot` (gate_up, its int8 scales, down,
        its scales; 0: none), unscaled -> [n, H] in x's dtype. Each row's result is what moe_swiglu gives
        that row alone with weight 1: a window's or a prompt's rows compute as single decode rows do."""
        n = x.shape[0]  # every row to expert 0 of a one-expert table, weight 1
        # The slot's table and the unit routes are kept (a missed expert's rows run this once each
        # on the decode path; building the C arrays per call cost a third of its Python).
        experts = self._one_expert(slot, weight_dtype, hidden, intermediate)
        routes = self._unit_routes(n)
        out = torch.empty((n, hidden), dtype=x.dtype)
        rc = self._run_experts(
            "moe_swiglu_rows_call", experts, routes, x, out, "moe_rows_work_bytes"
        )
        if rc != 0:
            raise ValueError("native expert_rows: bad arguments")
        return out

    def _one_expert(
        self, slot: tuple[int, ...], weight_dtype: torch.dtype, hidden: int, intermediate: int
    ) -> Experts:
        """The descriptor of a one-expert table at `slot`, built on first use and kept as _fixed keeps
        its descriptors."""
        key = (Experts, slot, weight_dtype, hidden, intermediate)
        found = self._fixed_structs.get(key)
        if found is None:
            found = self._keep(key, _swiglu_experts([slot], weight_dtype, hidden, intermediate))
        return found  # type: ignore[return-value]

    def _unit_routes(self, n: int) -> Routes:
        """n rows routed to expert 0 with weight 1 (kept per n, as _one_expert keeps its tables)."""
        key = (Routes, n)
        found = self._fixed_structs.get(key)
        if found is None:
            found = self._keep(
                key,
                Routes(ids=(ctypes.c_int64 * n)(), w=(ctypes.c_float * n)(*[1.0] * n), R=n, k=1),
            )
        return found  # type: ignore[return-value]

    def moe_rows(
        self,
        x: torch.Tensor,
        weight_dtype: torch.dtype,
        hidden: int,
        intermediate: int,
        slots: Sequence[Sequence[int]],
        ids: Sequence[int],
        weights: Sequence[float],
    ) -> torch.Tensor:
        """Rows x [R, H] (any R >= 1) through SwiGLU experts (cpu_gemv.c's moe_swiglu_rows): row r takes the k
        distinct experts slots[ids[r * k + j]] (each slot: gate_up, its int8 scales, down, its scales; 0: none),
        scaled by weights[r * k + j], summed in ascending slot index -> [R, H] in x's dtype. Each row's result
        is the one it gets alone."""
        routes = self._routes(x, ids, weights)
        out = torch.empty((x.shape[0], hidden), dtype=x.dtype)
        experts = _swiglu_experts(slots, weight_dtype, hidden, intermediate)
        rc = self._run_experts(
            "moe_swiglu_rows_call", experts, routes, x, out, "moe_rows_work_bytes"
        )
        if rc != 0:
            raise ValueError(f"native moe_rows takes 1 to {MAX_TOPK} distinct experts a row")
        return out

    def gemv_q4(
        self, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
    ) -> torch.Tensor | None:
        """x [m, cols] bf16 (m <= MAX_ROWS) times an int4 weight in groups of 64 (packed [rows, cols/2] uint8, low
        nibble first; fp16 scale and zero [rows, cols/64]: w = s * (q - z)) -> [m, rows] bf16, or None where
        the kernel does not apply (another dtype, cols not a multiple of 64): then dequantize."""
        m, cols = x.shape
        rows = packed.shape[0]
        y = torch.empty((m, rows), dtype=x.dtype)
        weight = Weight(
            w=packed.data_ptr(), scale=scale.data_ptr(), zero=zero.data_ptr(), rows=rows, cols=cols
        )
        xs = Rows(x=x.data_ptr(), out=y.data_ptr(), m=m, n=cols, xtype=X_CODES[x.dtype])
        work = self._work(self._scratch("gemv_q4_work_bytes", rows, cols, m))
        rc = self.lib.gemv_q4_call(weight, xs, work, torch.get_num_threads())
        return y if rc == 0 else None

    def moe_q4(
        self,
        x: torch.Tensor,
        hidden: int,
        intermediate: int,
        slots: Sequence[Sequence[int]],
        ids: Sequence[int],
        weights: Sequence[float],
    ) -> torch.Tensor:
        """Rows x [R, H] bf16 (any R >= 1) through int4 SwiGLU experts (groups of 64): row r takes the k experts
        slots[ids[r * k + j]] (each slot: gate_up codes, scales, down codes, scales, gate_up zeros, down zeros),
        scaled by weights[r * k + j], summed in ascending slot index (cpu_gemv.c's moe_q4_rows) -> [R, H]."""
        routes, table = self._routing(x, slots, ids, weights, range(6))
        out = torch.empty((x.shape[0], hidden), dtype=x.dtype)
        experts = Experts(
            gate_up=table[0],
            gate_up_scale=table[1],
            down=table[2],
            down_scale=table[3],
            gate_up_zero=table[4],
            down_zero=table[5],
            H=hidden,
            I=intermediate,
        )
        rc = self._run_experts("moe_q4_rows_call", experts, routes, x, out, "moe_q4_work_bytes")
        if rc != 0:
            raise ValueError(
                f"native moe_q4 takes bf16 rows and 1 to {MAX_TOPK} distinct experts a row"
            )
        return out

    def moe_mxfp4(
        self,
        x: torch.Tensor,
        hidden: int,
        intermediate: int,
        slots: Sequence[Sequence[int]],
        ids: Sequence[int],
        weights: Sequence[float],
        bias_dtype: torch.dtype,
        alpha: float,
        limit: float,
    ) -> torch.Tensor:
        """Rows x [R, H] (R <= MAX_ROWS, f32 or bf16) through gpt-oss MXFP4 experts (mxfp4_moe.c's moe_mxfp4_rows):
        row r takes the k experts slots[ids[r * k + j]] (each slot: gate_up blocks, scales, bias, down blocks,
        scales, bias addresses; biases in `bias_dtype`), scaled by weights[r * k + j], summed in ascending slot
        index -> [R, H] in x's dtype."""
        routes, table = self._routing(x, slots, ids, weights, range(6))
        out = torch.empty((x.shape[0], hidden), dtype=x.dtype)
        experts = Experts(
            gate_up=table[0],
            gate_up_scale=table[1],
            gate_up_bias=table[2],
            down=table[3],
            down_scale=table[4],
            down_bias=table[5],
            bias_wtype=W_CODES[bias_dtype],
            H=hidden,
            I=intermediate,
            alpha=alpha,
            limit=limit,
        )
        rc = self._run_experts(
            "moe_mxfp4_rows_call", experts, routes, x, out, "moe_mxfp4_work_bytes"
        )
        if rc != 0:
            raise ValueError(
                f"native moe_mxfp4 takes 1 to {MAX_ROWS} rows, {MAX_TOPK} distinct experts a row, H and I multiples of 32"
            )
        return out
