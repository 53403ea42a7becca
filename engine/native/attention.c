/* Attention on the CPU, after the q/k/v projections: a decode row (decode_attention) and any number of
 * consecutive rows of one sequence (attention_rows: a verification window, a prompt chunk), each row with the bits
 * it gets decoded alone. Called through ctypes (engine/native/row_ops.py) and by decode_layer.c. */
#include "simd.h"

/* The f32 queries of KV head g's query heads for rows r0..r0 + nb - 1 (q rows qd bytes apart), into qf [nb * group, d]. */
static void load_rows_q(const void *q, int wt, int64_t nb, int64_t group, int64_t d, int64_t g, int64_t r0, size_t qd,
                        float *qf) {
    for (int64_t b = 0; b < nb; b++)
        for (int64_t a = 0; a < group; a++)
            for (int64_t i = 0; i < d; i++)
                qf[(b * group + a) * d + i] = load1((const char *)q + (r0 + b) * qd, wt, (g * group + a) * d + i);
}

/* Those rows' outputs: each weighted sum acc [nb * group, d] times 1 / its softmax sum, in x's dtype, to out. */
static void store_rows_out(const float *acc, const float *inv, int xtype, int64_t nb, int64_t group, int64_t d,
                           int64_t g, void *out, int64_t r0, size_t qd) {
    for (int64_t b = 0; b < nb; b++)
        for (int64_t a = 0; a < group; a++)
            for (int64_t i = 0; i < d; i++) {
                float y = acc[(b * group + a) * d + i] * inv[b * group + a];
                int64_t o = (g * group + a) * d + i;
                char *orow = (char *)out + (r0 + b) * qd;
                if (xtype == X_F32) ((float *)orow)[o] = y;
                else ((uint16_t *)orow)[o] = f32_to_bf16(y);
            }
}

/* The softmax of `count` score rows in place, row r at scores + r * stride with lens[r] scores: each row shifted by its
 * maximum and exponentiated (exp_inplace), and 1 / the sum of its exponentials in inv[r]. Each row's sum runs over its
 * scores in key order, one addition after another (the decode row's order); up to eight rows' sums run side by side,
 * which changes no row's bits, only how many additions are in flight. */
#define SUM_ROWS 8
static void softmax_rows(float *scores, int64_t stride, const int64_t *lens, int64_t count, float *inv) {
    for (int64_t r = 0; r < count; r++) {
        float *sc = scores + r * stride, mx = row_max(sc, lens[r]);
        for (int64_t j = 0; j < lens[r]; j++) sc[j] -= mx;
        exp_inplace(sc, lens[r]);
    }
    for (int64_t r0 = 0; r0 < count; r0 += SUM_ROWS) {
        int64_t m = count - r0 < SUM_ROWS ? count - r0 : SUM_ROWS, common = lens[r0];
        float sum[SUM_ROWS] = {0};
        for (int64_t t = 1; t < m; t++) common = lens[r0 + t] < common ? lens[r0 + t] : common;
        for (int64_t j = 0; j < common; j++)
            for (int64_t t = 0; t < m; t++) sum[t] += scores[(r0 + t) * stride + j];
        for (int64_t t = 0; t < m; t++) {
            for (int64_t j = common; j < lens[r0 + t]; j++) sum[t] += scores[(r0 + t) * stride + j];
            inv[r0 + t] = 1.0f / sum[t];
        }
    }
}

/* ---- a decode row's attention, after its q/k/v projections --------------------------------------
 * What engine/worker/lean_forward.py does between the projections and o_proj for one new row of one
 * sequence, in one call: the per-head q/k RMSNorms (qw, kw; NULL: none, as in Qwen2-MoE), the rotary
 * embedding (rot = 0: none), the new key and value written at position `at` of the cache buffers
 * (cpu_gemv.h kv_row: a contiguous buffer or a paged pool's blocks), then softmax(scale * q K^T) V over positions 0..at for
 * each query head, query head i reading KV head i / (hq / hk) (grouped-query attention, as SDPA's
 * enable_gqa). q [hq, d], k and v [hk, d] contiguous, in x's dtype; q and k are normed and rotated
 * in place; out [hq, d] in x's dtype. Scores, softmax and the weighted sum are computed in f32 (as
 * SDPA's CPU kernels accumulate) but in another order, so `out` may differ from SDPA's in the last
 * bits. work: (hq / hk) * (at + 1 + 2 d) floats; at most 64 query heads per KV head, d <= 1024. */
