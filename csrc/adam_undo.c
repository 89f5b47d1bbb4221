/* The undo-logged Adam pass: a process killed anywhere inside it (SIGKILL, the OOM killer)
 * leaves, in the caller's undo buffer (the node daemon's shared memory, which outlives the
 * process), what a restart needs to finish the pass bit for bit: which calls and chunks
 * are done, and for each chunk in flight how far it got and the old values of the piece
 * it was updating.
 *
 * [Note: undo log]
 * The work of one call is cut as ofl_adam_step cuts it (OFL_CHUNK_ELEMS chunks of the
 * virtual concatenation, split at tensor ends into segments), and each segment further
 * into sub-chunks of OFL_UNDO_SUB_ELEMS elements counted from the segment's start. The
 * kernels' vector groups start at a segment's start, so a cut at a multiple of 16 from
 * it leaves every element in the same group (and the AVX2 scalar tail where it was): the
 * results are bit for bit ofl_adam_step's. Before a sub-chunk is updated, its old master,
 * exp_avg and exp_avg_sq are copied into the slot of the thread doing it (a slot is
 * 48 KiB: the copy is read back by the kernel from cache), then the slot's word says so;
 * after the chunk's last sub-chunk, the chunk's byte in the done map is set. So a
 * killed call leaves, per chunk: done (map byte 1), untouched (no slot names it), or in
 * flight in one slot, whose word says where the untouched part starts and whether the
 * sub-chunk there is half written (then the slot holds its old values). A restart with
 * the same tensors restores each in-flight sub-chunk, finishes those chunks, then runs
 * the chunks not done. The calls of a pass (one per param group, or per piece) are
 * numbered by the caller; the header's call word says how many are done and whether the
 * next is in flight.
 *
 * [Note: journal]
 * On the AVX-512 paths (x86) the kernel itself keeps the old values, vector by vector, over a
 * whole segment: it loads a vector's old master and moments, stores them into the slot's ring
 * of two vectors (vector j into place j & 1), stores the slot's word with the count of vectors
 * journaled (bits 18-30, with bit 31 set and `at` the segment's start), then stores the new
 * values in place. x86 makes a thread's stores visible in program order, and a killed process's
 * retired stores are all in memory; so with the count at c, the vectors before c - 1 are fully
 * written, vector c - 1 perhaps in part (its old values are in the ring: vector c's go to the
 * other place), and those from c untouched. A restart copies vector c - 1's old values back and
 * runs the segment from it. The undo form's copy, a separate read of the old values ahead of
 * the kernel, made the pass about 2x slower, and a redo form (new values into the slot, then
 * copied over the old) about 1.2x; this form runs at 1.03-1.05x (tools/bench/bench_undo.py, a quiet
 * 2-core EPYC): its extra stores go to 384 bytes that stay in the first-level cache.
 *
 * Every word changes with one aligned 8-byte store, ordered after what it describes
 * (release stores; compiler fences around the kernel): a process killed between two
 * stores leaves a state one of the readings above describes. (A killed process's stores
 * that executed reach memory: nothing here needs to survive a power loss, which the
 * daemon's memory does not survive either.)
 *
 * Layout (little-endian; `undo` 64-byte aligned, `slots` and the element counts fixed by
 * ofl_adam_undo_init):
 *   header, 64 bytes:
 *     0   u64  magic "OFLUNDO1"
 *     8   u32  version (1)
 *     12  u32  slots
 *     16  u32  sub-chunk elements (OFL_UNDO_SUB_ELEMS)
 *     20  u32  chunk elements (OFL_CHUNK_ELEMS)
 *     24  u64  done map bytes (chunks a call may have)
 *     32  u64  call word: (calls done << 1) | 1 while call `calls done` is in flight
 *     40  24 bytes reserved (0)
 *   slot s, at 64 + s * (64 + 12 * OFL_UNDO_SUB_ELEMS):
 *     0   u64  word: ~0 (empty), or (chunk << 32) | journal << 31 | vectors << 18 |
 *              (offset in the chunk << 1) | half
 *              (elements of the chunk before the offset are updated, those from it are not,
 *              except with half = 1 the sub-chunk at the offset, whose old values follow; with
 *              journal = 1, the segment at the offset, the first vectors - 1 of it updated,
 *              the next one's old values in the ring)
 *     8   i64  elements of that sub-chunk
 *     16  48 bytes reserved
 *     64  old (or new) master, then exp_avg, then exp_avg_sq: OFL_UNDO_SUB_ELEMS floats each
 *   done map, after the last slot: one byte per chunk of the call in flight (1 = done).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "adam_internal.h"
#include "ofl_parallel.h"

#define UNDO_VERSION 1u
#define UNDO_HEADER_BYTES 64
#define SLOT_HEAD_BYTES 64
#define SLOT_EMPTY UINT64_MAX
#define SLOT_JOURNAL (1ull << 31) /* [Note: journal] */
#define SLOT_VECTORS_MASK 0x1fffu
#define SLOT_STRIDE ((int64_t)SLOT_HEAD_BYTES + 12 * (int64_t)OFL_UNDO_SUB_ELEMS)

