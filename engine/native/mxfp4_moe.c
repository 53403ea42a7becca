/* gpt-oss's MXFP4 experts from the bytes the checkpoint ships, in one call a layer: no bf16 copy of
 * an expert, no torch matmul.
 *
 * Why: the torch path dequantizes each expert to the compute dtype (a table gather per byte) and then
 * runs a bf16 matmul, which this project's CPUs without AVX-512 BF16 widen element by element; both
 * cost more than reading the 4.25 bits a weight. Here each weight is decoded in registers and
 * multiplied in f32.
 *
 * The format (engine/experts/formats/native_quant.py): a projection [rows, cols] is `blocks` [rows, cols/32, 16]
 * uint8, two FP4 e2m1 codes a byte, low nibble first, and `scales` [rows, cols/32] uint8 e8m0, one
 * power of two 2^(s - 127) per 32 weights. A group's 16 bytes widen to 16 int32 lanes; the low 4 bits
 * of each lane index a 16-entry table of the e2m1 values (vpermps), the lane shifted right by 4 the
 * high nibble's. So the group's 16 low nibbles are its even elements and the 16 high ones its odd
 * elements, and the activation is stored per group of 32 as [its 16 even | its 16 odd elements]
 * (`mx_pos`). Per group: t = lo * x_even + hi * x_odd, then acc += t * 2^(s - 127). Every product
 * of an e2m1 value (2 significant bits) and a bf16 activation is exact in f32, and the power of two
 * is exact, so the result is the dot product with the dequantized weights, summed in another order.
 *
 * The expert, as transformers' GptOssExperts computes it (rounded to bf16 where that rounds in a bf16
 * model): gu = x W_gu^T + b_gu, gate and up interleaved (gu[2i], gu[2i+1]); gate = min(gate, limit),
 * up = clamp(up, -limit, limit); glu = gate * sigmoid(gate * alpha); h = (up + 1) * glu;
 * y = h W_d^T + b_d; then out[row] = sum over the row's experts ascending of w * y.
 * Several rows routed to one expert read its weights once: each weight group is decoded once for a
 * block of up to 4 rows, and each row keeps the one-row sequence of operations and accumulators, so
 * its result is bit for bit what it gets alone.
 *
 * AVX-512 builds take the 16-lane path, avx2 an 8-lane one (the table halved: magnitude by vpermps, sign
 * by a shift), portable plain C loops the compiler vectorises.
 */
#include <stdlib.h>
#include "cpu_gemv.h"
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#define MX_GROUP 32 /* weights a scale covers */
#define MX_ROWS_BLOCK 4 /* rows decoded together: 4 accumulators a row beside the weight registers */

