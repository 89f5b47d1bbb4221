/* The engine: request queue, per-request completion, and the pread/pwrite thread pool.
 * The Linux AIO worker lives in aio_linux.c and shares the queue through aio_internal.h. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "aio_internal.h"

int32_t ofl_aio_abi_version(void) { return OFL_AIO_ABI_VERSION; }

int32_t ofl_aio_linux_aio_available(void) { return ofl_aio_linux_probe(); }

int32_t ofl_aio_io_uring_available(void) { return ofl_aio_uring_probe(); }

int64_t ofl_aio_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void request_unref(ofl_aio_request *r) {
    if (__atomic_sub_fetch(&r->refs, 1, __ATOMIC_ACQ_REL) == 0) {
        free(r->block_crcs);
        free(r);
    }
}

/* Under the lock, once every block is in: the request's CRC from its blocks' (see
 * ofl_aio_submit_crc). Blocks start at multiples of the block size. */
static void join_crcs(ofl_aio_engine *e, ofl_aio_request *r) {
    int64_t bs = e->config.block_size_bytes;
    uint32_t full = ofl_aio_crc32c_shift_op(bs);
    uint32_t crc = 0;
    for (int64_t i = 0, start = 0; start < r->crc_bytes; i++, start += bs) {
        int64_t len = r->crc_bytes - start < bs ? r->crc_bytes - start : bs;
        uint32_t op = len == bs ? full : ofl_aio_crc32c_shift_op(len);
        crc = i == 0 ? r->block_crcs[0] : ofl_aio_crc32c_combine_op(crc, r->block_crcs[i], op);
    }
    r->crc = crc;
}

/* Without the lock: the CRC of a block that finished (the part of it below crc_bytes). */
static void block_crc(ofl_aio_engine *e, const ofl_aio_block *blk) {
    ofl_aio_request *r = blk->req;
    if (blk->offset >= r->crc_bytes) return;
    int64_t end = blk->offset + blk->len < r->crc_bytes ? blk->offset + blk->len : r->crc_bytes;
    ofl_io_crc32c(0, (uint64_t)(uintptr_t)(r->buffer + blk->offset), end - blk->offset,
                  &r->block_crcs[blk->offset / e->config.block_size_bytes]);
}

void ofl_aio_request_release(ofl_aio_request *request) {
    if (request) request_unref(request);
}

/* Under the lock: unlink `r` from the FIFO head (it has nothing left to hand out). */
static void pop_head(ofl_aio_engine *e) {
    ofl_aio_request *r = e->head;
    e->head = r->next;
    if (!e->head) e->tail = NULL;
    r->next = NULL;
}

/* Under the lock: mark complete if nothing is pending; returns 1 if it completed now. */
static int maybe_complete(ofl_aio_engine *e, ofl_aio_request *r) {
    if (r->done || r->blocks_pending > 0 || r->cursor < r->nbytes) return 0;
    if (!r->error && r->crc_bytes > 0) join_crcs(e, r);
    r->done = 1;
    r->complete_ns = ofl_aio_now_ns();
    e->stats.requests_completed++;
    e->stats.requests_pending--;
    if (r->error) {
        e->stats.requests_failed++;
    } else if (r->op == OFL_AIO_OP_READ) {
        e->stats.bytes_read += r->bytes_done;
    } else {
        e->stats.bytes_written += r->bytes_done;
    }
    pthread_cond_broadcast(&e->done_cv);
    return 1;
}

static int32_t find_buffer(ofl_aio_engine *e, uint64_t address, int64_t nbytes);

