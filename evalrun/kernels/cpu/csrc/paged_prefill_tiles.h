/* The score and value register tiles of paged_prefill.c, the scores also as vdpbf16ps for bfloat16
 * keys (included by it inside its PREFILL_SIMD section; they use that file's vec, VW, KP, RP, RV and
 * DV). Not a standalone header. */
#ifndef EVALRUN_PAGED_PREFILL_TILES_H
#define EVALRUN_PAGED_PREFILL_TILES_H
#include "isa.h"                  /* AS_BH512, PIN_ZMM */
/* sc[p][r] = (q_r . k_p) * scale for keys [p, p + np), np <= KP, and row vectors [v0, v0 + nv), nv <= RV:
 * qt [D][rp] the transposed rows. One chain over d per score. */
static inline __attribute__((always_inline)) void score_tile(const float *qt, int64_t rp, const float *const *kr,
                                                            int p, const int np, int v0, const int nv, int D,
                                                            vec sv, float *sc) {
    vec a[KP][RV];
    const float *k[KP];
    _Pragma("GCC unroll 8") for (int j = 0; j < KP; j++) {
        k[j] = j < np ? kr[p + j] : kr[p];
        _Pragma("GCC unroll 3") for (int i = 0; i < RV; i++) a[j][i] = VZERO();
    }
    const float *qp = qt + (int64_t)v0 * VW;
    for (int d = 0; d < D; d++, qp += rp) {
        vec qv[RV];
        _Pragma("GCC unroll 3") for (int i = 0; i < RV; i++) if (i < nv) {
            qv[i] = VLOAD(qp + i * VW);       /* one load per vector, not one per multiply-add: */
#if VW == 16
            PIN_ZMM(qv[i]);
#else                                           /* 12 sums + 3 rows + 1 key = the 16 ymm registers; on Zen 3
                                                   0.84-0.90x the time of loads folded into the 12 FMAs */
            __asm__("" : "+x"(qv[i]));
#endif
        }
        _Pragma("GCC unroll 8") for (int j = 0; j < KP; j++) if (j < np) {
            const vec b = VSET1(k[j][d]);
            _Pragma("GCC unroll 3") for (int i = 0; i < RV; i++) if (i < nv) a[j][i] = VFMA(qv[i], b, a[j][i]);
        }
    }
    _Pragma("GCC unroll 8") for (int j = 0; j < KP; j++) if (j < np)
        _Pragma("GCC unroll 3") for (int i = 0; i < RV; i++) if (i < nv)
            VSTORE(sc + (int64_t)(p + j) * rp + (v0 + i) * VW, VMUL(a[j][i], sv));
}

#define SCORE_FN(np, nv) SCORE_FN_(np, nv)   /* expands KP first */
#define SCORE_FN_(np, nv)                                                                         \
    static void score##np##_##nv(const float *qt, int64_t rp, const float *const *kr, int p, int v0, int D, \
                                 vec sv, float *sc) {                                            \
        score_tile(qt, rp, kr, p, np, v0, nv, D, sv, sc);                                        \
    }
SCORE_FN(KP, 3) SCORE_FN(KP, 2) SCORE_FN(KP, 1) SCORE_FN(1, 3) SCORE_FN(1, 2) SCORE_FN(1, 1)
typedef void (*ScoreFn)(const float *, int64_t, const float *const *, int, int, int, vec, float *);
#define SCORE_FNS(np) {0, score##np##_1, score##np##_2, score##np##_3}
#define SCORE_FNS_OF(np) SCORE_FNS(np)
static const ScoreFn SCORE_KP[RV + 1] = SCORE_FNS_OF(KP);
static const ScoreFn SCORE1[RV + 1] = SCORE_FNS(1);

/* rows[p] = head h of the slot of position p, in place in the cache (bfloat16 keys on the vdpbf16ps
 * tiles: read as they are), for positions [from, n); each row's lines prefetched. */
