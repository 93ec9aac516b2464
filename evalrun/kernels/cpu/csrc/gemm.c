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
 * (evalrun/kernels/linear.py: linear_reference).
 *
 * Rows are taken in tiles of up to 6 (6 rows x 16 columns: 12 accumulators); a call of 1-2 rows
 * uses tiles spanning several panels so a tile still has 8-12 independent chains. A call whose
 * rows fit one block (a decode step) runs in k-blocks of at most KC, so the weights' slice and
 * the rows' slices stay in L1 while every tile uses them; the partial sums are stored and
 * reloaded exactly, so the chain is unchanged. Columns (panels) go to the threads of the
 * shared persistent pool (pool.h).
 *
 * Built with AVX-512 (-march=native on a CPU that has it), the same scheme runs on 512-bit
 * registers (one panel per register, tiles of up to 8 rows by 3 panels: run_part_z); the chains are
 * the same, so the outputs are bitwise those of the AVX2 tiles (gemm_width, gemm_set_width).
 *
 * Without AVX2 and FMA at compile time gemm_supported() returns 0 and nothing else may be called.
 */
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define GEMM_SIMD 1
#else
#define GEMM_SIMD 0
#endif

#include "pool.h"
#include "simd_math.h"

#define PW 16                       /* columns per panel */
#define A_BLOCK_BYTES (192 * 1024)  /* rows of x kept hot while the panels stream */
#define MAX_BLOCK_ROWS 120          /* and at most this many (a multiple of 6) */
#ifndef GEMM_CHUNKS
#define GEMM_CHUNKS 8             /* panel ranges per thread (claimed dynamically) */
#endif
/* A call of many row blocks (a prefill chunk) re-reads x once per claimed range, from L3: there
 * fewer, larger ranges pay (MMLU-shaped prefill, 2 threads, paired A/B: every shape 3-10% faster
 * at 2 ranges per thread than at 8); a decode step's single block keeps the small ranges */
#define LARGE_M 256
#define GEMM_CHUNKS_LARGE 2
#define CARRY_FLOATS ((MAX_BLOCK_ROWS + 16) * 4 * PW)   /* every tile of a block, either width */

int gemm_supported(void) { return GEMM_SIMD; }

/* The tiles in use: 512 (AVX-512, where the library was built with it) or 256 (AVX2); both give
 * bitwise the same outputs. The first call reads EVALRUN_GEMM_WIDTH (256 keeps an AVX-512 CPU on
 * the AVX2 tiles); gemm_set_width changes it later (for comparisons). Both return the width in use. */
static int width_in_use;            /* 0 until chosen */
static int widest(void) {
#if defined(__AVX512F__)
    return 512;
#else
    return GEMM_SIMD ? 256 : 0;
#endif
}
int gemm_set_width(int width) {
    width_in_use = width == 256 && widest() >= 256 ? 256 : widest();
    return width_in_use;
}
int gemm_width(void) {
    if (!width_in_use) {
        const char *env = getenv("EVALRUN_GEMM_WIDTH");
        gemm_set_width(env && strcmp(env, "256") == 0 ? 256 : 512);
    }
    return width_in_use;
}

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
    int chunks;                    /* the panel units are split into this many ranges, */
    atomic_int next;               /* claimed one at a time by the threads */
    int stream;                    /* y written with non-temporal stores (see gemm_f32) */
    int pair;                      /* gemm_silu_f32: the gate panels (I / 16), else 0 */
    float *act;                    /* gemm_silu_f32's output [M, I] */
} Gemm;

/* Ranges of panel units [ub, ue) claimed until none are left: a thread that the OS takes off its
 * core holds up only the range it holds, not a fixed half of the panels (on a shared 2-core
 * machine a static split waited for the slower thread at every call). Which thread computes a
 * column does not change its chain, so outputs are the same bitwise. */
static int claim(Gemm *g, int units, int *ub, int *ue) {
    const int c = atomic_fetch_add(&g->next, 1);
    if (c >= g->chunks) return 0;
    *ub = (int)((int64_t)units * c / g->chunks);
    *ue = (int)((int64_t)units * (c + 1) / g->chunks);
    return 1;
}

