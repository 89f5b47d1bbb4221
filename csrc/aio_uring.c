/* The io_uring worker: one ring per submitting thread, through raw syscalls and the
 * kernel ABI of <linux/io_uring.h> (no liburing).
 *
 * The rings are made by the engine (ofl_aio_uring_open, before the workers start) so
 * that a buffer can be registered in every ring from any thread. Each ring gets a sparse
 * table of OFL_AIO_MAX_BUFFERS registered buffers; a transfer that lies wholly inside a
 * registered buffer is issued as READ_FIXED / WRITE_FIXED and its pages are not pinned
 * again per transfer.
 *
 * The worker keeps up to queue_depth blocks in flight, like the Linux AIO worker: it
 * puts an SQE per free slot, submits them and waits for at least one completion in one
 * io_uring_enter, reaps every CQE there is, continues short transfers and refills.
 * Only this thread touches its ring's SQ and CQ, so the ring needs release stores on the
 * tails and heads it publishes and acquire loads on the ones the kernel publishes. */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/io_uring.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include "aio_internal.h"

struct ofl_aio_uring {
    int fd;
    unsigned *sq_tail, *sq_mask, *sq_array;
    unsigned *cq_head, *cq_tail, *cq_mask;
    struct io_uring_cqe *cqes;
    struct io_uring_sqe *sqes;
    void *ring_ptr;
    size_t ring_len;
    size_t sqes_len;
};

static int sys_setup(unsigned entries, struct io_uring_params *p) {
    return (int)syscall(__NR_io_uring_setup, entries, p);
}
static int sys_enter(int fd, unsigned submit, unsigned min_complete, unsigned flags) {
    return (int)syscall(__NR_io_uring_enter, fd, submit, min_complete, flags, NULL, 0);
}
static int sys_register(int fd, unsigned op, void *arg, unsigned nr) {
    return (int)syscall(__NR_io_uring_register, fd, op, arg, nr);
}

static void ring_close(struct ofl_aio_uring *r) {
    if (r->sqes && r->sqes != MAP_FAILED) munmap(r->sqes, r->sqes_len);
    if (r->ring_ptr && r->ring_ptr != MAP_FAILED) munmap(r->ring_ptr, r->ring_len);
    if (r->fd >= 0) close(r->fd);
    memset(r, 0, sizeof(*r));
    r->fd = -1;
}

static int32_t ring_open(struct ofl_aio_uring *r, unsigned entries) {
    struct io_uring_params p;
    memset(&p, 0, sizeof(p));
    memset(r, 0, sizeof(*r));
    r->fd = sys_setup(entries, &p);
    if (r->fd < 0) {
        r->fd = -1;
        return -errno;
    }
    if (!(p.features & IORING_FEAT_SINGLE_MMAP)) {  /* kernels before 5.4: not supported here */
        ring_close(r);
        return -EOPNOTSUPP;
    }
    size_t sq_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    size_t cq_len = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    r->ring_len = sq_len > cq_len ? sq_len : cq_len;
    r->ring_ptr = mmap(NULL, r->ring_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd,
                       IORING_OFF_SQ_RING);
    r->sqes_len = p.sq_entries * sizeof(struct io_uring_sqe);
    r->sqes = mmap(NULL, r->sqes_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_SQES);
    if (r->ring_ptr == MAP_FAILED || r->sqes == MAP_FAILED) {
        int32_t err = -errno;
        ring_close(r);
        return err;
    }
    char *base = r->ring_ptr;
    r->sq_tail = (unsigned *)(base + p.sq_off.tail);
    r->sq_mask = (unsigned *)(base + p.sq_off.ring_mask);
    r->sq_array = (unsigned *)(base + p.sq_off.array);
    r->cq_head = (unsigned *)(base + p.cq_off.head);
    r->cq_tail = (unsigned *)(base + p.cq_off.tail);
    r->cq_mask = (unsigned *)(base + p.cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)(base + p.cq_off.cqes);
    return 0;
}

