/* A bfloat16 master for the compressed-state step: widening it, and storing the updated
 * fp32 value back by stochastic rounding. See [Note: a bf16 master] in ofl_adam.h.
 *
 * Each loop is integer work on the floats' bits, so the scalar, AVX2 and AVX-512 builds of
 * it (the same C, vectorized by the compiler under each target) give the same bits. */
#include "adam_master.h"

#define OFL_MASTER_LOOPS(SUFFIX, ATTR)                                                                  \
    ATTR void ofl_bf16_widen_##SUFFIX(const uint16_t *restrict src, float *restrict dst, int64_t n) { \
        uint32_t *d = (uint32_t *)dst;                                                                  \
        for (int64_t i = 0; i < n; i++) d[i] = (uint32_t)src[i] << 16;                                  \
    }                                                                                                   \
    ATTR void ofl_bf16_store_sr_##SUFFIX(const float *restrict src, uint16_t *restrict dst, int64_t n, \
                                         uint32_t key, uint32_t first) {                               \
        const uint32_t *s = (const uint32_t *)src;                                                      \
        for (int64_t i = 0; i < n; i++)                                                                 \
            dst[i] = ofl_bf16_sr1(s[i], ofl_sr_bits(key, first + (uint32_t)i));                         \
    }

OFL_MASTER_LOOPS(scalar, __attribute__((optimize("no-tree-vectorize"))))
#if OFL_HAVE_X86
OFL_MASTER_LOOPS(avx2, __attribute__((target("avx2"))))
OFL_MASTER_LOOPS(avx512, __attribute__((target("avx512f,avx512bw,avx512vl"))))
#endif

ofl_master_kernels ofl_master_kernels_for(int32_t isa) {
#if OFL_HAVE_X86
    if (isa == OFL_ISA_AVX512 || isa == OFL_ISA_AVX512_BF16)
        return (ofl_master_kernels){ofl_bf16_widen_avx512, ofl_bf16_store_sr_avx512};
    if (isa == OFL_ISA_AVX2) return (ofl_master_kernels){ofl_bf16_widen_avx2, ofl_bf16_store_sr_avx2};
#endif
    (void)isa;
    return (ofl_master_kernels){ofl_bf16_widen_scalar, ofl_bf16_store_sr_scalar};
}

uint32_t ofl_sr_key(uint64_t seed, uint32_t step) {
    uint32_t h = ofl_fmix32((uint32_t)(seed >> 32) ^ 0x5bd1e995u);
    h = ofl_fmix32(h ^ (uint32_t)seed);
    return ofl_fmix32(h + step * 0x27d4eb2fu);
}

int32_t ofl_bf16_round_sr(const float *x, uint16_t *out, int64_t n, uint64_t seed, uint32_t step,
                          int64_t first, int32_t isa) {
    if (n < 0 || first < 0 || (n > 0 && (!x || !out))) return -EINVAL;
    int32_t resolved;
    int32_t rc = ofl_adam_resolve_isa(isa, &resolved);
    if (rc) return rc;
    ofl_master_kernels_for(resolved).store_sr(x, out, n, ofl_sr_key(seed, step), (uint32_t)first);
    return 0;
}
