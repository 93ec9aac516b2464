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

#include "pool.h"

#define BF_PW 16                        /* columns per panel */
#define BF_ZR 8                         /* rows per bf_tile */
#define BF_ZP 3                         /* panels per bf_tile (3+ rows) */
#define BF_FEW_P 4                      /* panels per bf_tile (1-2 rows) */
#ifndef BF_KC
#define BF_KC 288                       /* k pairs per block (a K of 576 in one block) */
#endif
#define BF_A_BLOCK_BYTES (96 * 1024)    /* rows of x (as pairs) kept hot while the panels stream */
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

/* float32 -> bfloat16 bits, round to nearest even (torch's rule; NaN stays a quiet NaN). */
static inline uint16_t bf_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
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
        if (!g->y_bf16)             /* float32 out, 16 at a time: the same adds in the same order */
            for (float *y = (float *)g->y + at; j + 16 <= cols; j += 16) {
                __m512 v = _mm512_loadu_ps(a + j);
                if (b) v = _mm512_add_ps(v, _mm512_loadu_ps(b + j));
                if (res) v = _mm512_add_ps(_mm512_loadu_ps(res + j), v);
                _mm512_storeu_ps(y + j, v);
            }
#endif
        for (; j < cols; j++) {
            float v = a[j];
            if (b) v = v + b[j];
            if (res) v = res[j] + v;
            if (g->y_bf16) ((uint16_t *)g->y)[at + j] = bf_to_bf16(v);
            else ((float *)g->y)[at + j] = v;
        }
    }
}

/* ---- the tiles: R rows (x0.., stride ldp pairs) by P panels (bp, bp + ps, ..; bp at pair k0) over
 * kn pairs from k0; sums start from 0 when `first`, else from carry [R][P * 16], and are left there. */
typedef void (*bf_TileFn)(const uint32_t *x0, int64_t ldp, const uint32_t *bp, int64_t ps, int k0, int kn,
                       float *carry, int first, const uint32_t *pf, int pf_n);

#if BF_Z
#define BF_ZEACH_P(M, r) M(r, 0) M(r, 1) M(r, 2) M(r, 3)
#define BF_ZEACH(M) BF_ZEACH_P(M, 0) BF_ZEACH_P(M, 1) BF_ZEACH_P(M, 2) BF_ZEACH_P(M, 3) BF_ZEACH_P(M, 4) BF_ZEACH_P(M, 5) \
    BF_ZEACH_P(M, 6) BF_ZEACH_P(M, 7)
#define BF_ZDECL(r, p) __m512 c##r##p = _mm512_setzero_ps();
#define BF_ZLOAD(r, p) if (R > r && P > p) c##r##p = _mm512_loadu_ps(carry + (r * P + p) * BF_PW);
#define BF_ZSTORE(r, p) if (R > r && P > p) _mm512_storeu_ps(carry + (r * P + p) * BF_PW, c##r##p);
#define BF_XROWS                                                                                     \
    const uint32_t *x1 = R > 1 ? x0 + ldp : x0, *x2 = R > 2 ? x1 + ldp : x1, *x3 = R > 3 ? x2 + ldp : x2, \
                   *x4 = R > 4 ? x3 + ldp : x3, *x5 = R > 5 ? x4 + ldp : x4, *x6 = R > 6 ? x5 + ldp : x5, \
                   *x7 = R > 7 ? x6 + ldp : x6;

