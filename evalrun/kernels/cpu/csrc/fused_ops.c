/* Fused element-wise ops of a transformer layer on the CPU, float32, one pass over the rows:
 *
 *   rms_norm(x [T, H], w [H]) -> out [T, H]      out = x / sqrt(mean(x^2) + eps) * w
 *                                                (float32, or rounded to bfloat16 as bf16_from_f32:
 *                                                the rows a bf16 GEMM reads, the same bits it rounds to)
 *   silu_mul(gu [T, 2I])      -> out [T, I]      out = silu(gu[:, :I]) * gu[:, I:]
 *   gelu_tanh_mul(gu [T, 2I]) -> out [T, I]      out = gelu_tanh(gu[:, :I]) * gu[:, I:] (GeGLU, Gemma)
 *   rope_write(qkv [T, (Hq + 2 Hkv) D])          q rotated -> [T, Hq, D] float32; k rotated and v
 *                                                -> float32, bfloat16 or float16 pages
 *   argmax_rows(x [T, V])     -> out [T] int64   torch.argmax(x, dim=-1) (greedy sampling)
 *   finite_rows(x [T, V])     -> out [T] uint8   torch.isfinite(x).all(dim=-1) (the sampler's check)
 *
 * Every row is computed alone, in a fixed order, by whichever thread claims it: a row's result
 * never depends on how many rows share the call (batch invariance). Rows are split over up to
 * `nthreads` threads of the shared pool (pool.h). The torch references are evalrun/kernels/ref/fused.py's
 * rms_norm_reference, silu_mul_reference, gelu_tanh_mul_reference, rope_write_reference and argmax_reference.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "kv_load.h"
#include "pool.h"
#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define ROWS_PER_TASK 8
#define BF16_ROW_CHUNK 1024        /* rms_norm to bfloat16: a row's float32 values staged this many at a time */

typedef struct {
    int op;                        /* 0 rms_norm, 1 silu_mul, 2 gelu_tanh_mul, 3 rms_norm to bfloat16 */
    const float *x, *w;
    void *out;
    int T, H;                      /* rows, columns of the output */
    float eps;
    atomic_int *next;
} Task;

#include "simd_math.h"

/* 1 / sqrt(mean(x^2) + eps) of a row of H. */
static float rms_scale(const float *x, int H, float eps) {
    int j = 0;
    float ss = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    for (; j + 16 <= H; j += 16) {
        const __m256 v0 = _mm256_loadu_ps(x + j), v1 = _mm256_loadu_ps(x + j + 8);
        a0 = _mm256_fmadd_ps(v0, v0, a0);
        a1 = _mm256_fmadd_ps(v1, v1, a1);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_add_ps(a0, a1));
    for (int i = 0; i < 8; i++) ss += lanes[i];
#endif
    for (; j < H; j++) ss += x[j] * x[j];
    return 1.0f / sqrtf(ss / (float)H + eps);
}

/* out[j] = x[j] * inv * w[j] for j < n (n a multiple of 8 past the vectors, or the row's end). */
static void rms_scaled(const float *x, const float *w, float *out, int n, float inv) {
    int j = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 iv = _mm256_set1_ps(inv);
    for (; j + 8 <= n; j += 8)
        _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + j), iv), _mm256_loadu_ps(w + j)));
#endif
    for (; j < n; j++) out[j] = x[j] * inv * w[j];
}

static void rms_row(const float *x, const float *w, float *out, int H, float eps) {
    rms_scaled(x, w, out, H, rms_scale(x, H, eps));
}

/* rms_row's values rounded to bfloat16, staged in chunks of BF16_ROW_CHUNK (a multiple of 8, so
 * every value takes the same vector or scalar step as in rms_row). */
static void rms_row_bf16(const float *x, const float *w, uint16_t *out, int H, float eps) {
    float buf[BF16_ROW_CHUNK];
    const float inv = rms_scale(x, H, eps);
    for (int j0 = 0; j0 < H; j0 += BF16_ROW_CHUNK) {
        const int n = H - j0 < BF16_ROW_CHUNK ? H - j0 : BF16_ROW_CHUNK;
        rms_scaled(x + j0, w + j0, buf, n, inv);
        store_bf16(buf, out + j0, n);
    }
}

