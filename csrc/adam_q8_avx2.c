/* AVX2 + FMA + F16C Adam over compressed moments: 8 lanes, the last < 8 elements of a
 * block by the scalar steps; the same bits as the scalar path ([Note: one operation
 * sequence for every ISA]). */
#include "adam_q8.h"

#if OFL_HAVE_X86
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include "adam_avx2_lanes.h"

OFL_AI void store_out8(int32_t dt, void *out, __m256 x) {
    if (dt == OFL_DTYPE_NONE) return;
    if (dt == OFL_DTYPE_F32) {
        _mm256_storeu_ps((float *)out, x);
        return;
    }
    __m128i h = dt == OFL_DTYPE_BF16 ? f32_to_bf16_8(x)
                                     : _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128((__m128i *)out, h);
}

OFL_AI __m256 bf16_8(const uint16_t *h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)h)), 16));
}

OFL_AI __m256 dequant8(const float *val, const uint8_t *codes, __m256 scale) {
    __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)codes));
    return _mm256_mul_ps(_mm256_i32gather_ps(val, idx, 4), scale);
}

/* The codes of 8 values ([Note: the code of a value]); the decade's constants by permutes. */
OFL_AI __m256i code8(const ofl_q8_tables *t, int32_t map, __m256 x, __m256 inv) {
    __m256i xb = _mm256_castps_si256(x);
    __m256 a = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_and_si256(xb, _mm256_set1_epi32(0x7fffffff))), inv);
    a = _mm256_min_ps(a, _mm256_set1_ps(1.0f)); /* NaN -> 1 */
    __m256i d = _mm256_setzero_si256();
    for (int k = 0; k < t->decades[map] - 1; k++) /* a true compare is -1: subtract it */
        d = _mm256_sub_epi32(d, _mm256_castps_si256(_mm256_cmp_ps(a, _mm256_set1_ps(t->thr[map][k]), _CMP_LE_OQ)));
    __m256 gain = _mm256_permutevar8x32_ps(_mm256_loadu_ps(t->gain[map]), d);
    __m256 offset = _mm256_permutevar8x32_ps(_mm256_loadu_ps(t->offset[map]), d);
    __m256i idx = _mm256_cvtps_epi32(_mm256_fmadd_ps(a, gain, offset));
    idx = _mm256_min_epi32(_mm256_max_epi32(idx, _mm256_setzero_si256()), _mm256_set1_epi32(t->top[map]));
    if (map == OFL_Q8_MAP_UNSIGNED) {
        __m256i pos = _mm256_castps_si256(_mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GT_OQ));
        return _mm256_max_epi32(idx, _mm256_and_si256(pos, _mm256_set1_epi32(1)));
    }
    return _mm256_or_si256(idx, _mm256_and_si256(_mm256_srli_epi32(xb, 24), _mm256_set1_epi32(0x80)));
}

OFL_AI void store_codes8(uint8_t *dst, __m256i c) {
    __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    _mm_storel_epi64((__m128i *)dst, _mm_packus_epi16(w, w));
}

void ofl_q8_quant_avx2(const ofl_q8_tables *t, int32_t map, const float *x, uint8_t *codes, float *scale,
                       int64_t n) {
    __m256i vmax = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        vmax = _mm256_max_epu32(vmax, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + i)),
                                                       _mm256_set1_epi32(0x7fffffff)));
    uint32_t lanes[8];
    _mm256_storeu_si256((__m256i *)lanes, vmax);
    uint32_t amax = 0;
    for (int k = 0; k < 8; k++) amax = lanes[k] > amax ? lanes[k] : amax;
    for (; i < n; i++) {
        uint32_t b = ofl_q8_absbits(x[i]);
        amax = b > amax ? b : amax;
    }
    float s = ofl_bits_to_f32(amax);
    float inv = ofl_q8_inverse(s);
    *scale = s;
    __m256 vinv = _mm256_set1_ps(inv);
    for (i = 0; i + 8 <= n; i += 8) store_codes8(codes + i, code8(t, map, _mm256_loadu_ps(x + i), vinv));
    for (; i < n; i++) codes[i] = ofl_q8_code1(t, map, x[i], inv);
}

void ofl_q8_dequant_avx2(const ofl_q8_tables *t, int32_t map, const uint8_t *codes, float scale,
                         float *x, int64_t n) {
    const float *val = t->value[map];
    __m256 s = _mm256_set1_ps(scale);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, dequant8(val, codes + i, s));
    for (; i < n; i++) x[i] = val[codes[i]] * scale;
}

