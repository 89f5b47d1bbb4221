/* Scalar Adam over compressed moments: the reference of the vector paths. */
#include "adam_q8.h"

#define OFL_AI static inline __attribute__((always_inline))

void ofl_q8_quant_scalar(const ofl_q8_tables *t, int32_t map, const float *x, uint8_t *codes,
                         float *scale, int64_t n) {
    uint32_t amax = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t b = ofl_q8_absbits(x[i]);
        amax = b > amax ? b : amax;
    }
    float s = ofl_bits_to_f32(amax);
    float inv = ofl_q8_inverse(s);
    *scale = s;
    for (int64_t i = 0; i < n; i++) codes[i] = ofl_q8_code1(t, map, x[i], inv);
}

void ofl_q8_dequant_scalar(const ofl_q8_tables *t, int32_t map, const uint8_t *codes, float scale,
                           float *x, int64_t n) {
    const float *val = t->value[map];
    for (int64_t i = 0; i < n; i++) x[i] = val[codes[i]] * scale;
}

/* One block of n <= OFL_Q8_BLOCK elements. */
OFL_AI int32_t block1(const ofl_q8_tables *t, const ofl_adam_coeffs *c, int32_t gd, int32_t od, int l2,
                      int32_t sd, float *p, const void *g, void *m, void *v, float *ms, float *vs,
                      void *out, int64_t n) {
    float bm[OFL_Q8_BLOCK], bv[OFL_Q8_BLOCK];
    int32_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        float m0, v0;
        if (sd == OFL_STATE_Q8) {
            m0 = t->value[OFL_Q8_MAP_SIGNED][((const uint8_t *)m)[i]] * ms[0];
            v0 = t->value[OFL_Q8_MAP_UNSIGNED][((const uint8_t *)v)[i]] * vs[0];
        } else {
            m0 = ofl_bf16_to_f32(((const uint16_t *)m)[i]);
            v0 = ofl_bf16_to_f32(((const uint16_t *)v)[i]);
        }
        bad |= !isfinite(ofl_adamq_update1(c, gd, od, l2, p, g, m0, v0, &bm[i], &bv[i], out, i));
        if (sd == OFL_STATE_BF16) {
            ((uint16_t *)m)[i] = ofl_f32_to_bf16(bm[i]);
            ((uint16_t *)v)[i] = ofl_f32_to_bf16(bv[i]);
        }
    }
    if (sd == OFL_STATE_Q8) {
        ofl_q8_quant_scalar(t, OFL_Q8_MAP_SIGNED, bm, (uint8_t *)m, ms, n);
        ofl_q8_quant_scalar(t, OFL_Q8_MAP_UNSIGNED, bv, (uint8_t *)v, vs, n);
    }
    return bad;
}

OFL_AI int32_t loop1(const ofl_adam_coeffs *c, int32_t gd, int32_t od, int l2, int32_t sd, float *p,
                     const void *g, void *m, void *v, float *ms, float *vs, void *out, int64_t n) {
    const ofl_q8_tables *t = ofl_q8_tables_get();
    int64_t es = sd == OFL_STATE_Q8 ? 1 : 2; /* bytes of a moment element */
    int64_t eg = gd == OFL_DTYPE_F32 ? 4 : 2, eo = od == OFL_DTYPE_F32 ? 4 : 2;
    int32_t bad = 0;
    for (int64_t b = 0, i = 0; i < n; b++, i += OFL_Q8_BLOCK) {
        int64_t len = n - i < OFL_Q8_BLOCK ? n - i : OFL_Q8_BLOCK;
        bad |= block1(t, c, gd, od, l2, sd, p + i, (const char *)g + i * eg, (char *)m + i * es,
                      (char *)v + i * es, sd == OFL_STATE_Q8 ? ms + b : NULL, sd == OFL_STATE_Q8 ? vs + b : NULL, out ? (char *)out + i * eo : NULL, len);
    }
    return bad;
}

OFL_DEFINE_ADAMQ_KERNEL(ofl_adamq_kernel_scalar, loop1)