void decode_attention(void *q, void *k, const void *v, int xtype, int64_t hq, int64_t hk, int64_t d, const void *qw,
                      const void *kw, int wtype, float q_eps, float k_eps, int64_t rot, const void *cos, const void *sin,
                      void *kbuf, void *vbuf, const int64_t *blocks, int64_t bs, int64_t at, float scale, void *out,
                      float *work) {
    size_t xs = xtype == X_F32 ? 4 : 2, row = (size_t)d * xs;
    qk_norm_rope(q, k, xtype, 1, hq, hk, d, qw, kw, wtype, q_eps, k_eps, rot, cos, sin);
    kv_append(kbuf, vbuf, k, v, hk, 1, d, blocks, bs, at, d, d, d, d, (int64_t)xs); /* k, v: [hk, d], one position */
    /* The query heads of one KV head together: each cached row is read once for all of them. */
    int64_t len = at + 1, group = hq / hk;
    int wt = xtype == X_F32 ? W_F32 : W_BF16;
    if (group > MAX_HEAD_GROUP || group * hk != hq) return; /* the caller checks: never reached */
    float *scores = work, *qf = work + group * len, *acc = qf + group * d; /* [group, len], [group, d], [group, d] */
    for (int64_t g = 0; g < hk; g++) {
        for (int64_t a = 0; a < group; a++)
            for (int64_t i = 0; i < d; i++)
                qf[a * d + i] = load1(q, wt, (g * group + a) * d + i);
        for (int64_t j = 0; j < len; j++) {
            const char *kr = (const char *)kbuf + (size_t)kv_row(blocks, bs, hk, g, j) * row;
            for (int64_t a = 0; a < group; a++) scores[a * len + j] = dot_row(qf + a * d, kr, wt, d) * scale;
        }
        float inv[MAX_HEAD_GROUP];
        int64_t lens[MAX_HEAD_GROUP];
        for (int64_t a = 0; a < group; a++) lens[a] = len;
        softmax_rows(scores, len, lens, group, inv);
        for (int64_t i = 0; i < group * d; i++) acc[i] = 0.0f;
        for (int64_t j = 0; j < len; j++) {
            const char *vr = (const char *)vbuf + (size_t)kv_row(blocks, bs, hk, g, j) * row;
            for (int64_t a = 0; a < group; a++) {
                axpy_row(acc + a * d, scores[a * len + j], vr, wt, d);
            }
        }
        for (int64_t a = 0; a < group; a++)
            for (int64_t i = 0; i < d; i++) {
                float y = acc[a * d + i] * inv[a];
                int64_t o = (g * group + a) * d + i;
                if (xtype == X_F32) ((float *)out)[o] = y;
                else ((uint16_t *)out)[o] = f32_to_bf16(y);
            }
    }
}

/* T consecutive rows of one sequence attend as decode_attention attends each of them alone: row r's q and k are
 * normed and rotated, its key and value go to position at + r, and it attends to positions 0..at + r with the same
 * sums in the same order (scores, max, exp_inplace over its own length, the sum, the weighted values in key order),
 * so a prompt's rows, a verification window's and a decode row each give the bits of that row decoded alone. What
 * the blocking changes is only memory traffic: ATT_ROWS rows share each key and value row's load. q [T, hq, d], k and
 * v [T, hk, d] (q and k in place), cos/sin [T, rot] (NULL when rot is 0), out [T, hq, d]: contiguous, in x's
 * dtype; the KV cache's blocks (kv_row) have room for at + T positions. work: attention_rows_work_floats(). */
#define ATT_ROWS 16
#define KEY_TILE 16
static int64_t up16(int64_t n) { return (n + KEY_TILE - 1) / KEY_TILE * KEY_TILE; }

/* Whether T rows of head size d take the key tiles (a prompt chunk, in a build that has them): the same bits either way. */
static int key_tiled(int64_t T, int64_t d) {
#ifdef SIMD_HAVE_KEY_TILE
    return T >= ATT_ROWS && d % KEY_TILE == 0;
#else
    (void)T, (void)d;
    return 0;
#endif
}

