"""The C signatures of the native kernels (engine/native/cpu_gemv.c, decode_layer.c) for ctypes.

ctypes converts arguments to the declared C types; without a declaration it passes every Python
int as a C int, which pointers and 64-bit sizes do not fit. `declare` states each function's
argument and return types once, when the library is loaded (engine/native/kernels.py).
"""

from __future__ import annotations

import ctypes
from typing import Any

_P, _I64, _INT, _SIZE = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_size_t
_F = ctypes.c_float

# Two signatures that others extend: the row forms take one more size.
_DECODE_ATTENTION = [
    _P,
    _P,
    _P,
    _INT,
    _I64,
    _I64,
    _I64,
    _P,
    _P,
    _INT,
    ctypes.c_float,
    ctypes.c_float,
    _I64,
    _P,
    _P,
    _P,  # key buffer
    _P,  # value buffer
    _P,  # block table (int64)
    _I64,  # positions a block
    _I64,  # at
    ctypes.c_float,
    _P,
    _P,
]
_ROUTER_SIGMOID = [
    _P,
    _INT,
    _I64,
    _I64,
    _P,
    _INT,
    _I64,
    _I64,
    _I64,
    _INT,
    ctypes.c_float,
    _P,
    _P,
    _P,
    _P,
    _P,
    _P,
    _INT,
]

# Every library function the wrappers call: name -> (return type, argument types); None leaves
# the argument types undeclared (the function takes none).
SIGNATURES: dict[str, tuple[Any, list[Any] | None]] = {
    "capabilities": (_INT, None),
    "gemv": (_INT, [_P, _P, _INT, _I64, _I64, _P, _INT, _I64, _P, _P, _INT]),
    "gemv_sweep": (_INT, [_P, _I64, _INT, _I64, _I64, _P, _INT, _P, _P, _INT]),
    "gemv_work_bytes": (_SIZE, [_I64, _I64, _I64]),
    "gemm": (_INT, [_P, _P, _INT, _I64, _I64, _P, _INT, _I64, _P, _P, _INT]),
    "gemm_work_bytes": (_SIZE, [_I64, _I64, _I64]),
    "moe_swiglu": (_INT, [_INT, _I64, _I64, _I64, _P, _P, _P, _P, _P, _P, _INT, _P, _P, _INT]),
    "moe_swiglu_rows": (
        _INT,
        [_INT, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _P, _P, _P, _INT, _P, _P, _INT],
    ),
    "moe_rows_work_bytes": (_SIZE, [_I64, _I64, _I64]),
    "moe_work_bytes": (_SIZE, [_I64, _I64]),
    "rmsnorm": (None, [_P, _INT, _I64, _I64, _P, _INT, ctypes.c_float, _P]),
    "rope": (None, [_P, _INT, _I64, _I64, _I64, _I64, _P, _P]),
    "qk_norm_rope": (
        None,
        [
            _P,
            _P,
            _INT,
            _I64,
            _I64,
            _I64,
            _I64,
            _P,
            _P,
            _INT,
            ctypes.c_float,
            ctypes.c_float,
            _I64,
            _P,
            _P,
        ],
    ),
    "add_rmsnorm": (None, [_P, _P, _INT, _I64, _I64, _P, _INT, ctypes.c_float, _P, _P]),
    "router_topk": (_INT, [_P, _INT, _I64, _I64, _P, _INT, _I64, _INT, _P, _P, _P, _P, _INT]),
    "gemv_q4": (_INT, [_P, _P, _P, _I64, _I64, _P, _INT, _I64, _P, _P, _INT]),
    "gemv_q4_work_bytes": (_SIZE, [_I64, _I64, _I64]),
    "moe_q4_rows": (_INT, [_I64] * 4 + [_P] * 8 + [_P, _INT, _P, _P, _INT]),
    "moe_q4_work_bytes": (_SIZE, [_I64, _I64, _I64]),
    # mxfp4_moe.c: gpt-oss's MXFP4 experts
    "moe_mxfp4_rows": (_INT, [_I64] * 4 + [_P] * 8 + [_INT, _F, _F, _P, _INT, _P, _P, _INT]),
    "moe_mxfp4_work_bytes": (_SIZE, [_I64, _I64, _I64]),
    "kv_append": (None, [_P, _P, _P, _P] + [_I64] * 3 + [_P] + [_I64] * 7),
    "decode_attention": (None, _DECODE_ATTENTION),
    # decode_layer.c: decode_attention for a sequence's consecutive rows (a prompt chunk, a window): T after xtype.
    "attention_rows": (None, [*_DECODE_ATTENTION[:4], _I64, *_DECODE_ATTENTION[4:]]),
    "silu_mul": (None, [_P, _P, _INT, _I64, _P]),
    "sigmoid_gate_rows": (None, [_P, _P, _INT, _I64, _I64, _P]),
    # decode_layer.c: one decoder layer of a decode step (engine/worker/fused_decode.py builds the spec).
    "decode_layer": (_INT, [_P, _I64, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _INT]),
    "decode_layer_work_bytes": (_SIZE, [_P, _I64, _I64]),
    "router_sigmoid": (_INT, _ROUTER_SIGMOID),
    "router_sigmoid_rows": (_INT, [_I64, *_ROUTER_SIGMOID]),
}


def declare(lib: ctypes.CDLL) -> None:
    """Set the argument and return types of every library function the wrappers call."""
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype = restype
        if argtypes is not None:
            fn.argtypes = argtypes
