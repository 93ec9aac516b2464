/* The AMX-BF16 tiles of the bf16 GEMM (path 3), included by gemm_bf16.c after bf_rows_by_panels.
 * Off by default: the path is taken only with EVALRUN_GEMM_BF16=amx where gemm_bf16_amx_available()
 * (the CPU, the OS and Linux's permission); elsewhere that request gives the default path. Not yet
 * run on an AMX CPU: tests/test_gemm_bf16_amx.py is what to run on the first one.
 *
 * The operands are the other paths' own, not repacked:
 *   A tile  x pairs [M][K2] (element 2i low, 2i+1 high): R <= 16 rows by kn <= 16 pairs (kn * 4
 *           bytes), row stride K2 * 4 bytes
 *   B tile  one panel's slice [kn pairs][16 columns][2]: kn rows of 64 bytes, stride 64
 *   C tile  R rows by 16 float32: one panel's outputs, stored to acc [R][P * 16] for bf_epilogue
 *
 *          k pairs:  0 ........ 15 | 16 ....... 31 | ... | kf ... K2-1  (kt = K2 % 16 of them)
 *   A (R rows)       tmm4          | tmm4          | ... | tmm5 (kt * 4 bytes a row)
 *   B (panel p)      tmm6          | tmm6          | ... | tmm7 (kt rows)
 *   C (panel p)      tmm p (p < 4), from +0, one tdpbf16ps per block of pairs, in k order
 *
 * NOTE: what each output is: per block of pairs (16, the tail kt), one tdpbf16ps into the output's
 * running float32 sum, in k order from +0; a row's blocks never depend on the other rows in the
 * tile or the call (the instruction computes each row of C from that row of A alone), so a row's
 * bits are the same whatever the batch. Intel documents the arithmetic inside one instruction two
 * ways: the Intrinsics Guide (_tile_dpbf16ps) as one chain per output, the even element's product
 * then the odd one's, per pair (dot_bf16_reference pair_order="even_first"); the SDM (TDPBF16PS)
 * as two chains per output from +0 over the block, even and odd products apart, their sum then
 * added to the output ("split16"). Both round to nearest even with DAZ and FTZ, ignoring MXCSR.
 * Neither is vdpbf16ps's measured order (the odd product first), so this path is not expected to
 * give the other paths' bits. The K tail is a narrower tile, not zero padding: no pair outside
 * [0, K2) enters a sum (a padding +0 product would turn a flushed -0 sum into +0); an odd K's last
 * pair holds x = 0 and w = 0 in its odd half, as on the other paths.
 */
#if defined(__x86_64__) && (defined(__clang__) ? __clang_major__ >= 12 : __GNUC__ >= 11)
#include <cpuid.h>
#include <immintrin.h>
#if defined(__linux__)
#include <sys/syscall.h>
#endif

#define BF_AMX_ROWS 16                  /* rows of a C tile */
#define BF_AMX_PAIRS 16                 /* k pairs per A tile (64 bytes a row) */
#define BF_AMX_P 4                      /* C tiles: panels per step (tmm0 .. tmm3) */
#define BF_AMX_PERM 0x1023              /* arch_prctl ARCH_REQ_XCOMP_PERM */
#define BF_AMX_XTILEDATA 18             /* the XSAVE feature of the tile data */

#if defined(__linux__)
long syscall(long number, ...);         /* unistd.h hides it under -std=c11 */
#endif

/* ldtilecfg's 64 bytes, palette 1 (8 tiles; entries 8..15 stay 0) */
typedef struct __attribute__((aligned(64))) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} bf_AmxConfig;

/* 1 where this process may run AMX-BF16 tiles: CPUID.(7,0):EDX bit 22 (AMX-BF16) and 24 (AMX-TILE),
 * the OS saving tile state (XCR0 bits 17, 18) and, on Linux, permission for the tile data
 * (granted to the whole process; refused, e.g., while a thread's sigaltstack is too small). */
static int bf_amx_probe(void) {
    unsigned a, b, c, d;
    if (__get_cpuid_max(0, 0) < 7) return 0;
    __cpuid_count(7, 0, a, b, c, d);
    if (!(d >> 22 & 1) || !(d >> 24 & 1)) return 0;
    __cpuid(1, a, b, c, d);
    if (!(c >> 27 & 1)) return 0;       /* OSXSAVE: xgetbv may run */
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo >> 17 & 3) != 3) return 0;
#if defined(__linux__)
    return syscall(SYS_arch_prctl, BF_AMX_PERM, BF_AMX_XTILEDATA) == 0;
#else
    return 0;                           /* not tried elsewhere */
#endif
}

int gemm_bf16_amx_available(void) {
    static atomic_int known;            /* 0 not probed, 1 yes, -1 no */
    int v = atomic_load(&known);
    if (!v) {
        v = bf_amx_probe() ? 1 : -1;
        atomic_store(&known, v);
    }
    return v == 1;
}

