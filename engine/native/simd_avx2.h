/* AVX2 + FMA + F16C dot products for engine/native/cpu_gemv.c (the x86-64-v3 variant): 8 f32 lanes,
 * four independent accumulators per dot product. What it adds over plain C:
 *  - bf16 weights: 16 at a time from one 32-byte load, split into their even and odd elements by a
 *    shift and a mask (each becomes an f32 with no conversion instruction), against the activation
 *    stored in that even/odd order (act_t.p, BF16_FORM_PAIRS): exact products, f32 sums;
 *  - int8 weights in a bf16 model: the int8-quantized activation as cpu_gemv.c makes it, multiplied
 *    with vpmaddubsw (|x| unsigned times the weight carrying x's sign) and summed exactly in int32
 *    per block of 64, as llama.cpp's AVX2 Q8_0 dot product does;
 *  - int4 weights: the nibbles unpacked in registers, the same vpmaddubsw products.
 * Defined only where simd_avx512.h did not define it already (SIMD_HAVE_* guards; simd.h states the rule).
 * Self-contained: it includes kernel_common.h, and needs AVX2 and FMA (-march=x86-64-v3). */
#ifndef MOE_OFFLOAD_SIMD_AVX2_H
#define MOE_OFFLOAD_SIMD_AVX2_H
#if !(defined(__AVX2__) && defined(__FMA__))
#error "simd_avx2.h needs AVX2 and FMA (-march=x86-64-v3): simd.h includes it only then"
#endif
#include <immintrin.h>
#include "kernel_common.h"

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

static inline __m256 load8(const void *w, int wtype, int64_t i) {
    if (wtype == W_F32) return _mm256_loadu_ps((const float *)w + i);
    if (wtype == W_BF16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    __m128i q = _mm_loadl_epi64((const __m128i *)((const int8_t *)w + i));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
}

static inline float sum4x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    return hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}

#ifndef SIMD_HAVE_DOT_WIDEN
#define SIMD_HAVE_DOT_WIDEN 1
/* Widening path: each weight becomes f32 and multiplies the f32 activation (one loop per weight type, so
 * the type test is not in the loop). */
static float dot_widen(const void *w, int wtype, int64_t n, const float *x) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = 0;
#define WIDEN_LOOP(T)                                                                    \
    for (; i + 32 <= n; i += 32) {                                                       \
        prefetch_ahead((const char *)w + i * wsize(T), 32 * wsize(T));                   \
        a0 = _mm256_fmadd_ps(load8(w, T, i), _mm256_loadu_ps(x + i), a0);                \
        a1 = _mm256_fmadd_ps(load8(w, T, i + 8), _mm256_loadu_ps(x + i + 8), a1);        \
        a2 = _mm256_fmadd_ps(load8(w, T, i + 16), _mm256_loadu_ps(x + i + 16), a2);      \
        a3 = _mm256_fmadd_ps(load8(w, T, i + 24), _mm256_loadu_ps(x + i + 24), a3);      \
    }                                                                                    \
    for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(load8(w, T, i), _mm256_loadu_ps(x + i), a0);
    if (wtype == W_F32) {
        WIDEN_LOOP(W_F32)
    } else if (wtype == W_BF16) {
        WIDEN_LOOP(W_BF16)
    } else {
        WIDEN_LOOP(W_I8)
    }
#undef WIDEN_LOOP
    float s = sum4x8(a0, a1, a2, a3);
    for (; i < n; i++) s += load1(w, wtype, i) * x[i];
    return s;
}

/* dot_widen for R activation rows (R <= 4, a constant once inlined): each weight chunk is loaded and widened
 * once for all R rows; row r keeps dot_widen's four accumulators, loops, final sum and tail, so out[r] is bit
 * for bit what dot_widen gives row r alone. */