/* silu(g) * u with silu(g) = g * sigmoid(g), sigmoid from e = exp(-|g|) (never overflows). */
static void silu_mul_row(const float *gu, float *out, int I) {
    const float *g = gu, *u = gu + I;
    int j = 0;
#if defined(__AVX2__) && defined(__FMA__)
    for (; j + 8 <= I; j += 8)
        _mm256_storeu_ps(out + j, silu_mul8(_mm256_loadu_ps(g + j), _mm256_loadu_ps(u + j)));
#endif
    for (; j < I; j++) {
        const float e = expf(-fabsf(g[j]));
        const float sig = g[j] >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
        out[j] = g[j] * sig * u[j];
    }
}

/* gelu_tanh(g) * u = 0.5 g (1 + tanh(z)) u, z = sqrt(2 / pi) (g + 0.044715 g^3) (torch's
 * approximate="tanh"); tanh(z) = sign(z) (1 - e) / (1 + e) with e = exp(-2 |z|) (never overflows). */
#define GELU_K 0.7978845608028654f
#define GELU_C 0.044715f
#if defined(__AVX2__) && defined(__FMA__)
static inline __m256 gelu_tanh_mul8(__m256 g, __m256 u) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    const __m256 z = _mm256_mul_ps(_mm256_set1_ps(GELU_K),
                                   _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(GELU_C), g), _mm256_mul_ps(g, g), g));
    const __m256 e = exp_nonpositive(_mm256_mul_ps(_mm256_set1_ps(-2.0f), _mm256_andnot_ps(sign, z)));
    const __m256 t = _mm256_or_ps(_mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e)), _mm256_and_ps(sign, z));
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), g), _mm256_add_ps(one, t)), u);
}
#endif

static void gelu_tanh_mul_row(const float *gu, float *out, int I) {
    const float *g = gu, *u = gu + I;
    int j = 0;
#if defined(__AVX2__) && defined(__FMA__)
    for (; j + 8 <= I; j += 8)
        _mm256_storeu_ps(out + j, gelu_tanh_mul8(_mm256_loadu_ps(g + j), _mm256_loadu_ps(u + j)));
#endif
    for (; j < I; j++) {
        const float z = GELU_K * fmaf(GELU_C * g[j], g[j] * g[j], g[j]);
        const float e = expf(-2.0f * fabsf(z)), t = copysignf((1.0f - e) / (1.0f + e), z);
        out[j] = 0.5f * g[j] * (1.0f + t) * u[j];
    }
}

static void fused_worker(void *p, int tid, int nth) {
    (void)tid;
    (void)nth;
    const Task *t = (const Task *)p;
    float *out = (float *)t->out;
    for (int r0 = atomic_fetch_add(t->next, ROWS_PER_TASK); r0 < t->T; r0 = atomic_fetch_add(t->next, ROWS_PER_TASK)) {
        const int r1 = r0 + ROWS_PER_TASK < t->T ? r0 + ROWS_PER_TASK : t->T;
        for (int r = r0; r < r1; r++) {
            if (t->op == 0)
                rms_row(t->x + (int64_t)r * t->H, t->w, out + (int64_t)r * t->H, t->H, t->eps);
            else if (t->op == 3)
                rms_row_bf16(t->x + (int64_t)r * t->H, t->w, (uint16_t *)t->out + (int64_t)r * t->H, t->H, t->eps);
            else if (t->op == 1)
                silu_mul_row(t->x + (int64_t)r * 2 * t->H, out + (int64_t)r * t->H, t->H);
            else
                gelu_tanh_mul_row(t->x + (int64_t)r * 2 * t->H, out + (int64_t)r * t->H, t->H);
        }
    }
}

static int run(int op, const float *x, const float *w, void *out, int T, int H, float eps, int nthreads) {
    if (T < 0 || H < 1) return 1;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > 64) nthreads = 64;
    atomic_int next = 0;
    Task task = {op, x, w, out, T, H, eps, &next};
    evalrun_pool_run(fused_worker, &task, nthreads);
    return 0;
}

int rms_norm_f32(const float *x, const float *w, float *out, int T, int H, float eps, int nthreads) {
    return run(0, x, w, out, T, H, eps, nthreads);
}

