/* Paged prefill attention on the CPU: several query tokens per sequence, causal, read straight
 * from the pages (no gathered copy of the context), GQA, float32 math.
 *
 * Layouts (as evalrun/kernels/kv_format.py and evalrun/kernels/attention.py):
 *   q           [T, Hq, D]          float32 query rows of the sequences, packed (sequence b's
 *                                   q_len[b] rows start at row q_start[b]); in the attention
 *                                   domain (the caller rotates q in and the output out)
 *   k_cache     [P + 1, S, Hkv, W]  any storage kind of kv_load.h (float32, bfloat16, float16,
 *   v_cache                         8-bit and 4-bit codes with float16 scales k_scale/v_scale)
 *   page_table  [B, max_pages]      int32
 *   seq_lens    [B]                 int32 context length, the new tokens included: query i of b
 *                                   sits at position seq_lens[b] - q_len[b] + i and sees every key
 *                                   at a position <= its own
 *   out         [T, Hq, D]          float32
 *   sliding     a sliding window W (0: none): the query at position t sees the keys t - W < p <= t
 *   softcap     soft-capping c (0: none): each scaled score s becomes c * tanh(s / c) (Gemma 2)
 *   scratch     nthreads x paged_prefill_scratch_floats(Hq, Hkv, D, lmax, k_kind, v_kind), lmax >=
 *               max(seq_lens)
 *
 * A task is one KV head of up to QT consecutive query positions of one sequence: its G = Hq / Hkv
 * query heads at those positions are R <= G * QT rows. The rows lie in the lanes of the vectors
 * (query transposed once per task), so a key's scores for all rows come from one broadcast of each
 * of its elements, and the softmax runs down the keys for every row at once. Per row:
 *   s[p] = (q . k[p]) * scale   one multiply-add chain over d in order,
 *   w[p] = exp(s[p] - max)      over the row's keys p <= its position (the rest weigh 0),
 *   out  = (sum over p in order of w[p] v[p]) * (1 / sum over p in order of w[p]).
 * With bfloat16 keys q is rounded to bfloat16 first, as in paged_decode.c (every product exact).
 * Nothing in a row's arithmetic depends on the other rows, the task's size or the batch, so a
 * token's output is bitwise the same however its sequence is chunked or batched (batch invariance).
 * The head's K and V rows are read through the page table: float32 rows in place (a pointer per
 * position), the other kinds converted or dequantized into per-thread float32 buffers (bfloat16 keys
 * on vdpbf16ps in place too), which the thread's next task of the same sequence and head extends
 * (tasks come in position order). Tasks are claimed one at a time by the threads of the shared pool
 * (pool.h): each thread first from its own range of consecutive tasks, then from what is left of the
 * others' (so a head's rows are mostly converted once).
 * The torch reference is kernels.attention.attend (SDPA on the gathered context).
 */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_load.h"
#include "pool.h"
#include "simd_math.h"

#if defined(__AVX2__) && defined(__FMA__)
#define PREFILL_SIMD 1
#if defined(__AVX512F__)
#define VW 16
typedef __m512 vec;
#define VLOAD _mm512_loadu_ps
#define VSTORE _mm512_storeu_ps
#define VSET1 _mm512_set1_ps
#define VZERO _mm512_setzero_ps
#define VFMA _mm512_fmadd_ps
#define VMUL _mm512_mul_ps
#define VADD _mm512_add_ps
#define VMAX _mm512_max_ps
#define VSUB _mm512_sub_ps
#else
#define VW 8
typedef __m256 vec;
#define VLOAD _mm256_loadu_ps
#define VSTORE _mm256_storeu_ps
#define VSET1 _mm256_set1_ps
#define VZERO _mm256_setzero_ps
#define VFMA _mm256_fmadd_ps
#define VMUL _mm256_mul_ps
#define VADD _mm256_add_ps
#define VMAX _mm256_max_ps
#define VSUB _mm256_sub_ps
#endif
#else
#define PREFILL_SIMD 0
#define VW 8
#endif