#if BF_NATIVE
/* native: one vdpbf16ps per row, panel and pair */
#define BF_NB(p) const __m512i b##p = P > p ? _mm512_loadu_si512(bp + p * ps) : _mm512_setzero_si512();
#define BF_NF(r, p) if (P > p) c##r##p = _mm512_dpbf16_ps(c##r##p, (__m512bh)a_, (__m512bh)b##p);
#define BF_NROW(r)                                                                                   \
    if (R > r) {                                                                                  \
        const __m512i a_ = _mm512_set1_epi32((int)x##r[k]);                                       \
        BF_NF(r, 0) BF_NF(r, 1) BF_NF(r, 2) BF_NF(r, 3)                                                       \
    }
#define BF_NSTEP BF_NB(0) BF_NB(1) BF_NB(2) BF_NB(3) BF_NROW(0) BF_NROW(1) BF_NROW(2) BF_NROW(3) BF_NROW(4) BF_NROW(5) BF_NROW(6) BF_NROW(7)

#define BF_PF(p) if (P > p) _mm_prefetch((const char *)(pf + p * ps), BF_PF_HINT);

/* ... and the tile prefetches pf_n lines of each panel of the next slice pf, one line per step
 * (panel after panel) where the steps suffice, else one line of each panel per step (the weights
 * stream from memory in a decode step: the tiles of a block fetch the next slice between them) */
static inline __attribute__((always_inline)) void bf_ntile(const int R, const int P, const uint32_t *x0, int64_t ldp,
                                                       const uint32_t *bp, int64_t ps, int k0, int kn,
                                                       float *carry, int first, const uint32_t *pf, int pf_n) {
    BF_XROWS
    BF_ZEACH(BF_ZDECL)
    if (!first) { BF_ZEACH(BF_ZLOAD) }
    const int ke = k0 + kn, kp = k0 + (pf_n < kn ? pf_n : kn);
    int k = k0;
    if (P * (kp - k0) <= kn) {          /* spread out: one line a step, panel after panel */
        const int kq = k0 + P * (kp - k0);
        for (int pp = 0; k < kq; k++, bp += BF_PW) {
            _mm_prefetch((const char *)(pf + pp * ps), BF_PF_HINT);
            if (++pp == P) { pp = 0; pf += BF_PW; }
            BF_NSTEP
        }
    }
    for (; k < kp; k++, bp += BF_PW, pf += BF_PW) { BF_PF(0) BF_PF(1) BF_PF(2) BF_PF(3) BF_NSTEP }
    _Pragma("GCC unroll 2") for (; k < ke; k++, bp += BF_PW) { BF_NSTEP }
    BF_ZEACH(BF_ZSTORE)
}
#endif

/* emulated: the same chain as float32 fused multiply-adds under FTZ/DAZ (run_part sets them): each
 * product is exact, added to the sum with one rounding, a denormal sum flushed to a signed zero, as
 * vdpbf16ps does (a tiny product is not flushed before the add: checked against the instruction) */
#define BF_HI_MASK _mm512_set1_epi32((int)0xffff0000u)
#define BF_EB(p)                                                                                     \
    const __m512i w##p = P > p ? _mm512_loadu_si512(bp + p * ps) : _mm512_setzero_si512();        \
    const __m512 bo##p = _mm512_castsi512_ps(_mm512_and_si512(w##p, hi)),                         \
                 be##p = _mm512_castsi512_ps(_mm512_slli_epi32(w##p, 16));
#define BF_EF(r, p)                                                                                  \
    if (P > p) {                                                                                  \
        c##r##p = _mm512_fmadd_ps(ao_, bo##p, c##r##p);                                           \
        c##r##p = _mm512_fmadd_ps(ae_, be##p, c##r##p);                                           \
    }
#define BF_EROW(r)                                                                                   \
    if (R > r) {                                                                                  \
        const uint32_t v_ = x##r[k];                                                              \
        const uint32_t o_ = v_ & 0xffff0000u, e_ = v_ << 16;                                      \
        float fo_, fe_;                                                                           \
        memcpy(&fo_, &o_, 4);                                                                     \
        memcpy(&fe_, &e_, 4);                                                                     \
        const __m512 ao_ = _mm512_set1_ps(fo_), ae_ = _mm512_set1_ps(fe_);                        \
        BF_EF(r, 0) BF_EF(r, 1) BF_EF(r, 2) BF_EF(r, 3)                                                       \
    }
#define BF_ESTEP BF_EB(0) BF_EB(1) BF_EB(2) BF_EB(3) BF_EROW(0) BF_EROW(1) BF_EROW(2) BF_EROW(3) BF_EROW(4) BF_EROW(5) BF_EROW(6) BF_EROW(7)

static inline __attribute__((always_inline)) void bf_etile(const int R, const int P, const uint32_t *x0, int64_t ldp,
                                                       const uint32_t *bp, int64_t ps, int k0, int kn,
                                                       float *carry, int first, const uint32_t *pf, int pf_n) {
    (void)pf; (void)pf_n;
    BF_XROWS
    BF_ZEACH(BF_ZDECL)
    if (!first) { BF_ZEACH(BF_ZLOAD) }
    const __m512i hi = BF_HI_MASK;
    const int ke = k0 + kn;
    for (int k = k0; k < ke; k++, bp += BF_PW) { BF_ESTEP }
    BF_ZEACH(BF_ZSTORE)
}

#define BF_DEFINE_TILE(kind, r, p)                                                                   \
    static void kind##r##x##p(const uint32_t *x0, int64_t ldp, const uint32_t *bp, int64_t ps, int k0, int kn, \
                              float *carry, int first, const uint32_t *pf, int pf_n) {            \
        kind(r, p, x0, ldp, bp, ps, k0, kn, carry, first, pf, pf_n);                              \
    }
