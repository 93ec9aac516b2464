/* Float32 GEMM for the model's linears on the CPU, on a prepacked weight:
 *
 *   y[M, N] = residual + (x[M, K] @ W[N, K]^T + bias)        (bias, residual optional)
 *
 *   x         [M, K] rows with stride ldx (floats)
 *   packed    W in panels of 16 output columns: panel p is W[16p : 16p+16, :] stored k-major as
 *             [K][16], the last panel zero-padded; gemm_pack_f32 makes it, gemm_packed_floats
 *             says its size
 *   y         [M, N] contiguous; residual [M, N] contiguous (may be y itself); bias [N]
 *
 * Every output element is one chain of fused multiply-adds over k = 0 .. K-1 starting from 0,
 * then + bias, then residual + that. The chain does not depend on how rows are tiled, how
 * many rows the call has, or how columns are split over threads, so a row's output is bitwise
 * the same whatever else is in the batch (batch invariance). The torch reference is F.linear
 * (kernels/linear.py: linear_reference).
 *
 * Rows are taken in tiles of up to 6 (6 rows x 16 columns: 12 accumulators); tiles of 1-3 rows
 * span several panels so a tile still has 8-12 independent chains. Columns (panels) are split
 * over the threads of the shared persistent pool (pool.h).
 *
 * Without AVX2 and FMA at compile time gemm_supported() returns 0 and nothing else may be called.
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define GEMM_SIMD 1
#else
#define GEMM_SIMD 0
#endif

#include "pool.h"

#define PW 16                       /* columns per panel */
#define GROUP 4                     /* panels a tile pass covers */
#define A_BLOCK_BYTES (192 * 1024)  /* rows of x kept hot while a panel group streams */

int gemm_supported(void) { return GEMM_SIMD; }

int64_t gemm_packed_floats(int N, int K) { return (int64_t)((N + PW - 1) / PW) * PW * K; }

int gemm_pack_f32(const float *w, int N, int K, float *out) {
    if (N < 1 || K < 1) return 1;
    const int np = (N + PW - 1) / PW;
    for (int p = 0; p < np; p++) {
        float *dst = out + (int64_t)p * K * PW;
        for (int k = 0; k < K; k++)
            for (int c = 0; c < PW; c++) {
                const int n = p * PW + c;
                dst[(int64_t)k * PW + c] = n < N ? w[(int64_t)n * K + k] : 0.0f;
            }
    }
    return 0;
}

#if GEMM_SIMD

typedef struct {
    const float *x, *packed, *bias, *residual;
    float *y;
    int64_t ldx;
    int M, N, K, np;
} Gemm;

/* acc [R][P*16] -> y rows i0.., columns from panel p0, with bias and residual. */
static void epilogue(const Gemm *g, int i0, int R, int p0, int P, const float *acc) {
    const int c0 = p0 * PW, cols = (P * PW < g->N - c0) ? P * PW : g->N - c0;
    for (int r = 0; r < R; r++) {
        const float *a = acc + r * P * PW;
        float *y = g->y + (int64_t)(i0 + r) * g->N + c0;
        const float *res = g->residual ? g->residual + (int64_t)(i0 + r) * g->N + c0 : 0;
        const float *b = g->bias ? g->bias + c0 : 0;
        int j = 0;
        for (; j + 8 <= cols; j += 8) {
            __m256 v = _mm256_loadu_ps(a + j);
            if (b) v = _mm256_add_ps(v, _mm256_loadu_ps(b + j));
            if (res) v = _mm256_add_ps(_mm256_loadu_ps(res + j), v);
            _mm256_storeu_ps(y + j, v);
        }
        for (; j < cols; j++) {
            float v = a[j];
            if (b) v = v + b[j];
            if (res) v = res[j] + v;
            y[j] = v;
        }
    }
}

/* The 6 x 16 tile (rows i0 .. i0+R-1, R <= 6, one panel) and the 2 x 48 tile (R <= 2, three
 * panels): 12 accumulators, written out by name (GCC keeps an array of 12 in memory). Rows past
 * R repeat the last row and are not stored. */
#define FMA2(c0, c1, xp)                                                                          \
    {                                                                                             \
        const __m256 a_ = _mm256_broadcast_ss((xp) + k);                                          \
        c0 = _mm256_fmadd_ps(a_, b0, c0);                                                         \
        c1 = _mm256_fmadd_ps(a_, b1, c1);                                                         \
    }

