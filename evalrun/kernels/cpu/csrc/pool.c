/* The shared persistent thread pool (declared in pool.h).
 *
 * Workers are started on first use and stay: after a job a worker spins for up to
 * EVALRUN_POOL_SPIN_US microseconds (default 100) waiting for the next one - a decode step
 * calls a few hundred kernels tens of microseconds apart - then sleeps on a futex. Creating
 * threads per call instead costs ~20-50 us per call. Calls are serialized by a mutex (a call
 * from inside a job would deadlock: kernels never nest). After fork() the child starts with
 * no workers (threads do not survive a fork) and makes new ones on first use.
 */
#define _GNU_SOURCE 1
#include "pool.h"

#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define POOL_MAX 64

static struct {
    pthread_mutex_t lock;
    int started;                   /* workers running (tids 1..started) */
    atomic_uint gen;               /* bumped once per job */
    atomic_int pending;            /* workers that have not finished the current job */
    atomic_int sleepers;           /* workers in (or about to enter) futex_wait */
    pool_fn fn;
    void *ctx;
    int nth;
    int64_t spin_ns;
    int atfork_set;
    unsigned start_gen[POOL_MAX];  /* gen when worker tid was made: its first job is the next one */
} pool_ = {PTHREAD_MUTEX_INITIALIZER, 0, 0, 0, 0, 0, 0, 0, -1, 0, {0}};

static inline int64_t pool_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline void pool_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void *pool_worker(void *arg) {
    const int tid = (int)(intptr_t)arg;
    unsigned seen = pool_.start_gen[tid];
    for (;;) {
        unsigned g = atomic_load(&pool_.gen);
        if (g == seen) {
            const int64_t until = pool_now_ns() + pool_.spin_ns;
            for (int i = 0; (g = atomic_load(&pool_.gen)) == seen; i++) {
                pool_pause();
                if ((i & 63) == 63 && pool_now_ns() > until) {
                    atomic_fetch_add(&pool_.sleepers, 1);
                    while ((g = atomic_load(&pool_.gen)) == seen)
                        syscall(SYS_futex, (unsigned *)&pool_.gen, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
                    atomic_fetch_sub(&pool_.sleepers, 1);
                    break;
                }
            }
        }
        seen = g;
        if (tid < pool_.nth) pool_.fn(pool_.ctx, tid, pool_.nth);
        atomic_fetch_sub(&pool_.pending, 1);
    }
    return NULL;
}

static void pool_after_fork_child(void) {
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    pool_.lock = fresh;
    pool_.started = 0;
    atomic_store(&pool_.pending, 0);
    atomic_store(&pool_.sleepers, 0);
}

/* Returns 0; runs everything on the calling thread when workers cannot be started. */
int evalrun_pool_run(pool_fn fn, void *ctx, int nth) {
    if (nth > POOL_MAX) nth = POOL_MAX;
    if (nth <= 1) {
        fn(ctx, 0, 1);
        return 0;
    }
    pthread_mutex_lock(&pool_.lock);
    if (!pool_.atfork_set) {
        pthread_atfork(NULL, NULL, pool_after_fork_child);
        pool_.atfork_set = 1;
    }
    if (pool_.spin_ns < 0) {
        const char *s = getenv("EVALRUN_POOL_SPIN_US");
        pool_.spin_ns = (s && *s) ? (int64_t)(atof(s) * 1000.0) : 100000;
    }
    while (pool_.started < nth - 1) {
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pool_.start_gen[pool_.started + 1] = atomic_load(&pool_.gen);
        const int ok = pthread_create(&th, &attr, pool_worker, (void *)(intptr_t)(pool_.started + 1)) == 0;
        pthread_attr_destroy(&attr);
        if (!ok) break;
        pool_.started++;
    }
    if (nth > pool_.started + 1) nth = pool_.started + 1;
    pool_.fn = fn;
    pool_.ctx = ctx;
    pool_.nth = nth;
    atomic_store(&pool_.pending, pool_.started);
    atomic_fetch_add(&pool_.gen, 1);
    if (atomic_load(&pool_.sleepers) > 0)
        syscall(SYS_futex, (unsigned *)&pool_.gen, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    fn(ctx, 0, nth);
    while (atomic_load(&pool_.pending) > 0) pool_pause();
    pthread_mutex_unlock(&pool_.lock);
    return 0;
}

