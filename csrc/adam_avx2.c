/* AVX2 + FMA + F16C Adam: 8 lanes a vector, the last < 8 elements by the scalar update. */
#include "adam_internal.h"

#if OFL_HAVE_X86
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include "adam_avx2_lanes.h"

typedef struct {
    __m256 b1, omb1, b2, omb2, eps, step, ibc2, decay, l2, gscale;
} vcoeffs8;

OFL_AI void store_out8(int32_t dt, void *out, int64_t i, __m256 x) {
    if (dt == OFL_DTYPE_NONE) return;
    if (dt == OFL_DTYPE_F32) {
        _mm256_storeu_ps((float *)out + i, x);
        return;
    }
    __m128i h = dt == OFL_DTYPE_BF16
                    ? f32_to_bf16_8(x)
                    : _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128((__m128i *)((uint16_t *)out + i), h);
}

OFL_AI void update8(const vcoeffs8 *c, int32_t gd, int32_t od, int l2, float *p, const void *g,
                    float *m, float *v, void *out, int64_t i, __m256 *bad) {
    __m256 pv = _mm256_loadu_ps(p + i);
    __m256 mv = _mm256_loadu_ps(m + i);
    __m256 vv = _mm256_loadu_ps(v + i);
    __m256 gv = _mm256_mul_ps(load_grad8(gd, g, i), c->gscale);
    *bad = _mm256_add_ps(*bad, _mm256_mul_ps(gv, _mm256_setzero_ps()));
    if (l2) gv = _mm256_fmadd_ps(c->l2, pv, gv);
    mv = _mm256_fmadd_ps(c->b1, mv, _mm256_mul_ps(c->omb1, gv));
    vv = _mm256_fmadd_ps(c->b2, vv, _mm256_mul_ps(_mm256_mul_ps(c->omb2, gv), gv));
    __m256 den = _mm256_fmadd_ps(_mm256_sqrt_ps(vv), c->ibc2, c->eps);
    pv = _mm256_fnmadd_ps(c->step, _mm256_div_ps(mv, den), _mm256_mul_ps(pv, c->decay));
    _mm256_storeu_ps(p + i, pv);
    _mm256_storeu_ps(m + i, mv);
    _mm256_storeu_ps(v + i, vv);
    store_out8(od, out, i, pv);
}

OFL_AI int32_t adam_loop8(const ofl_adam_coeffs *s, int32_t gd, int32_t od, int l2, float *p,
                          const void *g, float *m, float *v, void *out, int64_t n) {
    vcoeffs8 c = {
        _mm256_set1_ps(s->beta1),    _mm256_set1_ps(s->one_minus_beta1),
        _mm256_set1_ps(s->beta2),    _mm256_set1_ps(s->one_minus_beta2),
        _mm256_set1_ps(s->eps),      _mm256_set1_ps(s->step_size),
        _mm256_set1_ps(s->inv_bias2_sqrt), _mm256_set1_ps(s->decay_mul),
        _mm256_set1_ps(s->l2_decay), _mm256_set1_ps(s->grad_scale),
    };
    __m256 bad = _mm256_setzero_ps();
    int64_t i = 0;
#pragma GCC unroll 4
    for (; i + 8 <= n; i += 8) update8(&c, gd, od, l2, p, g, m, v, out, i, &bad);
    int32_t nonfinite = _mm256_movemask_ps(_mm256_cmp_ps(bad, bad, _CMP_UNORD_Q)) != 0;
    for (; i < n; i++) nonfinite |= !isfinite(ofl_adam_update1(s, gd, od, l2, p, g, m, v, out, i));
    return nonfinite;
}

OFL_DEFINE_ADAM_KERNEL(ofl_adam_kernel_avx2, adam_loop8)

/* Squares of the 8 lanes of x added, in double, into two 4-lane accumulators. */
OFL_AI void square_into8(__m256 x, __m256d *a0, __m256d *a1) {
    __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
    __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    *a0 = _mm256_fmadd_pd(lo, lo, *a0);
    *a1 = _mm256_fmadd_pd(hi, hi, *a1);
}

OFL_AI double lanes_sum8(__m256d a0, __m256d a1) {
    double lanes[4];
    _mm256_storeu_pd(lanes, _mm256_add_pd(a0, a1));
    return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

OFL_AI void sumsq_loop8(int32_t dt, const void *g, int64_t n, double *acc) {
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) square_into8(load_grad8(dt, g, i), &a0, &a1);
    double s = lanes_sum8(a0, a1);
    for (; i < n; i++) {
        double x = ofl_load_grad1(dt, g, i);
        s += x * x;
    }
    *acc += s;
}

OFL_DEFINE_SUMSQ_KERNEL(ofl_sumsq_kernel_avx2, sumsq_loop8)

/* The landing pass; lanes and order as sumsq_loop8, so its partials are the same. */
OFL_AI void land_loop8(int32_t dt, int32_t dd, int acc_in, int zero_src, void *dst, void *src, int64_t n,
                       double *acc) {
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = load_grad8(dt, src, i);
        if (dd == OFL_DTYPE_BF16) { /* the fp32 sum rounded to nearest even, and that value summed */
            __m128i *h = (__m128i *)((uint16_t *)dst + i);
            if (acc_in)
                x = _mm256_add_ps(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(h)), 16)), x);
            __m128i r = f32_to_bf16_8(x);
            _mm_storeu_si128(h, r);
            x = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(r), 16));
        } else {
            if (acc_in) x = _mm256_add_ps(_mm256_loadu_ps((float *)dst + i), x);
            _mm256_storeu_ps((float *)dst + i, x);
        }
        if (zero_src) {
            if (dt == OFL_DTYPE_F32) _mm256_storeu_ps((float *)src + i, _mm256_setzero_ps());
            else _mm_storeu_si128((__m128i *)((uint16_t *)src + i), _mm_setzero_si128());
        }
        square_into8(x, &a0, &a1);
    }
    double s = lanes_sum8(a0, a1);
    for (; i < n; i++) {
        double x = ofl_land1(dt, dd, acc_in, zero_src, dst, src, i);
        s += x * x;
    }
    *acc += s;
}

OFL_DEFINE_LAND_KERNEL(ofl_land_kernel_avx2, land_loop8)
#endif /* OFL_HAVE_X86 */
