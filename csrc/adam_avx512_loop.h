/* The AVX-512 Adam loop, included by adam_avx512.c and adam_avx512bf16.c after each
 * sets its target and OFL_AVX512_NATIVE_BF16 (1: the bf16 param copy is converted with
 * AVX512_BF16's VCVTNEPS2BF16; 0: with integer operations). The two give the same bits.
 *
 * 16 lanes a vector; the last partial vector uses masked loads and stores, so there is
 * no scalar tail. Not a header of declarations: only those two files include it.
 */
#ifndef OFL_ADAM_AVX512_LOOP_H
#define OFL_ADAM_AVX512_LOOP_H

#include <immintrin.h>

#include "adam_internal.h"

#define OFL_AI static inline __attribute__((always_inline))

typedef struct {
    __m512 b1, omb1, b2, omb2, eps, step, ibc2, decay, l2, gscale;
} vcoeffs16;

OFL_AI __m512 load_grad16(int32_t dt, const void *g, int64_t i, __mmask16 k, int tail) {
    if (dt == OFL_DTYPE_F32) {
        const float *src = (const float *)g + i;
        return tail ? _mm512_maskz_loadu_ps(k, src) : _mm512_loadu_ps(src);
    }
    const uint16_t *src = (const uint16_t *)g + i;
    __m256i h = tail ? _mm256_maskz_loadu_epi16(k, src) : _mm256_loadu_si256((const __m256i *)src);
    if (dt == OFL_DTYPE_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Round to nearest even, NaN kept quiet: integer operations, any AVX-512 CPU. */
OFL_AI __m256i f32_to_bf16_16_int(__m512 x) {
    __m512i b = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(b, _mm512_set1_epi32(0x00400000)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

#if OFL_AVX512_NATIVE_BF16
/* The same with VCVTNEPS2BF16, one instruction: it too rounds to nearest even and sets
 * the quiet bit of a NaN, but it reads subnormal inputs as zero, where torch keeps
 * them; a vector holding one (rare: |p| < 2^-126) takes the integer path. */
OFL_AI __m256i f32_to_bf16_16(__m512 x) {
    if (__builtin_expect(_mm512_fpclass_ps_mask(x, 0x20) != 0, 0)) return f32_to_bf16_16_int(x);
    return (__m256i)_mm512_cvtneps_pbh(x);
}
#else
OFL_AI __m256i f32_to_bf16_16(__m512 x) { return f32_to_bf16_16_int(x); }
#endif

OFL_AI void store_out16(int32_t dt, void *out, int64_t i, __m512 x, __mmask16 k, int tail) {
    if (dt == OFL_DTYPE_NONE) return;
    if (dt == OFL_DTYPE_F32) {
        float *dst = (float *)out + i;
        if (tail) _mm512_mask_storeu_ps(dst, k, x);
        else _mm512_storeu_ps(dst, x);
        return;
    }
    __m256i h = dt == OFL_DTYPE_BF16
                    ? f32_to_bf16_16(x)
                    : _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    uint16_t *dst = (uint16_t *)out + i;
    if (tail) _mm256_mask_storeu_epi16(dst, k, h);
    else _mm256_storeu_si256((__m256i *)dst, h);
}

/* Master, exp_avg and exp_avg_sq vectors stored at element i (the first `k` lanes of a tail). */
OFL_AI void store3_16(float *p, float *m, float *v, int64_t i, __m512 pv, __m512 mv, __m512 vv, __mmask16 k,
                      int tail) {
    if (tail) {
        _mm512_mask_storeu_ps(p + i, k, pv);
        _mm512_mask_storeu_ps(m + i, k, mv);
        _mm512_mask_storeu_ps(v + i, k, vv);
    } else {
        _mm512_storeu_ps(p + i, pv);
        _mm512_storeu_ps(m + i, mv);
        _mm512_storeu_ps(v + i, vv);
    }
}

/* op, om, ov: a ring of two vectors where the old values go before the new ones are stored in
 * place (the journal of adam_undo.c, [Note: journal]), with *word set to base + the vectors
 * journaled so far after them; or NULL: no journal. Always a constant at the call, so the plain
 * loop compiles as it did without them. */
OFL_AI void update16(const vcoeffs16 *c, int32_t gd, int32_t od, int l2, float *p, const void *g,
                     float *m, float *v, void *out, int64_t i, __mmask16 k, int tail,
                     __m512 *bad, float *op, float *om, float *ov, uint64_t *word, uint64_t base) {
    __m512 pv = tail ? _mm512_maskz_loadu_ps(k, p + i) : _mm512_loadu_ps(p + i);
    __m512 mv = tail ? _mm512_maskz_loadu_ps(k, m + i) : _mm512_loadu_ps(m + i);
    __m512 vv = tail ? _mm512_maskz_loadu_ps(k, v + i) : _mm512_loadu_ps(v + i);
    if (op) {
        int64_t r = (i / 16 & 1) * 16; /* the journal's ring of two vectors */
        store3_16(op, om, ov, r, pv, mv, vv, k, tail);
        /* x86 stores reach memory in program order; these fences keep the compiler's order too */
        __atomic_store_n(word, base + ((uint64_t)(i / 16 + 1) << OFL_JOURNAL_VECTORS_SHIFT), __ATOMIC_RELEASE);
        __atomic_signal_fence(__ATOMIC_SEQ_CST);
    }
    __m512 gv = _mm512_mul_ps(load_grad16(gd, g, i, k, tail), c->gscale);
    /* g * 0 is 0 for finite g and NaN otherwise; the sum keeps any NaN. */
    *bad = _mm512_add_ps(*bad, _mm512_mul_ps(gv, _mm512_setzero_ps()));
    if (l2) gv = _mm512_fmadd_ps(c->l2, pv, gv);
    mv = _mm512_fmadd_ps(c->b1, mv, _mm512_mul_ps(c->omb1, gv));
    vv = _mm512_fmadd_ps(c->b2, vv, _mm512_mul_ps(_mm512_mul_ps(c->omb2, gv), gv));
    __m512 den = _mm512_fmadd_ps(_mm512_sqrt_ps(vv), c->ibc2, c->eps);
    pv = _mm512_fnmadd_ps(c->step, _mm512_div_ps(mv, den), _mm512_mul_ps(pv, c->decay));
    store3_16(p, m, v, i, pv, mv, vv, k, tail);
    store_out16(od, out, i, pv, k, tail);
}

OFL_AI int32_t adam_loop16_log(const ofl_adam_coeffs *s, int32_t gd, int32_t od, int l2, float *p,
                               const void *g, float *m, float *v, void *out, int64_t n, float *op, float *om,
                               float *ov, uint64_t *word, uint64_t base) {
    vcoeffs16 c = {
        _mm512_set1_ps(s->beta1),    _mm512_set1_ps(s->one_minus_beta1),
        _mm512_set1_ps(s->beta2),    _mm512_set1_ps(s->one_minus_beta2),
        _mm512_set1_ps(s->eps),      _mm512_set1_ps(s->step_size),
        _mm512_set1_ps(s->inv_bias2_sqrt), _mm512_set1_ps(s->decay_mul),
        _mm512_set1_ps(s->l2_decay), _mm512_set1_ps(s->grad_scale),
    };
    __m512 bad = _mm512_setzero_ps();
    int64_t i = 0;
#pragma GCC unroll 4
    for (; i + 16 <= n; i += 16) update16(&c, gd, od, l2, p, g, m, v, out, i, 0xffff, 0, &bad, op, om, ov, word, base);
    if (i < n) {
        __mmask16 k = (__mmask16)((1u << (n - i)) - 1u);
        update16(&c, gd, od, l2, p, g, m, v, out, i, k, 1, &bad, op, om, ov, word, base);
    }
    return _mm512_cmp_ps_mask(bad, bad, _CMP_UNORD_Q) != 0;
}

OFL_AI int32_t adam_loop16(const ofl_adam_coeffs *s, int32_t gd, int32_t od, int l2, float *p,
                           const void *g, float *m, float *v, void *out, int64_t n) {
    return adam_loop16_log(s, gd, od, l2, p, g, m, v, out, n, NULL, NULL, NULL, NULL, 0);
}

/* The journaled loop, in the scope of OFL_DEFINE_ADAM_LOG_KERNEL. */
#define OFL_ADAM_LOOP16_LOG(c, gd, od, l2, p, g, m, v, out, n) \
    adam_loop16_log(c, gd, od, l2, p, g, m, v, out, n, op, om, ov, word, base)

OFL_AI void sumsq_loop16(int32_t dt, const void *g, int64_t n, double *acc) {
    __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 x = load_grad16(dt, g, i, 0xffff, 0);
        __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
        __m512d hi = _mm512_cvtps_pd(_mm512_extractf32x8_ps(x, 1));
        a0 = _mm512_fmadd_pd(lo, lo, a0);
        a1 = _mm512_fmadd_pd(hi, hi, a1);
    }
    if (i < n) {
        __m512 x = load_grad16(dt, g, i, (__mmask16)((1u << (n - i)) - 1u), 1);
        __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
        __m512d hi = _mm512_cvtps_pd(_mm512_extractf32x8_ps(x, 1));
        a0 = _mm512_fmadd_pd(lo, lo, a0);
        a1 = _mm512_fmadd_pd(hi, hi, a1);
    }
    *acc += _mm512_reduce_add_pd(_mm512_add_pd(a0, a1));
}

/* One vector of the landing pass (see land_loop16). */
OFL_AI void land16(int32_t dt, int32_t dd, int acc_in, int zero_src, void *dst, void *src, int64_t i,
                   __mmask16 k, int tail, __m512d *a0, __m512d *a1) {
    __m512 x = load_grad16(dt, src, i, k, tail);
    if (dd == OFL_DTYPE_BF16) { /* the fp32 sum rounded to nearest even, and that value summed */
        uint16_t *h = (uint16_t *)dst + i;
        if (acc_in)
            x = _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                    tail ? _mm256_maskz_loadu_epi16(k, h) : _mm256_loadu_si256((const __m256i *)h)), 16)), x);
        __m256i r = f32_to_bf16_16(x);
        if (tail) _mm256_mask_storeu_epi16(h, k, r);
        else _mm256_storeu_si256((__m256i *)h, r);
        x = _mm512_maskz_mov_ps(k, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(r), 16)));
    } else {
        float *f = (float *)dst + i;
        if (acc_in) x = _mm512_add_ps(tail ? _mm512_maskz_loadu_ps(k, f) : _mm512_loadu_ps(f), x);
        if (tail) _mm512_mask_storeu_ps(f, k, x);
        else _mm512_storeu_ps(f, x);
    }
    if (zero_src) {
        if (dt == OFL_DTYPE_F32) {
            if (tail) _mm512_mask_storeu_ps((float *)src + i, k, _mm512_setzero_ps());
            else _mm512_storeu_ps((float *)src + i, _mm512_setzero_ps());
        } else {
            uint16_t *h = (uint16_t *)src + i;
            if (tail) _mm256_mask_storeu_epi16(h, k, _mm256_setzero_si256());
            else _mm256_storeu_si256((__m256i *)h, _mm256_setzero_si256());
        }
    }
    __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    __m512d hi = _mm512_cvtps_pd(_mm512_extractf32x8_ps(x, 1));
    *a0 = _mm512_fmadd_pd(lo, lo, *a0);
    *a1 = _mm512_fmadd_pd(hi, hi, *a1);
}

/* The landing pass; lanes and order as sumsq_loop16, so its partials are the same. */
OFL_AI void land_loop16(int32_t dt, int32_t dd, int acc_in, int zero_src, void *dst, void *src, int64_t n,
                        double *acc) {
    __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) land16(dt, dd, acc_in, zero_src, dst, src, i, 0xffff, 0, &a0, &a1);
    if (i < n)
        land16(dt, dd, acc_in, zero_src, dst, src, i, (__mmask16)((1u << (n - i)) - 1u), 1, &a0, &a1);
    *acc += _mm512_reduce_add_pd(_mm512_add_pd(a0, a1));
}

#endif /* OFL_ADAM_AVX512_LOOP_H */
