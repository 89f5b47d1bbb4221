/* Scalar Adam: the reference path, and the only one on CPUs without AVX2.
 * Each (grad, out) dtype pair gets its own copy of the loop, so the compiler can
 * vectorize it with whatever the baseline target allows. */
#include "adam_internal.h"

#define OFL_AI static inline __attribute__((always_inline))

OFL_AI int32_t adam_loop1(const ofl_adam_coeffs *c, int32_t gd, int32_t od, float *p,
                          const void *g, float *m, float *v, void *out, int64_t n) {
    int32_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        float gs = ofl_adam_update1(c, gd, od, p, g, m, v, out, i);
        bad |= !isfinite(gs);
    }
    return bad;
}

#define OFL_OUT_CASES(GD)                                                             \
    switch (out_dtype) {                                                              \
    case OFL_DTYPE_NONE: return adam_loop1(c, GD, OFL_DTYPE_NONE, p, g, m, v, out, n); \
    case OFL_DTYPE_F32: return adam_loop1(c, GD, OFL_DTYPE_F32, p, g, m, v, out, n);   \
    case OFL_DTYPE_BF16: return adam_loop1(c, GD, OFL_DTYPE_BF16, p, g, m, v, out, n); \
    default: return adam_loop1(c, GD, OFL_DTYPE_F16, p, g, m, v, out, n);              \
    }

int32_t ofl_adam_kernel_scalar(const ofl_adam_coeffs *c, int32_t grad_dtype, int32_t out_dtype,
                               float *p, const void *g, float *m, float *v, void *out,
                               int64_t n) {
    switch (grad_dtype) {
    case OFL_DTYPE_F32: OFL_OUT_CASES(OFL_DTYPE_F32)
    case OFL_DTYPE_BF16: OFL_OUT_CASES(OFL_DTYPE_BF16)
    default: OFL_OUT_CASES(OFL_DTYPE_F16)
    }
}

OFL_AI void sumsq_loop1(int32_t dt, const void *g, int64_t n, double *acc) {
    double s = 0.0;
    for (int64_t i = 0; i < n; i++) {
        double x = ofl_load_grad1(dt, g, i);
        s += x * x;
    }
    *acc += s;
}

void ofl_sumsq_kernel_scalar(int32_t dtype, const void *g, int64_t n, double *acc) {
    switch (dtype) {
    case OFL_DTYPE_F32: sumsq_loop1(OFL_DTYPE_F32, g, n, acc); break;
    case OFL_DTYPE_BF16: sumsq_loop1(OFL_DTYPE_BF16, g, n, acc); break;
    default: sumsq_loop1(OFL_DTYPE_F16, g, n, acc); break;
    }
}
