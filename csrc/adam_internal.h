/* Shared by the Adam dispatch and the per-ISA kernels; not part of the cffi API. */
#ifndef OFL_ADAM_INTERNAL_H
#define OFL_ADAM_INTERNAL_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "ofl_adam.h"

/* Per-tensor constants of one step, derived once in double and rounded to float.
 *   g' = g * grad_scale + l2_decay * p
 *   m  = beta1 * m + (1 - beta1) * g'
 *   v  = beta2 * v + (1 - beta2) * g'^2
 *   p  = p * decay_mul - step_size * m / (sqrt(v) * inv_bias2_sqrt + eps)
 * which is torch.optim.Adam (l2_decay = wd, decay_mul = 1) or AdamW
 * (l2_decay = 0, decay_mul = 1 - lr * wd), with step_size = lr / (1 - beta1^t)
 * and inv_bias2_sqrt = 1 / sqrt(1 - beta2^t) when bias correction is on. */
typedef struct {
    float beta1, one_minus_beta1;
    float beta2, one_minus_beta2;
    float eps;
    float step_size;
    float inv_bias2_sqrt;
    float decay_mul;
    float l2_decay;
    float grad_scale;
} ofl_adam_coeffs;

/* A kernel updates n elements of one tensor and returns 1 if a scaled gradient
 * was not finite. grad_dtype/out_dtype are OFL_DTYPE_* values. */
typedef int32_t (*ofl_adam_kernel_fn)(const ofl_adam_coeffs *c, int32_t grad_dtype,
                                      int32_t out_dtype, float *p, const void *g, float *m,
                                      float *v, void *out, int64_t n);

/* The grid of the virtual concatenation that work is cut on (256 KiB of each fp32
 * stream): each thread walks its own run of chunks, then steals whole chunks
 * ([Note: static shares with stealing]). The grid is the same for every thread count,
 * so a tensor is cut at the same places (the AVX2 path's scalar tails) and the grad
 * norm's per-chunk partials are the same: results do not depend on the thread count.
 * A multiple of 64, so chunks start on whole cache lines of every stream. */
#define OFL_CHUNK_ELEMS 65536

/* ---- one Adam call's work, shared by ofl_adam_step (adam.c) and the undo-logged pass
 * (adam_undo.c) ---- */

typedef struct {
    const ofl_adam_config *cfg;
    const ofl_adam_tensors *t;
    ofl_adam_coeffs *coeffs; /* per tensor */
    int64_t *starts;         /* count + 1 prefix sums of numel */
    ofl_adam_kernel_fn kernel;
    int32_t nonfinite;
} ofl_adam_job;

/* Validates the call, resolves the ISA and, when count > 0, derives each tensor's
 * constants (incrementing its step) and the prefix starts. 0 or -errno (nothing modified,
 * nothing to free). */
int32_t ofl_adam_job_init(ofl_adam_job *job, const ofl_adam_config *cfg, const ofl_adam_tensors *t);
void ofl_adam_job_free(ofl_adam_job *job);
/* The update of elements [off, off + len) of tensor i (an ofl_segment_fn over a job). */
void ofl_adam_job_segment(void *ctx, int64_t i, int64_t off, int64_t len);

typedef void (*ofl_segment_fn)(void *ctx, int64_t tensor, int64_t offset, int64_t len);
/* Visits the pieces of tensors that [lo, hi) of the virtual concatenation covers. */
void ofl_walk_share(const int64_t *starts, int64_t count, int64_t lo, int64_t hi,
                    ofl_segment_fn visit, void *ctx);
int64_t *ofl_prefix_starts(const int64_t *numel, int64_t count);
/* The threads worth waking for `total` elements, at most `requested`. */
int32_t ofl_effective_threads(int32_t requested, int64_t total);

/* Sum of squares of n gradient elements, added to *acc. */
typedef void (*ofl_sumsq_kernel_fn)(int32_t dtype, const void *g, int64_t n, double *acc);

/* Landing of n gradient elements: dst = src (accumulate 0) or dst += src (1), dst of
 * dst_dtype F32 or BF16 (the fp32 sum rounded to nearest even), src set to zero once read
 * when zero_src is 1, and the sum of squares of the landed dst added to *acc, with the
 * lanes and order of the ISA's sumsq kernel (the same partials). */
typedef void (*ofl_land_kernel_fn)(int32_t dtype, int32_t dst_dtype, int32_t accumulate, int32_t zero_src,
                                   void *dst, void *src, int64_t n, double *acc);

