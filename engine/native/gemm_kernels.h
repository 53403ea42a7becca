/* The register tiles of engine/native/gemm.c: for each dot product of cpu_gemv.c's simd headers, the same
 * accumulator chains, run for mr activation rows x nr weight rows at once.
 *
 * Each one-row dot product keeps four accumulators, each adding its own chunks of K in ascending order, then adds
 * the four as (a0 + a1) + (a2 + a3), sums the lanes, and adds a scalar tail. gemm.c packs each row's chunks in
 * chain order (chain q's chunks contiguous, ctx_t.pos/cnt), so a tile runs one chain at a time over contiguous
 * memory for its mr x nr outputs (registers for mr * nr accumulators and the loads they share), keeps each
 * chain's result in memory (a stored and reloaded f32 is the same f32), and finishes each output exactly as the
 * one-row dot does, tail from the unpacked rows. Every product and sum is the one-row dot's, in its order: only
 * the loads are shared. The families (which dot each mirrors, per build):
 *  - FAM_W512: simd_avx512.h dot_widen (any AVX-512 build; weights widened to f32 when packed: exact);
 *  - FAM_DPBF: simd_avx512.h dot_bf16, vdpbf16ps (avx512-bf16; bf16 weights and rows);
 *  - FAM_P256: simd_avx2.h dot_bf16, even/odd pairs (avx512, avx512-vnni, avx2; bf16 weights, packed as the
 *    f32 even/odd values its shift and mask make);
 *  - FAM_W256: simd_avx2.h dot_widen (avx2);
 *  - FAM_VNNI: simd_avx512.h dot_i8, vpdpbusd (avx512-vnni, avx512-bf16; int8 weights, bf16 rows). Its int32
 *    lane sums are exact, so the tile computes them another exact way that lets each weight load serve every
 *    row: the codes w + 128 (unsigned, packed so) times the signed activation codes, minus 128 times the
 *    activation codes' lane sum;
 *  - FAM_I8: simd_avx2.h dot_i8 (avx512, avx2), the same instructions per output.
 * tests/test_gemm_invariant.py checks every build this CPU runs against the one-row calls, bit for bit.
 * Self-contained: it defines what a tile reads (ctx_t) and is (tile_t) for gemm.c, which includes it. */
#ifndef MOE_OFFLOAD_GEMM_KERNELS_H
#define MOE_OFFLOAD_GEMM_KERNELS_H
#include "cpu_gemv.h"

/* The tile families (above: which dot product each mirrors). */
enum { FAM_NONE = 0, FAM_W512, FAM_DPBF, FAM_VNNI, FAM_P256, FAM_W256, FAM_I8 };

/* What a tile reads: rows packed in chain order (chain q's chunks at chunk pos[q], cnt[q] of them, V elements
 * each), and the unpacked rows for the scalar tails and the int8 block scales. */
typedef struct {
    int fam, V, wtype;
    int64_t n, tail; /* row length; where the one-row dot's scalar tail starts */
    int64_t pos[4], cnt[4];
    const char *wp, *xp, *xa; /* packed weight rows of the panel, activation rows, |x| codes (FAM_I8) */
    size_t ldwp, ldxp;        /* their row strides in bytes */
    const char *w;            /* the panel's unpacked weight rows, ldw bytes apart */
    size_t ldw;
    const act_t *X; /* the unpacked activation rows of the packed block */
} ctx_t;

/* A tile: out[r * TILE_LD + c] = the one-row dot of panel weight row c0 + c with packed activation row j0 + r. */
#define TILE_LD 8
typedef void (*tile_fn)(const ctx_t *k, int64_t c0, int64_t j0, float *out, int mr, int nr);
typedef struct {
    int fam, V, esize; /* family, elements a chunk, bytes a packed element */
    tile_fn fn;
    int mr, nr; /* the full tile's shape */
} tile_t;

/* Element i of a weight row as a float: the scalar tails of the tiles, as the one-row dots' load1. */
static inline float w_at(const char *w, int wt, int64_t i) {
    if (wt == W_F32) return ((const float *)w)[i];
    if (wt == W_BF16) return bf16_to_f32(((const uint16_t *)w)[i]);
    return (float)((const int8_t *)w)[i];
}

#define AI static inline __attribute__((always_inline))
#define MAXR 4 /* tile rows, at most */
#define MAXC 6 /* tile columns, at most */