static const char UNDO_MAGIC[8] = {'O', 'F', 'L', 'U', 'N', 'D', 'O', '1'};

typedef struct {
    char magic[8];
    uint32_t version;
    uint32_t slots;
    uint32_t sub_elems;
    uint32_t chunk_elems;
    uint64_t map_bytes;
    uint64_t call_word;
    uint64_t reserved[3];
} undo_header;

typedef struct {
    uint64_t word;
    int64_t n;
    uint64_t reserved[6];
} undo_slot;

_Static_assert(sizeof(undo_header) == UNDO_HEADER_BYTES, "undo header layout");
_Static_assert(sizeof(undo_slot) == SLOT_HEAD_BYTES, "undo slot layout");
_Static_assert(OFL_UNDO_SUB_ELEMS % 16 == 0 && OFL_CHUNK_ELEMS % OFL_UNDO_SUB_ELEMS == 0, "sub-chunk grid");
_Static_assert(OFL_CHUNK_ELEMS <= (1 << 17) && OFL_CHUNK_ELEMS / 16 <= SLOT_VECTORS_MASK &&
                   OFL_JOURNAL_VECTORS_SHIFT == 18, "word fields");

typedef struct {
    undo_header *h;
    char *slot0;
    uint8_t *map;
    int32_t slots;
} undo_view;

static int64_t map_bytes_for(int64_t max_elems) {
    int64_t chunks = (max_elems + OFL_CHUNK_ELEMS - 1) / OFL_CHUNK_ELEMS;
    return (chunks + 7) / 8 * 8;
}

int64_t ofl_adam_undo_bytes(int32_t slots, int64_t max_elems) {
    if (slots < 1 || slots > OFL_MAX_THREADS || max_elems < 0) return -EINVAL;
    return UNDO_HEADER_BYTES + slots * SLOT_STRIDE + (map_bytes_for(max_elems) > 0 ? map_bytes_for(max_elems) : 8);
}

int32_t ofl_adam_undo_init(void *undo, int64_t undo_bytes, int32_t slots, int64_t max_elems) {
    int64_t need = ofl_adam_undo_bytes(slots, max_elems);
    if (need < 0) return (int32_t)need;
    if (!undo || ((uintptr_t)undo & 63) || undo_bytes < need) return -EINVAL;
    memset(undo, 0, (size_t)need);
    undo_header *h = (undo_header *)undo;
    h->version = UNDO_VERSION;
    h->slots = (uint32_t)slots;
    h->sub_elems = OFL_UNDO_SUB_ELEMS;
    h->chunk_elems = OFL_CHUNK_ELEMS;
    h->map_bytes = (uint64_t)(need - UNDO_HEADER_BYTES - slots * SLOT_STRIDE);
    for (int32_t s = 0; s < slots; s++)
        ((undo_slot *)((char *)undo + UNDO_HEADER_BYTES + s * SLOT_STRIDE))->word = SLOT_EMPTY;
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    memcpy(h->magic, UNDO_MAGIC, sizeof h->magic); /* last: a buffer cut short in init reads as none */
    return 0;
}

