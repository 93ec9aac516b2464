/* The AVX-512 path of paged_decode.c for float pages (included by it, after sequence(); it uses
 * that file's Args, Window, SCRATCH and kv_load.h). Not a standalone header. */
#ifndef EVALRUN_PAGED_DECODE_Z_H
#define EVALRUN_PAGED_DECODE_Z_H
#include "isa.h"                  /* AS_BH512, PIN_ZMM */
#if defined(__AVX512F__)
/* AVX-512 path for float pages (float32, bfloat16, float16) without a recent-token window, head
 * sizes that are a multiple of 16 up to 128 and up to 64 query heads; everything else takes
 * sequence() above. The choice depends only on the cache's kinds and shapes, never on the batch,
 * so each sequence's arithmetic stays fixed. What differs from sequence():
 *   - 16-bit rows are widened in the tiles, no converted copy. bfloat16: 32 columns with two ops
 *     (x << 16 gives the even columns, x & 0xffff0000 the odd ones), so within each 32 columns
 *     q and the V sums are held evens first, then odds (bf16_order); float16: vcvtph2ps;
 *   - 16 lanes. A score is one chain per (head, key) over its head's 16-lane units in order,
 *     whose lanes reduce16 then sums by a fixed tree that mixes no two keys, so a score does not
 *     depend on where its key falls in a block. A V sum is one chain per column over positions
 *     in order;
 *   - every line of the context is prefetched into L2 FAST_PFD positions ahead, for every kind
 *     (a block's lines in one burst took 1.25-1.5x the time of a share before each head),
 *     across the end of the keys into the values and across the end of the values into the
 *     keys of the next sequence this thread takes (claimed before it starts this one).
 * Interleaved A/B against sequence() (30 layers of 32 rows x 100-260 positions, 9/3 heads of 64,
 * pages of 256 on 2 MiB pages, Zen 4, medians of 21 rounds): 0.43x the time with bf16 pages,
 * 0.52x with float32 ones on 2 threads (0.40x / 0.50x on one). */
#define FAST_PFD 64                /* positions prefetched ahead (into L2: 0.6x the time of L1 at 16) */
#define FAST_BLOCK 16

/* Units u0, u1 (16 lanes each) of columns 32 c .. 32 c + 31 of a row: in order for float32 and
 * float16; the even columns, then the odd ones for bfloat16. */
static inline __attribute__((always_inline)) void load32(const int KIND, const void *row, int c, __m512 *u0, __m512 *u1) {
    if (KIND == KIND_BF16) {
        const __m512i x = _mm512_loadu_si512((const uint16_t *)row + 32 * c);
        *u0 = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
        *u1 = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u)));
    } else if (KIND == KIND_F16) {
        *u0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + 32 * c)));
        *u1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + 32 * c + 16)));
    } else {
        *u0 = _mm512_loadu_ps((const float *)row + 32 * c);
        *u1 = _mm512_loadu_ps((const float *)row + 32 * c + 16);
    }
}

/* Unit j (columns 16 j .. 16 j + 15, in order): a head size's last 16 columns when D % 32 = 16. */
static inline __attribute__((always_inline)) __m512 load16(const int KIND, const void *row, int j) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + 16 * j));
    if (KIND == KIND_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    if (KIND == KIND_F16) return _mm512_cvtph_ps(h);
    return _mm512_loadu_ps((const float *)row + 16 * j);
}

/* The n units of columns d0 .. d0 + 16 n of a row, d0 a multiple of 32 (see load32). */
static inline __attribute__((always_inline)) void load_units(const int KIND, const int n, const void *row, int d0, __m512 *x) {
    _Pragma("GCC unroll 4") for (int u = 0; u + 1 < n; u += 2) load32(KIND, row, d0 / 32 + u / 2, &x[u], &x[u + 1]);
    if (n & 1) x[n - 1] = load16(KIND, row, d0 / 16 + n - 1);
}

/* dst = src [D] in the column order the tiles read (load32): bf16_order(.., 0) for q;
 * bf16_order(.., 1) puts V sums back in order. Other kinds keep the order. */
static void bf16_order(float *dst, const float *src, int D, int back) {
    int c = 0;
    for (; c + 32 <= D; c += 32)
        for (int i = 0; i < 16; i++) {
            if (back) { dst[c + 2 * i] = src[c + i]; dst[c + 2 * i + 1] = src[c + 16 + i]; }
            else { dst[c + i] = src[c + 2 * i]; dst[c + 16 + i] = src[c + 2 * i + 1]; }
        }
    for (; c < D; c++) dst[c] = src[c];
}

