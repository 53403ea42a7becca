"""The native kernels' limits, each defined once: Python reads them from here and the C sources get them
at build time (engine/native/build.py passes -DMAX_ROWS, -DMAX_TOPK and -DMAX_HEAD_GROUP), so the two
cannot disagree."""

from __future__ import annotations

# Activation rows one kernel call takes (a decode step or a speculative window): gemv, the experts
# (moe_swiglu_rows, moe_q4_rows, moe_mxfp4_rows) and decode_layer's fused step. More rows go to
# gemm.c's tiles or are split by the caller.
MAX_ROWS = 16
# Routed experts one row may use (top-k), in every expert kernel (moe_swiglu*, moe_q4_rows, moe_mxfp4_rows,
# decode_layer) and the native router.
MAX_TOPK = 64
# Query heads that share one KV head (hq / hk) in the native attention (attention.c, decode_layer).
MAX_HEAD_GROUP = 64
