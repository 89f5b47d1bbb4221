/* AVX-512 Adam (F + BW + VL + DQ, FMA, F16C conversions built in).
 *
 * bf16 is converted with integer operations (round to nearest even, NaN kept quiet),
 * which needs no AVX512_BF16; adam_avx512bf16.c is the same loop with that extension.
 */
#include "adam_internal.h"

#if OFL_HAVE_X86
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#define OFL_AVX512_NATIVE_BF16 0
#include "adam_avx512_loop.h"

OFL_DEFINE_ADAM_KERNEL(ofl_adam_kernel_avx512, adam_loop16)
OFL_DEFINE_ADAM_LOG_KERNEL(ofl_adam_log_kernel_avx512, OFL_ADAM_LOOP16_LOG)
OFL_DEFINE_SUMSQ_KERNEL(ofl_sumsq_kernel_avx512, sumsq_loop16)
OFL_DEFINE_LAND_KERNEL(ofl_land_kernel_avx512, land_loop16)
#endif /* OFL_HAVE_X86 */
