/* The AVX2 path (with FMA and F16C): 8 floats per vector, the same roundings as the
 * scalar path (adam.c), fp16/bf16 gradients and bf16 moments included.
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
    int small_weight, maximize, use_l2, use_decoupled, amsgrad, copy, grad_dtype, bf16_state;
    uint32_t sr_seed;
} rp_consts;

/* 8 lanes of 32-bit values <= 0xFFFF -> 8 uint16. The unsigned-saturating pack is exact
 * for such values; it packs per 128-bit lane, the permute gathers the two halves. */
RP_TARGET static inline __m128i pack16(__m256i r) {
    __m256i packed = _mm256_packus_epi32(r, r);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0xD8));
}

/* fp32 -> bf16 bits, round to nearest even, NaN -> 0x7FC0 (c10::BFloat16's conversion). */
RP_TARGET static inline __m128i to_bf16(__m256 p) {
    __m256i u = _mm256_castps_si256(p);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(p, p, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    return pack16(r);
}

/* rp_hash32 (adam.c) in every lane. */
RP_TARGET static inline __m256i hash32(__m256i x) {
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7FEB352D));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int)0x846CA68Bu));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

/* f32_to_bf16_sr (adam.c) of 8 lanes with element indices idx .. idx + 7. */
RP_TARGET static inline __m128i to_bf16_sr(__m256 f, int64_t idx, uint32_t which, uint32_t seed) {
    __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i i = _mm256_add_epi32(_mm256_set1_epi32((int)(uint32_t)idx), lane);
    __m256i key = _mm256_add_epi32(_mm256_slli_epi32(i, 1), _mm256_set1_epi32((int)which));
    __m256i r = _mm256_and_si256(hash32(_mm256_xor_si256(key, _mm256_set1_epi32((int)seed))),
                                 _mm256_set1_epi32(0xFFFF));
    __m256i b = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(f), r), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
    b = _mm256_blendv_epi8(b, _mm256_set1_epi32(0x7FC0), nan);
    return pack16(b);
}

RP_TARGET static inline __m256 load_bf16(const void *p) {
    __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}

RP_TARGET static inline __m256 load_grad(const rp_consts *c, const void *p) {
    if (c->grad_dtype == RP_DTYPE_FP16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    if (c->grad_dtype == RP_DTYPE_BF16) return load_bf16(p);
    return _mm256_loadu_ps((const float *)p);
}

/* One vector of the update at element index `idx`; `max_sq` is touched only with amsgrad.
 * Pointers are already offset to `idx`. */
RP_TARGET static inline __m128i update(const rp_consts *c, float *param, const void *grad,
                                       void *exp_avg, void *exp_avg_sq, float *max_sq,
                                       int64_t idx) {
    __m256 p = _mm256_loadu_ps(param);
    __m256 g = load_grad(c, grad);
    __m256 m = c->bf16_state ? load_bf16(exp_avg) : _mm256_loadu_ps((const float *)exp_avg);
    __m256 v = c->bf16_state ? load_bf16(exp_avg_sq) : _mm256_loadu_ps((const float *)exp_avg_sq);
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
    if (c->bf16_state) {
        _mm_storeu_si128((__m128i *)exp_avg, to_bf16_sr(m, idx, 0u, c->sr_seed));
        _mm_storeu_si128((__m128i *)exp_avg_sq, to_bf16_sr(v, idx, 1u, c->sr_seed));
    } else {
        _mm256_storeu_ps((float *)exp_avg, m);
        _mm256_storeu_ps((float *)exp_avg_sq, v);
    }
    if (c->copy == RP_COPY_FP16)
        return _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    if (c->copy == RP_COPY_BF16) return to_bf16(p);
    return _mm_setzero_si128();
}

RP_TARGET void rp_adam_kernel_avx2(const rp_adam_tensor *t, const rp_adam_hyper *h,
                                   int64_t begin, int64_t end, int prefetch) {
    float *param = (float *)t->param;
    char *grad = (char *)t->grad;
    char *exp_avg = (char *)t->exp_avg;
    char *exp_avg_sq = (char *)t->exp_avg_sq;
    float *max_sq = (float *)t->max_exp_avg_sq;
    uint16_t *copy = (uint16_t *)t->model_copy;
    const size_t gsz = t->grad_dtype == RP_DTYPE_FP32 ? 4 : 2;
    const size_t ssz = t->state_dtype == RP_DTYPE_BF16 ? 2 : 4;
    rp_consts c = {
        _mm256_set1_ps(h->l2_weight_decay), _mm256_set1_ps(h->decoupled_decay),
        _mm256_set1_ps(h->beta1_weight), _mm256_set1_ps(h->beta1_weight - 1.0f),
        _mm256_set1_ps(h->beta2), _mm256_set1_ps(h->one_minus_beta2),
        _mm256_set1_ps(h->inv_bias_correction2_sqrt), _mm256_set1_ps(h->eps),
        _mm256_set1_ps(h->neg_step_size), _mm256_set1_ps(-0.0f),
        h->beta1_weight < 0.5f && h->beta1_weight > -0.5f, h->maximize, h->use_l2,
        h->use_decoupled, h->amsgrad, copy ? t->copy_dtype : RP_COPY_NONE,
        t->grad_dtype, t->state_dtype == RP_DTYPE_BF16, h->sr_seed,
    };
    int64_t i = begin;
    /* The model copy is written, never read: non-temporal stores skip the read-for-
     * ownership of its cache lines. They need 16-byte alignment, which an 8-element
     * stride keeps once the first store has it. */
    int stream = c.copy != RP_COPY_NONE && ((uintptr_t)(copy + i) & 15u) == 0;
    for (; i + W <= end; i += W) {
        if (prefetch) { /* past an array's end is harmless: a prefetch never faults */
            _mm_prefetch(rp_ahead(param + i), _MM_HINT_T0);
            _mm_prefetch(rp_ahead((const float *)(grad + i * gsz)), _MM_HINT_T0);
            _mm_prefetch(rp_ahead((const float *)(exp_avg + i * ssz)), _MM_HINT_T0);
            _mm_prefetch(rp_ahead((const float *)(exp_avg_sq + i * ssz)), _MM_HINT_T0);
        }
        __m128i half = update(&c, param + i, grad + i * gsz, exp_avg + i * ssz,
                              exp_avg_sq + i * ssz, c.amsgrad ? max_sq + i : NULL, i);
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
        memcpy(tg, grad + i * gsz, gsz * n);
        memcpy(tm, exp_avg + i * ssz, ssz * n);
        memcpy(tv, exp_avg_sq + i * ssz, ssz * n);
        if (c.amsgrad) memcpy(tvm, max_sq + i, sizeof(float) * n);
        __m128i half = update(&c, tp, tg, tm, tv, tvm, i);
        _mm_storeu_si128((__m128i *)tc, half);
        memcpy(param + i, tp, sizeof(float) * n);
        memcpy(exp_avg + i * ssz, tm, ssz * n);
        memcpy(exp_avg_sq + i * ssz, tv, ssz * n);
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
