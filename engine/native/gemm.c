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
#include "gemm_kernels.h"

#define GEMM_MB 128 /* activation rows prepared at a time by gemm() */
#define GEMM_XB 128 /* activation rows packed at a time by gemm_tiles */
#define GEMM_NB 48  /* weight rows packed per panel: [48, 1024] f32 is 192 KB, in L2 while the rows pass over it */

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

/* The source offsets (elements) of accumulator chain q's chunks, in the order the one-row dot adds them; returns
 * their count. Float dots: chunk q of every 4 V, then (chain 0) the V-chunks after the last full 4 V, except the
 * even/odd dot, whose last 16-element block gives chains 0 and 1 one 8-chunk each. int8 dots: block b of 64 goes
 * to chain b % 4. */
static int64_t chain_offsets(int fam, int V, int64_t n, int q, int64_t *offs) {
    int64_t k = 0;
    if (fam == FAM_VNNI || fam == FAM_I8) {
        for (int64_t b = q; b < n / 64; b += 4) offs[k++] = 64 * b;
        return k;
    }
    int64_t main_end = n / (4 * V) * (4 * V);
    for (int64_t i = q * V; i < main_end; i += 4 * V) offs[k++] = i;
    if (fam == FAM_P256) {
        if (q < 2 && main_end + 16 <= n) offs[k++] = main_end + 8 * q;
    } else if (q == 0) {
        for (int64_t i = main_end; i + V <= n; i += V) offs[k++] = i;
    }
    return k;
}

static size_t up64(size_t n) { return (n + 63) / 64 * 64; }

/* Copies `total` chunks of cb bytes (32 or 64: a constant size, so each copy is a register move) in chain order. */
static void gather(char *dst, const char *src, const int64_t *offs, int64_t total, int esize, size_t cb) {
    if (cb == 64)
        for (int64_t k = 0; k < total; k++) memcpy(dst + k * 64, src + offs[k] * esize, 64);
    else
        for (int64_t k = 0; k < total; k++) memcpy(dst + k * 32, src + offs[k] * esize, 32);
}

/* A weight row in its tile family's packed form: chunks in chain order; f32 families widen (exactly) as they
 * pack, the even/odd family splits each 16 bf16 weights into even then odd f32 values, the VNNI family stores
 * w + 128. `stage`: n floats of scratch. */
static void pack_w(const tile_t *t, int wtype, const char *w, int64_t n, const int64_t *offs, int64_t total,
                   float *stage, char *dst) {
    const char *src = w;
    const uint16_t *h = (const uint16_t *)w;
    if ((t->fam == FAM_W512 || t->fam == FAM_W256) && wtype != W_F32) {
        if (wtype == W_BF16)
            for (int64_t i = 0; i < n; i++) stage[i] = bf16_to_f32(h[i]);
        else
            for (int64_t i = 0; i < n; i++) stage[i] = (float)((const int8_t *)w)[i];
        src = (const char *)stage;
    } else if (t->fam == FAM_P256) {
        for (int64_t i = 0; i + 16 <= n; i += 16)
            for (int j = 0; j < 8; j++) {
                stage[i + j] = bf16_to_f32(h[i + 2 * j]);
                stage[i + 8 + j] = bf16_to_f32(h[i + 2 * j + 1]);
            }
        src = (const char *)stage;
    }
    size_t cb = (size_t)t->V * (size_t)t->esize;
    gather(dst, src, offs, total, t->esize, cb);
    if (t->fam == FAM_VNNI)
        for (size_t b = 0; b < (size_t)total * cb; b++) dst[b] = (char)(dst[b] ^ 0x80);
}

/* An activation row's chunks in chain order, from the form its dot reads (and |x| beside them for FAM_I8). */
static void pack_x(const tile_t *t, const act_t *a, const int64_t *offs, int64_t total, char *dst, char *dsta) {
    const char *src = t->fam == FAM_P256                       ? (const char *)a->p
                      : t->fam == FAM_DPBF                     ? (const char *)a->b
                      : t->fam == FAM_VNNI || t->fam == FAM_I8 ? (const char *)a->q8
                                                               : (const char *)a->f;
    size_t cb = (size_t)t->V * (size_t)t->esize;
    gather(dst, src, offs, total, t->esize, cb);
    if (t->fam == FAM_I8) gather(dsta, (const char *)a->qa, offs, total, 1, cb);
}

/* This thread's packing buffer, grown as needed and kept (OpenMP's threads persist between calls). */
static _Thread_local char *tl_buf;
static _Thread_local size_t tl_cap;

