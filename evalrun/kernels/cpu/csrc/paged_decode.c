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
 * Work is split over sequences, claimed one at a time by the threads of the shared pool
 * (pool.h); a sequence's query
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
    atomic_int *next_task;         /* shared: tasks are claimed one by one, so a thread on a
                                      busy core does not hold the others up */
} Args;

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
 * 0.88-0.92 of the time of one-head-at-a-time tiles with blocks of 8/64. */
#define BLOCK 16
#define VBLOCK 16
#define ROWS_MAX (BLOCK > VBLOCK ? BLOCK : VBLOCK)
_Static_assert(ROWS_MAX <= 64, "the scratch converts at most 64 head rows at a time");

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

#include "simd_math.h"

/* In place: sh[pos] = exp(scale * sh[pos] - max); returns the sum. The same code runs for every
 * row whatever the batch, so a row's weights never depend on its neighbours. */
static float softmax_weights(float *sh, int L, float scale) {
    int pos = 0;
    float m = -INFINITY, sum = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 sv = _mm256_set1_ps(scale);
    __m256 mv = _mm256_set1_ps(-INFINITY);
    for (; pos + 8 <= L; pos += 8) {
        const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(sh + pos), sv);
        _mm256_storeu_ps(sh + pos, x);
        mv = _mm256_max_ps(mv, x);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, mv);
    for (int i = 0; i < 8; i++) m = lanes[i] > m ? lanes[i] : m;
#endif
    for (int p = pos; p < L; p++) { sh[p] *= scale; m = sh[p] > m ? sh[p] : m; }
    pos = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 mb = _mm256_set1_ps(m);
    __m256 acc = _mm256_setzero_ps();
    for (; pos + 8 <= L; pos += 8) {
        const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(sh + pos), mb));
        _mm256_storeu_ps(sh + pos, e);
        acc = _mm256_add_ps(acc, e);
    }
    _mm256_storeu_ps(lanes, acc);
    for (int i = 0; i < 8; i++) sum += lanes[i];
#endif
    for (; pos < L; pos++) { sh[pos] = expf(sh[pos] - m); sum += sh[pos]; }
    return sum;
}

#define PFD 16                     /* keys prefetched this many positions ahead */
/* Prefetch every line of the float32 slots slot[0 .. n): a sequence's slots are contiguous within
 * a page, but the hardware prefetchers lose the stream at each 4 KB boundary. Interleaved A/B
 * (32 rows x 200 positions, 30 layers, 2 threads, AVX2): 1.2-1.3x over none. */
static inline void prefetch_rows(const void *cache, const int64_t *slot, int n, int W) {
    for (int p = 0; p < n; p++) {
        const char *s = (const char *)((const float *)cache + slot[p] * W);
        for (int b = 0; b < W * 4; b += 64) __builtin_prefetch(s + b, 0, 3);
    }
}

/* One sequence: every query head scored against every key, an exact two-pass softmax
 * (vectorized exp), then the values summed with those weights. Keys and values are read
 * once, block by block in page order with all KV heads of a slot together (sequential
 * memory, which the prefetcher follows); interleaved A/B against reading one head's slice
 * per pass: 1.2-1.5x at 1-32 rows x 300-2,000 positions (SmolLM2 shapes, AVX2). */
