/* SIMD Adam / AdamW over many tensors in one call.
 *
 * This header is the declaration source for both the C and cffi's cdef: the
 * build script strips the preprocessor lines (guards, includes) and keeps the
 * integer #defines. Every function returns 0 or -errno and never exits.
 *
 * One call updates a whole set of tensors. The caller passes, per tensor, the
 * addresses of its fp32 master params, gradient (fp32, bf16 or fp16), fp32 first
 * and second moments, an optional low-precision output copy of the updated params,
 * and a float32 step counter that the call increments. The tensors are treated as
 * one virtual concatenation and split across threads in contiguous ranges, so 100
 * small tensors cost what one large tensor of the same total costs.
 */
#ifndef OFL_ADAM_H
#define OFL_ADAM_H

#include <stdint.h>

#define OFL_ADAM_ABI_VERSION 8

/* Instruction-set paths. AUTO picks the best the CPU and OS support. */
#define OFL_ISA_AUTO 0
#define OFL_ISA_SCALAR 1
#define OFL_ISA_AVX2 2
#define OFL_ISA_AVX512 3
#define OFL_ISA_AVX512_BF16 4 /* AVX512 with AVX512_BF16 for the bf16 param copy; same bits */

/* Element types of gradients and of the optional param copy. */
#define OFL_DTYPE_NONE -1
#define OFL_DTYPE_F32 0
#define OFL_DTYPE_BF16 1
#define OFL_DTYPE_F16 2

typedef struct {
    double lr; /* hyperparameters in double: 1 - beta2 must not lose digits */
    double beta1;
    double beta2;
    double eps;
    double weight_decay;
    int32_t adamw_mode;      /* 1: decoupled decay (AdamW); 0: L2 decay added to the gradient (Adam) */
    int32_t bias_correction; /* 1: divide the moments by (1 - beta^step); 0: use them as they are */
    double grad_scale;       /* every gradient is multiplied by this first (1/loss_scale * clip coefficient) */
    int32_t grad_dtype;      /* OFL_DTYPE_F32, _BF16 or _F16 */
    int32_t out_dtype;       /* OFL_DTYPE_NONE, or _BF16 / _F16 / _F32 for the param copy */
    int32_t isa;             /* OFL_ISA_* */
    int32_t num_threads;     /* >= 1 */
} ofl_adam_config;

/* Struct of arrays, `count` entries each; addresses as uint64_t so that Python can
 * fill them from plain integer arrays. param_out may be NULL when out_dtype is NONE. */
typedef struct {
    const uint64_t *param;      /* float32 *, updated in place */
    const uint64_t *grad;       /* grad_dtype *, read only */
    const uint64_t *exp_avg;    /* float32 *, updated in place */
    const uint64_t *exp_avg_sq; /* float32 *, updated in place */
    const uint64_t *param_out;  /* out_dtype *, written; or NULL */
    const uint64_t *step;       /* float32 * (one value), incremented by one before use */
    const int64_t *numel;       /* elements of tensor i, >= 0 */
    int64_t count;
} ofl_adam_tensors;

int32_t ofl_adam_abi_version(void);

/* 1 if this CPU and OS can run that path, else 0. */
int32_t ofl_adam_isa_supported(int32_t isa);

/* The path OFL_ISA_AUTO resolves to. */
int32_t ofl_adam_best_isa(void);

/* One Adam step over every tensor of `tensors`. *nonfinite_out is set to 1 if any
 * scaled gradient was inf or NaN (the update has then already used it: call
 * ofl_grad_sumsq first where a step must be skipped on overflow), else 0.
 * -EINVAL: bad dtype, count, numel, thread count or NULL address; -ENOTSUP: the
 * isa cannot run here; -ENOMEM. Nothing is modified when an error is returned. */
int32_t ofl_adam_step(const ofl_adam_config *config, const ofl_adam_tensors *tensors,
                      int32_t *nonfinite_out);

/* ---- the undo-logged step: a pass that a killed process's restart can finish
 * (adam_undo.c, [Note: undo log]) ---- */

/* Elements of the piece whose old values a thread keeps before updating it. */
#define OFL_UNDO_SUB_ELEMS 4096

/* Bytes of an undo buffer with `slots` thread slots for calls of up to max_elems
 * elements, or -EINVAL. */
int64_t ofl_adam_undo_bytes(int32_t slots, int64_t max_elems);

/* Lays out a fresh undo buffer (64-byte aligned, at least ofl_adam_undo_bytes long). */
int32_t ofl_adam_undo_init(void *undo, int64_t undo_bytes, int32_t slots, int64_t max_elems);

/* A new pass begins: no call of it is done. */
int32_t ofl_adam_undo_begin(void *undo, int64_t undo_bytes);

