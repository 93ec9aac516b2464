/* Spellings the AVX-512 code needs that differ under the SIMDe emulation (emulate_avx512.h, which
 * defines its own): a reinterpretation of 512 bits as bfloat16 pairs, and an empty asm that keeps a
 * vector in a register. */
#ifndef EVALRUN_ISA_H
#define EVALRUN_ISA_H
#ifndef EVALRUN_EMULATED_ISA
#define AS_BH512(x) ((__m512bh)(x))
#define PIN_ZMM(x) __asm__("" : "+v"(x))
#endif
#endif