/* Checks a buffer ofl_adam_undo_init wrote (by this build: the same grid); 0 or -EINVAL. */
static int32_t undo_open(void *undo, int64_t undo_bytes, undo_view *u) {
    if (!undo || ((uintptr_t)undo & 63) || undo_bytes < UNDO_HEADER_BYTES) return -EINVAL;
    undo_header *h = (undo_header *)undo;
    if (memcmp(h->magic, UNDO_MAGIC, sizeof h->magic) != 0 || h->version != UNDO_VERSION ||
        h->sub_elems != OFL_UNDO_SUB_ELEMS || h->chunk_elems != OFL_CHUNK_ELEMS || h->slots < 1 ||
        h->slots > OFL_MAX_THREADS)
        return -EINVAL;
    if (UNDO_HEADER_BYTES + (int64_t)h->slots * SLOT_STRIDE + (int64_t)h->map_bytes > undo_bytes) return -EINVAL;
    u->h = h;
    u->slot0 = (char *)undo + UNDO_HEADER_BYTES;
    u->map = (uint8_t *)u->slot0 + h->slots * SLOT_STRIDE;
    u->slots = (int32_t)h->slots;
    return 0;
}

static inline undo_slot *slot_at(const undo_view *u, int32_t s) {
    return (undo_slot *)(u->slot0 + s * SLOT_STRIDE);
}

static inline float *slot_data(undo_slot *slot, int32_t which) {
    return (float *)((char *)slot + SLOT_HEAD_BYTES) + which * (int64_t)OFL_UNDO_SUB_ELEMS;
}

int32_t ofl_adam_undo_begin(void *undo, int64_t undo_bytes) {
    undo_view u;
    int32_t rc = undo_open(undo, undo_bytes, &u);
    if (rc) return rc;
    __atomic_store_n(&u.h->call_word, 0, __ATOMIC_RELEASE);
    return 0;
}

/* ---- the test hook: SIGKILL halfway through one sub-chunk ---- */

static int64_t fault_call = -1, fault_chunk = -1, fault_offset = -1;

int32_t ofl_adam_undo_fault(int64_t call, int64_t chunk, int64_t offset) {
    __atomic_store_n(&fault_chunk, chunk, __ATOMIC_RELAXED);
    __atomic_store_n(&fault_offset, offset, __ATOMIC_RELAXED);
    __atomic_store_n(&fault_call, call, __ATOMIC_RELEASE);
    return 0;
}

/* ---- the pass ---- */

typedef struct {
    ofl_adam_job *job;
    const undo_view *u;
    int64_t call;
    int64_t total;
    int32_t threads;
    ofl_adam_log_kernel_fn log_kernel; /* the journaled kernel, or NULL: the undo form */
    uint32_t claimed[OFL_MAX_THREADS]; /* slots held by a running chunk */
} undo_job;

typedef struct {
    undo_job *uj;
    undo_slot *slot;
    int64_t chunk, lo;
} chunk_walk;

/* Copies n elements of tensor i at off between the tensors and a slot (save 1: into the slot). */
static void copy_sub(const ofl_adam_tensors *t, undo_slot *slot, int64_t i, int64_t off, int64_t n, int save) {
    float *streams[3] = {(float *)(uintptr_t)t->param[i] + off, (float *)(uintptr_t)t->exp_avg[i] + off,
                         (float *)(uintptr_t)t->exp_avg_sq[i] + off};
    for (int32_t w = 0; w < 3; w++) {
        if (save) memcpy(slot_data(slot, w), streams[w], (size_t)n * sizeof(float));
        else memcpy(streams[w], slot_data(slot, w), (size_t)n * sizeof(float));
    }
}

/* The journaled form of a segment ([Note: journal]). `die` >= 0: the test hook: stop after the
 * first `die` elements (whole vectors), scribble over the last of them in place as a kill inside
 * its stores would leave it, and SIGKILL this process. */