/* r[i] = sum of the 16 lanes of v[i], i < 16: halves, then quarters, pairs and lanes added in the
 * same pattern for every i; no add mixes two i. */
static inline __m512 reduce16(const float *v) {
    __m512 s1[8], s2[4], s3[2];
    for (int i = 0; i < 8; i++) {
        const __m512 a = _mm512_load_ps(v + 32 * i), b = _mm512_load_ps(v + 32 * i + 16);
        s1[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    }
    for (int i = 0; i < 4; i++)
        s2[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s1[2 * i], s1[2 * i + 1], 0x88),
                              _mm512_shuffle_f32x4(s1[2 * i], s1[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        s3[i] = _mm512_add_ps(_mm512_unpacklo_ps(s2[2 * i], s2[2 * i + 1]), _mm512_unpackhi_ps(s2[2 * i], s2[2 * i + 1]));
    const __m512 r = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(s3[0]), _mm512_castps_pd(s3[1]))),
                                   _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(s3[0]), _mm512_castps_pd(s3[1]))));
    /* lane 4 k + j now holds the sum of v[4 j + k] */
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}

/* Lane vectors of HG (1..4) query heads (q [HG, D] in tile order) x m (<= 4) keys into
 * tmp[g][p][16]; a tile of m < 4 repeats key 0 in the unused slots and stores only m. */
static inline __attribute__((always_inline)) void score_tile16(const int KIND, const int HG, const float *q, int D,
                                                                const void *const *k, int m, float *tmp) {
    const void *kr[4] = {k[0], k[m > 1 ? 1 : 0], k[m > 2 ? 2 : 0], k[m > 3 ? 3 : 0]};
    __m512 acc[4][4];
    _Pragma("GCC unroll 4") for (int g = 0; g < HG; g++)
        _Pragma("GCC unroll 4") for (int p = 0; p < 4; p++) acc[g][p] = _mm512_setzero_ps();
    for (int c = 0; c + 32 <= D; c += 32) {
        __m512 x[4][2];
        _Pragma("GCC unroll 4") for (int p = 0; p < 4; p++) load32(KIND, kr[p], c / 32, &x[p][0], &x[p][1]);
        _Pragma("GCC unroll 2") for (int u = 0; u < 2; u++)
            _Pragma("GCC unroll 4") for (int g = 0; g < HG; g++) {
                const __m512 qv = _mm512_loadu_ps(q + g * D + c + 16 * u);
                _Pragma("GCC unroll 4") for (int p = 0; p < 4; p++) acc[g][p] = _mm512_fmadd_ps(qv, x[p][u], acc[g][p]);
            }
    }
    if (D % 32) {
        __m512 x[4];
        _Pragma("GCC unroll 4") for (int p = 0; p < 4; p++) x[p] = load16(KIND, kr[p], D / 16 - 1);
        _Pragma("GCC unroll 4") for (int g = 0; g < HG; g++) {
            const __m512 qv = _mm512_loadu_ps(q + g * D + D - 16);
            _Pragma("GCC unroll 4") for (int p = 0; p < 4; p++) acc[g][p] = _mm512_fmadd_ps(qv, x[p], acc[g][p]);
        }
    }
    _Pragma("GCC unroll 4") for (int g = 0; g < HG; g++)
        _Pragma("GCC unroll 4") for (int p = 0; p < 4; p++)
            if (p < m) _mm512_store_ps(tmp + (g * FAST_BLOCK + p) * 16, acc[g][p]);
}

#if defined(__AVX512BF16__)
#define DOT_BF16 1
/* score_tile16 for bfloat16 keys and q (qb [HG, D], rounded to bfloat16, columns in order): one
 * vdpbf16ps per 32 columns, head and key (products exact, two adds per lane and pair as the
 * instruction does them); the last 16 columns of a head size with D % 32 = 16 zero-extended. */
