/* The register tiles of engine/native/gemm.c: for each dot product of cpu_gemv.c's simd headers, the same
 * accumulator chains run for mr activation rows x nr weight rows at once.
 *
 * Each one-row dot product keeps four accumulators, each summing its own chunks of K in ascending order (chunk
 * c goes to accumulator c % 4), then adds the four as (a0 + a1) + (a2 + a3), sums the lanes, and adds a scalar
 * tail. A tile runs one accumulator's chain at a time for its mr x nr outputs (a pass over K: registers for
 * mr * nr accumulators and the loads they share), keeps each pass's result in memory (a stored and reloaded f32
 * is the same f32), and finishes each output exactly as the one-row dot does. Every chunk, product and sum is the
 * one-row dot's, in its order: only the loads are shared. Which tile mirrors which dot, per build:
 *  - widen512: simd_avx512.h dot_widen (any AVX-512 build; f32 weights, and bf16/int8 weights where the dot widens);
 *  - dpbf16: simd_avx512.h dot_bf16 (avx512-bf16; bf16 weights, bf16 rows);
 *  - pairs256: simd_avx2.h dot_bf16, the even/odd form (avx512, avx512-vnni, avx2; bf16 weights);
 *  - widen256: simd_avx2.h dot_widen (avx2);
 *  - vnni_i8: simd_avx512.h dot_i8 (avx512-vnni, avx512-bf16; int8 weights, bf16 rows). Its int32 block sums are
 *    exact, so the tile computes each lane's sum another exact way that lets the weights be shared: the codes
 *    w + 128 (unsigned) times the signed activation codes, minus 128 times the activation codes' lane sum;
 *  - i8_256: simd_avx2.h dot_i8 (avx512, avx2), the same instructions per output.
 * tests/test_gemm_invariant.py checks every build this CPU runs against the one-row calls, bit for bit. */
#define AI static inline __attribute__((always_inline))

/* Calls blk for an mr x nr tile from full MR x NR tiles, single rows and single columns (edges are rare). */
#define TILE_FN(name, blk, MR, NR)                                                                          \
    static void name(const char *w, size_t ldw, const act_t *X, int64_t n, float *out, int mr, int nr) {   \
        if (mr == MR && nr == NR) blk(w, ldw, X, n, out, MR, NR);                                           \
        else if (mr == MR) for (int c = 0; c < nr; c++) blk(w + c * ldw, ldw, X, n, out + c, MR, 1);        \
        else if (nr == NR) for (int r = 0; r < mr; r++) blk(w, ldw, X + r, n, out + r * TILE_LD, 1, NR);    \
        else for (int r = 0; r < mr; r++)                                                                   \
            for (int c = 0; c < nr; c++) blk(w + c * ldw, ldw, X + r, n, out + r * TILE_LD + c, 1, 1);    \
    }

static inline float w_at(const char *w, int wt, int64_t i) {
    if (wt == W_F32) return ((const float *)w)[i];
    if (wt == W_BF16) return bf16_to_f32(((const uint16_t *)w)[i]);
    return (float)((const int8_t *)w)[i];
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
AI __m512 w16(const char *w, const int wt, int64_t i) { /* simd_avx512.h load16 */
    if (wt == W_F32) return _mm512_loadu_ps((const float *)w + i);
    if (wt == W_BF16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    __m128i q = _mm_loadu_si128((const __m128i *)((const int8_t *)w + i));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
}

/* The four passes' accumulators of output (r, c) summed as simd_avx512.h sum4 does. */
#define SUM4_512(acc, r, c) \
    _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0][r][c], acc[1][r][c]), _mm512_add_ps(acc[2][r][c], acc[3][r][c])))

/* dot_widen: accumulator q sums the 16-element chunks at 64 t + 16 q; accumulator 0 then the 16-element chunks
 * after the last full 64; a scalar tail after the sum. */
