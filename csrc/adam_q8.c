/* Adam over compressed moments: the maps, validation, ISA choice and threading.
 * See [Note: quantized Adam states] in ofl_adam.h and adam_q8.h for the kernels' rules.
 *
 * [Note: the dynamic map]
 * As in Dettmers et al. 2022 (dynamic tree quantization): after the sign (signed map
 * only), a code's bits say a power of ten by how many leading zeros they have, and the
 * bits after the first one are a linear fraction within that decade, so large values
 * get many levels and small ones a wide range. Here, per decade d (values in
 * (10^-(d+1), 10^-d]) with c_d levels, the values are (0.1 + 0.9 (j + 1) / c_d) / 10^d,
 * j = 0 .. c_d - 1, so 1 is a code (the block's largest magnitude decodes exactly) and
 * each decade ends on the next one's start. Signed map: 0 and decades 0..6 with
 * 64, 32, ..., 1 levels (127 magnitudes, both signs; code | 0x80 is the negative).
 * Unsigned map: 0 and decades 0..7 with 128, 64, ..., 1 levels (255 values). Built in
 * double and rounded to float once, the same way by the numpy reference.
 */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>

#include "adam_master.h"
#include "adam_q8.h"
#include "ofl_parallel.h"

#define OFL_MIN_ELEMS_PER_THREAD 65536
#define OFL_Q8_CHUNK_ELEMS 65536 /* a multiple of OFL_Q8_BLOCK: chunks never split a block */

static ofl_q8_tables tables;
static pthread_once_t tables_once = PTHREAD_ONCE_INIT;

/* Ascending magnitudes of a map: 0, then decades from the smallest up. */
static int build_magnitudes(int decades, float *mag) {
    int k = 0;
    mag[k++] = 0.0f;
    for (int d = decades - 1; d >= 0; d--) {
        int levels = 1 << (decades - 1 - d);
        double tens = 1.0;
        for (int i = 0; i < d; i++) tens *= 10.0;
        for (int j = 0; j < levels; j++) mag[k++] = (float)((0.1 + 0.9 * (j + 1) / levels) / tens);
    }
    return k;
}

/* The constants of [Note: the code of a value] for a map of `decades` decades. */
static void build_decades(int map, int decades) {
    double tens = 1.0;
    for (int d = 0; d < decades; d++) {
        int levels = 1 << (decades - 1 - d);
        tables.thr[map][d] = (float)(1.0 / (tens * 10.0));
        tables.gain[map][d] = (float)(tens * levels / 0.9);
        tables.offset[map][d] = (float)((levels - 1) - 0.1 * levels / 0.9);
        tens *= 10.0;
    }
    tables.decades[map] = decades;
    for (int d = 0; d < OFL_Q8_DECADES_MAX; d++) tables.thr_or_none[map][d] = d < decades - 1 ? tables.thr[map][d] : -1.0f;
    for (int e = 0; e < 32; e++) {
        float upper = ldexpf(1.0f, 1 - e);
        int count = 0;
        for (int k = 0; k < decades - 1; k++) count += tables.thr[map][k] >= upper;
        tables.first_decade[map][e] = count;
    }
    for (int x = 0; x < 32; x++) {
        tables.decade_by_exp[map][x] = tables.first_decade[map][31 - x];
        tables.thr_by_exp[map][x] = tables.thr_or_none[map][tables.first_decade[map][31 - x]];
    }
}

static void build_planes(int map) {
    for (int code = 0; code < 256; code++) {
        uint32_t b = ofl_f32_to_bits(tables.value[map][code]);
        for (int k = 0; k < 4; k++) tables.plane[map][k][code] = (uint8_t)(b >> (8 * k));
    }
}

static void build_tables(void) {
    float mag[256];
    int n = build_magnitudes(7, mag);
    for (int k = 0; k < 128; k++) {
        tables.value[OFL_Q8_MAP_SIGNED][k] = mag[k];
        tables.value[OFL_Q8_MAP_SIGNED][128 + k] = -mag[k];
    }
    tables.top[OFL_Q8_MAP_SIGNED] = n - 1;
    build_decades(OFL_Q8_MAP_SIGNED, 7);
    n = build_magnitudes(8, mag);
    for (int k = 0; k < 256; k++) tables.value[OFL_Q8_MAP_UNSIGNED][k] = mag[k];
    tables.top[OFL_Q8_MAP_UNSIGNED] = n - 1;
    build_decades(OFL_Q8_MAP_UNSIGNED, 8);
    build_planes(OFL_Q8_MAP_SIGNED);
    build_planes(OFL_Q8_MAP_UNSIGNED);
}

