/* AVX-512 dot products for engine/native/cpu_gemv.c: 16 f32 lanes (the x86-64-v4 variant), plus the
 * AVX-512 BF16 dot (vdpbf16ps) and VNNI int8 dot (vpdpbusd) where the variant is built with them.
 * Each function is defined here only for what AVX-512 speeds up; simd_avx2.h and simd_portable.h
 * define the rest (the first definition wins: simd.h states the rule and applies it). Self-contained: it
 * includes kernel_common.h for act_t, the limits and the dtype helpers, and needs AVX-512 (-march=x86-64-v4). */
#ifndef MOE_OFFLOAD_SIMD_AVX512_H
#define MOE_OFFLOAD_SIMD_AVX512_H
#if !defined(__AVX512F__)
#error "simd_avx512.h needs AVX-512 (-march=x86-64-v4): simd.h includes it only then"
#endif
#include <immintrin.h>
#include "kernel_common.h"

static inline __m512 load16(const void *w, int wtype, int64_t i) {
    if (wtype == W_F32) return _mm512_loadu_ps((const float *)w + i);
    if (wtype == W_BF16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    __m128i q = _mm_loadu_si128((const __m128i *)((const int8_t *)w + i));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
}

static inline float sum4(const __m512 acc[4]) {
    return hsum16(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
}

/* Widening path: each weight becomes f32 and multiplies the f32 activation. */
#define SIMD_HAVE_DOT_WIDEN 1
static float dot_widen(const void *w, int wtype, int64_t n, const float *x) {
    int64_t i = 0;
    __m512 acc[4];
    for (int q = 0; q < 4; q++) acc[q] = _mm512_setzero_ps();
    /* Unrolled: the same FMAs in the same order (each accumulator still sums its lanes in key order), fewer loop
     * branches between loads, so the memory stream keeps more loads in flight (about 4 % on an Intel Xeon, 1 thread). */
    const size_t es = wsize(wtype);
#pragma GCC unroll 4
    for (; i + 64 <= n; i += 64) {
        prefetch_ahead((const char *)w + i * es, 64 * es);
        for (int q = 0; q < 4; q++) acc[q] = _mm512_fmadd_ps(load16(w, wtype, i + 16 * q), _mm512_loadu_ps(x + i + 16 * q), acc[q]);
    }
    for (; i + 16 <= n; i += 16) acc[0] = _mm512_fmadd_ps(load16(w, wtype, i), _mm512_loadu_ps(x + i), acc[0]);
    float s = sum4(acc);
    for (; i < n; i++) s += load1(w, wtype, i) * x[i];
    return s;
}

/* dot_widen for R activation rows (R <= 4, a constant once inlined): each weight chunk is loaded and widened
 * once for all R rows; row r keeps dot_widen's four accumulators, loops, final sum and tail, so out[r] is bit
 * for bit what dot_widen gives row r alone. */
static inline __attribute__((always_inline)) void widen_rows_blk(const void *w, int wtype, int64_t n, const act_t *X,
                                                                 float *out, const int R) {
    __m512 acc[4][4];
    const float *x[4];
    for (int r = 0; r < R; r++) {
        x[r] = X[r].f;
        for (int q = 0; q < 4; q++) acc[r][q] = _mm512_setzero_ps();
    }
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        prefetch_ahead((const char *)w + i * wsize(wtype), 64 * wsize(wtype));
        __m512 v[4];
        for (int q = 0; q < 4; q++) v[q] = load16(w, wtype, i + 16 * q);
        for (int r = 0; r < R; r++)
            for (int q = 0; q < 4; q++) acc[r][q] = _mm512_fmadd_ps(v[q], _mm512_loadu_ps(x[r] + i + 16 * q), acc[r][q]);
    }
    for (; i + 16 <= n; i += 16) {
        __m512 v = load16(w, wtype, i);
        for (int r = 0; r < R; r++) acc[r][0] = _mm512_fmadd_ps(v, _mm512_loadu_ps(x[r] + i), acc[r][0]);
    }
    for (int r = 0; r < R; r++) {
        float s = sum4(acc[r]);
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

#if defined(__AVX512BF16__)
/* bf16 weights and a bf16 activation (act_t.b), f32 sums; a tail of n that is not a multiple of 32 widens. */
#define SIMD_HAVE_DOT_BF16 1
#define BF16_FORM BF16_FORM_BF16
static float dot_bf16(const uint16_t *w, int64_t n, act_t a) {
    __m512 acc[4];
    for (int q = 0; q < 4; q++) acc[q] = _mm512_setzero_ps();
    int64_t i = 0;
#pragma GCC unroll 4
    for (; i + 128 <= n; i += 128) {
        prefetch_ahead(w + i, 256);
        for (int q = 0; q < 4; q++)
            acc[q] = _mm512_dpbf16_ps(acc[q], (__m512bh)_mm512_loadu_si512(w + i + 32 * q), (__m512bh)_mm512_loadu_si512(a.b + i + 32 * q));
    }
    for (; i + 32 <= n; i += 32)
        acc[0] = _mm512_dpbf16_ps(acc[0], (__m512bh)_mm512_loadu_si512(w + i), (__m512bh)_mm512_loadu_si512(a.b + i));
    float s = sum4(acc);
    for (; i < n; i++) s += bf16_to_f32(w[i]) * bf16_to_f32(a.b[i]);
    return s;
}
ONE_ROW_AT_A_TIME(dot_bf16_rows, dot_bf16, const uint16_t *) /* no CPU here to check a blocked form on */
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* int8 weights against the int8-quantized activation (n a multiple of QBLOCK): vpdpbusd multiplies
 * unsigned by signed bytes, so the activation's sign moves onto the weight (w -> -w where x < 0;
 * weights are in [-127, 127], so negation cannot overflow). Block sums are exact in int32, then
 * scaled by the block's activation scale into one of four f32 accumulators. */
#define SIMD_HAVE_DOT_I8 1
static float dot_i8(const int8_t *w, int64_t n, act_t a) {
    __m512 acc[4];
    for (int q = 0; q < 4; q++) acc[q] = _mm512_setzero_ps();
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t i = 0, b = 0; i < n; i += QBLOCK, b++) {
        prefetch_ahead(w + i, QBLOCK);
        __m512i wv = _mm512_loadu_si512(w + i);
        wv = _mm512_mask_sub_epi8(wv, a.neg[b], zero, wv);
        __m512 block = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, _mm512_loadu_si512(a.qa + i), wv));
        acc[b & 3] = _mm512_fmadd_ps(block, _mm512_set1_ps(a.qs[b]), acc[b & 3]);
    }
    return sum4(acc);
}
ONE_ROW_AT_A_TIME(dot_i8_rows, dot_i8, const int8_t *) /* the sign moves onto each row's weights: little to share */
#endif

