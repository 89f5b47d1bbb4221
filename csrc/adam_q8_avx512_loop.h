/* AVX-512 Adam over compressed moments, included by adam_q8_avx512.c (OFL_Q8_VBMI 0) and
 * adam_q8_avx512vbmi.c (OFL_Q8_VBMI 1: the moments dequantized by AVX512_VBMI byte permutes)
 * after each sets its target. Not a header of declarations: only those two files include it.
 * The same bits as the scalar path ([Note: one operation sequence for every ISA]).
 *
 * [Note: the full-block pass]
 * A whole block of OFL_Q8_BLOCK elements with a finite scale (nearly every block) goes
 * through full vectors, no masks, in three short passes over two L1 buffers: (1) m
 * dequantized into bm, (2) v dequantized, both moments updated into bm, bv and their
 * block maxima taken, (3) the params updated and both moments coded, four vectors at a
 * time packed into 64 codes. Each pass keeps one map's tables in registers, and the
 * square roots and divisions of (3) overlap the integer work of the coding. A tail
 * block, or a block whose new moment is not finite, takes the masked path (block16). */
#define OFL_AVX512_NATIVE_BF16 0
#include "adam_avx512_loop.h" /* load_grad16, f32_to_bf16_16, store_out16 */

#define OFL_Q8_CAT2(a, b) a##b
#define OFL_Q8_CAT(a, b) OFL_Q8_CAT2(a, b)
#if OFL_Q8_VBMI
#define OFL_Q8_FN(name) OFL_Q8_CAT(name, _avx512vbmi)
#else
#define OFL_Q8_FN(name) OFL_Q8_CAT(name, _avx512)
#endif

OFL_AI __mmask16 tail_mask(int64_t left) { return left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1u); }

/* [Note: masked moves in tails only]
 * A masked load or store of a whole vector gives the bits a plain one gives, but on a Zen 5
 * EPYC the bf16-state step ran 0.63-0.67x the fp32-state step with every move masked and
 * 1.35-1.37x with whole vectors moved plainly (tools/bench/results/adam-state-dtype_2core-epyc_202611.md):
 * the loops here mask only the tail of a block (k not all ones). */
OFL_AI __m512 loadps16(__mmask16 k, const float *src) {
    return k == 0xffff ? _mm512_loadu_ps(src) : _mm512_maskz_loadu_ps(k, src);
}

OFL_AI void storeps16(float *dst, __mmask16 k, __m512 x) {
    if (k == 0xffff) _mm512_storeu_ps(dst, x);
    else _mm512_mask_storeu_ps(dst, k, x);
}

OFL_AI __m256i load16(__mmask16 k, const uint16_t *src) {
    return k == 0xffff ? _mm256_loadu_si256((const __m256i *)src) : _mm256_maskz_loadu_epi16(k, src);
}

OFL_AI void store16(uint16_t *dst, __mmask16 k, __m256i x) {
    if (k == 0xffff) _mm256_storeu_si256((__m256i *)dst, x);
    else _mm256_mask_storeu_epi16(dst, k, x);
}

/* The 256 values of a map as 16 registers, looked up by permutes (a gather is slow on some CPUs). */
typedef struct {
    __m512 r[16];
} table16;

OFL_AI void load_table16(const float *val, table16 *tab) {
    for (int i = 0; i < 16; i++) tab->r[i] = _mm512_loadu_ps(val + 16 * i);
}

