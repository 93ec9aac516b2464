/* The softmax of one row of paged decode attention's scores (paged_decode.c): soft-capping and
 * the exact two-pass exp-normalise, vectorized on AVX2. */
#ifndef EVALRUN_DECODE_SOFTMAX_H
#define EVALRUN_DECODE_SOFTMAX_H

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


/* Soft-capping in place: s = cap * tanh((s * scale) / cap), the reference's operations in its
 * order (the softmax then runs with scale 1). */
static void cap_scores(float *s, int n, float scale, float cap) {
    for (int p = 0; p < n; p++) s[p] = tanhf(s[p] * scale / cap) * cap;
}

#endif