static inline __attribute__((always_inline)) void widen_rows_blk(const void *w, int wtype, int64_t n, const act_t *X,
                                                                 float *out, const int R) {
    __m256 a[4][4];
    const float *x[4];
    for (int r = 0; r < R; r++) {
        x[r] = X[r].f;
        for (int q = 0; q < 4; q++) a[r][q] = _mm256_setzero_ps();
    }
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        prefetch_ahead((const char *)w + i * wsize(wtype), 32 * wsize(wtype));
        __m256 v[4];
        for (int q = 0; q < 4; q++) v[q] = load8(w, wtype, i + 8 * q);
        for (int r = 0; r < R; r++)
            for (int q = 0; q < 4; q++) a[r][q] = _mm256_fmadd_ps(v[q], _mm256_loadu_ps(x[r] + i + 8 * q), a[r][q]);
    }
    for (; i + 8 <= n; i += 8) {
        __m256 v = load8(w, wtype, i);
        for (int r = 0; r < R; r++) a[r][0] = _mm256_fmadd_ps(v, _mm256_loadu_ps(x[r] + i), a[r][0]);
    }
    for (int r = 0; r < R; r++) {
        float s = sum4x8(a[r][0], a[r][1], a[r][2], a[r][3]);
        for (int64_t t = i; t < n; t++) s += load1(w, wtype, t) * x[r][t];
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
#define SIMD_HAVE_DOT_BF16 1
#define BF16_FORM BF16_FORM_PAIRS
/* bf16 weights against the activation in even/odd order (act_t.p: per 16 elements, the 8 even ones then the 8
 * odd ones): lane t of a 32-bit view holds elements 2t (low half) and 2t + 1 (high half). */
static float dot_bf16(const uint16_t *w, int64_t n, act_t a) {
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        prefetch_ahead(w + i, 64);
        __m256i v0 = _mm256_loadu_si256((const __m256i *)(w + i)), v1 = _mm256_loadu_si256((const __m256i *)(w + i + 16));
        a0 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v0, 16)), _mm256_loadu_ps(a.p + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(v0, high)), _mm256_loadu_ps(a.p + i + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v1, 16)), _mm256_loadu_ps(a.p + i + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(v1, high)), _mm256_loadu_ps(a.p + i + 24), a3);
    }
    for (; i + 16 <= n; i += 16) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(w + i));
        a0 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), _mm256_loadu_ps(a.p + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(v, high)), _mm256_loadu_ps(a.p + i + 8), a1);
    }
    float s = sum4x8(a0, a1, a2, a3);
    for (; i < n; i++) s += bf16_to_f32(w[i]) * a.f[i];
    return s;
}

/* dot_bf16 for R activation rows (R <= 4, a constant once inlined): each 32-byte weight chunk is loaded and split
 * once for all R rows; row r keeps dot_bf16's four accumulators, loops, final sum and tail, so out[r] is bit for
 * bit what dot_bf16 gives row r alone. */
static inline __attribute__((always_inline)) void bf16_rows_blk(const uint16_t *w, int unused, int64_t n, const act_t *X,
                                                                float *out, const int R) {
    (void)unused;
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256 a[4][4];
    const float *p[4];
    for (int r = 0; r < R; r++) {
        p[r] = X[r].p;
        for (int q = 0; q < 4; q++) a[r][q] = _mm256_setzero_ps();
    }
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        prefetch_ahead(w + i, 64);
        __m256i v0 = _mm256_loadu_si256((const __m256i *)(w + i)), v1 = _mm256_loadu_si256((const __m256i *)(w + i + 16));
        __m256 v[4] = {_mm256_castsi256_ps(_mm256_slli_epi32(v0, 16)), _mm256_castsi256_ps(_mm256_and_si256(v0, high)),
                       _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16)), _mm256_castsi256_ps(_mm256_and_si256(v1, high))};
        for (int r = 0; r < R; r++)
            for (int q = 0; q < 4; q++) a[r][q] = _mm256_fmadd_ps(v[q], _mm256_loadu_ps(p[r] + i + 8 * q), a[r][q]);
    }
    for (; i + 16 <= n; i += 16) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(w + i));
        __m256 lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), hi = _mm256_castsi256_ps(_mm256_and_si256(v, high));
        for (int r = 0; r < R; r++) {
            a[r][0] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(p[r] + i), a[r][0]);
            a[r][1] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(p[r] + i + 8), a[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {
        float s = sum4x8(a[r][0], a[r][1], a[r][2], a[r][3]);
        for (int64_t t = i; t < n; t++) s += bf16_to_f32(w[t]) * X[r].f[t];
        out[r] = s;
    }
}

static void dot_bf16_rows(const uint16_t *w, int64_t n, const act_t *X, int64_t m, float *out) {
    ROWS_IN_BLOCKS(bf16_rows_blk, w, 0, n, X, m, out);
}
#endif

/* The exact int32 sum of 32 products of unsigned bytes u (< 128 here) by signed bytes s, in 8 lanes. */
static inline __m256i madd_u8s8(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)); /* pairs <= 2 * 127 * 127: no saturation */
}

#ifndef SIMD_HAVE_DOT_I8
#define SIMD_HAVE_DOT_I8 1
/* int8 weights against the int8-quantized activation (n a multiple of QBLOCK): |x| (act_t.qa) times the weight
 * with x's sign (vpsignb against act_t.q8); block sums exact in int32, scaled by the block's activation scale. */
