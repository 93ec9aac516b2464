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
 *   scratch     [nthreads, G, lmax] float32, G = Hq / Hkv, lmax >= max(seq_lens)
 *
 * Work is split over (sequence, kv head) pairs; each pair computes the scores of its G
 * query heads against every key (exact two-pass softmax), then the weighted sum of V.
 * The torch reference is kernels.attention._decode.
 */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

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

/* Row `row` (= slot * Hkv + head) of a cache as float32 into buf (or a pointer into the cache). */
static inline const float *load_row(const void *cache, int bf16, int64_t row, int D, float *buf) {
    if (!bf16) return (const float *)cache + row * D;
    const uint16_t *src = (const uint16_t *)cache + row * D;
    for (int d = 0; d < D; d++) buf[d] = bf16_to_f32(src[d]);
    return buf;
}

static void pair(const Args *a, int b, int h, float *scores, float *kbuf, float *acc) {
    const int G = a->Hq / a->Hkv, D = a->D, S = a->S, L = a->seq_lens[b];
    const float *q = a->q + ((int64_t)b * a->Hq + (int64_t)h * G) * D;
    const int32_t *pages = a->page_table + (int64_t)b * a->max_pages;
    for (int pos = 0; pos < L; pos++) {
        int64_t slot = (int64_t)pages[pos / S] * S + pos % S;
        const float *k = load_row(a->k, a->bf16, slot * a->Hkv + h, D, kbuf);
        for (int g = 0; g < G; g++) {
            const float *qg = q + (int64_t)g * D;
            float s = 0.0f;
            #pragma omp simd reduction(+:s)
            for (int d = 0; d < D; d++) s += qg[d] * k[d];
            scores[(int64_t)g * a->lmax + pos] = s * a->scale;
        }
    }
    float inv_sum[64];
    for (int g = 0; g < G; g++) {
        float *sg = scores + (int64_t)g * a->lmax;
        float m = -INFINITY, sum = 0.0f;
        for (int pos = 0; pos < L; pos++) m = sg[pos] > m ? sg[pos] : m;
        for (int pos = 0; pos < L; pos++) { sg[pos] = expf(sg[pos] - m); sum += sg[pos]; }
        inv_sum[g] = 1.0f / sum;
    }
    memset(acc, 0, sizeof(float) * (size_t)G * D);
    for (int pos = 0; pos < L; pos++) {
        int64_t slot = (int64_t)pages[pos / S] * S + pos % S;
        const float *v = load_row(a->v, a->bf16, slot * a->Hkv + h, D, kbuf);
        for (int g = 0; g < G; g++) {
            const float w = scores[(int64_t)g * a->lmax + pos];
            float *ag = acc + (int64_t)g * D;
            #pragma omp simd
            for (int d = 0; d < D; d++) ag[d] += w * v[d];
        }
    }
    for (int g = 0; g < G; g++) {
        float *o = a->out + ((int64_t)b * a->Hq + (int64_t)h * G + g) * D;
        for (int d = 0; d < D; d++) o[d] = acc[(int64_t)g * D + d] * inv_sum[g];
    }
}

static void *worker(void *p) {
    const Args *a = (const Args *)p;
    const int G = a->Hq / a->Hkv;
    float *scores = a->scratch + (int64_t)a->tid * G * a->lmax;
    float kbuf[512], acc[64 * 512 / 8];
    const int tasks = a->B * a->Hkv;
    for (int task = atomic_fetch_add(a->next_task, 1); task < tasks; task = atomic_fetch_add(a->next_task, 1))
        pair(a, task / a->Hkv, task % a->Hkv, scores, kbuf, acc);
    return NULL;
}

/* Returns 0 on success, 1 when the shapes are outside this kernel's limits. */
int paged_decode(const float *q, const void *k_cache, const void *v_cache, int bf16,
                 const int32_t *page_table, int max_pages, const int32_t *seq_lens, float *out,
                 int B, int Hq, int Hkv, int D, int S, float scale, float *scratch, int lmax,
                 int nthreads) {
    if (D > 512 || Hkv <= 0 || Hq % Hkv || Hq / Hkv > 64 || (int64_t)(Hq / Hkv) * D > 64 * 512 / 8)
        return 1;
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
