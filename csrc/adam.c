/* Adam dispatch: validation, per-tensor constants, ISA choice and threading. */
#include <errno.h>
#include <stdlib.h>

#include "adam_internal.h"
#include "ofl_parallel.h"

/* Below this many elements a thread costs more to wake than it saves. */
#define OFL_MIN_ELEMS_PER_THREAD 65536

int32_t ofl_adam_abi_version(void) { return OFL_ADAM_ABI_VERSION; }

int32_t ofl_adam_isa_supported(int32_t isa) {
    switch (isa) {
    case OFL_ISA_AUTO:
    case OFL_ISA_SCALAR: return 1;
#if OFL_HAVE_X86
    case OFL_ISA_AVX2:
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case OFL_ISA_AVX512:
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("fma");
    case OFL_ISA_AVX512_BF16:
        return ofl_adam_isa_supported(OFL_ISA_AVX512) && __builtin_cpu_supports("avx512bf16");
#endif
    default: return 0;
    }
}

int32_t ofl_adam_best_isa(void) {
    if (ofl_adam_isa_supported(OFL_ISA_AVX512_BF16)) return OFL_ISA_AVX512_BF16;
    if (ofl_adam_isa_supported(OFL_ISA_AVX512)) return OFL_ISA_AVX512;
    if (ofl_adam_isa_supported(OFL_ISA_AVX2)) return OFL_ISA_AVX2;
    return OFL_ISA_SCALAR;
}

/* Resolves AUTO and checks the rest; 0 on success or -ENOTSUP / -EINVAL. */
static int32_t resolve_isa(int32_t isa, int32_t *resolved) {
    if (isa < OFL_ISA_AUTO || isa > OFL_ISA_AVX512_BF16) return -EINVAL;
    if (isa == OFL_ISA_AUTO) isa = ofl_adam_best_isa();
    if (!ofl_adam_isa_supported(isa)) return -ENOTSUP;
    *resolved = isa;
    return 0;
}

ofl_adam_kernel_fn ofl_adam_kernel_for(int32_t isa) {
#if OFL_HAVE_X86
    if (isa == OFL_ISA_AVX512_BF16) return ofl_adam_kernel_avx512bf16;
    if (isa == OFL_ISA_AVX512) return ofl_adam_kernel_avx512;
    if (isa == OFL_ISA_AVX2) return ofl_adam_kernel_avx2;
#endif
    (void)isa;
    return ofl_adam_kernel_scalar;
}

static ofl_sumsq_kernel_fn sumsq_kernel_for(int32_t isa) {
#if OFL_HAVE_X86
    if (isa == OFL_ISA_AVX512 || isa == OFL_ISA_AVX512_BF16) return ofl_sumsq_kernel_avx512;
    if (isa == OFL_ISA_AVX2) return ofl_sumsq_kernel_avx2;
#endif
    (void)isa;
    return ofl_sumsq_kernel_scalar;
}

static int64_t dtype_bytes(int32_t dtype) { return dtype == OFL_DTYPE_F32 ? 4 : 2; }

int32_t ofl_effective_threads(int32_t requested, int64_t total) {
    int64_t useful = total / OFL_MIN_ELEMS_PER_THREAD;
    if (useful < 1) useful = 1;
    return useful < requested ? (int32_t)useful : requested;
}

/* ---- walking a thread's share of a virtual concatenation of tensors ---- */

/* starts has count + 1 entries: starts[i] is where tensor i begins. */
void ofl_walk_share(const int64_t *starts, int64_t count, int64_t lo, int64_t hi,
                    ofl_segment_fn visit, void *ctx) {
    if (lo >= hi) return;
    int64_t a = 0, b = count - 1; /* first tensor whose end is past lo */
    while (a < b) {
        int64_t mid = a + (b - a) / 2;
        if (starts[mid + 1] <= lo) a = mid + 1;
        else b = mid;
    }
    for (int64_t t = a; t < count && starts[t] < hi; t++) {
        int64_t s = lo > starts[t] ? lo : starts[t];
        int64_t e = hi < starts[t + 1] ? hi : starts[t + 1];
        if (e > s) visit(ctx, t, s - starts[t], e - s);
    }
}

int64_t *ofl_prefix_starts(const int64_t *numel, int64_t count) {
    int64_t *starts = malloc((size_t)(count + 1) * sizeof *starts);
    if (!starts) return NULL;
    starts[0] = 0;
    for (int64_t i = 0; i < count; i++) starts[i + 1] = starts[i] + numel[i];
    return starts;
}

