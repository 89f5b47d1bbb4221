/* AVX-512 with AVX512_VBMI Adam over compressed moments: the loop of adam_q8_avx512_loop.h with
 * the maps looked up by byte permutes, 64 codes an instruction. */
#include "adam_master.h"

#if OFL_HAVE_X86
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx2,fma,f16c")
#define OFL_Q8_VBMI 1
#include "adam_q8_avx512_loop.h"
#include "adam_q8_avx512_driver.h"
#endif /* OFL_HAVE_X86 */