/* val[code] * scale for 16 codes. Signed map: its 128 magnitudes and the sign bit of the code. */
OFL_AI __m512 dequant16(const table16 *tab, int32_t map, const uint8_t *codes, __m512 scale, __mmask16 k) {
    __m512i c = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(k, codes));
    __m512 q[8];
    int pairs = map == OFL_Q8_MAP_SIGNED ? 4 : 8;
    for (int i = 0; i < pairs; i++) q[i] = _mm512_permutex2var_ps(tab->r[2 * i], c, tab->r[2 * i + 1]);
    __mmask16 b5 = _mm512_test_epi32_mask(c, _mm512_set1_epi32(32));
    __mmask16 b6 = _mm512_test_epi32_mask(c, _mm512_set1_epi32(64));
    __m512 lo = _mm512_mask_blend_ps(b6, _mm512_mask_blend_ps(b5, q[0], q[1]), _mm512_mask_blend_ps(b5, q[2], q[3]));
    if (map == OFL_Q8_MAP_SIGNED) {
        __m512i sign = _mm512_slli_epi32(_mm512_and_si512(c, _mm512_set1_epi32(0x80)), 24);
        lo = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(lo), sign));
    } else {
        __mmask16 b7 = _mm512_test_epi32_mask(c, _mm512_set1_epi32(128));
        __m512 hi = _mm512_mask_blend_ps(b6, _mm512_mask_blend_ps(b5, q[4], q[5]), _mm512_mask_blend_ps(b5, q[6], q[7]));
        lo = _mm512_mask_blend_ps(b7, lo, hi);
    }
    return _mm512_mul_ps(lo, scale);
}

/* The codes of 16 values ([Note: the code of a value]); the decade's constants by permutes. */
OFL_AI __m512i code16(const ofl_q8_tables *t, int32_t map, __m512 x, __m512 inv) {
    __m512i xb = _mm512_castps_si512(x);
    __m512 a = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(xb, _mm512_set1_epi32(0x7fffffff))), inv);
    a = _mm512_min_ps(a, _mm512_set1_ps(1.0f)); /* NaN -> 1 */
    __m512i one = _mm512_set1_epi32(1);
    __m512i e = _mm512_sub_epi32(_mm512_set1_epi32(127), _mm512_srli_epi32(_mm512_castps_si512(a), 23));
    e = _mm512_min_epi32(e, _mm512_set1_epi32(31));
    __m512i d = _mm512_permutex2var_epi32(_mm512_loadu_si512(t->first_decade[map]), e,
                                          _mm512_loadu_si512(t->first_decade[map] + 16));
    __m512 below = _mm512_permutexvar_ps(d, _mm512_castps256_ps512(_mm256_loadu_ps(t->thr_or_none[map])));
    d = _mm512_mask_add_epi32(d, _mm512_cmp_ps_mask(a, below, _CMP_LE_OQ), d, one);
    __m512 gain = _mm512_permutexvar_ps(d, _mm512_castps256_ps512(_mm256_loadu_ps(t->gain[map])));
    __m512 offset = _mm512_permutexvar_ps(d, _mm512_castps256_ps512(_mm256_loadu_ps(t->offset[map])));
    /* s is in [-0.12, top] (a decade's own range, and below the last one's down to 0): no clamp */
    __m512i idx = _mm512_cvtps_epi32(_mm512_fmadd_ps(a, gain, offset));
    if (map == OFL_Q8_MAP_UNSIGNED) {
        __mmask16 pos = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GT_OQ);
        return _mm512_mask_max_epi32(idx, pos, idx, one);
    }
    return _mm512_mask_or_epi32(idx, _mm512_movepi32_mask(xb), idx, _mm512_set1_epi32(0x80));
}

OFL_AI __m512i absmax16(__m512i amax, __m512 x, __mmask16 k) {
    return _mm512_mask_max_epu32(amax, k, amax, _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7fffffff)));
}

/* The codes of n values whose block maximum (|x|'s bits, lane-wise) is amax; the scale to *scale. */
OFL_AI void codes_block16(const ofl_q8_tables *t, int32_t map, const float *x, uint8_t *codes, float *scale,
                          int64_t n, __m512i amax) {
    float s = ofl_bits_to_f32((uint32_t)_mm512_reduce_max_epu32(amax));
    __m512 inv = _mm512_set1_ps(ofl_q8_inverse(s));
    *scale = s;
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 k = tail_mask(n - i);
        __m128i c = _mm512_cvtepi32_epi8(code16(t, map, loadps16(k, x + i), inv)); /* vpmovdb to memory is slow on Zen 4 */
        if (k == 0xffff) _mm_storeu_si128((__m128i *)(codes + i), c); /* [Note: masked moves in tails only] */
        else _mm_mask_storeu_epi8(codes + i, k, c);
    }
}

