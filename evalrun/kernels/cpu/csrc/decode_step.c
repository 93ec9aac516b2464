/* All decoder layers of one decode step in one native call (CPU, a float32 residual stream; the
 * linears on the float32 GEMM or on the bf16 GEMM, pages float32, bfloat16 or float16).
 *
 * A decode step has one new token per sequence. Per layer, with x [T, H] the residual stream
 * (updated in place):
 *
 *   h   = rms_norm(x, input_norm)                       fused_ops.c (OLMo 2, no input_norm: h = x)
 *   qkv = h @ Wqkv^T (+ bqkv)                           gemm.c
 *   q   = rope(q); k = rope(k), v -> the layer's pages  fused_ops.c (rope_write_f32)
 *   o   = paged decode attention(q, pages)              paged_decode.c
 *   x   = x + o @ Wo^T                                  gemm.c (residual in the epilogue)
 *         (Gemma: x = x + rms_norm(o @ Wo^T, attn_out_norm))
 *   h   = rms_norm(x, post_norm)                        (OLMo 2, no post_norm: h = x)
 *   a   = silu(h @ Wg^T) * (h @ Wu^T)                   gemm.c, fused_ops.c (silu_mul_f32; Gemma:
 *                                                       gelu_tanh_mul_f32)
 *   x   = x + a @ Wd^T                                  (Gemma: x + rms_norm(a @ Wd^T, mlp_out_norm))
 *
 * These are the very functions the per-op path calls from Python (this file includes their
 * sources), in the same order on the same data, so the step's output is bitwise the same as
 * that path's; only the ~10 Python calls per layer (~3 ms per step at 30 layers) are gone.
 * One exception, with the same bits: where gemm_silu_supported (3+ rows, the AVX2 tiles) or
 * gemm_bf16_silu_supported, the SiLU runs in the gate/up GEMM's epilogue (gemm_silu_f32,
 * gemm_bf16_silu; its time is profiled as gate/up).
 * evalrun/kernels/cpu/decode_step.py builds the layer table and decides when this path applies.
 *
 *   DecodeLayer   per layer: norm weights [H] float32, packed weights (gemm_pack_f32, or
 *                 gemm_bf16_pack where DecodeModel.weight_kind is 1), biases (float32, each NULL
 *                 where the layer has none: qkv [Q], o [H], gate/up [2I], down [H]), the layer's
 *                 K and V pages [P + 1, S, Hkv, D] of DecodeModel.page_kind (kv_load.h) and its
 *                 sliding window (0: full attention; paged_decode.c), soft-capping (0: none)
 *                 and q/k norm weights [D] (NULL: none; each q and k head RMS-normed before rope)
 *   x             [T, H] in/out
 *   cos, sin      [n_ropes, T, rot] at each token's position, one table per rope of the model (a layer
 *                 reads table DecodeLayer.rope: Gemma 3's sliding layers have a rope of their own)
 *   slots         [T] int64 flat cache slot of each new token (page * S + offset)
 *   page_table    [T, max_pages] int32, seq_lens [T] int32 (the new token included)
 *   work          float32 scratch of decode_step_work_floats(...) floats
 * Returns 0, or the 1-based index of the layer whose kernel refused its input (x then holds
 * partial results; the caller raises).
 */
#define _POSIX_C_SOURCE 199309L    /* clock_gettime under -std=c11 */
#include <time.h>

#include "gemm.c"
#include "gemm_bf16.c"
#include "fused_ops.c"
#include "paged_decode.c"

typedef struct {
    const float *input_norm, *post_norm;
    const void *wqkv;
    const float *bqkv;                                       /* may be NULL */
    const void *wo, *w_gate_up, *w_down;                     /* packed panels */
    void *k_pages, *v_pages;
    const float *bo, *b_gate_up, *b_down;                    /* may be NULL */
    int sliding;
    float softcap;                                           /* attention soft-capping, 0: none */
    const float *q_norm, *k_norm;                            /* q/k RMSNorm weights, or NULL: [D] per head (Qwen3),
                                                                [Hq D] / [Hkv D] the whole projection (qk_whole) */
    const float *attn_out_norm, *mlp_out_norm;               /* [H] norms of the sublayers' outputs (Gemma), or NULL */
    int rope;                                                /* which cos/sin table */
    int qk_whole;                                            /* q_norm / k_norm over the whole projections (OLMo 2) */
} DecodeLayer;