const ofl_q8_tables *ofl_q8_tables_get(void) {
    pthread_once(&tables_once, build_tables);
    return &tables;
}

int32_t ofl_q8_map(int32_t map, float *values_out) {
    if ((map != OFL_Q8_MAP_SIGNED && map != OFL_Q8_MAP_UNSIGNED) || !values_out) return -EINVAL;
    memcpy(values_out, ofl_q8_tables_get()->value[map], sizeof tables.value[map]);
    return 0;
}

typedef struct {
    ofl_adamq_kernel_fn adam;
    ofl_q8_quant_fn quant;
    ofl_q8_dequant_fn dequant;
    ofl_adamq_m16_kernel_fn m16; /* int8 with a bf16 master fused, or NULL: the tile path */
} q8_kernels;

static q8_kernels kernels_for(int32_t isa) {
#if OFL_HAVE_X86
    /* avx512_bf16 names the newer CPUs: there the lookups take AVX512_VBMI where it is, so
     * both forms are exercised on a CPU that has it (the same bits either way). */
    if (isa == OFL_ISA_AVX512_BF16 && __builtin_cpu_supports("avx512vbmi"))
        return (q8_kernels){ofl_adamq_kernel_avx512vbmi, ofl_q8_quant_avx512vbmi, ofl_q8_dequant_avx512vbmi,
                            ofl_adamq_m16_kernel_avx512vbmi};
    if (isa == OFL_ISA_AVX512 || isa == OFL_ISA_AVX512_BF16)
        return (q8_kernels){ofl_adamq_kernel_avx512, ofl_q8_quant_avx512, ofl_q8_dequant_avx512,
                            ofl_adamq_m16_kernel_avx512};
    if (isa == OFL_ISA_AVX2) return (q8_kernels){ofl_adamq_kernel_avx2, ofl_q8_quant_avx2, ofl_q8_dequant_avx2, NULL};
#endif
    (void)isa;
    return (q8_kernels){ofl_adamq_kernel_scalar, ofl_q8_quant_scalar, ofl_q8_dequant_scalar, NULL};
}

static int32_t threads_for(int32_t requested, int64_t total) {
    int64_t useful = total / OFL_MIN_ELEMS_PER_THREAD;
    if (useful < 1) useful = 1;
    return useful < requested ? (int32_t)useful : requested;
}

static int64_t blocks_of(int64_t n) { return (n + OFL_Q8_BLOCK - 1) / OFL_Q8_BLOCK; }

/* ---- the fused step ---- */

typedef struct {
    const ofl_adam_config *cfg;
    const ofl_adam_qtensors *t;
    int32_t sd;
    const ofl_adam_coeffs *coeffs;
    const int64_t *starts; /* count + 1 entries, in elements padded to whole blocks */
    ofl_adamq_kernel_fn kernel;
    int32_t nonfinite;
    int32_t md;                  /* the master's dtype: OFL_DTYPE_F32 or _BF16 */
    const uint32_t *keys;        /* bf16 master: each tensor's rounding key (ofl_sr_key) */
    ofl_master_kernels master;
    ofl_adamq_m16_kernel_fn m16; /* int8 moments with a bf16 master in one pass, where the ISA has it */
    ofl_adam_kernel_fn f32;      /* fp32 moments (with a bf16 master only): ofl_adam_step's kernel */
} adamq_job;

/* A bf16 master's elements [off, off + len) of tensor i, tile by tile: widened into a stack
 * buffer, stepped as an fp32 master (no copy written), rounded back stochastically, then the
 * copy written from the rounded value ([Note: a bf16 master] in ofl_adam.h). */
