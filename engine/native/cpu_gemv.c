/* Weight-streaming kernels for decoding on the CPU: Y = X W^T for a few rows X, with W in f32, bf16
 * or int8 (one fp16 scale per row), and a fused SwiGLU MoE step for one token.
 *
 * Why: a decode step multiplies one (or a few) activation rows by every weight once, so it should
 * run at the speed the weights stream from memory. torch's single-row paths stream f32 at 9-12
 * GB/s but bf16 at 5-9 GB/s and weight-only int8 at about 5 GB/s on this project's machines (1
 * thread): widening each narrow weight to f32 costs more instructions than its bytes save.
 *
 * One source, several builds (engine/native/build.py compiles each variant with its own -march and
 * engine/native/loaded.py runs the widest one the CPU runs, engine/native/variants.py). The dot products
 * live in three headers (included by simd.h, which states the rule), each defining only what its instruction set
 * speeds up, the first definition winning:
 *  - simd_avx512.h: 16 f32 lanes; the AVX-512 BF16 dot (vdpbf16ps: exact products of two bf16
 *    operands, f32 sums) and the VNNI int8 dot (vpdpbusd) where the variant has them;
 *  - simd_avx2.h: 8 f32 lanes with FMA; bf16 weights split into even and odd elements in
 *    registers; int8 and int4 weights through vpmaddubsw;
 *  - simd_portable.h: plain C in eight independent lanes, which any compiler vectorises.
 * In a bf16 model (bf16 activations) int8 and int4 weights multiply the activation quantized to
 * int8 in blocks of 64, one f32 scale per block, as llama.cpp's Q8_0 dot product does with blocks
 * of 32 (about 0.4 % relative error per dot product on random data, on top of the weights' own
 * quantization); every variant computes those integer sums exactly. With an f32 activation (an f32
 * model) each weight is widened to f32 and multiplied in f32: exact products.
 * The fused MoE call runs all of a token's resident experts in one call: on small models the Python
 * and dispatch of five torch calls per expert cost more than the arithmetic.
 *
 * More than MAX_ROWS activation rows (a prompt) go to engine/native/gemm.c's register tiles, which give each row the
 * bits this file's one-row dot gives it.
 *
 * Called through ctypes (engine/native/kernels.py). Threads: OpenMP, at most `nthreads`, each owning
 * a contiguous range of output rows, so a result does not depend on the thread count.
 */
#include "simd.h"

size_t act_bytes(int64_t n) {
    size_t blocks = (size_t)((n + QBLOCK - 1) / QBLOCK), un = (size_t)n;
    return up64_(un * 4) * 2 + up64_(un * 2) + up64_(blocks * QBLOCK) * 2 + up64_(blocks * 8) + up64_(blocks * 4);
}

act_t act_at(char *mem, int64_t n) {
    size_t blocks = (size_t)((n + QBLOCK - 1) / QBLOCK), un = (size_t)n;
    act_t a;
    a.mode = DOT_WIDEN;
    a.f = (float *)mem;
    a.p = (float *)(mem += up64_(un * 4));
    a.b = (uint16_t *)(mem += up64_(un * 4));
    a.q8 = (int8_t *)(mem += up64_(un * 2));
    a.qa = (uint8_t *)(mem += up64_(blocks * QBLOCK));
    a.neg = (uint64_t *)(mem += up64_(blocks * QBLOCK));
    a.qs = (float *)(mem + up64_(blocks * 8));
    return a;
}


/* What this build can do, for engine/native/kernels.py to report: bit 0 AVX-512, bit 1 the AVX-512 BF16 dot,
 * bit 2 the VNNI int8 dot, bit 3 AVX2 with FMA. */
int capabilities(void) {
    int caps = 0;
#ifdef __AVX512F__
    caps |= 1;
#endif
#if defined(__AVX512BF16__)
    caps |= 2;
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    caps |= 4;
#endif
#if defined(__AVX2__) && defined(__FMA__)
    caps |= 8;
#endif
    return caps;
}

/* One block of QBLOCK (64) activations quantized to int8, bit for bit the scalar loop of act_prepare: the same
 * scale (the block's largest |x|, which any order finds, over 127), the same products x * (1 / s) and the same
 * rounding (cvtps2dq rounds to nearest even under the default MXCSR, as lrintf does), 16 at a time: the scalar
 * loop's libm calls per element took a tenth of an int8 prompt's time. */
#if defined(__AVX512F__)
static void quantize_block_avx512(const float *x, int8_t *q8, uint8_t *qa, uint64_t *neg, float *qs) {
    __m512 m = _mm512_setzero_ps();
    for (int j = 0; j < QBLOCK; j += 16) m = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + j)), m); /* a NaN: m, as fmaxf */
    float s = _mm512_reduce_max_ps(m) / 127.0f, inv = s > 0.0f ? 1.0f / s : 0.0f;
    uint64_t bits = 0;
    for (int j = 0; j < QBLOCK; j += 16) {
        __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + j), _mm512_set1_ps(inv)));
        _mm_storeu_si128((__m128i *)(q8 + j), _mm512_cvtepi32_epi8(q));
        _mm_storeu_si128((__m128i *)(qa + j), _mm512_cvtepi32_epi8(_mm512_abs_epi32(q)));
        bits |= (uint64_t)_mm512_cmplt_epi32_mask(q, _mm512_setzero_si512()) << j;
    }
    *neg = bits;
    *qs = s;
}
#endif

