/* The AVX2 path (with FMA and F16C): 8 floats per vector, the same roundings as the
 * scalar path (adam.c), fp16/bf16 gradients, bf16 moments and parameters, and 8-bit
 * moments included.
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
    int small_weight, maximize, use_l2, use_decoupled, amsgrad, copy, grad_dtype, bf16_state,
        bf16_param;
    uint32_t sr_seed, param_sr_seed;
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

RP_TARGET static inline __m256 load_param(const rp_consts *c, const void *p) {
    return c->bf16_param ? load_bf16(p) : _mm256_loadu_ps((const float *)p);
}

/* A bf16 parameter is stored with stochastic rounding (its own seed), as in adam.c. */
RP_TARGET static inline void store_param(const rp_consts *c, void *dst, __m256 p, int64_t idx) {
    if (c->bf16_param)
        _mm_storeu_si128((__m128i *)dst, to_bf16_sr(p, idx, 0u, c->param_sr_seed));
    else _mm256_storeu_ps((float *)dst, p);
}

/* adam_elem (adam.c) in 8 lanes; `max_sq` is touched only with amsgrad. */
RP_TARGET static inline void adam_math(const rp_consts *c, __m256 *p_io, __m256 g, __m256 *m_io,
                                       __m256 *v_io, float *max_sq) {
    __m256 p = *p_io, m = *m_io, v = *v_io;
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
    *p_io = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(c->nss, m), denom));
    *m_io = m;
    *v_io = v;
}

/* One vector of the update at element index `idx`; `max_sq` is touched only with amsgrad.
 * Pointers are already offset to `idx`. */
RP_TARGET static inline __m128i update(const rp_consts *c, void *param, const void *grad,
                                       void *exp_avg, void *exp_avg_sq, float *max_sq,
                                       int64_t idx) {
    __m256 p = load_param(c, param);
    __m256 g = load_grad(c, grad);
    __m256 m = c->bf16_state ? load_bf16(exp_avg) : _mm256_loadu_ps((const float *)exp_avg);
    __m256 v = c->bf16_state ? load_bf16(exp_avg_sq) : _mm256_loadu_ps((const float *)exp_avg_sq);
    adam_math(c, &p, g, &m, &v, max_sq);
    store_param(c, param, p, idx);
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

/* 8 codes -> map value * absmax (q8 decoding in adam.c). */
RP_TARGET static inline __m256 q8_decode(const float *map, const uint8_t *codes, __m256 absmax) {
    __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)codes));
    return _mm256_mul_ps(_mm256_i32gather_ps(map, idx, 4), absmax);
}

/* One map's decade tables (RP_QMAP_*_DECADES) in registers. */
typedef struct {
    __m256 lo, inv_step, base;
    const float *thresholds;
    int signed_map;
} q8_map;

RP_TARGET static inline q8_map q8_load_map(const float *qmap, int signed_map) {
    const float *dec = qmap + (signed_map ? RP_QMAP_SIGNED_DECADES : RP_QMAP_UNSIGNED_DECADES);
    q8_map m = {
        _mm256_loadu_ps(dec), _mm256_loadu_ps(dec + 8), _mm256_loadu_ps(dec + 16),
        qmap + (signed_map ? RP_QMAP_SIGNED_THRESHOLDS : RP_QMAP_UNSIGNED_THRESHOLDS),
        signed_map,
    };
    return m;
}

/* q8_encode (adam.c) in 8 lanes: the decade by seven compares, the guess from permuted
 * decade constants, one gathered threshold to correct it; the codes come back as the 8
 * bytes of a uint64 (lane 0 lowest). */
RP_TARGET static inline uint64_t q8_encode(__m256 x, const q8_map *map, const __m256 *bounds) {
    __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
    __m256i z = _mm256_setzero_si256();
    for (int d = 0; d < 7; ++d) /* a true compare is -1 */
        z = _mm256_sub_epi32(z, _mm256_castps_si256(_mm256_cmp_ps(a, bounds[d], _CMP_LE_OQ)));
    __m256 decade_lo = _mm256_permutevar8x32_ps(map->lo, z);
    __m256 inv_step = _mm256_permutevar8x32_ps(map->inv_step, z);
    __m256i below = _mm256_add_epi32(
        _mm256_cvttps_epi32(_mm256_permutevar8x32_ps(map->base, z)),
        _mm256_cvttps_epi32(_mm256_mul_ps(_mm256_sub_ps(a, decade_lo), inv_step)));
    __m256i idx = below;
    if (map->signed_map) {
        __m256i nonneg = _mm256_castps_si256(_mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ));
        idx = _mm256_blendv_epi8(_mm256_sub_epi32(_mm256_set1_epi32(126), below),
                                 _mm256_add_epi32(_mm256_set1_epi32(127), below), nonneg);
    }
    idx = _mm256_min_epi32(_mm256_max_epi32(idx, _mm256_setzero_si256()),
                           _mm256_set1_epi32(255));
    __m256i ordered = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_ORD_Q)); /* NaN: 0 */
    idx = _mm256_and_si256(idx, ordered);
    __m256 t = _mm256_i32gather_ps(map->thresholds, idx, 4);
    idx = _mm256_sub_epi32(idx, _mm256_castps_si256(_mm256_cmp_ps(t, x, _CMP_LT_OQ)));
    if (!map->signed_map) {
        __m256i pos = _mm256_castps_si256(_mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GT_OQ));
        idx = _mm256_max_epi32(idx, _mm256_and_si256(pos, _mm256_set1_epi32(1)));
    }
    /* the low byte of each 32-bit lane, per 128-bit half */
    __m256i bytes = _mm256_shuffle_epi8(
        idx, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4,
                              8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
    uint32_t lo = (uint32_t)_mm_cvtsi128_si32(_mm256_castsi256_si128(bytes));
    uint32_t hi = (uint32_t)_mm_cvtsi128_si32(_mm256_extracti128_si256(bytes, 1));
    return (uint64_t)lo | (uint64_t)hi << 32;
}

