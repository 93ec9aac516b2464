/* Paged decode attention on the CPU: one query token per sequence, read straight from
 * the pages (no gathered copy of the context), GQA, float32 math.
 *
 * Layouts (as evalrun/kernels/kv_format.py and evalrun/kernels/attention.py):
 *   q           [B, Hq, D]          float32, in the attention domain (rotated for rotating
 *                                   formats; the caller rotates q in and the output out)
 *   k_cache     [P + 1, S, Hkv, W]  by kind: 0 float32, 1 bfloat16, 2 float16 (W = D);
 *   v_cache                         3 8-bit codes (W = D, value c - 128), 4 4-bit codes
 *                                   (W = D / 2, byte j of a group of G: element j in the low
 *                                   nibble, element j + G/2 in the high one; value c - 8)
 *   k_scale     [P + 1, S, Hkv, D / G] float16 scales of the code kinds (else unused)
 *   v_scale
 *   page_table  [B, max_pages]      int32
 *   seq_lens    [B]                 int32 context length (the new token included)
 *   out         [B, Hq, D]          float32
 *   sliding     a sliding window (0: none): each query, at position L - 1, attends the keys at
 *               positions p > L - 1 - sliding only, i.e. the last `sliding` positions (transformers'
 *               sliding_window_overlay); the keys before are never read
 *   softcap     soft-capping (0: none): each scaled score s becomes softcap * tanh(s / softcap)
 *               before the softmax (Gemma 2)
 *   wk, wv      [J, WW, Hkv, D]     optional recent-token window store (kinds 0-2; NULL: none):
 *   win_slot    [B]                 int32 block of the store of each sequence, and
 *   win_start   [B]                 int32 first position read from it (row pos - win_start);
 *                                   positions before it are read from the pages
 *   scratch     [nthreads, SCRATCH(Hq, Hkv, D, lmax)] float32, lmax >= max(seq_lens):
 *               per thread the scores [Hq, lmax], the V sums [Hq, D], up to 64 converted
 *               head rows [64, D] and the softmax normalisers [Hq] (heap, not thread stacks)
 *
 * Codes are dequantized a block of head rows at a time into that small buffer, which
 * stays in L1: the context is never copied, so a 4-bit cache moves about a quarter
 * of the bytes of a 16-bit one through attention.
 *
 * bfloat16 keys: every path scores q rounded to bfloat16 (to nearest even), as torch's bf16
 * attention and flash-attention do: each product of a key element and a query element is then
 * exact in float32, so on a CPU with AVX512_BF16 the scores are vdpbf16ps (paged_decode_z.h),
 * elsewhere float32 multiply-adds of the same values; only the order of the adds differs.
 *
 * Work is split over sequences, claimed one at a time by the threads of the shared pool
 * (pool.h; a thread claims its next sequence before it runs one, for the prefetch stream of
 * decode_prefetch.h); a sequence's query
 * heads are scored against every key (exact two-pass softmax), then V is summed with
 * those weights.
 * The torch reference is kernels.attention.decode_torch.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "kv_load.h"
#include "pool.h"
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* Floats of scratch per thread; evalrun/kernels/cpu/paged_decode.py allocates nthreads times this. */
#define SCRATCH(Hq, Hkv, D, lmax) ((int64_t)(Hq) * (lmax) + (int64_t)(Hq) * (D) + 64 * (int64_t)(D) + (Hq))

typedef struct {
    const float *q;
    const void *k, *v;
    const uint16_t *k_scale, *v_scale;
    int k_kind, v_kind, G;
    const int32_t *page_table;
    int max_pages;
    const int32_t *seq_lens;
    float *out;
    int B, Hq, Hkv, D, S;
    float scale;
    float *scratch;
    int lmax, nthreads, tid;
    const void *wk, *wv;
    int w_kind, WW;
    const int32_t *win_slot, *win_start;
    int sliding;                   /* sliding window, 0: none */
    float softcap;                 /* soft-capping, 0: none */
    atomic_int *next_task;         /* shared: tasks are claimed one by one, so a thread on a
                                      busy core does not hold the others up */
} Args;

