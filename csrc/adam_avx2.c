/* The AVX2 path (with FMA and F16C): 8 floats per vector, the same roundings as the
 * scalar path (adam.c).
 *
 * Functions carry a target attribute instead of the file being built with -mavx2, so one
 * build runs on any x86-64 CPU; adam.c calls this kernel only when the CPU has the ISA.
 */
#include <stdint.h>
#include <string.h>

#include "adam.h"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#define RP_TARGET __attribute__((target("avx2,fma,f16c")))
/* Elements ahead to prefetch: 2 KiB of each array (512, 1024 and 2048 measured on the
 * 16-core GPU host: 512 was the steadiest). */
#define RP_PREFETCH_AHEAD 512

/* The address RP_PREFETCH_AHEAD floats on, computed as an integer: it may lie past the
 * end of the array, where pointer arithmetic would be undefined. */
static inline const char *rp_ahead(const float *p) {
    return (const char *)((uintptr_t)p + RP_PREFETCH_AHEAD * sizeof(float));
}

#define W 8

typedef struct {
    __m256 l2, decay, w, w_big, beta2, c2, inv_bc2, eps, nss, sign;
    int small_weight, maximize, use_l2, use_decoupled, amsgrad, copy;
} rp_consts;

/* fp32 -> bf16 bits, round to nearest even, NaN -> 0x7FC0 (c10::BFloat16's conversion). */
RP_TARGET static inline __m128i to_bf16(__m256 p) {
    __m256i u = _mm256_castps_si256(p);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(p, p, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    /* r holds values <= 0xFFFF, so the unsigned-saturating pack is exact; it packs
     * per 128-bit lane, the permute gathers the two halves. */
    __m256i packed = _mm256_packus_epi32(r, r);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0xD8));
}

/* One vector of the update; `max_sq` is touched only with amsgrad. */
RP_TARGET static inline __m128i update(const rp_consts *c, float *param, const float *grad,
                                       float *exp_avg, float *exp_avg_sq, float *max_sq) {
    __m256 p = _mm256_loadu_ps(param);
    __m256 g = _mm256_loadu_ps(grad);
    __m256 m = _mm256_loadu_ps(exp_avg);
    __m256 v = _mm256_loadu_ps(exp_avg_sq);
    if (c->maximize) g = _mm256_xor_ps(g, c->sign);
    if (c->use_l2) g = _mm256_fmadd_ps(p, c->l2, g);
    if (c->use_decoupled) p = _mm256_mul_ps(p, c->decay);
    __m256 diff = _mm256_sub_ps(g, m);
    m = c->small_weight ? _mm256_fmadd_ps(c->w, diff, m) : _mm256_fmadd_ps(c->w_big, diff, g);
    v = _mm256_mul_ps(v, c->beta2);
    v = _mm256_fmadd_ps(_mm256_mul_ps(c->c2, g), g, v);
    __m256 s = v;
    if (c->amsgrad) {
        s = _mm256_max_ps(_mm256_loadu_ps(max_sq), v);
        _mm256_storeu_ps(max_sq, s);
    }
    __m256 denom = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(s), c->inv_bc2), c->eps);
    p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(c->nss, m), denom));
    _mm256_storeu_ps(param, p);
    _mm256_storeu_ps(exp_avg, m);
    _mm256_storeu_ps(exp_avg_sq, v);
    if (c->copy == RP_COPY_FP16)
        return _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    if (c->copy == RP_COPY_BF16) return to_bf16(p);
    return _mm_setzero_si128();
}

RP_TARGET void rp_adam_kernel_avx2(const rp_adam_tensor *t, const rp_adam_hyper *h,
                                   int64_t begin, int64_t end, int prefetch) {
    float *param = (float *)t->param;
    const float *grad = (const float *)t->grad;
    float *exp_avg = (float *)t->exp_avg;
    float *exp_avg_sq = (float *)t->exp_avg_sq;
    float *max_sq = (float *)t->max_exp_avg_sq;
    uint16_t *copy = (uint16_t *)t->model_copy;
    rp_consts c = {
        _mm256_set1_ps(h->l2_weight_decay), _mm256_set1_ps(h->decoupled_decay),
        _mm256_set1_ps(h->beta1_weight), _mm256_set1_ps(h->beta1_weight - 1.0f),
        _mm256_set1_ps(h->beta2), _mm256_set1_ps(h->one_minus_beta2),
        _mm256_set1_ps(h->inv_bias_correction2_sqrt), _mm256_set1_ps(h->eps),
        _mm256_set1_ps(h->neg_step_size), _mm256_set1_ps(-0.0f),
        h->beta1_weight < 0.5f && h->beta1_weight > -0.5f, h->maximize, h->use_l2,
        h->use_decoupled, h->amsgrad, copy ? t->copy_dtype : RP_COPY_NONE,
    };
    int64_t i = begin;
    /* The model copy is written, never read: non-temporal stores skip the read-for-
     * ownership of its cache lines. They need 16-byte alignment, which an 8-element
     * stride keeps once the first store has it. */
    int stream = c.copy != RP_COPY_NONE && ((uintptr_t)(copy + i) & 15u) == 0;
    for (; i + W <= end; i += W) {
        if (prefetch) { /* past an array's end is harmless: a prefetch never faults */
            _mm_prefetch(rp_ahead(param + i), _MM_HINT_T0);
            _mm_prefetch(rp_ahead(grad + i), _MM_HINT_T0);
            _mm_prefetch(rp_ahead(exp_avg + i), _MM_HINT_T0);
            _mm_prefetch(rp_ahead(exp_avg_sq + i), _MM_HINT_T0);
        }
        __m128i half = update(&c, param + i, grad + i, exp_avg + i, exp_avg_sq + i,
                              c.amsgrad ? max_sq + i : NULL);
        if (c.copy == RP_COPY_NONE) continue;
        if (stream) _mm_stream_si128((__m128i *)(copy + i), half);
        else _mm_storeu_si128((__m128i *)(copy + i), half);
    }
    if (stream) _mm_sfence();
    if (i < end) {
        /* Tail: run the same vector code on padded copies, so every element gets the
         * same roundings as in the main loop. */
        int n = (int)(end - i);
        float tp[W] = {0}, tg[W] = {0}, tm[W] = {0}, tv[W] = {0}, tvm[W] = {0};
        uint16_t tc[W];
        memcpy(tp, param + i, sizeof(float) * n);
        memcpy(tg, grad + i, sizeof(float) * n);
        memcpy(tm, exp_avg + i, sizeof(float) * n);
        memcpy(tv, exp_avg_sq + i, sizeof(float) * n);
        if (c.amsgrad) memcpy(tvm, max_sq + i, sizeof(float) * n);
        __m128i half = update(&c, tp, tg, tm, tv, tvm);
        _mm_storeu_si128((__m128i *)tc, half);
        memcpy(param + i, tp, sizeof(float) * n);
        memcpy(exp_avg + i, tm, sizeof(float) * n);
        memcpy(exp_avg_sq + i, tv, sizeof(float) * n);
        if (c.amsgrad) memcpy(max_sq + i, tvm, sizeof(float) * n);
        if (c.copy != RP_COPY_NONE) memcpy(copy + i, tc, sizeof(uint16_t) * n);
    }
}

#else /* not x86 or not GCC/clang: never called, rp_adam_isa_supported() says no */

void rp_adam_kernel_avx2(const rp_adam_tensor *t, const rp_adam_hyper *h,
                         int64_t begin, int64_t end, int prefetch) {
    (void)prefetch;
    (void)t;
    (void)h;
    (void)begin;
    (void)end;
}

#endif