OFL_AI int32_t block8(const ofl_q8_tables *t, const ofl_adam_coeffs *c, int32_t gd, int32_t od, int l2,
                      int32_t sd, float *p, const void *g, void *m, void *v, float *ms, float *vs,
                      void *out, int64_t n) {
    float bm[OFL_Q8_BLOCK] __attribute__((aligned(32))), bv[OFL_Q8_BLOCK] __attribute__((aligned(32)));
    const __m256 b1 = _mm256_set1_ps(c->beta1), omb1 = _mm256_set1_ps(c->one_minus_beta1);
    const __m256 b2 = _mm256_set1_ps(c->beta2), omb2 = _mm256_set1_ps(c->one_minus_beta2);
    const __m256 eps = _mm256_set1_ps(c->eps), step = _mm256_set1_ps(c->step_size);
    const __m256 ibc2 = _mm256_set1_ps(c->inv_bias2_sqrt), decay = _mm256_set1_ps(c->decay_mul);
    const __m256 l2c = _mm256_set1_ps(c->l2_decay), gscale = _mm256_set1_ps(c->grad_scale);
    const float *vals = t->value[OFL_Q8_MAP_SIGNED], *valu = t->value[OFL_Q8_MAP_UNSIGNED];
    float sms = sd == OFL_STATE_Q8 ? ms[0] : 0.0f, svs = sd == OFL_STATE_Q8 ? vs[0] : 0.0f;
    __m256 sm = _mm256_set1_ps(sms), sv = _mm256_set1_ps(svs);
    int64_t eo = od == OFL_DTYPE_F32 ? 4 : 2;
    __m256 bad = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 m0, v0;
        if (sd == OFL_STATE_Q8) {
            m0 = dequant8(vals, (const uint8_t *)m + i, sm);
            v0 = dequant8(valu, (const uint8_t *)v + i, sv);
        } else {
            m0 = bf16_8((const uint16_t *)m + i);
            v0 = bf16_8((const uint16_t *)v + i);
        }
        __m256 pv = _mm256_loadu_ps(p + i);
        __m256 gv = _mm256_mul_ps(load_grad8(gd, g, i), gscale);
        bad = _mm256_add_ps(bad, _mm256_mul_ps(gv, _mm256_setzero_ps()));
        if (l2) gv = _mm256_fmadd_ps(l2c, pv, gv);
        __m256 mv = _mm256_fmadd_ps(b1, m0, _mm256_mul_ps(omb1, gv));
        __m256 vv = _mm256_fmadd_ps(b2, v0, _mm256_mul_ps(_mm256_mul_ps(omb2, gv), gv));
        __m256 den = _mm256_fmadd_ps(_mm256_sqrt_ps(vv), ibc2, eps);
        pv = _mm256_fnmadd_ps(step, _mm256_div_ps(mv, den), _mm256_mul_ps(pv, decay));
        _mm256_storeu_ps(p + i, pv);
        if (od != OFL_DTYPE_NONE) store_out8(od, (char *)out + i * eo, pv);
        if (sd == OFL_STATE_Q8) {
            _mm256_store_ps(bm + i, mv);
            _mm256_store_ps(bv + i, vv);
        } else {
            _mm_storeu_si128((__m128i *)((uint16_t *)m + i), f32_to_bf16_8(mv));
            _mm_storeu_si128((__m128i *)((uint16_t *)v + i), f32_to_bf16_8(vv));
        }
    }
    int32_t nonfinite = _mm256_movemask_ps(_mm256_cmp_ps(bad, bad, _CMP_UNORD_Q)) != 0;
    for (; i < n; i++) {
        float m0, v0;
        if (sd == OFL_STATE_Q8) {
            m0 = vals[((const uint8_t *)m)[i]] * sms;
            v0 = valu[((const uint8_t *)v)[i]] * svs;
        } else {
            m0 = ofl_bf16_to_f32(((const uint16_t *)m)[i]);
            v0 = ofl_bf16_to_f32(((const uint16_t *)v)[i]);
        }
        nonfinite |= !isfinite(ofl_adamq_update1(c, gd, od, l2, p, g, m0, v0, &bm[i], &bv[i], out, i));
        if (sd == OFL_STATE_BF16) {
            ((uint16_t *)m)[i] = ofl_f32_to_bf16(bm[i]);
            ((uint16_t *)v)[i] = ofl_f32_to_bf16(bv[i]);
        }
    }
    if (sd == OFL_STATE_Q8) {
        ofl_q8_quant_avx2(t, OFL_Q8_MAP_SIGNED, bm, (uint8_t *)m, ms, n);
        ofl_q8_quant_avx2(t, OFL_Q8_MAP_UNSIGNED, bv, (uint8_t *)v, vs, n);
    }
    return nonfinite;
}

OFL_AI int32_t loop8(const ofl_adam_coeffs *c, int32_t gd, int32_t od, int l2, int32_t sd, float *p,
                     const void *g, void *m, void *v, float *ms, float *vs, void *out, int64_t n) {
    const ofl_q8_tables *t = ofl_q8_tables_get();
    int64_t es = sd == OFL_STATE_Q8 ? 1 : 2;
    int64_t eg = gd == OFL_DTYPE_F32 ? 4 : 2, eo = od == OFL_DTYPE_F32 ? 4 : 2;
    int32_t bad = 0;
    for (int64_t b = 0, i = 0; i < n; b++, i += OFL_Q8_BLOCK) {
        int64_t len = n - i < OFL_Q8_BLOCK ? n - i : OFL_Q8_BLOCK;
        bad |= block8(t, c, gd, od, l2, sd, p + i, (const char *)g + i * eg, (char *)m + i * es,
                      (char *)v + i * es, sd == OFL_STATE_Q8 ? ms + b : NULL,
                      sd == OFL_STATE_Q8 ? vs + b : NULL, out ? (char *)out + i * eo : NULL, len);
    }
    return bad;
}

OFL_DEFINE_ADAMQ_KERNEL(ofl_adamq_kernel_avx2, loop8)
#endif /* OFL_HAVE_X86 */
