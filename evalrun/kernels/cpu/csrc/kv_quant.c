/* Quantized KV cache writes and the Walsh-Hadamard rotation on the CPU: the native versions
 * of evalrun/kernels/ref/kv_quant.py (`rotate`, `quantize`) and evalrun/kernels/ref/cache_ops.py (`write_kv_torch`
 * for code formats). Every float operation is the reference's, in the same order (butterfly
 * a + b / a - b, one multiply by G^-1/2, amax / qmax, round half to even, float16 round to
 * nearest even then one ulp up when short), so the codes equal the reference's bit for bit
 * and a row's result never depends on the other rows of the call. A group holding a NaN gets
 * the reference's NaN scale (its codes are unspecified there; zeros here), so it reads NaN.
 *
 * Layouts (as evalrun/kernels/kv_format.py):
 *   x       [T, W] float32, W = Hkv * D values of each new token (all heads)
 *   slots   [T] int64 slot ids (page * S + offset)
 *   codes   [(P + 1) * S, W * bits / 8] uint8 (4-bit: byte j of a group of G holds element j
 *           in its low nibble and element j + G/2 in its high one; offsets +128 / +8)
 *   scales  [(P + 1) * S, W / G] float16 bit patterns
 * Needs F16C (float16 conversions with round to nearest even); without it the functions
 * return 1 and callers use the torch reference.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

#define MAX_GROUP 256
#define F16_NAN 0x7e00             /* the float16 NaN torch produces from a float32 NaN */

static void fwht(float *y, int G, float norm) {
    for (int h = 1; h < G; h *= 2)
        for (int i = 0; i < G; i += 2 * h)
            for (int j = i; j < i + h; j++) {
                const float a = y[j], b = y[j + h];
                y[j] = a + b;
                y[j + h] = a - b;
            }
    for (int j = 0; j < G; j++) y[j] *= norm;
}

/* x [n, G] rotated in place, group by group. Returns 1 on a group size it cannot take. */
int rotate_groups(float *x, int64_t n, int G, float norm) {
    if (G < 1 || G > MAX_GROUP || (G & (G - 1))) return 1;
    for (int64_t i = 0; i < n; i++) fwht(x + i * G, G, norm);
    return 0;
}

#if defined(__F16C__)
static inline uint16_t f32_to_f16(float f) { return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
static inline float f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }
#endif

/* 1 when quantize_write can run in this build (it needs F16C), else 0. */
int quantize_supported(void) {
#if defined(__F16C__)
    return 1;
#else
    return 0;
#endif
}

int quantize_write(const float *x, int64_t T, int W, const int64_t *slots, uint8_t *codes,
                   uint16_t *scales, int bits, int G, int rotation, float norm) {
#if !defined(__F16C__)
    (void)x; (void)T; (void)W; (void)slots; (void)codes; (void)scales; (void)bits; (void)G;
    (void)rotation; (void)norm;
    return 1;
#else
    if ((bits != 8 && bits != 4) || G < 2 || G > MAX_GROUP || (G & (G - 1)) || W % G) return 1;
    const int qmax = bits == 8 ? 127 : 7, offset = bits == 8 ? 128 : 8, half = G / 2;
    const int64_t row_bytes = (int64_t)W * bits / 8, groups = W / G;
    const float fp16_max = 65504.0f;
    float y[MAX_GROUP];
    int32_t c[MAX_GROUP];
    for (int64_t t = 0; t < T; t++) {
        uint8_t *crow = codes + slots[t] * row_bytes;
        uint16_t *srow = scales + slots[t] * groups;
        for (int64_t g = 0; g < groups; g++) {
            memcpy(y, x + t * W + g * G, sizeof(float) * (size_t)G);
            if (rotation) fwht(y, G, norm);
            float amax = 0.0f;
            int nan = 0;
            for (int j = 0; j < G; j++) {
                nan |= y[j] != y[j];
                amax = fabsf(y[j]) > amax ? fabsf(y[j]) : amax;
            }
            if (nan) {                             /* as the reference: a NaN scale, so the group reads NaN */
                srow[g] = F16_NAN;
                memset(bits == 8 ? crow + g * G : crow + g * half, 0, (size_t)(bits == 8 ? G : half));
                continue;
            }
            const float exact = amax / (float)qmax;
            uint16_t s = f32_to_f16(exact < fp16_max ? exact : fp16_max);
            if (f16_to_f32(s) < exact && f16_to_f32(s) < fp16_max) s = (uint16_t)(s + 1);  /* one ulp up */
            const float divisor = s == 0 ? 1.0f : f16_to_f32(s);
            for (int j = 0; j < G; j++) {
                float q = nearbyintf(y[j] / divisor);
                q = q < (float)-qmax ? (float)-qmax : q > (float)qmax ? (float)qmax : q;
                c[j] = (int32_t)q + offset;
            }
            srow[g] = s;
            if (bits == 8) {
                uint8_t *cg = crow + g * G;
                for (int j = 0; j < G; j++) cg[j] = (uint8_t)c[j];
            } else {
                uint8_t *cg = crow + g * half;
                for (int j = 0; j < half; j++) cg[j] = (uint8_t)(c[j] | (c[j + half] << 4));
            }
        }
    }
    return 0;
#endif
}
