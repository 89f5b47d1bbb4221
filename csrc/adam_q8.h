/* Adam over compressed moments (bf16 or 8-bit blockwise): what the dispatch in adam_q8.c
 * and the per-ISA kernels (adam_q8_scalar.c, adam_q8_avx2.c, adam_q8_avx512.c) share.
 * Not part of the cffi API; see [Note: quantized Adam states] in ofl_adam.h.
 *
 * [Note: one operation sequence for every ISA]
 * Every path computes each element with the same IEEE operations in the same order:
 *   m0 = map[code] * scale                          (bf16: the exact widening)
 *   g  = grad * grad_scale;  g = fma(l2_decay, p, g) when L2 decay is on
 *   m  = fma(beta1, m0, (1 - beta1) * g)
 *   v  = fma(beta2, v0, ((1 - beta2) * g) * g)
 *   p  = fma(-step_size, m / fma(sqrt(v), inv_bias2_sqrt, eps), p * decay_mul)
 * (the scalar path calls fmaf, the vector paths their FMA instructions), and quantizing
 * is integer work on the float's bits (see ofl_q8_code1), so scalar, AVX2 and AVX-512
 * give the same bits; the block maximum is an integer maximum of |x|'s bits, which does
 * not depend on the order it is taken in. */
#ifndef OFL_ADAM_Q8_H
#define OFL_ADAM_Q8_H

#include "adam_internal.h"

/* [Note: the code of a value]
 * a = min(|x| / scale, 1) (NaN -> 1). Its decade d is how many of 10^-1 .. 10^-(D-1) are >= a
 * (D decades in the map, [Note: the dynamic map] in adam_q8.c), and its code, unrounded,
 * s = fma(a, gain_d, offset_d) with gain_d = 10^d c_d / 0.9 and offset_d = c_d - 1 - 0.1 c_d / 0.9
 * (each computed in double and rounded to float once): s is c_d - 1 (the top code of the decade
 * below) at 10^-(d+1) and c_d + j, the code of the decade's j-th value, at that value. The code
 * is s rounded to the nearest integer (ties to even), clamped to the map: the nearest map value
 * but for float rounding within ~2^-16 of a level of a midpoint, and below the smallest decade's
 * midpoint with 10^-D, zero. One fma and two lookups by d; the same float operations on every
 * path, each table a register or a few. */
#define OFL_Q8_DECADES_MAX 8

typedef struct {
    float value[2][256];                     /* map -> code -> value */
    float thr[2][OFL_Q8_DECADES_MAX];        /* 10^-(k+1): a <= thr[k] is one decade further down */
    float gain[2][OFL_Q8_DECADES_MAX];       /* 10^d c_d / 0.9 */
    float offset[2][OFL_Q8_DECADES_MAX];     /* c_d - 1 - 0.1 c_d / 0.9 (c_d - 1: the code before decade d) */
    int32_t decades[2];
    int32_t top[2];                          /* the largest magnitude code */
    /* The decade by the float's exponent (AVX-512): for a in [2^-e, 2^(1-e)), e = 0..31 (all
     * smaller a as e = 31), first_decade[e] counts the thresholds >= 2^(1-e), all of which a is
     * under; at most one more (thr_or_none[first_decade[e]]) lies in the interval, as decades are
     * wider than octaves. thr_or_none is thr with -1 for the last decade (none below it). */
    int32_t first_decade[2][32];
    float thr_or_none[2][OFL_Q8_DECADES_MAX];
    /* The same by the biased exponent x of a (x & 31 for x = 96..127, i.e. 31 - e, smaller a
     * clamped to x = 96), for a lookup by the exponent field itself; and thr_or_none of it. */
    int32_t decade_by_exp[2][32];
    float thr_by_exp[2][32];
    /* Byte k of value[map][code] at plane[map][k][code] (the AVX512_VBMI lookups). */
    uint8_t plane[2][4][256] __attribute__((aligned(64)));
} ofl_q8_tables;

/* Built once (pthread_once) by ofl_q8_tables_get; read only afterwards. */
const ofl_q8_tables *ofl_q8_tables_get(void);