#define QT 16                      /* query positions per task */
#if VW == 16                       /* 32 vector registers: tiles of 24 sums */
#define KP 8                       /* keys per score tile */
#define RP 6                       /* rows per value tile */
#define DV 4                       /* vectors of D per value tile (the tile tables take up to 4) */
#else                              /* 16 registers */
#define KP 4
#define RP 6                       /* 12 sums + 2 values + 1 weight in the 16 ymm; 4 x 4 spilled 5 sums: */
#define DV 2                       /* 0.83-0.98x its time on Zen 3 (bench_prefill_attention, alternated) */
#endif
#define RV 3                       /* row vectors per score tile */
#ifndef PF
#define PF 8                       /* slots ahead a conversion prefetches */
#endif
#ifndef PB                         /* keys per block of the value sums */
#if VW == 16
#define PB 256                     /* 3% faster than 64 at 9/3 heads of 64 on Zen 4 (alternated A/B, 2026-12-04) */
#else
#define PB 64
#endif
#endif

int paged_prefill_supported(void) { return PREFILL_SIMD; }

static int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* Rows of a task, padded to whole vectors. */
static int64_t rows_pad(int Hq, int Hkv) { return round_up((int64_t)(Hq / Hkv) * QT, VW); }

/* Floats of scratch per thread: row pointers [2][lmax] (two floats' room each, first: aligned), the
 * transposed queries [D][Rp], the scores [lmax][Rp], the K rows and V rows as float32 [lmax][D], the
 * rows' key counts and inverse sums [3][Rp], the value sums [Rp][D]. */

int64_t paged_prefill_scratch_floats(int Hq, int Hkv, int D, int lmax, int k_kind, int v_kind) {
    if (Hq < 1 || Hkv < 1 || Hq % Hkv || D < 1 || lmax < 1) return 0;
    const int64_t rp = rows_pad(Hq, Hkv);
    (void)k_kind; (void)v_kind;
    return 2 * rp * D + (int64_t)lmax * rp + 2 * (int64_t)lmax * D
           + 4 * (int64_t)lmax + 3 * rp + 16;
}

#if PREFILL_SIMD

#define MAX_RANGES 64
typedef struct {
    _Alignas(64) atomic_long next;   /* the range's next unclaimed task, on a line of its own */
} Range;

typedef struct {
    const float *q;
    const void *k, *v;
    const uint16_t *k_scale, *v_scale;
    int k_kind, v_kind, G;
    const int32_t *page_table;
    int max_pages;
    const int32_t *seq_lens, *q_start, *q_len;
    float *out;
    int B, Hq, Hkv, D, S;
    float scale;
    float *scratch;
    int lmax;
    int sliding;                   /* sliding window, 0: none */
    float softcap;                 /* soft-capping, 0: none */
    const int64_t *first_task;     /* [B + 1] tasks before sequence b */
    int64_t ntasks;
    int nranges;
    Range *ranges;                 /* [nranges]: range r is tasks [ntasks r / nranges, ntasks (r + 1) / nranges) */
} Args;

/* Head h of positions [from, n) as float32 rows: rows[p] points into the page (float32, with
 * PREFILL_F32_IN_PLACE) or at buf + p * D, where the row was converted or dequantized (or copied, without
 * it). On an AVX2-only Zen 3 in place ran 0.99-1.11x the copy's speed (equal at MMLU shapes, faster on
 * fresh prompts) and 1.02-1.12x the kernel before per-row key ranges (bench_prefill_attention, alternated). */
#ifndef PREFILL_F32_IN_PLACE
#define PREFILL_F32_IN_PLACE 1
#endif
static void head_rows(const void *cache, const uint16_t *scales, int kind, int G, const int32_t *pages, int S,
                      int from, int n, int h, int D, int W, float *buf, const float **rows) {
    const int64_t esize = kind == KIND_F32 ? 4 : kind == KIND_BF16 || kind == KIND_F16 ? 2 : kind == KIND_Q8 ? 1 : 0;
    for (int p0 = from / S * S; p0 < n; p0 += S) {   /* page by page: slots are consecutive within one */
        const int64_t slot = (int64_t)pages[p0 / S] * S;
        const int pb = p0 > from ? p0 : from, pe = p0 + S < n ? p0 + S : n;
        const char *base = (const char *)cache + (slot * W + (int64_t)h * D) * esize;
        for (int p = pb; p < pe; p++) {
            float *row = buf + (int64_t)p * D;
            if (esize && p + PF < pe)           /* the row PF slots ahead: its lines are far away in memory */
                for (int64_t off = 0; off < D * esize; off += 64)
                    __builtin_prefetch(base + (int64_t)(p + PF - p0) * W * esize + off);
            if (kind == KIND_F32 && PREFILL_F32_IN_PLACE) {
                rows[p] = (const float *)(base + (int64_t)(p - p0) * W * esize);
                continue;
            }
            if (kind == KIND_F32)
                memcpy(row, base + (int64_t)(p - p0) * W * esize, sizeof(float) * (size_t)D);
            else
                load_head(cache, scales, kind, G, slot + p - p0, h, D, W, row);
            rows[p] = row;
        }
    }
}