static inline __attribute__((always_inline)) void score_tile_dot(const int HG, const uint16_t *qb, int D,
                                                                  const void *const *k, int m, float *tmp) {
    const uint16_t *kr[4] = {(const uint16_t *)k[0], (const uint16_t *)k[m > 1 ? 1 : 0],
                             (const uint16_t *)k[m > 2 ? 2 : 0], (const uint16_t *)k[m > 3 ? 3 : 0]};
    __m512 acc[4][4];
    _Pragma("GCC unroll 4") for (int g = 0; g < HG; g++)
        _Pragma("GCC unroll 4") for (int p = 0; p < 4; p++) acc[g][p] = _mm512_setzero_ps();
    for (int c = 0; c < D; c += 32) {
        const __mmask32 lanes = D - c >= 32 ? ~(__mmask32)0 : (__mmask32)0xffffu;
        __m512i x[4];
        _Pragma("GCC unroll 4") for (int p = 0; p < 4; p++) x[p] = _mm512_maskz_loadu_epi16(lanes, kr[p] + c);
        _Pragma("GCC unroll 4") for (int g = 0; g < HG; g++) {
            const __m512i qv = _mm512_maskz_loadu_epi16(lanes, qb + g * D + c);
            _Pragma("GCC unroll 4") for (int p = 0; p < 4; p++)
                acc[g][p] = _mm512_dpbf16_ps(acc[g][p], AS_BH512(qv), AS_BH512(x[p]));
        }
    }
    _Pragma("GCC unroll 4") for (int g = 0; g < HG; g++)
        _Pragma("GCC unroll 4") for (int p = 0; p < 4; p++)
            if (p < m) _mm512_store_ps(tmp + (g * FAST_BLOCK + p) * 16, acc[g][p]);
}
#else
#define DOT_BF16 0
#endif

/* out[g * ostride + p] = q[g] . k[p] for the Gq query heads sharing the n <= FAST_BLOCK keys k; q:
 * float32 in tile order, or with DOT bfloat16 in column order (score_tile_dot). */
static inline __attribute__((always_inline)) void score_block16(const int KIND, const int DOT, const void *qh,
                                                                 int Gq, int D, const void *const *k, int n,
                                                                 float *out, int64_t ostride) {
    float tmp[4 * FAST_BLOCK * 16] __attribute__((aligned(64)));
    const __mmask16 keep = (__mmask16)((1u << n) - 1);
    for (int g0 = 0; g0 < Gq; g0 += 4) {
        const int hg = Gq - g0 < 4 ? Gq - g0 : 4;
        const float *qg = (const float *)qh + (int64_t)g0 * D;
        for (int p = 0; p < n; p += 4) {
            const int m = n - p < 4 ? n - p : 4;
            float *t = tmp + p * 16;
#if DOT_BF16
            if (DOT) {
                const uint16_t *qb = (const uint16_t *)qh + (int64_t)g0 * D;
                if (hg == 4) score_tile_dot(4, qb, D, k + p, m, t);
                else if (hg == 3) score_tile_dot(3, qb, D, k + p, m, t);
                else if (hg == 2) score_tile_dot(2, qb, D, k + p, m, t);
                else score_tile_dot(1, qb, D, k + p, m, t);
                continue;
            }
#endif
            if (hg == 4) score_tile16(KIND, 4, qg, D, k + p, m, t);
            else if (hg == 3) score_tile16(KIND, 3, qg, D, k + p, m, t);
            else if (hg == 2) score_tile16(KIND, 2, qg, D, k + p, m, t);
            else score_tile16(KIND, 1, qg, D, k + p, m, t);
        }
        for (int g = 0; g < hg; g++) {
            float *t = tmp + g * FAST_BLOCK * 16;
            for (int p = n; p < FAST_BLOCK; p++) _mm512_store_ps(t + 16 * p, _mm512_setzero_ps());
            _mm512_mask_storeu_ps(out + (g0 + g) * ostride, keep, reduce16(t));
        }
    }
}

/* acc[g][d0 .. d0 + 16 NC) += sum over p of w[g * ws + p] * v[p][d0 ..] (tile order) for HG (1..4)
 * heads: one chain per column, positions in order. */
static inline __attribute__((always_inline)) void value_tile16(const int KIND, const int HG, const int NC, float *acc,
                                                                int D, const float *w, int64_t ws,
                                                                const void *const *v, int n, int d0) {
    __m512 c[4][4];
    _Pragma("GCC unroll 4") for (int g = 0; g < HG; g++)
        _Pragma("GCC unroll 4") for (int j = 0; j < NC; j++) c[g][j] = _mm512_loadu_ps(acc + g * D + d0 + 16 * j);
    for (int p = 0; p < n; p++) {
        __m512 x[4];
        load_units(KIND, NC, v[p], d0, x);
        _Pragma("GCC unroll 4") for (int g = 0; g < HG; g++) {
            const __m512 wb = _mm512_set1_ps(w[g * ws + p]);
            _Pragma("GCC unroll 4") for (int j = 0; j < NC; j++) c[g][j] = _mm512_fmadd_ps(wb, x[j], c[g][j]);
        }
    }
    _Pragma("GCC unroll 4") for (int g = 0; g < HG; g++)
        _Pragma("GCC unroll 4") for (int j = 0; j < NC; j++) _mm512_storeu_ps(acc + g * D + d0 + 16 * j, c[g][j]);
}