#if defined(__AVX512BW__)
#define SIMD_HAVE_Q4_ROW 1
/* A group's 64 codes times its 64 activation bytes as sixteen int32 lanes: one vpdpbusd with VNNI, else
 * vpmaddubsw (unsigned codes <= 15 times signed bytes: pairs sum to at most 3810, no saturation) and vpmaddwd. */
#if defined(__AVX512VNNI__)
#define Q4_GROUP_DOT(q, x) _mm512_dpbusd_epi32(_mm512_setzero_si512(), (q), (x))
#define Q4_PAIR_DOT(lo, xa, hi, xb) _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), (lo), (xa)), (hi), (xb))
#else
#define Q4_GROUP_DOT(q, x) _mm512_madd_epi16(_mm512_maddubs_epi16((q), (x)), _mm512_set1_epi16(1))
/* two products of at most 3810 each: their int16 sum cannot overflow either */
#define Q4_PAIR_DOT(lo, xa, hi, xb) \
    _mm512_madd_epi16(_mm512_add_epi16(_mm512_maddubs_epi16((lo), (xa)), _mm512_maddubs_epi16((hi), (xb))), _mm512_set1_epi16(1))
#endif
/* Group b's 64 codes (low nibbles, the even elements, in the low half; high nibbles in the high half) against
 * its 64 activation bytes, as f32 lanes: the last group of a row with an odd number of groups. */
static inline __m512 q4_group(const uint8_t *packed, const int8_t *xq, int64_t b) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256i v = _mm256_loadu_si256((const __m256i *)(packed + b * (Q4_GROUP / 2)));
    __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    return _mm512_cvtepi32_ps(Q4_GROUP_DOT(q, _mm512_loadu_si512(xq + b * Q4_GROUP)));
}

/* Groups b and b+1 from one 64-byte load: the low nibbles are [even b | even b+1], the high ones [odd b | odd
 * b+1], which is how q4_slot lays out a pair of the activation's groups (SIMD_Q4_PAIRED), so two dot
 * products and no lane shuffle give lanes 0-7 of group b and lanes 8-15 of group b+1. */
#define SIMD_Q4_PAIRED 1
static inline __m512 q4_pair(const uint8_t *packed, const int8_t *xq, int64_t b) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512i v = _mm512_loadu_si512(packed + b * (Q4_GROUP / 2));
    __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    const int8_t *x = xq + b * Q4_GROUP;
    return _mm512_cvtepi32_ps(Q4_PAIR_DOT(lo, _mm512_loadu_si512(x), hi, _mm512_loadu_si512(x + Q4_GROUP)));
}

