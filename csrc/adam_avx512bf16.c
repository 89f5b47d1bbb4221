/* AVX-512 Adam whose bf16 param copy uses AVX512_BF16 (Cooper Lake, Sapphire Rapids and
 * later Xeons; AMD Zen 4 and later): one instruction instead of six where the step is
 * compute-bound (arrays in cache). Its bits are those of adam_avx512.c; gradient norms
 * use that file's kernel.
 */
#include "adam_internal.h"

#if OFL_HAVE_X86
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,avx512bf16")
#define OFL_AVX512_NATIVE_BF16 1
#include "adam_avx512_loop.h"

OFL_DEFINE_ADAM_KERNEL(ofl_adam_kernel_avx512bf16, adam_loop16)
OFL_DEFINE_ADAM_LOG_KERNEL(ofl_adam_log_kernel_avx512bf16, OFL_ADAM_LOOP16_LOG)
#endif /* OFL_HAVE_X86 */