static char *thread_buffer(size_t bytes) {
    if (bytes > tl_cap) {
        free(tl_buf);
        tl_cap = up64(bytes);
        tl_buf = (char *)aligned_alloc(64, tl_cap);
        if (tl_buf == NULL) tl_cap = 0;
    }
    return tl_buf;
}

/* The tiles over [j0, j0 + xb) x the panel [p0, p1), scaled into Y. */
static void panel(const ctx_t *k, const tile_t *t, const uint16_t *scale, int64_t p0, int64_t p1, int64_t j0,
                  int64_t xb, float *Y, int64_t ldy, int64_t y0) {
    float out[MAXR * TILE_LD];
    for (int64_t c = 0; c < p1 - p0; c += t->nr) {
        int nr = (int)(p1 - p0 - c < t->nr ? p1 - p0 - c : t->nr);
        for (int64_t j = 0; j < xb; j += t->mr) {
            int mr = (int)(xb - j < t->mr ? xb - j : t->mr);
            t->fn(k, c, j, out, mr, nr);
            for (int cc = 0; cc < nr; cc++) {
                float s = scale ? f16_to_f32(scale[p0 + c + cc]) : 1.0f;
                for (int r = 0; r < mr; r++) {
                    float v = out[r * TILE_LD + cc];
                    Y[(j0 + j + r) * ldy + p0 + c + cc - y0] = scale ? v * s : v;
                }
            }
        }
    }
}

void gemm_tiles(const void *W, const uint16_t *scale, int wtype, int64_t n, int64_t r0, int64_t r1, const act_t *X,
                int64_t m, float *Y, int64_t ldy, int64_t y0) {
    size_t ldw = (size_t)n * (wtype == W_F32 ? 4 : wtype == W_BF16 ? 2 : 1);
    tile_t t = pick_tile(X[0].mode, wtype);
    int64_t maxc = n / t.V + 8;
    size_t ld = up64((size_t)n * (size_t)t.esize + 64), stage = up64((size_t)n * 4), offb = up64((size_t)maxc * 8);
    char *buf = t.fn ? thread_buffer(stage + offb + ld * (2 * GEMM_XB + GEMM_NB)) : NULL;
    if (buf == NULL) {
        rows_by_dot((const char *)W, ldw, scale, wtype, n, r0, r1, X, m, Y, ldy, y0);
        return;
    }
    ctx_t k = {t.fam, t.V, wtype, n, n, {0}, {0}, buf, NULL, NULL, ld, ld, NULL, ldw, NULL};
    k.tail = t.fam == FAM_P256 ? n / 16 * 16 : t.fam == FAM_VNNI || t.fam == FAM_I8 ? n : n / t.V * t.V;
    int64_t *offs = (int64_t *)(buf + stage), total = 0;
    for (int q = 0; q < 4; q++) {
        k.pos[q] = total;
        k.cnt[q] = chain_offsets(t.fam, t.V, n, q, offs + total);
        total += k.cnt[q];
    }
    char *wpack = buf + stage + offb, *xpack = wpack + ld * GEMM_NB, *xa = xpack + ld * GEMM_XB;
    k.wp = wpack, k.xp = xpack, k.xa = xa;
    for (int64_t j0 = 0; j0 < m; j0 += GEMM_XB) {
        int64_t xb = m - j0 < GEMM_XB ? m - j0 : GEMM_XB;
        for (int64_t j = 0; j < xb; j++) pack_x(&t, &X[j0 + j], offs, total, xpack + j * ld, xa + j * ld);
        k.X = X + j0;
        for (int64_t p0 = r0; p0 < r1; p0 += GEMM_NB) {
            int64_t p1 = r1 - p0 < GEMM_NB ? r1 : p0 + GEMM_NB;
            for (int64_t c = p0; c < p1; c++)
                pack_w(&t, wtype, (const char *)W + (size_t)c * ldw, n, offs, total, (float *)buf, wpack + (c - p0) * ld);
            k.w = (const char *)W + (size_t)p0 * ldw;
            panel(&k, &t, scale, p0, p1, j0, xb, Y, ldy, y0);
        }
    }
}

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
            share(rows, TID(), NT(), &r0, &r1); /* cpu_gemv.c: blocks of 4 weight rows */
            gemm_tiles(W, scale, wtype, cols, r0, r1, acts, mb, yf, rows, 0);
            for (int64_t j = 0; j < mb; j++) {
                char *yr = (char *)Y + (m0 + j) * rows * xs;
                for (int64_t r = r0; r < r1; r++) x_set(yr, xtype, r, yf[j * rows + r]);
            }
        }
    }
    return 0;
}