/* Calls blk for an mr x nr tile from full MR x NR tiles, single rows and single columns (edges are rare). */
#define TILE_FN(name, blk, MR, NR)                                                                          \
    static void name(const ctx_t *k, int64_t c0, int64_t j0, float *out, int mr, int nr) {                 \
        if (mr == MR && nr == NR) blk(k, c0, j0, out, MR, NR);                                              \
        else if (mr == MR) for (int c = 0; c < nr; c++) blk(k, c0 + c, j0, out + c, MR, 1);                 \
        else if (nr == NR) for (int r = 0; r < mr; r++) blk(k, c0, j0 + r, out + r * TILE_LD, 1, NR);       \
        else for (int r = 0; r < mr; r++)                                                                   \
            for (int c = 0; c < nr; c++) blk(k, c0 + c, j0 + r, out + r * TILE_LD + c, 1, 1);              \
    }

/* Packed row pointers: weight row c (of the panel) and activation row j, at chain q's first chunk. */
#define WP(k, c, q, T) ((const T *)((k)->wp + (size_t)(c) * (k)->ldwp) + (k)->pos[q] * (k)->V)
#define XP(k, j, q, T) ((const T *)((k)->xp + (size_t)(j) * (k)->ldxp) + (k)->pos[q] * (k)->V)
/* The unpacked weight row of panel row c (the scalar tails). */
#define WROW(k, c) ((k)->w + (size_t)(c) * (k)->ldw)

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

/* acc[q][r][c] = chain q of output (r, c): the loop the float tiles share (VT vectors, rows packed as ET, LOAD
 * reading a vector, OP adding a product, STEP elements a chunk). */
#define RUN_CHAINS(VT, ET, ZERO, LOAD, OP, STEP)                                  \
    VT acc[4][MAXR][MAXC];                                                        \
    for (int q = 0; q < 4; q++) {                                                 \
        VT a[MAXR][MAXC];                                                         \
        const ET *w[MAXC], *x[MAXR];                                              \
        for (int c = 0; c < NR; c++) w[c] = WP(k, c0 + c, q, ET);                 \
        for (int r = 0; r < MR; r++) x[r] = XP(k, j0 + r, q, ET);                 \
        for (int r = 0; r < MR; r++)                                              \
            for (int c = 0; c < NR; c++) a[r][c] = ZERO;                          \
        for (int64_t t = 0; t < k->cnt[q] * (STEP); t += (STEP)) {                \
            __typeof__(LOAD(w[0])) v[MAXC];                                       \
            for (int c = 0; c < NR; c++) v[c] = LOAD(w[c] + t);                   \
            for (int r = 0; r < MR; r++) {                                        \
                __typeof__(LOAD(w[0])) xv = LOAD(x[r] + t);                       \
                for (int c = 0; c < NR; c++) a[r][c] = OP(a[r][c], v[c], xv);     \
            }                                                                     \
        }                                                                         \
        for (int r = 0; r < MR; r++)                                              \
            for (int c = 0; c < NR; c++) acc[q][r][c] = a[r][c];                  \
    }


#if defined(__AVX512F__)
#define SUM4_512(acc, r, c) \
    hsum16(_mm512_add_ps(_mm512_add_ps(acc[0][r][c], acc[1][r][c]), _mm512_add_ps(acc[2][r][c], acc[3][r][c])))

#define FMA512(a, v, x) _mm512_fmadd_ps(v, x, a)
/* FAM_W512: f32 FMA chains over packed f32 rows; the tail widens the unpacked weights (dot_widen's). */
AI void w512_blk(const ctx_t *k, int64_t c0, int64_t j0, float *out, const int MR, const int NR) {
    RUN_CHAINS(__m512, float, _mm512_setzero_ps(), _mm512_loadu_ps, FMA512, 16)
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < NR; c++) {
            float s = SUM4_512(acc, r, c);
            const float *xf = k->X[j0 + r].f;
            for (int64_t t = k->tail; t < k->n; t++) s += w_at(WROW(k, c0 + c), k->wtype, t) * xf[t];
            out[r * TILE_LD + c] = s;
        }
}
TILE_FN(w512_tile, w512_blk, 4, 6)
#endif