static int32_t adamq_bf16_master(adamq_job *job, int64_t i, int64_t off, int64_t len, char *g, int64_t eg,
                                 char *m, char *v, int64_t es, float *ms, float *vs, char *out, int64_t eo) {
    float tile[OFL_MASTER_TILE] __attribute__((aligned(64)));
    uint16_t *master = (uint16_t *)(uintptr_t)job->t->param[i] + off;
    int32_t gd = job->cfg->grad_dtype, od = job->cfg->out_dtype, bad = 0;
    for (int64_t k = 0; k < len; k += OFL_MASTER_TILE) {
        int64_t n = len - k < OFL_MASTER_TILE ? len - k : OFL_MASTER_TILE;
        int64_t b = k / OFL_Q8_BLOCK;
        job->master.widen(master + k, tile, n);
        /* The next tile's masters (4 KiB) are fetched while this one is stepped: read at a tile's start,
         * each tile a page, the hardware prefetchers would meet every one cold. */
        if (k + OFL_MASTER_TILE < len) {
            int64_t next = len - k - OFL_MASTER_TILE < OFL_MASTER_TILE ? len - k - OFL_MASTER_TILE : OFL_MASTER_TILE;
            for (int64_t e = 0; e < next; e += 32) __builtin_prefetch(master + k + OFL_MASTER_TILE + e, 0, 3);
        }
        if (job->sd == OFL_STATE_F32)
            bad |= job->f32(&job->coeffs[i], gd, OFL_DTYPE_NONE, tile, g + k * eg, (float *)(m + k * es),
                            (float *)(v + k * es), NULL, n);
        else
            bad |= job->kernel(&job->coeffs[i], gd, OFL_DTYPE_NONE, job->sd, tile, g + k * eg, m + k * es,
                               v + k * es, ms ? ms + b : NULL, vs ? vs + b : NULL, NULL, n);
        job->master.store_sr(tile, master + k, n, job->keys[i], (uint32_t)(off + k));
        if (od == OFL_DTYPE_BF16) {
            memcpy(out + k * eo, master + k, (size_t)n * 2);
        } else if (od != OFL_DTYPE_NONE) {
            job->master.widen(master + k, tile, n);
            for (int64_t j = 0; j < n; j++) ofl_store_out1(od, out + k * eo, j, tile[j]);
        }
    }
    return bad;
}

/* Tensor i's elements [off, off + len), off on a block boundary. */
static void adamq_segment(adamq_job *job, int64_t i, int64_t off, int64_t len) {
    const ofl_adam_qtensors *t = job->t;
    int32_t gd = job->cfg->grad_dtype, od = job->cfg->out_dtype;
    int64_t es = job->sd == OFL_STATE_Q8 ? 1 : job->sd == OFL_STATE_BF16 ? 2 : 4;
    int64_t eg = gd == OFL_DTYPE_F32 ? 4 : 2, eo = od == OFL_DTYPE_F32 ? 4 : 2;
    float *ms = NULL, *vs = NULL;
    if (job->sd == OFL_STATE_Q8) {
        ms = (float *)(uintptr_t)t->exp_avg_scale[i] + off / OFL_Q8_BLOCK;
        vs = (float *)(uintptr_t)t->exp_avg_sq_scale[i] + off / OFL_Q8_BLOCK;
    }
    char *out = od == OFL_DTYPE_NONE ? NULL : (char *)(uintptr_t)t->param_out[i] + off * eo;
    if (job->md == OFL_DTYPE_BF16 && job->sd == OFL_STATE_Q8 && job->m16) {
        if (job->m16(&job->coeffs[i], gd, od, job->sd, (uint16_t *)(uintptr_t)t->param[i] + off, job->keys[i],
                     (uint32_t)off, (char *)(uintptr_t)t->grad[i] + off * eg, (char *)(uintptr_t)t->exp_avg[i] + off,
                     (char *)(uintptr_t)t->exp_avg_sq[i] + off, ms, vs, out, len))
            __atomic_store_n(&job->nonfinite, 1, __ATOMIC_RELAXED);
        return;
    }
    if (job->md == OFL_DTYPE_BF16) {
        char *m = (char *)(uintptr_t)t->exp_avg[i] + off * es, *v = (char *)(uintptr_t)t->exp_avg_sq[i] + off * es;
        if (adamq_bf16_master(job, i, off, len, (char *)(uintptr_t)t->grad[i] + off * eg, eg, m, v, es, ms, vs, out, eo))
            __atomic_store_n(&job->nonfinite, 1, __ATOMIC_RELAXED);
        return;
    }
    int32_t bad = job->kernel(&job->coeffs[i], gd, od, job->sd, (float *)(uintptr_t)t->param[i] + off,
                              (char *)(uintptr_t)t->grad[i] + off * eg, (char *)(uintptr_t)t->exp_avg[i] + off * es,
                              (char *)(uintptr_t)t->exp_avg_sq[i] + off * es, ms, vs, out, len);
    if (bad) __atomic_store_n(&job->nonfinite, 1, __ATOMIC_RELAXED);
}

