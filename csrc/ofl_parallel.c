#include "ofl_parallel.h"

#include <pthread.h>
#include <stdlib.h>

#define OFL_MAX_THREADS 256

typedef struct {
    ofl_task_fn fn;
    void *ctx;
    int32_t index;
    int32_t count;
} ofl_task;

static void *run_task(void *arg) {
    ofl_task *t = (ofl_task *)arg;
    t->fn(t->ctx, t->index, t->count);
    return NULL;
}

void ofl_parallel_run(ofl_task_fn fn, void *ctx, int32_t count) {
    if (count < 1) return;
    if (count > OFL_MAX_THREADS) count = OFL_MAX_THREADS;
    pthread_t threads[OFL_MAX_THREADS];
    ofl_task tasks[OFL_MAX_THREADS];
    int started[OFL_MAX_THREADS];
    for (int32_t i = 1; i < count; i++) {
        tasks[i] = (ofl_task){fn, ctx, i, count};
        started[i] = pthread_create(&threads[i], NULL, run_task, &tasks[i]) == 0;
    }
    fn(ctx, 0, count);
    for (int32_t i = 1; i < count; i++) {
        if (started[i]) pthread_join(threads[i], NULL);
        else fn(ctx, i, count);
    }
}

typedef struct {
    ofl_chunk_fn fn;
    void *ctx;
    int64_t total;
    int64_t chunk;
    int64_t next; /* next chunk index to claim; atomic */
} ofl_chunk_job;

static void claim_chunks(void *arg, int32_t index, int32_t count) {
    ofl_chunk_job *job = (ofl_chunk_job *)arg;
    (void)index;
    (void)count;
    for (;;) {
        int64_t k = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
        int64_t lo = k * job->chunk;
        if (lo >= job->total) return;
        int64_t hi = lo + job->chunk < job->total ? lo + job->chunk : job->total;
        job->fn(job->ctx, k, lo, hi);
    }
}

void ofl_parallel_chunks(ofl_chunk_fn fn, void *ctx, int64_t total, int64_t chunk,
                         int32_t threads) {
    if (total <= 0 || chunk <= 0) return;
    int64_t chunks = (total + chunk - 1) / chunk;
    if (threads > chunks) threads = (int32_t)chunks;
    ofl_chunk_job job = {fn, ctx, total, chunk, 0};
    ofl_parallel_run(claim_chunks, &job, threads);
}
