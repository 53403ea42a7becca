"""The descriptors the native library's entry points take (engine/native/cpu_gemv.h, entry.c; decode_layer.c's
`decode_step_t`), as ctypes Structures: the same fields in the same order. Each groups the arguments that describe
one thing (a weight matrix, activation rows, routed experts, a KV cache, ...), so that no call passes a long list of
positional arguments; the wrappers (engine/native/kernels.py, row_ops.py) fill them with keyword fields.
"""

from __future__ import annotations

import ctypes
from typing import Any

_P, _I64, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
# An address table (a C array of pointers): a field of this type keeps the array it is given alive with the
# Structure, where a plain pointer field holding an address would not.
_TABLE = ctypes.POINTER(_P)


def _fields(kind: Any, names: str) -> list[tuple[str, Any]]:
    """One field of type `kind` for each space-separated name."""
    return [(n, kind) for n in names.split()]


class Weight(ctypes.Structure):
    """weight_t: a weight matrix [rows, cols] of `wtype` codes (int8: fp16 row scales; int4: group scales, zeros)."""

    _fields_ = _fields(_P, "w scale zero") + _fields(_I64, "rows cols wtype")


class Rows(ctypes.Structure):
    """rows_t: m activation rows x [m, n] in `xtype`, and where their results go."""

    _fields_ = _fields(_P, "x out") + _fields(_I64, "m n xtype")


class Norm(ctypes.Structure):
    """norm_t: a norm's weight [n] in `wtype` and its epsilon."""

    _fields_ = [("w", _P), ("wtype", _I64), ("eps", _F), ("pad_", _F)]


class Experts(ctypes.Structure):
    """experts_t: routed experts' address tables (C arrays, None: none) and their forms."""

    _fields_ = (
        _fields(_TABLE, "gate_up gate_up_scale gate_up_zero gate_up_bias")
        + _fields(_TABLE, "down down_scale down_zero down_bias")
        + _fields(_I64, "wtype bias_wtype H I")
        + _fields(_F, "alpha limit")
    )


class Routes(ctypes.Structure):
    """routes_t: R rows routed to k experts each, ids and weights [R k] (C arrays, kept alive by the Structure)."""

    _fields_ = (
        _fields(ctypes.POINTER(_I64), "ids")
        + _fields(ctypes.POINTER(_F), "w")
        + _fields(_I64, "R k")
    )


class Router(ctypes.Structure):
    """router_t: a router's choice rule and where its outputs go."""

    _fields_ = (
        _fields(_I64, "k norm n_group topk_group")
        + _fields(_F, "scale pad_")
        + _fields(_P, "bias logits weights ids xf")
    )


class Heads(ctypes.Structure):
    """heads_t: rows of attention heads q [rows, hq, d] and k [rows, hk, d], in place."""

    _fields_ = _fields(_P, "q k") + _fields(_I64, "xtype rows hq hk d")


class QKNorm(ctypes.Structure):
    """qk_norm_t: per-head q and k RMSNorm weights [d] (None: none) and their epsilons."""

    _fields_ = _fields(_P, "qw kw") + [("wtype", _I64)] + _fields(_F, "q_eps k_eps")


class Rotary(ctypes.Structure):
    """rotary_t: cos and sin [rows, rot] (rot 0: none)."""

    _fields_ = _fields(_P, "cos sin") + [("rot", _I64)]


class KVCache(ctypes.Structure):
    """kv_cache_t: a sequence's key and value buffers read through its block table of blocks of bs positions."""

    _fields_ = _fields(_P, "kbuf vbuf blocks") + _fields(_I64, "bs heads d")


class KVNew(ctypes.Structure):
    """kv_new_t: n new keys and values [heads, n, d], strides in elements, elem bytes an element."""

    _fields_ = _fields(_P, "k v") + _fields(_I64, "n k_head k_pos v_head v_pos elem")


class Attend(ctypes.Structure):
    """attend_t: an attention call's values, output, scratch, first position and softmax scale."""

    _fields_ = _fields(_P, "v out work") + [("at", _I64)] + _fields(_F, "scale pad_")


class DecodeStep(ctypes.Structure):
    """decode_layer.c's decode_step_t: a fused decode step's rows, buffers and each row's KV cache."""

    _fields_ = _fields(_P, "x h cos sin work kbufs vbufs tables bss ats") + _fields(
        _I64, "R nthreads"
    )
