/* CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), as used by iSCSI, ext4 and
 * RocksDB. The SSE4.2 crc32 instruction when the CPU has it; a byte table otherwise,
 * or when a test forces it (ofl_io_crc32c_test_force_table), since on the x86 machines
 * that run the tests the table would otherwise never run. */
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

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t crc, const unsigned char *p, size_t n) {
    uint64_t c = crc;
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