static void head_ptrs(const void *cache, const int32_t *pages, int S, int from, int n, int h, int D, int W,
                      const uint16_t **rows) {
    for (int p = from; p < n; p++) {
        rows[p] = (const uint16_t *)cache + ((int64_t)pages[p / S] * S + p % S) * W + (int64_t)h * D;
        for (int off = 0; off < D * 2; off += 64) __builtin_prefetch((const char *)rows[p] + off);
    }
}

/* qt (transpose_rows' bfloat16 values, [D][rp]) -> bfloat16 pairs in place, [D / 2][rp] words: word
 * (i, r) holds row r's elements 2i (low half) and 2i + 1 (high half), as score_tile_dot reads them.
 * Word row i overwrites float row i only, whose values were read by then (rows 2i and 2i + 1 >= i). */
static void pair_rows(float *qt, int D, int64_t rp, int nr) {
    uint32_t *qt2 = (uint32_t *)qt;
    for (int i = 0; i < D / 2; i++)
        for (int r = 0; r < nr; r++) {
            uint32_t lo, hi;
            memcpy(&lo, qt + (int64_t)(2 * i) * rp + r, sizeof lo);
            memcpy(&hi, qt + (int64_t)(2 * i + 1) * rp + r, sizeof hi);
            qt2[(int64_t)i * rp + r] = (lo >> 16) | (hi & 0xffff0000u);
        }
}

#if VW == 16 && defined(__AVX512BF16__)
#define PREFILL_DOT 1
/* score_tile for bfloat16 keys read in place from their pages (kr[p]: the row's D values) and q
 * rounded to bfloat16 in pairs (qt2 [D / 2][rp]: element 2i in the low half of a word, 2i + 1 in
 * the high one, as the keys' pairs lie in memory): one vdpbf16ps per pair of d, key and row vector
 * (products exact; one chain over the pairs in order per score). */
static inline __attribute__((always_inline)) void score_tile_dot(const uint32_t *qt2, int64_t rp,
                                                                const uint16_t *const *kr, int p, const int np,
                                                                int v0, const int nv, int D, vec sv, float *sc) {
    vec a[KP][RV];
    const uint16_t *k[KP];
    _Pragma("GCC unroll 8") for (int j = 0; j < KP; j++) {
        k[j] = j < np ? kr[p + j] : kr[p];
        _Pragma("GCC unroll 3") for (int i = 0; i < RV; i++) a[j][i] = VZERO();
    }
    const uint32_t *qp = qt2 + (int64_t)v0 * VW;
    for (int d2 = 0; d2 < D / 2; d2++, qp += rp) {
        __m512i qv[RV];
        _Pragma("GCC unroll 3") for (int i = 0; i < RV; i++) if (i < nv) {
            qv[i] = _mm512_loadu_si512(qp + i * VW);
            PIN_ZMM(qv[i]);             /* one load per vector, not one per dot */
        }
        _Pragma("GCC unroll 8") for (int j = 0; j < KP; j++) if (j < np) {
            uint32_t pair;
            memcpy(&pair, k[j] + 2 * d2, sizeof pair);
            const __m512i b = _mm512_set1_epi32((int)pair);
            _Pragma("GCC unroll 3") for (int i = 0; i < RV; i++) if (i < nv)
                a[j][i] = _mm512_dpbf16_ps(a[j][i], AS_BH512(qv[i]), AS_BH512(b));
        }
    }
    _Pragma("GCC unroll 8") for (int j = 0; j < KP; j++) if (j < np)
        _Pragma("GCC unroll 3") for (int i = 0; i < RV; i++) if (i < nv)
            VSTORE(sc + (int64_t)(p + j) * rp + (v0 + i) * VW, VMUL(a[j][i], sv));
}

#define SCORE_DOT_FN(np, nv) SCORE_DOT_FN_(np, nv)
#define SCORE_DOT_FN_(np, nv)                                                                     \
    static void score_dot##np##_##nv(const uint32_t *qt2, int64_t rp, const uint16_t *const *kr, int p, int v0, \
                                     int D, vec sv, float *sc) {                                 \
        score_tile_dot(qt2, rp, kr, p, np, v0, nv, D, sv, sc);                                   \
    }