/* Chooses the dot product for weights of `wtype` and fills the activation's narrow form for it. The bf16 dot
 * of AVX-512 BF16 reads a bf16 activation and runs only where the activation is bf16 (it then carries 8
 * significant bits already, so the products are exact); the even/odd form of AVX2 holds f32 values and serves
 * any activation. The int8 dot runs only where the activation is bf16: its quantization loses about what bf16
 * rounding already did. An f32 activation (an f32 model) keeps exact products: each weight is widened to f32. */
void act_prepare(act_t *a, int64_t n, int wtype, int xtype) {
    a->mode = DOT_WIDEN;
    if (wtype == W_BF16 && BF16_FORM == BF16_FORM_BF16 && xtype == X_BF16) {
        a->mode = DOT_BF16;
        for (int64_t i = 0; i < n; i++) a->b[i] = f32_to_bf16(a->f[i]);
    }
    if (wtype == W_BF16 && BF16_FORM == BF16_FORM_PAIRS) {
        a->mode = DOT_BF16;
        for (int64_t i = 0; i + 16 <= n; i += 16)
            for (int t = 0; t < 8; t++) {
                a->p[i + t] = a->f[i + 2 * t];
                a->p[i + 8 + t] = a->f[i + 2 * t + 1];
            }
    }
    if (wtype == W_I8 && xtype == X_BF16 && n % QBLOCK == 0) {
        a->mode = DOT_I8;
        for (int64_t b = 0; b < n / QBLOCK; b++) {
            const float *x = a->f + b * QBLOCK;
#if defined(__AVX512F__)
            quantize_block_avx512(x, a->q8 + b * QBLOCK, a->qa + b * QBLOCK, a->neg + b, a->qs + b);
            continue;
#endif
            float inv, s = block_scale(x, QBLOCK, &inv);
            uint64_t neg = 0;
            for (int j = 0; j < QBLOCK; j++) {
                int q = (int)lrintf(x[j] * inv);
                a->q8[b * QBLOCK + j] = (int8_t)q;
                a->qa[b * QBLOCK + j] = (uint8_t)(q < 0 ? -q : q);
                if (q < 0) neg |= (uint64_t)1 << j;
            }
            a->neg[b] = neg;
            a->qs[b] = s;
        }
    }
}

/* Row w ([n] in `wtype`) dotted with activation a, by the dot product act_prepare chose. */
static float dot1(const void *w, int wtype, int64_t n, act_t a) {
    if (a.mode == DOT_BF16) return dot_bf16((const uint16_t *)w, n, a);
    if (a.mode == DOT_I8) return dot_i8((const int8_t *)w, n, a);
    return dot_widen(w, wtype, n, a.f);
}

/* dot1 of row w with each of X[0..m) (all prepared alike: one mode), into out[j]: bit for bit m dot1 calls, the
 * weight row read and converted once per block of rows. */
void dot_rows(const void *w, int wtype, int64_t n, const act_t *X, int64_t m, float *out) {
    if (X[0].mode == DOT_BF16) dot_bf16_rows((const uint16_t *)w, n, X, m, out);
    else if (X[0].mode == DOT_I8) dot_i8_rows((const int8_t *)w, n, X, m, out);
    else dot_widen_rows(w, wtype, n, X, m, out);
}

/* The rows [r0, r1) of Y[j] = W . X[j] for j in [0, m), times the int8 row scales if any, stored at
 * Y[j * ldy + r - y0]. Each weight row is read from memory once for all m activation rows (a decode
 * batch or a speculative window streams the weights once), and dot_rows loads and converts each of its
 * chunks once per block of rows. */
static void rows_range(const void *W, const uint16_t *scale, int wtype, int64_t n, int64_t r0, int64_t r1,
                       const act_t *X, int64_t m, float *Y, int64_t ldy, int64_t y0) {
    if (m > MAX_ROWS) { /* many rows (a prompt): gemm.c's register tiles, the same bits per row */
        gemm_tiles(W, scale, wtype, n, r0, r1, X, m, Y, ldy, y0);
        return;
    }
    size_t rb = (size_t)n * wsize(wtype);
    float t[MAX_ROWS];
    for (int64_t r = r0; r < r1; r++) {
        const void *w = (const char *)W + (size_t)r * rb;
        float s = scale ? f16_to_f32(scale[r]) : 1.0f;
        if (m == 1) t[0] = dot1(w, wtype, n, X[0]);
        else dot_rows(w, wtype, n, X, m, t);
        for (int64_t j = 0; j < m; j++) Y[j * ldy + r - y0] = scale ? t[j] * s : t[j];
    }
}

/* This thread's share of [0, rows), in blocks of 4 rows (moe_swiglu works through its share of the down projection 4 rows at a time). */
void share(int64_t rows, int tid, int nt, int64_t *r0, int64_t *r1) {
    int64_t blocks = (rows + 3) / 4, per = blocks / nt, extra = blocks % nt;
    int64_t b0 = tid * per + (tid < extra ? tid : extra), b1 = b0 + per + (tid < extra ? 1 : 0);
    *r0 = b0 * 4 < rows ? b0 * 4 : rows;
    *r1 = b1 * 4 < rows ? b1 * 4 : rows;
}

void load_act(const void *x, int xtype, int64_t n, float *out) {
    if (xtype == X_F32) {
        memcpy(out, x, (size_t)n * 4);
        return;
    }
    for (int64_t i = 0; i < n; i++) out[i] = bf16_to_f32(((const uint16_t *)x)[i]);
}

static void store_rows(const float *y, int xtype, int64_t r0, int64_t r1, void *out) {
    if (xtype == X_F32) {
        memcpy((float *)out + r0, y + r0, (size_t)(r1 - r0) * 4);
        return;
    }
    for (int64_t r = r0; r < r1; r++) ((uint16_t *)out)[r] = f32_to_bf16(y[r]);
}