/* e2m1 code -> value (transformers.integrations.mxfp4.FP4_VALUES). */
static const float FP4[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                              -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* 2^(s - 127) for each e8m0 byte, as torch.ldexp in float64 then f32 gives it: s = 0 is 2^-127 (a subnormal),
 * s = 255 overflows to infinity. In memory, so a group's scale is one broadcast load. */
static void pow2_table(float *t) {
    for (uint32_t s = 0; s < 256; s++) {
        uint32_t u = s ? s << 23 : 0x00400000u;
        memcpy(&t[s], &u, 4);
    }
}

/* Where element i of an activation goes in the even/odd order of its group of 32. */
static inline int64_t mx_pos(int64_t i) { return (i & ~(int64_t)31) + ((i & 1) ? 16 : 0) + ((i & 31) >> 1); }

#if defined(__AVX512F__)
/* Dot products of one weight row (G groups: blocks blk [G, 16], scales sc [G]) with R activation rows X[r]
 * (even/odd order), into out[r]. R is a constant once inlined. */
static inline __attribute__((always_inline)) void mx_dot_blk(const uint8_t *blk, const uint8_t *sc, int64_t G,
                                                             const float *pow2, const float *const *X, float *out,
                                                             const int R) {
    const __m512 lut = _mm512_loadu_ps(FP4);
    __m512 acc[MX_ROWS_BLOCK][4];
    for (int r = 0; r < R; r++)
        for (int q = 0; q < 4; q++) acc[r][q] = _mm512_setzero_ps();
#define MX_STEP(g, q)                                                                                       \
    do {                                                                                                    \
        __m512i b_ = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + (g) * 16)));              \
        __m512 lo_ = _mm512_permutexvar_ps(b_, lut);                                                        \
        __m512 hi_ = _mm512_permutexvar_ps(_mm512_srli_epi32(b_, 4), lut);                                  \
        __m512 s_ = _mm512_set1_ps(pow2[sc[g]]);                                                            \
        for (int r = 0; r < R; r++) {                                                                       \
            const float *xr_ = X[r] + (g) * MX_GROUP;                                                       \
            __m512 t_ = _mm512_mul_ps(lo_, _mm512_loadu_ps(xr_));                                           \
            t_ = _mm512_fmadd_ps(hi_, _mm512_loadu_ps(xr_ + 16), t_);                                       \
            acc[r][q] = _mm512_fmadd_ps(t_, s_, acc[r][q]);                                                 \
        }                                                                                                   \
    } while (0)
    int64_t g = 0;
    for (; g + 4 <= G; g += 4) {
        MX_STEP(g, 0);
        MX_STEP(g + 1, 1);
        MX_STEP(g + 2, 2);
        MX_STEP(g + 3, 3);
    }
    if (g < G) MX_STEP(g, 0);
    if (g + 1 < G) MX_STEP(g + 1, 1);
    if (g + 2 < G) MX_STEP(g + 2, 2);
#undef MX_STEP
    for (int r = 0; r < R; r++)
        out[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3])));
}
#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2: 8 lanes, and vpermps indexes 8 entries, so a code's magnitude (its low 3 bits) comes from the table of
 * the 8 non-negative e2m1 values and its sign bit (bit 3) moves to the float's sign bit. Two accumulators a row:
 * a group's first and second 8 lanes. */
static inline __m256 mx_half(__m256i b, __m256 mag8, int shift_mag, int shift_sign) {
    __m256i idx = shift_mag ? _mm256_srli_epi32(b, 4) : b;
    __m256 m = _mm256_permutevar8x32_ps(mag8, idx);
    __m256i sign = _mm256_and_si256(_mm256_slli_epi32(b, shift_sign), _mm256_set1_epi32((int)0x80000000u));
    return _mm256_xor_ps(m, _mm256_castsi256_ps(sign));
}

