/* Paged decode attention on the CPU: one query token per sequence, read straight from
 * the pages (no gathered copy of the context), GQA, float32 math.
 *
 * Layouts (as kernels/attention.py):
 *   q           [B, Hq, D]          float32
 *   k_cache     [P + 1, S, Hkv, D]  float32 or bfloat16 (uint16 bit patterns)
 *   v_cache     [P + 1, S, Hkv, D]
 *   page_table  [B, max_pages]      int32
 *   seq_lens    [B]                 int32 context length (the new token included)
 *   out         [B, Hq, D]          float32
 *   scratch     [nthreads, SCRATCH(Hq, Hkv, D, lmax)] float32, lmax >= max(seq_lens):
 *               per thread the scores [Hq, lmax], the V sums [Hq, D], a converted slot
 *               row [Hkv, D] and the softmax normalisers [Hq] (heap, not thread stacks)
 *
 * Work is split over sequences, claimed one at a time by the threads; a sequence's query
 * heads are scored against every key (exact two-pass softmax), then V is summed with
 * those weights.
 * The torch reference is kernels.attention._decode.
 */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

/* Floats of scratch per thread; kernels/attention.py allocates nthreads times this. */
#define SCRATCH(Hq, Hkv, D, lmax) ((int64_t)(Hq) * (lmax) + (int64_t)(Hq) * (D) + (int64_t)(Hkv) * (D) + (Hq))

typedef struct {
    const float *q;
    const void *k, *v;
    int bf16;
    const int32_t *page_table;
    int max_pages;
    const int32_t *seq_lens;
    float *out;
    int B, Hq, Hkv, D, S;
    float scale;
    float *scratch;
    int lmax, nthreads, tid;
    atomic_int *next_task;         /* shared: tasks are claimed one by one, so a thread on a
                                      busy core does not hold the others up */
} Args;

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = ((uint32_t)x) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Slot `slot` of a cache (all Hkv heads, W = Hkv * D values) as float32: a pointer into
 * the cache, or converted into buf. */
static inline const float *load_slot(const void *cache, int bf16, int64_t slot, int W, float *buf) {
    if (!bf16) return (const float *)cache + slot * W;
    const uint16_t *src = (const uint16_t *)cache + slot * W;
    for (int i = 0; i < W; i++) buf[i] = bf16_to_f32(src[i]);
    return buf;
}

/* One sequence: every query head against the whole context, reading each slot's row of
 * all heads once and in page order (sequential memory, which the prefetcher follows). */
static void sequence(const Args *a, int b, float *scores, float *rowbuf, float *acc, float *inv_sum) {
    const int Hq = a->Hq, Hkv = a->Hkv, G = Hq / Hkv, D = a->D, S = a->S, W = Hkv * D;
    const int L = a->seq_lens[b];
    const int64_t lmax = a->lmax;
    const float *q = a->q + (int64_t)b * Hq * D;
    float *o = a->out + (int64_t)b * Hq * D;
    if (L <= 0) {                   /* empty context: zeros, as an empty softmax sum gives */
        memset(o, 0, sizeof(float) * (size_t)Hq * D);
        return;
    }
    const int32_t *pages = a->page_table + (int64_t)b * a->max_pages;
    for (int pos = 0; pos < L; pos++) {
        const float *k = load_slot(a->k, a->bf16, (int64_t)pages[pos / S] * S + pos % S, W, rowbuf);
        for (int hq = 0; hq < Hq; hq++) {
            const float *qh = q + (int64_t)hq * D, *kh = k + (int64_t)(hq / G) * D;
            float s = 0.0f;
            #pragma omp simd reduction(+:s)
            for (int d = 0; d < D; d++) s += qh[d] * kh[d];
            scores[hq * lmax + pos] = s * a->scale;
        }
    }
    for (int hq = 0; hq < Hq; hq++) {
        float *sh = scores + hq * lmax;
        float m = -INFINITY, sum = 0.0f;
        for (int pos = 0; pos < L; pos++) m = sh[pos] > m ? sh[pos] : m;
        for (int pos = 0; pos < L; pos++) { sh[pos] = expf(sh[pos] - m); sum += sh[pos]; }
        inv_sum[hq] = 1.0f / sum;
    }
    memset(acc, 0, sizeof(float) * (size_t)Hq * D);
    for (int pos = 0; pos < L; pos++) {
        const float *v = load_slot(a->v, a->bf16, (int64_t)pages[pos / S] * S + pos % S, W, rowbuf);
        for (int hq = 0; hq < Hq; hq++) {
            const float w = scores[hq * lmax + pos];
            const float *vh = v + (int64_t)(hq / G) * D;
            float *ah = acc + (int64_t)hq * D;
            #pragma omp simd
            for (int d = 0; d < D; d++) ah[d] += w * vh[d];
        }
    }
    for (int hq = 0; hq < Hq; hq++)
        for (int d = 0; d < D; d++) o[(int64_t)hq * D + d] = acc[(int64_t)hq * D + d] * inv_sum[hq];
}

static void *worker(void *p) {
    const Args *a = (const Args *)p;
    float *scores = a->scratch + (int64_t)a->tid * SCRATCH(a->Hq, a->Hkv, a->D, a->lmax);
    float *acc = scores + (int64_t)a->Hq * a->lmax;
    float *rowbuf = acc + (int64_t)a->Hq * a->D;
    float *inv_sum = rowbuf + (int64_t)a->Hkv * a->D;
    for (int b = atomic_fetch_add(a->next_task, 1); b < a->B; b = atomic_fetch_add(a->next_task, 1))
        sequence(a, b, scores, rowbuf, acc, inv_sum);
    return NULL;
}

/* Returns 0 on success, 1 on shapes it cannot take. The caller checks page ids and
 * lengths against the cache and the table (kernels/attention.py). */
int paged_decode(const float *q, const void *k_cache, const void *v_cache, int bf16,
                 const int32_t *page_table, int max_pages, const int32_t *seq_lens, float *out,
                 int B, int Hq, int Hkv, int D, int S, float scale, float *scratch, int lmax,
                 int nthreads) {
    if (B < 0 || Hq < 1 || Hkv < 1 || Hq % Hkv || D < 1 || S < 1 || lmax < 1) return 1;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > 64) nthreads = 64;
    Args args[64];
    pthread_t threads[64];
    atomic_int next_task = 0;
    for (int t = 0; t < nthreads; t++) {
        args[t] = (Args){q, k_cache, v_cache, bf16, page_table, max_pages, seq_lens, out,
                         B, Hq, Hkv, D, S, scale, scratch, lmax, nthreads, t, &next_task};
    }
    int started = 0;
    for (int t = 1; t < nthreads; t++) {
        if (pthread_create(&threads[t], NULL, worker, &args[t]) != 0) break;
        started = t;
    }
    worker(&args[0]);               /* claims tasks until none are left, whoever started */
    for (int t = 1; t <= started; t++) pthread_join(threads[t], NULL);
    return 0;
}