#if defined(__AVX512BF16__)
#define LOADBF(p) _mm512_loadu_si512(p)
#define DPBF(a, v, x) _mm512_dpbf16_ps(a, (__m512bh)(v), (__m512bh)(x))
/* FAM_DPBF: vdpbf16ps chains over packed bf16 rows; the tail multiplies bf16 by bf16 in f32 (dot_bf16's). */
AI void dpbf_blk(const ctx_t *k, int64_t c0, int64_t j0, float *out, const int MR, const int NR) {
    RUN_CHAINS(__m512, uint16_t, _mm512_setzero_ps(), LOADBF, DPBF, 32)
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < NR; c++) {
            float s = SUM4_512(acc, r, c);
            const uint16_t *w = (const uint16_t *)WROW(k, c0 + c), *xb = k->X[j0 + r].b;
            for (int64_t t = k->tail; t < k->n; t++) s += bf16_to_f32(w[t]) * bf16_to_f32(xb[t]);
            out[r * TILE_LD + c] = s;
        }
}
TILE_FN(dpbf_tile, dpbf_blk, 4, 6)
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* FAM_VNNI: chain q adds blocks q, q + 4, ... of 64: each block's exact int32 lane sums, times its activation
 * scale (dot_i8's). The packed weights are w ^ 0x80 = w + 128 as unsigned bytes. No tail: n is a multiple of 64. */
AI void vnni_blk(const ctx_t *k, int64_t c0, int64_t j0, float *out, const int MR, const int NR) {
    __m512 acc[4][MAXR][MAXC];
    const __m512i zero = _mm512_setzero_si512(), bias = _mm512_set1_epi8((char)0x80);
    for (int q = 0; q < 4; q++) {
        __m512 a[MAXR][MAXC];
        const int8_t *w[MAXC], *x[MAXR];
        for (int c = 0; c < NR; c++) w[c] = WP(k, c0 + c, q, int8_t);
        for (int r = 0; r < MR; r++) x[r] = XP(k, j0 + r, q, int8_t);
        for (int r = 0; r < MR; r++)
            for (int c = 0; c < NR; c++) a[r][c] = _mm512_setzero_ps();
        for (int64_t t = 0, b = q; t < k->cnt[q]; t++, b += 4) {
            __m512i v[MAXC];
            for (int c = 0; c < NR; c++) v[c] = _mm512_loadu_si512(w[c] + 64 * t);
            for (int r = 0; r < MR; r++) {
                __m512i xv = _mm512_loadu_si512(x[r] + 64 * t);
                __m512i corr = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, bias, xv));
                __m512 s = _mm512_set1_ps(k->X[j0 + r].qs[b]);
                for (int c = 0; c < NR; c++)
                    a[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(corr, v[c], xv)), s, a[r][c]);
            }
        }
        for (int r = 0; r < MR; r++)
            for (int c = 0; c < NR; c++) acc[q][r][c] = a[r][c];
    }
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < NR; c++) out[r * TILE_LD + c] = SUM4_512(acc, r, c);
}
TILE_FN(vnni_tile, vnni_blk, 4, 4)
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
#define T256_MR 4
#define T256_NR 5
#else
#define T256_MR 3
#define T256_NR 4
#endif

#if !(defined(__AVX512F__) && defined(__AVX512BF16__)) /* used by FAM_W256 (AVX2) or FAM_P256 (no BF16 dot) */
#define FMA256(a, v, x) _mm256_fmadd_ps(v, x, a)
/* FAM_P256 and FAM_W256: 8-lane f32 FMA chains over packed f32 rows (for FAM_P256 the even/odd values of the
 * bf16 weights); the tail: bf16 weights times f32 (dot_bf16 of simd_avx2.h) or widened weights (its dot_widen). */
AI void f256_blk(const ctx_t *k, int64_t c0, int64_t j0, float *out, const int MR, const int NR) {
    RUN_CHAINS(__m256, float, _mm256_setzero_ps(), _mm256_loadu_ps, FMA256, 8)
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < NR; c++) {
            float s = SUM4_256(acc, r, c);
            const float *xf = k->X[j0 + r].f;
            int wt = k->fam == FAM_P256 ? W_BF16 : k->wtype;
            for (int64_t t = k->tail; t < k->n; t++) s += w_at(WROW(k, c0 + c), wt, t) * xf[t];
            out[r * TILE_LD + c] = s;
        }
}
TILE_FN(f256_tile, f256_blk, T256_MR, T256_NR)
#endif