/* ---- Adam ---- */

void ofl_adam_job_segment(void *ctx, int64_t i, int64_t off, int64_t len) {
    ofl_adam_job *job = (ofl_adam_job *)ctx;
    const ofl_adam_tensors *t = job->t;
    int32_t od = job->cfg->out_dtype;
    char *g = (char *)(uintptr_t)t->grad[i] + off * dtype_bytes(job->cfg->grad_dtype);
    char *out = od == OFL_DTYPE_NONE
                    ? NULL
                    : (char *)(uintptr_t)t->param_out[i] + off * dtype_bytes(od);
    int32_t bad = job->kernel(&job->coeffs[i], job->cfg->grad_dtype, od,
                              (float *)(uintptr_t)t->param[i] + off, g,
                              (float *)(uintptr_t)t->exp_avg[i] + off,
                              (float *)(uintptr_t)t->exp_avg_sq[i] + off, out, len);
    if (bad) __atomic_store_n(&job->nonfinite, 1, __ATOMIC_RELAXED);
}

static void adam_chunk(void *ctx, int64_t chunk, int64_t lo, int64_t hi) {
    ofl_adam_job *job = (ofl_adam_job *)ctx;
    (void)chunk;
    ofl_walk_share(job->starts, job->t->count, lo, hi, ofl_adam_job_segment, job);
}

static int32_t check_adam_args(const ofl_adam_config *cfg, const ofl_adam_tensors *t) {
    if (!cfg || !t || t->count < 0 || cfg->num_threads < 1) return -EINVAL;
    if (cfg->grad_dtype < OFL_DTYPE_F32 || cfg->grad_dtype > OFL_DTYPE_F16) return -EINVAL;
    if (cfg->out_dtype < OFL_DTYPE_NONE || cfg->out_dtype > OFL_DTYPE_F16) return -EINVAL;
    if (t->count == 0) return 0;
    int want_out = cfg->out_dtype != OFL_DTYPE_NONE;
    if (!t->param || !t->grad || !t->exp_avg || !t->exp_avg_sq || !t->step || !t->numel ||
        (want_out && !t->param_out))
        return -EINVAL;
    for (int64_t i = 0; i < t->count; i++) {
        if (t->numel[i] < 0 || !t->step[i]) return -EINVAL;
        if (t->numel[i] > 0 && (!t->param[i] || !t->grad[i] || !t->exp_avg[i] ||
                                !t->exp_avg_sq[i] || (want_out && !t->param_out[i])))
            return -EINVAL;
    }
    return 0;
}

/* Increments tensor i's step and derives its constants in double. */
static void step_coeffs(const ofl_adam_config *cfg, float *step, ofl_adam_coeffs *c) {
    *step += 1.0f;
    double t = *step;
    double bc1 = cfg->bias_correction ? 1.0 - pow(cfg->beta1, t) : 1.0;
    double bc2 = cfg->bias_correction ? 1.0 - pow(cfg->beta2, t) : 1.0;
    c->beta1 = (float)cfg->beta1;
    c->one_minus_beta1 = (float)(1.0 - cfg->beta1);
    c->beta2 = (float)cfg->beta2;
    c->one_minus_beta2 = (float)(1.0 - cfg->beta2);
    c->eps = (float)cfg->eps;
    c->step_size = (float)(cfg->lr / bc1);
    c->inv_bias2_sqrt = (float)(1.0 / sqrt(bc2));
    c->decay_mul = cfg->adamw_mode ? (float)(1.0 - cfg->lr * cfg->weight_decay) : 1.0f;
    c->l2_decay = cfg->adamw_mode ? 0.0f : (float)cfg->weight_decay;
    c->grad_scale = (float)cfg->grad_scale;
}