/* this thread's tile shapes for R rows and a k tail of kt pairs (0: tmm5, tmm7 left unconfigured) */
__attribute__((target("amx-tile"))) static void bf_amx_configure(int R, int kt) {
    bf_AmxConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < BF_AMX_P; t++) c.rows[t] = (uint8_t)R, c.colsb[t] = 64;
    c.rows[4] = (uint8_t)R, c.colsb[4] = 64;
    c.rows[6] = BF_AMX_PAIRS, c.colsb[6] = 64;
    if (kt) {
        c.rows[5] = (uint8_t)R, c.colsb[5] = (uint16_t)(kt * 4);
        c.rows[7] = (uint8_t)kt, c.colsb[7] = 64;
    }
    __asm__ volatile("ldtilecfg %0" ::"m"(c));      /* the whole struct as the operand: no store dropped */
}

/* C tile t (panel t of the step) += A tile `at` x panel t's slice at pair k0, through B tile `bt` */
#define BF_AMX_DP(t, at, bt)                                                                          \
    if (P > t) {                                                                                      \
        _tile_loadd(bt, bp + t * ps + (int64_t)k0 * BF_PW, 64);                                       \
        _tile_dpbf16ps(t, at, bt);                                                                    \
    }
#define BF_AMX_ZERO(t) if (P > t) _tile_zero(t);
#define BF_AMX_STORE(t) if (P > t) _tile_stored(t, acc + t * BF_PW, P * BF_PW * 4);

/* R rows (x0, stride lda bytes) by P <= 4 panels (bp, bp + ps, ..) over all K2 pairs -> acc [R][P * 16] */
__attribute__((target("amx-tile,amx-bf16"))) static void bf_amx_step(int P, const uint32_t *x0, int64_t lda,
                                                                    const uint32_t *bp, int64_t ps, int K2,
                                                                    float *acc) {
    const int kf = K2 - K2 % BF_AMX_PAIRS;
    BF_AMX_ZERO(0) BF_AMX_ZERO(1) BF_AMX_ZERO(2) BF_AMX_ZERO(3)
    int k0 = 0;
    for (; k0 < kf; k0 += BF_AMX_PAIRS) {
        _tile_loadd(4, x0 + k0, lda);
        BF_AMX_DP(0, 4, 6) BF_AMX_DP(1, 4, 6) BF_AMX_DP(2, 4, 6) BF_AMX_DP(3, 4, 6)
    }
    if (k0 < K2) {
        _tile_loadd(5, x0 + k0, lda);
        BF_AMX_DP(0, 5, 7) BF_AMX_DP(1, 5, 7) BF_AMX_DP(2, 5, 7) BF_AMX_DP(3, 5, 7)
    }
    BF_AMX_STORE(0) BF_AMX_STORE(1) BF_AMX_STORE(2) BF_AMX_STORE(3)
}

/* Panels [pb, pe) for all rows, 16 rows by 4 panels a step (the last rows: a tile of fewer rows);
 * the tile configuration is this thread's, loaded here and released at the end. */
__attribute__((target("amx-tile,amx-bf16"))) static void bf_amx_rows_by_panels(const bf_Gemm *g, int pb, int pe) {
    const int K2 = g->K2;
    const int64_t ps = (int64_t)K2 * BF_PW, lda = (int64_t)K2 * 4;
    float acc[BF_AMX_ROWS * BF_AMX_P * BF_PW] __attribute__((aligned(64)));
    int shaped = 0;                     /* the rows the loaded configuration is for */
    for (int i0 = 0; i0 < g->M; i0 += BF_AMX_ROWS) {
        const int R = g->M - i0 < BF_AMX_ROWS ? g->M - i0 : BF_AMX_ROWS;
        if (R != shaped) {
            bf_amx_configure(R, K2 % BF_AMX_PAIRS);
            shaped = R;
        }
        for (int q = pb; q < pe; q += BF_AMX_P) {
            const int P = pe - q < BF_AMX_P ? pe - q : BF_AMX_P;
            bf_amx_step(P, g->xp + (int64_t)i0 * K2, lda, g->packed + q * ps, ps, K2, acc);
            bf_epilogue(g, i0, R, q, P, acc);
        }
    }
    _tile_release();
}

#else  /* not x86-64, or a compiler without AMX: never available, and the default tiles if called */
int gemm_bf16_amx_available(void) { return 0; }
static void bf_amx_rows_by_panels(const bf_Gemm *g, int pb, int pe) {
    bf_Next none = {1, 0, 0, 0};                 /* never reached: the path is never available here */
    bf_rows_by_panels((bf_Gemm *)g, pb, pe, &none);
}
#endif