/* What a thread's scratch holds of the K and V rows: positions [lo, n) of sequence b's head h (lo:
 * 0, or under a sliding window the first key a task needed). The tasks of one head and sequence
 * mostly come in position order, so a thread that claims the next one converts only the keys it
 * adds (conversion is exact: a row's values do not depend on it). */
typedef struct {
    int b, h, lo, n;
} HeadRows;

#include "paged_prefill_tiles.h"     /* score_tile(_dot), value_tile, their tables; head_ptrs, pair_rows */

#if VW == 16
#define VEXP exp_nonpositive16
#else
#define VEXP exp_nonpositive
#endif

/* Lane-wise softmax weights down the keys, for the row vectors of a task: row r (lane) sees keys
 * p < lim[r]; keys [0, shared) are seen by every row. In place: sc[p][r] = exp(s - max) (0 past
 * the row's keys); inv[r] = 1 / the sum over p in order. Up to SV row vectors go down the keys
 * together (independent chains: a row's sum is one chain over p). */
#define SV 4
#if VW == 16
/* Keys [shared, nk), which only some lanes see: the lane-by-lane steps of the scalar version below,
 * under masks (a lane past its keys keeps its max, weighs 0 and adds 0 to its sum). */
static void softmax_tail_max(const float *col, int64_t rp, int nv, int shared, int nk, const float *l, vec *mv) {
    for (int p = shared; p < nk; p++)
        for (int i = 0; i < nv; i++) {
            const vec x = VLOAD(col + p * rp + i * VW);
            const __mmask16 sees = _mm512_cmp_ps_mask(VSET1((float)p), VLOAD(l + i * VW), _CMP_LT_OQ);
            mv[i] = _mm512_mask_mov_ps(mv[i], sees & _mm512_cmp_ps_mask(x, mv[i], _CMP_GT_OQ), x);
        }
}

static void softmax_tail_exp(float *col, int64_t rp, int nv, int shared, int nk, const float *l, const vec *mv,
                             vec *sum) {
    for (int p = shared; p < nk; p++)
        for (int i = 0; i < nv; i++) {
            const __mmask16 sees = _mm512_cmp_ps_mask(VSET1((float)p), VLOAD(l + i * VW), _CMP_LT_OQ);
            const vec w = _mm512_maskz_mov_ps(sees, VEXP(VSUB(VLOAD(col + p * rp + i * VW), mv[i])));
            VSTORE(col + p * rp + i * VW, w);
            sum[i] = VADD(sum[i], w);
        }
}
#endif

static void softmax_rows(float *sc, int64_t rp, int nvec, int shared, int nk, const float *lim, float *inv) {
    for (int i0 = 0; i0 < nvec; i0 += SV) {
        const int nv = nvec - i0 < SV ? nvec - i0 : SV;
        float *col = sc + i0 * VW;
        const float *l = lim + i0 * VW;
        vec mv[SV], sum[SV];
        for (int i = 0; i < SV; i++) { mv[i] = VSET1(-INFINITY); sum[i] = VZERO(); }
        for (int p = 0; p < shared; p++)
            for (int i = 0; i < nv; i++) mv[i] = VMAX(mv[i], VLOAD(col + p * rp + i * VW));
#if VW == 16
        softmax_tail_max(col, rp, nv, shared, nk, l, mv);
#else
        float m[SV * VW], s[SV * VW], e[SV * VW];
        for (int i = 0; i < nv; i++) VSTORE(m + i * VW, mv[i]);
        for (int p = shared; p < nk; p++)
            for (int j = 0; j < nv * VW; j++)
                if (p < l[j] && col[p * rp + j] > m[j]) m[j] = col[p * rp + j];
        for (int i = 0; i < nv; i++) mv[i] = VLOAD(m + i * VW);
#endif
        for (int p = 0; p < shared; p++)
            for (int i = 0; i < nv; i++) {
                const vec w = VEXP(VSUB(VLOAD(col + p * rp + i * VW), mv[i]));
                VSTORE(col + p * rp + i * VW, w);
                sum[i] = VADD(sum[i], w);
            }
#if VW == 16
        softmax_tail_exp(col, rp, nv, shared, nk, l, mv, sum);
        for (int i = 0; i < nv; i++) VSTORE(inv + i0 * VW + i * VW, _mm512_div_ps(VSET1(1.0f), sum[i]));
#else
        for (int i = 0; i < nv; i++) VSTORE(s + i * VW, sum[i]);
        for (int p = shared; p < nk; p++) {
            for (int i = 0; i < nv; i++) VSTORE(e + i * VW, VEXP(VSUB(VLOAD(col + p * rp + i * VW), mv[i])));
            for (int j = 0; j < nv * VW; j++) {
                const float w = p < l[j] ? e[j] : 0.0f;
                col[p * rp + j] = w;
                s[j] = s[j] + w;
            }
        }
        for (int j = 0; j < nv * VW; j++) inv[i0 * VW + j] = 1.0f / s[j];
#endif
    }
}

