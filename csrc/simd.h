/* What the SIMD layers (simd_avx2.h, simd_avx512.h) have in common: whether this compiler
 * and architecture can build them, and the stub kernel an ISA file defines where it cannot.
 *
 * A layer defines, for one ISA, the vector types and the few dozen operations that
 * adam_vector.h writes the kernel with:
 *   vf   RP_W floats        vf_set1 vf_load vf_store vf_add vf_sub vf_mul vf_div vf_fmadd
 *                           vf_sqrt vf_max vf_abs vf_neg vf_from_bits vf_from_f16 ...
 *   vi   RP_W int32 lanes   vi_set1 vi_iota vi_add vi_sub vi_and vi_xor vi_srli vi_slli
 *                           vi_mullo vi_min vi_max vi_bits vi_cvtt ...
 *   vh   RP_W 16-bit lanes  vh_load vh_store vh_stream vh_narrow vi_widen_u16 vh_f16 ...
 *   vm   a lane mask        vm_le vm_lt vm_ge vm_gt vm_ord vm_nan vm_first vm_all, and the
 *                           masked forms vi_blend vi_inc_where vi_zero_unless ...
 *   vd   4 doubles          vd_zero vd_store vd_add_squares: the sum of squares' four
 *                           running sums (rp_grad_sumsq), the same width on every ISA
 * Each operation is one instruction (or the fixed sequence the ISA needs for it), so the
 * floating-point operations of adam_vector.h are the same, in the same order, on every
 * ISA: that, with -ffp-contract=off, is what keeps the paths bit-identical.
 */
#ifndef RP_SIMD_H
#define RP_SIMD_H

#include <stdint.h>

#include "adam.h"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define RP_SIMD_X86 1
#else
#define RP_SIMD_X86 0
#endif

/* Not x86 or not GCC/clang: the kernel is never called (rp_adam_isa_supported() says no),
 * but it must exist for the library to link. */
#define RP_KERNEL_STUB(name)                                                                  \
    void name(const rp_adam_tensor *t, const rp_adam_hyper *h, int64_t begin, int64_t end,  \
              int prefetch) {                                                               \
        (void)t;                                                                            \
        (void)h;                                                                            \
        (void)begin;                                                                        \
        (void)end;                                                                          \
        (void)prefetch;                                                                     \
    }

/* The same for an ISA file's sum-of-squares kernel. */
#define RP_SUMSQ_STUB(name)                                                                   \
    double name(const rp_adam_tensor *t, int64_t begin, int64_t end) {                      \
        (void)t;                                                                            \
        (void)begin;                                                                        \
        (void)end;                                                                          \
        return 0.0;                                                                         \
    }

#endif
