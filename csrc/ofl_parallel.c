/* The worker pool and the chunked loop; see [Note: the worker pool] and
 * [Note: static shares with stealing] in ofl_parallel.h. Linux only (futexes). */
#define _GNU_SOURCE
#include "ofl_parallel.h"
#include "ofl_adam.h" /* OFL_THREADS_* and the team entry points */

#include <dlfcn.h>
#include <errno.h>
#include <link.h>
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* Workers run kernels and little else; their stacks need not be the default 8 MiB. */
#define OFL_WORKER_STACK_BYTES (1 << 20)
/* [Note: spinning workers]
 * A worker that has finished its share keeps looking for the next call this long before
 * it parks. Calls that come back to back (every param group of a step, every sub-group
 * of the engine, a benchmark's repetitions) then start at once: waking a parked thread
 * costs tens of microseconds in a virtual machine, a tenth of a 1e6-param step. OpenMP
 * runtimes spin for milliseconds; this is kept short, as the spin takes a core from
 * whatever else the machine runs. */
#define OFL_WORKER_SPIN_NS 100000u
/* How often the caller looks at its workers before it sleeps until they are done:
 * with stealing they finish within about one chunk of the caller (tens of microseconds). */
#define OFL_CALLER_SPINS 4096
/* A team call whose close waits longer than this past the caller's last task counts as late
 * ([Note: one thread team] in ofl_parallel.h): a member the scheduler ran late. */
#define OFL_TEAM_LATE_NS 200000u

static void futex_wait(uint32_t *word, uint32_t expected) {
    syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
}