/* acc [R][P*16] -> y rows i0.., columns from panel p0, with bias and residual. */
static void epilogue(const Gemm *g, int i0, int R, int p0, int P, const float *acc) {
    const int c0 = p0 * PW, cols = (P * PW < g->N - c0) ? P * PW : g->N - c0;
    for (int r = 0; r < R; r++) {
        const float *a = acc + r * P * PW;
        float *y = g->y + (int64_t)(i0 + r) * g->N + c0;
        /* the same columns R rows on (the next tile's): their lines arrive while these are stored,
         * instead of each store waiting for its line (in a prefill call y is tens of MB) */
        if (!g->stream)
            for (int j = 0; j < cols; j += 16) _mm_prefetch((const char *)(y + (int64_t)R * g->N + j), _MM_HINT_T0);
        const float *res = g->residual ? g->residual + (int64_t)(i0 + r) * g->N + c0 : 0;
        const float *b = g->bias ? g->bias + c0 : 0;
        int j = 0;
        for (; j + 8 <= cols; j += 8) {
            __m256 v = _mm256_loadu_ps(a + j);
            if (b) v = _mm256_add_ps(v, _mm256_loadu_ps(b + j));
            if (res) v = _mm256_add_ps(_mm256_loadu_ps(res + j), v);
            if (g->stream) _mm256_stream_ps(y + j, v);      /* aligned: see gemm_f32 */
            else _mm256_storeu_ps(y + j, v);
        }
        for (; j < cols; j++) {
            float v = a[j];
            if (b) v = v + b[j];
            if (res) v = res[j] + v;
            y[j] = v;
        }
    }
}

/* gemm_silu_f32: rows i0.. of gate panel p0 (sums acc_g [R][16]) and its up panel (acc_u) ->
 * act = silu(gate) * up, the very operations of silu_mul_f32 (fused_ops.c), so the same bits. */
static void epilogue_silu(const Gemm *g, int i0, int R, int p0, const float *acc_g, const float *acc_u) {
    const int I = g->pair * PW;
    for (int r = 0; r < R; r++) {
        float *out = g->act + (int64_t)(i0 + r) * I + p0 * PW;
        for (int j = 0; j < PW; j += 8)
            _mm256_storeu_ps(out + j, silu_mul8(_mm256_loadu_ps(acc_g + r * PW + j), _mm256_loadu_ps(acc_u + r * PW + j)));
    }
}

/* The k-blocked tile: rows i0 .. i0 + R - 1 (R = 1..6, a compile-time constant after inlining)
 * by one panel, over k in [k0, k0 + kn). 2 R accumulators written out by name (GCC keeps an array
 * of them in memory). They start from 0 when `first`, else from carry [R][16], and are left in
 * carry: a k-block's slice of the panel (KC x 64 bytes) and the tiles' rows stay in L1 while all
 * the tiles of a block use it, and storing and reloading a float32 sum is exact, so each output is
 * still one chain over k in order. The first pf_n steps also prefetch one line each of pf (the
 * next slice of the weights). */
