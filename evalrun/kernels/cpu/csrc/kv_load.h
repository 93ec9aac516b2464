/* Reading one head row of a paged K/V cache slot as float32, for every storage kind (shared by
 * the native attention kernels; evalrun/kernels/cpu/native.py hashes this header with each source).
 *
 *   kinds: 0 float32, 1 bfloat16, 2 float16 (W = Hkv * D values per slot), 3 8-bit codes (value
 *   c - 128), 4 4-bit codes (W / 2 bytes per slot: byte j of a group of G holds element j in the
 *   low nibble and element j + G/2 in the high one; value c - 8); the code kinds scale each group
 *   of G by a float16 scale ([slot, W / G]).
 */
#ifndef EVALRUN_KV_LOAD_H
#define EVALRUN_KV_LOAD_H
#include <stdint.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

enum { KIND_F32 = 0, KIND_BF16 = 1, KIND_F16 = 2, KIND_Q8 = 3, KIND_Q4 = 4 };

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = ((uint32_t)x) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* One float32 value rounded to bfloat16, to nearest even as torch's .to(torch.bfloat16): overflow
 * goes to +-inf, NaN stays NaN (quieted: sign and top payload bits kept). Subnormal float32 inputs
 * are rounded, not flushed (so not _mm512_cvtneps_pbh: AVX512_BF16 flushes them to zero, torch
 * does not). */
static inline uint16_t bf16_from_f32(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

/* n float32 values -> n bfloat16 (bf16_from_f32's rounding, 16 or 8 lanes at a time). */
static inline void store_bf16(const float *src, uint16_t *dst, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512i bias16 = _mm512_set1_epi32(0x7fff), one16 = _mm512_set1_epi32(1), quiet16 = _mm512_set1_epi32(0x40);
    for (; i + 16 <= n; i += 16) {
        const __m512 f = _mm512_loadu_ps(src + i);
        const __m512i x = _mm512_castps_si512(f), hi = _mm512_srli_epi32(x, 16);
        const __m512i up = _mm512_add_epi32(_mm512_add_epi32(x, bias16), _mm512_and_si512(hi, one16));
        const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
        const __m512i r = _mm512_mask_blend_epi32(nan, _mm512_srli_epi32(up, 16), _mm512_or_si512(hi, quiet16));
        _mm256_storeu_si256((__m256i *)(dst + i), _mm512_cvtepi32_epi16(r));
    }
#endif
#if defined(__AVX2__)
    const __m256i bias8 = _mm256_set1_epi32(0x7fff), one8 = _mm256_set1_epi32(1), quiet8 = _mm256_set1_epi32(0x40);
    for (; i + 8 <= n; i += 8) {
        const __m256 f = _mm256_loadu_ps(src + i);
        const __m256i x = _mm256_castps_si256(f), hi = _mm256_srli_epi32(x, 16);
        __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(x, bias8), _mm256_and_si256(hi, one8)), 16);
        r = _mm256_blendv_epi8(r, _mm256_or_si256(hi, quiet8), _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)));
        const __m128i lo = _mm256_castsi256_si128(r), top = _mm256_extracti128_si256(r, 1);
        _mm_storeu_si128((__m128i *)(dst + i), _mm_packus_epi32(lo, top));
    }
#endif
    for (; i < n; i++) dst[i] = bf16_from_f32(src[i]);
}

/* x[0 .. n) rounded to bfloat16 values in place (bf16_from_f32's rounding, kept as float32), in a
 * loop the compiler vectorizes. */
static inline void round_bf16(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, x + i, sizeof u);
        const uint32_t r = (u & 0x7fffffffu) > 0x7f800000u ? (u | 0x400000u) & 0xffff0000u
                                                            : (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
        memcpy(x + i, &r, sizeof r);
    }
}

static inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, bits;
    if (e == 0) {                                  /* zero or subnormal: m * 2^-24 */
        float f = (float)m * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    bits = e == 31 ? sign | 0x7f800000u | (m << 13) : sign | ((e + 112) << 23) | (m << 13);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* Head h of slot `slot` (D values) as float32: a pointer into the cache, or converted /
 * dequantized into buf. Row strides: W = Hkv * D values per slot (codes: W or W / 2 bytes,
 * W / G scales). */
static inline const float *load_head(const void *cache, const uint16_t *scales, int kind, int G,
                                     int64_t slot, int h, int D, int W, float *buf) {
    switch (kind) {
    case KIND_F32:
        return (const float *)cache + slot * W + (int64_t)h * D;
    case KIND_BF16: {
        const uint16_t *src = (const uint16_t *)cache + slot * W + (int64_t)h * D;
        int i = 0;
#if defined(__AVX2__)
        for (; i + 8 <= D; i += 8)                 /* bf16 bits are the top half of a float's */
            _mm256_storeu_ps(buf + i, _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + i))), 16)));
#endif
        for (; i < D; i++) buf[i] = bf16_to_f32(src[i]);
        return buf;
    }
    case KIND_F16: {
        const uint16_t *src = (const uint16_t *)cache + slot * W + (int64_t)h * D;
        int i = 0;
#if defined(__F16C__)
        for (; i + 8 <= D; i += 8) _mm256_storeu_ps(buf + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
        for (; i < D; i++) buf[i] = f16_to_f32(src[i]);
        return buf;
    }
    case KIND_Q8: {
        const uint8_t *c = (const uint8_t *)cache + slot * W + (int64_t)h * D;
        const uint16_t *sc = scales + slot * (W / G) + (int64_t)h * (D / G);
        for (int g = 0; g < D / G; g++) {
            const float s = f16_to_f32(sc[g]);
            const uint8_t *cg = c + g * G;
            float *bg = buf + g * G;
            int j = 0;
#if defined(__AVX2__) && defined(__FMA__)
            const __m256 vs = _mm256_set1_ps(s), vz = _mm256_set1_ps(-128.0f * s);
            for (; j + 8 <= G; j += 8) {           /* (c - 128) * s = c * s - 128 s */
                const __m256 cf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(cg + j))));
                _mm256_storeu_ps(bg + j, _mm256_fmadd_ps(cf, vs, vz));
            }
#endif
            for (; j < G; j++) bg[j] = (float)((int)cg[j] - 128) * s;
        }
        return buf;
    }
    default: {                                     /* KIND_Q4: byte j = element j | element j + G/2 */
        const uint8_t *c = (const uint8_t *)cache + slot * (W / 2) + (int64_t)h * (D / 2);
        const uint16_t *sc = scales + slot * (W / G) + (int64_t)h * (D / G);
        const int half = G / 2;
        for (int g = 0; g < D / G; g++) {
            const float s = f16_to_f32(sc[g]);
            const uint8_t *cg = c + g * half;
            float *bg = buf + g * G;
            int j = 0;
#if defined(__AVX2__) && defined(__FMA__)
            const __m256 vs = _mm256_set1_ps(s), vz = _mm256_set1_ps(-8.0f * s);
            const __m128i low = _mm_set1_epi8(15);
            for (; j + 8 <= half; j += 8) {        /* 8 bytes: 8 low and 8 high codes */
                const __m128i bytes = _mm_loadl_epi64((const __m128i *)(cg + j));
                const __m128i lo = _mm_and_si128(bytes, low), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
                _mm256_storeu_ps(bg + j, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), vs, vz));
                _mm256_storeu_ps(bg + half + j, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), vs, vz));
            }
#endif
            for (; j < half; j++) {
                bg[j] = (float)((int)(cg[j] & 15) - 8) * s;
                bg[half + j] = (float)((int)(cg[j] >> 4) - 8) * s;
            }
        }
        return buf;
    }
    }
}

#endif