int32_t ofl_aio_uring_probe(void) {
    struct ofl_aio_uring r;
    int32_t rc = ring_open(&r, 1);
    if (rc == 0) ring_close(&r);
    return rc;
}

int32_t ofl_aio_uring_open(ofl_aio_engine *e) {
    int32_t n = e->config.num_threads;
    e->rings = calloc((size_t)n, sizeof(struct ofl_aio_uring));
    if (!e->rings) return -ENOMEM;
    for (int32_t i = 0; i < n; i++) e->rings[i].fd = -1;
    for (int32_t i = 0; i < n; i++) {
        int32_t rc = ring_open(&e->rings[i], (unsigned)e->config.queue_depth);
        if (rc) return rc;  /* the caller closes the engine, which closes the rings made so far */
    }
    /* A sparse registered-buffer table per ring (Linux 5.19+); without it, plain READ/WRITE. */
    e->fixed_buffers = 1;
    for (int32_t i = 0; i < n; i++) {
        struct io_uring_rsrc_register reg;
        memset(&reg, 0, sizeof(reg));
        reg.nr = OFL_AIO_MAX_BUFFERS;
        reg.flags = IORING_RSRC_REGISTER_SPARSE;
        if (sys_register(e->rings[i].fd, IORING_REGISTER_BUFFERS2, &reg, sizeof(reg)) < 0) e->fixed_buffers = 0;
    }
    return 0;
}

void ofl_aio_uring_close(ofl_aio_engine *e) {
    if (!e->rings) return;
    for (int32_t i = 0; i < e->config.num_threads; i++) ring_close(&e->rings[i]);
    free(e->rings);
    e->rings = NULL;
}

int32_t ofl_aio_uring_update(ofl_aio_engine *e, int32_t slot, uint64_t address, int64_t nbytes) {
    struct iovec iov = {(void *)(uintptr_t)address, (size_t)nbytes};
    for (int32_t i = 0; i < e->config.num_threads; i++) {
        struct io_uring_rsrc_update2 up;
        memset(&up, 0, sizeof(up));
        up.offset = (unsigned)slot;
        up.data = (uint64_t)(uintptr_t)&iov;
        up.nr = 1;
        if (sys_register(e->rings[i].fd, IORING_REGISTER_BUFFERS_UPDATE, &up, sizeof(up)) < 0) {
            int32_t err = -errno;
            struct iovec none = {NULL, 0};
            up.data = (uint64_t)(uintptr_t)&none;
            for (int32_t k = 0; k < i; k++) sys_register(e->rings[k].fd, IORING_REGISTER_BUFFERS_UPDATE, &up, sizeof(up));
            return err;
        }
    }
    return 0;
}

enum { SLOT_FREE = 0, SLOT_READY = 1, SLOT_IN_FLIGHT = 2 };

typedef struct {
    ofl_aio_block blk;
    int64_t moved;
    int state;
} slot;

/* Put one SQE for slot `s` on the ring (there is always room: at most queue_depth slots). */
static void queue_sqe(ofl_aio_engine *e, struct ofl_aio_uring *r, slot *s) {
    ofl_aio_request *q = s->blk.req;
    unsigned tail = *r->sq_tail;
    unsigned idx = tail & *r->sq_mask;
    struct io_uring_sqe *sqe = &r->sqes[idx];
    memset(sqe, 0, sizeof(*sqe));
    int fixed = s->blk.buf_index >= 0;
    if (q->op == OFL_AIO_OP_READ) sqe->opcode = fixed ? IORING_OP_READ_FIXED : IORING_OP_READ;
    else sqe->opcode = fixed ? IORING_OP_WRITE_FIXED : IORING_OP_WRITE;
    sqe->fd = q->fd;
    sqe->addr = (uint64_t)(uintptr_t)(q->buffer + s->blk.offset + s->moved);
    sqe->len = (uint32_t)ofl_aio_transfer_len(e, s->blk.len - s->moved);
    sqe->off = (uint64_t)(q->file_offset + s->blk.offset + s->moved);
    if (fixed) {
        sqe->buf_index = (uint16_t)s->blk.buf_index;
        __atomic_add_fetch(&e->stats.blocks_registered, 1, __ATOMIC_RELAXED);
    }
    sqe->user_data = (uint64_t)(uintptr_t)s;
    r->sq_array[idx] = idx;
    __atomic_store_n(r->sq_tail, tail + 1, __ATOMIC_RELEASE);
    s->state = SLOT_IN_FLIGHT;
}

