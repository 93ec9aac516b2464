/* bfloat16 GEMM for the model's linears on the CPU, on a prepacked weight:
 *
 *   y[M, N] = residual + (bf16(x)[M, K] @ W[N, K]^T + bias)      (bias, residual optional, float32)
 *
 *   x        [M, K] rows with stride ldx (elements), float32 (rounded to bfloat16 here, to nearest
 *            even, as torch's .to(torch.bfloat16)) or bfloat16
 *   packed   W (bfloat16) in panels of 16 output columns: panel p is W[16p : 16p+16, :] stored as
 *            [K2][16][2] (K2 = ceil(K / 2) pairs of k; element 2i of column c then 2i+1), the last
 *            panel and an odd K zero-padded; gemm_bf16_pack makes it, gemm_bf16_packed_u16 sizes it
 *   y        [M, N] contiguous, float32 or bfloat16 (rounded once, at the end)
 *
 * Every output is one chain over the k pairs in order, starting from 0: for pair i,
 *     acc = acc + x[2i+1] * w[2i+1];  acc = acc + x[2i] * w[2i]
 * (each product of two bfloat16 values is exact in float32; each add rounded to nearest even;
 * denormal inputs read as zero and denormal results flushed to zero), then + bias, then residual +
 * that. This is what one AVX512-BF16 `vdpbf16ps` does per lane and pair, so on a CPU with
 * AVX512_BF16 the tiles are that instruction ("native"); elsewhere ("emulated") the same chain runs
 * as float32 multiplies and adds under FTZ/DAZ, bitwise the same. Nothing in a chain depends on the
 * number of rows, their tiling or the threads, so a row's output is bitwise the same whatever else
 * is in the call (batch invariance). The torch reference of the chain is
 * evalrun/kernels/ref/linear.py dot_bf16_reference.
 *
 * Tiles: up to 8 rows by 3 panels (24 accumulators in 512-bit registers; one or two rows: 4 panels).
 * A call runs in k-blocks of up to BF_KC pairs (the partial sums stored and reloaded exactly), every
 * bf_tile of a row block on the block's slice while it is in L1/L2. Ranges of panel groups are
 * claimed by the threads of the shared pool (pool.h); a range's last slice prefetches the first of
 * the range its thread claims next. In a decode step the weights stream from memory once, so the
 * prefetches matter: measured on a decode step's 120 linears at 32 rows (Zen 4, 2 threads), one
 * line per tile step spread over the slice, a whole K of 576 per block, 2 ranges per thread and
 * the next range's slice prefetched took 0.88-0.89 of the time of bursts of prefetches at the
 * start of each tile, blocks of 128 pairs and 8 ranges per thread.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#elif defined(__SSE__)
#include <xmmintrin.h>
#endif

#include "kv_load.h"                  /* bf16_from_f32, store_bf16: rows and outputs rounded to bfloat16 */
#include "pool.h"
#include "simd_math.h"                 /* silu_mul8: gemm_bf16_silu's epilogue */

#define BF_PW 16                        /* columns per panel */
#define BF_ZR 8                         /* rows per bf_tile */
#define BF_ZP 3                         /* panels per bf_tile (3+ rows) */
#define BF_FEW_P 4                      /* panels per bf_tile (1-2 rows) */
#ifndef BF_KC
#define BF_KC 288                       /* k pairs per block (a K of 576 in one block) */
#endif
#ifndef BF_A_BLOCK_BYTES
#define BF_A_BLOCK_BYTES (96 * 1024)    /* rows of x (as pairs) kept hot while the panels stream */
#endif
#define BF_MAX_BLOCK_ROWS 96
#ifndef BF_CHUNKS
#define BF_CHUNKS 2                     /* panel-group ranges per thread (claimed dynamically) */
#endif
#define BF_CHUNKS_LARGE 2               /* ... for calls of BF_LARGE_M rows or more (each range re-reads x) */
#define BF_LARGE_M 256
#ifndef BF_PF_HINT
#define BF_PF_HINT _MM_HINT_T0
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define BF_NATIVE 1
#else
#define BF_NATIVE 0
#endif
#if defined(__AVX512F__)
#define BF_Z 1
#else
#define BF_Z 0
#endif