/* rms_norm_f32's values rounded to bfloat16 (out [T, H] bf16 bits). */
int rms_norm_f32_bf16(const float *x, const float *w, uint16_t *out, int T, int H, float eps, int nthreads) {
    return run(3, x, w, out, T, H, eps, nthreads);
}

int silu_mul_f32(const float *gate_up, float *out, int T, int I, int nthreads) {
    return run(1, gate_up, 0, out, T, I, 0.0f, nthreads);
}

int gelu_tanh_mul_f32(const float *gate_up, float *out, int T, int I, int nthreads) {
    return run(2, gate_up, 0, out, T, I, 0.0f, nthreads);
}

/* One float32 value rounded to float16, to nearest even as torch's .to(dtype) (bfloat16:
 * kv_load.h's bf16_from_f32): overflow goes to +-inf, NaN stays NaN (quieted: sign and top payload
 * bits kept, as the F16C instruction does). */
static inline uint16_t f16_from_f32(float f) {
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint32_t sign = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu)); /* NaN */
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);                     /* >= 65520: inf */
    if (a >= 0x38800000u) {                                                     /* >= 2^-14: normal */
        const uint32_t r = a - 0x38000000u;                                     /* exponent 127 -> 15 bias */
        return (uint16_t)(sign | ((r + 0xfffu + ((r >> 13) & 1u)) >> 13));
    }
    if (a < 0x33000000u) return (uint16_t)sign;                                 /* < 2^-25, half the least subnormal */
    const int shift = 126 - (int)(a >> 23);                                     /* subnormal: m * 2^-24 */
    const uint32_t m = (a & 0x7fffffu) | 0x800000u, half = 1u << (shift - 1);
    uint32_t q = m >> shift;
    const uint32_t rem = m & ((half << 1) - 1u);
    if (rem > half || (rem == half && (q & 1u))) q++;
    return (uint16_t)(sign | q);
#endif
}

/* n float32 values -> n float16 (the conversion instruction, round to nearest even). */
static void store_f16(const float *src, uint16_t *dst, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i), _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++) dst[i] = f16_from_f32(src[i]);
}

/* n float32 values stored as `kind` (KIND_F32, KIND_BF16 or KIND_F16 of kv_load.h). */
static void store_kind(const float *src, void *dst, int64_t n, int kind) {
    if (kind == KIND_F32) memcpy(dst, src, sizeof(float) * (size_t)n);
    else if (kind == KIND_BF16) store_bf16(src, (uint16_t *)dst, n);
    else store_f16(src, (uint16_t *)dst, n);
}

/* Rope on the q and k heads of the fused QKV projection, k and v written straight into the
 * layer's pages, q returned rotated:
 *   qkv  [T, row_stride] float32 with q heads [Hq, D], then k heads [Hkv, D], then v heads [Hkv, D]
 *   cos, sin [T, D] float32 at each token's position; rotate-half convention (first half with second):
 *     out[:h] = x[:h] cos[:h] - x[h:] sin[:h],  out[h:] = x[h:] cos[h:] + x[:h] sin[h:]
 *   slots [T] int64 flat cache slots (page * S + offset); k_pages, v_pages [n_slots, Hkv, D] of
 *   page_kind: KIND_F32 float32, KIND_BF16 bfloat16, KIND_F16 float16 (kv_load.h)
 *   q_out [T, Hq, D] float32
 * k and v are computed in float32 (the same bits in every kind) and rounded once to the page's
 * dtype (bf16_from_f32 / f16_from_f32).
 * NOTE: each product is rounded before the add (no FMA: GCC turns contraction off under -std=c11;
 * clang would fuse them), so q and k are the bits of torch's `x * c - y * s`; rope_write_reference's
 * addcmul_ fuses the second product on AVX2 CPUs and can differ from these by an ulp.
 * Returns 0, or 1 (nothing written) when a slot is outside [0, n_slots), D is odd or page_kind is
 * none of the three. */
/* Rope over the first R values of a head (R = D, or partial rotary: R < D, tables [T, R]); values
 * R .. D - 1 pass through unchanged. */
static inline void rope_span(const float *x, const float *c, const float *s, float *out, int R, int j0, int n) {
    const int h = R / 2, j1 = j0 + n, m = j1 < h ? j1 : h, r = j1 < R ? j1 : R;   /* out[i] = rope(x)[j0 + i], i < n */
    int j = j0;
    for (; j < m; j++) out[j - j0] = x[j] * c[j] - x[h + j] * s[j];
    for (; j < r; j++) out[j - j0] = x[j] * c[j] + x[j - h] * s[j];
    for (; j < j1; j++) out[j - j0] = x[j];
}