OFL_AI int32_t block16(const ofl_q8_tables *t, const ofl_adam_coeffs *c, int32_t gd, int32_t od, int l2,
                       int32_t sd, float *p, const void *g, void *m, void *v, float *ms, float *vs,
                       void *out, int64_t n) {
    float bm[OFL_Q8_BLOCK] __attribute__((aligned(64))), bv[OFL_Q8_BLOCK] __attribute__((aligned(64)));
    const __m512 b1 = _mm512_set1_ps(c->beta1), omb1 = _mm512_set1_ps(c->one_minus_beta1);
    const __m512 b2 = _mm512_set1_ps(c->beta2), omb2 = _mm512_set1_ps(c->one_minus_beta2);
    const __m512 eps = _mm512_set1_ps(c->eps), step = _mm512_set1_ps(c->step_size);
    const __m512 ibc2 = _mm512_set1_ps(c->inv_bias2_sqrt), decay = _mm512_set1_ps(c->decay_mul);
    const __m512 l2c = _mm512_set1_ps(c->l2_decay), gscale = _mm512_set1_ps(c->grad_scale);
    __m512 sm = _mm512_setzero_ps(), sv = _mm512_setzero_ps();
    table16 tabs, tabu;
    if (sd == OFL_STATE_Q8) {
        load_table16(t->value[OFL_Q8_MAP_SIGNED], &tabs);
        load_table16(t->value[OFL_Q8_MAP_UNSIGNED], &tabu);
        sm = _mm512_set1_ps(ms[0]);
        sv = _mm512_set1_ps(vs[0]);
    }
    __m512 bad = _mm512_setzero_ps();
    __m512i amax_m = _mm512_setzero_si512(), amax_v = _mm512_setzero_si512();
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 k = tail_mask(n - i);
        __m512 m0, v0;
        if (sd == OFL_STATE_Q8) {
            m0 = dequant16(&tabs, OFL_Q8_MAP_SIGNED, (const uint8_t *)m + i, sm, k);
            v0 = dequant16(&tabu, OFL_Q8_MAP_UNSIGNED, (const uint8_t *)v + i, sv, k);
        } else {
            m0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(load16(k, (const uint16_t *)m + i)), 16));
            v0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(load16(k, (const uint16_t *)v + i)), 16));
        }
        __m512 gv = _mm512_mul_ps(load_grad16(gd, g, i, k, k != 0xffff), gscale);
        bad = _mm512_add_ps(bad, _mm512_mul_ps(gv, _mm512_setzero_ps()));
        if (l2) gv = _mm512_fmadd_ps(l2c, loadps16(k, p + i), gv);
        __m512 mv = _mm512_fmadd_ps(b1, m0, _mm512_mul_ps(omb1, gv));
        __m512 vv = _mm512_fmadd_ps(b2, v0, _mm512_mul_ps(_mm512_mul_ps(omb2, gv), gv));
        _mm512_store_ps(bm + i, mv);
        _mm512_store_ps(bv + i, vv);
        if (sd == OFL_STATE_Q8) {
            amax_m = absmax16(amax_m, mv, k);
            amax_v = absmax16(amax_v, vv, k);
        } else {
            store16((uint16_t *)m + i, k, f32_to_bf16_16(mv));
            store16((uint16_t *)v + i, k, f32_to_bf16_16(vv));
        }
    }
    /* The update apart, a short loop whose square roots and divisions overlap from one vector
     * to the next (in the loop above they wait behind the lookups). */