#define BF_DEFINE_TILES(kind)                                                                        \
    BF_DEFINE_TILE(kind, 1, 1) BF_DEFINE_TILE(kind, 2, 1) BF_DEFINE_TILE(kind, 3, 1) BF_DEFINE_TILE(kind, 4, 1)   \
    BF_DEFINE_TILE(kind, 5, 1) BF_DEFINE_TILE(kind, 6, 1) BF_DEFINE_TILE(kind, 7, 1) BF_DEFINE_TILE(kind, 8, 1)   \
    BF_DEFINE_TILE(kind, 1, 2) BF_DEFINE_TILE(kind, 2, 2) BF_DEFINE_TILE(kind, 3, 2) BF_DEFINE_TILE(kind, 4, 2)   \
    BF_DEFINE_TILE(kind, 5, 2) BF_DEFINE_TILE(kind, 6, 2) BF_DEFINE_TILE(kind, 7, 2) BF_DEFINE_TILE(kind, 8, 2)   \
    BF_DEFINE_TILE(kind, 1, 3) BF_DEFINE_TILE(kind, 2, 3) BF_DEFINE_TILE(kind, 3, 3) BF_DEFINE_TILE(kind, 4, 3)   \
    BF_DEFINE_TILE(kind, 5, 3) BF_DEFINE_TILE(kind, 6, 3) BF_DEFINE_TILE(kind, 7, 3) BF_DEFINE_TILE(kind, 8, 3)   \
    BF_DEFINE_TILE(kind, 1, 4) BF_DEFINE_TILE(kind, 2, 4)