static void sequence(const Args *a, int b, float *scores, float *rowbuf, float *acc, float *inv_sum) {
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
    const float *rows[ROWS_MAX];
    Window wk = {a->wk, a->w_kind, a->wk ? a->win_start[b] : L, a->wk ? (int64_t)a->win_slot[b] * a->WW : 0};
    Window wv = wk;
    wv.store = a->wv;
    /* Positions outer, KV heads inner: a block of slots is read whole, in memory order (a slot
     * holds every head), instead of one head's slice per pass over the context. */
    int64_t slot[ROWS_MAX], ahead[ROWS_MAX];
    for (int p0 = 0; p0 < L; p0 += BLOCK) {
        const int n = L - p0 < BLOCK ? L - p0 : BLOCK, in_cache = block_slots(pages, S, p0, n, &wk, slot);
        if (a->k_kind == KIND_F32 && p0 + PFD < L) {
            const int m = L - p0 - PFD < BLOCK ? L - p0 - PFD : BLOCK;
            prefetch_rows(a->k, ahead, block_slots(pages, S, p0 + PFD, m, &wk, ahead), W);
        }
        for (int h = 0; h < Hkv; h++) {
            load_rows(a->k, a->k_scale, a->k_kind, a->G, slot, in_cache, n, h, D, W, rowbuf, rows, &wk);
            dots_group(q + (int64_t)h * Gq * D, Gq, rows, n, D, scores + h * Gq * lmax + p0, lmax);
        }
    }
    for (int hq = 0; hq < Hq; hq++) {
        inv_sum[hq] = 1.0f / softmax_weights(scores + hq * lmax, L, a->scale);
        memset(acc + (int64_t)hq * D, 0, sizeof(float) * (size_t)D);
    }
    if (a->v_kind == KIND_F32)
        prefetch_rows(a->v, slot, block_slots(pages, S, 0, L < VBLOCK ? L : VBLOCK, &wv, slot), W);
    for (int p0 = 0; p0 < L; p0 += VBLOCK) {
        const int n = L - p0 < VBLOCK ? L - p0 : VBLOCK, in_cache = block_slots(pages, S, p0, n, &wv, slot);
        int ahead_n = 0;                            /* slots of the next block held in `ahead` */
        if (a->v_kind == KIND_F32 && p0 + VBLOCK < L) {
            const int m = L - p0 - VBLOCK < VBLOCK ? L - p0 - VBLOCK : VBLOCK;
            ahead_n = block_slots(pages, S, p0 + VBLOCK, m, &wv, ahead);
        }
        const int share = (VBLOCK + Hkv - 1) / Hkv;
        for (int h = 0; h < Hkv; h++) {
            if (ahead_n > h * share)                /* the next block, a share before each head's pass */
                prefetch_rows(a->v, ahead + h * share, ahead_n - h * share < share ? ahead_n - h * share : share, W);
            load_rows(a->v, a->v_scale, a->v_kind, a->G, slot, in_cache, n, h, D, W, rowbuf, rows, &wv);
            axpys_group(acc + (int64_t)h * Gq * D, Gq, scores + h * Gq * lmax + p0, lmax, rows, n, D);
        }
    }
    for (int hq = 0; hq < Hq; hq++)
        for (int d = 0; d < D; d++) o[(int64_t)hq * D + d] = acc[(int64_t)hq * D + d] * inv_sum[hq];
}

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