/* The first position a sequence of length L reads under a sliding window of `sliding` (0: none). */
static inline int first_position(int L, int sliding) { return sliding > 0 && L > sliding ? L - sliding : 0; }

/* A sequence's window: positions >= start are row base + pos - start of `store` (kind). */
typedef struct {
    const void *store;
    int kind, start;
    int64_t base;
} Window;

/* The rows of positions p0 .. p0 + n - 1, for every head: slot[p] their cache slot (page * S +
 * offset, walking the page table without a division per position) or, for positions in the
 * window, their row of the window store; returns how many precede the window (those read the
 * cache). One walk per block serves every head and both the prefetches and the loads: a division
 * and a table read per position and head cost more than the FMAs at these head sizes. */
static inline int block_slots(const int32_t *pages, int S, int p0, int n, const Window *win, int64_t *slot) {
    const int in_cache = win->start - p0 >= n ? n : win->start - p0 > 0 ? win->start - p0 : 0;
    int page = p0 / S, off = p0 - page * S;
    for (int p = 0; p < in_cache; p++) {
        slot[p] = (int64_t)pages[page] * S + off;
        if (++off == S) { off = 0; page++; }
    }
    for (int p = in_cache; p < n; p++) slot[p] = win->base + p0 + p - win->start;
    return in_cache;
}

/* rows[p] = head h of the block's positions (see block_slots and load_head). Returns n. */
static inline int load_rows(const void *cache, const uint16_t *scales, int kind, int G, const int64_t *slot,
                            int in_cache, int n, int h, int D, int W, float *buf, const float **rows,
                            const Window *win) {
    if (kind == KIND_F32)
        for (int p = 0; p < in_cache; p++) rows[p] = (const float *)cache + slot[p] * W + (int64_t)h * D;
    else
        for (int p = 0; p < in_cache; p++)
            rows[p] = load_head(cache, scales, kind, G, slot[p], h, D, W, buf + (int64_t)p * D);
    for (int p = in_cache; p < n; p++)
        rows[p] = load_head(win->store, NULL, win->kind, G, slot[p], h, D, W, buf + (int64_t)p * D);
    return n;
}

/* Keys scored together, and values summed per pass over the accumulators. Interleaved A/B in a C
 * harness (30 layers of float32 pages, 32 rows x 100-400 positions, SmolLM2's 9/3 heads of 64, 2
 * threads, AVX2, pages streamed from memory): the grouped tiles below with blocks of 16/16 took
 * 0.88-0.92 of the time of one-head-at-a-time tiles with blocks of 8/64. The prefetch stream's path
 * (float pages, no window store) takes blocks of SBLOCK (benchmarks/ab_decode_attention.py, Zen 3: 4/4
 * took 0.89 of 16/16's time at 470 positions, 0.86 at 150, 0.94 with bf16 pages; the same bits). */
#define BLOCK 16
#define VBLOCK 16
#define SBLOCK 4
#define ROWS_MAX (BLOCK > VBLOCK ? BLOCK : VBLOCK)
_Static_assert(SBLOCK <= ROWS_MAX && ROWS_MAX <= 64, "the scratch converts at most 64 head rows at a time");

/* out[p] = q . k[p] for the n <= BLOCK keys of a block (the path of head sizes that are not a
 * multiple of 8; dots_group takes the others). */
static __attribute__((noinline)) void dots(const float *q, const float *const *k, int n, int D, float *out) {
    for (int p = 0; p < n; p++) {
        float s = 0.0f;
        #pragma omp simd reduction(+:s)
        for (int d = 0; d < D; d++) s += q[d] * k[p][d];
        out[p] = s;
    }
}

#if defined(__AVX2__) && defined(__FMA__)
/* Scores of HG (1..3) query heads that share a KV head x 4 keys: each key row is loaded once for
 * the HG heads (12 chains of 8 lanes at HG 3; scoring one head at a time loaded every key row HG
 * times, and its 8-key tiles had 8 chains). Each chain runs over d in order and is reduced
 * ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), whatever the tile, so a score does not depend
 * on where its key falls in a block. Writes the first n (<= 4) keys' scores of head g to
 * out + g * ostride (a tile of n < 4 repeats key 0 in the unused slots). */