RP_TARGET static inline float hmax(__m256 x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

/* The first half of kernel_q8 for one vector at element `i`: decode m and v, update, store
 * the parameter; pointers are already offset to `i`. */
RP_TARGET static inline void q8_update(const rp_consts *c, const float *qmap, void *param,
                                       const void *grad, const uint8_t *codes_m,
                                       const uint8_t *codes_v, __m256 am_old, __m256 av_old,
                                       int64_t i, __m256 *m_out, __m256 *v_out) {
    __m256 p = load_param(c, param);
    __m256 g = load_grad(c, grad);
    __m256 m = q8_decode(qmap + RP_QMAP_SIGNED, codes_m, am_old);
    __m256 v = q8_decode(qmap + RP_QMAP_UNSIGNED, codes_v, av_old);
    adam_math(c, &p, g, &m, &v, NULL);
    store_param(c, param, p, i);
    *m_out = m;
    *v_out = v;
}

/* kernel_q8_scalar (adam.c) 8 lanes at a time. Full vectors run in place; a block's last
 * partial vector (only at the tensor's end) runs on zero-padded copies, its padded lanes
 * left out of the absmax. */
RP_TARGET static void kernel_q8(const rp_adam_tensor *t, const rp_adam_hyper *h,
                                const rp_consts *c, int64_t begin, int64_t end) {
    const float *qmap = (const float *)h->qmap;
    char *param = (char *)t->param;
    const char *grad = (const char *)t->grad;
    uint8_t *cm = (uint8_t *)t->exp_avg;
    uint8_t *cv = (uint8_t *)t->exp_avg_sq;
    float *am_blocks = (float *)t->exp_avg_absmax;
    float *av_blocks = (float *)t->exp_avg_sq_absmax;
    const size_t psz = c->bf16_param ? 2 : 4;
    const size_t gsz = c->grad_dtype == RP_DTYPE_FP32 ? 4 : 2;
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    float bm[RP_QBLOCK], bv[RP_QBLOCK];
    const q8_map smap = q8_load_map(qmap, 1), umap = q8_load_map(qmap, 0);
    __m256 bounds[7];
    for (int d = 0; d < 7; ++d) bounds[d] = _mm256_set1_ps(qmap[RP_QMAP_DECADE_BOUNDS + d]);
    for (int64_t b0 = begin; b0 < end; b0 += RP_QBLOCK) {
        int n = (int)(b0 + RP_QBLOCK < end ? RP_QBLOCK : end - b0);
        int full = n & ~(W - 1);
        int64_t blk = b0 / RP_QBLOCK;
        __m256 am_old = _mm256_set1_ps(am_blocks[blk]), av_old = _mm256_set1_ps(av_blocks[blk]);
        __m256 am = _mm256_setzero_ps(), av = _mm256_setzero_ps();
        __m256 m, v;
        for (int k = 0; k < full; k += W) {
            int64_t i = b0 + k;
            q8_update(c, qmap, param + i * psz, grad + i * gsz, cm + i, cv + i, am_old, av_old,
                      i, &m, &v);
            /* max(|x|, acc): a NaN |x| leaves acc, as the scalar comparison does */
            am = _mm256_max_ps(_mm256_and_ps(m, abs_mask), am);
            av = _mm256_max_ps(_mm256_and_ps(v, abs_mask), av);
            _mm256_storeu_ps(bm + k, m);
            _mm256_storeu_ps(bv + k, v);
        }
        if (full < n) {
            int64_t i = b0 + full;
            int live = n - full;
            float tp[W] = {0}, tg[W] = {0};
            uint8_t tcm[8] = {0}, tcv[8] = {0};
            memcpy(tp, param + i * psz, psz * live);
            memcpy(tg, grad + i * gsz, gsz * live);
            memcpy(tcm, cm + i, live);
            memcpy(tcv, cv + i, live);
            q8_update(c, qmap, tp, tg, tcm, tcv, am_old, av_old, i, &m, &v);
            memcpy(param + i * psz, tp, psz * live);
            __m256 lanes = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(live), lane));
            am = _mm256_blendv_ps(am, _mm256_max_ps(_mm256_and_ps(m, abs_mask), am), lanes);
            av = _mm256_blendv_ps(av, _mm256_max_ps(_mm256_and_ps(v, abs_mask), av), lanes);
            _mm256_storeu_ps(bm + full, m);
            _mm256_storeu_ps(bv + full, v);
        }
        float am_s = hmax(am), av_s = hmax(av);
        /* a zero absmax encodes every element as 0 / 1 (the x = 0 of the scalar path) */
        __m256 amv = _mm256_set1_ps(am_s), avv = _mm256_set1_ps(av_s);
        __m256 live_m = _mm256_castsi256_ps(_mm256_set1_epi32(am_s > 0.0f ? -1 : 0));
        __m256 live_v = _mm256_castsi256_ps(_mm256_set1_epi32(av_s > 0.0f ? -1 : 0));
        for (int k = 0; k < n; k += W) {
            __m256 xm = _mm256_and_ps(_mm256_div_ps(_mm256_loadu_ps(bm + k), amv), live_m);
            __m256 xv = _mm256_and_ps(_mm256_div_ps(_mm256_loadu_ps(bv + k), avv), live_v);
            uint64_t qm = q8_encode(xm, &smap, bounds);
            uint64_t qv = q8_encode(xv, &umap, bounds);
            if (k < full) { /* little-endian: lane 0 first */
                memcpy(cm + b0 + k, &qm, W);
                memcpy(cv + b0 + k, &qv, W);
            } else {
                memcpy(cm + b0 + k, &qm, (size_t)(n - k));
                memcpy(cv + b0 + k, &qv, (size_t)(n - k));
            }
        }
        am_blocks[blk] = am_s;
        av_blocks[blk] = av_s;
    }
}