#define BF_TILE_TABLE(kind)                                                                          \
    {{0}, {0, kind##1x1, kind##2x1, kind##3x1, kind##4x1, kind##5x1, kind##6x1, kind##7x1, kind##8x1},     \
     {0, kind##1x2, kind##2x2, kind##3x2, kind##4x2, kind##5x2, kind##6x2, kind##7x2, kind##8x2},          \
     {0, kind##1x3, kind##2x3, kind##3x3, kind##4x3, kind##5x3, kind##6x3, kind##7x3, kind##8x3},          \
     {0, kind##1x4, kind##2x4}}
BF_DEFINE_TILES(bf_etile)
static const bf_TileFn bf_ETILES[BF_FEW_P + 1][BF_ZR + 1] = BF_TILE_TABLE(bf_etile);
#if BF_NATIVE
BF_DEFINE_TILES(bf_ntile)
static const bf_TileFn bf_NTILES[BF_FEW_P + 1][BF_ZR + 1] = BF_TILE_TABLE(bf_ntile);
#endif

#else  /* no AVX-512: the emulated chain in plain C */
static void bf_ctile(int R, int P, const uint32_t *x0, int64_t ldp, const uint32_t *bp, int64_t ps, int k0, int kn,
                  float *carry, int first, const uint32_t *pf, int pf_n) {
    (void)pf; (void)pf_n;
    float acc[BF_ZR * BF_FEW_P * BF_PW];
    for (int i = 0; i < R * P * BF_PW; i++) acc[i] = first ? 0.0f : carry[i];
    for (int k = k0; k < k0 + kn; k++, bp += BF_PW)
        for (int r = 0; r < R; r++) {
            const uint32_t v = x0[r * ldp + k], o = v & 0xffff0000u, e = v << 16;
            float xo, xe;
            memcpy(&xo, &o, 4);
            memcpy(&xe, &e, 4);
            for (int p = 0; p < P; p++)
                for (int c = 0; c < BF_PW; c++) {
                    const uint32_t w = bp[p * ps + c], wo = w & 0xffff0000u, we = w << 16;
                    float fo, fe;
                    memcpy(&fo, &wo, 4);
                    memcpy(&fe, &we, 4);
                    float *a = acc + (r * P + p) * BF_PW + c;
                    *a = fmaf(xo, fo, *a);
                    *a = fmaf(xe, fe, *a);
                }
        }
    memcpy(carry, acc, sizeof(float) * R * P * BF_PW);
}
#endif

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

/* Panels [pb, pe) for all rows: blocks of rows that stay in L2, split evenly into tiles of at most
 * BF_ZR rows; per group of P panels and k-block, every bf_tile of the block on the block's slice. */
/* The range claimed after this one, claimed when this one's last slice starts (so that slice's
 * tiles prefetch the next range's first, and a thread holds no range it has not started on). */
typedef struct {
    int claimed, has, ub, ue;
} bf_Next;

static int bf_next_panel(bf_Gemm *g, bf_Next *nx) {
    if (!nx->claimed) {
        nx->claimed = 1;
        nx->has = bf_claim(g, (g->np + g->group - 1) / g->group, &nx->ub, &nx->ue);
    }
    return nx->has && nx->ub * g->group < g->np ? nx->ub * g->group : -1;
}

static void bf_rows_by_panels(bf_Gemm *g, int pb, int pe, bf_Next *nx) {
    const int K2 = g->K2, PG = g->M <= 2 ? BF_FEW_P : BF_ZP;
    const int64_t ps = (int64_t)K2 * BF_PW;
    int mc = BF_A_BLOCK_BYTES / (K2 * 4);
    mc = mc < BF_ZR ? BF_ZR : mc > BF_MAX_BLOCK_ROWS ? BF_MAX_BLOCK_ROWS : mc - mc % BF_ZR;
    const int nkb = (K2 + BF_KC - 1) / BF_KC, kc = (K2 + nkb - 1) / nkb;
    float carry[(BF_MAX_BLOCK_ROWS + BF_ZR) * BF_FEW_P * BF_PW];
    const int stride = BF_ZR * BF_FEW_P * BF_PW;
    for (int i0 = 0, i1; i0 < g->M; i0 = i1) {
        i1 = i0 + mc < g->M ? i0 + mc : g->M;
        if (g->M - i1 < BF_ZR) i1 = g->M;
        const int n = i1 - i0, t = (n + BF_ZR - 1) / BF_ZR;
        for (int q = pb; q < pe; q += PG) {
            const int P = pe - q < PG ? pe - q : PG;
            const uint32_t *panel = g->packed + q * ps;
            for (int k0 = 0; k0 < K2; k0 += kc) {
                const int kn = k0 + kc <= K2 ? kc : K2 - k0;
                /* the next slice: the rest of these panels, else the next group's first (P panels of
                 * it prefetched; in this claimed range), its lines shared out over the tiles */
                const int more = k0 + kn < K2, last = !more && q + PG >= pe && i1 == g->M;
                const int after = last ? bf_next_panel(g, nx) : -1;
                const int next_group = q + PG < pe || after >= 0;
                const int lines = more ? (K2 - k0 - kn < kc ? K2 - k0 - kn : kc) : next_group ? kc : 0;
                const uint32_t *next = more ? panel + (int64_t)(k0 + kn) * BF_PW
                                            : q + PG < pe ? panel + PG * ps : g->packed + (int64_t)after * ps;
                const int per = (lines + t - 1) / t;
                for (int j = 0, i = i0; j < t; j++) {
                    const int R = n / t + (j < n % t);
                    const int lo = j * per < lines ? j * per : lines, hi = lo + per < lines ? lo + per : lines;
                    bf_tile(g, R, P, g->xp + (int64_t)i * K2, K2, panel + (int64_t)k0 * BF_PW, ps, k0, kn,
                            carry + j * stride, k0 == 0, next + (int64_t)lo * BF_PW, hi - lo);
                    i += R;
                }
            }
            for (int j = 0, i = i0; j < t; j++) {
                const int R = n / t + (j < n % t);
                bf_epilogue(g, i, R, q, P, carry + j * stride);
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
    if (g->native == 1) _mm_setcsr(csr | 0x8040u);
#endif
    const int units = (g->np + g->group - 1) / g->group;
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
            const float *src = (const float *)x + (int64_t)m * ldx;
            for (int k = 0; k < K; k++) dst[k] = bf_to_bf16(src[k]);
        }
        if (K & 1) dst[K] = 0;
    }
}

/* Returns 0; 1 (nothing done) on invalid sizes or a failed allocation. x_bf16 / y_bf16: 1 when
 * x / y hold bfloat16, 0 float32. */
int gemm_bf16(const void *x, int x_bf16, int M, int K, int64_t ldx, const uint16_t *packed, int N,
              const float *bias, const float *residual, void *y, int y_bf16, int nthreads) {
    if (M < 0 || N < 1 || K < 1 || ldx < K) return 1;
    if (M == 0) return 0;
    const int K2 = bf_n_pairs(K);
    static _Thread_local uint32_t *buf;
    static _Thread_local int64_t buf_len;
    if ((int64_t)M * K2 > buf_len) {
        free(buf);
        buf_len = (int64_t)M * K2;
        buf = (uint32_t *)aligned_alloc(64, (size_t)((buf_len * 4 + 63) / 64 * 64));
        if (!buf) {
            buf_len = 0;
            return 1;
        }
    }
    bf_to_pairs(x, x_bf16, M, K, ldx, buf);
    bf_Gemm g = {buf, (const uint32_t *)packed, bias, residual, y, y_bf16, M, N, K2, (N + BF_PW - 1) / BF_PW,
              M <= 2 ? BF_FEW_P : BF_ZP, 1, 0, gemm_bf16_path()};
    const int units = (g.np + g.group - 1) / g.group;
    int nth = nthreads < 1 ? 1 : nthreads;
    if (nth > units) nth = units;
    if ((int64_t)M * N * K < 65536) nth = 1;
    if (nth > 1) g.chunks = M <= 2 ? nth : nth * (M >= BF_LARGE_M ? BF_CHUNKS_LARGE : BF_CHUNKS);
    return evalrun_pool_run(bf_run_part, &g, nth);
}