int32_t ofl_adam_job_init(ofl_adam_job *job, const ofl_adam_config *cfg, const ofl_adam_tensors *t) {
    int32_t rc = check_adam_args(cfg, t);
    if (rc) return rc;
    int32_t isa;
    rc = resolve_isa(cfg->isa, &isa);
    if (rc) return rc;
    *job = (ofl_adam_job){cfg, t, NULL, NULL, ofl_adam_kernel_for(isa), 0};
    if (t->count == 0) return 0;

    int64_t *starts = ofl_prefix_starts(t->numel, t->count);
    ofl_adam_coeffs *coeffs = malloc((size_t)t->count * sizeof *coeffs);
    if (!starts || !coeffs) {
        free(starts);
        free(coeffs);
        return -ENOMEM;
    }
    for (int64_t i = 0; i < t->count; i++) {
        float *step = (float *)(uintptr_t)t->step[i];
        /* The tensors of a group share a step count: derive the constants once per value
         * (two pow() calls per tensor are a visible cost at 1,000 small tensors). */
        if (i > 0 && *step + 1.0f == *(float *)(uintptr_t)t->step[i - 1]) {
            *step += 1.0f;
            coeffs[i] = coeffs[i - 1];
        } else {
            step_coeffs(cfg, step, &coeffs[i]);
        }
    }
    job->starts = starts;
    job->coeffs = coeffs;
    return 0;
}

void ofl_adam_job_free(ofl_adam_job *job) {
    free(job->starts);
    free(job->coeffs);
    job->starts = NULL;
    job->coeffs = NULL;
}

int32_t ofl_adam_step(const ofl_adam_config *cfg, const ofl_adam_tensors *t,
                      int32_t *nonfinite_out) {
    ofl_adam_job job;
    int32_t rc = ofl_adam_job_init(&job, cfg, t);
    if (rc) return rc;
    if (nonfinite_out) *nonfinite_out = 0;
    if (t->count == 0) return 0;
    int64_t total = job.starts[t->count];
    ofl_parallel_chunks(adam_chunk, &job, total, OFL_CHUNK_ELEMS,
                        ofl_effective_threads(cfg->num_threads, total));
    if (nonfinite_out) *nonfinite_out = job.nonfinite;
    ofl_adam_job_free(&job);
    return 0;
}

/* ---- gradient sum of squares, and the landing pass that takes it on the way ---- */

static ofl_land_kernel_fn land_kernel_for(int32_t isa) {
#if OFL_HAVE_X86
    if (isa == OFL_ISA_AVX512 || isa == OFL_ISA_AVX512_BF16) return ofl_land_kernel_avx512;
    if (isa == OFL_ISA_AVX2) return ofl_land_kernel_avx2;
#endif
    (void)isa;
    return ofl_land_kernel_scalar;
}

typedef struct {
    const uint64_t *grads;  /* the sources (landing) or the gradients (sum of squares) */
    const uint64_t *dsts;   /* landing only: the accumulators (of dst_dtype); NULL for a plain sum */
    const int64_t *starts;
    int64_t count;
    int32_t dtype, dst_dtype;
    int32_t accumulate, zero_src;
    ofl_sumsq_kernel_fn kernel;
    ofl_land_kernel_fn land;
    double *partial; /* one per chunk, summed in chunk order: the result is deterministic */
} sumsq_job;

typedef struct {
    sumsq_job *job;
    int64_t chunk;
} sumsq_visit;

static void sumsq_segment(void *ctx, int64_t i, int64_t off, int64_t len) {
    sumsq_visit *sv = (sumsq_visit *)ctx;
    sumsq_job *job = sv->job;
    char *g = (char *)(uintptr_t)job->grads[i] + off * dtype_bytes(job->dtype);
    if (job->dsts)
        job->land(job->dtype, job->dst_dtype, job->accumulate, job->zero_src,
                  (char *)(uintptr_t)job->dsts[i] + off * dtype_bytes(job->dst_dtype), g, len, &job->partial[sv->chunk]);
    else
        job->kernel(job->dtype, g, len, &job->partial[sv->chunk]);
}

static void sumsq_chunk(void *ctx, int64_t chunk, int64_t lo, int64_t hi) {
    sumsq_job *job = (sumsq_job *)ctx;
    sumsq_visit sv = {job, chunk};
    ofl_walk_share(job->starts, job->count, lo, hi, sumsq_segment, &sv);
}

/* Checks shared by the sum of squares and the landing; 0 or -EINVAL. */
static int32_t check_sumsq_args(const uint64_t *grads, const uint64_t *dsts, const int64_t *numel,
                                int64_t count, int32_t dtype, int32_t num_threads, double *sumsq_out) {
    if (!sumsq_out || count < 0 || num_threads < 1) return -EINVAL;
    if (dtype < OFL_DTYPE_F32 || dtype > OFL_DTYPE_F16) return -EINVAL;
    if (count > 0 && (!grads || !numel)) return -EINVAL;
    for (int64_t i = 0; i < count; i++)
        if (numel[i] < 0 || (numel[i] > 0 && (!grads[i] || (dsts && !dsts[i])))) return -EINVAL;
    return 0;
}