#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
AI __m256i madd_u8s8_(__m256i u, __m256i s) { return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)); }

/* FAM_I8: chain q adds blocks q, q + 4, ... of 64: |x| (packed beside the codes, xa) times the weight carrying
 * x's sign, exact int32 lane sums, times the block's activation scale (dot_i8 of simd_avx2.h). */
AI void i8_blk(const ctx_t *k, int64_t c0, int64_t j0, float *out, const int MR, const int NR) {
    __m256 acc[4][MAXR][MAXC];
    for (int q = 0; q < 4; q++) {
        __m256 a[MAXR][MAXC];
        const int8_t *w[MAXC], *x[MAXR];
        const uint8_t *u[MAXR];
        for (int c = 0; c < NR; c++) w[c] = WP(k, c0 + c, q, int8_t);
        for (int r = 0; r < MR; r++) {
            x[r] = XP(k, j0 + r, q, int8_t);
            u[r] = (const uint8_t *)k->xa + (size_t)(j0 + r) * k->ldxp + k->pos[q] * 64;
        }
        for (int r = 0; r < MR; r++)
            for (int c = 0; c < NR; c++) a[r][c] = _mm256_setzero_ps();
        for (int64_t t = 0, b = q; t < k->cnt[q]; t++, b += 4) {
            __m256i w0[MAXC], w1[MAXC];
            for (int c = 0; c < NR; c++) {
                w0[c] = _mm256_loadu_si256((const __m256i *)(w[c] + 64 * t));
                w1[c] = _mm256_loadu_si256((const __m256i *)(w[c] + 64 * t + 32));
            }
            for (int r = 0; r < MR; r++) {
                const int8_t *xb = x[r] + 64 * t;
                const uint8_t *ub = u[r] + 64 * t;
                __m256i x0 = _mm256_loadu_si256((const __m256i *)xb), x1 = _mm256_loadu_si256((const __m256i *)(xb + 32));
                __m256i u0 = _mm256_loadu_si256((const __m256i *)ub), u1 = _mm256_loadu_si256((const __m256i *)(ub + 32));
                __m256 s = _mm256_set1_ps(k->X[j0 + r].qs[b]);
                for (int c = 0; c < NR; c++) {
                    __m256i d = _mm256_add_epi32(madd_u8s8_(u0, _mm256_sign_epi8(w0[c], x0)),
                                                 madd_u8s8_(u1, _mm256_sign_epi8(w1[c], x1)));
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
#if defined(__AVX512F__)
TILE_FN(i8_tile, i8_blk, 3, 3)
#else
TILE_FN(i8_tile, i8_blk, 2, 2)
#endif
#endif
#endif /* AVX2 */

/* The tile family mirroring the dot product act_prepare chose (`mode`) for this build, or FAM_NONE (dot_rows). */
static tile_t pick_tile(int mode, int wtype) {
    (void)mode, (void)wtype;
#if defined(__AVX512F__)
    if (mode == DOT_WIDEN) return (tile_t){FAM_W512, 16, 4, w512_tile, 4, 6};
#elif defined(__AVX2__) && defined(__FMA__)
    if (mode == DOT_WIDEN) return (tile_t){FAM_W256, 8, 4, f256_tile, T256_MR, T256_NR};
#endif
#if defined(__AVX512BF16__)
    if (mode == DOT_BF16) return (tile_t){FAM_DPBF, 32, 2, dpbf_tile, 4, 6};
#elif defined(__AVX2__) && defined(__FMA__)
    if (mode == DOT_BF16) return (tile_t){FAM_P256, 8, 4, f256_tile, T256_MR, T256_NR};
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if (mode == DOT_I8) return (tile_t){FAM_VNNI, 64, 1, vnni_tile, 4, 4};
#elif defined(__AVX2__) && defined(__FMA__)
#if defined(__AVX512F__)
    if (mode == DOT_I8) return (tile_t){FAM_I8, 64, 1, i8_tile, 3, 3};
#else
    if (mode == DOT_I8) return (tile_t){FAM_I8, 64, 1, i8_tile, 2, 2};
#endif
#endif
    return (tile_t){FAM_NONE, 1, 1, NULL, 1, 1};
}

#endif
