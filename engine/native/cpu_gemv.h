/* What engine/native/cpu_gemv.c shares with the kernels built on it (engine/native/gemm.c, decode_layer.c,
 * mxfp4_moe.c): the OpenMP helpers, the activation forms (act_t), the dtype codes, the bf16 conversions and rounding, SiLU, and the
 * prototypes of its exported kernels (documented where they are defined). */
#ifndef MOE_OFFLOAD_CPU_GEMV_H
#define MOE_OFFLOAD_CPU_GEMV_H
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <math.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

/* This thread's number and the team's size inside an OpenMP parallel region (0 and 1 in a build without OpenMP). */
#ifdef _OPENMP
#include <omp.h>
#define TID() omp_get_thread_num()
#define NT() omp_get_num_threads()
#define BARRIER() _Pragma("omp barrier")
#else
#define TID() 0
#define NT() 1
#define BARRIER()
#endif

/* Activation rows a call takes (a decode batch or a speculative window): gemv's, the experts' (moe_swiglu_rows,
 * moe_q4_rows, moe_mxfp4_rows) and decode_layer's limit. Defined once, in engine/native/limits.py; engine/native/build.py
 * passes it as -DMAX_ROWS, so C and Python cannot disagree. */
#ifndef MAX_ROWS
#error "MAX_ROWS is passed at build time: -DMAX_ROWS (engine/native/build.py, from engine/native/limits.py)"
#endif

enum { W_F32 = 0, W_BF16 = 1, W_I8 = 2, W_Q4 = 3 }; /* W_Q4: int4 groups of 64 (moe_q4_rows), experts only */
enum { X_F32 = 0, X_BF16 = 1 };

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Rounds v to the activation dtype: a bf16 model rounds every intermediate, as its reference does. */
static inline float as_x(float v, int xtype) { return xtype == X_BF16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

/* An fp16 value (the int8 weights' row scales) as a float. */
#if defined(__F16C__)
static inline float f16_to_f32(uint16_t h) { return _cvtsh_ss(h); } /* one instruction where F16C exists */
#else
static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (exp == 0 && man == 0) {
        u = sign;
    } else if (exp == 0) { /* subnormal: normalise */
        exp = 127 - 15 + 1;
        while (!(man & 0x400u)) { man <<= 1; exp--; }
        u = sign | (exp << 23) | ((man & 0x3ffu) << 13);
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}
#endif

static inline float silu(float g) { return g / (1.0f + expf(-g)); }

static inline float sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

#if defined(__AVX512F__)
#include <immintrin.h>
/* The sum of v's 16 lanes in the order GCC's _mm512_reduce_add_ps adds them, written out so that every compiler
 * adds alike: the one-row dot products (simd_avx512.h) and gemm's tiles (gemm_kernels.h) must agree bit for bit. */
static inline float hsum16(__m512 v) {
    __m256 t3 = _mm256_add_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)), _mm512_castps512_ps256(v));
    __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, 1));
}
#endif

/* Element i of a buffer in the activation dtype, as a float; and storing one (rounded to bf16 where it is bf16). */
static inline float x_get(const void *p, int xtype, int64_t i) {
    return xtype == X_F32 ? ((const float *)p)[i] : bf16_to_f32(((const uint16_t *)p)[i]);
}

static inline void x_set(void *p, int xtype, int64_t i, float v) {
    if (xtype == X_F32) ((float *)p)[i] = v;
    else ((uint16_t *)p)[i] = f32_to_bf16(v);
}

/* One activation row in the forms the dot products read: f32 always; for bf16 weights, a bf16 copy (b) or the
 * f32 values in even/odd order per 16 (p), as the variant's dot reads them; for the int8 dot, the int8
 * quantization: signed codes (q8), their magnitudes (qa), the sign mask (neg) and the block scales (qs).
 * act_prepare (cpu_gemv.c) fills the form the build's dot product for `wtype` reads and sets `mode`. */
enum { DOT_WIDEN = 0, DOT_BF16 = 1, DOT_I8 = 2 };
typedef struct {
    int mode; /* which dot product reads it: DOT_WIDEN, DOT_BF16 or DOT_I8 */
    float *f;
    float *p;
    uint16_t *b;
    int8_t *q8;
    uint8_t *qa;
    uint64_t *neg;
    float *qs;
} act_t;
size_t act_bytes(int64_t n);
act_t act_at(char *mem, int64_t n);
void load_act(const void *x, int xtype, int64_t n, float *out);
void act_prepare(act_t *a, int64_t n, int wtype, int xtype);
/* Weight row w dotted with each of X[0..m) (one mode), into out[j]: the one-row dot product's bits per row. */
void dot_rows(const void *w, int wtype, int64_t n, const act_t *X, int64_t m, float *out);
/* Rows [r0, r1) of W times the m prepared rows X, times the row scales if any: Y[j * ldy + r - y0] (gemm.c).
 * Bit for bit what dot_rows gives each row, in register-blocked tiles: the path for many rows. */