/* out[g * ostride + p] = q[g] . k[p] for the Gq query heads sharing the n <= FAST_BLOCK keys k. */
static inline __attribute__((always_inline)) void score_block16(const int KIND, const float *q, int Gq, int D,
                                                                 const void *const *k, int n, float *out,
                                                                 int64_t ostride) {
    float tmp[4 * FAST_BLOCK * 16] __attribute__((aligned(64)));
    const __mmask16 keep = (__mmask16)((1u << n) - 1);
    for (int g0 = 0; g0 < Gq; g0 += 4) {
        const int hg = Gq - g0 < 4 ? Gq - g0 : 4;
        const float *qg = q + (int64_t)g0 * D;
        for (int p = 0; p < n; p += 4) {
            const int m = n - p < 4 ? n - p : 4;
            float *t = tmp + p * 16;
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

/* Rows 0 .. len - 1 of one sequence's keys or values: cache, the sequence's page table, len. */
typedef struct {
    const char *cache;
    const int32_t *pages;
    int len;
} Stream;

/* Prefetch every line of the rows of positions lo .. hi - 1 of `cur`, continuing into `then`
 * past its end. */
static inline void prefetch_ahead(const Stream *cur, const Stream *then, int64_t slot_bytes, int S, int lo, int hi) {
    for (int i = 0; i < 2; i++) {
        const Stream *st = i ? then : cur;
        int a = i ? (lo > cur->len ? lo - cur->len : 0) : lo, b = i ? hi - cur->len : (hi < cur->len ? hi : cur->len);
        if (b > st->len) b = st->len;
        while (a < b) {
            const int page = a / S, off = a - page * S, m = S - off < b - a ? S - off : b - a;
            const char *s = st->cache + ((int64_t)st->pages[page] * S + off) * slot_bytes, *e = s + m * slot_bytes;
            for (s = (const char *)((uintptr_t)s & ~(uintptr_t)63); s < e; s += 64) _mm_prefetch(s, _MM_HINT_T1);
            a += m;
        }
    }
}

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
 * thread takes after it. qt: [Hq, D] scratch for q in tile order. */
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
    const Stream keys = {kc, pages, L}, values = {vc, pages, L},
                 next_keys = {kc, next >= 0 ? a->page_table + (int64_t)next * a->max_pages : pages,
                              next >= 0 ? a->seq_lens[next] : 0};
    const Window none = {NULL, 0, L, 0};
    int64_t slot[FAST_BLOCK];
    const void *rows[FAST_BLOCK];
    if (KIND == KIND_BF16) {
        for (int hq = 0; hq < Hq; hq++) bf16_order(qt + (int64_t)hq * D, q + (int64_t)hq * D, D, 0);
        q = qt;
    }
    prefetch_ahead(&keys, &values, slot_bytes, S, 0, FAST_PFD);
    for (int p0 = 0; p0 < L; p0 += FAST_BLOCK) {
        const int n = L - p0 < FAST_BLOCK ? L - p0 : FAST_BLOCK;
        block_slots(pages, S, p0, n, &none, slot);
        for (int h = 0; h < Hkv; h++) {       /* the block FAST_PFD ahead, a share before each head */
            prefetch_ahead(&keys, &values, slot_bytes, S, p0 + FAST_PFD + h * n / Hkv, p0 + FAST_PFD + (h + 1) * n / Hkv);
            for (int p = 0; p < n; p++) rows[p] = kc + (slot[p] * W + (int64_t)h * D) * es;
            score_block16(KIND, q + (int64_t)h * Gq * D, Gq, D, rows, n, scores + h * Gq * lmax + p0, lmax);
        }
    }
    for (int hq = 0; hq < Hq; hq++) {
        inv_sum[hq] = 1.0f / softmax_weights16(scores + hq * lmax, L, a->scale);
        memset(acc + (int64_t)hq * D, 0, sizeof(float) * (size_t)D);
    }
    for (int p0 = 0; p0 < L; p0 += FAST_BLOCK) {
        const int n = L - p0 < FAST_BLOCK ? L - p0 : FAST_BLOCK;
        block_slots(pages, S, p0, n, &none, slot);
        for (int h = 0; h < Hkv; h++) {       /* the block FAST_PFD ahead, a share before each head */
            prefetch_ahead(&values, &next_keys, slot_bytes, S, p0 + FAST_PFD + h * n / Hkv, p0 + FAST_PFD + (h + 1) * n / Hkv);
            for (int p = 0; p < n; p++) rows[p] = vc + (slot[p] * W + (int64_t)h * D) * es;
            value_block16(KIND, acc + (int64_t)h * Gq * D, Gq, D, scores + h * Gq * lmax + p0, lmax, rows, n);
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
    for (int b = atomic_fetch_add(a->next_task, 1); b < a->B; b = atomic_fetch_add(a->next_task, 1))
        sequence(a, b, scores, rowbuf, acc, inv_sum);
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
                 const int32_t *win_slot, const int32_t *win_start) {
    if (B < 0 || Hq < 1 || Hkv < 1 || Hq % Hkv || D < 1 || S < 1 || lmax < 1) return 1;
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
                 win_slot, win_start, &next_task};
    evalrun_pool_run(pool_task, &args, nthreads);         /* tasks are claimed until none are left */
    return 0;
}