static float dot_i8(const int8_t *w, int64_t n, act_t a) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t i = 0, b = 0; i < n; i += QBLOCK, b++) {
        prefetch_ahead(w + i, QBLOCK);
        __m256i x0 = _mm256_loadu_si256((const __m256i *)(a.q8 + i)), x1 = _mm256_loadu_si256((const __m256i *)(a.q8 + i + 32));
        __m256i w0 = _mm256_loadu_si256((const __m256i *)(w + i)), w1 = _mm256_loadu_si256((const __m256i *)(w + i + 32));
        __m256i u0 = _mm256_loadu_si256((const __m256i *)(a.qa + i)), u1 = _mm256_loadu_si256((const __m256i *)(a.qa + i + 32));
        __m256i d = _mm256_add_epi32(madd_u8s8(u0, _mm256_sign_epi8(w0, x0)), madd_u8s8(u1, _mm256_sign_epi8(w1, x1)));
        acc[b & 3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(a.qs[b]), acc[b & 3]);
    }
    return sum4x8(acc[0], acc[1], acc[2], acc[3]);
}
ONE_ROW_AT_A_TIME(dot_i8_rows, dot_i8, const int8_t *) /* the sign moves onto each row's weights: little to share */
#endif

#ifndef SIMD_HAVE_Q4_ROW
#define SIMD_HAVE_Q4_ROW 1
/* One int4 row (groups of 64) against the quantized activation: the low nibbles (even elements) times the
 * block's first 32 activation bytes, the high nibbles (odd elements) times the next 32; codes are unsigned. */
static float q4_row(const uint8_t *packed, const uint16_t *scale, const uint16_t *zero, int64_t n, const int8_t *xq,
                    const float *xs, const int32_t *xsum) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
    float corr = 0.0f;
    for (int64_t b = 0; b < n / Q4_GROUP; b++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(packed + b * (Q4_GROUP / 2)));
        __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        const int8_t *xb = xq + b * Q4_GROUP;
        __m256i d = _mm256_add_epi32(madd_u8s8(lo, _mm256_loadu_si256((const __m256i *)xb)),
                                     madd_u8s8(hi, _mm256_loadu_si256((const __m256i *)(xb + 32))));
        float s = f16_to_f32(scale[b]) * xs[b];
        if (b & 1) acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(s), acc1);
        else acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(s), acc0);
        corr += s * f16_to_f32(zero[b]) * (float)xsum[b];
    }
    return hsum8(_mm256_add_ps(acc0, acc1)) - corr;
}
#endif

#ifndef SIMD_HAVE_DOT_ROW
#define SIMD_HAVE_DOT_ROW 1
/* q . row for one cached key row (f32 or bf16), q in f32: eight lanes of partial sums, then their sum. */
static inline float dot_row(const float *q, const void *row, int wtype, int64_t d) {
    int64_t i = 0;
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= d; i += 8) acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(q + i), load8(row, wtype, i)));
    float s = hsum8(acc);
    for (; i < d; i++) s += q[i] * load1(row, wtype, i);
    return s;
}
#endif

#ifndef SIMD_HAVE_AXPY_ROW
#define SIMD_HAVE_AXPY_ROW 1
static inline void axpy_row(float *acc, float p, const void *row, int wtype, int64_t d) {
    int64_t i = 0;
    __m256 pv = _mm256_set1_ps(p);
    for (; i + 8 <= d; i += 8) _mm256_storeu_ps(acc + i, _mm256_add_ps(_mm256_loadu_ps(acc + i), _mm256_mul_ps(pv, load8(row, wtype, i))));
    for (; i < d; i++) acc[i] += p * load1(row, wtype, i);
}
#endif

#ifndef SIMD_HAVE_EXP
#define SIMD_HAVE_EXP 1
/* exp(x) in place, eight at a time: simd_avx512.h's Cephes expf, with 2^n built in the exponent bits. */
static void exp_inplace(float *x, int64_t n) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 v = _mm256_max_ps(_mm256_loadu_ps(x + j), _mm256_set1_ps(-87.3f));
        __m256 k = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), v);
        r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
        __m256 p = _mm256_set1_ps(1.9875691500e-4f);
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
        p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
        __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23); /* k >= -126 */
        _mm256_storeu_ps(x + j, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
    }
    for (; j < n; j++) x[j] = expf(x[j]);
}
#endif

#endif
