"""The native kernels' row limit, defined once: Python reads it from here and the C sources get it at
build time (engine/native/build.py passes -DMAX_ROWS), so the two cannot disagree."""

from __future__ import annotations

# Activation rows one kernel call takes (a decode step or a speculative window): gemv, the experts
# (moe_swiglu_rows, moe_q4_rows, moe_mxfp4_rows) and decode_layer's fused step. More rows go to
# gemm.c's tiles or are split by the caller.
MAX_ROWS = 16
