/* Y = X W^T for any number of activation rows: the many-row (prompt, prefill) path of the native kernels, with
 * every row's result bit for bit what cpu_gemv.c's one-row dot product gives that row alone.
 *
 * Why bitwise: the engine's promise is that a row computes the same whatever other rows share its call (a decode
 * row, a speculative window, a prompt chunk, another request's rows). A row's dot product is a fixed set of
 * accumulator chains (the one-row dot's vector accumulators, each summing its chunks of K in order), then a fixed
 * final sum and tail. The tiles here (gemm_kernels.h) run exactly those chains for several activation rows and
 * several weight rows at once, sharing each load among them: one accumulator chain of the tile at a time (a
 * "pass" over K, the other chains' partial sums kept in memory, which changes no value), so a tile of 4 x 6
 * outputs fits the registers. Blocking: weight rows in panels that stay in L2 while all activation rows of a chunk
 * pass over them; activation rows in chunks of GEMM_MB (gemm) whose activation forms (act_prepare: the bf16 copy,
 * the even/odd pairs, the int8 blocks) are made once per row. Threads split the weight rows, so a result does not
 * depend on the thread count either.
 *
 * A build whose dot product has no tile here (the portable build) runs dot_rows per weight row: the same bits,
 * without the register blocking.
 */
#include <stdlib.h>
#include "cpu_gemv.h"
#ifdef _OPENMP
#include <omp.h>
#define TID() omp_get_thread_num()
#define NT() omp_get_num_threads()
#else
#define TID() 0
#define NT() 1
#endif

#define GEMM_MB 128 /* activation rows prepared and multiplied at a time by gemm() */
#define GEMM_NB 48  /* weight rows per panel: a panel of [48, 1024] f32 is 192 KB, in L2 while the rows pass */
#define GEMV_ROWS 16 /* cpu_gemv.c's MAX_ROWS: gemv() hands more rows than this to gemm() */

/* A tile: out[r * TILE_LD + c] = the one-row dot of weight row c (at w + c * ldw) with X[r], r < mr, c < nr. */
#define TILE_LD 8
typedef void (*tile_fn)(const char *w, size_t ldw, const act_t *X, int64_t n, float *out, int mr, int nr);
typedef struct {
    tile_fn fn;
    int mr, nr; /* the full tile's shape */
} tile_t;

#include "gemm_kernels.h"

/* One weight row at a time through dot_rows, 16 activation rows a call: for a dot product without a tile. */
static void rows_by_dot(const char *W, size_t ldw, const uint16_t *scale, int wtype, int64_t n, int64_t r0,
                        int64_t r1, const act_t *X, int64_t m, float *Y, int64_t ldy, int64_t y0) {
    float t[16];
    for (int64_t r = r0; r < r1; r++) {
        float s = scale ? f16_to_f32(scale[r]) : 1.0f;
        for (int64_t j0 = 0; j0 < m; j0 += 16) {
            int64_t mj = m - j0 < 16 ? m - j0 : 16;
            dot_rows(W + (size_t)r * ldw, wtype, n, X + j0, mj, t);
            for (int64_t j = 0; j < mj; j++) Y[(j0 + j) * ldy + r - y0] = scale ? t[j] * s : t[j];
        }
    }
}