/* One int4 row (groups of 64, cpu_gemv.c's format) against the quantized activation: two groups a register,
 * four pairs at a time into four f32 accumulators held in registers; the group scales, zeros and activation
 * sums are widened sixteen groups at a time and each pair's two scales spread over its lanes with one
 * permute, so no scalar work is left per group. (One group a register, with its accumulator array indexed by
 * j & 3, streamed int4 at half int8's rate on an AVX-512 EPYC: bound by the unpacking's instructions.) */
static float q4_row(const uint8_t *packed, const uint16_t *scale, const uint16_t *zero, int64_t n, const int8_t *xq,
                    const float *xs, const int32_t *xsum) {
    /* lanes 0-7 take the pair's first scale, lanes 8-15 its second: pair p of sixteen groups uses 2p, 2p+1 */
#define PAIR_IDX(p) _mm512_set_epi32(2 * (p) + 1, 2 * (p) + 1, 2 * (p) + 1, 2 * (p) + 1, 2 * (p) + 1, 2 * (p) + 1, \
                                     2 * (p) + 1, 2 * (p) + 1, 2 * (p), 2 * (p), 2 * (p), 2 * (p), 2 * (p), 2 * (p), 2 * (p), 2 * (p))
    const __m512i idx[8] = {PAIR_IDX(0), PAIR_IDX(1), PAIR_IDX(2), PAIR_IDX(3),
                            PAIR_IDX(4), PAIR_IDX(5), PAIR_IDX(6), PAIR_IDX(7)};
#undef PAIR_IDX
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, corr = a0;
    int64_t groups = n / Q4_GROUP;
    for (int64_t g0 = 0; g0 < groups; g0 += 16) {
        int64_t cnt = groups - g0 < 16 ? groups - g0 : 16;
        __mmask16 mk = (__mmask16)(cnt == 16 ? 0xFFFFu : (1u << cnt) - 1u);
        __m512 s = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, scale + g0)),
                                 _mm512_maskz_loadu_ps(mk, xs + g0));
        __m512 z = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, zero + g0));
        corr = _mm512_fmadd_ps(_mm512_mul_ps(s, z), _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(mk, xsum + g0)), corr);
        int64_t p = 0, pairs = cnt / 2;
        for (; p + 4 <= pairs; p += 4) {
            a0 = _mm512_fmadd_ps(q4_pair(packed, xq, g0 + 2 * p), _mm512_permutexvar_ps(idx[p], s), a0);
            a1 = _mm512_fmadd_ps(q4_pair(packed, xq, g0 + 2 * p + 2), _mm512_permutexvar_ps(idx[p + 1], s), a1);
            a2 = _mm512_fmadd_ps(q4_pair(packed, xq, g0 + 2 * p + 4), _mm512_permutexvar_ps(idx[p + 2], s), a2);
            a3 = _mm512_fmadd_ps(q4_pair(packed, xq, g0 + 2 * p + 6), _mm512_permutexvar_ps(idx[p + 3], s), a3);
        }
        for (; p < pairs; p++) a0 = _mm512_fmadd_ps(q4_pair(packed, xq, g0 + 2 * p), _mm512_permutexvar_ps(idx[p], s), a0);
        if (cnt % 2) /* the row's last group, unpaired */
            a1 = _mm512_fmadd_ps(q4_group(packed, xq, g0 + cnt - 1), _mm512_permutexvar_ps(_mm512_set1_epi32((int)cnt - 1), s), a1);
    }
    __m512 sum = _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));
    return _mm512_reduce_add_ps(_mm512_sub_ps(sum, corr)); /* one horizontal sum a row: rows are short */
}
#undef Q4_GROUP_DOT
#undef Q4_PAIR_DOT
#endif

/* q . row for one cached key row (f32 or bf16), q in f32: sixteen lanes of fused multiply-adds, then their sum
 * (hsum16). Fused: half the instructions of a product and a sum, for the attention of a long prompt. */
#define SIMD_HAVE_DOT_ROW 1
static inline float dot_row(const float *q, const void *row, int wtype, int64_t d) {
    int64_t i = 0;
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= d; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), load16(row, wtype, i), acc);
    float s = hsum16(acc);
    for (; i < d; i++) s = fmaf(q[i], load1(row, wtype, i), s);
    return s;
}

/* The attention of many rows (a prompt chunk) in tiles, each row's bits those of dot_row and axpy_row, so a prompt
 * row gets what it would decoded alone (attention.c attention_rows). Keys are transposed to f32 [d][16], 16 keys a
 * tile, so that one vector holds one lane sum of 16 keys: d % 16 == 0 only (no tail). */