#define VALUE_TILE16(HG)                                                                          \
    for (int d0 = 0; d0 < D; d0 += 64) {                                                          \
        const int nc = (D - d0) / 16 < 4 ? (D - d0) / 16 : 4;                                     \
        if (nc == 4) value_tile16(KIND, HG, 4, a, D, wg, ws, v, n, d0);                           \
        else if (nc == 3) value_tile16(KIND, HG, 3, a, D, wg, ws, v, n, d0);                      \
        else if (nc == 2) value_tile16(KIND, HG, 2, a, D, wg, ws, v, n, d0);                      \
        else value_tile16(KIND, HG, 1, a, D, wg, ws, v, n, d0);                                   \
    }
/* acc[g][D] += sum over the n values of w[g][p] * v[p] for the Gq heads sharing them. */
static inline __attribute__((always_inline)) void value_block16(const int KIND, float *acc, int Gq, int D,
                                                                 const float *w, int64_t ws, const void *const *v,
                                                                 int n) {
    for (int g0 = 0; g0 < Gq; g0 += 4) {
        const int hg = Gq - g0 < 4 ? Gq - g0 : 4;
        float *a = acc + (int64_t)g0 * D;
        const float *wg = w + g0 * ws;
        if (hg == 4) { VALUE_TILE16(4) }
        else if (hg == 3) { VALUE_TILE16(3) }
        else if (hg == 2) { VALUE_TILE16(2) }
        else { VALUE_TILE16(1) }
    }
}
#undef VALUE_TILE16

/* In place: sh[pos] = exp(scale * sh[pos] - max); returns the sum (16 lanes, a masked tail). */
static float softmax_weights16(float *sh, int L, float scale) {
    const __m512 sv = _mm512_set1_ps(scale);
    const __mmask16 tail = (__mmask16)((1u << (L % 16)) - 1);
    const int full = L - L % 16;
    __m512 mv = _mm512_set1_ps(-INFINITY), acc = _mm512_setzero_ps();
    for (int pos = 0; pos < full; pos += 16) {
        const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(sh + pos), sv);
        _mm512_storeu_ps(sh + pos, x);
        mv = _mm512_max_ps(mv, x);
    }
    if (tail) {
        const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, sh + full), sv);
        _mm512_mask_storeu_ps(sh + full, tail, x);
        mv = _mm512_mask_max_ps(mv, tail, mv, x);
    }
    const __m512 mb = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
    for (int pos = 0; pos < full; pos += 16) {
        const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(sh + pos), mb));
        _mm512_storeu_ps(sh + pos, e);
        acc = _mm512_add_ps(acc, e);
    }
    if (tail) {
        const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, sh + full), mb));
        _mm512_mask_storeu_ps(sh + full, tail, e);
        acc = _mm512_mask_add_ps(acc, tail, acc, e);
    }
    return _mm512_reduce_add_ps(acc);
}

static inline int fast_path(const Args *a) {
    return !a->wk && a->k_kind == a->v_kind && a->k_kind <= KIND_F16 && a->D % 16 == 0 && a->D <= 128 && a->Hq <= 64;
}

/* Sequence b as sequence() computes it, on the tiles above; next (or -1): the sequence this
 * thread takes after it. qt: [Hq, D] scratch for q as the score tiles read it (bfloat16 keys: rounded). */