#include "paged_prefill_window.h"   /* softmax_rows_window, cap_rows */

/* qt [D][rp] = the task's R query rows transposed (row r = j * G + g at q + j * ldj + g * D), rows
 * R .. nvec * VW - 1 zero; bf16: every value rounded to bfloat16 (the keys are bfloat16: see the top). */
static void transpose_rows(const float *q, int G, int64_t ldj, int R, int nvec, int D, int64_t rp, int bf16,
                           float *qt) {
    for (int r = 0; r < nvec * VW; r++) {    /* stores, not gathers: AMD's gathers cost ~1 cycle a lane */
        const float *qr = r < R ? q + (int64_t)(r / G) * ldj + (int64_t)(r % G) * D : 0;
        for (int d = 0; d < D; d++) qt[(int64_t)d * rp + r] = qr ? qr[d] : 0.0f;
    }
    if (bf16) round_bf16(qt, (int64_t)D * rp);
}

/* Task t: sequence b, KV head h, query positions [i0, i0 + QT) (at most) of the sequence's new tokens. */
typedef struct {
    int b, h, i0;
} Where;

static Where locate(const Args *a, int64_t t) {
    int lo = 0, hi = a->B;                 /* the sequence whose tasks contain t */
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (a->first_task[mid] <= t) lo = mid; else hi = mid;
    }
    const int64_t local = t - a->first_task[lo], tiles = (a->q_len[lo] + QT - 1) / QT;
    return (Where){lo, (int)(local / tiles), (int)(local % tiles) * QT};
}

/* The query rows of task t (their lines come from memory), fetched while the task before it runs. */
static void prefetch_queries(const Args *a, int64_t t) {
    const Where w = locate(a, t);
    const int G = a->Hq / a->Hkv, npos = a->q_len[w.b] - w.i0 < QT ? a->q_len[w.b] - w.i0 : QT;
    const float *q = a->q + ((int64_t)(a->q_start[w.b] + w.i0) * a->Hq + w.h * G) * a->D;
    for (int j = 0; j < npos; j++)
        for (int i = 0; i < G * a->D; i += 16) __builtin_prefetch(q + (int64_t)j * a->Hq * a->D + i, 0, 2);
}