#define KC 128
#define ROW(r, c0, c1)                                                                            \
    if (R > r) {                                                                                  \
        const __m256 a_ = _mm256_broadcast_ss(x##r + k);                                          \
        c0 = _mm256_fmadd_ps(a_, b0, c0);                                                         \
        c1 = _mm256_fmadd_ps(a_, b1, c1);                                                         \
    }
#define ROWS                                                                                      \
    const __m256 b0 = _mm256_loadu_ps(bp), b1 = _mm256_loadu_ps(bp + 8);                          \
    ROW(0, c00, c01) ROW(1, c10, c11) ROW(2, c20, c21) ROW(3, c30, c31) ROW(4, c40, c41) ROW(5, c50, c51)

static inline __attribute__((always_inline)) void ktile(const int R, const float *x0, int64_t ldx, const float *bp,
                                                       int k0, int kn, float *carry, int first, const float *pf,
                                                       int pf_n) {
    const float *x1 = R > 1 ? x0 + ldx : x0, *x2 = R > 2 ? x1 + ldx : x1, *x3 = R > 3 ? x2 + ldx : x2,
                *x4 = R > 4 ? x3 + ldx : x3, *x5 = R > 5 ? x4 + ldx : x4;
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00,
           c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    float *cr = carry;
    if (!first) {
        c00 = _mm256_loadu_ps(cr); c01 = _mm256_loadu_ps(cr + 8);
        if (R > 1) { c10 = _mm256_loadu_ps(cr + 16); c11 = _mm256_loadu_ps(cr + 24); }
        if (R > 2) { c20 = _mm256_loadu_ps(cr + 32); c21 = _mm256_loadu_ps(cr + 40); }
        if (R > 3) { c30 = _mm256_loadu_ps(cr + 48); c31 = _mm256_loadu_ps(cr + 56); }
        if (R > 4) { c40 = _mm256_loadu_ps(cr + 64); c41 = _mm256_loadu_ps(cr + 72); }
        if (R > 5) { c50 = _mm256_loadu_ps(cr + 80); c51 = _mm256_loadu_ps(cr + 88); }
    }
    const int ke = k0 + kn, kp = k0 + (pf_n < kn ? pf_n : kn);
    int k = k0;
    for (; k < kp; k++, bp += PW, pf += PW) {
        _mm_prefetch((const char *)pf, _MM_HINT_T0);
        ROWS
    }
    _Pragma("GCC unroll 4") for (; k < ke; k++, bp += PW) { ROWS }
    _mm256_storeu_ps(cr, c00); _mm256_storeu_ps(cr + 8, c01);
    if (R > 1) { _mm256_storeu_ps(cr + 16, c10); _mm256_storeu_ps(cr + 24, c11); }
    if (R > 2) { _mm256_storeu_ps(cr + 32, c20); _mm256_storeu_ps(cr + 40, c21); }
    if (R > 3) { _mm256_storeu_ps(cr + 48, c30); _mm256_storeu_ps(cr + 56, c31); }
    if (R > 4) { _mm256_storeu_ps(cr + 64, c40); _mm256_storeu_ps(cr + 72, c41); }
    if (R > 5) { _mm256_storeu_ps(cr + 80, c50); _mm256_storeu_ps(cr + 88, c51); }
}
#undef ROWS
#undef ROW

typedef void (*TileFn)(const float *, int64_t, const float *, int, int, float *, int, const float *, int);
#define KTILE(n)                                                                                  \
    static void ktile##n(const float *x0, int64_t ldx, const float *bp, int k0, int kn, float *carry, int first, \
                         const float *pf, int pf_n) {                                             \
        ktile(n, x0, ldx, bp, k0, kn, carry, first, pf, pf_n);                                    \
    }
KTILE(1) KTILE(2) KTILE(3) KTILE(4) KTILE(5) KTILE(6)
static const TileFn TILES[7] = {0, ktile1, ktile2, ktile3, ktile4, ktile5, ktile6};