int ofl_aio_take_block(ofl_aio_engine *e, ofl_aio_block *blk) {
    ofl_aio_request *r = e->head;
    if (!r) return 0;
    int64_t len = r->nbytes - r->cursor;
    if (len > e->config.block_size_bytes) len = e->config.block_size_bytes;
    blk->req = r;
    blk->offset = r->cursor;
    blk->len = len;
    blk->buf_index = find_buffer(e, (uint64_t)(uintptr_t)(r->buffer + r->cursor), len);
    r->cursor += len;
    r->blocks_pending++;
    e->stats.blocks_in_flight++;
    if (r->cursor >= r->nbytes) pop_head(e);
    return 1;
}

void ofl_aio_finish_block(ofl_aio_engine *e, ofl_aio_block *blk, int32_t err, int64_t moved) {
    ofl_aio_request *r = blk->req;
    int completed;
    if (!err && r->crc_bytes > 0) block_crc(e, blk);  /* on this I/O thread, before the lock */
    pthread_mutex_lock(&e->lock);
    r->blocks_pending--;
    e->stats.blocks_in_flight--;
    r->bytes_done += moved;
    if (err && !r->error) {
        r->error = err;
        if (r->cursor < r->nbytes) {  /* stop handing out its remaining blocks */
            r->cursor = r->nbytes;
            /* it is still queued: unlink it */
            ofl_aio_request **pp = &e->head, *prev = NULL;
            while (*pp && *pp != r) { prev = *pp; pp = &(*pp)->next; }
            if (*pp) {
                *pp = r->next;
                if (e->tail == r) e->tail = prev;
                r->next = NULL;
            }
        }
    }
    completed = maybe_complete(e, r);
    pthread_mutex_unlock(&e->lock);
    if (completed) request_unref(r);  /* the engine's reference */
}

/* One block with blocking pread/pwrite, continuing short transfers. */
static void transfer_block(ofl_aio_engine *e, ofl_aio_block *blk) {
    ofl_aio_request *r = blk->req;
    int64_t moved = 0;
    int32_t err = 0;
    while (moved < blk->len) {
        char *buf = r->buffer + blk->offset + moved;
        size_t want = (size_t)ofl_aio_transfer_len(e, blk->len - moved);
        off_t pos = (off_t)(r->file_offset + blk->offset + moved);
        ssize_t n = r->op == OFL_AIO_OP_READ ? pread(r->fd, buf, want, pos) : pwrite(r->fd, buf, want, pos);
        if (n < 0) {
            if (errno == EINTR) continue;
            err = errno;
            break;
        }
        if (n == 0) {
            err = r->op == OFL_AIO_OP_READ ? ENODATA : EIO;
            break;
        }
        moved += n;
        if (moved < blk->len) {
            pthread_mutex_lock(&e->lock);
            e->stats.short_transfers++;
            pthread_mutex_unlock(&e->lock);
        }
    }
    ofl_aio_finish_block(e, blk, err, moved);
}

static void *thread_worker(void *arg) {
    ofl_aio_engine *e = ((ofl_aio_worker_arg *)arg)->engine;
    for (;;) {
        ofl_aio_block blk;
        pthread_mutex_lock(&e->lock);
        while (!e->stopping && !e->head) pthread_cond_wait(&e->work_cv, &e->lock);
        if (!e->head) {  /* stopping, and nothing queued */
            pthread_mutex_unlock(&e->lock);
            return NULL;
        }
        ofl_aio_take_block(e, &blk);
        pthread_mutex_unlock(&e->lock);
        transfer_block(e, &blk);
    }
}

