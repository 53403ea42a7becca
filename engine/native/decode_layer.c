/* One decoder layer of a one-token decode step in one call, for a llama-style MoE layer whose
 * experts are all resident for good (engine/worker/fused_decode.py decides when).
 *
 * Why: with every expert resident the arithmetic of a decode layer is eight native kernels (q, k
 * and v projections, the attention, o_proj, a residual add and norm, the router, the experts, a
 * residual add and norm) and the Python that calls them one by one took 0.3-0.7 ms a layer on this
 * project's machine: more than the arithmetic of the tiny peers checkpoint, and about an eighth of
 * the mid one's (docs/benchmarks/peers.md). llama.cpp runs a whole graph per token without
 * returning to its caller. This runs the same kernels, in the same order, on the same buffers as
 * engine/worker/lean_forward.py's decode path, so the result is what that path computes (the
 * differences: f32 projections run this library's gemv rather than torch's F.linear, another order
 * of each dot product's sum; shared experts' SiLU and the sigmoids use expf where that path runs
 * torch's exp; engine/worker/fused_decode.py says what that means for exactness).
 *
 * The layer, for residual x [H] and its normed form h [H] (both updated in place):
 *   q, k, v = h Wq^T (+ bq), h Wk^T (+ bk), h Wv^T (+ bv)
 *   a = decode_attention(q, k, v)             (q/k norms, rotary, KV append at `at`, softmax attention)
 *   x = x + (a Wo^T (+ bo));  h = post_norm(x)
 *   ids, w = router(h)                        (softmax top-k, or DeepSeek-V3's sigmoid top-k: router_sigmoid)
 *   m = sum over ids ascending of w * expert(h)
 *   m = m + [sigmoid(h . g)] * shared(h)       (a shared SwiGLU expert, optionally gated, where the layer has one)
 *   x = x + m;  h = next_norm(x)
 * A dense layer (ROUTER_NONE) has no router or routed experts: m = shared(h) alone.
 * `next_norm` is the next layer's input norm, or the model's final norm after the last layer.
 */
#include "cpu_gemv.h"

/* Everything about one layer that does not change from a step to the next; engine/worker/fused_decode.py
 * fills it once (ctypes Structure `LayerSpec`, same fields in the same order). Weights in the
 * activation's dtype unless a *_wtype says otherwise; a NULL bias or q/k norm: none. */
typedef struct {
    int64_t xtype, proj_wtype, norm_wtype, expert_wtype; /* X_* and W_* codes */
    int64_t H, hq, hk, d, rot, E, topk, I, norm_topk;
    float q_eps, k_eps, post_eps, next_eps, scale, pad_;
    const void *wq, *wk, *wv, *wo, *bq, *bk, *bv, *bo;
    const void *q_norm, *k_norm, *post_norm, *next_norm, *router;
    /* Per expert e < E: its gate_up [2I, H] and down [H, I] weights (int8: and their fp16 row scales, else NULL tables). */
    const void *const *gate_up;
    const uint16_t *const *gate_up_scale;
    const void *const *down;
    const uint16_t *const *down_scale;
    /* A shared expert (Qwen2-MoE's): gate_proj, up_proj [sh_I, H], down_proj [H, sh_I] in proj_wtype, and its
     * sigmoid gate's weight [1, H] (NULL: ungated); sh_gate NULL: none. */
    const void *sh_gate, *sh_up, *sh_down, *sh_gate_w;
    int64_t sh_I;
    /* Which router: ROUTER_SOFTMAX (router_topk), ROUTER_SIGMOID (router_sigmoid below, with its per-expert
     * correction bias [E] in f32, n_group groups of which topk_group are kept, and a scaling factor), or
     * ROUTER_NONE: a dense layer, whose MLP is the sh_* SwiGLU alone (E is 0). */
    int64_t router_kind, router_wtype, n_group, topk_group;
    const float *score_bias;
    float routed_scale, pad2_;
    /* Where the step's routing goes for the routing bus's listeners (NULL: nowhere): the router's input [H]
     * in the activation dtype, its logits [E], and the top-k ids [k] and weights [k] in the router's order. */
    void *route_x;
    float *route_logits, *route_weights;
    int64_t *route_ids;
    /* int8 dense weights (--dense-quant int8): the fp16 row scales of wq, wk, wv, wo and the shared expert's
     * gate, up and down projections; a projection with a scale holds int8 codes (W_I8), NULL: proj_wtype. */
    const uint16_t *wq_s, *wk_s, *wv_s, *wo_s, *sh_gate_s, *sh_up_s, *sh_down_s;
    /* int4 experts (expert_wtype W_Q4, moe_q4_rows): per expert, the fp16 zero points of gate_up and down (their
     * scales in gate_up_scale and down_scale); NULL tables otherwise. */
    const uint16_t *const *gate_up_zero;
    const uint16_t *const *down_zero;
} layer_spec_t;

