/* The register tiles of the bfloat16 GEMM (included by gemm_bf16.c, which defines BF_PW, BF_ZR,
 * BF_ZP, BF_FEW_P, BF_NATIVE, BF_Z and BF_PF_HINT first): the native vdpbf16ps tiles, the same
 * chain emulated with float32 FMAs on AVX-512, and the plain C chain elsewhere; bf_NTILES /
 * bf_ETILES [P][R] (bf_ctile without AVX-512). */
#ifndef EVALRUN_GEMM_BF16_TILES_H
#define EVALRUN_GEMM_BF16_TILES_H
#include "isa.h"                  /* AS_BH512, PIN_ZMM */

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
#define BF_NF(r, p) if (P > p) c##r##p = _mm512_dpbf16_ps(c##r##p, AS_BH512(a_), AS_BH512(b##p));
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

#endif