static inline __attribute__((always_inline)) void mx_dot_blk(const uint8_t *blk, const uint8_t *sc, int64_t G,
                                                             const float *pow2, const float *const *X, float *out,
                                                             const int R) {
    const __m256 mag8 = _mm256_loadu_ps(FP4);
    __m256 acc[MX_ROWS_BLOCK][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m128i bytes = _mm_loadu_si128((const __m128i *)(blk + g * 16));
        __m256i b0 = _mm256_cvtepu8_epi32(bytes), b1 = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));
        __m256 lo0 = mx_half(b0, mag8, 0, 28), lo1 = mx_half(b1, mag8, 0, 28);
        __m256 hi0 = mx_half(b0, mag8, 1, 24), hi1 = mx_half(b1, mag8, 1, 24);
        __m256 s = _mm256_broadcast_ss(&pow2[sc[g]]);
        for (int r = 0; r < R; r++) {
            const float *xr = X[r] + g * MX_GROUP;
            __m256 t0 = _mm256_mul_ps(lo0, _mm256_loadu_ps(xr));
            __m256 t1 = _mm256_mul_ps(lo1, _mm256_loadu_ps(xr + 8));
            t0 = _mm256_fmadd_ps(hi0, _mm256_loadu_ps(xr + 16), t0);
            t1 = _mm256_fmadd_ps(hi1, _mm256_loadu_ps(xr + 24), t1);
            acc[r][0] = _mm256_fmadd_ps(t0, s, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(t1, s, acc[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {
        float lanes[8];
        _mm256_storeu_ps(lanes, _mm256_add_ps(acc[r][0], acc[r][1]));
        out[r] = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    }
}
#else
/* The same lanes in plain C: 4 accumulators of 16 lanes a row, group g into accumulator g % 4. */
static inline __attribute__((always_inline)) void mx_dot_blk(const uint8_t *blk, const uint8_t *sc, int64_t G,
                                                             const float *pow2, const float *const *X, float *out,
                                                             const int R) {
    float acc[MX_ROWS_BLOCK][4][16];
    for (int r = 0; r < R; r++) memset(acc[r], 0, sizeof acc[r]);
    for (int64_t g = 0; g < G; g++) {
        float lo[16], hi[16], s = pow2[sc[g]];
        const uint8_t *b = blk + g * 16;
        for (int l = 0; l < 16; l++) {
            lo[l] = FP4[b[l] & 15];
            hi[l] = FP4[b[l] >> 4];
        }
        for (int r = 0; r < R; r++) {
            const float *xr = X[r] + g * MX_GROUP;
            float *a = acc[r][g & 3];
            for (int l = 0; l < 16; l++) {
                float t = lo[l] * xr[l];
                t = t + hi[l] * xr[16 + l];
                a[l] = a[l] + t * s;
            }
        }
    }
    for (int r = 0; r < R; r++) {
        float sum = 0.0f;
        for (int l = 0; l < 16; l++) sum += (acc[r][0][l] + acc[r][1][l]) + (acc[r][2][l] + acc[r][3][l]);
        out[r] = sum;
    }
}
#endif

/* mx_dot_blk for m rows: blocks of MX_ROWS_BLOCK, then the rest in one block. */
static void mx_rows(const uint8_t *blk, const uint8_t *sc, int64_t G, const float *pow2, const float *const *X,
                    int64_t m, float *out) {
    int64_t j = 0;
    for (; j + MX_ROWS_BLOCK <= m; j += MX_ROWS_BLOCK) mx_dot_blk(blk, sc, G, pow2, X + j, out + j, MX_ROWS_BLOCK);
    if (m - j == 3) mx_dot_blk(blk, sc, G, pow2, X + j, out + j, 3);
    else if (m - j == 2) mx_dot_blk(blk, sc, G, pow2, X + j, out + j, 2);
    else if (m - j == 1) mx_dot_blk(blk, sc, G, pow2, X + j, out + j, 1);
}

static inline float bias_at(const void *b, int btype, int64_t i, int xtype) {
    float v = btype == W_F32 ? ((const float *)b)[i] : bf16_to_f32(((const uint16_t *)b)[i]);
    return as_x(v, xtype); /* the torch path casts the bias to the compute dtype */
}

/* Bytes of `work` that moe_mxfp4_rows needs for up to R rows. */
size_t moe_mxfp4_work_bytes(int64_t H, int64_t I, int64_t R) {
    return (size_t)(256 + R * (H + I + 2 * I + H)) * 4 + 64;
}

/* R rows x [R, H] (R <= MAX_ROWS, in `xtype`) through their k gpt-oss experts each (row r: experts ids[r*k + j] with
 * weights w[r*k + j]); expert e: gate_up blocks gu_blocks[e] [2I, H/32, 16] and scales gu_scales[e] [2I, H/32],
 * bias gu_bias[e] [2I], down d_blocks[e] [H, I/32, 16], d_scales[e] [H, I/32], d_bias[e] [H]; biases in `btype`
 * (W_BF16 or W_F32). The experts run in ascending id, each on every row routed to it, and each row's sum runs
 * in that order (transformers' index_add_ order). H and I multiples of 32. out: [R, H] in `xtype`.
 * Returns 0, or -1 for a shape, row count or bias type it does not take. */
int moe_mxfp4_rows(int64_t H, int64_t I, int64_t R, int64_t k, const int64_t *ids, const float *w,
                   const uint8_t *const *gu_blocks, const uint8_t *const *gu_scales, const void *const *gu_bias,
                   const uint8_t *const *d_blocks, const uint8_t *const *d_scales, const void *const *d_bias,
                   int btype, float alpha, float limit, const void *x, int xtype, void *out, void *work,
                   int nthreads) {
    route_t routes[MAX_ROWS * 64];
    int64_t starts[MAX_ROWS * 64 + 1];
    int first[MAX_ROWS * 64];
    if (R < 1 || R > MAX_ROWS || k < 1 || k > MAX_TOPK || H % MX_GROUP || I % MX_GROUP) return -1;
    if (btype != W_F32 && btype != W_BF16) return -1;
    int64_t groups = group_routes(R, k, ids, w, routes, starts, first);
    for (int64_t g = 0; g < groups; g++)
        if (starts[g + 1] - starts[g] > R) return -1; /* a row naming one expert twice */
    float *pow2 = (float *)(((uintptr_t)work + 63) & ~(uintptr_t)63);
    float *xp = pow2 + 256, *hp = xp + R * H, *gu = hp + R * I, *acc = gu + R * 2 * I;
    pow2_table(pow2);
    size_t xs = xtype == X_F32 ? 4 : 2;
    for (int64_t r = 0; r < R; r++)
        for (int64_t i = 0; i < H; i++) xp[r * H + mx_pos(i)] = x_get((const char *)x + r * H * xs, xtype, i);
    int64_t G = H / MX_GROUP, D = I / MX_GROUP;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        int tid = TID(), nt = NT();
        int64_t a0, a1, i0, i1, h0, h1;
        share(2 * I, tid, nt, &a0, &a1);
        share(I, tid, nt, &i0, &i1);
        share(H, tid, nt, &h0, &h1);
        const float *X[MAX_ROWS];
        float t[MAX_ROWS];
        for (int64_t g = 0; g < groups; g++) {
            int64_t s0 = starts[g], m = starts[g + 1] - s0, e = routes[s0].id;
            for (int64_t j = 0; j < m; j++) X[j] = xp + routes[s0 + j].row * H;
            for (int64_t q = a0; q < a1; q++) {
                mx_rows(gu_blocks[e] + q * G * 16, gu_scales[e] + q * G, G, pow2, X, m, t);
                float b = bias_at(gu_bias[e], btype, q, xtype);
                for (int64_t j = 0; j < m; j++) gu[j * 2 * I + q] = as_x(as_x(t[j], xtype) + b, xtype);
            }
            if (nt > 1) { BARRIER(); } /* a thread's slice of I reads gate and up rows other threads computed */
            for (int64_t j = 0; j < m; j++)
                for (int64_t i = i0; i < i1; i++) {
                    float gate = gu[j * 2 * I + 2 * i], up = gu[j * 2 * I + 2 * i + 1];
                    gate = gate > limit ? limit : gate;
                    up = up > limit ? limit : up < -limit ? -limit : up;
                    float sg = as_x(sigmoid(as_x(gate * alpha, xtype)), xtype);
                    float glu = as_x(gate * sg, xtype);
                    hp[j * I + mx_pos(i)] = as_x(as_x(up + 1.0f, xtype) * glu, xtype);
                }
            if (nt > 1) { BARRIER(); } /* the down projection reads all of h */
            for (int64_t j = 0; j < m; j++) X[j] = hp + j * I;
            for (int64_t q = h0; q < h1; q++) {
                mx_rows(d_blocks[e] + q * D * 16, d_scales[e] + q * D, D, pow2, X, m, t);
                float b = bias_at(d_bias[e], btype, q, xtype);
                for (int64_t j = 0; j < m; j++) {
                    const route_t *rt = &routes[s0 + j];
                    float v = as_x(as_x(as_x(t[j], xtype) + b, xtype) * rt->w, xtype);
                    float *a = acc + rt->row * H;
                    a[q] = first[s0 + j] ? v : as_x(a[q] + v, xtype);
                }
            }
            if (nt > 1) { BARRIER(); } /* gu and h are reused by the next expert */
        }
        for (int64_t r = 0; r < R; r++)
            for (int64_t q = h0; q < h1; q++) x_set((char *)out + r * H * xs, xtype, q, acc[r * H + q]);
    }
    return 0;
}
