/* Scalar Adam: the reference path, and the only one on CPUs without AVX2. */
#include "adam_internal.h"

int32_t ofl_adam_kernel_scalar(const ofl_adam_coeffs *c, int32_t grad_dtype, int32_t out_dtype,
                               float *p, const void *g, float *m, float *v, void *out,
                               int64_t n) {
    int32_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        float gs = ofl_adam_update1(c, grad_dtype, out_dtype, p, g, m, v, out, i);
        bad |= !isfinite(gs);
    }
    return bad;
}

void ofl_sumsq_kernel_scalar(int32_t dtype, const void *g, int64_t n, double *acc) {
    double s = 0.0;
    for (int64_t i = 0; i < n; i++) {
        double x = ofl_load_grad1(dtype, g, i);
        s += x * x;
    }
    *acc += s;
}