#define ROPE_CHUNK 128             /* float32 values of a k head rotated on the stack before rounding */

static void rope_store_head(const float *x, const float *c, const float *s, void *dst, int D, int R, int kind) {
    if (kind == KIND_F32) {
        rope_span(x, c, s, (float *)dst, R, 0, D);
        return;
    }
    float buf[ROPE_CHUNK];
    for (int j0 = 0; j0 < D; j0 += ROPE_CHUNK) {
        const int n = D - j0 < ROPE_CHUNK ? D - j0 : ROPE_CHUNK;
        rope_span(x, c, s, buf, R, j0, n);
        store_kind(buf, (uint16_t *)dst + j0, n, kind);
    }
}

/* rope_write_kind with the rotary dim R (partial rotary: the first R of each head's D values,
 * cos / sin [T, R]; R = D rotates all). */
int rope_write_part(const float *qkv, int64_t row_stride, const float *cos, const float *sin, int T, int Hq,
                    int Hkv, int D, int R, const int64_t *slots, int64_t n_slots, void *k_pages, void *v_pages,
                    int page_kind, float *q_out) {
    if (R % 2 || R < 2 || R > D || (page_kind != KIND_F32 && page_kind != KIND_BF16 && page_kind != KIND_F16)) return 1;
    for (int t = 0; t < T; t++)
        if (slots[t] < 0 || slots[t] >= n_slots) return 1;
    const int64_t W = (int64_t)Hkv * D, bytes = page_kind == KIND_F32 ? 4 : 2;     /* values, bytes a value */
    /* every destination line first: a decode step's K/V rows lie far apart in the pages, and their
     * lines then arrive while the rows are rotated instead of each store waiting for its own */
    for (int t = 0; t < T; t++)
        for (int64_t o = 0; o < W * bytes; o += 64) {
            __builtin_prefetch((const char *)k_pages + slots[t] * W * bytes + o, 1, 3);
            __builtin_prefetch((const char *)v_pages + slots[t] * W * bytes + o, 1, 3);
        }
    for (int t = 0; t < T; t++) {
        const float *row = qkv + (int64_t)t * row_stride, *c = cos + (int64_t)t * R, *s = sin + (int64_t)t * R;
        for (int h = 0; h < Hq; h++) rope_span(row + (int64_t)h * D, c, s, q_out + ((int64_t)t * Hq + h) * D, R, 0, D);
        char *kd = (char *)k_pages + slots[t] * W * bytes, *vd = (char *)v_pages + slots[t] * W * bytes;
        for (int h = 0; h < Hkv; h++)
            rope_store_head(row + (int64_t)(Hq + h) * D, c, s, kd + (int64_t)h * D * bytes, D, R, page_kind);
        store_kind(row + (int64_t)(Hq + Hkv) * D, vd, W, page_kind);
    }
    return 0;
}

int rope_write_kind(const float *qkv, int64_t row_stride, const float *cos, const float *sin, int T, int Hq,
                    int Hkv, int D, const int64_t *slots, int64_t n_slots, void *k_pages, void *v_pages,
                    int page_kind, float *q_out) {
    return rope_write_part(qkv, row_stride, cos, sin, T, Hq, Hkv, D, D, slots, n_slots, k_pages, v_pages, page_kind,
                           q_out);
}

/* rope_write_kind with float32 pages (decode_step.c's layers). */
int rope_write_f32(const float *qkv, int64_t row_stride, const float *cos, const float *sin, int T, int Hq,
                   int Hkv, int D, const int64_t *slots, int64_t n_slots, float *k_cache, float *v_cache,
                   float *q_out) {
    return rope_write_kind(qkv, row_stride, cos, sin, T, Hq, Hkv, D, slots, n_slots, k_cache, v_cache, KIND_F32, q_out);
}

/* out[r] = the index of row r's largest value (x [T, V] float32 rows), with torch.argmax's
 * contract: the first index on ties, and the first NaN's index when a row holds a NaN. Two
 * passes per row: the maximum (and whether any NaN), then the first index holding it. */