/* Threads per kind of op, chosen by the caller with the per-op path's own rules (evalrun/kernels/cpu/fused.py,
 * evalrun/kernels/cpu/paged_decode.py): results never depend on them, only the time does. */
typedef struct {
    int gemm, norm, act, attn;
} DecodeThreads;

typedef struct {
    int L, H, Hq, Hkv, D, I, S;
    float eps, scale;
    int64_t n_slots;                /* slots of each layer's pages: (P + 1) * S */
    const DecodeLayer *layers;
    int weight_kind;                /* 0: float32 panels (gemm.c), 1: bf16 panels (gemm_bf16.c) */
    int page_kind;                  /* KIND_F32, KIND_BF16 or KIND_F16 */
    int act;                        /* the gated MLP's activation: 0 SiLU, 1 tanh GELU */
    int n_ropes;                    /* cos/sin tables */
    int rot;                        /* rotary dim (<= D: partial rotary) */
} DecodeModel;

/* y = residual + x @ W^T (+ bias) on the layer's GEMM (float32 rows in and out) */
static int step_gemm(const DecodeModel *m, const float *x, int T, int K, const void *w, int N, const float *bias,
                     const float *residual, float *y, int nthreads) {
    if (m->weight_kind == 1)
        return gemm_bf16(x, 0, T, K, K, (const uint16_t *)w, N, bias, residual, y, 0, nthreads);
    return gemm_f32(x, T, K, K, (const float *)w, N, bias, residual, y, nthreads);
}

/* Optional wall time per stage, summed over layers and steps (decode_step_profile): 0 norms,
 * 1 QKV, 2 rope + page write, 3 attention, 4 output projection, 5 gate/up, 6 SiLU, 7 down. */
#define STAGES 8
static int profile_on;
static double profile_s[STAGES];

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* on: 1 start (and zero the sums), 0 stop; out (may be NULL): the sums so far, STAGES doubles. */
void decode_step_profile(int on, double *out) {
    if (out)
        for (int i = 0; i < STAGES; i++) out[i] = profile_s[i];
    if (on)
        for (int i = 0; i < STAGES; i++) profile_s[i] = 0.0;
    profile_on = on;
}

static int64_t attn_scratch_floats(const DecodeModel *m, int lmax) {
    return SCRATCH(m->Hq, m->Hkv, m->D, lmax);
}

/* attn_threads: the threads the attention may use (each has its own scratch). */
int64_t decode_step_work_floats(const DecodeModel *m, int T, int lmax, int attn_threads) {
    const int64_t qkv = (int64_t)(m->Hq + 2 * m->Hkv) * m->D;
    return (int64_t)T * (m->H + qkv + 2 * (int64_t)m->Hq * m->D + 3 * (int64_t)m->I)
           + (int64_t)(attn_threads < 1 ? 1 : attn_threads) * attn_scratch_floats(m, lmax);
}

