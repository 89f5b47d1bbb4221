/* Scalar Adam: the reference path, and the only one on CPUs without AVX2. */
#include "adam_internal.h"

#define OFL_AI static inline __attribute__((always_inline))

OFL_AI int32_t adam_loop1(const ofl_adam_coeffs *c, int32_t gd, int32_t od, int l2, float *p,
                          const void *g, float *m, float *v, void *out, int64_t n) {
    int32_t bad = 0;
    for (int64_t i = 0; i < n; i++)
        bad |= !isfinite(ofl_adam_update1(c, gd, od, l2, p, g, m, v, out, i));
    return bad;
}

OFL_DEFINE_ADAM_KERNEL(ofl_adam_kernel_scalar, adam_loop1)

OFL_AI void sumsq_loop1(int32_t dt, const void *g, int64_t n, double *acc) {
    double s = 0.0;
    for (int64_t i = 0; i < n; i++) {
        double x = ofl_load_grad1(dt, g, i);
        s += x * x;
    }
    *acc += s;
}

OFL_DEFINE_SUMSQ_KERNEL(ofl_sumsq_kernel_scalar, sumsq_loop1)

OFL_AI void land_loop1(int32_t dt, int32_t dd, int acc_in, int zero_src, void *dst, void *src, int64_t n,
                       double *acc) {
    double s = 0.0;
    for (int64_t i = 0; i < n; i++) {
        double x = ofl_land1(dt, dd, acc_in, zero_src, dst, src, i);
        s += x * x;
    }
    *acc += s;
}

OFL_DEFINE_LAND_KERNEL(ofl_land_kernel_scalar, land_loop1)