static inline __attribute__((always_inline)) void sequence16(const int KIND, const Args *a, int b, int next,
                                                              float *scores, float *acc, float *inv_sum, float *qt) {
    const int Hq = a->Hq, Hkv = a->Hkv, Gq = Hq / Hkv, D = a->D, S = a->S, W = Hkv * D;
    const int L = a->seq_lens[b];
    const int64_t lmax = a->lmax, es = KIND == KIND_F32 ? 4 : 2, slot_bytes = W * es;
    const float *q = a->q + (int64_t)b * Hq * D;
    float *o = a->out + (int64_t)b * Hq * D;
    const char *kc = (const char *)a->k, *vc = (const char *)a->v;
    const int32_t *pages = a->page_table + (int64_t)b * a->max_pages;
    if (L <= 0) {                   /* empty context: zeros, as an empty softmax sum gives */
        memset(o, 0, sizeof(float) * (size_t)Hq * D);
        return;
    }
    const int P0 = first_position(L, a->sliding), n_keys = L - P0;    /* scores[p - P0] */
    const int next_len = next >= 0 ? a->seq_lens[next] : 0;
    const Stream keys = {kc, pages, L, P0}, values = {vc, pages, L, P0},
                 next_keys = {kc, next >= 0 ? a->page_table + (int64_t)next * a->max_pages : pages, next_len,
                              first_position(next_len, a->sliding)};
    const Window none = {NULL, 0, L, 0};
    int64_t slot[FAST_BLOCK];
    const void *rows[FAST_BLOCK];
    const int dot = KIND == KIND_BF16 && DOT_BF16;
    if (dot) {                      /* q rounded to bfloat16, columns in order (score_tile_dot) */
        uint16_t *qb = (uint16_t *)qt;
        for (int i = 0; i < Hq * D; i++) qb[i] = bf16_from_f32(q[i]);
    } else if (KIND == KIND_BF16) { /* q rounded to bfloat16, in tile order (load32) */
        for (int hq = 0; hq < Hq; hq++) bf16_order(qt + (int64_t)hq * D, q + (int64_t)hq * D, D, 0);
        round_bf16(qt, (int64_t)Hq * D);
    }
    const void *qh = KIND == KIND_BF16 ? (const void *)qt : (const void *)q;
    prefetch_ahead(&keys, &values, slot_bytes, S, P0, P0 + FAST_PFD);
    for (int p0 = P0; p0 < L; p0 += FAST_BLOCK) {
        const int n = L - p0 < FAST_BLOCK ? L - p0 : FAST_BLOCK;
        block_slots(pages, S, p0, n, &none, slot);
        for (int h = 0; h < Hkv; h++) {       /* the block FAST_PFD ahead, a share before each head */
            prefetch_ahead(&keys, &values, slot_bytes, S, p0 + FAST_PFD + h * n / Hkv, p0 + FAST_PFD + (h + 1) * n / Hkv);
            for (int p = 0; p < n; p++) rows[p] = kc + (slot[p] * W + (int64_t)h * D) * es;
            const void *qg = dot ? (const void *)((const uint16_t *)qh + (int64_t)h * Gq * D)
                                 : (const void *)((const float *)qh + (int64_t)h * Gq * D);
            if (dot) score_block16(KIND, 1, qg, Gq, D, rows, n, scores + h * Gq * lmax + p0 - P0, lmax);
            else score_block16(KIND, 0, qg, Gq, D, rows, n, scores + h * Gq * lmax + p0 - P0, lmax);
        }
    }
    for (int hq = 0; hq < Hq; hq++) {
        if (a->softcap > 0.0f) cap_scores(scores + hq * lmax, n_keys, a->scale, a->softcap);
        inv_sum[hq] = 1.0f / softmax_weights16(scores + hq * lmax, n_keys, a->softcap > 0.0f ? 1.0f : a->scale);
        memset(acc + (int64_t)hq * D, 0, sizeof(float) * (size_t)D);
    }
    for (int p0 = P0; p0 < L; p0 += FAST_BLOCK) {
        const int n = L - p0 < FAST_BLOCK ? L - p0 : FAST_BLOCK;
        block_slots(pages, S, p0, n, &none, slot);
        for (int h = 0; h < Hkv; h++) {       /* the block FAST_PFD ahead, a share before each head */
            prefetch_ahead(&values, &next_keys, slot_bytes, S, p0 + FAST_PFD + h * n / Hkv, p0 + FAST_PFD + (h + 1) * n / Hkv);
            for (int p = 0; p < n; p++) rows[p] = vc + (slot[p] * W + (int64_t)h * D) * es;
            value_block16(KIND, acc + (int64_t)h * Gq * D, Gq, D, scores + h * Gq * lmax + p0 - P0, lmax, rows, n);
        }
    }
    for (int hq = 0; hq < Hq; hq++) {
        float *ah = acc + (int64_t)hq * D;
        for (int d = 0; d < D; d++) ah[d] *= inv_sum[hq];
        if (KIND == KIND_BF16) bf16_order(o + (int64_t)hq * D, ah, D, 1);
        else memcpy(o + (int64_t)hq * D, ah, sizeof(float) * (size_t)D);
    }
}

static __attribute__((noinline)) void sequence_f32(const Args *a, int b, int next, float *s, float *acc, float *inv,
                                                   float *qt) {
    sequence16(KIND_F32, a, b, next, s, acc, inv, qt);
}
static __attribute__((noinline)) void sequence_bf16(const Args *a, int b, int next, float *s, float *acc, float *inv,
                                                    float *qt) {
    sequence16(KIND_BF16, a, b, next, s, acc, inv, qt);
}
static __attribute__((noinline)) void sequence_f16(const Args *a, int b, int next, float *s, float *acc, float *inv,
                                                   float *qt) {
    sequence16(KIND_F16, a, b, next, s, acc, inv, qt);
}
#endif
#endif
