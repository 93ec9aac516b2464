/* The persistent thread pool every native kernel library shares (evalrun/kernels/cpu/csrc/pool.c, built
 * as its own library and loaded first with RTLD_GLOBAL by evalrun/kernels/cpu/native.py, so all kernels
 * use one set of worker threads).
 *
 *   evalrun_pool_run(fn, ctx, nth)   runs fn(ctx, tid, nth) for tid = 0..nth-1 and returns
 *                                    when all are done; tid 0 runs on the calling thread;
 *                                    nth may come back smaller than asked (never below 1).
 */
#ifndef EVALRUN_POOL_H
#define EVALRUN_POOL_H

typedef void (*pool_fn)(void *ctx, int tid, int nth);

int evalrun_pool_run(pool_fn fn, void *ctx, int nth);

#endif