enum { ROUTER_SOFTMAX = 0, ROUTER_SIGMOID = 1, ROUTER_NONE = 2 };

static size_t up64(size_t n) { return (n + 63) / 64 * 64; }

static size_t max_sz(size_t a, size_t b) { return a > b ? a : b; }

/* ---- a DeepSeek-V3-style router, for one token ---------------------------------------------------
 * What transformers' Glm4Moe/DeepseekV3 TopkRouter computes for one row: logits = W . x in f32 (x widened),
 * scores = sigmoid(logits), choice = scores + bias; the experts' n_group groups ranked by the sum of their two
 * best choices and all but the topk_group best masked; the k best choices (descending, ties to the lower id);
 * weights = their scores, divided by (their sum + 1e-20) when `norm`, times `scale`. Outputs in f32: logits [E],
 * weights [k], ids [k]. xf: H floats of scratch for the widened row; work: gemv's. Returns gemv's status, or -1
 * for a shape it does not take. */
int router_sigmoid(const void *W, int wtype, int64_t E, int64_t H, const void *x, int xtype, int64_t k, int64_t n_group,
                   int64_t topk_group, int norm, float scale, const float *bias, float *logits, float *weights, int64_t *ids,
                   float *xf, void *work, int nthreads) {
    if (k < 1 || k > E || E > 4096 || n_group < 1 || E % n_group || topk_group < 1 || topk_group > n_group) return -1;
    for (int64_t i = 0; i < H; i++) xf[i] = x_get(x, xtype, i);
    int rc = gemv(W, 0, wtype, E, H, xf, X_F32, 1, logits, work, nthreads);
    if (rc != 0) return rc;
    float score[4096], choice[4096];
    for (int64_t e = 0; e < E; e++) {
        score[e] = sigmoid(logits[e]);
        choice[e] = score[e] + (bias ? bias[e] : 0.0f);
    }
    int64_t per = E / n_group;
    if (topk_group < n_group) {
        float gsum[4096];
        int64_t kept[4096];
        unsigned char keep[4096];
        for (int64_t g = 0; g < n_group; g++) { /* the sum of the group's two best choices */
            float a = -INFINITY, b = -INFINITY;
            for (int64_t e = g * per; e < (g + 1) * per; e++) {
                if (choice[e] > a) { b = a; a = choice[e]; } else if (choice[e] > b) b = choice[e];
            }
            gsum[g] = per > 1 ? a + b : a;
            keep[g] = 0;
        }
        topk_desc(gsum, n_group, topk_group, kept);
        for (int64_t t = 0; t < topk_group; t++) keep[kept[t]] = 1;
        for (int64_t e = 0; e < E; e++)
            if (!keep[e / per]) choice[e] = -INFINITY;
    }
    topk_desc(choice, E, k, ids);
    float sum = 0.0f;
    for (int64_t j = 0; j < k; j++) {
        weights[j] = score[ids[j]];
        sum += weights[j];
    }
    for (int64_t j = 0; j < k; j++) weights[j] = (norm ? weights[j] / (sum + 1e-20f) : weights[j]) * scale;
    return 0;
}

/* router_sigmoid for R rows x [R, H] (rows H elements apart), one call: row r's outputs at logits + r E, weights +
 * r k, ids + r k, each row routed exactly as router_sigmoid routes it alone (the same function, row by row): what a
 * prompt chunk's rows need without a call a row from Python. Returns the first failing row's status, or 0. */
int router_sigmoid_rows(int64_t R, const void *W, int wtype, int64_t E, int64_t H, const void *x, int xtype, int64_t k,
                        int64_t n_group, int64_t topk_group, int norm, float scale, const float *bias, float *logits,
                        float *weights, int64_t *ids, float *xf, void *work, int nthreads) {
    size_t row = (size_t)H * (xtype == X_F32 ? 4 : 2);
    for (int64_t r = 0; r < R; r++) {
        int rc = router_sigmoid(W, wtype, E, H, (const char *)x + r * row, xtype, k, n_group, topk_group, norm, scale,
                                bias, logits + r * E, weights + r * k, ids + r * k, xf, work, nthreads);
        if (rc) return rc;
    }
    return 0;
}