int decode_step_f32(const DecodeModel *m, float *x, const float *cos, const float *sin, const int64_t *slots,
                    const int32_t *page_table, int max_pages, const int32_t *seq_lens, int T, float *work,
                    int lmax, const DecodeThreads *th) {
#if GEMM_SIMD
    const int H = m->H, D = m->D, Hq = m->Hq, Hkv = m->Hkv, I = m->I;
    const int Q = (Hq + 2 * Hkv) * D;
    if (T < 1) return T == 0 ? 0 : 1;
    const int nthreads = th->gemm, norm_threads = th->norm, act_threads = th->act, attn_threads = th->attn;
    float *h = work, *qkv = h + (int64_t)T * H, *q = qkv + (int64_t)T * Q, *o = q + (int64_t)T * Hq * D;
    float *gu = o + (int64_t)T * Hq * D, *act = gu + (int64_t)T * 2 * I, *scratch = act + (int64_t)T * I;
    const int prof = profile_on, fuse_silu_ok = m->act == 0 && (m->weight_kind == 0 ? gemm_silu_supported(T, I)
                                                                                     : gemm_bf16_silu_supported(I));
    const int64_t TH = (int64_t)T * H;
    const int kind = m->page_kind;
    double t0 = prof ? now_s() : 0.0;
#define STAGE(i, call)                                                                            \
    if (call) return l + 1;                                                                       \
    if (prof) {                                                                                   \
        const double t1 = now_s();                                                                \
        profile_s[i] += t1 - t0;                                                                  \
        t0 = t1;                                                                                  \
    }
/* a sublayer's input: rms_norm(x) into h, or x itself where it has no norm (OLMo 2) */
#define NORMED_INPUT(norm)                                                                        \
    hin = x;                                                                                      \
    if (norm) {                                                                                   \
        STAGE(0, rms_norm_f32(x, norm, h, T, H, m->eps, norm_threads))                            \
        hin = h;                                                                                  \
    }
/* x += in W^T (+ bias), the add in the GEMM's epilogue; with an output norm (Gemma, OLMo 2) the
 * projection goes into h, is normed there and added (the per-op path's Model._add_output) */
#define ADD_OUTPUT(stage, in, K, w, bias, norm)                                                   \
    if (norm) {                                                                                   \
        STAGE(stage, step_gemm(m, in, T, K, w, H, bias, 0, h, nthreads))                          \
        STAGE(0, rms_norm_f32(h, norm, h, T, H, m->eps, norm_threads))                            \
        for (int64_t i = 0; i < TH; i++) x[i] = x[i] + h[i];                                      \
    } else {                                                                                      \
        STAGE(stage, step_gemm(m, in, T, K, w, H, bias, x, x, nthreads))                          \
    }
    for (int l = 0; l < m->L; l++) {
        const DecodeLayer *ly = &m->layers[l];
        const float *hin;
        NORMED_INPUT(ly->input_norm)
        STAGE(1, step_gemm(m, hin, T, H, ly->wqkv, Q, ly->bqkv, 0, qkv, nthreads))
        if (ly->q_norm) {            /* each token's q heads, then its k heads (rows of D, or one row each) in place */
            const int qr = ly->qk_whole ? 1 : Hq, kr = ly->qk_whole ? 1 : Hkv, qc = Hq * D / qr, kc = Hkv * D / kr;
            int rc = 0;
            for (int t = 0; t < T && !rc; t++) {
                float *row = qkv + (int64_t)t * Q;
                rc = rms_norm_f32(row, ly->q_norm, row, qr, qc, m->eps, 1)
                     || rms_norm_f32(row + (int64_t)Hq * D, ly->k_norm, row + (int64_t)Hq * D, kr, kc, m->eps, 1);
            }
            STAGE(0, rc)
        }
        if (ly->rope < 0 || ly->rope >= m->n_ropes) return l + 1;
        const float *lcos = cos + ly->rope * (int64_t)T * m->rot, *lsin = sin + ly->rope * (int64_t)T * m->rot;
        STAGE(2, rope_write_part(qkv, Q, lcos, lsin, T, Hq, Hkv, D, m->rot, slots, m->n_slots, ly->k_pages,
                                 ly->v_pages, kind, q))
        STAGE(3, paged_decode(q, ly->k_pages, ly->v_pages, 0, 0, kind, kind, 0, page_table, max_pages,
                              seq_lens, o, T, Hq, Hkv, D, m->S, m->scale, scratch, lmax, attn_threads, 0, 0, 0, 0,
                              0, 0, ly->sliding, ly->softcap))
        ADD_OUTPUT(4, o, Hq * D, ly->wo, ly->bo, ly->attn_out_norm)
        NORMED_INPUT(ly->post_norm)
        if (fuse_silu_ok && !ly->b_gate_up) {            /* SiLU in the gate/up GEMM's epilogue: the same bits */
            STAGE(5, m->weight_kind == 0 ? gemm_silu_f32(hin, T, H, H, (const float *)ly->w_gate_up, I, act, nthreads)
                                         : gemm_bf16_silu(hin, 0, T, H, H, (const uint16_t *)ly->w_gate_up, I, act,
                                                          nthreads))
        } else {
            STAGE(5, step_gemm(m, hin, T, H, ly->w_gate_up, 2 * I, ly->b_gate_up, 0, gu, nthreads))
            STAGE(6, m->act ? gelu_tanh_mul_f32(gu, act, T, I, act_threads) : silu_mul_f32(gu, act, T, I, act_threads))
        }
        ADD_OUTPUT(7, act, I, ly->w_down, ly->b_down, ly->mlp_out_norm)
    }
#undef ADD_OUTPUT
#undef NORMED_INPUT
#undef STAGE
    return 0;
#else
    (void)m; (void)x; (void)cos; (void)sin; (void)slots; (void)page_table; (void)max_pages; (void)seq_lens;
    (void)T; (void)work; (void)lmax; (void)th;
    return 1;
#endif
}
