/* Parallel loops on the process's OpenMP team where it has one, else on a persistent,
 * fork-safe pool of plain pthreads.
 *
 * [Note: one thread team]
 * torch runs its CPU ops on GNU libgomp's team, whose workers spin for milliseconds after
 * each parallel region before they sleep. A second team of threads (our pool) that starts
 * right after a torch op finds those workers holding the cores: on 2 cores the pool's
 * worker waited for a time slice and the caller did the step alone, at one core's rate
 * (tools/bench/results/adam-openmp-team_2core-epyc_202611.md). So a call from the main
 * thread runs on the main thread's libgomp team, the one torch's ops on that thread use,
 * through GOMP_parallel, the entry point gcc's `#pragma omp parallel` compiles to: the
 * spinning workers take it at once, and the two kinds of work hand the cores to each other
 * instead of contending for them. Members take task indices from a shared counter until
 * none is left, so the shares, the chunk grid and the stealing are the pool's and the bits
 * are the same on either. The library does not link libgomp: it finds the one the process
 * has loaded (torch's) and uses it only when there is exactly one; with none (or two, or
 * another OpenMP runtime) every call uses the pool.
 *
 * What the team costs: its caller waits at the region's closing barrier for every member,
 * also one the scheduler has not run yet, where the pool's caller takes such a member's
 * share itself ([Note: late workers] in ofl_parallel.c). ofl_parallel_team_stats counts
 * those late closes. Measured on a 2-core EPYC under two busy loops, the team was still the
 * faster of the two, for our step and for torch's op that follows it (the pool's spinning
 * worker is then what torch's team waits for): tools/bench/results/adam-one-team_*.md.
 *
 * Threads other than the main one use the pool: libgomp would give each such thread a
 * team of its own, whose spinning workers would contend with torch's. So does a forked
 * child (libgomp's pool there lists threads the child does not have), and every call
 * after ofl_parallel_set_threads(OFL_THREADS_POOL).
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

/* Runs fn(ctx, i, count) for every i in [0, count), each exactly once, on up to count
 * threads, the caller among them: on the OpenMP team ([Note: one thread team]), or on pool
 * workers, where a share whose thread cannot be had, or whose worker has not started when
 * the caller is done with its own ([Note: late workers] in ofl_parallel.c), is run by the
 * caller. count is clamped to [1, OFL_MAX_THREADS]. */
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