#pragma GCC unroll 4
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 k = tail_mask(n - i);
        __m512 pv = loadps16(k, p + i);
        __m512 den = _mm512_fmadd_ps(_mm512_sqrt_ps(_mm512_load_ps(bv + i)), ibc2, eps);
        pv = _mm512_fnmadd_ps(step, _mm512_div_ps(_mm512_load_ps(bm + i), den), _mm512_mul_ps(pv, decay));
        storeps16(p + i, k, pv);
        store_out16(od, out, i, pv, k, k != 0xffff);
    }
    if (sd == OFL_STATE_Q8) {
        codes_block16(t, OFL_Q8_MAP_SIGNED, bm, (uint8_t *)m, ms, n, amax_m);
        codes_block16(t, OFL_Q8_MAP_UNSIGNED, bv, (uint8_t *)v, vs, n, amax_v);
    }
    return _mm512_cmp_ps_mask(bad, bad, _CMP_UNORD_Q) != 0;
}


/* ---- whole blocks ([Note: the full-block pass]) ---- */

/* A block's scale from its maximum |x| bits, and whether the full-block coding applies: a
 * finite scale that is 0 or normal, so 1 / scale is finite, every |x| <= scale and
 * a = |x| / scale is in [0, 1 + 2^-22] (a code of the top value above 1 as at 1), never NaN. */
OFL_AI int full_scale(__m512i amax, float *scale) {
    uint32_t bits = (uint32_t)_mm512_reduce_max_epu32(amax);
    *scale = ofl_bits_to_f32(bits);
    return bits < 0x7f800000u && (bits == 0 || bits >= 0x00800000u);
}

/* The constants of the code of one map in registers, the decade looked up by the exponent field. */
typedef struct {
    __m512i dx_lo, dx_hi;
    __m512 tx_lo, tx_hi, gain, offset;
} qtab16;

OFL_AI void load_qtab16(const ofl_q8_tables *t, int32_t map, qtab16 *q) {
    q->dx_lo = _mm512_loadu_si512(t->decade_by_exp[map]);
    q->dx_hi = _mm512_loadu_si512(t->decade_by_exp[map] + 16);
    q->tx_lo = _mm512_loadu_ps(t->thr_by_exp[map]);
    q->tx_hi = _mm512_loadu_ps(t->thr_by_exp[map] + 16);
    q->gain = _mm512_castps256_ps512(_mm256_loadu_ps(t->gain[map]));
    q->offset = _mm512_castps256_ps512(_mm256_loadu_ps(t->offset[map]));
}

/* code16 where full_scale holds: no min(a, 1) (a is never NaN, and the few a above 1 code as
 * 1 does), the exponent field clamped below at 2^-31 instead of e at 31, and the unsigned
 * map's "positive is at least 1" as an integer maximum (x is not NaN). */
OFL_AI __m512i code16_full(const qtab16 *q, int32_t map, __m512 x, __m512 inv) {
    __m512i xb = _mm512_castps_si512(x);
    __m512 a = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(xb, _mm512_set1_epi32(0x7fffffff))), inv);
    __m512i ex = _mm512_max_epi32(_mm512_srli_epi32(_mm512_castps_si512(a), 23), _mm512_set1_epi32(96));
    __m512i d = _mm512_permutex2var_epi32(q->dx_lo, ex, q->dx_hi);
    __m512 below = _mm512_permutex2var_ps(q->tx_lo, ex, q->tx_hi);
    d = _mm512_mask_add_epi32(d, _mm512_cmp_ps_mask(a, below, _CMP_LE_OQ), d, _mm512_set1_epi32(1));
    __m512i idx = _mm512_cvtps_epi32(
        _mm512_fmadd_ps(a, _mm512_permutexvar_ps(d, q->gain), _mm512_permutexvar_ps(d, q->offset)));
    if (map == OFL_Q8_MAP_UNSIGNED) return _mm512_max_epi32(idx, _mm512_min_epi32(xb, _mm512_set1_epi32(1)));
    return _mm512_ternarylogic_epi32(idx, _mm512_srli_epi32(xb, 24), _mm512_set1_epi32(0x80), 0xf8); /* a | b & c */
}

/* 64 codes (four vectors of 16, each in [0, 255]) packed and stored in order. */
OFL_AI void store_codes64(uint8_t *dst, __m512i c0, __m512i c1, __m512i c2, __m512i c3) {
    __m512i b = _mm512_packus_epi16(_mm512_packus_epi32(c0, c1), _mm512_packus_epi32(c2, c3));
    /* dword 4 l + q of b holds vector q's lane l (elements 4 l .. 4 l + 3) */
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_storeu_si512(dst, _mm512_permutexvar_epi32(order, b));
}