int64_t attention_rows_work_floats(int64_t T, int64_t hq, int64_t hk, int64_t d, int64_t at) {
    /* scores (each row's span rounded up to whole key tiles), q and the weighted values of a block of rows; the tiled
     * path adds a head's keys transposed and its values in f32 */
    int64_t tiles = key_tiled(T, d) ? 2 * up16(at + T) * d : 0;
    return ATT_ROWS * (hq / hk) * (up16(at + T) + 2 * d) + tiles + 64;
}

/* softmax_rows for a block of nb consecutive rows, each with `group` query heads: row b attends to its first
 * first_len + b keys; row b's scores are at scores + (b * group + a) * span. */
static void softmax_block(float *scores, int64_t span, int64_t first_len, int64_t nb, int64_t group, float *inv) {
    int64_t lens[ATT_ROWS * 64];
    for (int64_t b = 0; b < nb; b++)
        for (int64_t a = 0; a < group; a++) lens[b * group + a] = first_len + b;
    softmax_rows(scores, span, lens, nb * group, inv);
}

#ifdef SIMD_HAVE_KEY_TILE
/* attention_rows' attention (after the norms, rotary and KV append) for many rows, in key tiles: per KV head the
 * keys 0..at + T - 1 are transposed to f32 once (dot_keys16) and the values widened to f32 once, then each block of
 * ATT_ROWS rows takes 16 keys at a time. Each row's scores, softmax and weighted values are bit for bit the one-row
 * loop's (dot_row, exp_inplace, axpy_row in key order), at a third of the instructions: no reduction a key and row,
 * no bf16 widening a key and row. */
static void attend_tiled(const void *q, int xtype, int64_t T, int64_t hq, int64_t hk, int64_t d, const void *kbuf,
                         const void *vbuf, const int64_t *blocks, int64_t bs, int64_t at, float scale, void *out,
                         float *work) {
    size_t xs = xtype == X_F32 ? 4 : 2, qd = (size_t)(hq * d) * xs, row = (size_t)d * xs;
    int64_t group = hq / hk, keys = at + T, span = up16(keys);
    int wt = xtype == X_F32 ? W_F32 : W_BF16;
    float *scores = work, *qf = scores + ATT_ROWS * group * span, *acc = qf + ATT_ROWS * group * d;
    float *kt = acc + ATT_ROWS * group * d, *vf = kt + span * d; /* [span / 16][d][16], [span][d] */
    for (int64_t g = 0; g < hk; g++) {
        for (int64_t j = 0; j < span; j++) {
            size_t at_j = j < keys ? (size_t)kv_row(blocks, bs, hk, g, j) * row : 0;
            const char *kr = (const char *)kbuf + at_j, *vr = (const char *)vbuf + at_j;
            for (int64_t i = 0; i < d; i++) {
                kt[((j / KEY_TILE) * d + i) * KEY_TILE + j % KEY_TILE] = j < keys ? load1(kr, wt, i) : 0.0f;
                vf[j * d + i] = j < keys ? load1(vr, wt, i) : 0.0f;
            }
        }
        for (int64_t r0 = 0; r0 < T; r0 += ATT_ROWS) {
            int64_t nb = T - r0 < ATT_ROWS ? T - r0 : ATT_ROWS, last = at + r0 + nb; /* keys [0, last) */
            load_rows_q(q, wt, nb, group, d, g, r0, qd, qf);
            for (int64_t j = 0; j < last; j += KEY_TILE) {
                const float *tile = kt + (j / KEY_TILE) * d * KEY_TILE;
                for (int64_t b = j <= at + r0 ? 0 : j - at - r0; b < nb; b++) /* rows at positions >= j */
                    for (int64_t a = 0; a < group; a++) {
                        __m512 sc = _mm512_mul_ps(dot_keys16(qf + (b * group + a) * d, tile, d), _mm512_set1_ps(scale));
                        _mm512_storeu_ps(scores + (b * group + a) * span + j, sc);
                    }
            }
            float inv[ATT_ROWS * 64];
            softmax_block(scores, span, at + r0 + 1, nb, group, inv);
            for (int64_t i = 0; i < nb * group * d; i++) acc[i] = 0.0f;
            for (int64_t j = 0; j < last; j += KEY_TILE)
                for (int64_t b = j <= at + r0 ? 0 : j - at - r0; b < nb; b++) {
                    int64_t len = at + r0 + b + 1, n = len - j < KEY_TILE ? len - j : KEY_TILE;
                    for (int64_t a = 0; a < group; a++)
                        axpy_keys(acc + (b * group + a) * d, scores + (b * group + a) * span + j, vf + j * d, n, d);
                }
            store_rows_out(acc, inv, xtype, nb, group, d, g, out, r0, qd);
        }
    }
}
#endif