void gemm_tiles(const void *W, const uint16_t *scale, int wtype, int64_t n, int64_t r0, int64_t r1, const act_t *X,
                int64_t m, float *Y, int64_t ldy, int64_t y0);

/* One route of a token to an expert, with its routing weight; group_routes sorts a step's routes by expert then
 * row (cpu_gemv.c), so each expert's weights are read once for all the rows routed to it. */
typedef struct { int64_t id, row; float w; } route_t;
int64_t group_routes(int64_t R, int64_t k, const int64_t *ids, const float *w, route_t *routes, int64_t *starts,
                     int *first);
/* This thread's share [r0, r1) of `rows` output rows, in blocks of 4 (cpu_gemv.c). */
void share(int64_t rows, int tid, int nt, int64_t *r0, int64_t *r1);
size_t gemv_work_bytes(int64_t rows, int64_t cols, int64_t m);
size_t gemm_work_bytes(int64_t rows, int64_t cols, int64_t m);
int gemm(const void *W, const uint16_t *scale, int wtype, int64_t rows, int64_t cols, const void *X, int xtype,
         int64_t m, void *Y, void *work, int nthreads);
int gemv(const void *W, const uint16_t *scale, int wtype, int64_t rows, int64_t cols,
         const void *X, int xtype, int64_t m, void *Y, void *work, int nthreads);
size_t moe_work_bytes(int64_t H, int64_t I);
size_t moe_q4_work_bytes(int64_t H, int64_t I, int64_t R);
int moe_q4_rows(int64_t H, int64_t I, int64_t R, int64_t k, const int64_t *ids, const float *w,
                const uint8_t *const *gate_up, const uint16_t *const *gu_scale, const uint16_t *const *gu_zero,
                const uint8_t *const *down, const uint16_t *const *d_scale, const uint16_t *const *d_zero,
                const void *x, int xtype, void *out, void *work, int nthreads);
size_t moe_rows_work_bytes(int64_t H, int64_t I, int64_t R);
int moe_swiglu_rows(int wtype, int64_t H, int64_t I, int64_t R, int64_t k, const int64_t *ids, const float *w,
                     const void *const *gate_up, const uint16_t *const *gu_scale, const void *const *down,
                     const uint16_t *const *down_scale, const void *x, int xtype, void *out, void *work, int nthreads);
int moe_swiglu(int wtype, int64_t H, int64_t I, int64_t m, const void *const *gate_up, const uint16_t *const *gu_scale,
                const void *const *down, const uint16_t *const *down_scale, const float *w,
                const void *x, int xtype, void *out, void *work, int nthreads);
void add_rmsnorm(const void *x, const void *a, int xtype, int64_t rows, int64_t n, const void *w, int wtype, float eps,
                 void *sum, void *normed);
/* Kernels only Python calls, through engine/native/entry.c (declared here so their definitions are checked). */
int gemv_sweep(const void *const *Ws, int64_t count, int wtype, int64_t rows, int64_t cols, const void *X, int xtype,
               void *Y, void *work, int nthreads);
int gemv_q4(const uint8_t *packed, const uint16_t *scale, const uint16_t *zero, int64_t rows, int64_t cols,
            const void *X, int xtype, int64_t m, void *Y, void *work, int nthreads);
int moe_mxfp4_rows(int64_t H, int64_t I, int64_t R, int64_t k, const int64_t *ids, const float *w,
                   const uint8_t *const *gu_blocks, const uint8_t *const *gu_scales, const void *const *gu_bias,
                   const uint8_t *const *d_blocks, const uint8_t *const *d_scales, const void *const *d_bias,
                   int btype, float alpha, float limit, const void *x, int xtype, void *out, void *work,
                   int nthreads);
int router_sigmoid_rows(int64_t R, const void *W, int wtype, int64_t E, int64_t H, const void *x, int xtype, int64_t k,
                        int64_t n_group, int64_t topk_group, int norm, float scale, const float *bias, float *logits,
                        float *weights, int64_t *ids, float *xf, void *work, int nthreads);
void rmsnorm(const void *x, int xtype, int64_t rows, int64_t n, const void *w, int wtype, float eps, void *out);
void rope(void *x, int xtype, int64_t rows, int64_t heads, int64_t d, int64_t rot, const void *cos, const void *sin);
void attention_rows(void *q, void *k, const void *v, int xtype, int64_t T, int64_t hq, int64_t hk, int64_t d,
                    const void *qw, const void *kw, int wtype, float q_eps, float k_eps, int64_t rot, const void *cos,
                    const void *sin, void *kbuf, void *vbuf, const int64_t *blocks, int64_t bs, int64_t at, float scale,
                    void *out, float *work);
void topk_desc(const float *v, int64_t n, int64_t k, int64_t *ids);
int router_topk(const void *W, int wtype, int64_t E, int64_t H, const void *x, int xtype, int64_t k, int norm,
                void *logits, void *weights, int64_t *ids, void *work, int nthreads);
