"""The C signatures of the native kernels (engine/native/cpu_gemv.c, decode_layer.c) for ctypes.

ctypes converts arguments to the declared C types; without a declaration it passes every Python
int as a C int, which pointers and 64-bit sizes do not fit. `declare` states each function's
argument and return types once, when the library is loaded (engine/native/kernels.py).
"""

from __future__ import annotations

import ctypes

_P, _I64, _INT, _SIZE = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_size_t
_F = ctypes.c_float


def declare(lib: ctypes.CDLL) -> None:
    """Set the argument and return types of every library function the wrappers call."""
    lib.capabilities.restype = _INT
    lib.gemv.argtypes = [_P, _P, _INT, _I64, _I64, _P, _INT, _I64, _P, _P, _INT]
    lib.gemv.restype = _INT
    lib.gemv_sweep.argtypes = [_P, _I64, _INT, _I64, _I64, _P, _INT, _P, _P, _INT]
    lib.gemv_sweep.restype = _INT
    lib.gemv_work_bytes.argtypes = [_I64, _I64, _I64]
    lib.gemv_work_bytes.restype = _SIZE
    lib.gemm.argtypes = [_P, _P, _INT, _I64, _I64, _P, _INT, _I64, _P, _P, _INT]
    lib.gemm.restype = _INT
    lib.gemm_work_bytes.argtypes = [_I64, _I64, _I64]
    lib.gemm_work_bytes.restype = _SIZE
    lib.moe_swiglu.argtypes = [
        _INT,
        _I64,
        _I64,
        _I64,
        _P,
        _P,
        _P,
        _P,
        _P,
        _P,
        _INT,
        _P,
        _P,
        _INT,
    ]
    lib.moe_swiglu.restype = _INT
    lib.moe_swiglu_rows.argtypes = [
        _INT,
        _I64,
        _I64,
        _I64,
        _I64,
        _P,
        _P,
        _P,
        _P,
        _P,
        _P,
        _P,
        _INT,
        _P,
        _P,
        _INT,
    ]
    lib.moe_swiglu_rows.restype = _INT
    lib.moe_rows_work_bytes.argtypes = [_I64, _I64, _I64]
    lib.moe_rows_work_bytes.restype = _SIZE
    lib.moe_work_bytes.argtypes = [_I64, _I64]
    lib.moe_work_bytes.restype = _SIZE
    lib.rmsnorm.argtypes = [_P, _INT, _I64, _I64, _P, _INT, ctypes.c_float, _P]
    lib.rmsnorm.restype = None
    lib.rope.argtypes = [_P, _INT, _I64, _I64, _I64, _I64, _P, _P]
    lib.rope.restype = None
    lib.qk_norm_rope.argtypes = [
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
    ]
    lib.qk_norm_rope.restype = None
    lib.add_rmsnorm.argtypes = [_P, _P, _INT, _I64, _I64, _P, _INT, ctypes.c_float, _P, _P]
    lib.add_rmsnorm.restype = None
    lib.router_topk.argtypes = [
        _P,
        _INT,
        _I64,
        _I64,
        _P,
        _INT,
        _I64,
        _INT,
        _P,
        _P,
        _P,
        _P,
        _INT,
    ]
    lib.router_topk.restype = _INT
    lib.gemv_q4.argtypes = [_P, _P, _P, _I64, _I64, _P, _INT, _I64, _P, _P, _INT]
    lib.gemv_q4.restype = _INT
    lib.gemv_q4_work_bytes.argtypes = [_I64, _I64, _I64]
    lib.gemv_q4_work_bytes.restype = _SIZE
    lib.moe_q4_rows.argtypes = [_I64] * 4 + [_P] * 8 + [_P, _INT, _P, _P, _INT]
    lib.moe_q4_rows.restype = _INT
    lib.moe_q4_work_bytes.argtypes = [_I64, _I64, _I64]
    lib.moe_q4_work_bytes.restype = _SIZE
    # mxfp4_moe.c: gpt-oss's MXFP4 experts
    lib.moe_mxfp4_rows.argtypes = [_I64] * 4 + [_P] * 8 + [_INT, _F, _F, _P, _INT, _P, _P, _INT]
    lib.moe_mxfp4_rows.restype = _INT
    lib.moe_mxfp4_work_bytes.argtypes = [_I64, _I64, _I64]
    lib.moe_mxfp4_work_bytes.restype = _SIZE
    lib.kv_append.argtypes = [_P, _P, _P, _P] + [_I64] * 3 + [_P] + [_I64] * 7
    lib.kv_append.restype = None
    lib.decode_attention.argtypes = [
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
    lib.decode_attention.restype = None
    # decode_layer.c: decode_attention for a sequence's consecutive rows (a prompt chunk, a window): T after xtype.
    lib.attention_rows.argtypes = [
        *lib.decode_attention.argtypes[:4],
        _I64,
        *lib.decode_attention.argtypes[4:],
    ]
    lib.attention_rows.restype = None
    lib.silu_mul.argtypes = [_P, _P, _INT, _I64, _P]
    lib.silu_mul.restype = None
    lib.sigmoid_gate_rows.argtypes = [_P, _P, _INT, _I64, _I64, _P]
    lib.sigmoid_gate_rows.restype = None
    # decode_layer.c: one decoder layer of a decode step (engine/worker/fused_decode.py builds the spec).
    lib.decode_layer.argtypes = [_P, _I64, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _INT]
    lib.decode_layer.restype = _INT
    lib.decode_layer_work_bytes.argtypes = [_P, _I64, _I64]
    lib.decode_layer_work_bytes.restype = _SIZE
    lib.router_sigmoid.argtypes = [
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
    lib.router_sigmoid.restype = _INT
    lib.router_sigmoid_rows.argtypes = [_I64, *lib.router_sigmoid.argtypes]
    lib.router_sigmoid_rows.restype = _INT