static void journal_segment(chunk_walk *cw, int64_t i, int64_t off, int64_t n, uint64_t word, int64_t die) {
    ofl_adam_job *job = cw->uj->job;
    const ofl_adam_tensors *t = job->t;
    int32_t gd = job->cfg->grad_dtype, od = job->cfg->out_dtype;
    char *g = (char *)(uintptr_t)t->grad[i] + off * (gd == OFL_DTYPE_F32 ? 4 : 2);
    char *out = od == OFL_DTYPE_NONE ? NULL : (char *)(uintptr_t)t->param_out[i] + off * (od == OFL_DTYPE_F32 ? 4 : 2);
    float *p = (float *)(uintptr_t)t->param[i] + off;
    int32_t bad = cw->uj->log_kernel(&job->coeffs[i], gd, od, p, g, (float *)(uintptr_t)t->exp_avg[i] + off,
                                     (float *)(uintptr_t)t->exp_avg_sq[i] + off, out, die >= 0 ? die : n,
                                     slot_data(cw->slot, 0), slot_data(cw->slot, 1), slot_data(cw->slot, 2),
                                     &cw->slot->word, word);
    if (bad) __atomic_store_n(&job->nonfinite, 1, __ATOMIC_RELAXED);
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    if (die >= 0) {
        for (int64_t e = (die - 1) / 16 * 16; e >= 0 && e < die; e++) p[e] = -p[e] * 3.0f;
        __atomic_signal_fence(__ATOMIC_SEQ_CST);
        kill(getpid(), SIGKILL);
        for (;;) pause();
    }
}

static void logged_segment(void *ctx, int64_t i, int64_t off, int64_t len) {
    chunk_walk *cw = (chunk_walk *)ctx;
    ofl_adam_job *job = cw->uj->job;
    int faulty = __atomic_load_n(&fault_call, __ATOMIC_ACQUIRE) == cw->uj->call && fault_chunk == cw->chunk;
    if (cw->uj->log_kernel) { /* [0, at) updated, no vector of the segment at `at` journaled yet */
        int64_t at = job->starts[i] + off - cw->lo;
        uint64_t word = ((uint64_t)cw->chunk << 32) | SLOT_JOURNAL | ((uint64_t)at << 1) | 1u;
        int64_t die = -1;
        if (faulty && at + len > fault_offset) {
            die = (fault_offset > at ? (fault_offset - at) / 16 * 16 : 0) + 16;
            if (die > len) die = len;
        }
        __atomic_store_n(&cw->slot->word, word, __ATOMIC_RELEASE);
        __atomic_signal_fence(__ATOMIC_SEQ_CST);
        journal_segment(cw, i, off, len, word, die);
        return;
    }
    for (int64_t a = 0; a < len; a += OFL_UNDO_SUB_ELEMS) {
        int64_t n = len - a < OFL_UNDO_SUB_ELEMS ? len - a : OFL_UNDO_SUB_ELEMS;
        int64_t at = job->starts[i] + off + a - cw->lo; /* offset in the chunk */
        uint64_t word = ((uint64_t)cw->chunk << 32) | ((uint64_t)at << 1);
        __atomic_store_n(&cw->slot->word, word, __ATOMIC_RELEASE); /* [0, at) updated, the rest not */
        copy_sub(job->t, cw->slot, i, off + a, n, 1);
        cw->slot->n = n;
        __atomic_store_n(&cw->slot->word, word | 1u, __ATOMIC_RELEASE); /* the sub-chunk at `at` may be half written */
        __atomic_signal_fence(__ATOMIC_SEQ_CST);
        if (faulty && at >= fault_offset) {
            ofl_adam_job_segment(job, i, off + a, n / 2);
            kill(getpid(), SIGKILL);
            for (;;) pause();
        }
        ofl_adam_job_segment(job, i, off + a, n);
        __atomic_signal_fence(__ATOMIC_SEQ_CST);
    }
}
/* Updates [from, hi) of chunk k with slot s, then marks the chunk done. */
static void run_logged(undo_job *uj, int32_t s, int64_t k, int64_t from) {
    int64_t lo = k * OFL_CHUNK_ELEMS;
    int64_t hi = lo + OFL_CHUNK_ELEMS < uj->total ? lo + OFL_CHUNK_ELEMS : uj->total;
    chunk_walk cw = {uj, slot_at(uj->u, s), k, lo};
    ofl_walk_share(uj->job->starts, uj->job->t->count, from, hi, logged_segment, &cw);
    __atomic_store_n(&uj->u->map[k], 1, __ATOMIC_RELEASE);
}

