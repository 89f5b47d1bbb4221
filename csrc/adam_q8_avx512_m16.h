/* AVX-512 Adam over int8 moments with a bf16 master, fused: included by adam_q8_avx512.c and
 * adam_q8_avx512vbmi.c after adam_q8_avx512_loop.h, whose full-block passes it drives with the
 * master in bfloat16 ([Note: a bf16 master in the full-block pass] there). */

/* A bf16 master's n elements from element `first` (even) of its tensor: whole int8 blocks fused
 * ([Note: a bf16 master in the full-block pass]), any other block through an fp32 copy of its
 * masters rounded back as the tile path does. */
OFL_AI int32_t loop16_m16(const ofl_adam_coeffs *c, int32_t gd, int32_t od, int l2, int32_t sd, uint16_t *pm,
                          uint32_t key, uint32_t first, const void *g, void *m, void *v, float *ms, float *vs,
                          void *out, int64_t n) {
    const ofl_q8_tables *t = ofl_q8_tables_get();
    int64_t es = sd == OFL_STATE_Q8 ? 1 : 2;
    int64_t eg = gd == OFL_DTYPE_F32 ? 4 : 2, eo = od == OFL_DTYPE_F32 ? 4 : 2;
    int32_t bad = 0;
    staged_block st[2];
    staged_block *pending = NULL;
    const int unit = c->grad_scale == 1.0f;
    for (int64_t b = 0, i = 0; i < n; b++, i += OFL_Q8_BLOCK) {
        int64_t len = n - i < OFL_Q8_BLOCK ? n - i : OFL_Q8_BLOCK;
        if (sd == OFL_STATE_Q8 && len == OFL_Q8_BLOCK) {
            staged_block *sb = &st[b & 1];
            sb->p = NULL;
            sb->pm = pm + i;
            sb->key = key;
            sb->first = first + (uint32_t)i;
            sb->g = (const char *)g + i * eg;
            sb->mc = (uint8_t *)m + i;
            sb->vc = (uint8_t *)v + i;
            sb->ms = ms + b;
            sb->vs = vs + b;
            sb->out = out ? (char *)out + i * eo : NULL;
            if (unit) stage_moments(t, c, gd, l2, 1, 1, sb);
            else stage_moments(t, c, gd, l2, 0, 1, sb);
            if (pending) bad |= stage_params(t, c, gd, od, 1, pending);
            pending = sb;
            continue;
        }
        if (pending) bad |= stage_params(t, c, gd, od, 1, pending);
        pending = NULL;
        float wide[OFL_Q8_BLOCK] __attribute__((aligned(64)));
        uint32_t *w = (uint32_t *)wide;
        for (int64_t j = 0; j < len; j++) w[j] = (uint32_t)pm[i + j] << 16;
        bad |= block16(t, c, gd, OFL_DTYPE_NONE, l2, sd, wide, (const char *)g + i * eg, (char *)m + i * es,
                       (char *)v + i * es, sd == OFL_STATE_Q8 ? ms + b : NULL, sd == OFL_STATE_Q8 ? vs + b : NULL,
                       NULL, len);
        for (int64_t j = 0; j < len; j++) {
            pm[i + j] = ofl_bf16_sr1(w[j], ofl_sr_bits(key, first + (uint32_t)(i + j)));
            if (out) ofl_store_out1(od, (char *)out + i * eo, j, ofl_bf16_to_f32(pm[i + j]));
        }
    }
    if (pending) bad |= stage_params(t, c, gd, od, 1, pending);
    return bad;
}

#define OFL_ADAMQ_M16_ARGS pm, key, first, g, m, v, ms, vs, out, n
#define OFL_ADAMQ_M16_SD(GD, OD, L2)                                                             \
    if (sd == OFL_STATE_Q8) return loop16_m16(c, GD, OD, L2, OFL_STATE_Q8, OFL_ADAMQ_M16_ARGS);   \
    return loop16_m16(c, GD, OD, L2, OFL_STATE_BF16, OFL_ADAMQ_M16_ARGS);
#define OFL_ADAMQ_M16_OUT(GD, L2)                                                 \
    switch (od) {                                                                 \
    case OFL_DTYPE_NONE: OFL_ADAMQ_M16_SD(GD, OFL_DTYPE_NONE, L2)                 \
    case OFL_DTYPE_F32: OFL_ADAMQ_M16_SD(GD, OFL_DTYPE_F32, L2)                   \
    case OFL_DTYPE_BF16: OFL_ADAMQ_M16_SD(GD, OFL_DTYPE_BF16, L2)                 \
    default: OFL_ADAMQ_M16_SD(GD, OFL_DTYPE_F16, L2)                              \
    }
#define OFL_ADAMQ_M16_GRAD(L2)                                      \
    switch (gd) {                                                   \
    case OFL_DTYPE_F32: OFL_ADAMQ_M16_OUT(OFL_DTYPE_F32, L2)        \
    case OFL_DTYPE_BF16: OFL_ADAMQ_M16_OUT(OFL_DTYPE_BF16, L2)      \
    default: OFL_ADAMQ_M16_OUT(OFL_DTYPE_F16, L2)                   \
    }

int32_t OFL_Q8_FN(ofl_adamq_m16_kernel)(const ofl_adam_coeffs *c, int32_t gd, int32_t od, int32_t sd, uint16_t *pm,
                                        uint32_t key, uint32_t first, const void *g, void *m, void *v, float *ms,
                                        float *vs, void *out, int64_t n) {
    if (c->l2_decay != 0.0f) OFL_ADAMQ_M16_GRAD(1)
    OFL_ADAMQ_M16_GRAD(0)
}