OFL_AI void codes_full(const qtab16 *q, int32_t map, const float *x, uint8_t *codes, __m512 inv) {
    for (int i = 0; i < OFL_Q8_BLOCK; i += 64)
        store_codes64(codes + i, code16_full(q, map, _mm512_loadu_ps(x + i), inv),
                      code16_full(q, map, _mm512_loadu_ps(x + i + 16), inv),
                      code16_full(q, map, _mm512_loadu_ps(x + i + 32), inv),
                      code16_full(q, map, _mm512_loadu_ps(x + i + 48), inv));
}

#if OFL_Q8_VBMI
/* Byte k of a map's values [128 h, 128 h + 128): two registers per byte. */
typedef struct {
    __m512i lo[4], hi[4];
} ptab128;

OFL_AI void load_ptab128(const ofl_q8_tables *t, int32_t map, int h, ptab128 *q) {
    for (int k = 0; k < 4; k++) {
        q->lo[k] = _mm512_load_si512(t->plane[map][k] + 128 * h);
        q->hi[k] = _mm512_load_si512(t->plane[map][k] + 128 * h + 64);
    }
}

/* map[code] * scale for 64 codes: each of the value's four bytes by one byte permute of
 * 128 entries (two, and a blend by the code's top bit, for the 256 of the unsigned map;
 * the signed map's sign is the code's top bit), then the bytes interleaved into floats.
 * The interleave works within 128-bit lanes, so the codes are first put in the order
 * that brings the floats out in theirs. */
OFL_AI void dequant64(const ptab128 *lo, const ptab128 *hi, int32_t map, const uint8_t *codes, __m512 scale,
                      float *dst) {
    static const uint8_t order[64] __attribute__((aligned(64))) = {
        0, 1, 2, 3, 16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51, 4, 5, 6, 7, 20, 21, 22, 23,
        36, 37, 38, 39, 52, 53, 54, 55, 8, 9, 10, 11, 24, 25, 26, 27, 40, 41, 42, 43, 56, 57, 58, 59,
        12, 13, 14, 15, 28, 29, 30, 31, 44, 45, 46, 47, 60, 61, 62, 63};
    __m512i c = _mm512_permutexvar_epi8(_mm512_load_si512(order), _mm512_loadu_si512(codes));
    __m512i b[4];
    if (map == OFL_Q8_MAP_SIGNED) {
        for (int k = 0; k < 4; k++) b[k] = _mm512_permutex2var_epi8(lo->lo[k], c, lo->hi[k]);
        b[3] = _mm512_ternarylogic_epi32(b[3], c, _mm512_set1_epi8((char)0x80), 0xf8);
    } else {
        __mmask64 top = _mm512_movepi8_mask(c);
        for (int k = 0; k < 4; k++)
            b[k] = _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(lo->lo[k], c, lo->hi[k]),
                                          _mm512_permutex2var_epi8(hi->lo[k], c, hi->hi[k]));
    }
    __m512i w0 = _mm512_unpacklo_epi8(b[0], b[1]), w1 = _mm512_unpackhi_epi8(b[0], b[1]);
    __m512i w2 = _mm512_unpacklo_epi8(b[2], b[3]), w3 = _mm512_unpackhi_epi8(b[2], b[3]);
    _mm512_store_ps(dst, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(w0, w2)), scale));
    _mm512_store_ps(dst + 16, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(w0, w2)), scale));
    _mm512_store_ps(dst + 32, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(w1, w3)), scale));
    _mm512_store_ps(dst + 48, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(w1, w3)), scale));
}

