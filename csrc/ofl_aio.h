/* Async direct I/O engine: Linux AIO through raw syscalls, or a pread/pwrite thread pool.
 *
 * This header is the declaration source for both the C and cffi's cdef (the build
 * script strips the preprocessor lines and keeps the integer #defines). Every
 * function returns 0 or -errno and never exits.
 *
 * An engine owns a FIFO of requests and its worker threads. A request (one read or
 * write of `nbytes` at `file_offset` of an open fd, to or from a caller's buffer) is
 * split into blocks of at most `block_size_bytes`; workers take blocks in order, so
 * the blocks of one large request run in parallel across workers.
 *
 * Kinds of engine:
 * - OFL_AIO_KIND_LINUX_AIO: `num_threads` submitting threads, each with its own AIO
 *   context (io_setup) keeping up to `queue_depth` blocks in flight (io_submit /
 *   io_getevents). The kernel ABI from <linux/aio_abi.h> is used directly, so neither
 *   libaio nor its headers are needed.
 * - OFL_AIO_KIND_IO_URING: `num_threads` submitting threads, each with its own io_uring
 *   (io_uring_setup / io_uring_enter through raw syscalls, no liburing) keeping up to
 *   `queue_depth` blocks in flight. Buffers registered with ofl_aio_register_buffer are
 *   pinned once and used with READ_FIXED / WRITE_FIXED, which saves pinning the pages
 *   of every transfer again (the reason this engine exists: see the swap bench).
 * - OFL_AIO_KIND_THREADS: `num_threads * queue_depth` threads (at most
 *   OFL_AIO_MAX_IO_THREADS), each doing blocking pread/pwrite of one block at a time.
 *
 * A short transfer is continued from where it stopped; a read that reaches end of
 * file before `nbytes` fails the request with -ENODATA, a write that makes no
 * progress with -EIO. Nothing short is accepted silently. (Tests make every transfer
 * short with ofl_aio_test_cap_transfer_bytes, on every kind of engine.)
 *
 * Requests are reference counted: the caller's reference is dropped with
 * ofl_aio_request_release (Python does it through ffi.gc); the engine holds its own
 * reference until the request completes, so releasing an unfinished request is safe.
 * The caller's buffer must stay valid until the request is done.
 */
#ifndef OFL_AIO_H
#define OFL_AIO_H

#include <stdint.h>

#define OFL_AIO_ABI_VERSION 4

#define OFL_AIO_KIND_LINUX_AIO 1
#define OFL_AIO_KIND_THREADS 2
#define OFL_AIO_KIND_IO_URING 3

#define OFL_AIO_OP_READ 0
#define OFL_AIO_OP_WRITE 1

#define OFL_AIO_MAX_THREADS 64
#define OFL_AIO_MAX_QUEUE_DEPTH 1024
#define OFL_AIO_MAX_IO_THREADS 256
#define OFL_AIO_MAX_BUFFERS 64
#define OFL_AIO_BUFFER_PIECE_BYTES 1073741824

typedef struct ofl_aio_engine ofl_aio_engine;
typedef struct ofl_aio_request ofl_aio_request;

typedef struct {
    int32_t kind;             /* OFL_AIO_KIND_* */
    int32_t queue_depth;      /* blocks in flight per submitting thread, 1..OFL_AIO_MAX_QUEUE_DEPTH */
    int32_t num_threads;      /* submitting threads, 1..OFL_AIO_MAX_THREADS */
    int32_t reserved;         /* 0 */
    int64_t block_size_bytes; /* largest single transfer, > 0 */
} ofl_aio_config;

typedef struct {
    int64_t bytes_read;          /* completed, successfully */
    int64_t bytes_written;
    int64_t requests_completed;  /* successful or not */
    int64_t requests_failed;
    int64_t requests_pending;    /* submitted and not yet complete */
    int64_t blocks_in_flight;    /* handed to the kernel or to an I/O thread now */
    int64_t short_transfers;     /* short transfers that were continued */
    int64_t blocks_registered;   /* io_uring: blocks issued from a registered buffer (READ/WRITE_FIXED) */
} ofl_aio_stats;

typedef struct {
    int32_t done;          /* 1 once complete */
    int32_t error;         /* 0, or a positive errno */
    int64_t bytes_done;    /* bytes transferred; == nbytes when error is 0 */
    int64_t submit_ns;     /* CLOCK_MONOTONIC at submit */
    int64_t complete_ns;   /* CLOCK_MONOTONIC at completion, 0 until done */
    int32_t has_crc;       /* 1 if the request asked for a CRC and completed without error */
    uint32_t crc;          /* then: CRC-32C of its first crc_bytes bytes (ofl_aio_submit_crc) */
} ofl_aio_result;

int32_t ofl_aio_abi_version(void);

/* 0 if this kernel lets the process create an AIO context, else the -errno of io_setup. */
int32_t ofl_aio_linux_aio_available(void);

/* -EINVAL: bad config; -ENOSYS / -EPERM / -EAGAIN: Linux AIO refused (kind LINUX_AIO);
 * -ENOMEM; or the -errno of pthread_create. */