/* 2: the native vdpbf16ps tiles; 1: the emulated chain; 3: AMX tiles (gemm_bf16_amx.h), only when
 * asked for and available, else the default; the first call reads EVALRUN_GEMM_BF16 ("emulate"
 * forces the emulation on a CPU that has the instruction, for comparisons; "amx" the AMX tiles). */
static int bf_path_in_use;
int gemm_bf16_native(void) { return BF_NATIVE; }
int gemm_bf16_amx_available(void);      /* gemm_bf16_amx.h */
int gemm_bf16_set_path(int path) {
    if (path == 3 && !gemm_bf16_amx_available()) path = 2;
    bf_path_in_use = path == 3 ? 3 : path == 2 && BF_NATIVE ? 2 : 1;
    return bf_path_in_use;
}
int gemm_bf16_path(void) {
    if (!bf_path_in_use) {
        const char *env = getenv("EVALRUN_GEMM_BF16");
        gemm_bf16_set_path(!env ? 2 : strcmp(env, "emulate") == 0 ? 1 : strcmp(env, "amx") == 0 ? 3 : 2);
    }
    return bf_path_in_use;
}

static inline int bf_n_pairs(int K) { return (K + 1) / 2; }
int64_t gemm_bf16_packed_u16(int N, int K) { return (int64_t)((N + BF_PW - 1) / BF_PW) * bf_n_pairs(K) * 2 * BF_PW; }

int gemm_bf16_pack(const uint16_t *w, int N, int K, uint16_t *out) {
    if (N < 1 || K < 1) return 1;
    const int np = (N + BF_PW - 1) / BF_PW, K2 = bf_n_pairs(K);
    for (int p = 0; p < np; p++)
        for (int i = 0; i < K2; i++)
            for (int c = 0; c < BF_PW; c++) {
                const int n = p * BF_PW + c, k = 2 * i;
                uint16_t *dst = out + (((int64_t)p * K2 + i) * BF_PW + c) * 2;
                dst[0] = n < N ? w[(int64_t)n * K + k] : 0;
                dst[1] = n < N && k + 1 < K ? w[(int64_t)n * K + k + 1] : 0;
            }
    return 0;
}

typedef struct {
    const uint32_t *xp;              /* x as pairs [M][K2] (element 2i low, 2i+1 high) */
    const uint32_t *packed;          /* panels as dwords */
    const float *bias, *residual;
    void *y;
    int y_bf16;
    int M, N, K2, np;
    int group;                       /* panels per claimed unit */
    int chunks;
    atomic_int next;
    int native;                      /* the path: 2 vdpbf16ps tiles, 1 emulated, 3 AMX */
    int pair;                        /* gemm_bf16_silu: the gate panels (I / 16; np is this), else 0 */
    void *act;                       /* gemm_bf16_silu's output [M, I], float32 or bfloat16 */
    int stream;                      /* float32 y written with non-temporal stores (see gemm_bf16) */
    int act_bf16;                    /* gemm_bf16_silu: act rounded to bfloat16 (bf16_from_f32) */
} bf_Gemm;

static int bf_claim(bf_Gemm *g, int units, int *ub, int *ue) {
    const int c = atomic_fetch_add(&g->next, 1);
    if (c >= g->chunks) return 0;
    *ub = (int)((int64_t)units * c / g->chunks);
    *ue = (int)((int64_t)units * (c + 1) / g->chunks);
    return 1;
}