/* A whole block's values into dst (64-byte aligned). */
OFL_AI void dequant_full(const ofl_q8_tables *t, int32_t map, const uint8_t *codes, float scale, float *dst) {
    ptab128 lo, hi;
    load_ptab128(t, map, 0, &lo);
    if (map == OFL_Q8_MAP_UNSIGNED) load_ptab128(t, map, 1, &hi);
    __m512 s = _mm512_set1_ps(scale);
    for (int i = 0; i < OFL_Q8_BLOCK; i += 64) dequant64(&lo, &hi, map, codes + i, s, dst + i);
}
#else
OFL_AI void dequant_full(const ofl_q8_tables *t, int32_t map, const uint8_t *codes, float scale, float *dst) {
    table16 tab;
    load_table16(t->value[map], &tab);
    __m512 s = _mm512_set1_ps(scale);
    for (int i = 0; i < OFL_Q8_BLOCK; i += 16) _mm512_store_ps(dst + i, dequant16(&tab, map, codes + i, s, 0xffff));
}
#endif

/* One whole int8 block between its two halves ([Note: the full-block pass]). */
typedef struct {
    float m[OFL_Q8_BLOCK] __attribute__((aligned(64))); /* the new moments */
    float v[OFL_Q8_BLOCK] __attribute__((aligned(64)));
    __m512i amax_m, amax_v; /* lane-wise maxima of their |x| bits */
    float *p;
    const void *g;
    uint8_t *mc, *vc;
    float *ms, *vs;
    void *out;
    uint16_t *pm;        /* a bf16 master (mb 1): its 256 elements, instead of p */
    uint32_t key, first; /* its rounding key, and the tensor's index of its first element (even) */
} staged_block;

/* [Note: a bf16 master in the full-block pass]
 * With a bf16 master (adam_master.h) the full int8 block reads the master widened in registers
 * and stores it back rounded stochastically in the same pass: no tile of fp32 copies, so no
 * pass more over memory. The rounding is ofl_bf16_sr1 with ofl_sr_bits, lane by lane, so the
 * bits are those of the tile path (adam_q8.c) that the scalar and AVX2 paths take. */
OFL_AI __m512 load_master16(const staged_block *b, int mb, int j) {
    if (!mb) return _mm512_loadu_ps(b->p + j);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(b->pm + j))), 16));
}

/* The random bits of the 32 elements from j (j even): one hash a pair, for vectors j and j + 16. */
OFL_AI void sr_bits32(const staged_block *b, int j, __m512i *r0, __m512i *r1) {
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i pair = _mm512_add_epi32(_mm512_set1_epi32((int)((b->first + (uint32_t)j) >> 1)), lanes);
    __m512i h = _mm512_add_epi32(_mm512_mullo_epi32(pair, _mm512_set1_epi32((int)OFL_SR_GOLDEN)),
                                 _mm512_set1_epi32((int)b->key));
    OFL_FMIX_V(h, _mm512_xor_si512, _mm512_srli_epi32, _mm512_mullo_epi32, _mm512_set1_epi32);
    __m512i hi = _mm512_srli_epi32(h, 16), lo = _mm512_and_si512(h, _mm512_set1_epi32(0xffff));
    *r0 = _mm512_permutex2var_epi32(hi, _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23), lo);
    *r1 = _mm512_permutex2var_epi32(hi, _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31), lo);
}

/* pv stored as the master at j (mb 1: rounded with the random bits r); returns the value stored. */
OFL_AI __m512 store_master16(staged_block *b, int mb, int j, __m512 pv, __m512i r) {
    if (!mb) {
        _mm512_storeu_ps(b->p + j, pv);
        return pv;
    }
    __m512i x = _mm512_castps_si512(pv);
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(x, _mm512_set1_epi32(0x7fffffff)),
                                            _mm512_set1_epi32(0x7f800000));
    __m512i y = _mm512_srli_epi32(_mm512_add_epi32(x, r), 16);
    y = _mm512_mask_mov_epi32(y, nan, _mm512_or_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(0x0040)));
    _mm256_storeu_si256((__m256i *)(b->pm + j), _mm512_cvtepi32_epi16(y));
    return _mm512_castsi512_ps(_mm512_slli_epi32(y, 16));
}