AI void widen512_blk(const char *w, size_t ldw, const int wt, const act_t *X, int64_t n, float *out, const int MR,
                     const int NR) {
    __m512 acc[4][4][6];
    int64_t n64 = n / 64 * 64, n16 = n / 16 * 16;
    for (int q = 0; q < 4; q++) {
        __m512 a[4][6];
        for (int r = 0; r < MR; r++)
            for (int c = 0; c < NR; c++) a[r][c] = _mm512_setzero_ps();
        int64_t i = 16 * q, end = n64, step = 64;
        for (int seg = 0; seg < (q == 0 ? 2 : 1); seg++) {
            for (; i < end; i += step) {
                __m512 v[6];
                for (int c = 0; c < NR; c++) v[c] = w16(w + c * ldw, wt, i);
                for (int r = 0; r < MR; r++) {
                    __m512 x = _mm512_loadu_ps(X[r].f + i);
                    for (int c = 0; c < NR; c++) a[r][c] = _mm512_fmadd_ps(v[c], x, a[r][c]);
                }
            }
            i = n64, end = n16, step = 16;
        }
        for (int r = 0; r < MR; r++)
            for (int c = 0; c < NR; c++) acc[q][r][c] = a[r][c];
    }
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < NR; c++) {
            float s = SUM4_512(acc, r, c);
            for (int64_t t = n16; t < n; t++) s += w_at(w + c * ldw, wt, t) * X[r].f[t];
            out[r * TILE_LD + c] = s;
        }
}
#define WIDEN512(T) \
    AI void widen512_##T(const char *w, size_t ldw, const act_t *X, int64_t n, float *out, const int MR, const int NR) { \
        widen512_blk(w, ldw, T, X, n, out, MR, NR);                                                               \
    }                                                                                                             \
    TILE_FN(widen512_tile_##T, widen512_##T, 4, 6)
WIDEN512(W_F32)
WIDEN512(W_BF16)
WIDEN512(W_I8)
#endif

#if defined(__AVX512BF16__)
/* dot_bf16 (vdpbf16ps): accumulator q sums the 32-element chunks at 128 t + 32 q; accumulator 0 then the
 * 32-element chunks after the last full 128; a scalar tail of bf16 products after the sum. */
AI void dpbf16_blk(const char *wb, size_t ldw, const act_t *X, int64_t n, float *out, const int MR, const int NR) {
    __m512 acc[4][4][6];
    int64_t n128 = n / 128 * 128, n32 = n / 32 * 32;
    for (int q = 0; q < 4; q++) {
        __m512 a[4][6];
        for (int r = 0; r < MR; r++)
            for (int c = 0; c < NR; c++) a[r][c] = _mm512_setzero_ps();
        int64_t i = 32 * q, end = n128, step = 128;
        for (int seg = 0; seg < (q == 0 ? 2 : 1); seg++) {
            for (; i < end; i += step) {
                __m512i v[6];
                for (int c = 0; c < NR; c++) v[c] = _mm512_loadu_si512((const uint16_t *)(wb + c * ldw) + i);
                for (int r = 0; r < MR; r++) {
                    __m512i x = _mm512_loadu_si512(X[r].b + i);
                    for (int c = 0; c < NR; c++) a[r][c] = _mm512_dpbf16_ps(a[r][c], (__m512bh)v[c], (__m512bh)x);
                }
            }
            i = n128, end = n32, step = 32;
        }
        for (int r = 0; r < MR; r++)
            for (int c = 0; c < NR; c++) acc[q][r][c] = a[r][c];
    }
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < NR; c++) {
            const uint16_t *w = (const uint16_t *)(wb + c * ldw);
            float s = SUM4_512(acc, r, c);
            for (int64_t t = n32; t < n; t++) s += bf16_to_f32(w[t]) * bf16_to_f32(X[r].b[t]);
            out[r * TILE_LD + c] = s;
        }
}
TILE_FN(dpbf16_tile, dpbf16_blk, 4, 6)
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* dot_i8 (vpdpbusd): accumulator q sums blocks q, q + 4, ... of 64: the exact int32 lane sums, times the block's
 * activation scale. Lane sums here: (w + 128) . x - 128 * (lane sum of x), both exact. */
AI void vnni_i8_blk(const char *w, size_t ldw, const act_t *X, int64_t n, float *out, const int MR, const int NR) {
    __m512 acc[4][4][4];
    const __m512i zero = _mm512_setzero_si512(), bias = _mm512_set1_epi8((char)0x80);
    int64_t blocks = n / 64;
    for (int q = 0; q < 4; q++) {
        __m512 a[4][4];
        for (int r = 0; r < MR; r++)
            for (int c = 0; c < NR; c++) a[r][c] = _mm512_setzero_ps();
        for (int64_t b = q; b < blocks; b += 4) {
            __m512i v[4];
            for (int c = 0; c < NR; c++) v[c] = _mm512_xor_si512(_mm512_loadu_si512(w + c * ldw + 64 * b), bias);
            for (int r = 0; r < MR; r++) {
                __m512i x = _mm512_loadu_si512(X[r].q8 + 64 * b);
                __m512i corr = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, bias, x));
                __m512 s = _mm512_set1_ps(X[r].qs[b]);
                for (int c = 0; c < NR; c++)
                    a[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(corr, v[c], x)), s, a[r][c]);
            }
        }
        for (int r = 0; r < MR; r++)
            for (int c = 0; c < NR; c++) acc[q][r][c] = a[r][c];
    }
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < NR; c++) out[r * TILE_LD + c] = SUM4_512(acc, r, c);
}
TILE_FN(vnni_i8_tile, vnni_i8_blk, 4, 4)
#endif