static void futex_wake(uint32_t *word, int32_t waiters) {
    syscall(SYS_futex, word, FUTEX_WAKE_PRIVATE, waiters, NULL, NULL, 0);
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* [Note: late workers]
 * A worker is offered a call (claim = OFFERED, then its wake word bumped) and takes it by
 * moving claim to RUNNING before it reads the call. A worker that the scheduler runs late
 * (its CPU busy with another process, or with torch's OpenMP workers spinning after a
 * parallel op) may find that the caller has already done every chunk, its share stolen:
 * the caller then takes the offer back (OFFERED -> IDLE) and runs that share itself, so
 * a call waits only for workers that have started, never for a wake-up on a busy CPU.
 * A worker that lost its offer goes back to waiting; if a new call has offered it again
 * meanwhile, it takes that one, whose fields were published before the offer. */
enum { CLAIM_IDLE = 0, CLAIM_OFFERED = 1, CLAIM_RUNNING = 2 };

typedef struct {
    _Alignas(64) uint32_t wake; /* futex word: the caller bumps it to start this worker */
    uint32_t sleeping;          /* 1 while the worker is (about to be) parked on `wake` */
    uint32_t claim;             /* CLAIM_*: see [Note: late workers] */
} ofl_worker;

static struct {
    pthread_mutex_t lock; /* held by the call that is using the pool */
    int32_t started;      /* workers 1..started exist */
    ofl_task_fn fn;       /* the current call, read by workers after their wake-up */
    void *ctx;
    int32_t count;
    _Alignas(64) uint32_t pending; /* workers of the current call still running */
    ofl_worker workers[OFL_MAX_THREADS];
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER};

static pthread_once_t pool_once = PTHREAD_ONCE_INIT;

/* In a forked child only the forking thread exists: forget the parent's workers. */
static void pool_after_fork_in_child(void) {
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    pool.lock = fresh;
    pool.started = 0;
    pool.pending = 0;
    for (int32_t i = 0; i < OFL_MAX_THREADS; i++)
        pool.workers[i].wake = pool.workers[i].sleeping = pool.workers[i].claim = 0;
}

static void pool_init_once(void) { pthread_atfork(NULL, NULL, pool_after_fork_in_child); }

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Waits until *wake differs from `seen` and returns the new value: first spinning for
 * OFL_WORKER_SPIN_NS ([Note: spinning workers]), then parked on the futex. */
static uint32_t wait_for_call(ofl_worker *w, uint32_t seen) {
    uint32_t now;
    uint64_t deadline = now_ns() + OFL_WORKER_SPIN_NS;
    for (int32_t spin = 1;; spin++) {
        if ((now = __atomic_load_n(&w->wake, __ATOMIC_ACQUIRE)) != seen) return now;
        cpu_relax();
        if (spin % 64 == 0 && now_ns() > deadline) break;
    }
    for (;;) {
        __atomic_store_n(&w->sleeping, 1, __ATOMIC_SEQ_CST);
        if ((now = __atomic_load_n(&w->wake, __ATOMIC_SEQ_CST)) != seen) break;
        futex_wait(&w->wake, seen);
    }
    __atomic_store_n(&w->sleeping, 0, __ATOMIC_RELAXED);
    return now;
}

static void *worker_main(void *arg) {
    int32_t index = (int32_t)(intptr_t)arg;
    ofl_worker *w = &pool.workers[index];
    uint32_t seen = 0; /* the value grow_pool set: a call may bump it before this line runs */
    for (;;) {
        seen = wait_for_call(w, seen);
        uint32_t offered = CLAIM_OFFERED;
        if (!__atomic_compare_exchange_n(&w->claim, &offered, CLAIM_RUNNING, 0, __ATOMIC_ACQ_REL,
                                         __ATOMIC_ACQUIRE))
            continue; /* taken back: the call was done without this worker */
        pool.fn(pool.ctx, index, pool.count);
        if (__atomic_sub_fetch(&pool.pending, 1, __ATOMIC_ACQ_REL) == 0) futex_wake(&pool.pending, 1);
    }
    return NULL;
}

/* Creates a thread with every signal blocked; 0 on success. */
static int32_t spawn(void *(*main_fn)(void *), void *arg, int detached, pthread_t *out) {
    pthread_attr_t attr;
    if (pthread_attr_init(&attr) != 0) return -1;
    pthread_attr_setstacksize(&attr, OFL_WORKER_STACK_BYTES);
    if (detached) pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pthread_t thread;
    int rc = pthread_create(&thread, &attr, main_fn, arg);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
    if (rc == 0 && out) *out = thread;
    return rc == 0 ? 0 : -1;
}

/* Pool lock held. Grows the pool toward `count - 1` workers; returns how many exist. */
static int32_t grow_pool(int32_t count) {
    while (pool.started < count - 1) {
        int32_t index = pool.started + 1;
        pool.workers[index].wake = 0;
        pool.workers[index].sleeping = 0;
        pool.workers[index].claim = CLAIM_IDLE;
        if (spawn(worker_main, (void *)(intptr_t)index, 1, NULL) != 0) break;
        pool.started = index;
    }
    return pool.started;
}

static void run_on_pool(ofl_task_fn fn, void *ctx, int32_t count) {
    int32_t workers = grow_pool(count);
    int32_t helped = workers < count - 1 ? workers : count - 1;
    pool.fn = fn;
    pool.ctx = ctx;
    pool.count = count;
    __atomic_store_n(&pool.pending, (uint32_t)helped, __ATOMIC_RELEASE);
    for (int32_t i = 1; i <= helped; i++) {
        ofl_worker *w = &pool.workers[i];
        __atomic_store_n(&w->claim, CLAIM_OFFERED, __ATOMIC_SEQ_CST);
        __atomic_add_fetch(&w->wake, 1, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&w->sleeping, __ATOMIC_SEQ_CST)) futex_wake(&w->wake, 1);
    }
    fn(ctx, 0, count);
    for (int32_t i = helped + 1; i < count; i++) fn(ctx, i, count); /* no thread for these */
    for (int32_t i = 1; i <= helped; i++) { /* [Note: late workers] */
        uint32_t offered = CLAIM_OFFERED;
        if (__atomic_compare_exchange_n(&pool.workers[i].claim, &offered, CLAIM_IDLE, 0,
                                        __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            __atomic_sub_fetch(&pool.pending, 1, __ATOMIC_ACQ_REL);
            fn(ctx, i, count);
        }
    }
    uint32_t left;
    for (int32_t spin = 0; spin < OFL_CALLER_SPINS; spin++) {
        if (__atomic_load_n(&pool.pending, __ATOMIC_ACQUIRE) == 0) return;
        cpu_relax();
    }
    while ((left = __atomic_load_n(&pool.pending, __ATOMIC_ACQUIRE)) != 0) futex_wait(&pool.pending, left);
}

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

/* The pool is in use by another call: threads of this call's own, joined before returning. */
static void run_on_new_threads(ofl_task_fn fn, void *ctx, int32_t count) {
    pthread_t threads[OFL_MAX_THREADS];
    ofl_task tasks[OFL_MAX_THREADS];
    int started[OFL_MAX_THREADS];
    for (int32_t i = 1; i < count; i++) {
        tasks[i] = (ofl_task){fn, ctx, i, count};
        started[i] = spawn(run_task, &tasks[i], 0, &threads[i]) == 0;
    }
    fn(ctx, 0, count);
    for (int32_t i = 1; i < count; i++) {
        if (started[i]) pthread_join(threads[i], NULL);
        else fn(ctx, i, count);
    }
}

/* ---- the process's OpenMP team: see [Note: one thread team] in ofl_parallel.h ---- */

typedef void (*gomp_parallel_fn)(void (*fn)(void *), void *data, unsigned num_threads, unsigned flags);

static struct {
    int32_t mode;             /* OFL_THREADS_*: ofl_parallel_set_threads */
    int32_t looked;           /* 1 once the lookup ran */
    pid_t pid;                /* the process that loaded this library: a forked child uses the pool */
    gomp_parallel_fn parallel; /* NULL: no single libgomp in the process */
    uint64_t calls, late_calls, late_ns; /* written by the main thread only */
} team = {.mode = OFL_THREADS_TEAM};

__attribute__((constructor)) static void team_note_loader(void) { team.pid = getpid(); }

typedef struct {
    gomp_parallel_fn found;
    int32_t libraries;
} gomp_search;

static int find_libgomp(struct dl_phdr_info *info, size_t size, void *arg) {
    gomp_search *search = (gomp_search *)arg;
    const char *slash = strrchr(info->dlpi_name, '/');
    const char *base = slash ? slash + 1 : info->dlpi_name;
    if (strncmp(base, "libgomp", 7) != 0) return 0;
    search->libraries++;
    void *handle = dlopen(info->dlpi_name, RTLD_NOW | RTLD_NOLOAD);
    if (handle) {
        search->found = (gomp_parallel_fn)dlsym(handle, "GOMP_parallel");
        dlclose(handle); /* RTLD_NOLOAD took a reference to a library that stays loaded */
    }
    return 0;
}

/* The process's one libgomp, looked up once. None in a forked child: libgomp's pool there
 * still lists the parent's threads, which the child does not have. */
static gomp_parallel_fn process_team(void) {
    if (getpid() != team.pid) return NULL;
    if (!__atomic_load_n(&team.looked, __ATOMIC_ACQUIRE)) {
        gomp_search search = {NULL, 0};
        dl_iterate_phdr(find_libgomp, &search);
        team.parallel = search.libraries == 1 ? search.found : NULL;
        __atomic_store_n(&team.looked, 1, __ATOMIC_RELEASE);
    }
    return team.parallel;
}

/* The team this call runs on, or NULL for the pool: the main thread's only (torch runs its
 * ops there; another thread would get a spinning team of its own beside torch's). */
static gomp_parallel_fn team_for_this_thread(void) {
    if (__atomic_load_n(&team.mode, __ATOMIC_RELAXED) != OFL_THREADS_TEAM) return NULL;
    if ((pid_t)syscall(SYS_gettid) != getpid()) return NULL;
    return process_team();
}

typedef struct {
    ofl_task_fn fn;
    void *ctx;
    int32_t count;
    pthread_t caller;
    uint64_t caller_done_ns;
    _Alignas(64) int32_t next; /* the next index to take */
} team_job;

/* Every member takes indices until none is left, so a member that starts late finds the
 * work done and leaves at once. */
static void team_member(void *arg) {
    team_job *job = (team_job *)arg;
    int32_t i;
    while ((i = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED)) < job->count) job->fn(job->ctx, i, job->count);
    if (pthread_equal(pthread_self(), job->caller)) job->caller_done_ns = now_ns();
}