/* Bytes of `work` that gemv needs. */
size_t gemv_work_bytes(int64_t rows, int64_t cols, int64_t m) {
    if (m > MAX_ROWS) return gemm_work_bytes(rows, cols, m);
    return (size_t)m * (act_bytes(cols) + (size_t)rows * 4) + 64;
}

/* Y[m][rows] = X[m][cols] W^T, W: [rows, cols] in `wtype` (int8: fp16 row scales), any m >= 1 (more than
 * MAX_ROWS rows: gemm.c's gemm, each row's bits the same). X and Y in `xtype`. Returns 0, or -1 when m < 1. */
int gemv(const void *W, const uint16_t *scale, int wtype, int64_t rows, int64_t cols,
         const void *X, int xtype, int64_t m, void *Y, void *work, int nthreads) {
    if (m < 1) return -1;
    if (m > MAX_ROWS) return gemm(W, scale, wtype, rows, cols, X, xtype, m, Y, work, nthreads);
    act_t acts[MAX_ROWS];
    char *mem = (char *)work;
    size_t xs = xtype == X_F32 ? 4 : 2;
    for (int64_t j = 0; j < m; j++, mem += act_bytes(cols)) {
        acts[j] = act_at(mem, cols);
        load_act((const char *)X + j * cols * xs, xtype, cols, acts[j].f);
        act_prepare(&acts[j], cols, wtype, xtype);
    }
    float *yf = (float *)mem;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        int64_t r0, r1;
        share(rows, TID(), NT(), &r0, &r1);
        rows_range(W, scale, wtype, cols, r0, r1, acts, m, yf, rows, 0);
        for (int64_t j = 0; j < m; j++) store_rows(yf + j * rows, xtype, r0, r1, (char *)Y + j * rows * xs);
    }
    return 0;
}


/* One row X through `count` weight matrices Ws[i] ([rows, cols] in `wtype`, no scales) one after another, Y
 * overwritten each time: the weight-streaming speed of gemv without a call's overhead per matrix, for the
 * measurement that picks a build (engine/native/autotune.py); a fused decode step pays no such overhead either. */
int gemv_sweep(const void *const *Ws, int64_t count, int wtype, int64_t rows, int64_t cols, const void *X, int xtype,
               void *Y, void *work, int nthreads) {
    for (int64_t i = 0; i < count; i++) {
        int rc = gemv(Ws[i], 0, wtype, rows, cols, X, xtype, 1, Y, work, nthreads);
        if (rc) return rc;
    }
    return 0;
}

/* Takes `bytes` (rounded up to 64) from the work buffer at *mem. */
static void *take(char **mem, size_t bytes) {
    void *p = *mem;
    *mem += up64_(bytes);
    return p;
}

/* The route tables of R rows with up to MAX_TOPK experts each (group_routes), from the work buffer. */
typedef struct {
    route_t *routes;
    int64_t *starts;
    int *first;
} route_tables_t;

static size_t route_bytes(int64_t R) {
    size_t n = (size_t)R * 64;
    return up64_(n * sizeof(route_t)) + up64_((n + 1) * 8) + up64_(n * sizeof(int));
}

static route_tables_t take_routes(char **mem, int64_t R) {
    size_t n = (size_t)R * 64;
    route_tables_t t;
    t.routes = (route_t *)take(mem, n * sizeof(route_t));
    t.starts = (int64_t *)take(mem, (n + 1) * 8);
    t.first = (int *)take(mem, n * sizeof(int));
    return t;
}

/* Whether a row names one expert twice (group_routes sorted them: such routes are adjacent). A group then has at
 * most R rows, which is what the buffers hold. */
static int repeats_an_expert(const route_t *routes, int64_t n) {
    for (int64_t i = 1; i < n; i++)
        if (routes[i].id == routes[i - 1].id && routes[i].row == routes[i - 1].row) return 1;
    return 0;
}

/* Bytes of `work` that moe_swiglu_rows needs for up to R rows. */
size_t moe_rows_work_bytes(int64_t H, int64_t I, int64_t R) {
    size_t rows = (size_t)R, many = R > MAX_ROWS ? up64_(rows * (size_t)H * 4) : 0;
    return route_bytes(R) + up64_(3 * rows * sizeof(act_t)) + rows * act_bytes(H) + rows * act_bytes(I) +
           up64_(rows * (size_t)(2 * I) * 4) + up64_(rows * (size_t)H * 4) + many + 64;
}

/* Bytes of `work` that moe_swiglu needs. */
size_t moe_work_bytes(int64_t H, int64_t I) { return moe_rows_work_bytes(H, I, 1); }

static int by_id_then_row(const void *a, const void *b) {
    const route_t *x = (const route_t *)a, *y = (const route_t *)b;
    if (x->id != y->id) return x->id < y->id ? -1 : 1;
    return x->row < y->row ? -1 : x->row > y->row;
}

/* R rows' k routes (ids[r*k + j], weights w[r*k + j]) sorted by expert then row into `routes`, grouped: group g
 * is routes[starts[g] .. starts[g+1]), one expert's; first[i] says whether route i is its row's first term.
 * Returns the number of groups, or -1 where memory for more than MAX_ROWS rows' marks ran out. k <= 64. */