static void logged_chunk(void *ctx, int64_t k, int64_t lo, int64_t hi) {
    undo_job *uj = (undo_job *)ctx;
    (void)hi;
    if (__atomic_load_n(&uj->u->map[k], __ATOMIC_ACQUIRE)) return; /* done before a restart */
    int32_t s = 0;
    for (;; s = (s + 1) % uj->threads) { /* at most `threads` chunks run at once: one is free */
        uint32_t idle = 0;
        if (__atomic_compare_exchange_n(&uj->claimed[s], &idle, 1, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) break;
    }
    run_logged(uj, s, k, lo);
    __atomic_store_n(&uj->claimed[s], 0, __ATOMIC_RELEASE);
}

/* The tensor holding element `pos` of the call's concatenation, or -1. */
static int64_t tensor_at(const undo_job *uj, int64_t pos) {
    const int64_t *starts = uj->job->starts;
    int64_t count = uj->job->t->count, i = 0;
    while (i < count && starts[i + 1] <= pos) i++;
    return i < count ? i : -1;
}

/* Where the segment of tensor i in the chunk starting at lo ends. */
static int64_t starts_end(const undo_job *uj, int64_t i, int64_t lo) {
    int64_t end = uj->job->starts[i + 1], hi = lo + OFL_CHUNK_ELEMS < uj->total ? lo + OFL_CHUNK_ELEMS : uj->total;
    return end < hi ? end : hi;
}

/* Copies the journal's ring vector r (n <= 16 elements) back over tensor i at off. */
static void copy_ring(const ofl_adam_tensors *t, undo_slot *slot, int32_t r, int64_t i, int64_t off, int64_t n) {
    float *streams[3] = {(float *)(uintptr_t)t->param[i] + off, (float *)(uintptr_t)t->exp_avg[i] + off,
                         (float *)(uintptr_t)t->exp_avg_sq[i] + off};
    for (int32_t w = 0; w < 3; w++) memcpy(streams[w], slot_data(slot, w) + 16 * r, (size_t)n * sizeof(float));
}

/* A restart: each chunk a slot names as in flight (and not done) has its half-written
 * sub-chunk restored and the rest of it run, one after another on this thread. */
static int32_t finish_in_flight(undo_job *uj, int64_t chunks, int64_t *restored) {
    const undo_view *u = uj->u;
    for (int32_t s = 0; s < u->slots; s++) {
        undo_slot *slot = slot_at(u, s);
        uint64_t word = __atomic_load_n(&slot->word, __ATOMIC_ACQUIRE);
        if (word == SLOT_EMPTY) continue;
        int64_t k = (int64_t)(word >> 32), at = (int64_t)((word >> 1) & 0x1ffffu);
        if (k >= chunks || at > OFL_CHUNK_ELEMS) return -EINVAL;
        if (__atomic_load_n(&u->map[k], __ATOMIC_ACQUIRE)) continue;
        int64_t lo = k * OFL_CHUNK_ELEMS;
        if ((word & SLOT_JOURNAL) && (word & 1u)) {
            int64_t c = (int64_t)((word >> OFL_JOURNAL_VECTORS_SHIFT) & SLOT_VECTORS_MASK);
            if (c > 0) { /* vector c - 1 may be half written: its old values back from the ring */
                int64_t seg = lo + at, i = tensor_at(uj, seg);
                if (i < 0) return -EINVAL;
                int64_t end = starts_end(uj, i, lo), pos = seg + 16 * (c - 1);
                if (pos >= end) return -EINVAL;
                copy_ring(uj->job->t, slot, (c - 1) & 1, i, pos - uj->job->starts[i], end - pos < 16 ? end - pos : 16);
                (*restored)++;
                at += 16 * (c - 1);
            }
        } else if (word & 1u) {
            int64_t pos = lo + at, n = slot->n, i = tensor_at(uj, pos);
            if (i < 0 || n < 1 || n > OFL_UNDO_SUB_ELEMS || pos + n > uj->job->starts[i + 1]) return -EINVAL;
            copy_sub(uj->job->t, slot, i, pos - uj->job->starts[i], n, 0); /* the old values back */
            (*restored)++;
        }
        run_logged(uj, s, k, lo + at);
    }
    return 0;
}

int32_t ofl_adam_step_undo(const ofl_adam_config *cfg, const ofl_adam_tensors *t, void *undo,
                           int64_t undo_bytes, int64_t call, int32_t resume, int32_t *nonfinite_out,
                           int64_t *restored_out) {
    undo_view u;
    int32_t rc = undo_open(undo, undo_bytes, &u);
    if (rc) return rc;
    if (call < 0 || call > (int64_t)(UINT64_MAX >> 2) || (resume != 0 && resume != 1) || !t || t->count < 0 ||
        (t->count > 0 && !t->numel))
        return -EINVAL;
    int64_t total = 0;
    for (int64_t i = 0; i < t->count; i++) {
        if (t->numel[i] < 0) return -EINVAL;
        total += t->numel[i];
    }
    int64_t chunks = (total + OFL_CHUNK_ELEMS - 1) / OFL_CHUNK_ELEMS;
    if (chunks > (int64_t)u.h->map_bytes) return -E2BIG;
    uint64_t word = __atomic_load_n(&u.h->call_word, __ATOMIC_ACQUIRE);
    int64_t calls_done = (int64_t)(word >> 1);
    int in_flight = resume && (word & 1u) && calls_done == call;
    if (resume && call > calls_done) return -EINVAL; /* the calls of a pass come in order */
    if (nonfinite_out) *nonfinite_out = 0;
    if (restored_out) *restored_out = 0;
    if (resume && call < calls_done) return 0; /* done before the restart */

    ofl_adam_job job;
    rc = ofl_adam_job_init(&job, cfg, t);
    if (rc) return rc;
    undo_job *uj = calloc(1, sizeof *uj);
    if (!uj) {
        ofl_adam_job_free(&job);
        return -ENOMEM;
    }
    uj->job = &job;
    uj->u = &u;
    uj->call = call;
    uj->total = total;
#if OFL_HAVE_X86
    if (job.kernel == ofl_adam_kernel_avx512) uj->log_kernel = ofl_adam_log_kernel_avx512;
    if (job.kernel == ofl_adam_kernel_avx512bf16) uj->log_kernel = ofl_adam_log_kernel_avx512bf16;
#endif
    int32_t threads = ofl_effective_threads(cfg->num_threads, total);
    uj->threads = threads < u.slots ? threads : u.slots;
    if (!in_flight) { /* [0, call) done, none in flight; then clear the map and slots; then in flight */
        __atomic_store_n(&u.h->call_word, (uint64_t)call << 1, __ATOMIC_RELEASE);
        memset(u.map, 0, (size_t)(chunks > 0 ? chunks : 0));
        for (int32_t s = 0; s < u.slots; s++) __atomic_store_n(&slot_at(&u, s)->word, SLOT_EMPTY, __ATOMIC_RELAXED);
        __atomic_store_n(&u.h->call_word, ((uint64_t)call << 1) | 1u, __ATOMIC_RELEASE);
    } else {
        int64_t restored = 0;
        rc = finish_in_flight(uj, chunks, &restored);
        if (restored_out) *restored_out = restored;
    }
    if (!rc && total > 0) ofl_parallel_chunks(logged_chunk, uj, total, OFL_CHUNK_ELEMS, uj->threads);
    if (!rc) __atomic_store_n(&u.h->call_word, (uint64_t)(call + 1) << 1, __ATOMIC_RELEASE);
    if (nonfinite_out) *nonfinite_out = job.nonfinite;
    free(uj);
    ofl_adam_job_free(&job);
    return rc;
}