/* The constants of a step, ISA resolution and the fp32-moment kernel of an ISA, from adam.c. */
void ofl_adam_coeffs_for(const ofl_adam_config *cfg, float *step, ofl_adam_coeffs *c);
int32_t ofl_adam_resolve_isa(int32_t isa, int32_t *resolved);
ofl_adam_kernel_fn ofl_adam_kernel_for(int32_t isa);

/* n elements (n need not be a multiple of the block) starting at a block boundary;
 * ms/vs: the scales of the first block (Q8), else unused. Returns 1 if a scaled
 * gradient was not finite. sd: OFL_STATE_BF16 or _Q8. */
typedef int32_t (*ofl_adamq_kernel_fn)(const ofl_adam_coeffs *c, int32_t gd, int32_t od, int32_t sd,
                                       float *p, const void *g, void *m, void *v, float *ms,
                                       float *vs, void *out, int64_t n);
/* n <= OFL_Q8_BLOCK elements of one block: scale and codes; and back. */
typedef void (*ofl_q8_quant_fn)(const ofl_q8_tables *t, int32_t map, const float *x, uint8_t *codes,
                                float *scale, int64_t n);
typedef void (*ofl_q8_dequant_fn)(const ofl_q8_tables *t, int32_t map, const uint8_t *codes, float scale,
                                  float *x, int64_t n);

#define OFL_Q8_DECLARE(SUFFIX)                                                                       \
    int32_t ofl_adamq_kernel_##SUFFIX(const ofl_adam_coeffs *c, int32_t gd, int32_t od, int32_t sd,  \
                                      float *p, const void *g, void *m, void *v, float *ms,          \
                                      float *vs, void *out, int64_t n);                              \
    void ofl_q8_quant_##SUFFIX(const ofl_q8_tables *t, int32_t map, const float *x, uint8_t *codes,  \
                               float *scale, int64_t n);                                             \
    void ofl_q8_dequant_##SUFFIX(const ofl_q8_tables *t, int32_t map, const uint8_t *codes,          \
                                 float scale, float *x, int64_t n);

OFL_Q8_DECLARE(scalar)
#if OFL_HAVE_X86
OFL_Q8_DECLARE(avx2)
OFL_Q8_DECLARE(avx512)
OFL_Q8_DECLARE(avx512vbmi)
#endif

/* ---- the scalar reference of each step, used by the scalar path and the AVX2 tails ---- */

/* |x| bits of the block's largest magnitude (an order-free integer maximum). */
static inline uint32_t ofl_q8_absbits(float x) { return ofl_f32_to_bits(x) & 0x7fffffffu; }

/* The scale from the block's largest |x| bits, and its reciprocal (0 for a zero,
 * infinite or NaN scale: every value then codes as 0 or the top code, and decodes
 * to 0 * scale, so a non-finite moment stays non-finite as in the fp32 path). */
static inline float ofl_q8_inverse(float scale) { return scale > 0.0f ? 1.0f / scale : 0.0f; }

/* The code of x in a block of reciprocal scale inv ([Note: the code of a value]). */
static inline uint8_t ofl_q8_code1(const ofl_q8_tables *t, int32_t map, float x, float inv) {
    float a = ofl_bits_to_f32(ofl_q8_absbits(x)) * inv;
    a = a < 1.0f ? a : 1.0f; /* NaN -> 1, as the vector min */
    int d = 0;
    for (int k = 0; k < t->decades[map] - 1; k++) d += a <= t->thr[map][k];
    int32_t idx = (int32_t)lrintf(fmaf(a, t->gain[map][d], t->offset[map][d]));
    idx = idx > 0 ? idx : 0;
    idx = idx < t->top[map] ? idx : t->top[map];
    if (map == OFL_Q8_MAP_UNSIGNED) {
        if (idx == 0 && x > 0.0f) idx = 1; /* a positive v never codes as zero */
    } else {
        idx |= (int32_t)((ofl_f32_to_bits(x) >> 24) & 0x80u);
    }
    return (uint8_t)idx;
}