/* Passes (1) and (2): the moments dequantized and updated into b. unit: grad_scale is 1, and
 * g * 1 is g (a signalling NaN quietened either way by what follows), so it is not multiplied. */
OFL_AI void stage_moments(const ofl_q8_tables *t, const ofl_adam_coeffs *c, int32_t gd, int l2, int unit, int mb,
                          staged_block *b) {
    dequant_full(t, OFL_Q8_MAP_SIGNED, b->mc, b->ms[0], b->m);
    dequant_full(t, OFL_Q8_MAP_UNSIGNED, b->vc, b->vs[0], b->v);
    const __m512 b1 = _mm512_set1_ps(c->beta1), omb1 = _mm512_set1_ps(c->one_minus_beta1);
    const __m512 b2 = _mm512_set1_ps(c->beta2), omb2 = _mm512_set1_ps(c->one_minus_beta2);
    const __m512 l2c = _mm512_set1_ps(c->l2_decay), gscale = _mm512_set1_ps(c->grad_scale);
    __m512i amax_m = _mm512_setzero_si512(), amax_v = _mm512_setzero_si512();
    const __m512i absmask = _mm512_set1_epi32(0x7fffffff);
    for (int i = 0; i < OFL_Q8_BLOCK; i += 16) {
        /* A scaled gradient that is not finite makes m not finite (so this block's scale too);
         * stage_params looks for it only then. */
        __m512 gv = load_grad16(gd, b->g, i, 0xffff, 0);
        if (!unit) gv = _mm512_mul_ps(gv, gscale);
        if (l2) gv = _mm512_fmadd_ps(l2c, load_master16(b, mb, i), gv);
        __m512 mv = _mm512_fmadd_ps(b1, _mm512_load_ps(b->m + i), _mm512_mul_ps(omb1, gv));
        __m512 vv = _mm512_fmadd_ps(b2, _mm512_load_ps(b->v + i), _mm512_mul_ps(_mm512_mul_ps(omb2, gv), gv));
        _mm512_store_ps(b->m + i, mv);
        _mm512_store_ps(b->v + i, vv);
        amax_m = _mm512_max_epu32(amax_m, _mm512_and_si512(_mm512_castps_si512(mv), absmask));
        amax_v = _mm512_max_epu32(amax_v, _mm512_and_si512(_mm512_castps_si512(vv), absmask));
    }
    b->amax_m = amax_m;
    b->amax_v = amax_v;
}

/* Pass (3): the params, and both moments' codes and scales. Returns 1 if a scaled gradient was
 * not finite. */
