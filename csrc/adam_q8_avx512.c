/* AVX-512 Adam over compressed moments: 16 lanes, masked tails, table lookups by gather.
 * The same bits as the scalar path ([Note: one operation sequence for every ISA]). */
#include "adam_q8.h"

#if OFL_HAVE_X86
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#define OFL_AVX512_NATIVE_BF16 0
#include "adam_avx512_loop.h" /* load_grad16, f32_to_bf16_16, store_out16 */

OFL_AI __mmask16 tail_mask(int64_t left) { return left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1u); }

/* The 256 values of a map as 16 registers, looked up by permutes (a gather is slow on some CPUs). */
typedef struct {
    __m512 r[16];
} table16;

OFL_AI void load_table16(const float *val, table16 *tab) {
    for (int i = 0; i < 16; i++) tab->r[i] = _mm512_loadu_ps(val + 16 * i);
}

/* val[code] * scale for 16 codes. Signed map: its 128 magnitudes and the sign bit of the code. */
OFL_AI __m512 dequant16(const table16 *tab, int32_t map, const uint8_t *codes, __m512 scale, __mmask16 k) {
    __m512i c = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(k, codes));
    __m512 q[8];
    int pairs = map == OFL_Q8_MAP_SIGNED ? 4 : 8;
    for (int i = 0; i < pairs; i++) q[i] = _mm512_permutex2var_ps(tab->r[2 * i], c, tab->r[2 * i + 1]);
    __mmask16 b5 = _mm512_test_epi32_mask(c, _mm512_set1_epi32(32));
    __mmask16 b6 = _mm512_test_epi32_mask(c, _mm512_set1_epi32(64));
    __m512 lo = _mm512_mask_blend_ps(b6, _mm512_mask_blend_ps(b5, q[0], q[1]), _mm512_mask_blend_ps(b5, q[2], q[3]));
    if (map == OFL_Q8_MAP_SIGNED) {
        __m512i sign = _mm512_slli_epi32(_mm512_and_si512(c, _mm512_set1_epi32(0x80)), 24);
        lo = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(lo), sign));
    } else {
        __mmask16 b7 = _mm512_test_epi32_mask(c, _mm512_set1_epi32(128));
        __m512 hi = _mm512_mask_blend_ps(b6, _mm512_mask_blend_ps(b5, q[4], q[5]), _mm512_mask_blend_ps(b5, q[6], q[7]));
        lo = _mm512_mask_blend_ps(b7, lo, hi);
    }
    return _mm512_mul_ps(lo, scale);
}

/* The codes of 16 values ([Note: the code of a value]); the decade's constants by permutes. */
OFL_AI __m512i code16(const ofl_q8_tables *t, int32_t map, __m512 x, __m512 inv) {
    __m512i xb = _mm512_castps_si512(x);
    __m512 a = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(xb, _mm512_set1_epi32(0x7fffffff))), inv);
    a = _mm512_min_ps(a, _mm512_set1_ps(1.0f)); /* NaN -> 1 */
    __m512i one = _mm512_set1_epi32(1);
    __m512i e = _mm512_sub_epi32(_mm512_set1_epi32(127), _mm512_srli_epi32(_mm512_castps_si512(a), 23));
    e = _mm512_min_epi32(e, _mm512_set1_epi32(31));
    __m512i d = _mm512_permutex2var_epi32(_mm512_loadu_si512(t->first_decade[map]), e,
                                          _mm512_loadu_si512(t->first_decade[map] + 16));
    __m512 below = _mm512_permutexvar_ps(d, _mm512_castps256_ps512(_mm256_loadu_ps(t->thr_or_none[map])));
    d = _mm512_mask_add_epi32(d, _mm512_cmp_ps_mask(a, below, _CMP_LE_OQ), d, one);
    __m512 p10 = _mm512_permutexvar_ps(d, _mm512_castps256_ps512(_mm256_loadu_ps(t->pow10[map])));
    __m512 slope = _mm512_permutexvar_ps(d, _mm512_castps256_ps512(_mm256_loadu_ps(t->slope[map])));
    __m512i base = _mm512_permutexvar_epi32(d, _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)t->base[map])));
    __m512 s = _mm512_mul_ps(_mm512_fmadd_ps(a, p10, _mm512_set1_ps(-0.1f)), slope);
    /* s is in [-0.12, c_d] (a decade's own range, and below the last one's down to 0): no clamp */
    __m512i idx = _mm512_add_epi32(base, _mm512_cvtps_epi32(s));
    if (map == OFL_Q8_MAP_UNSIGNED) {
        __mmask16 pos = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GT_OQ);
        return _mm512_mask_max_epi32(idx, pos, idx, one);
    }
    return _mm512_mask_or_epi32(idx, _mm512_movepi32_mask(xb), idx, _mm512_set1_epi32(0x80));
}