void attention_rows(void *q, void *k, const void *v, int xtype, int64_t T, int64_t hq, int64_t hk, int64_t d,
                    const void *qw, const void *kw, int wtype, float q_eps, float k_eps, int64_t rot, const void *cos,
                    const void *sin, void *kbuf, void *vbuf, const int64_t *blocks, int64_t bs, int64_t at, float scale,
                    void *out, float *work) {
    size_t xs = xtype == X_F32 ? 4 : 2, qd = (size_t)(hq * d) * xs, kd = (size_t)(hk * d) * xs, rs = (size_t)rot * xs;
    size_t row = (size_t)d * xs;
    int64_t group = hq / hk, span = at + T; /* a row's scores are at most span long */
    int wt = xtype == X_F32 ? W_F32 : W_BF16;
    if (group > MAX_HEAD_GROUP || group * hk != hq) return; /* the caller checks: never reached */
    for (int64_t r = 0; r < T; r++) { /* decode_attention's first two steps, row by row */
        qk_norm_rope((char *)q + r * qd, (char *)k + r * kd, xtype, 1, hq, hk, d, qw, kw, wtype, q_eps, k_eps, rot,
                     cos ? (const char *)cos + r * rs : NULL, sin ? (const char *)sin + r * rs : NULL);
        kv_append(kbuf, vbuf, (char *)k + r * kd, (const char *)v + r * kd, hk, 1, d, blocks, bs, at + r, d, d, d, d,
                  (int64_t)xs);
    }
#ifdef SIMD_HAVE_KEY_TILE
    if (key_tiled(T, d)) { /* a prompt chunk: the same bits in key tiles */
        attend_tiled(q, xtype, T, hq, hk, d, kbuf, vbuf, blocks, bs, at, scale, out, work);
        return;
    }
#endif
    float *scores = work, *qf = scores + ATT_ROWS * group * span, *acc = qf + ATT_ROWS * group * d;
    for (int64_t g = 0; g < hk; g++)
        for (int64_t r0 = 0; r0 < T; r0 += ATT_ROWS) {
            int64_t nb = T - r0 < ATT_ROWS ? T - r0 : ATT_ROWS, last = at + r0 + nb; /* keys [0, last) */
            load_rows_q(q, wt, nb, group, d, g, r0, qd, qf);
            for (int64_t j = 0; j < last; j++) {
                const char *kr = (const char *)kbuf + (size_t)kv_row(blocks, bs, hk, g, j) * row;
                for (int64_t b = j <= at + r0 ? 0 : j - at - r0; b < nb; b++) /* rows at positions >= j */
                    for (int64_t a = 0; a < group; a++)
                        scores[(b * group + a) * span + j] = dot_row(qf + (b * group + a) * d, kr, wt, d) * scale;
            }
            float inv[ATT_ROWS * 64];
            softmax_block(scores, span, at + r0 + 1, nb, group, inv);
            for (int64_t i = 0; i < nb * group * d; i++) acc[i] = 0.0f;
            for (int64_t j = 0; j < last; j++) {
                const char *vr = (const char *)vbuf + (size_t)kv_row(blocks, bs, hk, g, j) * row;
                for (int64_t b = j <= at + r0 ? 0 : j - at - r0; b < nb; b++)
                    for (int64_t a = 0; a < group; a++)
                        axpy_row(acc + (b * group + a) * d, scores[(b * group + a) * span + j], vr, wt, d);
            }
            store_rows_out(acc, inv, xtype, nb, group, d, g, out, r0, qd);
        }
}