/* acc [R][P * 16] -> y rows i0.., columns of panels p0 .. p0 + P - 1, with bias and residual. */
static void bf_epilogue(const bf_Gemm *g, int i0, int R, int p0, int P, const float *acc) {
    const int c0 = p0 * BF_PW, cols = P * BF_PW < g->N - c0 ? P * BF_PW : g->N - c0;
    const float *b = g->bias ? g->bias + c0 : 0;
    for (int r = 0; r < R; r++) {
        const float *a = acc + r * P * BF_PW;
        const float *res = g->residual ? g->residual + (int64_t)(i0 + r) * g->N + c0 : 0;
        const int64_t at = (int64_t)(i0 + r) * g->N + c0;
        int j = 0;
#if BF_Z
        if (!g->y_bf16) {           /* float32 out, 16 at a time: the same adds in the same order */
            float *y = (float *)g->y + at;
            for (; j + 16 <= cols; j += 16) {
                __m512 v = _mm512_loadu_ps(a + j);
                if (b) v = _mm512_add_ps(v, _mm512_loadu_ps(b + j));
                if (res) v = _mm512_add_ps(_mm512_loadu_ps(res + j), v);
                if (g->stream) _mm512_stream_ps(y + j, v);
                else _mm512_storeu_ps(y + j, v);
            }
        }
#endif
        for (; j < cols; j++) {
            float v = a[j];
            if (b) v = v + b[j];
            if (res) v = res[j] + v;
            if (g->y_bf16) ((uint16_t *)g->y)[at + j] = bf16_from_f32(v);
            else ((float *)g->y)[at + j] = v;
        }
    }
}

/* gemm_bf16_silu: rows i0.. of gate panels p0 .. p0 + P - 1 (sums acc_g [R][P * 16]) and their up
 * panels (acc_u) -> act = silu(gate) * up, silu_mul_f32's very operations (fused_ops.c), so the
 * same bits as gemm_bf16 then silu_mul_f32. */
#if defined(__SSE__)
static _Thread_local unsigned int bf_csr_caller;   /* MXCSR as the caller had it (bf_run_part) */
#endif
static void bf_epilogue_silu(const bf_Gemm *g, int i0, int R, int p0, int P, const float *acc_g, const float *acc_u) {
#if BF_Z
    const int I = g->pair * BF_PW;
    const unsigned int csr = _mm_getcsr();
    if (g->native == 1) _mm_setcsr(bf_csr_caller);      /* the emulation's FTZ/DAZ are not silu_mul's */
    float row[BF_FEW_P * BF_PW];
    for (int r = 0; r < R; r++) {
        const int64_t at = (int64_t)(i0 + r) * I + p0 * BF_PW;
        float *out = g->act_bf16 ? row : (float *)g->act + at;
        const float *a = acc_g + r * P * BF_PW, *u = acc_u + r * P * BF_PW;
        for (int j = 0; j < P * BF_PW; j += 8)
            _mm256_storeu_ps(out + j, silu_mul8(_mm256_loadu_ps(a + j), _mm256_loadu_ps(u + j)));
        if (g->act_bf16) store_bf16(row, (uint16_t *)g->act + at, P * BF_PW);
    }
    if (g->native == 1) _mm_setcsr(csr);
#else
    (void)g; (void)i0; (void)R; (void)p0; (void)P; (void)acc_g; (void)acc_u;
#endif
}

#include "gemm_bf16_tiles.h"          /* bf_NTILES, bf_ETILES, bf_ctile */

static void bf_tile(const bf_Gemm *g, int R, int P, const uint32_t *x0, int64_t ldp, const uint32_t *bp, int64_t ps,
                 int k0, int kn, float *carry, int first, const uint32_t *pf, int pf_n) {
#if BF_Z
#if BF_NATIVE
    if (g->native == 2) {
        bf_NTILES[P][R](x0, ldp, bp, ps, k0, kn, carry, first, pf, pf_n);
        return;
    }
#endif
    bf_ETILES[P][R](x0, ldp, bp, ps, k0, kn, carry, first, pf, pf_n);
#else
    (void)g;
    bf_ctile(R, P, x0, ldp, bp, ps, k0, kn, carry, first, pf, pf_n);
#endif
}

/* The range a thread takes after its current one, claimed only when the current one's last slice
 * starts: that slice's tiles prefetch the next range's first slice, and a thread holds a range it
 * has not started only for one slice (claimed at the start, one thread took both of 2 ranges). */