static int64_t argmax_row(const float *x, int V) {
    int j = 0;
    float m = -INFINITY;
    int nan = 0;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 mv = _mm256_set1_ps(-INFINITY), un = _mm256_setzero_ps();
    for (; j + 8 <= V; j += 8) {
        const __m256 v = _mm256_loadu_ps(x + j);
        un = _mm256_or_ps(un, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        mv = _mm256_max_ps(mv, v);
    }
    nan = _mm256_movemask_ps(un) != 0;
    float lanes[8];
    _mm256_storeu_ps(lanes, mv);
    for (int i = 0; i < 8; i++) m = lanes[i] > m ? lanes[i] : m;
#endif
    for (; j < V; j++) {
        if (x[j] != x[j]) nan = 1;
        else if (x[j] > m) m = x[j];
    }
    if (nan) {
        for (j = 0; j < V; j++)
            if (x[j] != x[j]) return j;
    }
    j = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 mb = _mm256_set1_ps(m);
    for (; j + 8 <= V; j += 8) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), mb, _CMP_EQ_OQ));
        if (hit) return j + __builtin_ctz((unsigned)hit);
    }
#endif
    for (; j < V; j++)
        if (x[j] == m) return j;
    return 0;                       /* V == 0 is refused by the caller */
}

/* 1 when none of the n values is NaN or +-Inf (exponent bits all ones), else 0. */
static int row_finite(const float *x, int V) {
    int j = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256i ex = _mm256_set1_epi32(0x7f800000);
    __m256i bad = _mm256_setzero_si256();
    for (; j + 8 <= V; j += 8) {
        const __m256i b = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + j)), ex);
        bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(b, ex));
    }
    if (!_mm256_testz_si256(bad, bad)) return 0;
#endif
    for (; j < V; j++)
        if (!isfinite(x[j])) return 0;
    return 1;
}

/* Per row of x [T, V], rows claimed one at a time by the pool's threads: its argmax where `argmax`
 * is set, whether it is all finite where `finite` is set (both: the check first, which brings the
 * row into L2 for the argmax). */
typedef struct {
    const float *x;
    int64_t *argmax;
    uint8_t *finite;
    int T, V;
    atomic_int *next;
} RowTask;

static void row_worker(void *p, int tid, int nth) {
    (void)tid;
    (void)nth;
    const RowTask *t = (const RowTask *)p;
    for (int r = atomic_fetch_add(t->next, 1); r < t->T; r = atomic_fetch_add(t->next, 1)) {
        const float *row = t->x + (int64_t)r * t->V;
        if (t->finite) t->finite[r] = (uint8_t)row_finite(row, t->V);
        if (t->argmax) t->argmax[r] = argmax_row(row, t->V);
    }
}

static void run_rows(const float *x, int T, int V, int64_t *argmax, uint8_t *finite, int nthreads) {
    atomic_int next = 0;
    RowTask task = {x, argmax, finite, T, V, &next};
    evalrun_pool_run(row_worker, &task, nthreads < 1 ? 1 : nthreads > T ? (T > 0 ? T : 1) : nthreads);
}

int argmax_rows_f32(const float *x, int T, int V, int64_t *out, int nthreads) {
    if (T < 0 || V < 1) return 1;
    run_rows(x, T, V, out, NULL, nthreads);
    return 0;
}

/* On the shared pool, not torch's threads: the sampler runs this on every step's logits, and a
 * torch reduction there left torch's OpenMP workers spinning on both cores while the next native
 * kernel waited for its pool thread (argmax 0.4 -> 3 ms a step at 32 rows, 2 cores). */
int finite_rows_f32(const float *x, int T, int V, uint8_t *out, int nthreads) {
    if (T < 0 || V < 0) return 1;
    run_rows(x, T, V, NULL, out, nthreads);
    return 0;
}

/* Both per row in one visit (a greedy step's logits, written to memory by the LM head): the finite
 * check reads the row from memory into L2 and the argmax reads it there, instead of two passes
 * over the whole [T, V] from memory. The same values as the two calls. */
int argmax_finite_rows_f32(const float *x, int T, int V, int64_t *argmax, uint8_t *finite, int nthreads) {
    if (T < 0 || V < 1) return 1;
    run_rows(x, T, V, argmax, finite, nthreads);
    return 0;
}