int64_t group_routes(int64_t R, int64_t k, const int64_t *ids, const float *w, route_t *routes,
                            int64_t *starts, int *first) {
    int64_t n = R * k, groups = 0;
    int few[MAX_ROWS] = {0};
    int *seen = R <= MAX_ROWS ? few : (int *)calloc((size_t)R, sizeof(int));
    if (seen == NULL) return -1;
    for (int64_t i = 0; i < n; i++) { routes[i].id = ids[i]; routes[i].row = i / k; routes[i].w = w[i]; }
    qsort(routes, (size_t)n, sizeof(route_t), by_id_then_row);
    for (int64_t i = 0; i < n; i++) {
        if (i == 0 || routes[i].id != routes[i - 1].id) starts[groups++] = i;
        first[i] = !seen[routes[i].row];
        seen[routes[i].row] = 1;
    }
    starts[groups] = n;
    if (seen != few) free(seen);
    return groups;
}

/* The down projection of one expert's m rows over this thread's output slice [h0, h1), each row's result scaled by
 * its routing weight and added to its row's sum in acc (rounded as the bf16 reference rounds). Up to MAX_ROWS rows: 4
 * outputs at a time into t, as a decode step; more: all of the slice at once into dn ([m, H]), gemm's tiles. */
static void down_rows(int wtype, int64_t H, int64_t I, const void *dw, const uint16_t *ds, const act_t *ah, int64_t m,
                      const route_t *rt, const int *first, int64_t h0, int64_t h1, int xtype, float *dn, float *acc) {
    float t[4 * MAX_ROWS];
    int64_t step = m > MAX_ROWS ? h1 - h0 : 4;
    for (int64_t r = h0; r < h1; r += step) {
        int64_t nr = h1 - r < step ? h1 - r : step;
        float *y = m > MAX_ROWS ? dn : t;
        int64_t ld = m > MAX_ROWS ? H : 4, y0 = m > MAX_ROWS ? 0 : r;
        rows_range(dw, ds, wtype, I, r, r + nr, ah, m, y, ld, y0);
        for (int64_t j = 0; j < m; j++) {
            float *a = acc + rt[j].row * H;
            for (int64_t q = 0; q < nr; q++) {
                float v = as_x(as_x(y[j * ld + r + q - y0], xtype) * rt[j].w, xtype);
                a[r + q] = first[j] ? v : as_x(a[r + q] + v, xtype);
            }
        }
    }
}

/* R tokens (any R >= 1) through their k SwiGLU experts each: out[r] = sum over ids[r] ascending of
 * w[r][j] * down_e(silu(gate_e x[r]) * up_e x[r]). Expert e's weights: gate_up[e] [2I, H], then down[e] [H, I]
 * (int8: with fp16 row scales). The experts run one after another in ascending id, each on every row that
 * routes to it, so its weights are read once for all of them (each row's dot products are the ones a single
 * row gets: gemv's rows share the weight row, gemm's tiles the loads, not the sums). Each row's sum runs over its
 * experts in ascending id, as one row alone would: in a bf16 model every intermediate is rounded to bf16 where
 * transformers' bf16 reference rounds it (gate and up, the SwiGLU product, the expert output, its scaled value
 * and the running sum). x and out: [R, H] in `xtype`. Returns 0, or -1 for more than MAX_TOPK experts a row, one
 * expert named twice in a row, or no memory. */
int moe_swiglu_rows(int wtype, int64_t H, int64_t I, int64_t R, int64_t k, const int64_t *ids, const float *w,
                     const void *const *gate_up, const uint16_t *const *gu_scale, const void *const *down,
                     const uint16_t *const *down_scale, const void *x, int xtype, void *out, void *work, int nthreads) {
    if (R < 1 || k < 1 || k > MAX_TOPK) return -1;
    char *mem = (char *)work;
    route_tables_t rt = take_routes(&mem, R);
    int64_t groups = group_routes(R, k, ids, w, rt.routes, rt.starts, rt.first);
    if (groups < 0 || repeats_an_expert(rt.routes, R * k)) return -1;
    size_t xs = xtype == X_F32 ? 4 : 2;
    act_t *ax = (act_t *)take(&mem, 3 * (size_t)R * sizeof(act_t)), *ah = ax + R, *sub = ah + R;
    for (int64_t r = 0; r < R; r++, mem += act_bytes(H)) {
        ax[r] = act_at(mem, H);
        load_act((const char *)x + r * H * xs, xtype, H, ax[r].f);
        act_prepare(&ax[r], H, wtype, xtype);
    }
    for (int64_t r = 0; r < R; r++, mem += act_bytes(I)) ah[r] = act_at(mem, I);
    float *gu = (float *)take(&mem, (size_t)R * (size_t)(2 * I) * 4), *acc = (float *)take(&mem, (size_t)R * H * 4);
    float *dn = R > MAX_ROWS ? (float *)take(&mem, (size_t)R * H * 4) : NULL;
    /* A team of one skips the barriers: libgomp's barrier costs a team of one microseconds each, three an expert
     * (12 % of an 8-row decode step on the embedded model, one thread). */
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        int tid = TID(), nt = NT();
        int64_t a0, a1, i0, i1, h0, h1;
        share(2 * I, tid, nt, &a0, &a1);
        share(I, tid, nt, &i0, &i1);
        share(H, tid, nt, &h0, &h1);
        for (int64_t g = 0; g < groups; g++) {
            int64_t s0 = rt.starts[g], m = rt.starts[g + 1] - s0, e = rt.routes[s0].id;
            /* the expert's rows: a copy per thread for a few, one shared list (thread 0's) for many */
            act_t few[MAX_ROWS];
            const act_t *rows = m <= MAX_ROWS ? few : sub;
            if (m <= MAX_ROWS) {
                for (int64_t j = 0; j < m; j++) few[j] = ax[rt.routes[s0 + j].row];
            } else {
                if (tid == 0)
                    for (int64_t j = 0; j < m; j++) sub[j] = ax[rt.routes[s0 + j].row];
                if (nt > 1) { BARRIER(); }
            }
            rows_range(gate_up[e], gu_scale ? gu_scale[e] : 0, wtype, H, a0, a1, rows, m, gu, 2 * I, 0);
            if (nt > 1) { BARRIER(); } /* a thread's slice of I needs gate and up rows that other threads computed */
            for (int64_t j = 0; j < m; j++) {
                const float *gj = gu + j * 2 * I;
                for (int64_t i = i0; i < i1; i++)
                    ah[j].f[i] = as_x(as_x(silu(as_x(gj[i], xtype)), xtype) * as_x(gj[I + i], xtype), xtype);
            }
            if (nt > 1) {
                BARRIER(); /* the down projection reads all of h */
#pragma omp for schedule(static)
                for (int64_t j = 0; j < m; j++) act_prepare(&ah[j], I, wtype, xtype);
            } else {
                for (int64_t j = 0; j < m; j++) act_prepare(&ah[j], I, wtype, xtype);
            }
            down_rows(wtype, H, I, down[e], down_scale ? down_scale[e] : 0, ah, m, rt.routes + s0, rt.first + s0,
                      h0, h1, xtype, dn, acc);
            if (nt > 1) { BARRIER(); } /* gu and h are reused by the next expert */
        }
        for (int64_t r = 0; r < R; r++) store_rows(acc + r * H, xtype, h0, h1, (char *)out + r * H * xs);
    }
    return 0;
}