static void adamq_chunk(void *ctx, int64_t chunk, int64_t lo, int64_t hi) {
    adamq_job *job = (adamq_job *)ctx;
    const int64_t *starts = job->starts;
    (void)chunk;
    int64_t a = 0, b = job->t->count - 1; /* first tensor whose padded end is past lo */
    while (a < b) {
        int64_t mid = a + (b - a) / 2;
        if (starts[mid + 1] <= lo) a = mid + 1;
        else b = mid;
    }
    for (int64_t i = a; i < job->t->count && starts[i] < hi; i++) {
        int64_t s = lo > starts[i] ? lo : starts[i];
        int64_t e = hi < starts[i + 1] ? hi : starts[i + 1];
        int64_t off = s - starts[i], end = e - starts[i];
        if (end > job->t->numel[i]) end = job->t->numel[i]; /* the padding of the last block */
        if (end > off) adamq_segment(job, i, off, end - off);
    }
}

static int32_t check_q_args(const ofl_adam_config *cfg, int32_t sd, int32_t md, const ofl_adam_qtensors *t) {
    if (!cfg || !t || t->count < 0 || cfg->num_threads < 1) return -EINVAL;
    if (sd != OFL_STATE_BF16 && sd != OFL_STATE_Q8 && !(sd == OFL_STATE_F32 && md == OFL_DTYPE_BF16)) return -EINVAL;
    if (cfg->grad_dtype < OFL_DTYPE_F32 || cfg->grad_dtype > OFL_DTYPE_F16) return -EINVAL;
    if (cfg->out_dtype < OFL_DTYPE_NONE || cfg->out_dtype > OFL_DTYPE_F16) return -EINVAL;
    if (t->count == 0) return 0;
    int want_out = cfg->out_dtype != OFL_DTYPE_NONE, q8 = sd == OFL_STATE_Q8;
    if (!t->param || !t->grad || !t->exp_avg || !t->exp_avg_sq || !t->step || !t->numel ||
        (want_out && !t->param_out) || (q8 && (!t->exp_avg_scale || !t->exp_avg_sq_scale)))
        return -EINVAL;
    for (int64_t i = 0; i < t->count; i++) {
        if (t->numel[i] < 0 || !t->step[i]) return -EINVAL;
        if (t->numel[i] > 0 && (!t->param[i] || !t->grad[i] || !t->exp_avg[i] || !t->exp_avg_sq[i] ||
                                (want_out && !t->param_out[i]) ||
                                (q8 && (!t->exp_avg_scale[i] || !t->exp_avg_sq_scale[i]))))
            return -EINVAL;
    }
    return 0;
}

int32_t ofl_adam_step_q(const ofl_adam_config *cfg, int32_t sd, const ofl_adam_qtensors *t,
                        int32_t *nonfinite_out) {
    return ofl_adam_step_qm(cfg, sd, OFL_DTYPE_F32, t, NULL, nonfinite_out);
}

