"""The C signatures of the native kernels (engine/native/cpu_gemv.c, decode_layer.c) for ctypes.

ctypes converts arguments to the declared C types; without a declaration it passes every Python
int as a C int, which pointers and 64-bit sizes do not fit. `declare` states each function's
argument and return types once, when the library is loaded (engine/native/kernels.py).
"""

from __future__ import annotations

import ctypes
from typing import Any

from engine.native.structs import (
    Attend,
    DecodeStep,
    Experts,
    Heads,
    KVCache,
    KVNew,
    Norm,
    QKNorm,
    Rotary,
    Router,
    Routes,
    Rows,
    Weight,
)

_P, _I64, _INT, _SIZE = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_size_t
# Descriptors (engine/native/structs.py) by pointer: a wrapper passes the Structure itself, and ctypes its address.
_W, _R, _N, _E, _RT = (ctypes.POINTER(c) for c in (Weight, Rows, Norm, Experts, Routes))
_HD, _QK, _ROT, _KV = (ctypes.POINTER(c) for c in (Heads, QKNorm, Rotary, KVCache))
_ROUTER, _NEW, _ATT, _STEP = (ctypes.POINTER(c) for c in (Router, KVNew, Attend, DecodeStep))

# Every library function the wrappers call: name -> (return type, argument types); None leaves
# the argument types undeclared (the function takes none). The *_call entry points (entry.c) take
# descriptors (cpu_gemv.h) and the call's scratch and thread count.
SIGNATURES: dict[str, tuple[Any, list[Any] | None]] = {
    "capabilities": (_INT, None),
    "gemv_call": (_INT, [_W, _R, _P, _INT]),
    "gemv_sweep_call": (_INT, [_P, _I64, _W, _R, _P, _INT]),
    "gemv_work_bytes": (_SIZE, [_I64, _I64, _I64]),
    "gemm_work_bytes": (_SIZE, [_I64, _I64, _I64]),
    "moe_swiglu_call": (_INT, [_E, _RT, _R, _P, _INT]),
    "moe_swiglu_rows_call": (_INT, [_E, _RT, _R, _P, _INT]),
    "moe_rows_work_bytes": (_SIZE, [_I64, _I64, _I64]),
    "moe_work_bytes": (_SIZE, [_I64, _I64]),
    "rmsnorm_call": (None, [_R, _N]),
    "rope_call": (None, [_HD, _ROT]),
    "qk_norm_rope_call": (None, [_HD, _QK, _ROT]),
    "add_rmsnorm_call": (None, [_R, _P, _P, _N]),
    "router_topk_call": (_INT, [_W, _R, _ROUTER, _P, _INT]),
    "gemv_q4_call": (_INT, [_W, _R, _P, _INT]),
    "gemv_q4_work_bytes": (_SIZE, [_I64, _I64, _I64]),
    "moe_q4_rows_call": (_INT, [_E, _RT, _R, _P, _INT]),
    "moe_q4_work_bytes": (_SIZE, [_I64, _I64, _I64]),
    # mxfp4_moe.c: gpt-oss's MXFP4 experts
    "moe_mxfp4_rows_call": (_INT, [_E, _RT, _R, _P, _INT]),
    "moe_mxfp4_work_bytes": (_SIZE, [_I64, _I64, _I64]),
    "kv_append_call": (None, [_KV, _NEW, _I64]),
    # attention.c: decode_attention for a sequence's consecutive rows (a prompt chunk, a window).
    "attention_rows_call": (None, [_HD, _QK, _ROT, _KV, _ATT]),
    "silu_mul": (None, [_P, _P, _INT, _I64, _P]),
    "sigmoid_gate_rows": (None, [_P, _P, _INT, _I64, _I64, _P]),
    # decode_layer.c: one decoder layer of a decode step (engine/worker/fused_decode.py builds the spec and the step).
    "decode_layer": (_INT, [_P, _STEP]),
    "decode_layer_work_bytes": (_SIZE, [_P, _I64, _I64]),
    "router_sigmoid_rows_call": (_INT, [_W, _R, _ROUTER, _P, _INT]),
}


def declare(lib: ctypes.CDLL) -> None:
    """Set the argument and return types of every library function the wrappers call."""
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype = restype
        if argtypes is not None:
            fn.argtypes = argtypes