/* pf: pf_n lines of the next panel to prefetch (one per k), or NULL. */
static void tile_6x1(const Gemm *g, int i0, int R, int p0, const float *pf, int pf_n) {
    const float *x0 = g->x + (int64_t)i0 * g->ldx, *x1 = x0, *x2 = x0, *x3 = x0, *x4 = x0, *x5 = x0;
    if (R > 1) x1 = x0 + g->ldx;
    if (R > 2) x2 = x1 + g->ldx; else x2 = x1;
    if (R > 3) x3 = x2 + g->ldx; else x3 = x2;
    if (R > 4) x4 = x3 + g->ldx; else x4 = x3;
    if (R > 5) x5 = x4 + g->ldx; else x5 = x4;
    const float *bp = g->packed + (int64_t)p0 * g->K * PW;
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00,
           c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    const int K = g->K;
    if (!pf) pf_n = 0;
    for (int k = 0; k < K; k++, bp += PW) {
        if (k < pf_n) _mm_prefetch((const char *)(pf + (int64_t)k * PW), _MM_HINT_T0);
        const __m256 b0 = _mm256_loadu_ps(bp), b1 = _mm256_loadu_ps(bp + 8);
        FMA2(c00, c01, x0) FMA2(c10, c11, x1) FMA2(c20, c21, x2)
        FMA2(c30, c31, x3) FMA2(c40, c41, x4) FMA2(c50, c51, x5)
    }
    float out[6 * PW];
    const __m256 all[12] = {c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51};
    for (int v = 0; v < 12; v++) _mm256_storeu_ps(out + v * 8, all[v]);
    epilogue(g, i0, R, p0, 1, out);
}

#define FMA6(c0, c1, c2, c3, c4, c5, xp)                                                          \
    {                                                                                             \
        const __m256 a_ = _mm256_broadcast_ss((xp) + k);                                          \
        c0 = _mm256_fmadd_ps(a_, _mm256_loadu_ps(b), c0);                                         \
        c1 = _mm256_fmadd_ps(a_, _mm256_loadu_ps(b + 8), c1);                                     \
        c2 = _mm256_fmadd_ps(a_, _mm256_loadu_ps(b + ps), c2);                                    \
        c3 = _mm256_fmadd_ps(a_, _mm256_loadu_ps(b + ps + 8), c3);                                \
        c4 = _mm256_fmadd_ps(a_, _mm256_loadu_ps(b + 2 * ps), c4);                                \
        c5 = _mm256_fmadd_ps(a_, _mm256_loadu_ps(b + 2 * ps + 8), c5);                            \
    }

static void tile_2x3(const Gemm *g, int i0, int R, int p0) {
    const float *x0 = g->x + (int64_t)i0 * g->ldx, *x1 = R > 1 ? x0 + g->ldx : x0;
    const float *b = g->packed + (int64_t)p0 * g->K * PW;
    const int64_t ps = (int64_t)g->K * PW;
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c03 = c00, c04 = c00, c05 = c00, c10 = c00,
           c11 = c00, c12 = c00, c13 = c00, c14 = c00, c15 = c00;
    const int K = g->K;
    for (int k = 0; k < K; k++, b += PW) {
        FMA6(c00, c01, c02, c03, c04, c05, x0)
        FMA6(c10, c11, c12, c13, c14, c15, x1)
    }
    float out[2 * 3 * PW];
    const __m256 all[12] = {c00, c01, c02, c03, c04, c05, c10, c11, c12, c13, c14, c15};
    for (int v = 0; v < 12; v++) _mm256_storeu_ps(out + v * 8, all[v]);
    epilogue(g, i0, R, p0, 3, out);
}

/* One row over four panels (GEMV-like: 8 chains). */
static void tile_1x4(const Gemm *g, int i0, int p0, int prefetch) {
    const float *x0 = g->x + (int64_t)i0 * g->ldx;
    const float *b = g->packed + (int64_t)p0 * g->K * PW;
    const int64_t ps = (int64_t)g->K * PW;
    __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0;
    const int K = g->K;
    for (int k = 0; k < K; k++, b += PW) {
        if (prefetch) {
            _mm_prefetch((const char *)(b + 4 * ps), _MM_HINT_T0);
            _mm_prefetch((const char *)(b + 5 * ps), _MM_HINT_T0);
            _mm_prefetch((const char *)(b + 6 * ps), _MM_HINT_T0);
            _mm_prefetch((const char *)(b + 7 * ps), _MM_HINT_T0);
        }
        const __m256 a = _mm256_broadcast_ss(x0 + k);
        c0 = _mm256_fmadd_ps(a, _mm256_loadu_ps(b), c0);
        c1 = _mm256_fmadd_ps(a, _mm256_loadu_ps(b + 8), c1);
        c2 = _mm256_fmadd_ps(a, _mm256_loadu_ps(b + ps), c2);
        c3 = _mm256_fmadd_ps(a, _mm256_loadu_ps(b + ps + 8), c3);
        c4 = _mm256_fmadd_ps(a, _mm256_loadu_ps(b + 2 * ps), c4);
        c5 = _mm256_fmadd_ps(a, _mm256_loadu_ps(b + 2 * ps + 8), c5);
        c6 = _mm256_fmadd_ps(a, _mm256_loadu_ps(b + 3 * ps), c6);
        c7 = _mm256_fmadd_ps(a, _mm256_loadu_ps(b + 3 * ps + 8), c7);
    }
    float out[4 * PW];
    const __m256 all[8] = {c0, c1, c2, c3, c4, c5, c6, c7};
    for (int v = 0; v < 8; v++) _mm256_storeu_ps(out + v * 8, all[v]);
    epilogue(g, i0, 1, p0, 4, out);
}