OFL_AI __m512i absmax16(__m512i amax, __m512 x, __mmask16 k) {
    return _mm512_mask_max_epu32(amax, k, amax, _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7fffffff)));
}

/* The codes of n values whose block maximum (|x|'s bits, lane-wise) is amax; the scale to *scale. */
OFL_AI void codes_block16(const ofl_q8_tables *t, int32_t map, const float *x, uint8_t *codes, float *scale,
                          int64_t n, __m512i amax) {
    float s = ofl_bits_to_f32((uint32_t)_mm512_reduce_max_epu32(amax));
    __m512 inv = _mm512_set1_ps(ofl_q8_inverse(s));
    *scale = s;
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 k = tail_mask(n - i);
        __m512i c = code16(t, map, _mm512_maskz_loadu_ps(k, x + i), inv);
        _mm_mask_storeu_epi8(codes + i, k, _mm512_cvtepi32_epi8(c)); /* vpmovdb to memory is slow on Zen 4 */
    }
}

void ofl_q8_quant_avx512(const ofl_q8_tables *t, int32_t map, const float *x, uint8_t *codes,
                         float *scale, int64_t n) {
    __m512i amax = _mm512_setzero_si512();
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 k = tail_mask(n - i);
        amax = absmax16(amax, _mm512_maskz_loadu_ps(k, x + i), k);
    }
    codes_block16(t, map, x, codes, scale, n, amax);
}

void ofl_q8_dequant_avx512(const ofl_q8_tables *t, int32_t map, const uint8_t *codes, float scale,
                           float *x, int64_t n) {
    __m512 s = _mm512_set1_ps(scale);
    table16 tab;
    load_table16(t->value[map], &tab);
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 k = tail_mask(n - i);
        _mm512_mask_storeu_ps(x + i, k, dequant16(&tab, map, codes + i, s, k));
    }
}