#define GACC(g)                                                                                   \
    __m256 a##g##0 = _mm256_setzero_ps(), a##g##1 = a##g##0, a##g##2 = a##g##0, a##g##3 = a##g##0;
#define GFMA(g)                                                                                   \
    if (HG > g) {                                                                                 \
        const __m256 qv = _mm256_loadu_ps(q + g * D + d);                                         \
        a##g##0 = _mm256_fmadd_ps(qv, k0v, a##g##0);                                              \
        a##g##1 = _mm256_fmadd_ps(qv, k1v, a##g##1);                                              \
        a##g##2 = _mm256_fmadd_ps(qv, k2v, a##g##2);                                              \
        a##g##3 = _mm256_fmadd_ps(qv, k3v, a##g##3);                                              \
    }
#define GOUT(g)                                                                                   \
    if (HG > g) {                                                                                 \
        const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a##g##0, a##g##1), _mm256_hadd_ps(a##g##2, a##g##3)); \
        const __m128 r = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));      \
        if (n == 4) _mm_storeu_ps(out + g * ostride, r);                                          \
        else { float t_[4]; _mm_storeu_ps(t_, r); for (int p = 0; p < n; p++) out[g * ostride + p] = t_[p]; } \
    }
static inline __attribute__((always_inline)) void dots_tile(const int HG, const float *q, const float *const *k,
                                                             int n, int D, float *out, int64_t ostride) {
    const float *k0 = k[0], *k1 = k[n > 1 ? 1 : 0], *k2 = k[n > 2 ? 2 : 0], *k3 = k[n > 3 ? 3 : 0];
    GACC(0) GACC(1) GACC(2)
    for (int d = 0; d < D; d += 8) {
        const __m256 k0v = _mm256_loadu_ps(k0 + d), k1v = _mm256_loadu_ps(k1 + d), k2v = _mm256_loadu_ps(k2 + d),
                     k3v = _mm256_loadu_ps(k3 + d);
        GFMA(0) GFMA(1) GFMA(2)
    }
    GOUT(0) GOUT(1) GOUT(2)
}
#undef GACC
#undef GFMA
#undef GOUT
#endif

/* Not inlined (nor axpys_group): inlined into sequence() such loops ran short of registers and
 * reloaded their row pointers from the stack (1.1-1.4x slower, interleaved A/B).
 * out[g * ostride + p] = q[g] . k[p] for the G query heads (rows of q, stride D) that share these
 * n <= BLOCK keys. */
static __attribute__((noinline)) void dots_group(const float *q, int G, const float *const *k, int n, int D,
                                                  float *out, int64_t ostride) {
#if defined(__AVX2__) && defined(__FMA__)
    if (D % 8 == 0) {
        for (int g = 0; g < G;) {
            const int hg = G - g >= 3 ? 3 : G - g;
            for (int p = 0; p < n; p += 4) {
                const int m = n - p < 4 ? n - p : 4;
                float *o = out + g * ostride + p;
                if (hg == 3) dots_tile(3, q + (int64_t)g * D, k + p, m, D, o, ostride);
                else if (hg == 2) dots_tile(2, q + (int64_t)g * D, k + p, m, D, o, ostride);
                else dots_tile(1, q + (int64_t)g * D, k + p, m, D, o, ostride);
            }
            g += hg;
        }
        return;
    }
#endif
    for (int g = 0; g < G; g++) dots(q + (int64_t)g * D, k, n, D, out + g * ostride);
}

#if defined(__AVX2__) && defined(__FMA__)
/* acc[d0 .. d0 + 8 NV) += sum over p of w[p] * v[p][...]: NV accumulators held in registers, one
 * chain per 8 columns, positions in order. */
