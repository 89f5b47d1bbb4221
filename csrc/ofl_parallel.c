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

void ofl_parallel_share(int64_t total, int32_t index, int32_t count, int64_t align,
                        int64_t *lo, int64_t *hi) {
    int64_t a = total / count * index + total % count * index / count;
    int64_t b = total / count * (index + 1) + total % count * (index + 1) / count;
    *lo = index == 0 ? 0 : a / align * align;
    *hi = index == count - 1 ? total : b / align * align;
}