/* ofl_adam_step as call number `call` of a pass (0, 1, ... in order), keeping the undo log
 * in `undo` as it goes, on at most the buffer's slots threads. resume 0: the call runs
 * whole. resume 1 (a restart of the pass, same tensors and constants): a call the log says
 * is done does nothing; the call in flight has its half-written pieces restored
 * (*restored_out counts them) and its chunks not done run; later calls run whole.
 * The results are bit for bit ofl_adam_step's. -EINVAL also for a buffer that is not an
 * undo log of this build, or a resumed call after the one in flight; -E2BIG: more
 * elements than the buffer was made for. */
int32_t ofl_adam_step_undo(const ofl_adam_config *config, const ofl_adam_tensors *tensors, void *undo,
                           int64_t undo_bytes, int64_t call, int32_t resume, int32_t *nonfinite_out,
                           int64_t *restored_out);

/* For tests: the process SIGKILLs itself halfway through the first sub-chunk at or after
 * element `offset` of chunk `chunk` of call `call` of an undo-logged pass (call -1: never). */
int32_t ofl_adam_undo_fault(int64_t call, int64_t chunk, int64_t offset);

/* Sum of squares, in double, of `count` gradient buffers of one dtype. A result
 * that is inf or NaN means some gradient was not finite. */
int32_t ofl_grad_sumsq(const uint64_t *grads, const int64_t *numel, int64_t count,
                       int32_t dtype, int32_t isa, int32_t num_threads, double *sumsq_out);

/* Lands `count` gradient pieces into accumulators in one pass: dst[i] = src[i]
 * (accumulate 0: the first micro-step) or dst[i] += src[i] (accumulate 1), the sources
 * of one dtype (F32, BF16, F16), the accumulators of dst_dtype F32 or BF16 (the sum
 * taken in fp32, then rounded to nearest even: the value stored is the value summed
 * below), and with zero_src 1 each source element set to zero
 * once read (the flat gradient buffer is then ready for the next backward). The sum
 * of squares, in double, of the landed dst values goes to *sumsq_out: the pieces are
 * one virtual concatenation cut on the chunk grid of ofl_grad_sumsq, with the same
 * per-chunk partials summed in chunk order, so the result equals ofl_grad_sumsq of the
 * dsts afterwards, for any thread count. Pieces must not overlap one another.
 * -EINVAL: bad dtype, flag, count, numel, thread count or NULL address; -ENOTSUP: the
 * isa cannot run here; -ENOMEM. Nothing is modified when an error is returned. */
int32_t ofl_grad_land(const uint64_t *dsts, const uint64_t *srcs, const int64_t *numel, int64_t count,
                      int32_t dtype, int32_t dst_dtype, int32_t accumulate, int32_t zero_src, int32_t isa,
                      int32_t num_threads, double *sumsq_out);

/* Roofline probe with Adam's memory traffic: a += b; c += b; d += b, in place over
 * n floats (reads 16 bytes and writes 12 per element, as Adam does). */
int32_t ofl_stream_inplace(float *a, const float *b, float *c, float *d, int64_t n,
                           int32_t num_threads);

/* ---- Adam with compressed moments (bf16, or 8-bit blockwise-quantized) ----
 * [Note: quantized Adam states]
 * The fp32 master stays; only exp_avg and exp_avg_sq are stored small. BF16: each
 * moment a bfloat16 (round to nearest even). Q8: each moment a uint8 code per element
 * and one float32 scale per block of OFL_Q8_BLOCK elements of a tensor (the block's
 * absolute maximum; the last block may be shorter). A code indexes a 256-value map in
 * [-1, 1] (exp_avg, OFL_Q8_MAP_SIGNED) or [0, 1] (exp_avg_sq, OFL_Q8_MAP_UNSIGNED):
 * the dynamic (base-10 exponent) map of Dettmers et al. 2022, "8-bit Optimizers via
 * Block-wise Quantization", see adam_q8.c. A value is map[code] * scale; quantizing
 * picks the nearest map value to x / scale (but for float rounding near a midpoint:
 * [Note: the code of a value] in adam_q8.h), and a positive
 * exp_avg_sq is never coded as zero, so sqrt(v) + eps never collapses for an element
 * that has seen a gradient. One fused pass per block dequantizes, updates (the fp32
 * update sees the fresh fp32 moments) and requantizes; threads take whole blocks, so
 * every ISA and thread count gives the same bits. */
#define OFL_STATE_F32 0
#define OFL_STATE_BF16 1
#define OFL_STATE_Q8 2
#define OFL_Q8_BLOCK 256
#define OFL_Q8_MAP_SIGNED 0
#define OFL_Q8_MAP_UNSIGNED 1