static inline __attribute__((always_inline)) void axpy_span(float *acc, const float *w, const float *const *v,
                                                             int n, int d0, const int NV) {
    __m256 a[8];
    _Pragma("GCC unroll 8") for (int j = 0; j < NV; j++) a[j] = _mm256_loadu_ps(acc + d0 + 8 * j);
    for (int p = 0; p < n; p++) {
        const __m256 wb = _mm256_set1_ps(w[p]);
        const float *vp = v[p] + d0;
        _Pragma("GCC unroll 8") for (int j = 0; j < NV; j++) a[j] = _mm256_fmadd_ps(wb, _mm256_loadu_ps(vp + 8 * j), a[j]);
    }
    _Pragma("GCC unroll 8") for (int j = 0; j < NV; j++) _mm256_storeu_ps(acc + d0 + 8 * j, a[j]);
}
#endif

/* acc[D] += sum over the n values of a block of w[p] * v[p]. */
static __attribute__((noinline)) void axpys(float *acc, const float *w, const float *const *v, int n, int D) {
    int d0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
    for (; d0 + 64 <= D; d0 += 64) axpy_span(acc, w, v, n, d0, 8);      /* eight independent chains */
    for (; d0 + 32 <= D; d0 += 32) axpy_span(acc, w, v, n, d0, 4);
#endif
    for (int p = 0; p < n; p++) {
        const float wp = w[p];
        #pragma omp simd
        for (int d = d0; d < D; d++) acc[d] += wp * v[p][d];
    }
}


#if defined(__AVX2__) && defined(__FMA__)
/* acc[g][d0 .. d0 + 32) += sum over p of w[g][p] * v[p][d0 ..] for HG (1..3) query heads that share
 * the values: 4 HG accumulators in registers, each value row loaded once for the HG heads, one chain
 * per 8 columns with positions in order (the chains of axpy_span, so the sums are the same bits). */
#define VACC(g)                                                                                   \
    __m256 c##g##0, c##g##1, c##g##2, c##g##3;                                                    \
    if (HG > g) {                                                                                 \
        c##g##0 = _mm256_loadu_ps(acc + g * D + d0); c##g##1 = _mm256_loadu_ps(acc + g * D + d0 + 8); \
        c##g##2 = _mm256_loadu_ps(acc + g * D + d0 + 16); c##g##3 = _mm256_loadu_ps(acc + g * D + d0 + 24); \
    }
#define VFMA(g)                                                                                   \
    if (HG > g) {                                                                                 \
        const __m256 wb = _mm256_set1_ps(w[g * ws + p]);                                          \
        c##g##0 = _mm256_fmadd_ps(wb, v0, c##g##0); c##g##1 = _mm256_fmadd_ps(wb, v1, c##g##1);   \
        c##g##2 = _mm256_fmadd_ps(wb, v2, c##g##2); c##g##3 = _mm256_fmadd_ps(wb, v3, c##g##3);   \
    }