int32_t ofl_adam_kernel_scalar(const ofl_adam_coeffs *c, int32_t grad_dtype, int32_t out_dtype,
                               float *p, const void *g, float *m, float *v, void *out,
                               int64_t n);
void ofl_sumsq_kernel_scalar(int32_t dtype, const void *g, int64_t n, double *acc);
void ofl_land_kernel_scalar(int32_t dtype, int32_t dst_dtype, int32_t accumulate, int32_t zero_src,
                            void *dst, void *src, int64_t n, double *acc);

#if defined(__x86_64__) && defined(__GNUC__)
#define OFL_HAVE_X86 1
int32_t ofl_adam_kernel_avx2(const ofl_adam_coeffs *c, int32_t grad_dtype, int32_t out_dtype,
                             float *p, const void *g, float *m, float *v, void *out, int64_t n);
int32_t ofl_adam_kernel_avx512(const ofl_adam_coeffs *c, int32_t grad_dtype, int32_t out_dtype,
                               float *p, const void *g, float *m, float *v, void *out,
                               int64_t n);
int32_t ofl_adam_kernel_avx512bf16(const ofl_adam_coeffs *c, int32_t grad_dtype, int32_t out_dtype,
                                   float *p, const void *g, float *m, float *v, void *out,
                                   int64_t n);
int32_t ofl_adam_log_kernel_avx512(const ofl_adam_coeffs *c, int32_t grad_dtype, int32_t out_dtype,
                                   float *p, const void *g, float *m, float *v, void *out, int64_t n,
                                   float *op, float *om, float *ov, uint64_t *word, uint64_t base);
int32_t ofl_adam_log_kernel_avx512bf16(const ofl_adam_coeffs *c, int32_t grad_dtype, int32_t out_dtype,
                                       float *p, const void *g, float *m, float *v, void *out, int64_t n,
                                       float *op, float *om, float *ov, uint64_t *word, uint64_t base);
void ofl_sumsq_kernel_avx2(int32_t dtype, const void *g, int64_t n, double *acc);
void ofl_sumsq_kernel_avx512(int32_t dtype, const void *g, int64_t n, double *acc);
void ofl_land_kernel_avx2(int32_t dtype, int32_t dst_dtype, int32_t accumulate, int32_t zero_src, void *dst, void *src,
                          int64_t n, double *acc);
void ofl_land_kernel_avx512(int32_t dtype, int32_t dst_dtype, int32_t accumulate, int32_t zero_src, void *dst, void *src,
                            int64_t n, double *acc);
#else
#define OFL_HAVE_X86 0
#endif

/* ---- scalar conversions, used by the scalar path and by the vector tails ---- */

static inline float ofl_bits_to_f32(uint32_t x) {
    float f;
    memcpy(&f, &x, sizeof f);
    return f;
}

static inline uint32_t ofl_f32_to_bits(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    return x;
}

static inline float ofl_bf16_to_f32(uint16_t h) { return ofl_bits_to_f32((uint32_t)h << 16); }

/* Round to nearest even; NaN stays a (quiet) NaN. */
static inline uint16_t ofl_f32_to_bf16(float f) {
    uint32_t x = ofl_f32_to_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x0040u);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

static inline float ofl_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    if (exp == 0x1fu) return ofl_bits_to_f32(sign | 0x7f800000u | (mant << 13));
    if (exp != 0) return ofl_bits_to_f32(sign | ((exp + 112u) << 23) | (mant << 13));
    /* zero or subnormal: mant * 2^-24, exact in float */
    float f = (float)mant * 5.9604644775390625e-08f;
    return ofl_bits_to_f32(ofl_f32_to_bits(f) | sign);
}

/* Round to nearest even, overflow to inf, subnormals kept, NaN stays NaN. */
static inline uint16_t ofl_f32_to_f16(float f) {
    uint32_t x = ofl_f32_to_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520 rounds to inf */
    if (ax >= 0x38800000u) {                                  /* normal in fp16 */
        uint32_t r = ax - 0x38000000u;                        /* rebias 127 -> 15 */
        r += 0xfffu + ((r >> 13) & 1u);
        return (uint16_t)(sign | (r >> 13));
    }
    if (ax < 0x33000000u) return sign; /* below half the smallest subnormal */
    uint32_t e = ax >> 23;
    uint32_t mant = (ax & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126u - e; /* 14..24 */
    uint32_t q = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) q++;
    return (uint16_t)(sign | q);
}