int32_t ofl_adam_step_qm(const ofl_adam_config *cfg, int32_t sd, int32_t md, const ofl_adam_qtensors *t,
                         const uint64_t *seeds, int32_t *nonfinite_out) {
    int32_t rc = check_q_args(cfg, sd, md, t);
    int32_t isa;
    if (!rc && md != OFL_DTYPE_F32 && md != OFL_DTYPE_BF16) rc = -EINVAL;
    if (!rc && md == OFL_DTYPE_BF16 && t->count > 0) {
        if (!seeds) rc = -EINVAL;
        for (int64_t i = 0; !rc && i < t->count; i++)
            if (t->numel[i] > (int64_t)UINT32_MAX) rc = -EINVAL; /* the element counter is 32 bits */
    }
    if (!rc) rc = ofl_adam_resolve_isa(cfg->isa, &isa);
    if (rc) return rc;
    if (nonfinite_out) *nonfinite_out = 0;
    if (t->count == 0) return 0;
    int64_t *starts = malloc((size_t)(t->count + 1) * sizeof *starts);
    ofl_adam_coeffs *coeffs = malloc((size_t)t->count * sizeof *coeffs);
    uint32_t *keys = md == OFL_DTYPE_BF16 ? malloc((size_t)t->count * sizeof *keys) : NULL;
    if (!starts || !coeffs || (md == OFL_DTYPE_BF16 && !keys)) {
        free(starts);
        free(coeffs);
        free(keys);
        return -ENOMEM;
    }
    ofl_q8_tables_get();
    starts[0] = 0;
    for (int64_t i = 0; i < t->count; i++) {
        starts[i + 1] = starts[i] + blocks_of(t->numel[i]) * OFL_Q8_BLOCK;
        float *step = (float *)(uintptr_t)t->step[i];
        if (i > 0 && *step + 1.0f == *(float *)(uintptr_t)t->step[i - 1]) { /* a group's shared count */
            *step += 1.0f;
            coeffs[i] = coeffs[i - 1];
        } else {
            ofl_adam_coeffs_for(cfg, step, &coeffs[i]);
        }
        if (keys) keys[i] = ofl_sr_key(seeds[i], (uint32_t)*step);
    }
    q8_kernels k = kernels_for(isa);
    adamq_job job = {cfg, t, sd, coeffs, starts, k.adam, 0, md, keys, ofl_master_kernels_for(isa), k.m16,
                     ofl_adam_kernel_for(isa)};
    int64_t total = starts[t->count];
    ofl_parallel_chunks(adamq_chunk, &job, total, OFL_Q8_CHUNK_ELEMS, threads_for(cfg->num_threads, total));
    if (nonfinite_out) *nonfinite_out = job.nonfinite;
    free(starts);
    free(coeffs);
    free(keys);
    return 0;
}

/* ---- quantizing and dequantizing a whole array (checkpoints, conversions, tests) ---- */

typedef struct {
    const ofl_q8_tables *tab;
    q8_kernels k;
    int32_t map, quantize;
    float *x;
    uint8_t *codes;
    float *scales;
    int64_t n;
} convert_job;

static void convert_chunk(void *ctx, int64_t chunk, int64_t lo, int64_t hi) {
    convert_job *j = (convert_job *)ctx;
    (void)chunk;
    for (int64_t i = lo; i < hi; i += OFL_Q8_BLOCK) {
        int64_t len = hi - i < OFL_Q8_BLOCK ? hi - i : OFL_Q8_BLOCK;
        if (j->quantize) j->k.quant(j->tab, j->map, j->x + i, j->codes + i, j->scales + i / OFL_Q8_BLOCK, len);
        else j->k.dequant(j->tab, j->map, j->codes + i, j->scales[i / OFL_Q8_BLOCK], j->x + i, len);
    }
}

static int32_t convert(float *x, uint8_t *codes, float *scales, int64_t n, int32_t map, int32_t isa,
                       int32_t num_threads, int32_t quantize) {
    if (n < 0 || num_threads < 1 || (map != OFL_Q8_MAP_SIGNED && map != OFL_Q8_MAP_UNSIGNED) ||
        (n > 0 && (!x || !codes || !scales)))
        return -EINVAL;
    int32_t resolved;
    int32_t rc = ofl_adam_resolve_isa(isa, &resolved);
    if (rc) return rc;
    convert_job job = {ofl_q8_tables_get(), kernels_for(resolved), map, quantize, x, codes, scales, n};
    ofl_parallel_chunks(convert_chunk, &job, n, OFL_Q8_CHUNK_ELEMS, threads_for(num_threads, n));
    return 0;
}

int32_t ofl_q8_quantize(const float *x, uint8_t *codes, float *scales, int64_t n, int32_t map,
                        int32_t isa, int32_t num_threads) {
    return convert((float *)(uintptr_t)x, codes, scales, n, map, isa, num_threads, 1);
}

int32_t ofl_q8_dequantize(const uint8_t *codes, const float *scales, float *x, int64_t n,
                          int32_t map, int32_t isa, int32_t num_threads) {
    return convert(x, (uint8_t *)(uintptr_t)codes, (float *)(uintptr_t)scales, n, map, isa, num_threads, 0);
}
