/* The Linux AIO worker: one AIO context per submitting thread, through raw syscalls and
 * the kernel ABI of <linux/aio_abi.h> (no libaio, no libaio headers).
 *
 * Each worker keeps up to queue_depth blocks in flight: it takes blocks from the shared
 * FIFO while it has free slots, submits them in one io_submit, then reaps at least one
 * completion with io_getevents and refills. A short completion is resubmitted for the
 * rest; a read that returns 0 bytes before the end fails with ENODATA. */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/aio_abi.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "aio_internal.h"

static long sys_io_setup(unsigned nr, aio_context_t *ctx) { return syscall(SYS_io_setup, nr, ctx); }
static long sys_io_destroy(aio_context_t ctx) { return syscall(SYS_io_destroy, ctx); }
static long sys_io_submit(aio_context_t ctx, long n, struct iocb **iocbs) {
    return syscall(SYS_io_submit, ctx, n, iocbs);
}
static long sys_io_getevents(aio_context_t ctx, long min_nr, long nr, struct io_event *events) {
    return syscall(SYS_io_getevents, ctx, min_nr, nr, events, NULL);
}

int32_t ofl_aio_linux_probe(void) {
    aio_context_t ctx = 0;
    if (sys_io_setup(1, &ctx) < 0) return -errno;
    sys_io_destroy(ctx);
    return 0;
}

enum { SLOT_FREE = 0, SLOT_READY = 1, SLOT_IN_FLIGHT = 2 };

typedef struct {
    struct iocb cb;
    ofl_aio_block blk;
    int64_t moved;  /* bytes of the block already transferred (after short completions) */
    int state;
} slot;

static void prep(ofl_aio_engine *e, slot *s) {
    ofl_aio_request *r = s->blk.req;
    memset(&s->cb, 0, sizeof(s->cb));
    s->cb.aio_data = (uint64_t)(uintptr_t)s;
    s->cb.aio_lio_opcode = r->op == OFL_AIO_OP_READ ? IOCB_CMD_PREAD : IOCB_CMD_PWRITE;
    s->cb.aio_fildes = (uint32_t)r->fd;
    s->cb.aio_buf = (uint64_t)(uintptr_t)(r->buffer + s->blk.offset + s->moved);
    s->cb.aio_nbytes = (uint64_t)ofl_aio_transfer_len(e, s->blk.len - s->moved);
    s->cb.aio_offset = r->file_offset + s->blk.offset + s->moved;
    s->state = SLOT_READY;
}

static void finish(ofl_aio_engine *e, slot *s, int32_t err) {
    s->state = SLOT_FREE;
    ofl_aio_finish_block(e, &s->blk, err, s->moved);
}

/* Handle one completion: done, continue a short transfer, or fail. */
static void complete(ofl_aio_engine *e, slot *s, int64_t res, int64_t *inflight) {
    (*inflight)--;
    if (res < 0) {
        finish(e, s, (int32_t)-res);
        return;
    }
    if (res == 0) {
        finish(e, s, s->blk.req->op == OFL_AIO_OP_READ ? ENODATA : EIO);
        return;
    }
    s->moved += res;
    if (s->moved >= s->blk.len) {
        finish(e, s, 0);
        return;
    }
    pthread_mutex_lock(&e->lock);
    e->stats.short_transfers++;
    pthread_mutex_unlock(&e->lock);
    prep(e, s);
}

void *ofl_aio_linux_worker(void *arg) {
    ofl_aio_engine *e = ((ofl_aio_worker_arg *)arg)->engine;
    int32_t qd = e->config.queue_depth;
    aio_context_t ctx = 0;
    slot *slots = calloc((size_t)qd, sizeof(slot));
    struct iocb **batch = calloc((size_t)qd, sizeof(struct iocb *));
    struct io_event *events = calloc((size_t)qd, sizeof(struct io_event));
    int32_t setup_err = 0;
    if (!slots || !batch || !events) setup_err = ENOMEM;
    else if (sys_io_setup((unsigned)qd, &ctx) < 0) setup_err = errno;
    int64_t inflight = 0;  /* slots handed to the kernel */
    int64_t used = 0;      /* slots not free */

    for (;;) {
        pthread_mutex_lock(&e->lock);
        while (!e->stopping && used == 0 && !e->head) pthread_cond_wait(&e->work_cv, &e->lock);
        if (used == 0 && !e->head) {  /* stopping and idle */
            pthread_mutex_unlock(&e->lock);
            break;
        }
        for (int32_t i = 0; i < qd && e->head; i++) {
            if (slots == NULL || setup_err) break;
            if (slots[i].state != SLOT_FREE) continue;
            ofl_aio_take_block(e, &slots[i].blk);
            slots[i].moved = 0;
            used++;
            prep(e, &slots[i]);
        }
        if (setup_err && e->head) {  /* no context: fail what we take, one block at a time */
            ofl_aio_block blk;
            ofl_aio_take_block(e, &blk);
            pthread_mutex_unlock(&e->lock);
            ofl_aio_finish_block(e, &blk, setup_err, 0);
            continue;
        }
        pthread_mutex_unlock(&e->lock);

        long n = 0;
        for (int32_t i = 0; i < qd; i++)
            if (slots[i].state == SLOT_READY) batch[n++] = &slots[i].cb;
        long off = 0;
        while (off < n) {
            long rc = sys_io_submit(ctx, n - off, batch + off);
            if (rc > 0) {
                for (long k = off; k < off + rc; k++) ((slot *)(uintptr_t)batch[k]->aio_data)->state = SLOT_IN_FLIGHT;
                inflight += rc;
                off += rc;
                continue;
            }
            int err = rc < 0 ? errno : EAGAIN;
            if (err == EINTR) continue;
            if (err == EAGAIN && inflight > 0) break;  /* retry after reaping */
            if (err == EAGAIN) {
                struct timespec pause = {0, 100000};
                nanosleep(&pause, NULL);
                continue;
            }
            /* this iocb is refused (EINVAL, EBADF, ...): fail its block, try the rest */
            slot *s = (slot *)(uintptr_t)batch[off]->aio_data;
            used--;
            finish(e, s, err);
            off++;
        }
        if (inflight == 0) continue;
        long got = sys_io_getevents(ctx, 1, qd, events);
        if (got < 0) {
            if (errno == EINTR) continue;
            got = 0;  /* should not happen with a valid context; loop and retry */
        }
        for (long k = 0; k < got; k++) {
            slot *s = (slot *)(uintptr_t)events[k].data;
            complete(e, s, (int64_t)events[k].res, &inflight);
            if (s->state == SLOT_FREE) used--;
        }
    }
    if (ctx) sys_io_destroy(ctx);
    free(slots);
    free(batch);
    free(events);
    return NULL;
}