#define VOUT(g)                                                                                   \
    if (HG > g) {                                                                                 \
        _mm256_storeu_ps(acc + g * D + d0, c##g##0); _mm256_storeu_ps(acc + g * D + d0 + 8, c##g##1); \
        _mm256_storeu_ps(acc + g * D + d0 + 16, c##g##2); _mm256_storeu_ps(acc + g * D + d0 + 24, c##g##3); \
    }
static inline __attribute__((always_inline)) void axpy_tile(const int HG, float *acc, const float *w, int64_t ws,
                                                             const float *const *v, int n, int d0, int D) {
    VACC(0) VACC(1) VACC(2)
    for (int p = 0; p < n; p++) {
        const float *vp = v[p] + d0;
        const __m256 v0 = _mm256_loadu_ps(vp), v1 = _mm256_loadu_ps(vp + 8), v2 = _mm256_loadu_ps(vp + 16),
                     v3 = _mm256_loadu_ps(vp + 24);
        VFMA(0) VFMA(1) VFMA(2)
    }
    VOUT(0) VOUT(1) VOUT(2)
}
#undef VACC
#undef VFMA
#undef VOUT
#endif

/* acc[g][D] += sum over the n values of a block of w[g][p] * v[p] for the G query heads (acc rows
 * of D, weight rows of stride ws) that share these values. */
static __attribute__((noinline)) void axpys_group(float *acc, int G, const float *w, int64_t ws,
                                                   const float *const *v, int n, int D) {
#if defined(__AVX2__) && defined(__FMA__)
    if (D % 32 == 0) {
        for (int g = 0; g < G;) {
            const int hg = G - g >= 3 ? 3 : G - g;
            float *a = acc + (int64_t)g * D;
            const float *wg = w + g * ws;
            for (int d0 = 0; d0 < D; d0 += 32) {
                if (hg == 3) axpy_tile(3, a, wg, ws, v, n, d0, D);
                else if (hg == 2) axpy_tile(2, a, wg, ws, v, n, d0, D);
                else axpy_tile(1, a, wg, ws, v, n, d0, D);
            }
            g += hg;
        }
        return;
    }
#endif
    for (int g = 0; g < G; g++) axpys(acc + (int64_t)g * D, w + g * ws, v, n, D);
}

#include "decode_softmax.h"        /* softmax_weights, cap_scores */
#include "decode_prefetch.h"       /* prefetch_rows, Stream, prefetch_ahead */
#define PFD 16                     /* keys prefetched this many positions ahead */
#ifndef STREAM_PFD
#define STREAM_PFD 32              /* positions ahead on the prefetch stream (decode_prefetch.h) */
#endif

/* One sequence: every query head scored against every key, an exact two-pass softmax
 * (vectorized exp), then the values summed with those weights. Keys and values are read
 * once, block by block in page order with all KV heads of a slot together (sequential
 * memory, which the prefetcher follows); interleaved A/B against reading one head's slice
 * per pass: 1.2-1.5x at 1-32 rows x 300-2,000 positions (SmolLM2 shapes, AVX2). next (or -1):
 * the sequence this thread takes after it, whose first keys the prefetch stream reaches. The stream
 * over the three passes, against prefetching within each pass (interleaved A/B, 30 layers of float32
 * pages on 2 MiB pages, 32 rows x 150 and 470 positions, 9/3 heads of 64, 2 threads, Zen 3):
 * 0.79-0.80x the time, outputs bitwise equal. */
static void sequence(const Args *a, int b, int next, float *scores, float *rowbuf, float *acc, float *inv_sum) {
    const int Hq = a->Hq, Hkv = a->Hkv, Gq = Hq / Hkv, D = a->D, S = a->S, W = Hkv * D;
    const int L = a->seq_lens[b];
    const int64_t lmax = a->lmax;
    const float *q = a->q + (int64_t)b * Hq * D;
    float *o = a->out + (int64_t)b * Hq * D;
    if (L <= 0) {                   /* empty context: zeros, as an empty softmax sum gives */
        memset(o, 0, sizeof(float) * (size_t)Hq * D);
        return;
    }
    const int32_t *pages = a->page_table + (int64_t)b * a->max_pages;
    const int P0 = first_position(L, a->sliding), n_keys = L - P0;   /* scores[p - P0] */
    if (a->k_kind == KIND_BF16) {   /* bfloat16 keys: q rounded to bfloat16 (acc is free until the values) */
        memcpy(acc, q, sizeof(float) * (size_t)Hq * D);
        round_bf16(acc, (int64_t)Hq * D);
        q = acc;
    }
    const float *rows[ROWS_MAX];
    Window wk = {a->wk, a->w_kind, a->wk ? a->win_start[b] : L, a->wk ? (int64_t)a->win_slot[b] * a->WW : 0};
    Window wv = wk;
    wv.store = a->wv;
    /* Positions outer, KV heads inner: a block of slots is read whole, in memory order (a slot
     * holds every head), instead of one head's slice per pass over the context. */
    int64_t slot[ROWS_MAX], ahead[ROWS_MAX];
    /* Float pages without a window store: the prefetch stream (keys, values, the next sequence's
     * keys), a share of the block STREAM_PFD ahead before each head. Else float32 keys are
     * prefetched PFD ahead and values a block ahead, within this sequence. */
    const int stream = !a->wk && a->k_kind == a->v_kind && a->k_kind <= KIND_F16;
    const int64_t slot_bytes = (int64_t)W * (a->k_kind == KIND_F32 ? 4 : 2);
    const int next_len = next >= 0 ? a->seq_lens[next] : 0;
    const Stream keys = {(const char *)a->k, pages, L, P0}, values = {(const char *)a->v, pages, L, P0},
                 next_keys = {(const char *)a->k, next >= 0 ? a->page_table + (int64_t)next * a->max_pages : pages,
                              next_len, first_position(next_len, a->sliding)};
    const int kb = stream ? SBLOCK : BLOCK, vb = stream ? SBLOCK : VBLOCK;   /* keys, values per block */
    if (stream) prefetch_ahead(&keys, &values, slot_bytes, S, P0, P0 + STREAM_PFD);
    for (int p0 = P0; p0 < L; p0 += kb) {
        const int n = L - p0 < kb ? L - p0 : kb, in_cache = block_slots(pages, S, p0, n, &wk, slot);
        if (!stream && a->k_kind == KIND_F32 && p0 + PFD < L) {
            const int m = L - p0 - PFD < BLOCK ? L - p0 - PFD : BLOCK;
            prefetch_rows(a->k, ahead, block_slots(pages, S, p0 + PFD, m, &wk, ahead), W);
        }
        for (int h = 0; h < Hkv; h++) {
            if (stream)
                prefetch_ahead(&keys, &values, slot_bytes, S, p0 + STREAM_PFD + h * n / Hkv, p0 + STREAM_PFD + (h + 1) * n / Hkv);
            load_rows(a->k, a->k_scale, a->k_kind, a->G, slot, in_cache, n, h, D, W, rowbuf, rows, &wk);
            dots_group(q + (int64_t)h * Gq * D, Gq, rows, n, D, scores + h * Gq * lmax + p0 - P0, lmax);
        }
    }
    for (int hq = 0; hq < Hq; hq++) {
        if (a->softcap > 0.0f) cap_scores(scores + hq * lmax, n_keys, a->scale, a->softcap);
        inv_sum[hq] = 1.0f / softmax_weights(scores + hq * lmax, n_keys, a->softcap > 0.0f ? 1.0f : a->scale);
        memset(acc + (int64_t)hq * D, 0, sizeof(float) * (size_t)D);
    }
    if (!stream && a->v_kind == KIND_F32)
        prefetch_rows(a->v, slot, block_slots(pages, S, P0, n_keys < VBLOCK ? n_keys : VBLOCK, &wv, slot), W);
    for (int p0 = P0; p0 < L; p0 += vb) {
        const int n = L - p0 < vb ? L - p0 : vb, in_cache = block_slots(pages, S, p0, n, &wv, slot);
        int ahead_n = 0;                            /* slots of the next block held in `ahead` */
        if (!stream && a->v_kind == KIND_F32 && p0 + VBLOCK < L) {
            const int m = L - p0 - VBLOCK < VBLOCK ? L - p0 - VBLOCK : VBLOCK;
            ahead_n = block_slots(pages, S, p0 + VBLOCK, m, &wv, ahead);
        }
        const int share = (VBLOCK + Hkv - 1) / Hkv;
        for (int h = 0; h < Hkv; h++) {
            if (stream)
                prefetch_ahead(&values, &next_keys, slot_bytes, S, p0 + STREAM_PFD + h * n / Hkv,
                               p0 + STREAM_PFD + (h + 1) * n / Hkv);
            else if (ahead_n > h * share)           /* the next block, a share before each head's pass */
                prefetch_rows(a->v, ahead + h * share, ahead_n - h * share < share ? ahead_n - h * share : share, W);
            load_rows(a->v, a->v_scale, a->v_kind, a->G, slot, in_cache, n, h, D, W, rowbuf, rows, &wv);
            axpys_group(acc + (int64_t)h * Gq * D, Gq, scores + h * Gq * lmax + p0 - P0, lmax, rows, n, D);
        }
    }
    for (int hq = 0; hq < Hq; hq++)
        for (int d = 0; d < D; d++) o[(int64_t)hq * D + d] = acc[(int64_t)hq * D + d] * inv_sum[hq];
}

#include "paged_decode_z.h"          /* the AVX-512 path for float pages (fast_path, sequence16) */

static void decode_worker(const Args *a) {
    float *scores = a->scratch + (int64_t)a->tid * SCRATCH(a->Hq, a->Hkv, a->D, a->lmax);
    float *acc = scores + (int64_t)a->Hq * a->lmax;
    float *rowbuf = acc + (int64_t)a->Hq * a->D;
    float *inv_sum = rowbuf + 64 * (int64_t)a->D;
#if defined(__AVX512F__)
    if (fast_path(a)) {             /* the next task is claimed before this one runs, for its prefetch */
        for (int b = atomic_fetch_add(a->next_task, 1), next; b < a->B; b = next) {
            next = atomic_fetch_add(a->next_task, 1);
            const int pf = next < a->B ? next : -1;
            if (a->k_kind == KIND_BF16) sequence_bf16(a, b, pf, scores, acc, inv_sum, rowbuf);
            else if (a->k_kind == KIND_F32) sequence_f32(a, b, pf, scores, acc, inv_sum, rowbuf);
            else sequence_f16(a, b, pf, scores, acc, inv_sum, rowbuf);
        }
        return;
    }
#endif
    for (int b = atomic_fetch_add(a->next_task, 1), next; b < a->B; b = next) {   /* as above */
        next = atomic_fetch_add(a->next_task, 1);
        sequence(a, b, next < a->B ? next : -1, scores, rowbuf, acc, inv_sum);
    }
}

static void pool_task(void *ctx, int tid, int nth) {
    (void)nth;
    Args a = *(const Args *)ctx;
    a.tid = tid;                    /* its own scratch */
    decode_worker(&a);
}

/* Returns 0 on success, 1 on shapes it cannot take. The caller checks page ids, lengths
 * and window rows against the cache, the table and the store (evalrun/kernels/cpu/paged_decode.py). */
int paged_decode(const float *q, const void *k_cache, const void *v_cache,
                 const uint16_t *k_scale, const uint16_t *v_scale, int k_kind, int v_kind, int G,
                 const int32_t *page_table, int max_pages, const int32_t *seq_lens, float *out,
                 int B, int Hq, int Hkv, int D, int S, float scale, float *scratch, int lmax,
                 int nthreads, const void *wk, const void *wv, int w_kind, int WW,
                 const int32_t *win_slot, const int32_t *win_start, int sliding, float softcap) {
    if (B < 0 || Hq < 1 || Hkv < 1 || Hq % Hkv || D < 1 || S < 1 || lmax < 1 || sliding < 0 || !(softcap >= 0.0f))
        return 1;
    if (wk && (!wv || !win_slot || !win_start || WW < 1 || w_kind < KIND_F32 || w_kind > KIND_F16)) return 1;
    for (int i = 0; i < 2; i++) {
        const int kind = i ? v_kind : k_kind;
        const int quantized = kind == KIND_Q8 || kind == KIND_Q4;
        if (kind < KIND_F32 || kind > KIND_Q4) return 1;
        if (quantized && (G < 2 || G % 2 || D % G || !(i ? v_scale : k_scale))) return 1;
    }
    if (nthreads < 1) nthreads = 1;
    if (nthreads > B) nthreads = B > 0 ? B : 1;           /* one sequence is one task */
    atomic_int next_task = 0;
    Args args = {q, k_cache, v_cache, k_scale, v_scale, k_kind, v_kind, G, page_table, max_pages, seq_lens, out,
                 B, Hq, Hkv, D, S, scale, scratch, lmax, nthreads, 0, wk, wv, w_kind, WW,
                 win_slot, win_start, sliding, softcap, &next_task};
    evalrun_pool_run(pool_task, &args, nthreads);         /* tasks are claimed until none are left */
    return 0;
}
