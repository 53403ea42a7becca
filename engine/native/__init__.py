"""Native CPU kernels for decoding (engine/native/cpu_gemv.c), built on first use and called via ctypes."""
