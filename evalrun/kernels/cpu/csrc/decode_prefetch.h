/* The prefetch stream of paged decode attention (paged_decode.c and its AVX-512 path,
 * paged_decode_z.h): a thread reads one sequence's keys, then its values, then the keys of the
 * next sequence it takes, each in position order; every line of those rows is prefetched into L2
 * a fixed number of positions ahead, across the ends of the keys and of the values
 * (prefetch_ahead); and prefetch_rows, for the slots of one block. */
#ifndef EVALRUN_DECODE_PREFETCH_H
#define EVALRUN_DECODE_PREFETCH_H

#include <stdint.h>

/* Prefetch every line of the float32 slots slot[0 .. n): a sequence's slots are contiguous within
 * a page, but the hardware prefetchers lose the stream at each 4 KB boundary. Interleaved A/B
 * (32 rows x 200 positions, 30 layers, 2 threads, AVX2): 1.2-1.3x over none. */
static inline void prefetch_rows(const void *cache, const int64_t *slot, int n, int W) {
    for (int p = 0; p < n; p++) {
        const char *s = (const char *)((const float *)cache + slot[p] * W);
        for (int b = 0; b < W * 4; b += 64) __builtin_prefetch(s + b, 0, 3);
    }
}

/* Rows first .. len - 1 of one sequence's keys or values: cache, the sequence's page table, len,
 * and the first position read (a sliding window's start, else 0). */
typedef struct {
    const char *cache;
    const int32_t *pages;
    int len, first;
} Stream;

/* Prefetch every line of the rows of positions lo .. hi - 1 of `cur`, continuing into `then`
 * past its end (from then's first position on). */
static inline void prefetch_ahead(const Stream *cur, const Stream *then, int64_t slot_bytes, int S, int lo, int hi) {
    for (int i = 0; i < 2; i++) {
        const Stream *st = i ? then : cur;
        int a = i ? then->first + (lo > cur->len ? lo - cur->len : 0) : lo;
        int b = i ? then->first + hi - cur->len : (hi < cur->len ? hi : cur->len);
        if (b > st->len) b = st->len;
        while (a < b) {
            const int page = a / S, off = a - page * S, m = S - off < b - a ? S - off : b - a;
            const char *s = st->cache + ((int64_t)st->pages[page] * S + off) * slot_bytes, *e = s + m * slot_bytes;
            for (s = (const char *)((uintptr_t)s & ~(uintptr_t)63); s < e; s += 64) __builtin_prefetch(s, 0, 2);
            a += m;
        }
    }
}

#endif