void *ofl_aio_uring_worker(void *arg) {
    ofl_aio_worker_arg *wa = (ofl_aio_worker_arg *)arg;
    ofl_aio_engine *e = wa->engine;
    struct ofl_aio_uring *r = &e->rings[wa->index];
    int32_t qd = e->config.queue_depth;
    slot *slots = calloc((size_t)qd, sizeof(slot));
    int64_t used = 0;     /* slots not free */
    unsigned unsubmitted = 0;  /* SQEs on the ring the kernel has not taken yet */

    for (;;) {
        pthread_mutex_lock(&e->lock);
        while (!e->stopping && used == 0 && !e->head) pthread_cond_wait(&e->work_cv, &e->lock);
        if (used == 0 && !e->head) {
            pthread_mutex_unlock(&e->lock);
            break;
        }
        if (!slots) {  /* no memory for slots: fail what we take, one block at a time */
            ofl_aio_block blk;
            int got = ofl_aio_take_block(e, &blk);
            pthread_mutex_unlock(&e->lock);
            if (got) ofl_aio_finish_block(e, &blk, ENOMEM, 0);
            continue;
        }
        for (int32_t i = 0; i < qd && e->head; i++) {
            if (slots[i].state != SLOT_FREE) continue;
            ofl_aio_take_block(e, &slots[i].blk);
            slots[i].moved = 0;
            slots[i].state = SLOT_READY;
            used++;
        }
        pthread_mutex_unlock(&e->lock);

        for (int32_t i = 0; i < qd; i++) {
            if (slots[i].state == SLOT_READY) {
                queue_sqe(e, r, &slots[i]);
                unsubmitted++;
            }
        }
        int rc = sys_enter(r->fd, unsubmitted, 1, IORING_ENTER_GETEVENTS);
        if (rc < 0) {
            if (errno != EINTR && errno != EAGAIN && errno != EBUSY) {
                /* the ring itself is broken: nothing more will complete; fail what is ours */
                int32_t err = errno;
                for (int32_t i = 0; i < qd; i++) {
                    if (slots[i].state != SLOT_FREE) {
                        slots[i].state = SLOT_FREE;
                        ofl_aio_finish_block(e, &slots[i].blk, err, slots[i].moved);
                    }
                }
                used = 0;
                unsubmitted = 0;
            }
        } else {
            unsubmitted -= (unsigned)rc < unsubmitted ? (unsigned)rc : unsubmitted;
        }

        unsigned head = *r->cq_head;
        unsigned tail = __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE);
        while (head != tail) {
            struct io_uring_cqe *cqe = &r->cqes[head & *r->cq_mask];
            slot *s = (slot *)(uintptr_t)cqe->user_data;
            int64_t res = cqe->res;
            head++;
            if (res < 0 || (res == 0 && s->blk.len > s->moved)) {
                int32_t err = res < 0 ? (int32_t)-res : (s->blk.req->op == OFL_AIO_OP_READ ? ENODATA : EIO);
                s->state = SLOT_FREE;
                used--;
                ofl_aio_finish_block(e, &s->blk, err, s->moved);
                continue;
            }
            s->moved += res;
            if (s->moved >= s->blk.len) {
                s->state = SLOT_FREE;
                used--;
                ofl_aio_finish_block(e, &s->blk, 0, s->moved);
            } else {
                pthread_mutex_lock(&e->lock);
                e->stats.short_transfers++;
                pthread_mutex_unlock(&e->lock);
                s->state = SLOT_READY;  /* the rest goes out with the next submit */
            }
        }
        __atomic_store_n(r->cq_head, head, __ATOMIC_RELEASE);
    }
    free(slots);
    return NULL;
}