#if defined(__AVX2__) && defined(__FMA__)
static inline float hsum8_(__m256 v) { /* simd_avx2.h hsum8 */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
#define SUM4_256(acc, r, c) \
    hsum8_(_mm256_add_ps(_mm256_add_ps(acc[0][r][c], acc[1][r][c]), _mm256_add_ps(acc[2][r][c], acc[3][r][c])))
#if defined(__AVX512F__) /* 32 vector registers */
#define P256_MR 3
#define P256_NR 3
#else
#define P256_MR 2
#define P256_NR 2
#endif

#if !defined(__AVX512BF16__)
/* dot_bf16 of simd_avx2.h: each 16 bf16 weights split into even (a0, a2) and odd (a1, a3) f32 lanes against the
 * even/odd activation (act_t.p). Pass 0: the 32-element chunks' first halves into a0, a1, then the 16-element
 * chunks after the last full 32; pass 1: their second halves into a2, a3. A scalar tail after the sum. */
AI void pairs256_blk(const char *wb, size_t ldw, const act_t *X, int64_t n, float *out, const int MR, const int NR) {
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256 acc[4][3][3];
    int64_t n32 = n / 32 * 32, n16 = n / 16 * 16;
    for (int pass = 0; pass < 2; pass++) {
        __m256 lo[3][3], hi[3][3];
        for (int r = 0; r < MR; r++)
            for (int c = 0; c < NR; c++) lo[r][c] = hi[r][c] = _mm256_setzero_ps();
        int64_t i = 16 * pass, end = n32 + 16 * pass, step = 32;
        for (int seg = 0; seg < (pass == 0 ? 2 : 1); seg++) {
            for (; i < end; i += step) {
                __m256 vl[3], vh[3];
                for (int c = 0; c < NR; c++) {
                    __m256i v = _mm256_loadu_si256((const __m256i *)((const uint16_t *)(wb + c * ldw) + i));
                    vl[c] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
                    vh[c] = _mm256_castsi256_ps(_mm256_and_si256(v, high));
                }
                for (int r = 0; r < MR; r++) {
                    __m256 pl = _mm256_loadu_ps(X[r].p + i), ph = _mm256_loadu_ps(X[r].p + i + 8);
                    for (int c = 0; c < NR; c++) {
                        lo[r][c] = _mm256_fmadd_ps(vl[c], pl, lo[r][c]);
                        hi[r][c] = _mm256_fmadd_ps(vh[c], ph, hi[r][c]);
                    }
                }
            }
            i = n32, end = n16, step = 16;
        }
        for (int r = 0; r < MR; r++)
            for (int c = 0; c < NR; c++) acc[2 * pass][r][c] = lo[r][c], acc[2 * pass + 1][r][c] = hi[r][c];
    }
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < NR; c++) {
            const uint16_t *w = (const uint16_t *)(wb + c * ldw);
            float s = SUM4_256(acc, r, c);
            for (int64_t t = n16; t < n; t++) s += bf16_to_f32(w[t]) * X[r].f[t];
            out[r * TILE_LD + c] = s;
        }
}
TILE_FN(pairs256_tile, pairs256_blk, P256_MR, P256_NR)
#endif

#if !defined(__AVX512F__)
AI __m256 w8(const char *w, const int wt, int64_t i) { /* simd_avx2.h load8 */
    if (wt == W_F32) return _mm256_loadu_ps((const float *)w + i);
    if (wt == W_BF16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    __m128i q = _mm_loadl_epi64((const __m128i *)((const int8_t *)w + i));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
}

/* dot_widen of simd_avx2.h: accumulator q sums the 8-element chunks at 32 t + 8 q; accumulator 0 then the
 * 8-element chunks after the last full 32; a scalar tail after the sum. */
AI void widen256_blk(const char *w, size_t ldw, const int wt, const act_t *X, int64_t n, float *out, const int MR,
                     const int NR) {
    __m256 acc[4][3][3];
    int64_t n32 = n / 32 * 32, n8 = n / 8 * 8;
    for (int q = 0; q < 4; q++) {
        __m256 a[3][3];
        for (int r = 0; r < MR; r++)
            for (int c = 0; c < NR; c++) a[r][c] = _mm256_setzero_ps();
        int64_t i = 8 * q, end = n32, step = 32;
        for (int seg = 0; seg < (q == 0 ? 2 : 1); seg++) {
            for (; i < end; i += step) {
                __m256 v[3];
                for (int c = 0; c < NR; c++) v[c] = w8(w + c * ldw, wt, i);
                for (int r = 0; r < MR; r++) {
                    __m256 x = _mm256_loadu_ps(X[r].f + i);
                    for (int c = 0; c < NR; c++) a[r][c] = _mm256_fmadd_ps(v[c], x, a[r][c]);
                }
            }
            i = n32, end = n8, step = 8;
        }
        for (int r = 0; r < MR; r++)
            for (int c = 0; c < NR; c++) acc[q][r][c] = a[r][c];
    }
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < NR; c++) {
            float s = SUM4_256(acc, r, c);
            for (int64_t t = n8; t < n; t++) s += w_at(w + c * ldw, wt, t) * X[r].f[t];
            out[r * TILE_LD + c] = s;
        }
}
#define WIDEN256(T) \
    AI void widen256_##T(const char *w, size_t ldw, const act_t *X, int64_t n, float *out, const int MR, const int NR) { \
        widen256_blk(w, ldw, T, X, n, out, MR, NR);                                                               \
    }                                                                                                             \
    TILE_FN(widen256_tile_##T, widen256_##T, 3, 3)
WIDEN256(W_F32)
WIDEN256(W_BF16)
WIDEN256(W_I8)
#endif

#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
AI __m256i madd_u8s8_(__m256i u, __m256i s) { return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)); }