/* One token through m SwiGLU experts, expert j's weights at gate_up[j] and down[j], summed in the order given
 * (the caller passes ascending expert ids, transformers' order): moe_swiglu_rows for one row. Returns its status. */
int moe_swiglu(int wtype, int64_t H, int64_t I, int64_t m, const void *const *gate_up, const uint16_t *const *gu_scale,
                const void *const *down, const uint16_t *const *down_scale, const float *w,
                const void *x, int xtype, void *out, void *work, int nthreads) {
    int64_t ids[MAX_TOPK];
    if (m < 1 || m > MAX_TOPK) return -1;
    for (int64_t j = 0; j < m; j++) ids[j] = j;
    return moe_swiglu_rows(wtype, H, I, 1, m, ids, w, gate_up, gu_scale, down, down_scale, x, xtype, out, work, nthreads);
}

/* RMSNorm of `rows` rows of length n, as transformers' llama-style norms compute it:
 * y = w * to_dtype(x * rsqrt(mean(x^2) + eps)), the mean in f32. `wtype`: W_F32 or W_BF16 weight. */
void rmsnorm(const void *x, int xtype, int64_t rows, int64_t n, const void *w, int wtype, float eps, void *out) {
    size_t xs = xtype == X_F32 ? 4 : 2;
    for (int64_t r = 0; r < rows; r++) {
        const char *xr = (const char *)x + r * n * xs;
        char *orow = (char *)out + r * n * xs;
        double ss = 0.0; /* a double sum: the mean is exact to f32 whatever the order */
        for (int64_t i = 0; i < n; i++) {
            float v = xtype == X_F32 ? ((const float *)xr)[i] : bf16_to_f32(((const uint16_t *)xr)[i]);
            ss += (double)v * v;
        }
        float inv = 1.0f / sqrtf((float)(ss / (double)n) + eps);
        for (int64_t i = 0; i < n; i++) {
            float v = xtype == X_F32 ? ((const float *)xr)[i] : bf16_to_f32(((const uint16_t *)xr)[i]);
            float y = as_x(v * inv, xtype) * load1(w, wtype, i);
            if (xtype == X_F32) ((float *)orow)[i] = y;
            else ((uint16_t *)orow)[i] = f32_to_bf16(y);
        }
    }
}

/* ---- int4 weights (groups of 64, fp16 scale and zero each: w = s * (q - z), q in [0, 15]) ---------
 * Two codes a byte, low nibble first, so a group's 32 bytes hold its even elements in the low
 * nibbles and its odd elements in the high ones. The activation is quantized to int8 in the same
 * blocks of 64 and stored per block as [its 32 even elements | its 32 odd elements] (q4_slot), so one
 * vpdpbusd multiplies the unpacked [low nibbles | high nibbles] by it (codes are unsigned, the
 * activation signed, as the instruction wants). Per group and row:
 *   sum_i w_i x_i ~= s * xs * (sum_i q_i xq_i - z * sum_i xq_i)
 * with the second sum computed once per block of the activation. bf16 activations only (as the int8
 * path), and rows whose length is a multiple of 64; gemv_q4 returns -1 otherwise. */
size_t gemv_q4_work_bytes(int64_t rows, int64_t cols, int64_t m) {
    int64_t blocks = cols / Q4_GROUP;
    return (size_t)m * ((size_t)cols * 4 + (size_t)cols + (size_t)blocks * 8) + (size_t)m * rows * 4 + 256;
}

/* Where element j of group b goes in the quantized activation. Per group, its 32 even elements then its 32
 * odd ones: the order of the unpacked nibbles. A build whose q4_row reads two groups a register
 * (SIMD_Q4_PAIRED: 64 packed bytes give [even b | even b+1] and [odd b | odd b+1]) stores each full pair of
 * groups as [even b | even b+1 | odd b | odd b+1]; a last, unpaired group keeps the per-group order. */
static inline int64_t q4_slot(int64_t b, int j, int64_t groups) {
    int64_t half = j / 2 + (j % 2 ? Q4_GROUP / 2 : 0);
#if defined(SIMD_Q4_PAIRED)
    if ((b | 1) < groups) return (b & ~(int64_t)1) * Q4_GROUP + (j % 2 ? Q4_GROUP : 0) + (b & 1) * (Q4_GROUP / 2) + j / 2;
#else
    (void)groups;
#endif
    return b * Q4_GROUP + half;
}