/* Rows [i, i + R), R <= 5 (the rows left after the 6-row tiles of a block), over panels
 * [p, p + n): one row four panels at a time, two rows three at a time, else one panel at a time. */
static void tail_span(const Gemm *g, int i, int R, int p, int n, int pe) {
    if (R == 1)
        for (; n >= 4; n -= 4, p += 4) tile_1x4(g, i, p, p + 8 <= pe);
    else if (R == 2)
        for (; n >= 3; n -= 3, p += 3) tile_2x3(g, i, 2, p);
    for (; n > 0; n--, p++) tile_6x1(g, i, R, p, 0, 0);
}

/* Thread tid's share: a contiguous range of panels, all rows. Rows go in blocks
 * that stay in L2; within a block each panel is used by all 6-row tiles while it is hot, and the
 * tiles on a panel prefetch the next one in slices (weights stream from memory in a decode step). */
static void run_part(void *ctx, int tid, int nth) {
    const Gemm *g = (const Gemm *)ctx;
    /* an even split of the panels (whole groups would leave 4 against 5 of 9) */
    const int pb = (int)((int64_t)g->np * tid / nth), pe = (int)((int64_t)g->np * (tid + 1) / nth);
    const int64_t ps = (int64_t)g->K * PW;
    int mc = A_BLOCK_BYTES / (g->K * 4);
    mc = mc < 6 ? 6 : mc - mc % 6;
    for (int i0 = 0; i0 < g->M; i0 += mc) {
        const int i1 = i0 + mc < g->M ? i0 + mc : g->M;
        const int full = i0 + (i1 - i0) / 6 * 6;
        const int tiles = (i1 - i0) / 6 > 0 ? (i1 - i0) / 6 : 1;
        for (int p = pb; p < pe; p += GROUP) {
            const int n = p + GROUP <= pe ? GROUP : pe - p;
            for (int q = p; q < p + n; q++) {
                /* the next panel's K lines, prefetched in equal slices by this panel's tiles */
                const float *next = q + 1 < pe ? g->packed + (q + 1) * ps : 0;
                const int per = (g->K + tiles - 1) / tiles;
                for (int i = i0, j = 0; i < full; i += 6, j++) {
                    const int lo = j * per < g->K ? j * per : g->K, hi = lo + per < g->K ? lo + per : g->K;
                    tile_6x1(g, i, 6, q, next && hi > lo ? next + (int64_t)lo * PW : 0, hi - lo);
                }
            }
            if (full < i1) tail_span(g, full, i1 - full, p, n, pe);
        }
    }
}

#endif

/* Returns 0, or 1 (nothing done) when the library lacks AVX2/FMA or a size is invalid. */
int gemm_f32(const float *x, int M, int K, int64_t ldx, const float *packed, int N, const float *bias,
             const float *residual, float *y, int nthreads) {
#if GEMM_SIMD
    if (M < 0 || N < 1 || K < 1 || ldx < K) return 1;
    if (M == 0) return 0;
    Gemm g = {x, packed, bias, residual, y, ldx, M, N, K, (N + PW - 1) / PW};
    int nth = nthreads < 1 ? 1 : nthreads;
    if (nth > g.np) nth = g.np;
    /* below ~64k multiply-adds a second thread costs more than it saves */
    if ((int64_t)M * N * K < 65536) nth = 1;
    return evalrun_pool_run(run_part, &g, nth);
#else
    (void)x; (void)M; (void)K; (void)ldx; (void)packed; (void)N; (void)bias; (void)residual; (void)y;
    (void)nthreads;
    return 1;
#endif
}
