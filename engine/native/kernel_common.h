/* What every kernel source (cpu_gemv.c, attention.c) and every instruction-set header (simd_*.h) shares, in one
 * place (beside cpu_gemv.h, which it includes for act_t, the dtype codes and the bf16 helpers): the activation block
 * sizes and row limits, the dtype loads, and the row-blocking macros of the dot products. The dot products
 * themselves are chosen in simd.h, which includes this header and then the instruction-set headers in the order of
 * its dispatch rule; each of those headers includes this one itself, so it compiles on its own. */
#ifndef MOE_OFFLOAD_KERNEL_COMMON_H
#define MOE_OFFLOAD_KERNEL_COMMON_H
#include <math.h>
#include <stdlib.h>
#include "cpu_gemv.h"

#define QBLOCK 64 /* activation quantization block of the int8 path */
#define Q4_GROUP 64 /* int4 weight group (below) */
/* The activation form the variant's bf16 dot product reads (BF16_FORM, set by the simd header that defines it). */
enum { BF16_FORM_NONE = 0, BF16_FORM_BF16 = 1, BF16_FORM_PAIRS = 2 };



static inline size_t wsize(int wtype) { return wtype == W_F32 ? 4 : wtype == W_BF16 ? 2 : 1; }

static size_t up64_(size_t n) { return (n + 63) / 64 * 64; }

/* The symmetric int8 scale of a block of activations, s = max|x| / 127, and 1/s in *inv (0 for a zero block). */
static inline float block_scale(const float *x, int n, float *inv) {
    float mx = 0.0f;
    for (int j = 0; j < n; j++) mx = fmaxf(mx, fabsf(x[j]));
    float s = mx / 127.0f;
    *inv = s > 0.0f ? 1.0f / s : 0.0f;
    return s;
}

/* The dot products' software prefetch: each loop step asks for the weight bytes PREFETCH_AHEAD past the ones it
 * loads, into L2 (prefetcht1). Why: an f32 row of 1024 is exactly one 4 KiB page, and the hardware prefetchers stop
 * at a page's end, so each row began cold; the rows of one matrix lie back to back, so a prefetch this far ahead
 * runs into the next row. On an Intel Xeon (Sapphire Rapids), 1 thread, 8 random experts of the peers 'mid' shape
 * a layer, an ad hoc C loop of dot_widen's form streamed 14.0 GB/s without it, 17.5 into L1 and 18.0 into L2 at
 * 3-4 KiB ahead (6 KiB: no better). It reads nothing the sums use, so no result changes; past a buffer's end a
 * prefetch cannot fault. */
#define PREFETCH_AHEAD 4096
static inline void prefetch_ahead(const void *p, size_t bytes) {
    for (size_t b = 0; b < bytes; b += 64) __builtin_prefetch((const char *)p + PREFETCH_AHEAD + b, 0, 2);
}

static inline float load1(const void *w, int wtype, int64_t i) {
    if (wtype == W_F32) return ((const float *)w)[i];
    if (wtype == W_BF16) return bf16_to_f32(((const uint16_t *)w)[i]);
    return (float)((const int8_t *)w)[i];
}

/* ---- one weight row dotted with one activation row ---------------------------------------------
 * One row at a time, as one sequential stream, with independent accumulators. Why not four rows at
 * once (what this file did first, so that each activation load served four rows): on an AMD EPYC
 * with AVX-512 BF16 the four interleaved row streams ran at 13 (bf16), 9 (int8) and 18 (f32) GB/s on
 * [1024, 1024] weights against 23, 20 and 22 GB/s for one sequential stream, with the memory read at
 * 31 GB/s (bench/kernel_bench.py); a speculative window's rows reuse the row from L1 either way
 * (rows_range). */
/* The same dot products for several activation rows at once (dot_*_rows, next to each one-row dot in the headers):
 * each weight chunk is loaded and converted once for a block of ROWS_BLOCK rows, and each row keeps the one-row
 * dot's accumulators and order, so its result is bit for bit the one-row dot's. ROWS_BLOCK: the rows whose
 * accumulators (four vectors a row) fit in the vector registers beside the weight chunk: 32 registers with
 * AVX-512, 16 with AVX2 (plain C keeps two SSE registers a row). */
#if defined(__AVX2__) && !defined(__AVX512F__)
#define ROWS_BLOCK 2
#else
#define ROWS_BLOCK 4
#endif
/* out[j] = blk's dot of weight row w with X[j], j < m: blocks of ROWS_BLOCK rows, then the rest in one block. */
#define ROWS_IN_BLOCKS(blk, w, t, n, X, m, out)                                                   \
    do {                                                                                          \
        int64_t j_ = 0;                                                                           \
        for (; j_ + ROWS_BLOCK <= (m); j_ += ROWS_BLOCK) blk(w, t, n, (X) + j_, (out) + j_, ROWS_BLOCK); \
        if ((m) - j_ == 3) blk(w, t, n, (X) + j_, (out) + j_, 3);                                 \
        else if ((m) - j_ == 2) blk(w, t, n, (X) + j_, (out) + j_, 2);                            \
        else if ((m) - j_ == 1) blk(w, t, n, (X) + j_, (out) + j_, 1);                            \
    } while (0)
/* A rows form that calls the one-row dot per row (where a blocked one would share little). */
#define ONE_ROW_AT_A_TIME(name, dot, wptr)                                                \
    static void name(wptr w, int64_t n, const act_t *X, int64_t m, float *out) {          \
        for (int64_t j = 0; j < m; j++) out[j] = dot(w, n, X[j]);                         \
    }
#endif