static void task(const Args *a, int64_t t, float *scratch, HeadRows *have) {
    const Where w = locate(a, t);
    const int b = w.b, h = w.h, i0 = w.i0;
    const int Hkv = a->Hkv, G = a->Hq / Hkv, D = a->D, W = Hkv * D;
    const int n = a->q_len[b], L = a->seq_lens[b], start = L - n;
    const int i1 = i0 + QT < n ? i0 + QT : n, npos = i1 - i0, nk = start + i1, R = G * npos;
    /* the first key any row of the task sees: its first position's window start (0: no window) */
    const int kfirst = a->sliding > 0 && start + i0 + 1 > a->sliding ? start + i0 + 1 - a->sliding : 0;
    const int64_t rp = rows_pad(a->Hq, Hkv), lmax = a->lmax;
    const int nvec = (R + VW - 1) / VW;
    const float **kr = (const float **)scratch, **vr = kr + lmax;
    float *qt = scratch + 4 * lmax, *sc = qt + rp * D, *kb = sc + lmax * rp, *vb = kb + lmax * D;
    float *lim = vb + lmax * D, *inv = lim + rp, *wlo = inv + rp, *acc = inv + 2 * rp;
    const int32_t *pages = a->page_table + (int64_t)b * a->max_pages;
    /* a task reads keys [kfirst, nk): kept rows serve if they start at or before kfirst and reach it
     * (under a window the keys before kfirst are never converted: a chunked prefill stays linear) */
    if (have->b != b || have->h != h || kfirst < have->lo || kfirst > have->n) *have = (HeadRows){b, h, kfirst, kfirst};
    const int dot = PREFILL_DOT && a->k_kind == KIND_BF16;   /* bfloat16 keys on vdpbf16ps, read in place */
    if (have->n < nk) {
        if (dot) head_ptrs(a->k, pages, a->S, have->n, nk, h, D, W, (const uint16_t **)kr);
        else head_rows(a->k, a->k_scale, a->k_kind, a->G, pages, a->S, have->n, nk, h, D, W, kb, kr);
        head_rows(a->v, a->v_scale, a->v_kind, a->G, pages, a->S, have->n, nk, h, D, W, vb, vr);
        have->n = nk;
    }
    /* rows r = j * G + g: position start + i0 + j, query head h * G + g; padding rows are zero */
    const int64_t first_row = ((int64_t)(a->q_start[b] + i0) * a->Hq + h * G) * D;   /* of row 0 in q and out */
    for (int r = 0; r < rp; r++) {
        const int pos = r < R ? start + i0 + r / G : kfirst;     /* padding rows see the first key only */
        lim[r] = (float)(pos + 1);
        wlo[r] = r < R ? (float)(a->sliding > 0 && pos + 1 > a->sliding ? pos + 1 - a->sliding : 0) : (float)kfirst;
    }
    transpose_rows(a->q + first_row, G, (int64_t)a->Hq * D, R, nvec, D, rp, a->k_kind == KIND_BF16, qt);
    const vec sv = VSET1(a->scale);
    if (dot) pair_rows(qt, D, rp, nvec * VW);
    for (int v0 = 0; v0 < nvec; v0 += RV) {
        const int nv = nvec - v0 < RV ? nvec - v0 : RV;
        int p = kfirst;
#if PREFILL_DOT
        if (dot) {
            const uint32_t *qt2 = (const uint32_t *)qt;
            const uint16_t *const *kr16 = (const uint16_t *const *)kr;
            for (; p + KP <= nk; p += KP) SCORE_DOT_KP[nv](qt2, rp, kr16, p, v0, D, sv, sc);
            for (; p < nk; p++) SCORE_DOT1[nv](qt2, rp, kr16, p, v0, D, sv, sc);
            continue;
        }
#endif
        for (; p + KP <= nk; p += KP) SCORE_KP[nv](qt, rp, kr, p, v0, D, sv, sc);
        for (; p < nk; p++) SCORE1[nv](qt, rp, kr, p, v0, D, sv, sc);
    }
    if (a->softcap > 0.0f) cap_rows(sc, rp, nvec, kfirst, nk, a->softcap);
    if (a->sliding > 0) softmax_rows_window(sc, rp, nvec, kfirst, nk, wlo, lim, inv);
    else softmax_rows(sc, rp, nvec, start + i0 + 1, nk, lim, inv);
    /* keys in blocks of PB (their value rows stay in L1 while every row tile uses them); a tile's rows
     * go together over the keys its first row sees, then each row alone over the rest of its own (a
     * row never touches a key past its position, so even a non-finite value there cannot reach it) */
    for (int p0 = kfirst; p0 < nk; p0 += PB) {
        for (int r0 = 0; r0 < R; r0 += RP) {
            const int nr = R - r0 < RP ? R - r0 : RP;
            const int common = (int)lim[r0];          /* rows in position order: the first sees least */
            for (int c0 = 0; c0 < D; c0 += DV * VW) {
                const int nd = (D - c0) / VW < DV ? (D - c0) / VW : DV;
                if (common > p0)
                    VALUE[nd][nr](sc, rp, vr, p0, common < p0 + PB ? common : p0 + PB, r0, c0, acc, D, p0 == kfirst);
                for (int r = r0; r < r0 + nr; r++) {
                    const int lo = common > p0 ? common : p0, own = (int)lim[r], hi = own < p0 + PB ? own : p0 + PB;
                    if (hi > lo) VALUE[nd][1](sc, rp, vr, lo, hi, r, c0, acc, D, lo == kfirst);
                }
            }
        }
    }
    for (int r = 0; r < R; r++) {
        const vec iv = VSET1(inv[r]);
        float *o = a->out + first_row + ((int64_t)(r / G) * a->Hq + r % G) * D;
        for (int c = 0; c < D; c += VW) VSTORE(o + c, VMUL(VLOAD(acc + (int64_t)r * D + c), iv));
    }
}