/* As ofl_adam_tensors; exp_avg/exp_avg_sq point at uint16 (BF16) or uint8 codes (Q8);
 * the scales (Q8 only, else NULL) at float32[ceil(numel / OFL_Q8_BLOCK)] each. */
typedef struct {
    const uint64_t *param;
    const uint64_t *grad;
    const uint64_t *exp_avg;
    const uint64_t *exp_avg_sq;
    const uint64_t *exp_avg_scale;
    const uint64_t *exp_avg_sq_scale;
    const uint64_t *param_out;
    const uint64_t *step;
    const int64_t *numel;
    int64_t count;
} ofl_adam_qtensors;

/* ofl_adam_step over compressed moments (state_dtype OFL_STATE_BF16 or _Q8); the same
 * errors, and -EINVAL for another state_dtype. */
int32_t ofl_adam_step_q(const ofl_adam_config *config, int32_t state_dtype,
                        const ofl_adam_qtensors *tensors, int32_t *nonfinite_out);

/* The 256 values of a Q8 map, ascending by code within each sign. */
int32_t ofl_q8_map(int32_t map, float *values_out);

/* x (n floats) -> codes (n bytes) and scales (ceil(n / OFL_Q8_BLOCK) floats), and back. */
int32_t ofl_q8_quantize(const float *x, uint8_t *codes, float *scales, int64_t n, int32_t map,
                        int32_t isa, int32_t num_threads);
int32_t ofl_q8_dequantize(const uint8_t *codes, const float *scales, float *x, int64_t n,
                          int32_t map, int32_t isa, int32_t num_threads);

/* ---- a bfloat16 master (offload.master_dtype "bf16") ----
 * [Note: a bf16 master]
 * With compressed moments the master itself may be stored as bfloat16 (2 bytes a param
 * instead of 4); so may a bfloat16 model's params with float32 moments. Each element is widened to fp32 exactly, updated as in ofl_adam_step_q
 * (the same operations, so the fp32 result is that of an fp32 master holding the widened
 * value), and stored back by stochastic rounding: it rounds away from zero with probability
 * (its 16 dropped bits) / 2^16, so an update smaller than the master's last place is kept
 * on average rather than always lost (round to nearest would stall a small learning rate;
 * torchao's bf16 optimizers and Zamirai et al. 2020 do the same). The random bits of element
 * j of tensor i are fmix32(j * 0x9e3779b1 + key), key = ofl_sr_key(seeds[i], step count after
 * this call's increment) (adam_master.h): a function of the element, its tensor's seed and
 * the step only, so every ISA and thread count, and a pass run again after a crash, give the
 * same bits. With a param copy (out_dtype) the copy is the rounded master's value: bf16 the
 * master's bits, fp32 its exact widening, fp16 that rounded to nearest even. */

/* ofl_adam_step_q with the master of master_dtype: OFL_DTYPE_F32 (param as float32, seeds
 * unused: ofl_adam_step_q itself) or OFL_DTYPE_BF16 (param as uint16 bfloat16, seeds[count]
 * needed). A bf16 master also takes state_dtype OFL_STATE_F32: float32 moments, updated as by
 * ofl_adam_step (a bfloat16 model's params with exact moments). -EINVAL for another master
 * dtype, fp32 moments with an fp32 master (that is ofl_adam_step), a missing seed table, or a
 * tensor of 2^32 or more elements with a bf16 master. */
int32_t ofl_adam_step_qm(const ofl_adam_config *config, int32_t state_dtype, int32_t master_dtype,
                         const ofl_adam_qtensors *tensors, const uint64_t *seeds, int32_t *nonfinite_out);

/* n floats rounded stochastically to bfloat16 as the step rounds elements first .. first + n - 1
 * of a tensor of that seed at that step (for tests and conversions). */
int32_t ofl_bf16_round_sr(const float *x, uint16_t *out, int64_t n, uint64_t seed, uint32_t step,
                          int64_t first, int32_t isa);

/* ---- where a call's threads come from ([Note: one thread team] in ofl_parallel.h) ---- */
#define OFL_THREADS_POOL 0         /* the library's own pool of pthreads */
#define OFL_THREADS_TEAM 1         /* the process's OpenMP team on the main thread (default) */

/* Sets the mode for later calls, process-wide; -EINVAL for another value. */
int32_t ofl_parallel_set_threads(int32_t mode);
/* 1 when the process has one libgomp whose team the main thread's calls can run on. */
int32_t ofl_parallel_team_found(void);
/* out[0] calls run on the team, out[1] of them closed late (a member the scheduler ran
 * late), out[2] the nanoseconds those closes waited past the caller's last task. */
void ofl_parallel_team_stats(uint64_t *out);

#endif /* OFL_ADAM_H */
