/* CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), as used by iSCSI, ext4 and
 * RocksDB. The SSE4.2 crc32 instruction when the CPU has it; a byte table otherwise,
 * or when a test forces it (ofl_io_crc32c_test_force_table), since on the x86 machines
 * that run the tests the table would otherwise never run.
 *
 * [Note: CRC lanes and combining]
 * The crc32 instruction has a latency of three cycles and a throughput of one, so one
 * dependency chain runs at a third of its speed. A long buffer is cut into three lanes
 * of equal length whose CRCs run interleaved, then joined: the register is linear over
 * GF(2), so crc(A || B) = crc(A) * x^(8 |B|) mod P  xor  crc(B) (raw registers; with the
 * usual pre/post inversion the inversions cancel and the same holds for finished CRCs).
 * The multiplication mod P is done bit by bit (multmodp), and x^(8n) from a table of
 * x^(2^k) by squaring, as zlib's crc32_combine does. The engine uses the same joining
 * to CRC a request block by block as blocks complete (ofl_aio_crc32c_combine). */
#include <errno.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "ofl_aio.h"

#define POLY 0x82F63B78u

static uint32_t table[256];
static pthread_once_t table_once = PTHREAD_ONCE_INIT;
static int32_t force_table;  /* atomic; tests only */

static void build_table(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ POLY : c >> 1;
        table[i] = c;
    }
}

static uint32_t crc_table(uint32_t crc, const unsigned char *p, size_t n) {
    pthread_once(&table_once, build_table);
    while (n--) crc = table[(crc ^ *p++) & 0xff] ^ (crc >> 8);
    return crc;
}

/* a * b mod P, both reflected (x^0 is the top bit). */
static uint32_t multmodp(uint32_t a, uint32_t b) {
    uint32_t m = 1u << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0) break;
        }
        m >>= 1;
        b = b & 1 ? (b >> 1) ^ POLY : b >> 1;
    }
    return p;
}

static uint32_t x2n_table[32]; /* x^(2^k) mod P */
static pthread_once_t x2n_once = PTHREAD_ONCE_INIT;

static void build_x2n(void) {
    uint32_t p = 1u << 30; /* x^1 */
    x2n_table[0] = p;
    for (int k = 1; k < 32; k++) x2n_table[k] = p = multmodp(p, p);
}

/* x^(8 n) mod P. */
static uint32_t x8nmodp(uint64_t n) {
    pthread_once(&x2n_once, build_x2n);
    uint32_t p = 1u << 31; /* x^0 */
    int k = 3;
    while (n) {
        if (n & 1) p = multmodp(x2n_table[k & 31], p);
        n >>= 1;
        k++;
    }
    return p;
}

uint32_t ofl_aio_crc32c_shift_op(int64_t len2) { return x8nmodp((uint64_t)len2); }

uint32_t ofl_aio_crc32c_combine_op(uint32_t crc1, uint32_t crc2, uint32_t op) {
    return multmodp(op, crc1) ^ crc2;
}

#if defined(__x86_64__)
/* Below this many bytes one chain is as fast as three plus their joining. */
#define LANES_MIN_BYTES 1536

__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t crc, const unsigned char *p, size_t n) {
    uint64_t c = crc;
    if (n >= LANES_MIN_BYTES) { /* [Note: CRC lanes and combining] */
        while ((uintptr_t)p & 7) {
            c = __builtin_ia32_crc32qi((uint32_t)c, *p++);
            n--;
        }
        size_t lane = (n / 3) & ~(size_t)7;
        const unsigned char *q = p + lane, *r = p + 2 * lane;
        uint64_t c1 = 0, c2 = 0;
        for (size_t i = 0; i < lane; i += 8) {
            uint64_t a, b, d;
            memcpy(&a, p + i, 8);
            memcpy(&b, q + i, 8);
            memcpy(&d, r + i, 8);
            c = __builtin_ia32_crc32di(c, a);
            c1 = __builtin_ia32_crc32di(c1, b);
            c2 = __builtin_ia32_crc32di(c2, d);
        }
        uint32_t shift = x8nmodp(lane);
        c = multmodp(shift, (uint32_t)c) ^ (uint32_t)c1;
        c = multmodp(shift, (uint32_t)c) ^ (uint32_t)c2;
        p += 3 * lane;
        n -= 3 * lane;
    }
    while (n && ((uintptr_t)p & 7)) {
        c = __builtin_ia32_crc32qi((uint32_t)c, *p++);
        n--;
    }
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c = __builtin_ia32_crc32di(c, v);
        p += 8;
        n -= 8;
    }
    while (n--) c = __builtin_ia32_crc32qi((uint32_t)c, *p++);
    return (uint32_t)c;
}

static int32_t cpu_has_sse42;
static pthread_once_t cpu_once = PTHREAD_ONCE_INIT;

static void detect_cpu(void) {
    __builtin_cpu_init();
    cpu_has_sse42 = __builtin_cpu_supports("sse4.2") ? 1 : 0;
}

int32_t ofl_io_crc32c_hw(void) {
    pthread_once(&cpu_once, detect_cpu);
    return cpu_has_sse42 && !__atomic_load_n(&force_table, __ATOMIC_RELAXED);
}
#else
static uint32_t crc_hw(uint32_t crc, const unsigned char *p, size_t n) { return crc_table(crc, p, n); }
int32_t ofl_io_crc32c_hw(void) { return 0; }
#endif

int32_t ofl_io_crc32c_test_force_table(int32_t on) {
    return __atomic_exchange_n(&force_table, on ? 1 : 0, __ATOMIC_RELAXED);
}

int32_t ofl_io_crc32c(uint32_t crc, uint64_t address, int64_t nbytes, uint32_t *crc_out) {
    if (!crc_out || nbytes < 0 || (address == 0 && nbytes > 0)) return -EINVAL;
    const unsigned char *p = (const unsigned char *)(uintptr_t)address;
    uint32_t c = ~crc;
    c = ofl_io_crc32c_hw() ? crc_hw(c, p, (size_t)nbytes) : crc_table(c, p, (size_t)nbytes);
    *crc_out = ~c;
    return 0;
}
