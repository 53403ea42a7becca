/* The library's entry points for Python (engine/native/kernels.py, row_ops.py): each kernel's arguments grouped
 * into the descriptors of cpu_gemv.h (a weight matrix, activation rows, routed experts, a KV cache, ...), which
 * engine/native/structs.py mirrors; each entry point unpacks them and calls the kernel, documented where it is
 * defined, with the same arguments as before, so every result is the kernel's own. The kernels keep their plain
 * argument lists for each other (decode_layer.c calls gemv, the experts, the routers and the attention directly). */
#include "cpu_gemv.h"

/* ---- matrices: x's rows (X->m of W->cols) times W^T into X->out ------------------------------------ */
int gemv_call(const weight_t *W, const rows_t *X, void *work, int nthreads) {
    return gemv(W->w, W->scale, (int)W->wtype, W->rows, W->cols, X->x, (int)X->xtype, X->m, X->out, work, nthreads);
}

/* Every one of the `count` matrices Ws (W's shape and dtype; W->w unused) times X's one row, into X->out. */
int gemv_sweep_call(const void *const *Ws, int64_t count, const weight_t *W, const rows_t *X, void *work,
                    int nthreads) {
    return gemv_sweep(Ws, count, (int)W->wtype, W->rows, W->cols, X->x, (int)X->xtype, X->out, work, nthreads);
}

int gemv_q4_call(const weight_t *W, const rows_t *X, void *work, int nthreads) {
    return gemv_q4((const uint8_t *)W->w, W->scale, W->zero, W->rows, W->cols, X->x, (int)X->xtype, X->m, X->out,
                   work, nthreads);
}

/* ---- routed experts: X's rows through the experts of E that `routes` picks ------------------------- */
/* One row through routes->k experts, table entries 0..k-1 in order (routes->ids unused). */
int moe_swiglu_call(const experts_t *E, const routes_t *routes, const rows_t *X, void *work, int nthreads) {
    return moe_swiglu((int)E->wtype, E->H, E->I, routes->k, E->gate_up, E->gate_up_scale, E->down, E->down_scale,
                      routes->w, X->x, (int)X->xtype, X->out, work, nthreads);
}

int moe_swiglu_rows_call(const experts_t *E, const routes_t *routes, const rows_t *X, void *work, int nthreads) {
    return moe_swiglu_rows((int)E->wtype, E->H, E->I, routes->R, routes->k, routes->ids, routes->w, E->gate_up,
                           E->gate_up_scale, E->down, E->down_scale, X->x, (int)X->xtype, X->out, work, nthreads);
}

int moe_q4_rows_call(const experts_t *E, const routes_t *routes, const rows_t *X, void *work, int nthreads) {
    return moe_q4_rows(E->H, E->I, routes->R, routes->k, routes->ids, routes->w, (const uint8_t *const *)E->gate_up,
                       E->gate_up_scale, E->gate_up_zero, (const uint8_t *const *)E->down, E->down_scale,
                       E->down_zero, X->x, (int)X->xtype, X->out, work, nthreads);
}

/* MXFP4 experts: gate_up and down hold the blocks, gate_up_scale and down_scale the (byte) scales. */
int moe_mxfp4_rows_call(const experts_t *E, const routes_t *routes, const rows_t *X, void *work, int nthreads) {
    return moe_mxfp4_rows(E->H, E->I, routes->R, routes->k, routes->ids, routes->w,
                          (const uint8_t *const *)E->gate_up, (const uint8_t *const *)E->gate_up_scale,
                          E->gate_up_bias, (const uint8_t *const *)E->down, (const uint8_t *const *)E->down_scale,
                          E->down_bias, (int)E->bias_wtype, E->alpha, E->limit, X->x, (int)X->xtype, X->out, work,
                          nthreads);
}

/* ---- routers: W [E, H] is the router's weight; X's rows (X->out unused) ----------------------------- */
int router_topk_call(const weight_t *W, const rows_t *X, const router_t *r, void *work, int nthreads) {
    return router_topk(W->w, (int)W->wtype, W->rows, W->cols, X->x, (int)X->xtype, r->k, (int)r->norm, r->logits,
                       r->weights, r->ids, work, nthreads);
}

int router_sigmoid_rows_call(const weight_t *W, const rows_t *X, const router_t *r, void *work, int nthreads) {
    return router_sigmoid_rows(X->m, W->w, (int)W->wtype, W->rows, W->cols, X->x, (int)X->xtype, r->k, r->n_group,
                               r->topk_group, (int)r->norm, r->scale, r->bias, (float *)r->logits,
                               (float *)r->weights, r->ids, r->xf, work, nthreads);
}

/* ---- row-wise ops ----------------------------------------------------------------------------------- */
void rmsnorm_call(const rows_t *X, const norm_t *N) {
    rmsnorm(X->x, (int)X->xtype, X->m, X->n, N->w, (int)N->wtype, N->eps, X->out);
}

/* X->x + a into X->out, and its rmsnorm into `normed`. */
void add_rmsnorm_call(const rows_t *X, const void *a, void *normed, const norm_t *N) {
    add_rmsnorm(X->x, a, (int)X->xtype, X->m, X->n, N->w, (int)N->wtype, N->eps, X->out, normed);
}

/* Rotary embedding of hd->q's heads in place (hd->k unused). */
void rope_call(const heads_t *hd, const rotary_t *rot) {
    rope(hd->q, (int)hd->xtype, hd->rows, hd->hq, hd->d, rot->rot, rot->cos, rot->sin);
}

void qk_norm_rope_call(const heads_t *hd, const qk_norm_t *N, const rotary_t *rot) {
    qk_norm_rope(hd->q, hd->k, (int)hd->xtype, hd->rows, hd->hq, hd->hk, hd->d, N->qw, N->kw, (int)N->wtype,
                 N->q_eps, N->k_eps, rot->rot, rot->cos, rot->sin);
}

void kv_append_call(const kv_cache_t *C, const kv_new_t *N, int64_t at) {
    kv_append(C->kbuf, C->vbuf, N->k, N->v, C->heads, N->n, C->d, C->blocks, C->bs, at, N->k_head, N->k_pos,
              N->v_head, N->v_pos, N->elem);
}

/* Attention for hd->rows consecutive rows of one sequence whose cache is C (C->heads, C->d unused). */
void attention_rows_call(const heads_t *hd, const qk_norm_t *N, const rotary_t *rot, const kv_cache_t *C,
                         const attend_t *A) {
    attention_rows(hd->q, hd->k, A->v, (int)hd->xtype, hd->rows, hd->hq, hd->hk, hd->d, N->qw, N->kw, (int)N->wtype,
                   N->q_eps, N->k_eps, rot->rot, rot->cos, rot->sin, C->kbuf, C->vbuf, C->blocks, C->bs, A->at,
                   A->scale, A->out, A->work);
}