typedef struct {
    int claimed, has, ub, ue;
} bf_Next;

static int bf_units(const bf_Gemm *g) { return (g->np + g->group - 1) / g->group; }

/* the next range's first panel, claiming the range if not yet done; -1 where there is none */
static int bf_next_panel(bf_Gemm *g, bf_Next *nx) {
    if (!nx->claimed) {
        nx->claimed = 1;
        nx->has = bf_claim(g, bf_units(g), &nx->ub, &nx->ue);
    }
    return nx->has && nx->ub * g->group < g->np ? nx->ub * g->group : -1;
}

/* Panels [pb, pe) for all rows: blocks of rows that stay in L2, split evenly into tiles of at most
 * BF_ZR rows; per group of P panels and k-block, every bf_tile of the block on the block's slice. */
static void bf_rows_by_panels(bf_Gemm *g, int pb, int pe, bf_Next *nx) {
    const int K2 = g->K2, PG = g->M <= 2 ? BF_FEW_P : BF_ZP;
    const int64_t ps = (int64_t)K2 * BF_PW;
    int mc = BF_A_BLOCK_BYTES / (K2 * 4);
    mc = mc < BF_ZR ? BF_ZR : mc > BF_MAX_BLOCK_ROWS ? BF_MAX_BLOCK_ROWS : mc - mc % BF_ZR;
    const int nkb = (K2 + BF_KC - 1) / BF_KC, kc = (K2 + nkb - 1) / nkb;
    float carry[(BF_MAX_BLOCK_ROWS + BF_ZR) * BF_FEW_P * BF_PW], carry_up[(BF_MAX_BLOCK_ROWS + BF_ZR) * BF_FEW_P * BF_PW];
    const int stride = BF_ZR * BF_FEW_P * BF_PW;
    for (int i0 = 0, i1; i0 < g->M; i0 = i1) {
        i1 = i0 + mc < g->M ? i0 + mc : g->M;
        if (g->M - i1 < BF_ZR) i1 = g->M;
        const int n = i1 - i0, t = (n + BF_ZR - 1) / BF_ZR;
        for (int q = pb; q < pe; q += PG) {
            const int P = pe - q < PG ? pe - q : PG;
            /* gemm_bf16_silu (pair): the gate panels q.., then their up panels q + pair.. into carry_up */
            for (int half = 0; half < (g->pair ? 2 : 1); half++) {
                const uint32_t *panel = g->packed + (int64_t)(q + half * g->pair) * ps;
                float *c = half ? carry_up : carry;
                for (int k0 = 0; k0 < K2; k0 += kc) {
                    const int kn = k0 + kc <= K2 ? kc : K2 - k0;
                    /* the next slice: the rest of these panels, else the up panels (pair, gate half),
                     * else the next group's first (in this range, else in the range claimed next);
                     * P panels of it, its lines shared out over the tiles */
                    const int more = k0 + kn < K2, to_up = !more && g->pair && half == 0;
                    const int last = !more && !to_up && q + PG >= pe && i1 == g->M;
                    const int after = last ? bf_next_panel(g, nx) : -1;
                    const int next_group = to_up || q + PG < pe || after >= 0;
                    const int lines = more ? (K2 - k0 - kn < kc ? K2 - k0 - kn : kc) : next_group ? kc : 0;
                    const int64_t np_next = to_up ? q + g->pair : q + PG < pe ? q + PG : after;
                    const uint32_t *next = more ? panel + (int64_t)(k0 + kn) * BF_PW : g->packed + np_next * ps;
                    const int per = (lines + t - 1) / t;
                    for (int j = 0, i = i0; j < t; j++) {
                        const int R = n / t + (j < n % t);
                        const int lo = j * per < lines ? j * per : lines, hi = lo + per < lines ? lo + per : lines;
                        bf_tile(g, R, P, g->xp + (int64_t)i * K2, K2, panel + (int64_t)k0 * BF_PW, ps, k0, kn,
                                c + j * stride, k0 == 0, next + (int64_t)lo * BF_PW, hi - lo);
                        i += R;
                    }
                }
            }
            for (int j = 0, i = i0; j < t; j++) {
                const int R = n / t + (j < n % t);
                if (g->pair) bf_epilogue_silu(g, i, R, q, P, carry + j * stride, carry_up + j * stride);
                else bf_epilogue(g, i, R, q, P, carry + j * stride);
                i += R;
            }
        }
    }
}

