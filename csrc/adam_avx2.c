/* The AVX2 path (with FMA and F16C): the vector kernel (adam_vector.h) over the AVX2
 * layer (simd_avx2.h), 8 floats per vector.
 */
#include "simd.h"

#if RP_SIMD_X86
#include "simd_avx2.h"
#define RP_KERNEL rp_adam_kernel_avx2
#define RP_SUMSQ_KERNEL rp_sumsq_kernel_avx2
#include "adam_vector.h"
#else
RP_KERNEL_STUB(rp_adam_kernel_avx2)
RP_SUMSQ_STUB(rp_sumsq_kernel_avx2)
#endif
