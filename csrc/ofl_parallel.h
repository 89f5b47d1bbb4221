/* Fork-join over plain pthreads: no thread outlives a call, so the library is
 * fork-safe and never competes with another OpenMP runtime in the process. */
#ifndef OFL_PARALLEL_H
#define OFL_PARALLEL_H

#include <stdint.h>

typedef void (*ofl_task_fn)(void *ctx, int32_t index, int32_t count);

/* Runs fn(ctx, i, count) for every i in [0, count): count - 1 new threads and the
 * calling thread. A share whose thread cannot be created is run by the caller, so
 * the call always completes. */
void ofl_parallel_run(ofl_task_fn fn, void *ctx, int32_t count);

/* Contiguous share [*lo, *hi) of `total` items for worker `index` of `count`, with
 * every boundary a multiple of `align` items (the last share takes the rest). */
void ofl_parallel_share(int64_t total, int32_t index, int32_t count, int64_t align,
                        int64_t *lo, int64_t *hi);

#endif /* OFL_PARALLEL_H */