#define SIMD_HAVE_KEY_TILE 1
/* q . key for the tile's 16 keys, bit for bit dot_row's per key: lane sum l of every key accumulates
 * q[i] * key[i] for i = l, l + 16, ... in order (one fused multiply-add each, as dot_row), and the 16 lane sums are
 * added in hsum16's tree (l with l + 8, then + 4, then + 2, then + 1). kt: [d][16]. */
static inline __m512 dot_keys16(const float *q, const float *kt, int64_t d) {
    __m512 a[16];
    for (int l = 0; l < 16; l++) a[l] = _mm512_setzero_ps();
    for (int64_t b = 0; b < d; b += 16)
        for (int l = 0; l < 16; l++)
            a[l] = _mm512_fmadd_ps(_mm512_set1_ps(q[b + l]), _mm512_loadu_ps(kt + (b + l) * 16), a[l]);
    for (int l = 0; l < 8; l++) a[l] = _mm512_add_ps(a[l + 8], a[l]);
    for (int l = 0; l < 4; l++) a[l] = _mm512_add_ps(a[l + 4], a[l]);
    for (int l = 0; l < 2; l++) a[l] = _mm512_add_ps(a[l], a[l + 2]);
    return _mm512_add_ps(a[0], a[1]);
}

/* acc[i] += p[j] * v[j][i] for j < n in order, for W vectors of acc held in registers (W a constant after inlining). */
static inline __attribute__((always_inline)) void axpy_keys_w(float *acc, const float *p, const float *v, int64_t n,
                                                              int64_t d, const int W) {
    __m512 a[8];
    for (int c = 0; c < W; c++) a[c] = _mm512_loadu_ps(acc + 16 * c);
    for (int64_t j = 0; j < n; j++) {
        __m512 pv = _mm512_set1_ps(p[j]);
        for (int c = 0; c < W; c++) a[c] = _mm512_fmadd_ps(pv, _mm512_loadu_ps(v + j * d + 16 * c), a[c]);
    }
    for (int c = 0; c < W; c++) _mm512_storeu_ps(acc + 16 * c, a[c]);
}

/* acc[i] += p[j] * v[j][i] for j < n in order, v [n][d] f32: axpy_row's fused multiply-adds, element by element
 * (d % 16 == 0), 128 elements of acc in registers at a time. */
static inline void axpy_keys(float *acc, const float *p, const float *v, int64_t n, int64_t d) {
    int64_t i = 0;
    for (; i + 128 <= d; i += 128) axpy_keys_w(acc + i, p, v + i, n, d, 8);
    for (; i + 64 <= d; i += 64) axpy_keys_w(acc + i, p, v + i, n, d, 4);
    for (; i < d; i += 16) axpy_keys_w(acc + i, p, v + i, n, d, 1);
}

/* The largest of x[0..n): the softmax's shift. Any order gives the same value (a -0 or +0 maximum shifts alike). */
#define SIMD_HAVE_ROW_MAX 1
static inline float row_max(const float *x, int64_t n) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(x + j));
    float mx = _mm512_reduce_max_ps(m);
    for (; j < n; j++) mx = x[j] > mx ? x[j] : mx;
    return mx;
}

/* acc[i] += p * row[i] for one cached value row, one fused multiply-add an element. */
#define SIMD_HAVE_AXPY_ROW 1
static inline void axpy_row(float *acc, float p, const void *row, int wtype, int64_t d) {
    int64_t i = 0;
    __m512 pv = _mm512_set1_ps(p);
    for (; i + 16 <= d; i += 16) _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(pv, load16(row, wtype, i), _mm512_loadu_ps(acc + i)));
    for (; i < d; i++) acc[i] = fmaf(p, load1(row, wtype, i), acc[i]);
}

/* exp(x) of each score for the softmax, in place, sixteen at a time (Cephes' expf: n = round(x / ln 2), a
 * degree-6 polynomial of the remainder, times 2^n; within about 2 ulp of expf over the range the softmax feeds
 * it, x <= 0): one scalar expf per cached position and head took most of a long context's attention time. */
#define SIMD_HAVE_EXP 1
static void exp_inplace(float *x, int64_t n) {
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        __m512 v = _mm512_max_ps(_mm512_loadu_ps(x + j), _mm512_set1_ps(-87.3f)); /* below: 0 after rounding anyway */
        __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), v);
        r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
        __m512 p = _mm512_set1_ps(1.9875691500e-4f);
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
        p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
        _mm512_storeu_ps(x + j, _mm512_scalef_ps(p, k));
    }
    for (; j < n; j++) x[j] = expf(x[j]);
}

#endif
