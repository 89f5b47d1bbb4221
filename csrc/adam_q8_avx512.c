/* AVX-512 (F/BW/VL/DQ) Adam over compressed moments: the loop of adam_q8_avx512_loop.h with
 * the maps looked up by 32-bit permutes. */
#include "adam_master.h"

#if OFL_HAVE_X86
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#define OFL_Q8_VBMI 0
#include "adam_q8_avx512_loop.h"
#include "adam_q8_avx512_driver.h"
#endif /* OFL_HAVE_X86 */