/* dot_i8 of simd_avx2.h: accumulator q sums blocks q, q + 4, ... of 64, each |x| times the weight with x's sign
 * (vpsignb, vpmaddubsw, vpmaddwd), times the block's activation scale. */
AI void i8_256_blk(const char *w, size_t ldw, const act_t *X, int64_t n, float *out, const int MR, const int NR) {
    __m256 acc[4][3][3];
    int64_t blocks = n / 64;
    for (int q = 0; q < 4; q++) {
        __m256 a[3][3];
        for (int r = 0; r < MR; r++)
            for (int c = 0; c < NR; c++) a[r][c] = _mm256_setzero_ps();
        for (int64_t b = q; b < blocks; b += 4) {
            int64_t i = 64 * b;
            __m256i w0[3], w1[3];
            for (int c = 0; c < NR; c++) {
                w0[c] = _mm256_loadu_si256((const __m256i *)(w + c * ldw + i));
                w1[c] = _mm256_loadu_si256((const __m256i *)(w + c * ldw + i + 32));
            }
            for (int r = 0; r < MR; r++) {
                __m256i x0 = _mm256_loadu_si256((const __m256i *)(X[r].q8 + i)), x1 = _mm256_loadu_si256((const __m256i *)(X[r].q8 + i + 32));
                __m256i u0 = _mm256_loadu_si256((const __m256i *)(X[r].qa + i)), u1 = _mm256_loadu_si256((const __m256i *)(X[r].qa + i + 32));
                __m256 s = _mm256_set1_ps(X[r].qs[b]);
                for (int c = 0; c < NR; c++) {
                    __m256i d = _mm256_add_epi32(madd_u8s8_(u0, _mm256_sign_epi8(w0[c], x0)), madd_u8s8_(u1, _mm256_sign_epi8(w1[c], x1)));
                    a[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), s, a[r][c]);
                }
            }
        }
        for (int r = 0; r < MR; r++)
            for (int c = 0; c < NR; c++) acc[q][r][c] = a[r][c];
    }
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < NR; c++) out[r * TILE_LD + c] = SUM4_256(acc, r, c);
}
TILE_FN(i8_256_tile, i8_256_blk, P256_MR, P256_NR)
#endif
#endif /* AVX2 */

/* The tile that mirrors the dot product act_prepare chose (`mode`) for weights of `wtype`; none: dot_rows. */
static tile_t pick_tile(int mode, int wtype) {
    tile_t none = {NULL, 1, 1};
    (void)wtype;
#if defined(__AVX512F__)
    if (mode == DOT_WIDEN) {
        tile_fn f = wtype == W_F32 ? widen512_tile_W_F32 : wtype == W_BF16 ? widen512_tile_W_BF16 : widen512_tile_W_I8;
        return (tile_t){f, 4, 6};
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if (mode == DOT_WIDEN) {
        tile_fn f = wtype == W_F32 ? widen256_tile_W_F32 : wtype == W_BF16 ? widen256_tile_W_BF16 : widen256_tile_W_I8;
        return (tile_t){f, 3, 3};
    }
#endif
#if defined(__AVX512BF16__)
    if (mode == DOT_BF16) return (tile_t){dpbf16_tile, 4, 6};
#elif defined(__AVX2__) && defined(__FMA__)
    if (mode == DOT_BF16) return (tile_t){pairs256_tile, P256_MR, P256_NR};
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if (mode == DOT_I8) return (tile_t){vnni_i8_tile, 4, 4};
#elif defined(__AVX2__) && defined(__FMA__)
    if (mode == DOT_I8) return (tile_t){i8_256_tile, P256_MR, P256_NR};
#endif
    return none;
}
