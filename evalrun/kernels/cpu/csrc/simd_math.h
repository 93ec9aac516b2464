/* Vector math shared by the native kernels (included by the kernels/cpu/csrc C files; evalrun/kernels/cpu/native.py
 * hashes this header with each source, so a change here rebuilds them). */
#ifndef EVALRUN_SIMD_MATH_H
#define EVALRUN_SIMD_MATH_H
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* exp(x) for x <= 0, 8 lanes: x = n ln2 + r (|r| <= ln2/2, ln2 split in two parts), a degree-6
 * polynomial for e^r (Cephes' coefficients, within ~2 ulp of expf over the range), times 2^n
 * built in the exponent bits. Below -87.3 the result is 0 (expf gives a denormal there). */
static inline __m256 exp_nonpositive(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f);
    const __m256 tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(tiny, _mm256_mul_ps(y, _mm256_castsi256_ps(bits)));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* silu(g) * u on 8 lanes, silu(g) = g * sigmoid(g) with sigmoid from e = exp(-|g|) (never
 * overflows): shared by fused_ops.c's silu_mul and gemm.c's fused gate/up epilogue, so the two
 * give the same bits. */
static inline __m256 silu_mul8(__m256 gv, __m256 uv) {
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 e = exp_nonpositive(_mm256_or_ps(gv, _mm256_set1_ps(-0.0f)));   /* exp(-|g|) */
    const __m256 inv = _mm256_div_ps(one, _mm256_add_ps(one, e));
    const __m256 pos = _mm256_cmp_ps(gv, _mm256_setzero_ps(), _CMP_GE_OQ);
    const __m256 sig = _mm256_blendv_ps(_mm256_mul_ps(e, inv), inv, pos);        /* g >= 0: 1/(1+e) */
    return _mm256_mul_ps(_mm256_mul_ps(gv, sig), uv);
}

#endif

#if defined(__AVX512F__)
/* The same exp(x) for x <= 0 on 16 lanes: lane for lane the operations of exp_nonpositive, so the
 * results are bitwise those of the 8-lane version. Its own code, not two 8-lane halves: the halves
 * made the prefill kernel 3-9% slower (alternated A/B, 2026-12-02). */
static inline __m512 exp_nonpositive16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.3f);
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_max_ps(x, lo);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mov_ps((__mmask16)~tiny, _mm512_mul_ps(y, _mm512_castsi512_ps(bits)));
}
#endif

#endif