RP_TARGET void rp_adam_kernel_avx2(const rp_adam_tensor *t, const rp_adam_hyper *h,
                                   int64_t begin, int64_t end, int prefetch) {
    char *param = (char *)t->param;
    char *grad = (char *)t->grad;
    char *exp_avg = (char *)t->exp_avg;
    char *exp_avg_sq = (char *)t->exp_avg_sq;
    float *max_sq = (float *)t->max_exp_avg_sq;
    uint16_t *copy = (uint16_t *)t->model_copy;
    const size_t gsz = t->grad_dtype == RP_DTYPE_FP32 ? 4 : 2;
    const size_t ssz = t->state_dtype == RP_DTYPE_BF16 ? 2 : 4;
    const size_t psz = t->param_dtype == RP_DTYPE_BF16 ? 2 : 4;
    rp_consts c = {
        _mm256_set1_ps(h->l2_weight_decay), _mm256_set1_ps(h->decoupled_decay),
        _mm256_set1_ps(h->beta1_weight), _mm256_set1_ps(h->beta1_weight - 1.0f),
        _mm256_set1_ps(h->beta2), _mm256_set1_ps(h->one_minus_beta2),
        _mm256_set1_ps(h->inv_bias_correction2_sqrt), _mm256_set1_ps(h->eps),
        _mm256_set1_ps(h->neg_step_size), _mm256_set1_ps(-0.0f),
        h->beta1_weight < 0.5f && h->beta1_weight > -0.5f, h->maximize, h->use_l2,
        h->use_decoupled, h->amsgrad, copy ? t->copy_dtype : RP_COPY_NONE,
        t->grad_dtype, t->state_dtype == RP_DTYPE_BF16, t->param_dtype == RP_DTYPE_BF16,
        h->sr_seed, h->param_sr_seed,
    };
    if (t->state_dtype == RP_DTYPE_Q8) {
        kernel_q8(t, h, &c, begin, end);
        return;
    }
    int64_t i = begin;
    /* The model copy is written, never read: non-temporal stores skip the read-for-
     * ownership of its cache lines. They need 16-byte alignment, which an 8-element
     * stride keeps once the first store has it. */
    int stream = c.copy != RP_COPY_NONE && ((uintptr_t)(copy + i) & 15u) == 0;
    for (; i + W <= end; i += W) {
        if (prefetch) { /* past an array's end is harmless: a prefetch never faults */
            _mm_prefetch(rp_ahead((const float *)(param + i * psz)), _MM_HINT_T0);
            _mm_prefetch(rp_ahead((const float *)(grad + i * gsz)), _MM_HINT_T0);
            _mm_prefetch(rp_ahead((const float *)(exp_avg + i * ssz)), _MM_HINT_T0);
            _mm_prefetch(rp_ahead((const float *)(exp_avg_sq + i * ssz)), _MM_HINT_T0);
        }
        __m128i half = update(&c, param + i * psz, grad + i * gsz, exp_avg + i * ssz,
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
        memcpy(tp, param + i * psz, psz * n);
        memcpy(tg, grad + i * gsz, gsz * n);
        memcpy(tm, exp_avg + i * ssz, ssz * n);
        memcpy(tv, exp_avg_sq + i * ssz, ssz * n);
        if (c.amsgrad) memcpy(tvm, max_sq + i, sizeof(float) * n);
        __m128i half = update(&c, tp, tg, tm, tv, tvm, i);
        _mm_storeu_si128((__m128i *)tc, half);
        memcpy(param + i * psz, tp, psz * n);
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