OFL_AI int32_t block16(const ofl_q8_tables *t, const ofl_adam_coeffs *c, int32_t gd, int32_t od, int l2,
                       int32_t sd, float *p, const void *g, void *m, void *v, float *ms, float *vs,
                       void *out, int64_t n) {
    float bm[OFL_Q8_BLOCK] __attribute__((aligned(64))), bv[OFL_Q8_BLOCK] __attribute__((aligned(64)));
    const __m512 b1 = _mm512_set1_ps(c->beta1), omb1 = _mm512_set1_ps(c->one_minus_beta1);
    const __m512 b2 = _mm512_set1_ps(c->beta2), omb2 = _mm512_set1_ps(c->one_minus_beta2);
    const __m512 eps = _mm512_set1_ps(c->eps), step = _mm512_set1_ps(c->step_size);
    const __m512 ibc2 = _mm512_set1_ps(c->inv_bias2_sqrt), decay = _mm512_set1_ps(c->decay_mul);
    const __m512 l2c = _mm512_set1_ps(c->l2_decay), gscale = _mm512_set1_ps(c->grad_scale);
    __m512 sm = _mm512_setzero_ps(), sv = _mm512_setzero_ps();
    table16 tabs, tabu;
    if (sd == OFL_STATE_Q8) {
        load_table16(t->value[OFL_Q8_MAP_SIGNED], &tabs);
        load_table16(t->value[OFL_Q8_MAP_UNSIGNED], &tabu);
        sm = _mm512_set1_ps(ms[0]);
        sv = _mm512_set1_ps(vs[0]);
    }
    __m512 bad = _mm512_setzero_ps();
    __m512i amax_m = _mm512_setzero_si512(), amax_v = _mm512_setzero_si512();
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 k = tail_mask(n - i);
        __m512 m0, v0;
        if (sd == OFL_STATE_Q8) {
            m0 = dequant16(&tabs, OFL_Q8_MAP_SIGNED, (const uint8_t *)m + i, sm, k);
            v0 = dequant16(&tabu, OFL_Q8_MAP_UNSIGNED, (const uint8_t *)v + i, sv, k);
        } else {
            m0 = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, (const uint16_t *)m + i)), 16));
            v0 = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, (const uint16_t *)v + i)), 16));
        }
        __m512 gv = _mm512_mul_ps(load_grad16(gd, g, i, k, 1), gscale);
        bad = _mm512_add_ps(bad, _mm512_mul_ps(gv, _mm512_setzero_ps()));
        if (l2) gv = _mm512_fmadd_ps(l2c, _mm512_maskz_loadu_ps(k, p + i), gv);
        __m512 mv = _mm512_fmadd_ps(b1, m0, _mm512_mul_ps(omb1, gv));
        __m512 vv = _mm512_fmadd_ps(b2, v0, _mm512_mul_ps(_mm512_mul_ps(omb2, gv), gv));
        _mm512_store_ps(bm + i, mv);
        _mm512_store_ps(bv + i, vv);
        if (sd == OFL_STATE_Q8) {
            amax_m = absmax16(amax_m, mv, k);
            amax_v = absmax16(amax_v, vv, k);
        } else {
            _mm256_mask_storeu_epi16((uint16_t *)m + i, k, f32_to_bf16_16(mv));
            _mm256_mask_storeu_epi16((uint16_t *)v + i, k, f32_to_bf16_16(vv));
        }
    }
    /* The update apart, a short loop whose square roots and divisions overlap from one vector
     * to the next (in the loop above they wait behind the lookups). */
#pragma GCC unroll 4
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 k = tail_mask(n - i);
        __m512 pv = _mm512_maskz_loadu_ps(k, p + i);
        __m512 den = _mm512_fmadd_ps(_mm512_sqrt_ps(_mm512_load_ps(bv + i)), ibc2, eps);
        pv = _mm512_fnmadd_ps(step, _mm512_div_ps(_mm512_load_ps(bm + i), den), _mm512_mul_ps(pv, decay));
        _mm512_mask_storeu_ps(p + i, k, pv);
        store_out16(od, out, i, pv, k, 1);
    }
    if (sd == OFL_STATE_Q8) {
        codes_block16(t, OFL_Q8_MAP_SIGNED, bm, (uint8_t *)m, ms, n, amax_m);
        codes_block16(t, OFL_Q8_MAP_UNSIGNED, bv, (uint8_t *)v, vs, n, amax_v);
    }
    return _mm512_cmp_ps_mask(bad, bad, _CMP_UNORD_Q) != 0;
}

OFL_AI int32_t loop16(const ofl_adam_coeffs *c, int32_t gd, int32_t od, int l2, int32_t sd, float *p,
                      const void *g, void *m, void *v, float *ms, float *vs, void *out, int64_t n) {
    const ofl_q8_tables *t = ofl_q8_tables_get();
    int64_t es = sd == OFL_STATE_Q8 ? 1 : 2;
    int64_t eg = gd == OFL_DTYPE_F32 ? 4 : 2, eo = od == OFL_DTYPE_F32 ? 4 : 2;
    int32_t bad = 0;
    for (int64_t b = 0, i = 0; i < n; b++, i += OFL_Q8_BLOCK) {
        int64_t len = n - i < OFL_Q8_BLOCK ? n - i : OFL_Q8_BLOCK;
        bad |= block16(t, c, gd, od, l2, sd, p + i, (const char *)g + i * eg, (char *)m + i * es,
                       (char *)v + i * es, sd == OFL_STATE_Q8 ? ms + b : NULL,
                       sd == OFL_STATE_Q8 ? vs + b : NULL, out ? (char *)out + i * eo : NULL, len);
    }
    return bad;
}

OFL_DEFINE_ADAMQ_KERNEL(ofl_adamq_kernel_avx512, loop16)
#endif /* OFL_HAVE_X86 */
