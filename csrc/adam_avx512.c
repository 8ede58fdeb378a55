/* The AVX-512 path: the vector kernel (adam_vector.h) over the AVX-512F layer
 * (simd_avx512.h), 16 floats per vector; and the timing that picks its 8-bit tables'
 * lookups (permutes or gathers).
 */
#define _POSIX_C_SOURCE 199309L /* clock_gettime under -std=c11 */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "simd.h"

#if RP_SIMD_X86
#include "simd_avx512.h"
#define RP_KERNEL rp_adam_kernel_avx512
#define RP_SUMSQ_KERNEL rp_sumsq_kernel_avx512
#include "adam_vector.h"

static double rp_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* rp_adam_q8_calibrate (adam.h): one thread, a compact-mode tensor of 64 K elements (bf16
 * parameter and gradient, 8-bit moments, a table of ramps standing in for the maps: the
 * lookups' cost does not depend on the values), each flavour run 2 + 5 times interleaved,
 * the faster best time kept. About a millisecond. */
int rp_adam_q8_calibrate_avx512(void) {
    enum { N = 1 << 16, BLOCKS = N / RP_QBLOCK };
    static float qmap[RP_QMAP_SIZE];
    for (int k = 0; k < RP_QMAP_SIZE; ++k) qmap[k] = (float)(k % 256) / 256.0f;
    uint16_t *param = malloc(2 * N * sizeof(uint16_t));
    uint8_t *codes = calloc(2 * N, 1);
    float *absmax = calloc(2 * BLOCKS, sizeof(float));
    if (!param || !codes || !absmax) {
        free(param), free(codes), free(absmax);
        return rp_adam_q8_permute_flag;
    }
    for (int k = 0; k < 2 * N; ++k) param[k] = (uint16_t)(0x3C00u + (unsigned)(k & 255));
    rp_adam_hyper h;
    memset(&h, 0, sizeof h);
    h.decoupled_decay = 1.0f, h.beta1_weight = 0.1f, h.beta2 = 0.999f;
    h.one_minus_beta2 = 0.001f, h.inv_bias_correction2_sqrt = 1.0f, h.eps = 1e-8f;
    h.neg_step_size = -1e-3f, h.sr_seed = 1, h.param_sr_seed = 2, h.qmap = (uintptr_t)qmap;
    rp_adam_tensor t;
    memset(&t, 0, sizeof t);
    t.param = (uintptr_t)param, t.grad = (uintptr_t)(param + N);
    t.exp_avg = (uintptr_t)codes, t.exp_avg_sq = (uintptr_t)(codes + N);
    t.exp_avg_absmax = (uintptr_t)absmax, t.exp_avg_sq_absmax = (uintptr_t)(absmax + BLOCKS);
    t.numel = N, t.grad_dtype = RP_DTYPE_BF16, t.state_dtype = RP_DTYPE_Q8;
    t.param_dtype = RP_DTYPE_BF16;
    double best[2] = {1e30, 1e30};
    for (int round = 0; round < 7; ++round) {
        for (int flavour = 0; flavour < 2; ++flavour) {
            rp_adam_q8_permute_flag = flavour;
            double start = rp_seconds();
            rp_adam_kernel_avx512(&t, &h, 0, N, 0);
            double took = rp_seconds() - start;
            if (round >= 2 && took < best[flavour]) best[flavour] = took;
        }
    }
    int chosen = best[1] <= best[0];
    rp_adam_q8_permute_flag = chosen;
    free(param), free(codes), free(absmax);
    return chosen;
}

#else

int rp_adam_q8_calibrate_avx512(void) { return -1; }

RP_KERNEL_STUB(rp_adam_kernel_avx512)
RP_SUMSQ_STUB(rp_sumsq_kernel_avx512)

#endif