OFL_AI int32_t stage_params(const ofl_q8_tables *t, const ofl_adam_coeffs *c, int32_t gd, int32_t od, int mb,
                            staged_block *b) {
    const __m512 eps = _mm512_set1_ps(c->eps), step = _mm512_set1_ps(c->step_size);
    const __m512 ibc2 = _mm512_set1_ps(c->inv_bias2_sqrt), decay = _mm512_set1_ps(c->decay_mul);
    float *bm = b->m, *bv = b->v;
    void *out = b->out;
    float sm, sv;
    int fm = full_scale(b->amax_m, &sm), fv = full_scale(b->amax_v, &sv);
    if (fm && fv) { /* the params and both moments' codes in one pass */
        qtab16 qm, qv;
        load_qtab16(t, OFL_Q8_MAP_SIGNED, &qm);
        load_qtab16(t, OFL_Q8_MAP_UNSIGNED, &qv);
        const __m512 im = _mm512_set1_ps(ofl_q8_inverse(sm)), iv = _mm512_set1_ps(ofl_q8_inverse(sv));
        for (int i = 0; i < OFL_Q8_BLOCK; i += 64) {
            __m512i cm[4], cv[4], r[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                                          _mm512_setzero_si512()};
            if (mb) {
                sr_bits32(b, i, &r[0], &r[1]);
                sr_bits32(b, i + 32, &r[2], &r[3]);
            }
            for (int q = 0; q < 4; q++) {
                int j = i + 16 * q;
                __m512 mv = _mm512_load_ps(bm + j), vv = _mm512_load_ps(bv + j);
                __m512 den = _mm512_fmadd_ps(_mm512_sqrt_ps(vv), ibc2, eps);
                __m512 pv = _mm512_fnmadd_ps(step, _mm512_div_ps(mv, den), _mm512_mul_ps(load_master16(b, mb, j), decay));
                pv = store_master16(b, mb, j, pv, r[q]);
                store_out16(od, out, j, pv, 0xffff, 0);
                cm[q] = code16_full(&qm, OFL_Q8_MAP_SIGNED, mv, im);
                cv[q] = code16_full(&qv, OFL_Q8_MAP_UNSIGNED, vv, iv);
            }
            store_codes64(b->mc + i, cm[0], cm[1], cm[2], cm[3]);
            store_codes64(b->vc + i, cv[0], cv[1], cv[2], cv[3]);
        }
        b->ms[0] = sm;
        b->vs[0] = sv;
        return 0;
    }
    /* a moment not finite (or a subnormal scale): the general codes, and the gradients' test */
    const __m512 gscale = _mm512_set1_ps(c->grad_scale);
    __m512 bad = _mm512_setzero_ps();
    for (int i = 0; i < OFL_Q8_BLOCK; i += 32) {
        __m512i r[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
        if (mb) sr_bits32(b, i, &r[0], &r[1]);
        for (int q = 0; q < 2; q++) {
            int j = i + 16 * q;
            __m512 gv = _mm512_mul_ps(load_grad16(gd, b->g, j, 0xffff, 0), gscale);
            bad = _mm512_add_ps(bad, _mm512_mul_ps(gv, _mm512_setzero_ps()));
            __m512 den = _mm512_fmadd_ps(_mm512_sqrt_ps(_mm512_load_ps(bv + j)), ibc2, eps);
            __m512 pv = _mm512_fnmadd_ps(step, _mm512_div_ps(_mm512_load_ps(bm + j), den),
                                         _mm512_mul_ps(load_master16(b, mb, j), decay));
            pv = store_master16(b, mb, j, pv, r[q]);
            store_out16(od, out, j, pv, 0xffff, 0);
        }
    }
    codes_block16(t, OFL_Q8_MAP_SIGNED, bm, b->mc, b->ms, OFL_Q8_BLOCK, b->amax_m);
    codes_block16(t, OFL_Q8_MAP_UNSIGNED, bv, b->vc, b->vs, OFL_Q8_BLOCK, b->amax_v);
    return _mm512_cmp_ps_mask(bad, bad, _CMP_UNORD_Q) != 0;
}

/* ---- whole arrays: quantizing and dequantizing ---- */

void OFL_Q8_FN(ofl_q8_quant)(const ofl_q8_tables *t, int32_t map, const float *x, uint8_t *codes,
                             float *scale, int64_t n) {
    __m512i amax = _mm512_setzero_si512();
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 k = tail_mask(n - i);
        amax = absmax16(amax, _mm512_maskz_loadu_ps(k, x + i), k);
    }
    float s;
    if (n == OFL_Q8_BLOCK && full_scale(amax, &s)) {
        qtab16 q;
        load_qtab16(t, map, &q);
        *scale = s;
        codes_full(&q, map, x, codes, _mm512_set1_ps(ofl_q8_inverse(s)));
        return;
    }
    codes_block16(t, map, x, codes, scale, n, amax);
}

void OFL_Q8_FN(ofl_q8_dequant)(const ofl_q8_tables *t, int32_t map, const uint8_t *codes, float scale,
                               float *x, int64_t n) {
    if (n == OFL_Q8_BLOCK) {
        float buf[OFL_Q8_BLOCK] __attribute__((aligned(64)));
        dequant_full(t, map, codes, scale, buf);
        memcpy(x, buf, sizeof buf);
        return;
    }
    __m512 s = _mm512_set1_ps(scale);
    table16 tab;
    load_table16(t->value[map], &tab);
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 k = tail_mask(n - i);
        _mm512_mask_storeu_ps(x + i, k, dequant16(&tab, map, codes + i, s, k));
    }
}