/* One element of the update from dequantized m0, v0; the new moments go to *mo, *vo.
 * Returns the scaled gradient so callers can test it. */
static inline float ofl_adamq_update1(const ofl_adam_coeffs *c, int32_t gd, int32_t od, int l2,
                                      float *p, const void *g, float m0, float v0, float *mo,
                                      float *vo, void *out, int64_t i) {
    float pi = p[i];
    float gi = ofl_load_grad1(gd, g, i) * c->grad_scale;
    float gs = gi;
    if (l2) gi = fmaf(c->l2_decay, pi, gi);
    float mi = fmaf(c->beta1, m0, c->one_minus_beta1 * gi);
    float gg = c->one_minus_beta2 * gi;
    float vi = fmaf(c->beta2, v0, gg * gi);
    float den = fmaf(sqrtf(vi), c->inv_bias2_sqrt, c->eps);
    float dec = pi * c->decay_mul;
    pi = fmaf(-c->step_size, mi / den, dec);
    p[i] = pi;
    ofl_store_out1(od, out, i, pi);
    *mo = mi;
    *vo = vi;
    return gs;
}

/* The per-ISA entry points call LOOP(c, GD, OD, L2, SD, ARGS()) with every combination as
 * constants, so each is compiled with its conversions folded in. ARGS names a function-like
 * macro giving the loop's remaining arguments (a plain name is not expanded on its way down). */
#define OFL_ADAMQ_ARGS() p, g, m, v, ms, vs, out, n
#define OFL_ADAMQ_SD_CASES(LOOP, ARGS, GD, OD, L2)                                  \
    if (sd == OFL_STATE_Q8) return LOOP(c, GD, OD, L2, OFL_STATE_Q8, ARGS());        \
    return LOOP(c, GD, OD, L2, OFL_STATE_BF16, ARGS());
#define OFL_ADAMQ_OUT_CASES(LOOP, ARGS, GD, L2)                                            \
    switch (od) {                                                                          \
    case OFL_DTYPE_NONE: OFL_ADAMQ_SD_CASES(LOOP, ARGS, GD, OFL_DTYPE_NONE, L2)            \
    case OFL_DTYPE_F32: OFL_ADAMQ_SD_CASES(LOOP, ARGS, GD, OFL_DTYPE_F32, L2)              \
    case OFL_DTYPE_BF16: OFL_ADAMQ_SD_CASES(LOOP, ARGS, GD, OFL_DTYPE_BF16, L2)            \
    default: OFL_ADAMQ_SD_CASES(LOOP, ARGS, GD, OFL_DTYPE_F16, L2)                         \
    }
#define OFL_ADAMQ_GRAD_CASES(LOOP, ARGS, L2)                                  \
    switch (gd) {                                                             \
    case OFL_DTYPE_F32: OFL_ADAMQ_OUT_CASES(LOOP, ARGS, OFL_DTYPE_F32, L2)    \
    case OFL_DTYPE_BF16: OFL_ADAMQ_OUT_CASES(LOOP, ARGS, OFL_DTYPE_BF16, L2)  \
    default: OFL_ADAMQ_OUT_CASES(LOOP, ARGS, OFL_DTYPE_F16, L2)               \
    }
/* The L2 term is a constant too: 0 when the decay is 0 (0 * inf would turn an inf param into NaN). */
#define OFL_ADAMQ_L2_CASES(LOOP, ARGS)                                  \
    if (c->l2_decay != 0.0f) OFL_ADAMQ_GRAD_CASES(LOOP, ARGS, 1)        \
    OFL_ADAMQ_GRAD_CASES(LOOP, ARGS, 0)
#define OFL_DEFINE_ADAMQ_KERNEL(NAME, LOOP)                                                          \
    int32_t NAME(const ofl_adam_coeffs *c, int32_t gd, int32_t od, int32_t sd, float *p,            \
                 const void *g, void *m, void *v, float *ms, float *vs, void *out, int64_t n) {     \
        OFL_ADAMQ_L2_CASES(LOOP, OFL_ADAMQ_ARGS)                                                    \
    }

#endif /* OFL_ADAM_Q8_H */
