/* Plain-C dot products for engine/native/cpu_gemv.c: the portable variant (any CPU the compiler targets; on
 * x86-64 it vectorises to SSE2, on AArch64 to NEON), and whatever a wider variant did not define (SIMD_HAVE_*
 * guards). Eight independent partial sums per dot product: each lane is its own chain, so the compiler may
 * vectorise the lanes without reordering any sum (ISO C, no -ffast-math), and the sums do not form one long
 * chain of dependent adds. Self-contained (it includes kernel_common.h); simd.h includes it last, in every build. */
#ifndef MOE_OFFLOAD_SIMD_PORTABLE_H
#define MOE_OFFLOAD_SIMD_PORTABLE_H
#include "kernel_common.h"

#define LANES 8

#ifndef SIMD_HAVE_DOT_WIDEN
static float dot_widen(const void *w, int wtype, int64_t n, const float *x) {
    float part[LANES] = {0};
    int64_t i = 0;
    if (wtype == W_F32) {
        const float *v = (const float *)w;
        for (; i + LANES <= n; i += LANES)
            for (int l = 0; l < LANES; l++) part[l] += v[i + l] * x[i + l];
    } else if (wtype == W_BF16) {
        const uint16_t *v = (const uint16_t *)w;
        for (; i + LANES <= n; i += LANES)
            for (int l = 0; l < LANES; l++) part[l] += bf16_to_f32(v[i + l]) * x[i + l];
    } else {
        const int8_t *v = (const int8_t *)w;
        for (; i + LANES <= n; i += LANES)
            for (int l = 0; l < LANES; l++) part[l] += (float)v[i + l] * x[i + l];
    }
    float s = 0.0f;
    for (int l = 0; l < LANES; l++) s += part[l];
    for (; i < n; i++) s += load1(w, wtype, i) * x[i];
    return s;
}

/* dot_widen for R activation rows (R <= 4, a constant once inlined): each weight is read and widened once for
 * all R rows; row r keeps dot_widen's lanes, their sum in order and its tail, so out[r] is bit for bit what
 * dot_widen gives row r alone. */
static inline __attribute__((always_inline)) void widen_rows_blk(const void *w, int wtype, int64_t n, const act_t *X,
                                                                 float *out, const int R) {
    float part[4][LANES] = {{0}};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) {
            float v = load1(w, wtype, i + l);
            for (int r = 0; r < R; r++) part[r][l] += v * X[r].f[i + l];
        }
    for (int r = 0; r < R; r++) {
        float s = 0.0f;
        for (int l = 0; l < LANES; l++) s += part[r][l];
        for (int64_t t = i; t < n; t++) s += load1(w, wtype, t) * X[r].f[t];
        out[r] = s;
    }
}

static void dot_widen_rows(const void *w, int wtype, int64_t n, const act_t *X, int64_t m, float *out) {
#define WIDEN_ROWS(T) ROWS_IN_BLOCKS(widen_rows_blk, w, T, n, X, m, out)
    if (wtype == W_F32) {
        WIDEN_ROWS(W_F32);
    } else if (wtype == W_BF16) {
        WIDEN_ROWS(W_BF16);
    } else {
        WIDEN_ROWS(W_I8);
    }
#undef WIDEN_ROWS
}
#endif

#ifndef SIMD_HAVE_DOT_BF16
#define BF16_FORM BF16_FORM_NONE
static float dot_bf16(const uint16_t *w, int64_t n, act_t a) { return dot_widen(w, W_BF16, n, a.f); }
static void dot_bf16_rows(const uint16_t *w, int64_t n, const act_t *X, int64_t m, float *out) {
    dot_widen_rows(w, W_BF16, n, X, m, out);
}
#endif

#ifndef SIMD_HAVE_DOT_I8
/* int8 weights against the int8-quantized activation: exact int32 block sums, scaled per block. */
static float dot_i8(const int8_t *w, int64_t n, act_t a) {
    float acc[4] = {0};
    for (int64_t i = 0, b = 0; i < n; i += QBLOCK, b++) {
        int32_t d = 0;
        for (int j = 0; j < QBLOCK; j++) d += (int32_t)a.q8[i + j] * (int32_t)w[i + j];
        acc[b & 3] += (float)d * a.qs[b];
    }
    return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}
ONE_ROW_AT_A_TIME(dot_i8_rows, dot_i8, const int8_t *)
#endif

#ifndef SIMD_HAVE_Q4_ROW
static float q4_row(const uint8_t *packed, const uint16_t *scale, const uint16_t *zero, int64_t n, const int8_t *xq,
                    const float *xs, const int32_t *xsum) {
    float acc = 0.0f, corr = 0.0f;
    for (int64_t b = 0; b < n / Q4_GROUP; b++) {
        const uint8_t *p = packed + b * (Q4_GROUP / 2);
        const int8_t *xb = xq + b * Q4_GROUP;
        int32_t d = 0;
        for (int j = 0; j < Q4_GROUP / 2; j++) d += (int32_t)(p[j] & 0x0F) * xb[j] + (int32_t)(p[j] >> 4) * xb[Q4_GROUP / 2 + j];
        float s = f16_to_f32(scale[b]) * xs[b];
        acc += (float)d * s;
        corr += s * f16_to_f32(zero[b]) * (float)xsum[b];
    }
    return acc - corr;
}
#endif

#ifndef SIMD_HAVE_ROW_MAX
#define SIMD_HAVE_ROW_MAX 1
/* The largest of x[0..n): the softmax's shift (simd_avx512.h's row_max, one element at a time). */
static inline float row_max(const float *x, int64_t n) {
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; j++) mx = x[j] > mx ? x[j] : mx;
    return mx;
}
#endif

#ifndef SIMD_HAVE_DOT_ROW
static inline float dot_row(const float *q, const void *row, int wtype, int64_t d) {
    float part[LANES] = {0}, s = 0.0f;
    int64_t i = 0;
    for (; i + LANES <= d; i += LANES)
        for (int l = 0; l < LANES; l++) part[l] += q[i + l] * load1(row, wtype, i + l);
    for (int l = 0; l < LANES; l++) s += part[l];
    for (; i < d; i++) s += q[i] * load1(row, wtype, i);
    return s;
}
#endif

#ifndef SIMD_HAVE_AXPY_ROW
static inline void axpy_row(float *acc, float p, const void *row, int wtype, int64_t d) {
    for (int64_t i = 0; i < d; i++) acc[i] += p * load1(row, wtype, i);
}
#endif

#ifndef SIMD_HAVE_EXP
static void exp_inplace(float *x, int64_t n) {
    for (int64_t j = 0; j < n; j++) x[j] = expf(x[j]);
}
#endif

#endif