SCORE_DOT_FN(KP, 3) SCORE_DOT_FN(KP, 2) SCORE_DOT_FN(KP, 1) SCORE_DOT_FN(1, 3) SCORE_DOT_FN(1, 2) SCORE_DOT_FN(1, 1)
typedef void (*ScoreDotFn)(const uint32_t *, int64_t, const uint16_t *const *, int, int, int, vec, float *);
#define SCORE_DOT_FNS(np) {0, score_dot##np##_1, score_dot##np##_2, score_dot##np##_3}
#define SCORE_DOT_FNS_OF(np) SCORE_DOT_FNS(np)
static const ScoreDotFn SCORE_DOT_KP[RV + 1] = SCORE_DOT_FNS_OF(KP);
static const ScoreDotFn SCORE_DOT1[RV + 1] = SCORE_DOT_FNS(1);
#else
#define PREFILL_DOT 0
#endif

/* Rows r0 .. r0 + nr - 1 (nr <= RP), columns [c0, c0 + nd * VW) of the value sums acc [R][D]: += w[p][r] v_p
 * for keys [p0, p1) in order (from 0 when `first`); row r's weights are 0 past its keys. Storing and
 * reloading a float32 sum is exact, so a row's sum is one chain over p however the keys are blocked. */
static inline __attribute__((always_inline)) void value_tile(const float *sc, int64_t rp, const float *const *vr,
                                                            int p0, int p1, int r0, const int nr, int c0,
                                                            const int nd, float *acc, int D, int first) {
    vec a[RP][DV];
    _Pragma("GCC unroll 8") for (int r = 0; r < RP; r++)
        _Pragma("GCC unroll 4") for (int c = 0; c < DV; c++)
            a[r][c] = first || r >= nr || c >= nd ? VZERO() : VLOAD(acc + (int64_t)(r0 + r) * D + c0 + c * VW);
    const float *w = sc + (int64_t)p0 * rp + r0;
    for (int p = p0; p < p1; p++, w += rp) {
        const float *v = vr[p] + c0;
        vec vv[DV];
        _Pragma("GCC unroll 4") for (int c = 0; c < DV; c++) if (c < nd) vv[c] = VLOAD(v + c * VW);
        _Pragma("GCC unroll 8") for (int r = 0; r < RP; r++) if (r < nr) {
            const vec wb = VSET1(w[r]);
            _Pragma("GCC unroll 4") for (int c = 0; c < DV; c++) if (c < nd) a[r][c] = VFMA(wb, vv[c], a[r][c]);
        }
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < RP; r++) if (r < nr)
        _Pragma("GCC unroll 4") for (int c = 0; c < DV; c++) if (c < nd)
            VSTORE(acc + (int64_t)(r0 + r) * D + c0 + c * VW, a[r][c]);
}

#define VALUE_FN(nr, nd)                                                                          \
    static void value##nr##_##nd(const float *sc, int64_t rp, const float *const *vr, int p0, int p1, int r0, \
                                 int c0, float *acc, int D, int first) {                          \
        value_tile(sc, rp, vr, p0, p1, r0, nr, c0, nd, acc, D, first);                           \
    }
#define VALUE_ROWS(nd) VALUE_FN(1, nd) VALUE_FN(2, nd) VALUE_FN(3, nd) VALUE_FN(4, nd) VALUE_FN(5, nd) VALUE_FN(6, nd)
VALUE_ROWS(1) VALUE_ROWS(2) VALUE_ROWS(3) VALUE_ROWS(4)
typedef void (*ValueFn)(const float *, int64_t, const float *const *, int, int, int, int, float *, int, int);
#define VALUE_ROW_FNS(nd) {0, value1_##nd, value2_##nd, value3_##nd, value4_##nd, value5_##nd, value6_##nd}
static const ValueFn VALUE[5][7] = {{0}, VALUE_ROW_FNS(1), VALUE_ROW_FNS(2), VALUE_ROW_FNS(3), VALUE_ROW_FNS(4)};
#endif