int32_t ofl_aio_engine_open(const ofl_aio_config *config, ofl_aio_engine **engine_out);

/* Fails queued requests that no worker has started with -ECANCELED, waits for the
 * blocks in flight, joins the workers and frees the engine. NULL is ignored. */
void ofl_aio_engine_close(ofl_aio_engine *engine);

int32_t ofl_aio_engine_stats(ofl_aio_engine *engine, ofl_aio_stats *stats_out);

/* Queue one transfer; returns at once with a new request (the caller's reference).
 * -EINVAL: bad op, fd, nbytes < 0, offset < 0 or NULL buffer with nbytes > 0;
 * -ESHUTDOWN: the engine is closing; -ENOMEM. A request of 0 bytes completes at once. */
int32_t ofl_aio_submit(ofl_aio_engine *engine, int32_t op, int32_t fd, uint64_t buffer_address,
                       int64_t nbytes, int64_t file_offset, ofl_aio_request **request_out);

/* The same, and the CRC-32C of the first `crc_bytes` bytes (0 <= crc_bytes <= nbytes) of the
 * buffer once the transfer is done (after a read: of what was read), computed by the
 * engine's own threads: each block's as it completes, joined when the last one does, so
 * the thread that waits finds it ready (ofl_aio_result.crc). -1: no CRC (ofl_aio_submit). */
int32_t ofl_aio_submit_crc(ofl_aio_engine *engine, int32_t op, int32_t fd, uint64_t buffer_address,
                           int64_t nbytes, int64_t file_offset, int64_t crc_bytes,
                           ofl_aio_request **request_out);

/* io_uring engines: register [address, address + nbytes) so that transfers use the pinned
 * pages; *slot_out receives its slot for unregistering. The kernel takes at most 1 GiB
 * per buffer, so a larger range is registered as consecutive pieces of at most
 * OFL_AIO_BUFFER_PIECE_BYTES, one table slot each (all released by unregistering the
 * returned slot); each block of a transfer uses the piece that holds it (a block across
 * two pieces goes unregistered). -EOPNOTSUPP: not an io_uring engine, or this kernel has
 * no sparse buffer tables; -ENOSPC: not enough free slots of OFL_AIO_MAX_BUFFERS;
 * -ENOMEM: the memlock limit refuses the pinning; -EINVAL / -EFAULT: a bad range. */
int32_t ofl_aio_register_buffer(ofl_aio_engine *engine, uint64_t address, int64_t nbytes, int32_t *slot_out);

/* Forget a registered buffer; transfers already in flight keep their pages pinned
 * until they finish. */
int32_t ofl_aio_unregister_buffer(ofl_aio_engine *engine, int32_t slot);

/* 0 if this process may create an io_uring, else the -errno of io_uring_setup. */
int32_t ofl_aio_io_uring_available(void);

/* Block until this request is complete, or timeout_ns elapse (< 0: no limit).
 * 0: complete (see ofl_aio_request_result); -ETIMEDOUT: not yet. */
int32_t ofl_aio_wait(ofl_aio_engine *engine, ofl_aio_request *request, int64_t timeout_ns);

int32_t ofl_aio_request_result(ofl_aio_engine *engine, ofl_aio_request *request,
                               ofl_aio_result *result_out);

/* Drop the caller's reference. NULL is ignored. */
void ofl_aio_request_release(ofl_aio_request *request);

/* TEST ONLY. Ask for at most `nbytes` in each pread/pwrite (threads), iocb (Linux AIO)
 * or SQE (io_uring) of this engine from now on, so that every block larger than that
 * moves as a run of short transfers the engine must continue, each of which succeeds.
 * 0 (the default) removes the cap. With O_DIRECT, `nbytes` must be a multiple of the
 * device's logical block size. Unset, it costs one load per transfer.
 * -EINVAL: NULL engine or nbytes < 0. */
int32_t ofl_aio_test_cap_transfer_bytes(ofl_aio_engine *engine, int64_t nbytes);

/* TEST ONLY. Register buffers in pieces of at most `nbytes` (a multiple of 4096) instead
 * of OFL_AIO_BUFFER_PIECE_BYTES from now on, so that tests see a buffer cut into pieces
 * without pinning gigabytes; 0 restores the default. -EINVAL: NULL engine or bad size. */
int32_t ofl_aio_test_buffer_piece_bytes(ofl_aio_engine *engine, int64_t nbytes);

/* CRC-32C (Castagnoli) of `nbytes` at `address`, continuing from `crc` (0 to start).
 * Uses SSE4.2 when the CPU has it. */
int32_t ofl_io_crc32c(uint32_t crc, uint64_t address, int64_t nbytes, uint32_t *crc_out);

/* 1 if ofl_io_crc32c uses the SSE4.2 instruction here, else 0 (table). */
int32_t ofl_io_crc32c_hw(void);

/* TEST ONLY. 1: ofl_io_crc32c uses the byte table (the path of CPUs without SSE4.2)
 * even where the CPU has SSE4.2, in the whole process, until called with 0. Returns
 * the previous setting. Unset, it costs one load per call. */
int32_t ofl_io_crc32c_test_force_table(int32_t on);

#endif /* OFL_AIO_H */