static inline float ofl_load_grad1(int32_t dtype, const void *g, int64_t i) {
    switch (dtype) {
    case OFL_DTYPE_BF16: return ofl_bf16_to_f32(((const uint16_t *)g)[i]);
    case OFL_DTYPE_F16: return ofl_f16_to_f32(((const uint16_t *)g)[i]);
    default: return ((const float *)g)[i];
    }
}

static inline void ofl_store_out1(int32_t dtype, void *out, int64_t i, float p) {
    switch (dtype) {
    case OFL_DTYPE_BF16: ((uint16_t *)out)[i] = ofl_f32_to_bf16(p); break;
    case OFL_DTYPE_F16: ((uint16_t *)out)[i] = ofl_f32_to_f16(p); break;
    case OFL_DTYPE_F32: ((float *)out)[i] = p; break;
    default: break;
    }
}

/* One element of the update; returns the scaled gradient so callers can test it. */
static inline float ofl_adam_update1(const ofl_adam_coeffs *c, int32_t grad_dtype,
                                     int32_t out_dtype, int l2, float *p, const void *g,
                                     float *m, float *v, void *out, int64_t i) {
    float pi = p[i];
    float gi = ofl_load_grad1(grad_dtype, g, i) * c->grad_scale;
    float gs = gi;
    if (l2) gi = gi + c->l2_decay * pi;
    float mi = c->beta1 * m[i] + c->one_minus_beta1 * gi;
    float vi = c->beta2 * v[i] + c->one_minus_beta2 * gi * gi;
    float denom = sqrtf(vi) * c->inv_bias2_sqrt + c->eps;
    pi = pi * c->decay_mul - c->step_size * (mi / denom);
    m[i] = mi;
    v[i] = vi;
    p[i] = pi;
    ofl_store_out1(out_dtype, out, i, pi);
    return gs;
}

/* ---- per-ISA entry points ----
 * Each ISA file writes one always-inline loop
 *   LOOP(c, grad_dtype, out_dtype, l2, p, g, m, v, out, n) -> nonfinite flag
 *   SUMSQ_LOOP(dtype, g, n, acc)
 * and these macros define its entry points, which call the loop with every dtype pair
 * (and the L2 term on or off) as constants, so each combination is compiled
 * separately with its conversions folded in. */
#define OFL_ADAM_OUT_CASES(LOOP, GD, L2)                                          \
    switch (out_dtype) {                                                          \
    case OFL_DTYPE_NONE: return LOOP(c, GD, OFL_DTYPE_NONE, L2, p, g, m, v, out, n); \
    case OFL_DTYPE_F32: return LOOP(c, GD, OFL_DTYPE_F32, L2, p, g, m, v, out, n);   \
    case OFL_DTYPE_BF16: return LOOP(c, GD, OFL_DTYPE_BF16, L2, p, g, m, v, out, n); \
    default: return LOOP(c, GD, OFL_DTYPE_F16, L2, p, g, m, v, out, n);              \
    }

#define OFL_ADAM_GRAD_CASES(LOOP, L2)                                 \
    switch (grad_dtype) {                                             \
    case OFL_DTYPE_F32: OFL_ADAM_OUT_CASES(LOOP, OFL_DTYPE_F32, L2)   \
    case OFL_DTYPE_BF16: OFL_ADAM_OUT_CASES(LOOP, OFL_DTYPE_BF16, L2) \
    default: OFL_ADAM_OUT_CASES(LOOP, OFL_DTYPE_F16, L2)              \
    }

#define OFL_DEFINE_ADAM_KERNEL(NAME, LOOP)                                                    \
    int32_t NAME(const ofl_adam_coeffs *c, int32_t grad_dtype, int32_t out_dtype, float *p,  \
                 const void *g, float *m, float *v, void *out, int64_t n) {                  \
        /* the L2 term is left out at 0: 0 * inf would turn an inf param into NaN */          \
        if (c->l2_decay != 0.0f) OFL_ADAM_GRAD_CASES(LOOP, 1)                                 \
        OFL_ADAM_GRAD_CASES(LOOP, 0)                                                          \
    }

/* The same, journaled: each vector's old master and moments to (op, om, ov) at (vector & 1) * 16,
 * then *word set to base + (vectors done << OFL_JOURNAL_VECTORS_SHIFT), then the new values in
 * place (adam_undo.c, [Note: journal]). x86 only: it relies on stores reaching memory in program order. */