static void pool_task(void *ctx, int tid, int nth) {
    (void)nth;
    const Args *a = (const Args *)ctx;
    float *scratch = a->scratch + (int64_t)tid * paged_prefill_scratch_floats(a->Hq, a->Hkv, a->D, a->lmax, a->k_kind, a->v_kind);
    HeadRows have = {-1, -1, 0, 0};
    /* its own range first, in order (one conversion per head mostly), then what is left of the others' */
    for (int k = 0; k < a->nranges; k++) {
        Range *r = &a->ranges[(tid + k) % a->nranges];
        const int64_t end = a->ntasks * ((tid + k) % a->nranges + 1) / a->nranges;
        for (int64_t t = atomic_fetch_add(&r->next, 1); t < end; t = atomic_fetch_add(&r->next, 1)) {
            if (t + 1 < end) prefetch_queries(a, t + 1);    /* most likely this thread's next task */
            task(a, t, scratch, &have);
        }
    }
}
#endif

/* Returns 0 on success, 1 on shapes it cannot take (D not a multiple of the vector width). The caller checks page ids and lengths against the cache
 * and the table, q_start / q_len against q, and scratch's size (evalrun/kernels/cpu/paged_prefill.py). */
int paged_prefill(const float *q, const void *k_cache, const void *v_cache, const uint16_t *k_scale,
                  const uint16_t *v_scale, int k_kind, int v_kind, int G, const int32_t *page_table, int max_pages,
                  const int32_t *seq_lens, const int32_t *q_start, const int32_t *q_len, float *out, int B, int Hq,
                  int Hkv, int D, int S, float scale, float *scratch, int lmax, int nthreads, int sliding,
                  float softcap) {
#if PREFILL_SIMD
    if (B < 0 || Hq < 1 || Hkv < 1 || Hq % Hkv || D < VW || D % VW || S < 1 || lmax < 1 || sliding < 0
        || !(softcap >= 0.0f))
        return 1;
    for (int i = 0; i < 2; i++) {
        const int kind = i ? v_kind : k_kind;
        if (kind < KIND_F32 || kind > KIND_Q4) return 1;
        if ((kind == KIND_Q8 || kind == KIND_Q4) && (G < 2 || G % 2 || D % G || !(i ? v_scale : k_scale))) return 1;
    }
    if (B == 0) return 0;
    int64_t *first = malloc(sizeof(int64_t) * (size_t)(B + 1));
    if (!first) return 1;
    first[0] = 0;
    for (int b = 0; b < B; b++) {
        if (q_len[b] < 1 || q_len[b] > seq_lens[b] || seq_lens[b] > lmax) { free(first); return 1; }
        first[b + 1] = first[b] + (int64_t)Hkv * ((q_len[b] + QT - 1) / QT);
    }
    if (nthreads < 1) nthreads = 1;
    if (nthreads > first[B]) nthreads = (int)first[B];
    if (nthreads > MAX_RANGES) nthreads = MAX_RANGES;
    Range ranges[MAX_RANGES];
    for (int r = 0; r < nthreads; r++) atomic_init(&ranges[r].next, first[B] * r / nthreads);
    Args args = {q, k_cache, v_cache, k_scale, v_scale, k_kind, v_kind, G, page_table, max_pages, seq_lens,
                 q_start, q_len, out, B, Hq, Hkv, D, S, scale, scratch, lmax, sliding, softcap, first, first[B], nthreads,
                 ranges};
    evalrun_pool_run(pool_task, &args, nthreads);
    free(first);
    return 0;
#else
    (void)q; (void)k_cache; (void)v_cache; (void)k_scale; (void)v_scale; (void)k_kind; (void)v_kind; (void)G;
    (void)page_table; (void)max_pages; (void)seq_lens; (void)q_start; (void)q_len; (void)out; (void)B; (void)Hq;
    (void)Hkv; (void)D; (void)S; (void)scale; (void)scratch; (void)lmax; (void)nthreads; (void)sliding; (void)softcap;
    return 1;
#endif
}