int32_t ofl_aio_engine_open(const ofl_aio_config *config, ofl_aio_engine **engine_out) {
    if (!config || !engine_out) return -EINVAL;
    *engine_out = NULL;
    if (config->queue_depth < 1 || config->queue_depth > OFL_AIO_MAX_QUEUE_DEPTH ||
        config->num_threads < 1 || config->num_threads > OFL_AIO_MAX_THREADS ||
        config->block_size_bytes <= 0)
        return -EINVAL;
    int32_t nworkers;
    void *(*fn)(void *);
    if (config->kind == OFL_AIO_KIND_LINUX_AIO) {
        int32_t rc = ofl_aio_linux_probe();
        if (rc) return rc;
        nworkers = config->num_threads;
        fn = ofl_aio_linux_worker;
    } else if (config->kind == OFL_AIO_KIND_IO_URING) {
        int32_t rc = ofl_aio_uring_probe();
        if (rc) return rc;
        nworkers = config->num_threads;
        fn = ofl_aio_uring_worker;
    } else if (config->kind == OFL_AIO_KIND_THREADS) {
        int64_t n = (int64_t)config->num_threads * config->queue_depth;
        nworkers = (int32_t)(n > OFL_AIO_MAX_IO_THREADS ? OFL_AIO_MAX_IO_THREADS : n);
        fn = thread_worker;
    } else {
        return -EINVAL;
    }
    ofl_aio_engine *e = calloc(1, sizeof(*e));
    if (!e) return -ENOMEM;
    e->workers = calloc((size_t)nworkers, sizeof(pthread_t));
    e->args = calloc((size_t)nworkers, sizeof(ofl_aio_worker_arg));
    if (!e->workers || !e->args) {
        free(e->workers);
        free(e->args);
        free(e);
        return -ENOMEM;
    }
    e->config = *config;
    pthread_mutex_init(&e->lock, NULL);
    pthread_cond_init(&e->work_cv, NULL);
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&e->done_cv, &attr);
    pthread_condattr_destroy(&attr);
    if (config->kind == OFL_AIO_KIND_IO_URING) {
        int32_t rc = ofl_aio_uring_open(e);
        if (rc) {
            ofl_aio_engine_close(e);
            return rc;
        }
    }
    for (int32_t i = 0; i < nworkers; i++) {
        e->args[i] = (ofl_aio_worker_arg){e, i};
        int rc = pthread_create(&e->workers[i], NULL, fn, &e->args[i]);
        if (rc) {
            e->nworkers = i;
            ofl_aio_engine_close(e);
            return -rc;
        }
    }
    e->nworkers = nworkers;
    *engine_out = e;
    return 0;
}

void ofl_aio_engine_close(ofl_aio_engine *e) {
    if (!e) return;
    ofl_aio_request *cancelled = NULL;
    pthread_mutex_lock(&e->lock);
    e->stopping = 1;
    while (e->head) {  /* requests with blocks not yet handed out */
        ofl_aio_request *r = e->head;
        pop_head(e);
        if (!r->error) r->error = ECANCELED;
        r->cursor = r->nbytes;
        if (maybe_complete(e, r)) {
            r->next = cancelled;
            cancelled = r;
        }
    }
    pthread_cond_broadcast(&e->work_cv);
    pthread_mutex_unlock(&e->lock);
    while (cancelled) {
        ofl_aio_request *r = cancelled;
        cancelled = r->next;
        r->next = NULL;
        request_unref(r);
    }
    for (int32_t i = 0; i < e->nworkers; i++) pthread_join(e->workers[i], NULL);
    ofl_aio_uring_close(e);
    pthread_cond_destroy(&e->work_cv);
    pthread_cond_destroy(&e->done_cv);
    pthread_mutex_destroy(&e->lock);
    free(e->workers);
    free(e->args);
    free(e);
}

/* Under the lock: clear every table slot of `group`; 0 or the first -errno. */
static int32_t release_group(ofl_aio_engine *e, int32_t group) {
    int32_t rc = 0;
    for (int32_t i = 0; i < OFL_AIO_MAX_BUFFERS; i++) {
        if (e->buffers[i].nbytes == 0 || e->buffers[i].group != group) continue;
        e->buffers[i].nbytes = 0;  /* no new transfer picks it; the kernel keeps in-flight pages */
        e->buffers[i].address = 0;
        int32_t err = ofl_aio_uring_update(e, i, 0, 0);
        if (!rc) rc = err;
    }
    return rc;
}