/* The scratch bytes decode_layer needs for this layer with up to `positions` cached positions and `rows` rows. */
size_t decode_layer_work_bytes(const layer_spec_t *L, int64_t positions, int64_t rows) {
    size_t xs = L->xtype == X_F32 ? 4 : 2, qd = (size_t)(L->hq * L->d), kd = (size_t)(L->hk * L->d), R = (size_t)rows;
    /* per row: q, its attention, k, v, the MLP output, the top-k weights and ids; once: logits and the sigmoid
     * router's widened row (the routers run row by row) */
    size_t mine = up64(R * qd * xs) * 2 + up64(R * kd * xs) * 2 + up64(R * (size_t)L->H * xs) + up64((size_t)L->E * 4)
                  + up64(R * (size_t)L->topk * 4) + up64(R * (size_t)L->topk * 8) + up64((size_t)L->H * 4);
    size_t gw = max_sz(max_sz(gemv_work_bytes((int64_t)qd, L->H, rows), gemv_work_bytes((int64_t)kd, L->H, rows)),
                       max_sz(gemv_work_bytes(L->H, (int64_t)qd, rows), gemv_work_bytes(L->E > 0 ? L->E : 1, L->H, 1)));
    size_t attention = (size_t)4 * (size_t)(L->hq / L->hk) * (size_t)(positions + 1 + 2 * L->d);
    if (L->sh_gate != NULL) { /* per row: g, u, their product, the shared output and the gate's value */
        mine += (up64((size_t)L->sh_I * xs) * 3 + up64((size_t)L->H * xs) + 64) * R;
        gw = max_sz(gw, max_sz(gemv_work_bytes(L->sh_I, L->H, rows), gemv_work_bytes(L->H, L->sh_I, rows)));
    }
    size_t experts = L->expert_wtype == W_Q4 ? moe_q4_work_bytes(L->H, L->I, rows) : moe_rows_work_bytes(L->H, L->I, rows);
    return mine + up64(max_sz(max_sz(gw, experts), attention)) + 64;
}

/* y[r][n] += b[n] for each of R rows, rounded as torch's add rounds in the activation dtype (after y was rounded by gemv). */
static void add_bias(void *y, const void *b, int64_t R, int64_t n, int xtype) {
    if (b == NULL) return;
    for (int64_t r = 0; r < R; r++)
        for (int64_t i = 0; i < n; i++) x_set(y, xtype, r * n + i, x_get(y, xtype, r * n + i) + x_get(b, xtype, i));
}

/* gemv of R rows plus an optional bias; returns gemv's status. With row scales `s` the weight is int8 (W_I8, as
 * engine/native/quant_linear.py's QuantLinear runs it), else in proj_wtype. */
static int project(const layer_spec_t *L, const void *w, const uint16_t *s, const void *b, int64_t rows, int64_t cols,
                   int64_t R, const void *x, void *y, void *work, int nthreads) {
    int rc = gemv(w, s, s ? W_I8 : (int)L->proj_wtype, rows, cols, x, (int)L->xtype, R, y, work, nthreads);
    add_bias(y, b, R, rows, (int)L->xtype);
    return rc;
}

/* a[i] = silu(g[i]) * u[i] for n elements in x's dtype, rounded where a bf16 reference rounds (the activation and
 * the product): a SwiGLU MLP's middle, element by element in one way, so a row's result never depends on the rows
 * beside it (torch's vectorised silu rounds an element by where it falls in the tensor: engine/native/layers.py). */
void silu_mul(const void *g, const void *u, int xtype, int64_t n, void *a) {
    for (int64_t i = 0; i < n; i++) x_set(a, xtype, i, as_x(silu(x_get(g, xtype, i)), xtype) * x_get(u, xtype, i));
}

/* y[r] = sigmoid(gate[r]) * s[r] for R rows of H (gate [R] and s, y [R, H] in x's dtype), rounded where a bf16
 * reference rounds (the sigmoid, the product): Qwen2-MoE's gated shared expert, as add_shared_expert gates it. */
void sigmoid_gate_rows(const void *gate, const void *s, int xtype, int64_t R, int64_t H, void *y) {
    for (int64_t r = 0; r < R; r++) {
        float sg = as_x(sigmoid(x_get(gate, xtype, r)), xtype);
        for (int64_t i = r * H; i < (r + 1) * H; i++) x_set(y, xtype, i, sg * x_get(s, xtype, i));
    }
}

/* y += [sigmoid(h . g)] * down(silu(gate h) * up h) for each of R rows, each step rounded where Qwen2-MoE's bf16
 * reference rounds it (each projection's output, the activation, the product, the gate's sigmoid and product, the
 * sum); `mem` holds the intermediates (decode_layer_work_bytes counts them), `scratch` is gemv's. Returns gemv's
 * status. */
