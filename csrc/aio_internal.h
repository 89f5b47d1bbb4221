/* Shared between aio.c (the request queue, the thread-pool worker) and aio_linux.c
 * (the Linux AIO worker). Not part of the cffi interface. */
#ifndef OFL_AIO_INTERNAL_H
#define OFL_AIO_INTERNAL_H

#include <pthread.h>
#include <stdint.h>

#include "ofl_aio.h"

struct ofl_aio_request {
    int32_t refs;            /* atomic: the caller's reference + the engine's until done */
    int32_t op;
    int32_t fd;
    int32_t error;           /* first error, positive errno; under the engine lock */
    char *buffer;
    int64_t nbytes;
    int64_t file_offset;
    int64_t cursor;          /* next byte to hand out; == nbytes once all handed out */
    int64_t blocks_pending;  /* handed out, not yet finished */
    int64_t bytes_done;
    int64_t submit_ns;
    int64_t complete_ns;
    int32_t done;
    int64_t crc_bytes;       /* CRC-32C of the first crc_bytes bytes wanted; -1: none */
    uint32_t *block_crcs;    /* crc_bytes >= 0: one per block, written by the thread that finished it */
    uint32_t crc;            /* the whole CRC, joined from block_crcs when the request completes */
    struct ofl_aio_request *next;  /* FIFO link while queued */
};

/* One piece of a request: the worker transfers `len` bytes at `offset` within the request. */
typedef struct {
    ofl_aio_request *req;
    int64_t offset;
    int64_t len;
    int32_t buf_index;  /* io_uring: registered buffer holding this block, or -1 */
} ofl_aio_block;

/* What a worker thread is started with. */
typedef struct {
    struct ofl_aio_engine *engine;
    int32_t index;
} ofl_aio_worker_arg;

typedef struct {
    uint64_t address;
    int64_t nbytes;  /* 0: slot free */
    int32_t group;   /* the slot ofl_aio_register_buffer returned for the range this piece is of */
} ofl_aio_buffer;

struct ofl_aio_uring;  /* aio_uring.c: one ring per submitting thread */

struct ofl_aio_engine {
    ofl_aio_config config;
    pthread_mutex_t lock;
    pthread_cond_t work_cv;   /* a block is available, or the engine is stopping */
    pthread_cond_t done_cv;   /* some request completed */
    ofl_aio_request *head;    /* requests with blocks still to hand out */
    ofl_aio_request *tail;
    int32_t stopping;
    int32_t nworkers;
    pthread_t *workers;
    ofl_aio_worker_arg *args;
    ofl_aio_stats stats;
    struct ofl_aio_uring *rings;   /* io_uring engines only: config.num_threads rings */
    int32_t fixed_buffers;         /* 1 if the rings have a (sparse) registered buffer table */
    ofl_aio_buffer buffers[OFL_AIO_MAX_BUFFERS];
    int64_t test_cap_bytes;        /* atomic; tests only: most bytes per read/write, 0 = no cap */
    int64_t test_piece_bytes;      /* under the lock; tests only: registered piece size, 0 = default */
};

/* Bytes one read/write of `want` asks for: `want`, or less under a test cap
 * (ofl_aio_test_cap_transfer_bytes). Every kind of engine sizes its transfers here. */
static inline int64_t ofl_aio_transfer_len(ofl_aio_engine *e, int64_t want) {
    int64_t cap = __atomic_load_n(&e->test_cap_bytes, __ATOMIC_RELAXED);
    return cap > 0 && want > cap ? cap : want;
}

int64_t ofl_aio_now_ns(void);

/* Under the engine lock: hand out the next block, or return 0 if none is queued. */
int ofl_aio_take_block(ofl_aio_engine *e, ofl_aio_block *blk);

/* Without the lock: record that `blk` finished with `err` (0 or positive errno) after
 * `len` bytes were transferred in total for it; completes the request when it was the last. */
void ofl_aio_finish_block(ofl_aio_engine *e, ofl_aio_block *blk, int32_t err, int64_t moved);

/* The Linux AIO worker loop (aio_linux.c); arg is an ofl_aio_worker_arg. */
void *ofl_aio_linux_worker(void *arg);

/* 0 if io_setup works here, else -errno (aio_linux.c). */
int32_t ofl_aio_linux_probe(void);

/* io_uring (aio_uring.c): probe; create / destroy the engine's rings (before the workers
 * start, after they stop); the worker loop (arg is an ofl_aio_worker_arg); and setting
 * slot `slot` of every ring's registered buffer table (nbytes 0 clears it). */
int32_t ofl_aio_uring_probe(void);
int32_t ofl_aio_uring_open(ofl_aio_engine *e);
void ofl_aio_uring_close(ofl_aio_engine *e);
void *ofl_aio_uring_worker(void *arg);
int32_t ofl_aio_uring_update(ofl_aio_engine *e, int32_t slot, uint64_t address, int64_t nbytes);

/* crc32c.c ([Note: CRC lanes and combining]): the operator that appends `len2` bytes,
 * and the CRC of A || B from crc(A), crc(B) and that operator for |B| (finished CRCs,
 * as ofl_io_crc32c returns them). */
uint32_t ofl_aio_crc32c_shift_op(int64_t len2);
uint32_t ofl_aio_crc32c_combine_op(uint32_t crc1, uint32_t crc2, uint32_t op);

#endif /* OFL_AIO_INTERNAL_H */