/* A sequence's KV cache, keys or values: blocks of bs positions (bs a power of two) in one buffer laid out
 * [blocks, heads, bs, d]; the sequence's i-th block is block blocks[i] of the buffer (its block table). A contiguous
 * buffer [heads, cap, d] is the table {0} with bs = cap; a paged pool (engine/worker/kv_pool.py) gives each sequence
 * its own table. kv_row: the row (in units of d elements from the buffer's start) of position j of head g. */
static inline int64_t kv_row(const int64_t *blocks, int64_t bs, int64_t heads, int64_t g, int64_t j) {
    int shift = __builtin_ctzll((unsigned long long)bs);
    return ((blocks[j >> shift] * heads + g) << shift) + (j & (bs - 1));
}
/* Per-head q/k RMSNorms and rotary in place, and a step's keys and values written into a KV cache (cpu_gemv.c). */
void qk_norm_rope(void *q, void *k, int xtype, int64_t rows, int64_t hq, int64_t hk, int64_t d, const void *qw,
                  const void *kw, int wtype, float q_eps, float k_eps, int64_t rot, const void *cos, const void *sin);
void kv_append(void *kbuf, void *vbuf, const void *k, const void *v, int64_t heads, int64_t n, int64_t d,
               const int64_t *blocks, int64_t bs, int64_t at, int64_t k_head, int64_t k_pos, int64_t v_head, int64_t v_pos, int64_t elem);
/* A decode row's attention (attention.c). */
void decode_attention(void *q, void *k, const void *v, int xtype, int64_t hq, int64_t hk, int64_t d, const void *qw,
                      const void *kw, int wtype, float q_eps, float k_eps, int64_t rot, const void *cos, const void *sin,
                      void *kbuf, void *vbuf, const int64_t *blocks, int64_t bs, int64_t at, float scale, void *out,
                      float *work);
/* The descriptors the library's entry points (entry.c) take from Python instead of long argument lists: one struct
 * for each fixed thing, mirrored field for field by engine/native/structs.py. Integers are int64_t and floats
 * float so that the ctypes mirrors need no padding rules of their own. */
typedef struct { /* a weight matrix [rows, cols] of wtype codes; int8: fp16 row scales; int4: fp16 group scales, zeros */
    const void *w;
    const uint16_t *scale, *zero;
    int64_t rows, cols, wtype;
} weight_t;
typedef struct { /* m activation rows x [m, n] in xtype, and where their results go */
    const void *x;
    void *out;
    int64_t m, n, xtype;
} rows_t;
typedef struct { /* a norm's weight [n] in wtype and its epsilon */
    const void *w;
    int64_t wtype;
    float eps, pad_;
} norm_t;
typedef struct { /* routed experts' address tables, one entry per expert (NULL tables: none), and their forms */
    const void *const *gate_up;
    const uint16_t *const *gate_up_scale, *const *gate_up_zero;
    const void *const *gate_up_bias;
    const void *const *down;
    const uint16_t *const *down_scale, *const *down_zero;
    const void *const *down_bias;
    int64_t wtype, bias_wtype, H, I;
    float alpha, limit; /* gpt-oss's clamped SwiGLU (moe_mxfp4_rows) */
} experts_t;
typedef struct { /* R rows routed to k experts each: ids [R k] (NULL: expert j is table entry j), weights [R k] */
    const int64_t *ids;
    const float *w;
    int64_t R, k;
} routes_t;
typedef struct { /* a router's choice rule and where its outputs go (router_topk, router_sigmoid_rows) */
    int64_t k, norm, n_group, topk_group;
    float scale, pad_;
    const float *bias;
    void *logits, *weights;
    int64_t *ids;
    float *xf;
} router_t;
typedef struct { /* rows of attention heads in place: q [rows, hq, d] and k [rows, hk, d] (k NULL: none) in xtype */
    void *q, *k;
    int64_t xtype, rows, hq, hk, d;
} heads_t;
typedef struct { /* per-head q and k RMSNorm weights [d] (NULL: none) */
    const void *qw, *kw;
    int64_t wtype;
    float q_eps, k_eps;
} qk_norm_t;
typedef struct { /* rotary tables cos and sin [rows, rot] (rot 0: none) */
    const void *cos, *sin;
    int64_t rot;
} rotary_t;
typedef struct { /* a sequence's KV cache: key and value buffers of `heads` heads of d, read through its block table */
    void *kbuf, *vbuf;
    const int64_t *blocks;
    int64_t bs, heads, d;
} kv_cache_t;
typedef struct { /* n new keys and values [heads, n, d], strided in elements, of elem bytes each */
    const void *k, *v;
    int64_t n, k_head, k_pos, v_head, v_pos, elem;
} kv_new_t;
typedef struct { /* an attention call's values, output [T, hq d], scratch, first position and softmax scale */
    const void *v;
    void *out;
    float *work;
    int64_t at;
    float scale, pad_;
} attend_t;
#endif
