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

typedef void (*ofl_chunk_fn)(void *ctx, int64_t chunk, int64_t lo, int64_t hi);

/* Splits [0, total) into chunks of `chunk` items (the last may be shorter) and has
 * `threads` workers claim them from a shared counter until none are left, calling
 * fn(ctx, chunk_index, lo, hi) for each. A worker that is descheduled (a busy or
 * shared machine) delays only the chunk it holds, not a fixed share of the work. */
void ofl_parallel_chunks(ofl_chunk_fn fn, void *ctx, int64_t total, int64_t chunk,
                         int32_t threads);

#endif /* OFL_PARALLEL_H */