#include "gemm_bf16_amx.h"              /* path 3: bf_amx_rows_by_panels, gemm_bf16_amx_available */

/* FTZ (bit 15) and DAZ (bit 6) for the emulated chain, restored after (AMX tiles ignore MXCSR: their
 * epilogue runs as the native path's). */
static void bf_run_part(void *ctx, int tid, int nth) {
    (void)tid; (void)nth;
    bf_Gemm *g = (bf_Gemm *)ctx;
#if defined(__SSE__)
    const unsigned int csr = _mm_getcsr();
    bf_csr_caller = csr;
    if (g->native == 1) _mm_setcsr(csr | 0x8040u);
#endif
    const int units = bf_units(g);
    bf_Next nx = {1, 0, 0, 0};
    nx.has = bf_claim(g, units, &nx.ub, &nx.ue);
    while (nx.has) {
        const int ub = nx.ub, ue = nx.ue;
        const int pb = ub * g->group, pe = ue * g->group < g->np ? ue * g->group : g->np;
        nx.claimed = 0;
        if (pb < pe) {
            if (g->native == 3) bf_amx_rows_by_panels(g, pb, pe);
            else bf_rows_by_panels(g, pb, pe, &nx);
        }
        if (!nx.claimed) nx.has = bf_claim(g, units, &nx.ub, &nx.ue);
    }
#if defined(__SSE__)
    if (g->native == 1) _mm_setcsr(csr);
#endif
#if BF_Z
    if (g->stream) _mm_sfence();      /* the streamed rows visible before the pool reports the call done */
#endif
}

/* x rows -> pairs [M][K2] (bfloat16 bits; element 2i in the low half), an odd K's last pair padded
 * with 0. */
static void bf_to_pairs(const void *x, int x_bf16, int M, int K, int64_t ldx, uint32_t *xp) {
    const int K2 = bf_n_pairs(K);
    for (int m = 0; m < M; m++) {
        uint16_t *dst = (uint16_t *)(xp + (int64_t)m * K2);
        if (x_bf16) {
            memcpy(dst, (const uint16_t *)x + (int64_t)m * ldx, (size_t)K * 2);
        } else {
            store_bf16((const float *)x + (int64_t)m * ldx, dst, K);
        }
        if (K & 1) dst[K] = 0;
    }
}

/* x rows -> the thread's pair buffer (grown as needed); NULL on a failed allocation. */
static uint32_t *bf_x_pairs(const void *x, int x_bf16, int M, int K, int64_t ldx) {
    const int K2 = bf_n_pairs(K);
    static _Thread_local uint32_t *buf;
    static _Thread_local int64_t buf_len;
    if ((int64_t)M * K2 > buf_len) {
        free(buf);
        buf_len = (int64_t)M * K2;
        buf = (uint32_t *)aligned_alloc(64, (size_t)((buf_len * 4 + 63) / 64 * 64));
        if (!buf) {
            buf_len = 0;
            return 0;
        }
    }
    bf_to_pairs(x, x_bf16, M, K, ldx, buf);
    return buf;
}

/* x as pairs: bfloat16 rows of an even K at a row stride of K are that layout already (read in
 * place); other rows are converted into the thread's buffer. */
static const uint32_t *bf_pairs_of(const void *x, int x_bf16, int M, int K, int64_t ldx) {
    if (x_bf16 && K % 2 == 0 && ldx == K) return (const uint32_t *)x;
    return bf_x_pairs(x, x_bf16, M, K, ldx);
}