static void run_on_team(gomp_parallel_fn parallel, ofl_task_fn fn, void *ctx, int32_t count) {
    team_job job = {fn, ctx, count, pthread_self(), 0, 0};
    parallel(team_member, &job, (unsigned)count, 0);
    uint64_t late = now_ns() - job.caller_done_ns;
    team.calls++;
    if (late > OFL_TEAM_LATE_NS) {
        team.late_calls++;
        team.late_ns += late;
    }
}

int32_t ofl_parallel_set_threads(int32_t mode) {
    if (mode != OFL_THREADS_POOL && mode != OFL_THREADS_TEAM) return -EINVAL;
    __atomic_store_n(&team.mode, mode, __ATOMIC_RELAXED);
    return 0;
}

int32_t ofl_parallel_team_found(void) { return process_team() != NULL; }

void ofl_parallel_team_stats(uint64_t *out) {
    out[0] = team.calls;
    out[1] = team.late_calls;
    out[2] = team.late_ns;
}

void ofl_parallel_run(ofl_task_fn fn, void *ctx, int32_t count) {
    if (count < 1) count = 1;
    if (count > OFL_MAX_THREADS) count = OFL_MAX_THREADS;
    if (count == 1) {
        fn(ctx, 0, 1);
        return;
    }
    gomp_parallel_fn parallel = team_for_this_thread();
    if (parallel) {
        run_on_team(parallel, fn, ctx, count);
        return;
    }
    pthread_once(&pool_once, pool_init_once);
    if (pthread_mutex_trylock(&pool.lock) != 0) {
        run_on_new_threads(fn, ctx, count);
        return;
    }
    run_on_pool(fn, ctx, count);
    pthread_mutex_unlock(&pool.lock);
}