#define OFL_JOURNAL_VECTORS_SHIFT 18
typedef int32_t (*ofl_adam_log_kernel_fn)(const ofl_adam_coeffs *c, int32_t grad_dtype, int32_t out_dtype,
                                          float *p, const void *g, float *m, float *v, void *out, int64_t n,
                                          float *op, float *om, float *ov, uint64_t *word, uint64_t base);

#define OFL_DEFINE_ADAM_LOG_KERNEL(NAME, LOOP)                                                       \
    int32_t NAME(const ofl_adam_coeffs *c, int32_t grad_dtype, int32_t out_dtype, float *p,         \
                 const void *g, float *m, float *v, void *out, int64_t n, float *op, float *om,     \
                 float *ov, uint64_t *word, uint64_t base) {                                        \
        if (c->l2_decay != 0.0f) OFL_ADAM_GRAD_CASES(LOOP, 1)                                        \
        OFL_ADAM_GRAD_CASES(LOOP, 0)                                                                 \
    }

#define OFL_DEFINE_SUMSQ_KERNEL(NAME, SUMSQ_LOOP)                           \
    void NAME(int32_t dtype, const void *g, int64_t n, double *acc) {       \
        switch (dtype) {                                                    \
        case OFL_DTYPE_F32: SUMSQ_LOOP(OFL_DTYPE_F32, g, n, acc); break;    \
        case OFL_DTYPE_BF16: SUMSQ_LOOP(OFL_DTYPE_BF16, g, n, acc); break;  \
        default: SUMSQ_LOOP(OFL_DTYPE_F16, g, n, acc); break;               \
        }                                                                   \
    }

/* LAND_LOOP(dtype, dst_dtype, accumulate, zero_src, dst, src, n, acc) with all four as constants. */
#define OFL_LAND_FLAG_CASES(LAND_LOOP, DT, DD)                               \
    switch (accumulate * 2 + zero_src) {                                     \
    case 0: LAND_LOOP(DT, DD, 0, 0, dst, src, n, acc); return;               \
    case 1: LAND_LOOP(DT, DD, 0, 1, dst, src, n, acc); return;               \
    case 2: LAND_LOOP(DT, DD, 1, 0, dst, src, n, acc); return;               \
    default: LAND_LOOP(DT, DD, 1, 1, dst, src, n, acc); return;              \
    }

#define OFL_LAND_SRC_CASES(LAND_LOOP, DD)                                    \
    switch (dtype) {                                                         \
    case OFL_DTYPE_F32: OFL_LAND_FLAG_CASES(LAND_LOOP, OFL_DTYPE_F32, DD)     \
    case OFL_DTYPE_BF16: OFL_LAND_FLAG_CASES(LAND_LOOP, OFL_DTYPE_BF16, DD)   \
    default: OFL_LAND_FLAG_CASES(LAND_LOOP, OFL_DTYPE_F16, DD)                \
    }

#define OFL_DEFINE_LAND_KERNEL(NAME, LAND_LOOP)                                                  \
    void NAME(int32_t dtype, int32_t dst_dtype, int32_t accumulate, int32_t zero_src, void *dst,  \
              void *src, int64_t n, double *acc) {                                               \
        if (dst_dtype == OFL_DTYPE_BF16) {                                                       \
            OFL_LAND_SRC_CASES(LAND_LOOP, OFL_DTYPE_BF16)                                        \
        }                                                                                        \
        OFL_LAND_SRC_CASES(LAND_LOOP, OFL_DTYPE_F32)                                             \
    }

/* One element of the landing pass into dst of dst_dtype (F32, or BF16: the fp32 sum rounded
 * to nearest even); returns the landed value as stored. */
static inline float ofl_land1(int32_t dtype, int32_t dst_dtype, int acc_in, int zero_src, void *dst, void *src,
                              int64_t i) {
    float x = ofl_load_grad1(dtype, src, i);
    if (dst_dtype == OFL_DTYPE_BF16) {
        uint16_t *d = (uint16_t *)dst;
        if (acc_in) x = ofl_bf16_to_f32(d[i]) + x;
        d[i] = ofl_f32_to_bf16(x);
        x = ofl_bf16_to_f32(d[i]);
    } else {
        float *d = (float *)dst;
        if (acc_in) x = d[i] + x;
        d[i] = x;
    }
    if (zero_src) {
        if (dtype == OFL_DTYPE_F32) ((float *)src)[i] = 0.0f;
        else ((uint16_t *)src)[i] = 0;
    }
    return x;
}

#endif /* OFL_ADAM_INTERNAL_H */
