/* AVX2 lane helpers shared by the fp32-state (adam_avx2.c) and compressed-state (adam_q8_avx2.c)
 * kernels: a gradient of any dtype in as 8 floats, 8 floats out as bf16 (round to nearest even,
 * NaN kept quiet). Include after `#pragma GCC target("avx2,fma,f16c")` and <immintrin.h>. */
#ifndef OFL_ADAM_AVX2_LANES_H
#define OFL_ADAM_AVX2_LANES_H

#define OFL_AI static inline __attribute__((always_inline))

OFL_AI __m256 load_grad8(int32_t dt, const void *g, int64_t i) {
    if (dt == OFL_DTYPE_F32) return _mm256_loadu_ps((const float *)g + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)g + i));
    if (dt == OFL_DTYPE_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

OFL_AI __m128i f32_to_bf16_8(__m256 x) {
    __m256i b = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(b, _mm256_set1_epi32(0x00400000)), nan);
    r = _mm256_srli_epi32(r, 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

#endif /* OFL_ADAM_AVX2_LANES_H */