/* ---- chunks: one contiguous run per worker, then stealing from the back ---- */

typedef struct {
    _Alignas(64) uint64_t range; /* next chunk to take from the front | (end << 32) */
} ofl_share;

typedef struct {
    ofl_chunk_fn fn;
    void *ctx;
    int64_t total;
    int64_t chunk;
    ofl_share *shares;
} ofl_chunk_job;

static int take_front(ofl_share *s, int64_t *k) {
    uint64_t r = __atomic_load_n(&s->range, __ATOMIC_RELAXED);
    for (;;) {
        uint32_t front = (uint32_t)r, end = (uint32_t)(r >> 32);
        if (front >= end) return 0;
        uint64_t next = ((uint64_t)end << 32) | (front + 1u);
        if (__atomic_compare_exchange_n(&s->range, &r, next, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
            *k = front;
            return 1;
        }
    }
}

static int take_back(ofl_share *s, int64_t *k) {
    uint64_t r = __atomic_load_n(&s->range, __ATOMIC_RELAXED);
    for (;;) {
        uint32_t front = (uint32_t)r, end = (uint32_t)(r >> 32);
        if (front >= end) return 0;
        uint64_t next = ((uint64_t)(end - 1u) << 32) | front;
        if (__atomic_compare_exchange_n(&s->range, &r, next, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
            *k = end - 1u;
            return 1;
        }
    }
}

static void run_chunk(const ofl_chunk_job *job, int64_t k) {
    int64_t lo = k * job->chunk;
    int64_t hi = lo + job->chunk < job->total ? lo + job->chunk : job->total;
    job->fn(job->ctx, k, lo, hi);
}

static void walk_and_steal(void *arg, int32_t index, int32_t count) {
    ofl_chunk_job *job = (ofl_chunk_job *)arg;
    int64_t k;
    while (take_front(&job->shares[index], &k)) run_chunk(job, k);
    for (;;) { /* own run done: help the run with the most left, from its back */
        int32_t victim = -1;
        uint32_t most = 0;
        for (int32_t j = 0; j < count; j++) {
            uint64_t r = __atomic_load_n(&job->shares[j].range, __ATOMIC_RELAXED);
            uint32_t front = (uint32_t)r, end = (uint32_t)(r >> 32);
            if (end > front && end - front > most) {
                most = end - front;
                victim = j;
            }
        }
        if (victim < 0) return;
        if (take_back(&job->shares[victim], &k)) run_chunk(job, k);
    }
}

void ofl_parallel_chunks(ofl_chunk_fn fn, void *ctx, int64_t total, int64_t chunk,
                         int32_t threads) {
    if (total <= 0 || chunk <= 0) return;
    int64_t chunks = (total + chunk - 1) / chunk;
    if (threads > chunks) threads = (int32_t)chunks;
    if (threads > OFL_MAX_THREADS) threads = OFL_MAX_THREADS;
    if (threads <= 1 || chunks > (int64_t)UINT32_MAX) { /* one thread: the chunks in order */
        for (int64_t k = 0; k < chunks; k++) {
            int64_t lo = k * chunk;
            fn(ctx, k, lo, lo + chunk < total ? lo + chunk : total);
        }
        return;
    }
    ofl_share shares[OFL_MAX_THREADS];
    for (int32_t i = 0; i < threads; i++) {
        uint64_t front = (uint64_t)(chunks * i / threads);
        uint64_t end = (uint64_t)(chunks * (i + 1) / threads);
        shares[i].range = (end << 32) | front;
    }
    ofl_chunk_job job = {fn, ctx, total, chunk, shares};
    ofl_parallel_run(walk_and_steal, &job, threads);
}
