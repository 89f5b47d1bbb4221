/* The bf16 master's conversions (adam_master.c), shared with the dispatch in adam_q8.c.
 * Not part of the cffi API; see [Note: a bf16 master] in ofl_adam.h. */
#ifndef OFL_ADAM_MASTER_H
#define OFL_ADAM_MASTER_H

#include <errno.h>

#include "adam_q8.h"

/* Elements of a master tile: widened into a stack buffer, stepped, rounded back. A multiple
 * of OFL_Q8_BLOCK, so a tile never splits a block of scales. */
#define OFL_MASTER_TILE 2048

/* murmur3's 32-bit finalizer: a bijection that mixes every input bit into every output bit. */
static inline uint32_t ofl_fmix32(uint32_t h) {
    h ^= h >> 16;
    h *= 0x85ebca6bu;
    h ^= h >> 13;
    h *= 0xc2b2ae35u;
    h ^= h >> 16;
    return h;
}

/* The 16 random bits of element j of a tensor whose (seed, step) key is `key`: one hash a pair
 * of elements, h = fmix32((j / 2) * 0x9e3779b1 + key), its high half for the even element and
 * its low half for the odd one (half the hashing of one a element; every bit of h is mixed). */
#define OFL_SR_GOLDEN 0x9e3779b1u
static inline uint32_t ofl_sr_bits(uint32_t key, uint32_t j) {
    uint32_t h = ofl_fmix32((j >> 1) * OFL_SR_GOLDEN + key);
    return j & 1u ? h & 0xffffu : h >> 16;
}

/* ofl_fmix32 on every lane of h, with one vector width's xor, shift, multiply and broadcast. */
#define OFL_FMIX_V(h, XOR, SRLI, MUL, SET1)                     \
    do {                                                        \
        h = XOR(h, SRLI(h, 16));                                \
        h = MUL(h, SET1((int)0x85ebca6bu));                     \
        h = XOR(h, SRLI(h, 13));                                \
        h = MUL(h, SET1((int)0xc2b2ae35u));                     \
        h = XOR(h, SRLI(h, 16));                                \
    } while (0)

/* x's bits rounded to bfloat16 stochastically with 16 random bits r: the top 16 bits of x + r,
 * so x rounds away from zero with probability (its dropped 16 bits) / 2^16; NaN stays a quiet NaN. */
static inline uint16_t ofl_bf16_sr1(uint32_t x, uint32_t r) {
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x0040u);
    return (uint16_t)((x + r) >> 16);
}

/* The key of tensor `seed` at step `step` (the step count after the call's increment). */
uint32_t ofl_sr_key(uint64_t seed, uint32_t step);

typedef void (*ofl_bf16_widen_fn)(const uint16_t *src, float *dst, int64_t n);
typedef void (*ofl_bf16_store_sr_fn)(const float *src, uint16_t *dst, int64_t n, uint32_t key, uint32_t first);
typedef struct {
    ofl_bf16_widen_fn widen;
    ofl_bf16_store_sr_fn store_sr;
} ofl_master_kernels;

ofl_master_kernels ofl_master_kernels_for(int32_t isa);

/* The int8 step over n elements of a bf16 master pm, from element `first` (even, on a block) of a
 * tensor of rounding key `key`, with the rounding fused into AVX-512's full-block pass
 * (adam_q8_avx512_loop.h); the arguments and result otherwise those of ofl_adamq_kernel_fn. */
typedef int32_t (*ofl_adamq_m16_kernel_fn)(const ofl_adam_coeffs *c, int32_t gd, int32_t od, int32_t sd, uint16_t *pm,
                                           uint32_t key, uint32_t first, const void *g, void *m, void *v, float *ms,
                                           float *vs, void *out, int64_t n);
#if OFL_HAVE_X86
int32_t ofl_adamq_m16_kernel_avx512(const ofl_adam_coeffs *c, int32_t gd, int32_t od, int32_t sd, uint16_t *pm,
                                    uint32_t key, uint32_t first, const void *g, void *m, void *v, float *ms,
                                    float *vs, void *out, int64_t n);
int32_t ofl_adamq_m16_kernel_avx512vbmi(const ofl_adam_coeffs *c, int32_t gd, int32_t od, int32_t sd, uint16_t *pm,
                                        uint32_t key, uint32_t first, const void *g, void *m, void *v, float *ms,
                                        float *vs, void *out, int64_t n);
#endif

#endif /* OFL_ADAM_MASTER_H */