/* Rows i0 .. i0 + R - 1 (R <= 6) by panel p0 over all of k, stored. */
static void tile_rows(const Gemm *g, int i0, int R, int p0) {
    float out[6 * PW];
    const float *panel = g->packed + (int64_t)p0 * g->K * PW;
    TILES[R](g->x + (int64_t)i0 * g->ldx, g->ldx, panel + 0, 0, g->K, out, 1, 0, 0);
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

/* One or two rows (a memory-bound decode step) over panels [pb, pe): one row four panels at a
 * time, two rows three at a time (8-12 chains per tile), the panels left one at a time. */
static void few_rows(const Gemm *g, int pb, int pe) {
    int p = pb;
    if (g->M == 1)
        for (; p + 4 <= pe; p += 4) tile_1x4(g, 0, p, p + 8 <= g->np);
    else
        for (; p + 3 <= pe; p += 3) tile_2x3(g, 0, 2, p);
    for (; p < pe; p++) tile_rows(g, 0, g->M, p);
}

/* A tile call of either width: rows x0.. (stride ldx) by P panels from bp (panel stride ps) over
 * k in [k0, k0 + kn); carry [R][P * 16]; prefetching pf_n lines of each panel of the next slice pf. */
typedef void (*AnyTile)(int R, int P, const float *x0, int64_t ldx, const float *bp, int64_t ps, int k0, int kn,
                        float *carry, int first, const float *pf, int pf_n);

/* Rows >= 3 over panels [pb, pe): blocks of rows that stay in L2, split evenly into tiles of at
 * most MR rows (32 rows at MR 6: 6,6,5,5,5,5, not 5 x 6 and a 2-row tail), by groups of PG panels
 * (the last group may be smaller); for each group and each k-block every tile of the block runs on
 * the block's slice while it is in L1, and the tiles prefetch the next slice of the weights between
 * them (in a decode step the weights stream from memory). */
static void blocked_rows(const Gemm *g, int pb, int pe, const int MR, const int PG, AnyTile tile) {
    const int K = g->K;
    const int64_t ps = (int64_t)K * PW;
    int mc = A_BLOCK_BYTES / (K * 4);
    mc = mc < MR ? MR : mc > MAX_BLOCK_ROWS ? MAX_BLOCK_ROWS - MAX_BLOCK_ROWS % MR : mc - mc % MR;
    /* k-blocks when the rows are one block (a decode step: weights stream from memory once);
     * many blocks (prefill) run each tile over all of k, which saves the carry traffic */
    const int one_block = g->M < mc + MR, nkb = one_block ? (K + KC - 1) / KC : 1, kc = (K + nkb - 1) / nkb;
    float carry[CARRY_FLOATS], carry_up[CARRY_FLOATS];
    const int stride = MR * PG * PW;                 /* one tile's carry */
    for (int i0 = 0, i1; i0 < g->M; i0 = i1) {
        /* blocks of mc rows; the last block takes the rest (and a rest under MR rows joins the
         * block before it), split into even tiles */
        i1 = i0 + mc < g->M ? i0 + mc : g->M;
        if (g->M - i1 < MR) i1 = g->M;
        const int n = i1 - i0, t = (n + MR - 1) / MR;
        for (int q = pb; q < pe; q += PG) {
            const int P = pe - q < PG ? pe - q : PG;
            /* gemm_silu_f32 (pair): gate panel q, then its up panel q + pair into carry_up */
            for (int half = 0; half < (g->pair ? 2 : 1); half++) {
                const float *panel = g->packed + (q + half * g->pair) * ps;
                float *c = half ? carry_up : carry;
                /* after the last slice: the up panel (pair, gate half), else the next group */
                const int more = g->pair ? (half == 0 || q + P < g->pair) : q + P < g->np;
                const float *after = g->pair && half == 0 ? g->packed + (q + g->pair) * ps
                                                          : g->packed + (q + P) * ps;
                for (int k0 = 0; k0 < K; k0 += kc) {
                    const int kn = k0 + kc <= K ? kc : K - k0;
                    /* the slice after this one (the rest of these panels, else the next group's
                     * first), prefetched in equal parts by the tiles */
                    const int rest = k0 + kn < K ? K - k0 - kn : (more ? K : 0);
                    const int lines = rest < kc ? rest : kc, per = (lines + t - 1) / t;
                    const float *next = k0 + kn < K ? panel + (int64_t)(k0 + kn) * PW : after;
                    for (int j = 0, i = i0; j < t; j++) {
                        const int R = n / t + (j < n % t);
                        const int lo = j * per < lines ? j * per : lines, hi = lo + per < lines ? lo + per : lines;
                        tile(R, P, g->x + (int64_t)i * g->ldx, g->ldx, panel + (int64_t)k0 * PW, ps, k0, kn,
                             c + j * stride, k0 == 0, next + (int64_t)lo * PW, hi - lo);
                        i += R;
                    }
                }
            }
            for (int j = 0, i = i0; j < t; j++) {
                const int R = n / t + (j < n % t);
                if (g->pair) epilogue_silu(g, i, R, q, carry + j * stride, carry_up + j * stride);
                else epilogue(g, i, R, q, P, carry + j * stride);
                i += R;
            }
        }
    }
}

static void avx2_tile(int R, int P, const float *x0, int64_t ldx, const float *bp, int64_t ps, int k0, int kn,
                      float *carry, int first, const float *pf, int pf_n) {
    (void)P; (void)ps;                               /* one panel */
    TILES[R](x0, ldx, bp, k0, kn, carry, first, pf, pf_n);
}

/* Claimed ranges of panels, all rows. One or two rows (a memory-bound decode step) go through the
 * wide 1 x 64 and 2 x 48 tiles, more rows through blocked_rows' tiles of up to 6 rows by one panel. */
static void run_part(void *ctx, int tid, int nth) {
    (void)tid; (void)nth;
    Gemm *g = (Gemm *)ctx;
    for (int pb, pe; claim(g, g->pair ? g->pair : g->np, &pb, &pe);) {
        if (pb >= pe) continue;
        if (g->M <= 2)
            few_rows(g, pb, pe);
        else
            blocked_rows(g, pb, pe, 6, 1, avx2_tile);
    }
    if (g->stream) _mm_sfence();    /* the streamed rows visible before the call returns */
}


#if defined(__AVX512F__)
/* ---- AVX-512: a panel is one 512-bit register -------------------------------------------------
 * The same chains as the AVX2 tiles (each output one FMA chain over k in order, the same k-blocks
 * and carries), so both paths give bitwise the same outputs; only the register width differs. A
 * tile is R rows (1..8) by P panels (1..4): up to 24 accumulators in registers. Rows >= 3 take
 * 8 x 3 tiles (24 chains; per k 11 loads for 24 FMAs), one or two rows 1 x 4 and 2 x 4 tiles.
 * Against 8 x 2 (interleaved runs, 2 threads, a 480 MB-L3 Xeon with AVX-512): 1600 rows 84-90% ->
 * 94-105% of the 2048^3 sgemm roof on the gate/up and down shapes, 32 rows 80-87% -> 91-98%. */
#define ZR 8                        /* rows per tile */
#define ZP 3                        /* panels per tile, rows >= 3 */
#define ZB(p) const __m512 b##p = P > p ? _mm512_loadu_ps(bp + p * ps) : _mm512_setzero_ps();
#define ZF(r, p) if (P > p) c##r##p = _mm512_fmadd_ps(a_, b##p, c##r##p);
#define ZROW(r)                                                                                   \
    if (R > r) {                                                                                  \
        const __m512 a_ = _mm512_set1_ps(x##r[k]);                                                \
        ZF(r, 0) ZF(r, 1) ZF(r, 2) ZF(r, 3)                                                       \
    }
#define ZSTEP ZB(0) ZB(1) ZB(2) ZB(3) ZROW(0) ZROW(1) ZROW(2) ZROW(3) ZROW(4) ZROW(5) ZROW(6) ZROW(7)
#define ZEACH_P(M, r) M(r, 0) M(r, 1) M(r, 2) M(r, 3)
#define ZEACH(M) ZEACH_P(M, 0) ZEACH_P(M, 1) ZEACH_P(M, 2) ZEACH_P(M, 3) ZEACH_P(M, 4) ZEACH_P(M, 5) \
    ZEACH_P(M, 6) ZEACH_P(M, 7)
#define ZDECL(r, p) __m512 c##r##p = _mm512_setzero_ps();
#define ZLOAD(r, p) if (R > r && P > p) c##r##p = _mm512_loadu_ps(carry + (r * P + p) * PW);
#define ZSTORE(r, p) if (R > r && P > p) _mm512_storeu_ps(carry + (r * P + p) * PW, c##r##p);

/* Rows x0.. (stride ldx) by panels bp, bp + ps, .. (bp at the block's first k) over kn steps
 * from k0; carry [R][P * 16] as in ktile. Prefetches the first pf_n lines of each of the P panels
 * at pf (the next slice), spread over the steps. */
static inline __attribute__((always_inline)) void ztile(const int R, const int P, const float *x0, int64_t ldx,
                                                       const float *bp, int64_t ps, int k0, int kn, float *carry,
                                                       int first, const float *pf, int pf_n) {
    const float *x1 = R > 1 ? x0 + ldx : x0, *x2 = R > 2 ? x1 + ldx : x1, *x3 = R > 3 ? x2 + ldx : x2,
                *x4 = R > 4 ? x3 + ldx : x3, *x5 = R > 5 ? x4 + ldx : x4, *x6 = R > 6 ? x5 + ldx : x5,
                *x7 = R > 7 ? x6 + ldx : x6;
    ZEACH(ZDECL)
    if (!first) { ZEACH(ZLOAD) }
    /* the pf_n x P lines to prefetch, spread evenly over the kn steps (line j: row j / P of panel
     * j % P): issued P at a time in the first steps, they filled the line-fill buffers in bursts
     * and stalled the FMAs, so streaming the weights and computing on them did not overlap. The
     * line's address is stepped, not computed from j: with a division and a multiply per line
     * the prefetching steps cost 7-11% of every 32-row call, hot or cold (probe, 2 threads) */
    const int ke = k0 + kn, nl = pf_n * P, per_step = kn > 0 ? (nl + kn - 1) / kn : 0;
    const char *line = (const char *)pf;
    const int64_t down = ps * 4, back = (PW - (int64_t)P * ps) * 4;   /* bytes */
    int k = k0, j = 0, p = 0;
#define ZNEXT_LINE                                                                                \
    {                                                                                             \
        _mm_prefetch(line, _MM_HINT_T0);                                                          \
        line += down;                                                                             \
        if (++p == P) { line += back; p = 0; }                                                    \
    }
    if (per_step == 1)
        for (; j < nl && k < ke; k++, j++, bp += PW) { ZNEXT_LINE ZSTEP }
    else
        for (; j < nl && k < ke; k++, bp += PW) {
            for (int i = 0; i < per_step && j < nl; i++, j++) ZNEXT_LINE
            ZSTEP
        }
#undef ZNEXT_LINE
    _Pragma("GCC unroll 4") for (; k < ke; k++, bp += PW) { ZSTEP }
    ZEACH(ZSTORE)
}

typedef void (*ZTileFn)(const float *, int64_t, const float *, int64_t, int, int, float *, int, const float *, int);
#define ZTILE(r, p)                                                                               \
    static void ztile##r##x##p(const float *x0, int64_t ldx, const float *bp, int64_t ps, int k0, int kn,   \
                               float *carry, int first, const float *pf, int pf_n) {              \
        ztile(r, p, x0, ldx, bp, ps, k0, kn, carry, first, pf, pf_n);                             \
    }
#define ZTILES_P(p) ZTILE(1, p) ZTILE(2, p) ZTILE(3, p) ZTILE(4, p) ZTILE(5, p) ZTILE(6, p) ZTILE(7, p) ZTILE(8, p)
ZTILES_P(1) ZTILES_P(2) ZTILES_P(3) ZTILE(1, 4) ZTILE(2, 4)
#define ZROW_FNS(p) {0, ztile1x##p, ztile2x##p, ztile3x##p, ztile4x##p, ztile5x##p, ztile6x##p, ztile7x##p, ztile8x##p}
static const ZTileFn ZTILES[ZP + 1][ZR + 1] = {{0}, ZROW_FNS(1), ZROW_FNS(2), ZROW_FNS(3)};
static const ZTileFn ZFEW[3][5] = {{0}, {0, ztile1x1, ztile1x2, ztile1x3, ztile1x4}, {0, ztile2x1, ztile2x2, ztile2x3, ztile2x4}};

static void ztile_any(int R, int P, const float *x0, int64_t ldx, const float *bp, int64_t ps, int k0, int kn,
                      float *carry, int first, const float *pf, int pf_n) {
    ZTILES[P][R](x0, ldx, bp, ps, k0, kn, carry, first, pf, pf_n);
}

/* Claimed ranges of panel triples. One or two rows: tiles of 4 panels over all of k. More rows:
 * blocked_rows with tiles of up to 8 rows by 3 panels. */
static void run_part_z(void *ctx, int tid, int nth) {
    (void)tid; (void)nth;
    Gemm *g = (Gemm *)ctx;
    const int units = (g->np + ZP - 1) / ZP;
    const int64_t ps = (int64_t)g->K * PW;
    for (int ub, ue; claim(g, units, &ub, &ue);) {
        const int pb = ub * ZP, pe = ue * ZP < g->np ? ue * ZP : g->np;
        if (pb >= pe) continue;
        if (g->M > 2) {
            blocked_rows(g, pb, pe, ZR, ZP, ztile_any);
            continue;
        }
        float carry[2 * 4 * PW];
        for (int q = pb; q < pe; q += 4) {
            const int P = pe - q < 4 ? pe - q : 4;
            ZFEW[g->M][P](g->x, g->ldx, g->packed + q * ps, ps, 0, g->K, carry, 1, g->packed + (q + P) * ps,
                          q + P < g->np ? g->K : 0);
            epilogue(g, 0, g->M, q, P, carry);
        }
    }
    if (g->stream) _mm_sfence();
}
#define GEMM_Z 1
#else
#define GEMM_Z 0
#endif

#endif

#if GEMM_SIMD
/* The threads for a call over `units` claimable panel units (at most one each), and the claim
 * ranges they share (g->chunks). */
static int plan_threads(Gemm *g, int units, int nthreads) {
    int nth = nthreads < 1 ? 1 : nthreads;
    if (nth > units) nth = units;
    /* below ~64k multiply-adds a second thread costs more than it saves */
    if ((int64_t)g->M * g->N * g->K < 65536) nth = 1;
    /* one or two rows stream the weights from memory: one long range per thread keeps each stream
     * whole (ranges of a sixteenth made a 1-row call 1.25x slower here); more rows claim smaller ones,
     * calls of LARGE_M rows or more fewer (each range re-reads x) */
    if (nth > 1) g->chunks = g->M <= 2 ? nth : nth * (g->M >= LARGE_M ? GEMM_CHUNKS_LARGE : GEMM_CHUNKS);
    return nth;
}
#endif

/* Returns 0, or 1 (nothing done) when the library lacks AVX2/FMA or a size is invalid. */
int gemm_f32(const float *x, int M, int K, int64_t ldx, const float *packed, int N, const float *bias,
             const float *residual, float *y, int nthreads) {
#if GEMM_SIMD
    if (M < 0 || N < 1 || K < 1 || ldx < K) return 1;
    if (M == 0) return 0;
    Gemm g = {x, packed, bias, residual, y, ldx, M, N, K, (N + PW - 1) / PW, 1, 0, 0, 0, 0};
    /* A decode step's LM head writes megabytes of logits while it streams the weights: the lines
     * would be read in only to be overwritten, and are evicted by the weights before the sampler
     * reads them. Non-temporal stores skip that read (interleaved A/B, 32 x 49152 x 576, 2 threads,
     * AVX2: 0.955 of the time); prefill-sized calls (M >= LARGE_M) gained nothing. Every 8-column
     * store must be 32-byte aligned: y aligned and N a multiple of 8. */
    g.stream = M < LARGE_M && (int64_t)M * N >= (1 << 20) && N % 8 == 0 && ((uintptr_t)y & 31) == 0;
    const int nth = plan_threads(&g, g.np, nthreads);
#if GEMM_Z
    if (gemm_width() == 512) return evalrun_pool_run(run_part_z, &g, nth);
#endif
    return evalrun_pool_run(run_part, &g, nth);
#else
    (void)x; (void)M; (void)K; (void)ldx; (void)packed; (void)N; (void)bias; (void)residual; (void)y;
    (void)nthreads;
    return 1;
#endif
}

/* act[M, I] = silu(x W_gate^T) * (x W_up^T) for a packed [gate | up] weight of 2I rows (a gated
 * MLP's input projection and its activation in one pass: the [M, 2I] product is never written).
 * Each output is silu_mul_f32 of gemm_f32's own sums, so bitwise the same as the two calls.
 * Returns 0; 2 (nothing done) where this path does not apply: AVX-512 tiles in use, 1-2 rows, or I
 * not a multiple of 16 (the caller then makes the two calls); 1 on invalid sizes. */
int gemm_silu_supported(int M, int I) {
#if GEMM_SIMD
    return M > 2 && I > 0 && I % PW == 0 && gemm_width() == 256;
#else
    (void)M; (void)I;
    return 0;
#endif
}

int gemm_silu_f32(const float *x, int M, int K, int64_t ldx, const float *packed, int I, float *act, int nthreads) {
#if GEMM_SIMD
    if (M < 0 || I < 1 || K < 1 || ldx < K) return 1;
    if (!gemm_silu_supported(M, I)) return 2;
    Gemm g = {x, packed, 0, 0, 0, ldx, M, 2 * I, K, 2 * I / PW, 1, 0, 0, I / PW, act};
    return evalrun_pool_run(run_part, &g, plan_threads(&g, g.pair, nthreads));   /* units: gate panels */
#else
    (void)x; (void)M; (void)K; (void)ldx; (void)packed; (void)I; (void)act; (void)nthreads;
    return 1;
#endif
}