static void q4_prepare(const float *x, int64_t n, int8_t *xq, float *xs, int32_t *xsum) {
    int64_t groups = n / Q4_GROUP;
    for (int64_t b = 0; b < groups; b++) {
        const float *xb = x + b * Q4_GROUP;
        float inv, s = block_scale(xb, Q4_GROUP, &inv);
        int32_t sum = 0;
        for (int j = 0; j < Q4_GROUP; j++) {
            int q = (int)lrintf(xb[j] * inv);
            sum += q;
            xq[q4_slot(b, j, groups)] = (int8_t)q;
        }
        xs[b] = s;
        xsum[b] = sum;
    }
}


/* Y[m][rows] = X[m][cols] W^T for int4 W (packed [rows, cols/2], scale and zero [rows, cols/64] fp16),
 * X and Y bf16, m <= MAX_ROWS. Returns 0, or -1 where this kernel does not apply (the caller dequantizes). */
int gemv_q4(const uint8_t *packed, const uint16_t *scale, const uint16_t *zero, int64_t rows, int64_t cols,
            const void *X, int xtype, int64_t m, void *Y, void *work, int nthreads) {
    if (m < 1 || m > MAX_ROWS || xtype != X_BF16 || cols % Q4_GROUP) return -1;
    int64_t blocks = cols / Q4_GROUP;
    char *mem = (char *)work;
    float *xf = (float *)mem;
    mem += (size_t)m * cols * 4;
    int8_t *xq = (int8_t *)mem;
    mem += (size_t)m * cols;
    mem = (char *)(((uintptr_t)mem + 7) & ~(uintptr_t)7);
    float *xs = (float *)mem;
    mem += (size_t)m * blocks * 4;
    int32_t *xsum = (int32_t *)mem;
    mem += (size_t)m * blocks * 4;
    float *yf = (float *)(((uintptr_t)mem + 63) & ~(uintptr_t)63);
    for (int64_t j = 0; j < m; j++) {
        load_act((const uint16_t *)X + j * cols, X_BF16, cols, xf + j * cols);
        q4_prepare(xf + j * cols, cols, xq + j * cols, xs + j * blocks, xsum + j * blocks);
    }
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        int64_t r0, r1;
        share(rows, TID(), NT(), &r0, &r1);
        for (int64_t r = r0; r < r1; r++) { /* rows are contiguous: one sequential stream per thread */
            const uint8_t *p = packed + (size_t)r * (cols / 2);
            for (int64_t j = 0; j < m; j++)
                yf[j * rows + r] = q4_row(p, scale + r * blocks, zero + r * blocks, cols, xq + j * cols, xs + j * blocks, xsum + j * blocks);
        }
        for (int64_t j = 0; j < m; j++) store_rows(yf + j * rows, X_BF16, r0, r1, (uint16_t *)Y + j * rows);
    }
    return 0;
}

/* One int4 row set's activation, quantized as q4_row reads it: per row, the codes [n] (even/odd order per
 * block), the block scales and the block sums of the codes [n / 64]. */
typedef struct { int8_t *q; float *s; int32_t *sum; } q4act_t;

static size_t q4act_bytes(int64_t n) { return up64_((size_t)n) + up64_((size_t)(n / Q4_GROUP) * 4) * 2; }

static q4act_t q4act_at(char *mem, int64_t n) {
    q4act_t a;
    a.q = (int8_t *)mem;
    a.s = (float *)(mem + up64_((size_t)n));
    a.sum = (int32_t *)(mem + up64_((size_t)n) + up64_((size_t)(n / Q4_GROUP) * 4));
    return a;
}

/* Bytes of `work` that moe_q4_rows needs. */
size_t moe_q4_work_bytes(int64_t H, int64_t I, int64_t R) {
    return route_bytes(R) + up64_(2 * (size_t)R * sizeof(q4act_t)) +
           (size_t)R * (q4act_bytes(H) + q4act_bytes(I) + (size_t)(2 * I + H + H + I) * 4) + 256;
}

/* moe_swiglu_rows for int4 experts (groups of 64, the format above; --expert-quant int4): R bf16 rows (any R >= 1)
 * through their k experts each, expert e's gate_up [2I, H] at gate_up[e] with scales gu_scale[e] and zeros
 * gu_zero[e] ([2I, H/64] fp16), down [H, I] likewise. The same arithmetic as two gemv_q4 calls an expert with
 * the SwiGLU between them rounded as torch rounds it in bf16 (gate and up, silu, the product, the expert's
 * output), then each expert's output times its routing weight summed in ascending id, as moe_swiglu_rows does:
 * one call for a layer's experts, each row's activation quantized once for all of them, each expert's weights
 * read once for every row routed to it. Each row's result is the one it gets alone. H and I multiples of 64.
 * Returns 0, or -1 for a shape it does not take, more than MAX_TOPK experts a row or one named twice. */
