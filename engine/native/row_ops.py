"""The native kernel library's base: its loaded handle, per-thread scratch, and the row-wise kernels of a
decode layer (norms, rotary embedding, KV append, one row's attention). engine/native/kernels.py's
`NativeKernels` adds the matrix kernels (GEMV, experts, routers). The wrappers take torch tensors on the
CPU and pass their data pointers; ctypes releases the GIL for the call, so transfer threads keep running.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, TypeVar

import torch

from engine.native.signatures import declare
from engine.native.structs import Attend, Heads, KVCache, KVNew, Norm, QKNorm, Rotary, Rows, Weight

W_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}  # weight dtypes the kernels read
X_CODES = {torch.float32: 0, torch.bfloat16: 1}  # activation dtypes


def reads_weights(w: torch.dtype, x: torch.dtype) -> bool:
    """Whether the float kernels take weights in `w` for activations in `x`: the same dtype, or bf16
    weights for f32 rows (widened exactly as they are read: an f32 model's bf16 weights)."""
    return w == x or (w == torch.bfloat16 and x == torch.float32)


_FIXED_KEPT = 4096  # descriptors KernelLibrary._fixed keeps before it starts again
S = TypeVar("S", bound=ctypes.Structure)

# The block table of a contiguous KV buffer: its one block, holding every position (cpu_gemv.h kv_row).
CONTIGUOUS_TABLE = torch.zeros(1, dtype=torch.int64)


def kv_table(key_buffer: torch.Tensor, table: torch.Tensor | None, block: int) -> tuple[int, int]:
    """(block table pointer, positions a block) for the native KV kernels: a contiguous buffer
    [1, heads, capacity, d] is one block of `capacity` positions; a pool's table is its own (int64,
    contiguous, covering every position the call reads or writes). Block sizes are powers of two
    (the kernels shift, not divide, on every key): kv_cache.py's capacities are, and the pool's block."""
    if table is None:
        table, block = CONTIGUOUS_TABLE, key_buffer.shape[2]
    if table.dtype != torch.int64 or not table.is_contiguous() or block & (block - 1):
        raise ValueError(
            "a KV cache's block size (a contiguous buffer's capacity) must be a power of two"
        )
    return table.data_ptr(), block


class KernelLibrary:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        declare(lib)
        self._local = (
            threading.local()
        )  # one scratch buffer per calling thread (compute, CPU-expert workers)
        self._scratch_bytes: dict[
            tuple, int
        ] = {}  # each kernel's scratch size per shape, asked of the library once
        self._fixed_structs: dict[tuple, ctypes.Structure] = {}

    def _scratch(self, size_fn: str, *shape: int) -> int:
        """The scratch bytes the library's `size_fn` (gemv_work_bytes, moe_work_bytes, ...) gives for this
        shape, asked once per shape: a decode step calls the kernels many times a layer with the same
        few shapes, and each question is a ctypes call."""
        key = (size_fn, *shape)
        nbytes = self._scratch_bytes.get(key)
        if nbytes is None:
            nbytes = self._scratch_bytes[key] = getattr(self.lib, size_fn)(*shape)
        return nbytes

    def _fixed(self, cls: type[S], **fields: Any) -> S:
        """The descriptor `cls` with these fields (given in its field order), built on first use
        and kept: a decode step passes the same few (a layer's norm weights, a request's KV buffers) every
        layer, and looking one up costs less than filling a new one. Read only once built, so threads
        share them."""
        key = (cls, *fields.values())
        found = self._fixed_structs.get(key)
        if found is None:
            found = self._keep(key, cls(**fields))
        return found  # type: ignore[return-value]

    def _keep(self, key: tuple, struct: S) -> S:
        """`struct` kept under `key` for the next call that needs it."""
        if len(self._fixed_structs) >= _FIXED_KEPT:  # buffers come and go: keep the recent ones
            self._fixed_structs.clear()
        self._fixed_structs[key] = struct
        return struct

    def _kv_cache(
        self,
        key_buffer: torch.Tensor,
        value_buffer: torch.Tensor,
        table: torch.Tensor | None,
        *,
        block: int,
        heads: int,
        d: int,
    ) -> KVCache:
        """The KV buffers' descriptor: [blocks, heads, block, d] read through the block `table`."""
        table_ptr, bs = kv_table(key_buffer, table, block)
        return self._fixed(
            KVCache,
            kbuf=key_buffer.data_ptr(),
            vbuf=value_buffer.data_ptr(),
            blocks=table_ptr,
            bs=bs,
            heads=heads,
            d=d,
        )

    def weight_of(self, w: torch.Tensor, scale: torch.Tensor | None = None) -> Weight:
        """The descriptor of weight w [rows, cols] (and its int8 row scales) that gemv_with takes, kept
        while w's memory is (a layer passes the same weights every step)."""
        return self._fixed(
            Weight,
            w=w.data_ptr(),
            scale=scale.data_ptr() if scale is not None else None,
            rows=w.shape[0],
            cols=w.shape[1],
            wtype=W_CODES[w.dtype],
        )

    def _work(self, nbytes: int) -> int:
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < nbytes:
            buf = self._local.buf = torch.empty(max(nbytes, 1 << 16), dtype=torch.uint8)
        return buf.data_ptr()

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Llama-style RMSNorm of x [..., n] (contiguous, f32 or bf16) with `weight` [n] of x's dtype."""
        out = torch.empty_like(x)
        n = x.shape[-1]
        rows = Rows(
            x=x.data_ptr(), out=out.data_ptr(), m=x.numel() // n, n=n, xtype=X_CODES[x.dtype]
        )
        norm = self._fixed(Norm, w=weight.data_ptr(), wtype=W_CODES[weight.dtype], eps=eps)
        self.lib.rmsnorm_call(rows, norm)
        return out

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of x [..., rows, heads, d] in place (contiguous, f32 or bf16) with cos and sin
        [..., rows, rot] of x's dtype (rot <= d, even, at most 1024): transformers' rotate_half convention,
        rounding as its elementwise ops do. Returns x."""
        heads, d = x.shape[-2], x.shape[-1]
        rot = cos.shape[-1]
        heads_ = Heads(
            q=x.data_ptr(), xtype=X_CODES[x.dtype], rows=x.numel() // (heads * d), hq=heads, d=d
        )
        rotary = Rotary(cos=cos.data_ptr(), sin=sin.data_ptr(), rot=rot)
        self.lib.rope_call(heads_, rotary)
        return x

    def qk_norm_rope(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        *,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        q_eps: float,
        k_eps: float,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> None:
        """rmsnorm of every head of q [..., rows, hq, d] and k [..., rows, hk, d] (weights [d]), then rope,
        in place: the same arithmetic as rmsnorm() and rope() one after the other, in one call."""
        hq, d, hk = q.shape[-2], q.shape[-1], k.shape[-2]
        heads = Heads(
            q=q.data_ptr(),
            k=k.data_ptr(),
            xtype=X_CODES[q.dtype],
            rows=q.numel() // (hq * d),
            hq=hq,
            hk=hk,
            d=d,
        )
        norms = self._fixed(
            QKNorm,
            qw=q_weight.data_ptr(),
            kw=k_weight.data_ptr(),
            wtype=W_CODES[q_weight.dtype],
            q_eps=q_eps,
            k_eps=k_eps,
        )
        rotary = Rotary(cos=cos.data_ptr(), sin=sin.data_ptr(), rot=cos.shape[-1])
        self.lib.qk_norm_rope_call(heads, norms, rotary)

    def add_rmsnorm(
        self, x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + a, rmsnorm(x + a)) for x, a [..., n] of one dtype (contiguous), in one call: the same
        arithmetic as torch's add followed by rmsnorm()."""
        total, normed = torch.empty_like(x), torch.empty_like(x)
        n = x.shape[-1]
        rows = Rows(
            x=x.data_ptr(), out=total.data_ptr(), m=x.numel() // n, n=n, xtype=X_CODES[x.dtype]
        )
        norm = self._fixed(Norm, w=weight.data_ptr(), wtype=W_CODES[weight.dtype], eps=eps)
        self.lib.add_rmsnorm_call(rows, a.data_ptr(), normed.data_ptr(), norm)
        return total, normed

    def kv_append(
        self,
        key_buffer: torch.Tensor,
        value_buffer: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        at: int,
        table: torch.Tensor | None = None,
        block: int = 0,
    ) -> None:
        """Write k and v [1, heads, n, d] (d contiguous) at positions at..at+n-1 of a KV cache of their
        dtype, in one call: contiguous buffers [1, heads, capacity, d] (table None), or a paged pool's
        buffers [blocks, heads, block, d] read through the sequence's block `table` (int64)."""
        _, heads, n, d = k.shape
        ks, vs = k.stride(), v.stride()
        cache = self._kv_cache(key_buffer, value_buffer, table, block=block, heads=heads, d=d)
        new = KVNew(
            k=k.data_ptr(),
            v=v.data_ptr(),
            n=n,
            k_head=ks[1],
            k_pos=ks[2],
            v_head=vs[1],
            v_pos=vs[2],
            elem=k.element_size(),
        )
        self.lib.kv_append_call(cache, new, at)

    def silu_mul(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """silu(g) * u elementwise (contiguous, one float dtype, one shape), rounded as a bf16 reference
        rounds; each element computed the same way wherever it falls (decode_layer.c `silu_mul`)."""
        out = torch.empty_like(g)
        self.lib.silu_mul(g.data_ptr(), u.data_ptr(), X_CODES[g.dtype], g.numel(), out.data_ptr())
        return out

    def sigmoid_gate(self, gate: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """sigmoid(gate) * s for rows s [R, H] and gate [R, 1] (contiguous, s's dtype): a gated shared
        expert's output, each row as it is alone (decode_layer.c `sigmoid_gate_rows`)."""
        out = torch.empty_like(s)
        rows, hidden = s.shape
        self.lib.sigmoid_gate_rows(
            gate.data_ptr(), s.data_ptr(), X_CODES[s.dtype], rows, hidden, out.data_ptr()
        )
        return out

    def decode_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        norms: tuple[torch.Tensor, torch.Tensor, float, float] | None,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        key_buffer: torch.Tensor,
        value_buffer: torch.Tensor,
        at: int,
        scale: float,
        table: torch.Tensor | None = None,
        block: int = 0,
    ) -> torch.Tensor:
        """Attention for T consecutive new rows of one sequence (attention.c `attention_rows`, each row as
        attention.c's `decode_attention` computes a decode row alone): q [T, hq, d], k and v [T, hk, d]
        (contiguous, one dtype; q and k are normed and rotated in place), `norms` (q weight, k weight, q eps,
        k eps) or None, cos/sin [T, rot] or None, the KV cache in the same dtype with room for at + T
        positions (contiguous buffers [1, hk, capacity, d], or a pool's [blocks, hk, block, d] through the
        block `table`: kv_append), the first row's position `at`. Returns [T, hq * d]. (q [hq, d] is one row.)"""
        if q.dim() == 2:
            q, k, v = q[None], k[None], v[None]
        rows, hq, d = q.shape
        hk = k.shape[1]
        out = torch.empty((rows, hq * d), dtype=q.dtype)
        qw, kw, q_eps, k_eps = norms if norms is not None else (None, None, 0.0, 0.0)
        heads = Heads(
            q=q.data_ptr(), k=k.data_ptr(), xtype=X_CODES[q.dtype], rows=rows, hq=hq, hk=hk, d=d
        )
        qk = self._fixed(
            QKNorm,
            qw=None if qw is None else qw.data_ptr(),
            kw=None if kw is None else kw.data_ptr(),
            wtype=W_CODES[qw.dtype] if qw is not None else 0,
            q_eps=q_eps,
            k_eps=k_eps,
        )
        rotary = Rotary(
            cos=None if cos is None else cos.data_ptr(),
            sin=None if sin is None else sin.data_ptr(),
            rot=0 if cos is None else cos.shape[-1],
        )
        cache = self._kv_cache(key_buffer, value_buffer, table, block=block, heads=hk, d=d)
        work = self._work(4 * self.lib.attention_rows_work_floats(rows, hq, hk, d, at))
        attend = Attend(v=v.data_ptr(), out=out.data_ptr(), work=work, at=at, scale=scale)
        self.lib.attention_rows_call(
            heads,
            qk,
            rotary,
            cache,
            attend,
        )
        return out
