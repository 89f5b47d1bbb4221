/* Parallel loops over a persistent, fork-safe pool of plain pthreads (no OpenMP, so the
 * library never competes with another OpenMP runtime in the process).
 *
 * [Note: the worker pool]
 * Workers are created on first use and then park on a futex between calls, so a call
 * costs a wake-up (microseconds) rather than a thread creation and join. The pool is
 * process-wide and serves one call at a time; a call that finds it busy (two Python
 * threads stepping at once) runs on threads of its own, created for that call, as every
 * call did before the pool. After fork() the child starts with an empty pool (a
 * pthread_atfork handler forgets the parent's workers, which do not exist in the child)
 * and creates its own on first use. Workers block every signal, so signals reach the
 * threads that expect them.
 */
#ifndef OFL_PARALLEL_H
#define OFL_PARALLEL_H

#include <stdint.h>

#define OFL_MAX_THREADS 256

typedef void (*ofl_task_fn)(void *ctx, int32_t index, int32_t count);

/* Runs fn(ctx, i, count) for every i in [0, count), i = 0 on the calling thread and the
 * rest on pool workers. A share whose thread cannot be had, or whose worker has not
 * started when the caller is done with its own ([Note: late workers] in ofl_parallel.c),
 * is run by the caller, so the call always completes and never waits for a wake-up.
 * count is clamped to [1, OFL_MAX_THREADS]. */
void ofl_parallel_run(ofl_task_fn fn, void *ctx, int32_t count);

typedef void (*ofl_chunk_fn)(void *ctx, int64_t chunk, int64_t lo, int64_t hi);

/* Splits [0, total) into chunks of `chunk` items (the last may be shorter) and calls
 * fn(ctx, chunk_index, lo, hi) once for each, on up to `threads` threads.
 *
 * [Note: static shares with stealing]
 * Worker i owns one contiguous run of chunks, the i-th of `threads` near-equal runs,
 * and walks it front to back, so each thread streams through one region of memory.
 * A worker that finishes its own run takes chunks one at a time from the back of the
 * run with the most left, so a worker that is descheduled (a busy or shared machine)
 * or woken late delays only the chunk it holds. The chunk grid does not depend on
 * the thread count: callers that keep per-chunk results get the same ones with any
 * number of threads. */
void ofl_parallel_chunks(ofl_chunk_fn fn, void *ctx, int64_t total, int64_t chunk,
                         int32_t threads);

#endif /* OFL_PARALLEL_H */
