/* A bfloat16 master for the compressed-state step: widening it, and storing the updated
 * fp32 value back by stochastic rounding. See [Note: a bf16 master] in ofl_adam.h.
 *
 * Each loop is integer work on the floats' bits, so the scalar, AVX2 and AVX-512 paths give the
 * same bits. */
#include "adam_master.h"

#if OFL_HAVE_X86
#include <immintrin.h>
#endif

/* The rounding of n elements from element `first` of the tensor, one at a time (the reference,
 * and the vector paths' odd first element and tails). */
static void store_sr_tail(const uint32_t *s, uint16_t *dst, int64_t n, uint32_t key, uint32_t first) {
    for (int64_t i = 0; i < n; i++) dst[i] = ofl_bf16_sr1(s[i], ofl_sr_bits(key, first + (uint32_t)i));
}

/* bf16 -> fp32 is the bits moved up 16: the same loop under each target. */
#define OFL_WIDEN(NAME, ATTR)                                                                \
    ATTR static void NAME(const uint16_t *restrict src, float *restrict dst, int64_t n) {    \
        uint32_t *d = (uint32_t *)dst;                                                       \
        for (int64_t i = 0; i < n; i++) d[i] = (uint32_t)src[i] << 16;                       \
    }

OFL_WIDEN(widen_scalar, __attribute__((optimize("no-tree-vectorize"))))

/* The vector paths' head: an odd first element alone (pairs start on even ones); how many were done. */
static int64_t store_sr_head(const uint32_t *s, uint16_t *dst, int64_t n, uint32_t key, uint32_t first) {
    if (n == 0 || !(first & 1u)) return 0;
    store_sr_tail(s, dst, 1, key, first);
    return 1;
}

__attribute__((optimize("no-tree-vectorize"))) static void store_sr_scalar(const float *src, uint16_t *dst, int64_t n,
                                                                          uint32_t key, uint32_t first) {
    store_sr_tail((const uint32_t *)src, dst, n, key, first);
}

#if OFL_HAVE_X86
OFL_WIDEN(widen_avx2, __attribute__((target("avx2"))))
OFL_WIDEN(widen_avx512, __attribute__((target("avx512f,avx512bw"))))

/* 16 elements a step (8 pair hashes); the rounding and NaN rule as ofl_bf16_sr1. */
__attribute__((target("avx2"))) static void store_sr_avx2(const float *src, uint16_t *dst, int64_t n, uint32_t key,
                                                          uint32_t first) {
    const uint32_t *s = (const uint32_t *)src;
    int64_t i = store_sr_head(s, dst, n, key, first);
    const __m256i golden8 = _mm256_set1_epi32((int)(8u * OFL_SR_GOLDEN));
    __m256i base = _mm256_add_epi32(
        _mm256_set1_epi32((int)(((first + (uint32_t)i) >> 1) * OFL_SR_GOLDEN + key)),
        _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)OFL_SR_GOLDEN)));
    const __m256i absmask = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
    const __m256i quiet = _mm256_set1_epi32(0x0040), low = _mm256_set1_epi32(0xffff);
    for (; i + 16 <= n; i += 16) {
        __m256i h = base;
        base = _mm256_add_epi32(base, golden8);
        OFL_FMIX_V(h, _mm256_xor_si256, _mm256_srli_epi32, _mm256_mullo_epi32, _mm256_set1_epi32);
        __m256i hi = _mm256_srli_epi32(h, 16), lo = _mm256_and_si256(h, low);
        /* element 2q gets hi[q], 2q+1 lo[q]: interleave (per 128-bit lane), then put the lanes in order */
        __m256i r0 = _mm256_unpacklo_epi32(hi, lo), r1 = _mm256_unpackhi_epi32(hi, lo);
        __m256i ra = _mm256_permute2x128_si256(r0, r1, 0x20), rb = _mm256_permute2x128_si256(r0, r1, 0x31);
        __m256i out[2];
        const __m256i rs[2] = {ra, rb};
        for (int k = 0; k < 2; k++) {
            __m256i x = _mm256_loadu_si256((const __m256i *)(s + i + 8 * k));
            __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(x, absmask), inf);
            __m256i y = _mm256_srli_epi32(_mm256_add_epi32(x, rs[k]), 16);
            __m256i q = _mm256_or_si256(_mm256_srli_epi32(x, 16), quiet);
            out[k] = _mm256_blendv_epi8(y, q, nan);
        }
        __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(out[0], out[1]), 0xd8);
        _mm256_storeu_si256((__m256i *)(dst + i), packed);
    }
    store_sr_tail(s + i, dst + i, n - i, key, first + (uint32_t)i);
}

/* 32 elements a step (16 pair hashes). */
__attribute__((target("avx512f,avx512bw"))) static void store_sr_avx512(const float *src, uint16_t *dst, int64_t n,
                                                                        uint32_t key, uint32_t first) {
    const uint32_t *s = (const uint32_t *)src;
    int64_t i = store_sr_head(s, dst, n, key, first);
    const __m512i golden16 = _mm512_set1_epi32((int)(16u * OFL_SR_GOLDEN));
    __m512i base = _mm512_add_epi32(
        _mm512_set1_epi32((int)(((first + (uint32_t)i) >> 1) * OFL_SR_GOLDEN + key)),
        _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                           _mm512_set1_epi32((int)OFL_SR_GOLDEN)));
    const __m512i idx_a = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i idx_b = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    const __m512i absmask = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
    const __m512i quiet = _mm512_set1_epi32(0x0040), low = _mm512_set1_epi32(0xffff);
    for (; i + 32 <= n; i += 32) {
        __m512i h = base;
        base = _mm512_add_epi32(base, golden16);
        OFL_FMIX_V(h, _mm512_xor_si512, _mm512_srli_epi32, _mm512_mullo_epi32, _mm512_set1_epi32);
        __m512i hi = _mm512_srli_epi32(h, 16), lo = _mm512_and_si512(h, low);
        const __m512i rs[2] = {_mm512_permutex2var_epi32(hi, idx_a, lo), _mm512_permutex2var_epi32(hi, idx_b, lo)};
        for (int k = 0; k < 2; k++) {
            __m512i x = _mm512_loadu_si512((const void *)(s + i + 16 * k));
            __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(x, absmask), inf);
            __m512i y = _mm512_srli_epi32(_mm512_add_epi32(x, rs[k]), 16);
            y = _mm512_mask_mov_epi32(y, nan, _mm512_or_si512(_mm512_srli_epi32(x, 16), quiet));
            _mm256_storeu_si256((__m256i *)(dst + i + 16 * k), _mm512_cvtepi32_epi16(y));
        }
    }
    store_sr_tail(s + i, dst + i, n - i, key, first + (uint32_t)i);
}
#endif

ofl_master_kernels ofl_master_kernels_for(int32_t isa) {
#if OFL_HAVE_X86
    if (isa == OFL_ISA_AVX512 || isa == OFL_ISA_AVX512_BF16) return (ofl_master_kernels){widen_avx512, store_sr_avx512};
    if (isa == OFL_ISA_AVX2) return (ofl_master_kernels){widen_avx2, store_sr_avx2};
#endif
    (void)isa;
    return (ofl_master_kernels){widen_scalar, store_sr_scalar};
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