/* Runs `job` (grads, dsts and flags set) over the chunk grid; the sum goes to *sumsq_out. */
static int32_t run_sumsq(sumsq_job *job, const int64_t *numel, int32_t num_threads, double *sumsq_out) {
    *sumsq_out = 0.0;
    if (job->count == 0) return 0;
    int64_t *starts = ofl_prefix_starts(numel, job->count);
    int64_t total = starts ? starts[job->count] : 0;
    int64_t chunks = (total + OFL_CHUNK_ELEMS - 1) / OFL_CHUNK_ELEMS;
    double *partial = calloc((size_t)(chunks > 0 ? chunks : 1), sizeof *partial);
    if (!starts || !partial) {
        free(starts);
        free(partial);
        return -ENOMEM;
    }
    job->starts = starts;
    job->partial = partial;
    ofl_parallel_chunks(sumsq_chunk, job, total, OFL_CHUNK_ELEMS, ofl_effective_threads(num_threads, total));
    double s = 0.0;
    for (int64_t i = 0; i < chunks; i++) s += partial[i];
    *sumsq_out = s;
    free(starts);
    free(partial);
    return 0;
}

int32_t ofl_grad_sumsq(const uint64_t *grads, const int64_t *numel, int64_t count,
                       int32_t dtype, int32_t isa, int32_t num_threads, double *sumsq_out) {
    int32_t rc = check_sumsq_args(grads, NULL, numel, count, dtype, num_threads, sumsq_out);
    int32_t resolved;
    if (!rc) rc = resolve_isa(isa, &resolved);
    if (rc) return rc;
    sumsq_job job = {grads, NULL, NULL, count, dtype, OFL_DTYPE_F32, 0, 0, sumsq_kernel_for(resolved), NULL, NULL};
    return run_sumsq(&job, numel, num_threads, sumsq_out);
}

int32_t ofl_grad_land(const uint64_t *dsts, const uint64_t *srcs, const int64_t *numel, int64_t count,
                      int32_t dtype, int32_t dst_dtype, int32_t accumulate, int32_t zero_src, int32_t isa,
                      int32_t num_threads, double *sumsq_out) {
    if ((count > 0 && !dsts) || (accumulate != 0 && accumulate != 1) || (zero_src != 0 && zero_src != 1) ||
        (dst_dtype != OFL_DTYPE_F32 && dst_dtype != OFL_DTYPE_BF16))
        return -EINVAL;
    int32_t rc = check_sumsq_args(srcs, dsts, numel, count, dtype, num_threads, sumsq_out);
    int32_t resolved;
    if (!rc) rc = resolve_isa(isa, &resolved);
    if (rc) return rc;
    sumsq_job job = {srcs, dsts, NULL, count, dtype, dst_dtype, accumulate, zero_src, NULL, land_kernel_for(resolved),
                     NULL};
    return run_sumsq(&job, numel, num_threads, sumsq_out);
}

/* ---- roofline probe ---- */

typedef struct {
    float *a;
    const float *b;
    float *c;
    float *d;
    int64_t n;
} stream_job;

#if OFL_HAVE_X86
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
static void stream_range(float *restrict a, const float *restrict b, float *restrict c,
                         float *restrict d, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        float x = b[i];
        a[i] += x;
        c[i] += x;
        d[i] += x;
    }
}

static void stream_chunk(void *ctx, int64_t chunk, int64_t lo, int64_t hi) {
    stream_job *j = (stream_job *)ctx;
    (void)chunk;
    stream_range(j->a + lo, j->b + lo, j->c + lo, j->d + lo, hi - lo);
}

int32_t ofl_stream_inplace(float *a, const float *b, float *c, float *d, int64_t n,
                           int32_t num_threads) {
    if (n < 0 || num_threads < 1 || (n > 0 && (!a || !b || !c || !d))) return -EINVAL;
    stream_job job = {a, b, c, d, n};
    ofl_parallel_chunks(stream_chunk, &job, n, OFL_CHUNK_ELEMS, ofl_effective_threads(num_threads, n));
    return 0;
}

/* ---- for the compressed-state pass (adam_q8.c) ---- */

void ofl_adam_coeffs_for(const ofl_adam_config *cfg, float *step, ofl_adam_coeffs *c) {
    step_coeffs(cfg, step, c);
}

int32_t ofl_adam_resolve_isa(int32_t isa, int32_t *resolved) { return resolve_isa(isa, resolved); }