static int add_shared_expert(const layer_spec_t *L, int64_t R, const void *h, void *y, char *mem, void *scratch,
                             int nthreads) {
    size_t xs = L->xtype == X_F32 ? 4 : 2;
    int64_t I = L->sh_I, H = L->H;
    int xt = (int)L->xtype;
    char *g = mem, *u = g + up64((size_t)(R * I) * xs), *a = u + up64((size_t)(R * I) * xs), *s = a + up64((size_t)(R * I) * xs);
    char *gate = s + up64((size_t)(R * H) * xs);
    int rc = project(L, L->sh_gate, L->sh_gate_s, NULL, I, H, R, h, g, scratch, nthreads);
    rc = rc ? rc : project(L, L->sh_up, L->sh_up_s, NULL, I, H, R, h, u, scratch, nthreads);
    if (rc) return rc;
    silu_mul(g, u, xt, R * I, a);
    rc = project(L, L->sh_down, L->sh_down_s, NULL, H, I, R, a, s, scratch, nthreads);
    if (!rc && L->sh_gate_w != NULL) rc = project(L, L->sh_gate_w, NULL, NULL, 1, H, R, h, gate, scratch, nthreads);
    if (rc) return rc;
    for (int64_t r = 0; r < R; r++) {
        float sg = L->sh_gate_w != NULL ? as_x(sigmoid(x_get(gate, xt, r)), xt) : 1.0f;
        for (int64_t i = r * H; i < (r + 1) * H; i++) {
            float sv = x_get(s, xt, i);
            x_set(y, xt, i, x_get(y, xt, i) + (L->sh_gate_w != NULL ? as_x(sg * sv, xt) : sv));
        }
    }
    return 0;
}

/* The layer above for R rows (R <= MAX_ROWS): x and h [R, H] in place; cos/sin [R, rot] of the rows' positions (NULL when
 * rot is 0). Row r's KV cache (buffers kbufs[r], vbufs[r], block table tables[r] of blocks of bss[r] positions:
 * cpu_gemv.h kv_row) holds ats[r] positions, and its new key
 * and value go to position ats[r]: a verification window's rows share one request's buffers at consecutive
 * positions and run in order, so each attends to the window's rows before it (causal); a batch's rows each have
 * their own. work: decode_layer_work_bytes(L, max(ats) + 1, R) bytes or more. Returns 0, -3 for a row count out of
 * range, or the first failing kernel's status. */