void gemm_tiles(const void *W, const uint16_t *scale, int wtype, int64_t n, int64_t r0, int64_t r1, const act_t *X,
                int64_t m, float *Y, int64_t ldy, int64_t y0) {
    size_t ldw = (size_t)n * (wtype == W_F32 ? 4 : wtype == W_BF16 ? 2 : 1);
    tile_t tile = pick_tile(X[0].mode, wtype);
    if (tile.fn == NULL) {
        rows_by_dot((const char *)W, ldw, scale, wtype, n, r0, r1, X, m, Y, ldy, y0);
        return;
    }
    float out[8 * TILE_LD];
    for (int64_t p0 = r0; p0 < r1; p0 += GEMM_NB) {
        int64_t p1 = r1 - p0 < GEMM_NB ? r1 : p0 + GEMM_NB;
        for (int64_t j0 = 0; j0 < m; j0 += tile.mr) {
            int mr = (int)(m - j0 < tile.mr ? m - j0 : tile.mr);
            for (int64_t c0 = p0; c0 < p1; c0 += tile.nr) {
                int nr = (int)(p1 - c0 < tile.nr ? p1 - c0 : tile.nr);
                tile.fn((const char *)W + (size_t)c0 * ldw, ldw, X + j0, n, out, mr, nr);
                for (int c = 0; c < nr; c++) {
                    float s = scale ? f16_to_f32(scale[c0 + c]) : 1.0f;
                    for (int r = 0; r < mr; r++) {
                        float v = out[r * TILE_LD + c];
                        Y[(j0 + r) * ldy + c0 + c - y0] = scale ? v * s : v;
                    }
                }
            }
        }
    }
}

/* This thread's share of [0, rows), in blocks of 8 weight rows. */
static void share8(int64_t rows, int tid, int nt, int64_t *r0, int64_t *r1) {
    int64_t blocks = (rows + 7) / 8, per = blocks / nt, extra = blocks % nt;
    int64_t b0 = tid * per + (tid < extra ? tid : extra), b1 = b0 + per + (tid < extra ? 1 : 0);
    *r0 = b0 * 8 < rows ? b0 * 8 : rows;
    *r1 = b1 * 8 < rows ? b1 * 8 : rows;
}

static size_t up64(size_t n) { return (n + 63) / 64 * 64; }

/* Bytes of `work` that gemm needs. */
size_t gemm_work_bytes(int64_t rows, int64_t cols, int64_t m) {
    size_t mb = (size_t)(m < GEMM_MB ? m : GEMM_MB);
    return up64(mb * sizeof(act_t)) + mb * (act_bytes(cols) + up64((size_t)rows * 4)) + 64;
}

/* Y[m][rows] = X[m][cols] W^T, W: [rows, cols] in `wtype` (int8: fp16 row scales), any m >= 1; X and Y in `xtype`.
 * Row j of Y is bit for bit what gemv gives row j alone. Returns 0, or -1 when m < 1. */
int gemm(const void *W, const uint16_t *scale, int wtype, int64_t rows, int64_t cols, const void *X, int xtype,
         int64_t m, void *Y, void *work, int nthreads) {
    if (m < 1) return -1;
    size_t xs = xtype == X_F32 ? 4 : 2;
    char *base = (char *)(((uintptr_t)work + 63) & ~(uintptr_t)63);
    act_t *acts = (act_t *)base;
    char *mem = base + up64((size_t)(m < GEMM_MB ? m : GEMM_MB) * sizeof(act_t));
    for (int64_t m0 = 0; m0 < m; m0 += GEMM_MB) {
        int64_t mb = m - m0 < GEMM_MB ? m - m0 : GEMM_MB;
        char *at = mem;
        for (int64_t j = 0; j < mb; j++, at += act_bytes(cols)) {
            acts[j] = act_at(at, cols);
            load_act((const char *)X + (m0 + j) * cols * xs, xtype, cols, acts[j].f);
            act_prepare(&acts[j], cols, wtype, xtype);
        }
        float *yf = (float *)at;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
        {
            int64_t r0, r1;
            share8(rows, TID(), NT(), &r0, &r1);
            gemm_tiles(W, scale, wtype, cols, r0, r1, acts, mb, yf, rows, 0);
            for (int64_t j = 0; j < mb; j++) {
                char *yr = (char *)Y + (m0 + j) * rows * xs;
                for (int64_t r = r0; r < r1; r++) x_set(yr, xtype, r, yf[j * rows + r]);
            }
        }
    }
    return 0;
}