int32_t ofl_aio_register_buffer(ofl_aio_engine *e, uint64_t address, int64_t nbytes, int32_t *slot_out) {
    if (!e || !slot_out || address == 0 || nbytes <= 0) return -EINVAL;
    *slot_out = -1;
    if (e->config.kind != OFL_AIO_KIND_IO_URING || !e->fixed_buffers) return -EOPNOTSUPP;
    pthread_mutex_lock(&e->lock);
    int64_t piece = e->test_piece_bytes ? e->test_piece_bytes : OFL_AIO_BUFFER_PIECE_BYTES;
    int64_t pieces = (nbytes + piece - 1) / piece;
    int32_t free_slots = 0;
    for (int32_t i = 0; i < OFL_AIO_MAX_BUFFERS; i++) free_slots += e->buffers[i].nbytes == 0;
    if (free_slots < pieces) {
        pthread_mutex_unlock(&e->lock);
        return -ENOSPC;
    }
    int32_t group = -1, rc = 0;
    int64_t done = 0;
    for (int32_t i = 0; i < OFL_AIO_MAX_BUFFERS && done < nbytes; i++) {
        if (e->buffers[i].nbytes != 0) continue;
        int64_t len = nbytes - done < piece ? nbytes - done : piece;
        rc = ofl_aio_uring_update(e, i, address + (uint64_t)done, len);
        if (rc) break;
        if (group < 0) group = i;
        e->buffers[i] = (ofl_aio_buffer){address + (uint64_t)done, len, group};
        done += len;
    }
    if (rc && group >= 0) release_group(e, group);
    if (!rc) *slot_out = group;
    pthread_mutex_unlock(&e->lock);
    return rc;
}

int32_t ofl_aio_unregister_buffer(ofl_aio_engine *e, int32_t slot) {
    if (!e || slot < 0 || slot >= OFL_AIO_MAX_BUFFERS) return -EINVAL;
    pthread_mutex_lock(&e->lock);
    int32_t rc = -EINVAL;
    if (e->buffers[slot].nbytes != 0 && e->buffers[slot].group == slot) rc = release_group(e, slot);
    pthread_mutex_unlock(&e->lock);
    return rc;
}

/* Under the lock: the registered buffer that holds [address, address + nbytes), or -1. */
static int32_t find_buffer(ofl_aio_engine *e, uint64_t address, int64_t nbytes) {
    if (!e->fixed_buffers) return -1;
    for (int32_t i = 0; i < OFL_AIO_MAX_BUFFERS; i++) {
        const ofl_aio_buffer *b = &e->buffers[i];
        if (b->nbytes && address >= b->address && address + (uint64_t)nbytes <= b->address + (uint64_t)b->nbytes)
            return i;
    }
    return -1;
}

int32_t ofl_aio_test_cap_transfer_bytes(ofl_aio_engine *e, int64_t nbytes) {
    if (!e || nbytes < 0) return -EINVAL;
    __atomic_store_n(&e->test_cap_bytes, nbytes, __ATOMIC_RELAXED);
    return 0;
}

int32_t ofl_aio_test_buffer_piece_bytes(ofl_aio_engine *e, int64_t nbytes) {
    if (!e || nbytes < 0 || nbytes % 4096 || nbytes > OFL_AIO_BUFFER_PIECE_BYTES) return -EINVAL;
    pthread_mutex_lock(&e->lock);
    e->test_piece_bytes = nbytes;
    pthread_mutex_unlock(&e->lock);
    return 0;
}

int32_t ofl_aio_engine_stats(ofl_aio_engine *e, ofl_aio_stats *out) {
    if (!e || !out) return -EINVAL;
    pthread_mutex_lock(&e->lock);
    *out = e->stats;
    pthread_mutex_unlock(&e->lock);
    return 0;
}