int moe_q4_rows(int64_t H, int64_t I, int64_t R, int64_t k, const int64_t *ids, const float *w,
                const uint8_t *const *gate_up, const uint16_t *const *gu_scale, const uint16_t *const *gu_zero,
                const uint8_t *const *down, const uint16_t *const *d_scale, const uint16_t *const *d_zero,
                const void *x, int xtype, void *out, void *work, int nthreads) {
    if (R < 1 || k < 1 || k > MAX_TOPK || xtype != X_BF16 || H % Q4_GROUP || I % Q4_GROUP) return -1;
    char *mem = (char *)(((uintptr_t)work + 63) & ~(uintptr_t)63);
    route_tables_t tables = take_routes(&mem, R);
    route_t *routes = tables.routes;
    int64_t *starts = tables.starts;
    int *first = tables.first;
    int64_t groups = group_routes(R, k, ids, w, routes, starts, first);
    if (groups < 0 || repeats_an_expert(routes, R * k)) return -1;
    q4act_t *ax = (q4act_t *)take(&mem, 2 * (size_t)R * sizeof(q4act_t)), *ah = ax + R;
    for (int64_t r = 0; r < R; r++, mem += q4act_bytes(H)) ax[r] = q4act_at(mem, H);
    for (int64_t r = 0; r < R; r++, mem += q4act_bytes(I)) ah[r] = q4act_at(mem, I);
    float *gu = (float *)mem, *acc = gu + R * 2 * I, *xf = acc + R * H, *hf = xf + R * H;
    for (int64_t r = 0; r < R; r++) {
        load_act((const uint16_t *)x + r * H, X_BF16, H, xf + r * H);
        q4_prepare(xf + r * H, H, ax[r].q, ax[r].s, ax[r].sum);
    }
    int64_t gb = H / Q4_GROUP, db = I / Q4_GROUP;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        int tid = TID(), nt = NT();
        int64_t a0, a1, i0, i1, h0, h1;
        share(2 * I, tid, nt, &a0, &a1);
        share(I, tid, nt, &i0, &i1);
        share(H, tid, nt, &h0, &h1);
        for (int64_t g = 0; g < groups; g++) {
            int64_t s0 = starts[g], m = starts[g + 1] - s0, e = routes[s0].id;
            for (int64_t q = a0; q < a1; q++) {
                const uint8_t *p = gate_up[e] + (size_t)q * (H / 2);
                for (int64_t j = 0; j < m; j++) {
                    q4act_t a = ax[routes[s0 + j].row];
                    gu[j * 2 * I + q] = q4_row(p, gu_scale[e] + q * gb, gu_zero[e] + q * gb, H, a.q, a.s, a.sum);
                }
            }
            BARRIER(); /* a thread's slice of I needs gate and up rows that other threads computed */
            for (int64_t j = 0; j < m; j++) {
                const float *gj = gu + j * 2 * I;
                for (int64_t i = i0; i < i1; i++)
                    hf[j * I + i] = as_x(as_x(silu(as_x(gj[i], X_BF16)), X_BF16) * as_x(gj[I + i], X_BF16), X_BF16);
            }
            BARRIER(); /* the down projection reads all of h */
#pragma omp for schedule(static)
            for (int64_t j = 0; j < m; j++) q4_prepare(hf + j * I, I, ah[j].q, ah[j].s, ah[j].sum);
            for (int64_t q = h0; q < h1; q++) {
                const uint8_t *p = down[e] + (size_t)q * (I / 2);
                for (int64_t j = 0; j < m; j++) {
                    const route_t *rt = &routes[s0 + j];
                    float t = q4_row(p, d_scale[e] + q * db, d_zero[e] + q * db, I, ah[j].q, ah[j].s, ah[j].sum);
                    float v = as_x(as_x(t, X_BF16) * rt->w, X_BF16);
                    float *a = acc + rt->row * H;
                    a[q] = first[s0 + j] ? v : as_x(a[q] + v, X_BF16);
                }
            }
            BARRIER(); /* gu and h are reused by the next expert */
        }
        for (int64_t r = 0; r < R; r++) store_rows(acc + r * H, X_BF16, h0, h1, (uint16_t *)out + r * H);
    }
    return 0;
}

/* ---- rotary position embedding ----------------------------------------------------------------
 * In place, as transformers' apply_rotary_pos_emb with rotate_half computes it: x is [rows, heads, d]
 * and row r takes cos/sin row r ([rows, rot], x's dtype); the first `rot` dims of each head turn,
 * the rest pass through (glm4_moe's partial rotary). With h = rot / 2:
 *   y_i = x_i c_i - x_{i+h} s_i  (i < h),   y_i = x_i c_i + x_{i-h} s_i  (h <= i < rot)
 * Each product and the sum is rounded to the activation dtype, as torch's elementwise ops round
 * them (this file is built as ISO C, so the compiler does not fuse them into an FMA). */
void rope(void *x, int xtype, int64_t rows, int64_t heads, int64_t d, int64_t rot, const void *cos, const void *sin) {
    int64_t h = rot / 2;
    float tmp[1024];
    if (rot > 1024 || rot > d) return;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t hd = 0; hd < heads; hd++) {
            int64_t base = (r * heads + hd) * d;
            for (int64_t i = 0; i < rot; i++)
                tmp[i] = xtype == X_F32 ? ((float *)x)[base + i] : bf16_to_f32(((uint16_t *)x)[base + i]);
            for (int64_t i = 0; i < rot; i++) {
                float c = xtype == X_F32 ? ((const float *)cos)[r * rot + i] : bf16_to_f32(((const uint16_t *)cos)[r * rot + i]);
                float s = xtype == X_F32 ? ((const float *)sin)[r * rot + i] : bf16_to_f32(((const uint16_t *)sin)[r * rot + i]);
                float other = i < h ? -tmp[i + h] : tmp[i - h];
                float y = as_x(as_x(tmp[i] * c, xtype) + as_x(other * s, xtype), xtype);
                if (xtype == X_F32) ((float *)x)[base + i] = y;
                else ((uint16_t *)x)[base + i] = f32_to_bf16(y);
            }
        }
    }
}

