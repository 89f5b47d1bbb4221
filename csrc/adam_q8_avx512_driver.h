/* AVX-512 Adam over compressed moments, the walk over a segment's blocks: included by
 * adam_q8_avx512.c and adam_q8_avx512vbmi.c after adam_q8_avx512_loop.h, whose passes it drives,
 * with an fp32 master or a bf16 one ([Note: a bf16 master in the full-block pass] there); and the
 * kernels' two entry points. */

/* n elements of a segment. mb 0: the fp32 master p. mb 1: the bf16 master pm, from element
 * `first` (even, on a block) of a tensor of rounding key `key`; a block that is not a whole int8
 * one then goes through an fp32 copy of its masters, rounded back as the tile path does. */
OFL_AI int32_t drive16(const ofl_adam_coeffs *c, int32_t gd, int32_t od, int l2, int32_t sd, int mb, float *p,
                       uint16_t *pm, uint32_t key, uint32_t first, const void *g, void *m, void *v, float *ms,
                       float *vs, void *out, int64_t n) {
    const ofl_q8_tables *t = ofl_q8_tables_get();
    int64_t es = sd == OFL_STATE_Q8 ? 1 : 2;
    int64_t eg = gd == OFL_DTYPE_F32 ? 4 : 2, eo = od == OFL_DTYPE_F32 ? 4 : 2;
    int32_t bad = 0;
    /* Whole int8 blocks in a software pipeline: block b's moments, then block b - 1's params
     * and codes, so the wait for b - 1's scales is spent on b's work. */
    staged_block st[2];
    staged_block *pending = NULL;
    const int unit = c->grad_scale == 1.0f;
    for (int64_t b = 0, i = 0; i < n; b++, i += OFL_Q8_BLOCK) {
        int64_t len = n - i < OFL_Q8_BLOCK ? n - i : OFL_Q8_BLOCK;
        float *ms_b = sd == OFL_STATE_Q8 ? ms + b : NULL, *vs_b = sd == OFL_STATE_Q8 ? vs + b : NULL;
        char *out_b = out ? (char *)out + i * eo : NULL;
        if (sd == OFL_STATE_Q8 && len == OFL_Q8_BLOCK) {
            staged_block *sb = &st[b & 1];
            sb->p = mb ? NULL : p + i;
            sb->pm = mb ? pm + i : NULL;
            sb->key = key;
            sb->first = first + (uint32_t)i;
            sb->g = (const char *)g + i * eg;
            sb->mc = (uint8_t *)m + i;
            sb->vc = (uint8_t *)v + i;
            sb->ms = ms_b;
            sb->vs = vs_b;
            sb->out = out_b;
            if (unit) stage_moments(t, c, gd, l2, 1, mb, sb);
            else stage_moments(t, c, gd, l2, 0, mb, sb);
            if (pending) bad |= stage_params(t, c, gd, od, mb, pending);
            pending = sb;
            continue;
        }
        if (pending) bad |= stage_params(t, c, gd, od, mb, pending);
        pending = NULL;
        const char *g_b = (const char *)g + i * eg;
        char *m_b = (char *)m + i * es, *v_b = (char *)v + i * es;
        if (!mb) {
            bad |= block16(t, c, gd, od, l2, sd, p + i, g_b, m_b, v_b, ms_b, vs_b, out_b, len);
            continue;
        }
        float wide[OFL_Q8_BLOCK] __attribute__((aligned(64)));
        uint32_t *w = (uint32_t *)wide;
        for (int64_t j = 0; j < len; j++) w[j] = (uint32_t)pm[i + j] << 16;
        bad |= block16(t, c, gd, OFL_DTYPE_NONE, l2, sd, wide, g_b, m_b, v_b, ms_b, vs_b, NULL, len);
        for (int64_t j = 0; j < len; j++) {
            pm[i + j] = ofl_bf16_sr1(w[j], ofl_sr_bits(key, first + (uint32_t)(i + j)));
            if (out_b) ofl_store_out1(od, out_b, j, ofl_bf16_to_f32(pm[i + j]));
        }
    }
    if (pending) bad |= stage_params(t, c, gd, od, mb, pending);
    return bad;
}

OFL_AI int32_t loop16(const ofl_adam_coeffs *c, int32_t gd, int32_t od, int l2, int32_t sd, float *p,
                      const void *g, void *m, void *v, float *ms, float *vs, void *out, int64_t n) {
    return drive16(c, gd, od, l2, sd, 0, p, NULL, 0, 0, g, m, v, ms, vs, out, n);
}

OFL_AI int32_t loop16_m16(const ofl_adam_coeffs *c, int32_t gd, int32_t od, int l2, int32_t sd, uint16_t *pm,
                          uint32_t key, uint32_t first, const void *g, void *m, void *v, float *ms, float *vs,
                          void *out, int64_t n) {
    return drive16(c, gd, od, l2, sd, 1, NULL, pm, key, first, g, m, v, ms, vs, out, n);
}

OFL_DEFINE_ADAMQ_KERNEL(OFL_Q8_FN(ofl_adamq_kernel), loop16)

#define OFL_ADAMQ_M16_ARGS() pm, key, first, g, m, v, ms, vs, out, n

int32_t OFL_Q8_FN(ofl_adamq_m16_kernel)(const ofl_adam_coeffs *c, int32_t gd, int32_t od, int32_t sd, uint16_t *pm,
                                        uint32_t key, uint32_t first, const void *g, void *m, void *v, float *ms,
                                        float *vs, void *out, int64_t n) {
    OFL_ADAMQ_L2_CASES(loop16_m16, OFL_ADAMQ_M16_ARGS)
}