static int layer_rows(const layer_spec_t *L, int64_t R, void *x, void *h, const void *cos, const void *sin,
                      void *const *kbufs, void *const *vbufs, const int64_t *const *tables, const int64_t *bss,
                      const int64_t *ats, void *work, int nthreads) {
    size_t xs = L->xtype == X_F32 ? 4 : 2, qd = (size_t)(L->hq * L->d), kd = (size_t)(L->hk * L->d);
    int64_t H = L->H, k = L->topk, E = L->E;
    int xt = (int)L->xtype;
    if (R < 1 || R > MAX_ROWS) return -3;
    if (L->router_kind != ROUTER_NONE && (k < 1 || k > MAX_TOPK)) return -2;
    char *mem = (char *)work;
    char *q = mem, *att = q + up64(R * qd * xs), *kk = att + up64(R * qd * xs), *vv = kk + up64(R * kd * xs);
    char *y = vv + up64(R * kd * xs), *logits = y + up64((size_t)(R * H) * xs), *weights = logits + up64((size_t)E * 4);
    int64_t *ids = (int64_t *)(weights + up64((size_t)(R * k) * 4));
    float *xf = (float *)((char *)ids + up64((size_t)(R * k) * 8));
    char *shared = (char *)xf + up64((size_t)H * 4);
    void *scratch = L->sh_gate == NULL ? shared
                    : shared + (up64((size_t)L->sh_I * xs) * 3 + up64((size_t)H * xs) + 64) * (size_t)R;
    int rc = project(L, L->wq, L->wq_s, L->bq, (int64_t)qd, H, R, h, q, scratch, nthreads);
    rc = rc ? rc : project(L, L->wk, L->wk_s, L->bk, (int64_t)kd, H, R, h, kk, scratch, nthreads);
    rc = rc ? rc : project(L, L->wv, L->wv_s, L->bv, (int64_t)kd, H, R, h, vv, scratch, nthreads);
    if (rc) return rc;
    size_t rs = (size_t)L->rot * xs;
    for (int64_t r = 0; r < R; r++)
        decode_attention(q + r * qd * xs, kk + r * kd * xs, vv + r * kd * xs, xt, L->hq, L->hk, L->d, L->q_norm, L->k_norm,
                         (int)L->norm_wtype, L->q_eps, L->k_eps, L->rot, cos ? (const char *)cos + r * rs : NULL,
                         sin ? (const char *)sin + r * rs : NULL, kbufs[r], vbufs[r], tables[r], bss[r], ats[r], L->scale,
                         att + r * qd * xs, (float *)scratch);
    rc = project(L, L->wo, L->wo_s, L->bo, H, (int64_t)qd, R, att, y, scratch, nthreads);
    if (rc) return rc;
    add_rmsnorm(x, y, xt, R, H, L->post_norm, (int)L->norm_wtype, L->post_eps, x, h); /* elementwise: in place is safe */
    memset(y, 0, (size_t)(R * H) * xs);
    if (L->router_kind != ROUTER_NONE) {
        /* Each row's routing weights as the resident lane passes them: the router's output (in the activation dtype
         * for the softmax router, f32 for the sigmoid one), read as floats. */
        int f32_weights = L->router_kind == ROUTER_SIGMOID;
        float w[MAX_ROWS * MAX_TOPK];
        for (int64_t r = 0; r < R; r++) {
            const char *hr = (const char *)h + r * H * xs;
            char *wr = weights + r * k * 4;
            int64_t *ir = ids + r * k;
            if (f32_weights)
                rc = router_sigmoid(L->router, (int)L->router_wtype, E, H, hr, xt, k, L->n_group, L->topk_group,
                                    (int)L->norm_topk, L->routed_scale, L->score_bias, (float *)logits, (float *)wr, ir, xf,
                                    scratch, nthreads);
            else
                rc = router_topk(L->router, xt /* its weight is in the activation dtype: same code */, E, H, hr, xt, k,
                                 (int)L->norm_topk, logits, wr, ir, scratch, nthreads);
            if (rc) return rc;
            for (int64_t j = 0; j < k; j++) w[r * k + j] = x_get(wr, f32_weights ? X_F32 : xt, j);
            if (L->route_ids != NULL) { /* what the layer-by-layer path publishes on the routing bus */
                memcpy((char *)L->route_x + r * H * xs, hr, (size_t)H * xs);
                for (int64_t e = 0; e < E; e++) L->route_logits[r * E + e] = x_get(logits, f32_weights ? X_F32 : xt, e);
                for (int64_t j = 0; j < k; j++) {
                    L->route_ids[r * k + j] = ir[j];
                    L->route_weights[r * k + j] = w[r * k + j];
                }
            }
        }
        /* Each row's experts in ascending id order (transformers' summation order), each with its routing weight;
         * each expert's weights read once for the rows that route to it. */
        if (L->expert_wtype == W_Q4)
            rc = moe_q4_rows(H, L->I, R, k, ids, w, (const uint8_t *const *)L->gate_up, L->gate_up_scale, L->gate_up_zero,
                             (const uint8_t *const *)L->down, L->down_scale, L->down_zero, h, xt, y, scratch, nthreads);
        else
            rc = moe_swiglu_rows((int)L->expert_wtype, H, L->I, R, k, ids, w, L->gate_up, L->gate_up_scale, L->down,
                                 L->down_scale, h, xt, y, scratch, nthreads);
        if (rc) return rc;
    }
    /* A dense layer's MLP, or a MoE layer's shared expert. */
    if (L->sh_gate != NULL && (rc = add_shared_expert(L, R, h, y, shared, scratch, nthreads)) != 0) return rc;
    add_rmsnorm(x, y, xt, R, H, L->next_norm, (int)L->norm_wtype, L->next_eps, x, h);
    return 0;
}

/* A decode step's rows and buffers, the same for every layer of the step (engine/worker/fused_decode.py fills it
 * once per step, ctypes Structure `DecodeStep`): R rows x and h, cos/sin, scratch and threads, and each row's KV
 * cache (kbufs, vbufs, tables, bss, ats: MAX_ROWS-entry arrays the caller refills per layer). */
typedef struct {
    void *x, *h;
    const void *cos, *sin;
    void *work;
    void *const *kbufs, *const *vbufs;
    const int64_t *const *tables;
    const int64_t *bss, *ats;
    int64_t R, nthreads;
} decode_step_t;

/* layer_rows above for layer L of step S. */
int decode_layer(const layer_spec_t *L, const decode_step_t *S) {
    return layer_rows(L, S->R, S->x, S->h, S->cos, S->sin, S->kbufs, S->vbufs, S->tables, S->bss, S->ats, S->work,
                      (int)S->nthreads);
}