static int bf_launch(bf_Gemm *g, int64_t work, int nthreads) {
    const int units = bf_units(g);
    int nth = nthreads < 1 ? 1 : nthreads;
    if (nth > units) nth = units;
    if (work < 65536) nth = 1;
    if (nth > 1) g->chunks = g->M <= 2 ? nth : nth * (g->M >= BF_LARGE_M ? BF_CHUNKS_LARGE : BF_CHUNKS);
    return evalrun_pool_run(bf_run_part, g, nth);
}

/* Returns 0; 1 (nothing done) on invalid sizes or a failed allocation. x_bf16 / y_bf16: 1 when
 * x / y hold bfloat16, 0 float32. */
int gemm_bf16(const void *x, int x_bf16, int M, int K, int64_t ldx, const uint16_t *packed, int N,
              const float *bias, const float *residual, void *y, int y_bf16, int nthreads) {
    if (M < 0 || N < 1 || K < 1 || ldx < K) return 1;
    if (M == 0) return 0;
    const uint32_t *xp = bf_pairs_of(x, x_bf16, M, K, ldx);
    if (!xp) return 1;
    bf_Gemm g = {xp, (const uint32_t *)packed, bias, residual, y, y_bf16, M, N, bf_n_pairs(K), (N + BF_PW - 1) / BF_PW,
              M <= 2 ? BF_FEW_P : BF_ZP, 1, 0, gemm_bf16_path(), 0, 0, 0};
    /* a decode step's LM head writes megabytes of logits while it streams the weights, as in gemm.c:
     * non-temporal stores skip reading lines only to overwrite them (benchmarks/ab_gemm_bf16, 32 x
     * 49152 x 576, 2 threads, Zen 4: 0.959 of the time); 64-byte aligned rows of 16-column multiples */
    g.stream = BF_Z && !y_bf16 && M < BF_LARGE_M && (int64_t)M * N >= (1 << 20) && N % 16 == 0 && ((uintptr_t)y & 63) == 0;
    return bf_launch(&g, (int64_t)M * N * K, nthreads);
}

/* act[M, I] = silu(x W_gate^T) * (x W_up^T) for a packed [gate | up] weight of 2I rows (a gated MLP's
 * input projection and its activation in one pass, the [M, 2I] product never written): each output
 * is silu_mul_f32 of gemm_bf16's own sums, so bitwise the same as the two calls. Returns 0; 2
 * (nothing done) where this path does not apply (no AVX-512, the AMX path, I not a multiple of 16:
 * the caller makes the two calls); 1 on invalid sizes or a failed allocation. act_bf16: act holds
 * bfloat16, each value silu_mul_f32's rounded as bf16_from_f32 (what a bf16 GEMM reading it rounds to). */
int gemm_bf16_silu_supported(int I) {
    return BF_Z && I > 0 && I % BF_PW == 0 && gemm_bf16_path() != 3;
}

int gemm_bf16_silu_to(const void *x, int x_bf16, int M, int K, int64_t ldx, const uint16_t *packed, int I, void *act,
                      int act_bf16, int nthreads) {
    if (M < 0 || I < 1 || K < 1 || ldx < K) return 1;
    if (!gemm_bf16_silu_supported(I)) return 2;
    if (M == 0) return 0;
    const uint32_t *xp = bf_pairs_of(x, x_bf16, M, K, ldx);
    if (!xp) return 1;
    bf_Gemm g = {xp, (const uint32_t *)packed, 0, 0, 0, 0, M, 2 * I, bf_n_pairs(K), I / BF_PW,
              M <= 2 ? BF_FEW_P : BF_ZP, 1, 0, gemm_bf16_path(), I / BF_PW, act, 0, act_bf16 != 0};
    return bf_launch(&g, (int64_t)M * 2 * I * K, nthreads);   /* units: groups of gate panels */
}

/* gemm_bf16_silu_to with float32 act. */
int gemm_bf16_silu(const void *x, int x_bf16, int M, int K, int64_t ldx, const uint16_t *packed, int I, float *act,
                   int nthreads) {
    return gemm_bf16_silu_to(x, x_bf16, M, K, ldx, packed, I, act, 0, nthreads);
}