/* The k largest of v[0..n) in descending order, ties to the lower index (as torch.topk returns them): their
 * indices into ids. n <= 4096. */
void topk_desc(const float *v, int64_t n, int64_t k, int64_t *ids) {
    unsigned char taken[4096];
    memset(taken, 0, (size_t)n);
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < n; e++)
            if (!taken[e] && (best < 0 || v[e] > v[best])) best = e;
        taken[best] = 1;
        ids[j] = best;
    }
}

/* ---- a softmax top-k router, for one token ----------------------------------------------------
 * What transformers' Qwen2/Qwen3/OLMoE TopKRouter computes for one row: logits = W . x (rounded to
 * x's dtype, as F.linear returns them), p = softmax(logits) in f32, the k largest p (descending; ties
 * to the lower expert id, as torch.topk returns them), divided by their sum when `norm`, then rounded
 * to x's dtype. Outputs: logits [E] in x's dtype, weights [k] in x's dtype, ids [k]. The sums run in
 * another order than torch's vectorized reductions, so p may differ from torch's in the last bit;
 * the caller checks its first result against the router's own forward. Returns gemv's status. */
int router_topk(const void *W, int wtype, int64_t E, int64_t H, const void *x, int xtype, int64_t k, int norm,
                void *logits, void *weights, int64_t *ids, void *work, int nthreads) {
    if (k < 1 || k > E || E > 4096) return -1;
    int rc = gemv(W, 0, wtype, E, H, x, xtype, 1, logits, work, nthreads);
    if (rc != 0) return rc;
    float p[4096];
    float mx = -INFINITY;
    for (int64_t e = 0; e < E; e++) {
        p[e] = xtype == X_F32 ? ((const float *)logits)[e] : bf16_to_f32(((const uint16_t *)logits)[e]);
        if (p[e] > mx) mx = p[e];
    }
    float sum = 0.0f;
    for (int64_t e = 0; e < E; e++) { p[e] = expf(p[e] - mx); sum += p[e]; }
    for (int64_t e = 0; e < E; e++) p[e] = p[e] / sum;
    float top[4096];
    float tsum = 0.0f;
    topk_desc(p, E, k, ids);
    for (int64_t j = 0; j < k; j++) {
        top[j] = p[ids[j]];
        tsum += top[j];
    }
    for (int64_t j = 0; j < k; j++) {
        float v = norm ? top[j] / tsum : top[j];
        if (xtype == X_F32) ((float *)weights)[j] = v;
        else ((uint16_t *)weights)[j] = f32_to_bf16(v);
    }
    return 0;
}

/* A decode step's per-head q and k norms, then their rotary embedding, in place, in one call: the
 * same arithmetic as rmsnorm (weights qw, kw: [d]; NULL: no norms) followed by rope (rot = 0: none),
 * with q [rows, hq, d] and k [rows, hk, d]. */
void qk_norm_rope(void *q, void *k, int xtype, int64_t rows, int64_t hq, int64_t hk, int64_t d, const void *qw,
                  const void *kw, int wtype, float q_eps, float k_eps, int64_t rot, const void *cos, const void *sin) {
    if (qw != NULL) {
        rmsnorm(q, xtype, rows * hq, d, qw, wtype, q_eps, q); /* row by row: each row is read before it is written */
        rmsnorm(k, xtype, rows * hk, d, kw, wtype, k_eps, k);
    }
    if (rot > 0) {
        rope(q, xtype, rows, hq, d, rot, cos, sin);
        rope(k, xtype, rows, hk, d, rot, cos, sin);
    }
}

/* A residual add and the next RMSNorm in one call: sum = x + a (rounded to the activation dtype, as
 * torch's add rounds it), then rmsnorm(sum) into `normed`, the same arithmetic as the two apart. */
void add_rmsnorm(const void *x, const void *a, int xtype, int64_t rows, int64_t n, const void *w, int wtype, float eps,
                 void *sum, void *normed) {
    int64_t total = rows * n;
    for (int64_t i = 0; i < total; i++) {
        if (xtype == X_F32) ((float *)sum)[i] = ((const float *)x)[i] + ((const float *)a)[i];
        else ((uint16_t *)sum)[i] = f32_to_bf16(bf16_to_f32(((const uint16_t *)x)[i]) + bf16_to_f32(((const uint16_t *)a)[i]));
    }
    rmsnorm(sum, xtype, rows, n, w, wtype, eps, normed);
}

/* A step's new keys and values written into a KV cache in place (engine/worker/kv_cache.py, kv_pool.py):
 * rows [heads, n, d] of k and v (any head and position strides, in elements; d contiguous) go to
 * positions at..at+n-1 of the cache's blocks (cpu_gemv.h kv_row). Plain copies of `elem`-byte values: one call for
 * what would be two torch copies and their dispatch. */
void kv_append(void *kbuf, void *vbuf, const void *k, const void *v, int64_t heads, int64_t n, int64_t d,
               const int64_t *blocks, int64_t bs, int64_t at, int64_t k_head, int64_t k_pos, int64_t v_head,
               int64_t v_pos, int64_t elem) {
    size_t row = (size_t)(d * elem);
    for (int64_t h = 0; h < heads; h++)
        for (int64_t i = 0; i < n; i++) {
            size_t dst = (size_t)kv_row(blocks, bs, heads, h, at + i) * row;
            memcpy((char *)kbuf + dst, (const char *)k + (size_t)((h * k_head + i * k_pos) * elem), row);
            memcpy((char *)vbuf + dst, (const char *)v + (size_t)((h * v_head + i * v_pos) * elem), row);
        }
}