int32_t ofl_aio_submit(ofl_aio_engine *e, int32_t op, int32_t fd, uint64_t buffer_address,
                       int64_t nbytes, int64_t file_offset, ofl_aio_request **request_out) {
    return ofl_aio_submit_crc(e, op, fd, buffer_address, nbytes, file_offset, -1, request_out);
}

int32_t ofl_aio_submit_crc(ofl_aio_engine *e, int32_t op, int32_t fd, uint64_t buffer_address,
                           int64_t nbytes, int64_t file_offset, int64_t crc_bytes,
                           ofl_aio_request **request_out) {
    if (!e || !request_out) return -EINVAL;
    *request_out = NULL;
    if ((op != OFL_AIO_OP_READ && op != OFL_AIO_OP_WRITE) || fd < 0 || nbytes < 0 || file_offset < 0 ||
        (buffer_address == 0 && nbytes > 0) || crc_bytes < -1 || crc_bytes > nbytes)
        return -EINVAL;
    ofl_aio_request *r = calloc(1, sizeof(*r));
    if (!r) return -ENOMEM;
    if (crc_bytes > 0) {
        int64_t blocks = (nbytes + e->config.block_size_bytes - 1) / e->config.block_size_bytes;
        r->block_crcs = calloc((size_t)blocks, sizeof(uint32_t));
        if (!r->block_crcs) {
            free(r);
            return -ENOMEM;
        }
    }
    r->refs = 2;
    r->op = op;
    r->fd = fd;
    r->buffer = (char *)(uintptr_t)buffer_address;
    r->nbytes = nbytes;
    r->file_offset = file_offset;
    r->crc_bytes = crc_bytes;
    r->submit_ns = ofl_aio_now_ns();
    pthread_mutex_lock(&e->lock);
    if (e->stopping) {
        pthread_mutex_unlock(&e->lock);
        free(r->block_crcs);
        free(r);
        return -ESHUTDOWN;
    }
    e->stats.requests_pending++;
    if (nbytes == 0) {
        maybe_complete(e, r);
        r->refs = 1;
    } else {
        if (e->tail) e->tail->next = r;
        else e->head = r;
        e->tail = r;
        pthread_cond_broadcast(&e->work_cv);
    }
    pthread_mutex_unlock(&e->lock);
    *request_out = r;
    return 0;
}

int32_t ofl_aio_wait(ofl_aio_engine *e, ofl_aio_request *r, int64_t timeout_ns) {
    if (!e || !r) return -EINVAL;
    struct timespec deadline;
    if (timeout_ns >= 0) {
        clock_gettime(CLOCK_MONOTONIC, &deadline);
        int64_t ns = deadline.tv_nsec + timeout_ns % 1000000000LL;
        deadline.tv_sec += timeout_ns / 1000000000LL + ns / 1000000000LL;
        deadline.tv_nsec = ns % 1000000000LL;
    }
    int32_t rc = 0;
    pthread_mutex_lock(&e->lock);
    while (!r->done) {
        if (timeout_ns < 0) {
            pthread_cond_wait(&e->done_cv, &e->lock);
        } else if (pthread_cond_timedwait(&e->done_cv, &e->lock, &deadline) == ETIMEDOUT) {
            rc = r->done ? 0 : -ETIMEDOUT;
            break;
        }
    }
    pthread_mutex_unlock(&e->lock);
    return rc;
}

int32_t ofl_aio_request_result(ofl_aio_engine *e, ofl_aio_request *r, ofl_aio_result *out) {
    if (!e || !r || !out) return -EINVAL;
    pthread_mutex_lock(&e->lock);
    out->done = r->done;
    out->error = r->error;
    out->bytes_done = r->bytes_done;
    out->submit_ns = r->submit_ns;
    out->complete_ns = r->complete_ns;
    out->has_crc = r->done && !r->error && r->crc_bytes >= 0;
    out->crc = r->crc;
    pthread_mutex_unlock(&e->lock);
    return 0;
}
