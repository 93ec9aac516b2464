/* Build mode for tests on CPUs without AVX-512: every kernel's AVX-512 (F, BW, DQ, VL, BF16) code
 * compiled against SIMDe's portable implementations of those intrinsics (simde-py's headers), so
 * the paths an AVX-512 CPU takes are checked against the torch reference on any x86 CPU. Slow, for
 * correctness only. kernels/cpu/native.py passes it with -include when EVALRUN_NATIVE_EMULATE is
 * "avx512_bf16" (and reports those flags as the CPU's: kernels/cpu/host.py).
 *
 * SIMDe includes <immintrin.h> first (for what the CPU has), then aliases the _mm512_* names to its
 * own; the __AVX512*__ macros are defined after it, for the kernels' own #if lines only. */
#ifndef EVALRUN_EMULATE_AVX512_H
#define EVALRUN_EMULATE_AVX512_H
#define EVALRUN_EMULATED_ISA 1
/* decode_step.c's, which must come before the first system header: this one is first now */
#define _POSIX_C_SOURCE 199309L
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <simde/x86/avx512.h>
#include <simde/x86/f16c.h>
#undef I                                   /* <complex.h>'s, through SIMDe: the kernels name matrices I */

#define __AVX512F__ 1
#define __AVX512BW__ 1
#define __AVX512DQ__ 1
#define __AVX512VL__ 1
#define __AVX512BF16__ 1

/* the 512 bits of an integer vector as 32 bfloat16 (a cast on the real instructions) */
static inline simde__m512bh evalrun_emulated_as_bh(simde__m512i x) {
    simde__m512bh r;
    memcpy(&r, &x, sizeof r);
    return r;
}
#define AS_BH512(x) evalrun_emulated_as_bh(x)
#define PIN_ZMM(x) ((void)0)               /* the register pin is meaningless here */

/* reductions GCC's header implements as macros over its own intrinsics: the same order of
 * operations (halves of 256, then 128, then pairs), so sums are bitwise those of the real build */
static inline float evalrun_emulated_reduce_add_ps(simde__m512 a) {
    float v[16], h[8], q[4];
    simde_mm512_storeu_ps(v, a);
    for (int i = 0; i < 8; i++) h[i] = v[8 + i] + v[i];
    for (int i = 0; i < 4; i++) q[i] = h[4 + i] + h[i];
    const float s0 = q[0] + q[2], s1 = q[1] + q[3];
    return s0 + s1;
}
static inline float evalrun_emulated_reduce_max_ps(simde__m512 a) {
    float v[16], h[8], q[4];
    simde_mm512_storeu_ps(v, a);
    for (int i = 0; i < 8; i++) h[i] = v[8 + i] > v[i] ? v[8 + i] : v[i];
    for (int i = 0; i < 4; i++) q[i] = h[4 + i] > h[i] ? h[4 + i] : h[i];
    const float s0 = q[0] > q[2] ? q[0] : q[2], s1 = q[1] > q[3] ? q[1] : q[3];
    return s0 > s1 ? s0 : s1;
}

/* intrinsics SIMDe does not have */
static inline simde__m256i evalrun_emulated_cvtepi32_epi16(simde__m512i a) {      /* truncating */
    int32_t v[16];
    int16_t r[16];
    simde_mm512_storeu_si512(v, a);
    for (int i = 0; i < 16; i++) r[i] = (int16_t)v[i];
    return simde_mm256_loadu_si256(r);
}
#define _mm512_cvtepi32_epi16(a) evalrun_emulated_cvtepi32_epi16(a)
#undef _mm512_cvtps_ph                     /* GCC's header makes it a macro at -O0 */
#define _mm512_cvtps_ph(a, imm) simde_mm256_set_m128i(simde_mm256_cvtps_ph(simde_mm512_extractf32x8_ps(a, 1), imm), \
                                                     simde_mm256_cvtps_ph(simde_mm512_extractf32x8_ps(a, 0), imm))
#define _mm512_stream_ps(p, a) simde_mm512_store_ps(p, a)     /* aligned, as the instruction asks */

/* masked loads and stores touch only their lanes' memory, as the instructions do (SIMDe's read all
 * 64 bytes, and its mask_storeu_ps writes zeros to the lanes outside the mask) */
static inline simde__m512 evalrun_emulated_maskz_loadu_ps(simde__mmask16 k, const void *p) {
    float v[16] = {0};
    for (int i = 0; i < 16; i++) if (k >> i & 1) memcpy(&v[i], (const char *)p + 4 * i, 4);
    return simde_mm512_loadu_ps(v);
}
static inline simde__m512i evalrun_emulated_maskz_loadu_epi16(simde__mmask32 k, const void *p) {
    uint16_t v[32] = {0};
    for (int i = 0; i < 32; i++) if (k >> i & 1) memcpy(&v[i], (const char *)p + 2 * i, 2);
    return simde_mm512_loadu_si512(v);
}
static inline void evalrun_emulated_mask_storeu_ps(void *p, simde__mmask16 k, simde__m512 a) {
    float v[16];
    simde_mm512_storeu_ps(v, a);
    for (int i = 0; i < 16; i++) if (k >> i & 1) memcpy((char *)p + 4 * i, &v[i], 4);
}
#undef _mm512_maskz_loadu_ps
#undef _mm512_maskz_loadu_epi16
#undef _mm512_mask_storeu_ps
#define _mm512_maskz_loadu_ps(k, p) evalrun_emulated_maskz_loadu_ps(k, p)
#define _mm512_maskz_loadu_epi16(k, p) evalrun_emulated_maskz_loadu_epi16(k, p)
#define _mm512_mask_storeu_ps(p, k, a) evalrun_emulated_mask_storeu_ps(p, k, a)

/* vdpbf16ps as the instruction computes it (SIMDe's rounds differently): per float, element 2j+1's
 * product then 2j's, each added with one rounding to nearest even, denormal inputs and results
 * flushed to zero (the instruction ignores MXCSR) */
static inline float evalrun_emulated_ftz(float x) { return fabsf(x) < FLT_MIN ? copysignf(0.0f, x) : x; }
static inline float evalrun_emulated_bf16(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return evalrun_emulated_ftz(f);
}
static inline simde__m512 evalrun_emulated_dpbf16_ps(simde__m512 src, simde__m512bh a, simde__m512bh b) {
    float acc[16];
    uint16_t av[32], bv[32];
    simde_mm512_storeu_ps(acc, src);
    memcpy(av, &a, sizeof av);
    memcpy(bv, &b, sizeof bv);
    for (int j = 0; j < 16; j++) {
        float s = evalrun_emulated_ftz(acc[j]);
        s = evalrun_emulated_ftz(fmaf(evalrun_emulated_bf16(av[2 * j + 1]), evalrun_emulated_bf16(bv[2 * j + 1]), s));
        acc[j] = evalrun_emulated_ftz(fmaf(evalrun_emulated_bf16(av[2 * j]), evalrun_emulated_bf16(bv[2 * j]), s));
    }
    return simde_mm512_loadu_ps(acc);
}
#undef _mm512_dpbf16_ps
#define _mm512_dpbf16_ps(src, a, b) evalrun_emulated_dpbf16_ps(src, a, b)

#undef _mm512_reduce_add_ps
#undef _mm512_reduce_max_ps
#define _mm512_reduce_add_ps(a) evalrun_emulated_reduce_add_ps(a)
#define _mm512_reduce_max_ps(a) evalrun_emulated_reduce_max_ps(a)
#endif
