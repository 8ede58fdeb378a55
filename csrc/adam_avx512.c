/* The AVX-512 path: 16 floats per vector, the same roundings as the scalar path (adam.c),
 * fp16/bf16 gradients, bf16 moments and parameters, and 8-bit moments included.
 *
 * Functions carry a target attribute instead of the file being built with -mavx512f, so
 * one build runs on any x86-64 CPU; adam.c calls this kernel only when the CPU has AVX-512F.
 */
#define _POSIX_C_SOURCE 199309L /* clock_gettime under -std=c11 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "adam.h"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#define RP_TARGET __attribute__((target("avx512f")))

extern int rp_adam_q8_permute_flag; /* adam.c: rp_adam_set_q8_permute */
/* Elements ahead to prefetch: 2 KiB of each array (512, 1024 and 2048 measured on the
 * 16-core GPU host: 512 was the steadiest). */
#define RP_PREFETCH_AHEAD 512

/* The address RP_PREFETCH_AHEAD floats on, computed as an integer: it may lie past the
 * end of the array, where pointer arithmetic would be undefined. */
static inline const char *rp_ahead(const float *p) {
    return (const char *)((uintptr_t)p + RP_PREFETCH_AHEAD * sizeof(float));
}

#define W 16

typedef struct {
    __m512 l2, decay, w, w_big, beta2, c2, inv_bc2, eps, nss, sign;
    int small_weight, maximize, use_l2, use_decoupled, amsgrad, copy, grad_dtype, bf16_state,
        bf16_param;
    uint32_t sr_seed, param_sr_seed;
} rp_consts;

/* fp32 -> bf16 bits, round to nearest even, NaN -> 0x7FC0 (c10::BFloat16's conversion). */
RP_TARGET static inline __m256i to_bf16(__m512 p) {
    __m512i u = _mm512_castps_si512(p);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(p, p, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
}

/* rp_hash32 (adam.c) in every lane. */
RP_TARGET static inline __m512i hash32(__m512i x) {
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7FEB352D));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)0x846CA68Bu));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

/* f32_to_bf16_sr (adam.c) of 16 lanes with element indices idx .. idx + 15. */
RP_TARGET static inline __m256i to_bf16_sr(__m512 f, int64_t idx, uint32_t which, uint32_t seed) {
    __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i i = _mm512_add_epi32(_mm512_set1_epi32((int)(uint32_t)idx), lane);
    __m512i key = _mm512_add_epi32(_mm512_slli_epi32(i, 1), _mm512_set1_epi32((int)which));
    __m512i r = _mm512_and_si512(hash32(_mm512_xor_si512(key, _mm512_set1_epi32((int)seed))),
                                 _mm512_set1_epi32(0xFFFF));
    __m512i b = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(f), r), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    b = _mm512_mask_mov_epi32(b, nan, _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(b);
}

RP_TARGET static inline __m512 load_bf16(const void *p) {
    __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
}

RP_TARGET static inline __m512 load_grad(const rp_consts *c, const void *p) {
    if (c->grad_dtype == RP_DTYPE_FP16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    if (c->grad_dtype == RP_DTYPE_BF16) return load_bf16(p);
    return _mm512_loadu_ps((const float *)p);
}

RP_TARGET static inline __m512 load_param(const rp_consts *c, const void *p) {
    return c->bf16_param ? load_bf16(p) : _mm512_loadu_ps((const float *)p);
}

/* A bf16 parameter is stored with stochastic rounding (its own seed), as in adam.c. */
RP_TARGET static inline void store_param(const rp_consts *c, void *dst, __m512 p, int64_t idx) {
    if (c->bf16_param)
        _mm256_storeu_si256((__m256i *)dst, to_bf16_sr(p, idx, 0u, c->param_sr_seed));
    else _mm512_storeu_ps((float *)dst, p);
}

/* adam_elem (adam.c) in 16 lanes; `max_sq` is touched only with amsgrad. */
RP_TARGET static inline void adam_math(const rp_consts *c, __m512 *p_io, __m512 g, __m512 *m_io,
                                       __m512 *v_io, float *max_sq) {
    __m512 p = *p_io, m = *m_io, v = *v_io;
    if (c->maximize) g = _mm512_castsi512_ps(
        _mm512_xor_si512(_mm512_castps_si512(g), _mm512_castps_si512(c->sign)));
    if (c->use_l2) g = _mm512_fmadd_ps(p, c->l2, g);
    if (c->use_decoupled) p = _mm512_mul_ps(p, c->decay);
    __m512 diff = _mm512_sub_ps(g, m);
    m = c->small_weight ? _mm512_fmadd_ps(c->w, diff, m) : _mm512_fmadd_ps(c->w_big, diff, g);
    v = _mm512_mul_ps(v, c->beta2);
    v = _mm512_fmadd_ps(_mm512_mul_ps(c->c2, g), g, v);
    __m512 s = v;
    if (c->amsgrad) {
        s = _mm512_max_ps(_mm512_loadu_ps(max_sq), v);
        _mm512_storeu_ps(max_sq, s);
    }
    __m512 denom = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(s), c->inv_bc2), c->eps);
    *p_io = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(c->nss, m), denom));
    *m_io = m;
    *v_io = v;
}

/* One vector of the update at element index `idx`; `vm` and `copy` are touched only when
 * enabled. Pointers are already offset to `idx`. */
RP_TARGET static inline __m256i update(const rp_consts *c, void *param, const void *grad,
                                       void *exp_avg, void *exp_avg_sq, float *max_sq,
                                       int64_t idx) {
    __m512 p = load_param(c, param);
    __m512 g = load_grad(c, grad);
    __m512 m = c->bf16_state ? load_bf16(exp_avg) : _mm512_loadu_ps((const float *)exp_avg);
    __m512 v = c->bf16_state ? load_bf16(exp_avg_sq) : _mm512_loadu_ps((const float *)exp_avg_sq);
    adam_math(c, &p, g, &m, &v, max_sq);
    store_param(c, param, p, idx);
    if (c->bf16_state) {
        _mm256_storeu_si256((__m256i *)exp_avg, to_bf16_sr(m, idx, 0u, c->sr_seed));
        _mm256_storeu_si256((__m256i *)exp_avg_sq, to_bf16_sr(v, idx, 1u, c->sr_seed));
    } else {
        _mm512_storeu_ps((float *)exp_avg, m);
        _mm512_storeu_ps((float *)exp_avg_sq, v);
    }
    if (c->copy == RP_COPY_FP16)
        return _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    if (c->copy == RP_COPY_BF16) return to_bf16(p);
    return _mm256_setzero_si256();
}

/* table[idx] of a 256-float table (idx in 0..255) by in-register permutes: eight two-table
 * permutes pick by idx bits 0..4 from each 32-entry slice, three levels of blends by bits
 * 5..7. The same value as a gather, and faster: 1.5x the kernel's speed on the AMD Zen 5
 * development VM, where the threshold gather of q8_encode alone took a third of the time. */
RP_TARGET static inline __m512 q8_lookup(const float *table, __m512i idx, int permute) {
    if (!permute) return _mm512_i32gather_ps(idx, table, 4);
    __m512 r[8];
    for (int j = 0; j < 8; ++j)
        r[j] = _mm512_permutex2var_ps(_mm512_loadu_ps(table + 32 * j), idx,
                                      _mm512_loadu_ps(table + 32 * j + 16));
    __mmask16 b5 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(32));
    __mmask16 b6 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(64));
    __mmask16 b7 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(128));
    __m512 a0 = _mm512_mask_blend_ps(b5, r[0], r[1]), a1 = _mm512_mask_blend_ps(b5, r[2], r[3]);
    __m512 a2 = _mm512_mask_blend_ps(b5, r[4], r[5]), a3 = _mm512_mask_blend_ps(b5, r[6], r[7]);
    return _mm512_mask_blend_ps(b7, _mm512_mask_blend_ps(b6, a0, a1),
                                _mm512_mask_blend_ps(b6, a2, a3));
}

/* 16 codes -> map value * absmax (q8 decoding in adam.c). */
RP_TARGET static inline __m512 q8_decode(const float *map, __m128i codes, __m512 absmax,
                                         int permute) {
    return _mm512_mul_ps(q8_lookup(map, _mm512_cvtepu8_epi32(codes), permute), absmax);
}

/* One map's decade tables (RP_QMAP_*_DECADES) in registers, lanes 0..7 used. */
typedef struct {
    __m512 lo, inv_step, base;
    const float *thresholds;
    int signed_map;
    int permute; /* table lookups by permutes (1) or gathers (0): rp_adam_set_q8_permute */
} q8_map;

RP_TARGET static inline q8_map q8_load_map(const float *qmap, int signed_map, int permute) {
    const float *dec = qmap + (signed_map ? RP_QMAP_SIGNED_DECADES : RP_QMAP_UNSIGNED_DECADES);
    q8_map m = {
        _mm512_castps256_ps512(_mm256_loadu_ps(dec)),
        _mm512_castps256_ps512(_mm256_loadu_ps(dec + 8)),
        _mm512_castps256_ps512(_mm256_loadu_ps(dec + 16)),
        qmap + (signed_map ? RP_QMAP_SIGNED_THRESHOLDS : RP_QMAP_UNSIGNED_THRESHOLDS),
        signed_map,
        permute,
    };
    return m;
}

/* q8_encode (adam.c) in 16 lanes: the decade by seven compares, the guess from permuted
 * decade constants, one looked-up threshold to correct it. */
RP_TARGET static inline __m128i q8_encode(__m512 x, const q8_map *map, const __m512 *bounds) {
    __m512 a = _mm512_abs_ps(x);
    __m512i one = _mm512_set1_epi32(1);
    __m512i z = _mm512_setzero_si512();
    for (int d = 0; d < 7; ++d)
        z = _mm512_mask_add_epi32(z, _mm512_cmp_ps_mask(a, bounds[d], _CMP_LE_OQ), z, one);
    __m512 lo = _mm512_permutexvar_ps(z, map->lo);
    __m512 inv_step = _mm512_permutexvar_ps(z, map->inv_step);
    __m512i below = _mm512_add_epi32(
        _mm512_cvttps_epi32(_mm512_permutexvar_ps(z, map->base)),
        _mm512_cvttps_epi32(_mm512_mul_ps(_mm512_sub_ps(a, lo), inv_step)));
    __m512i code = below;
    if (map->signed_map) {
        __mmask16 nonneg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ);
        code = _mm512_mask_blend_epi32(nonneg, _mm512_sub_epi32(_mm512_set1_epi32(126), below),
                                       _mm512_add_epi32(_mm512_set1_epi32(127), below));
    }
    code = _mm512_min_epi32(_mm512_max_epi32(code, _mm512_setzero_si512()),
                            _mm512_set1_epi32(255));
    code = _mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(x, x, _CMP_ORD_Q), code); /* NaN: 0 */
    __m512 t = q8_lookup(map->thresholds, code, map->permute);
    code = _mm512_mask_add_epi32(code, _mm512_cmp_ps_mask(t, x, _CMP_LT_OQ), code, one);
    if (!map->signed_map) {
        __mmask16 pos = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GT_OQ);
        code = _mm512_mask_max_epi32(code, pos, code, one);
    }
    return _mm512_cvtepi32_epi8(code);
}

/* The first half of kernel_q8 for one vector at element `i`: decode m and v, update, store
 * the parameter; pointers are already offset to `i`. */
RP_TARGET static inline void q8_update(const rp_consts *c, const float *qmap, void *param,
                                       const void *grad, __m128i codes_m, __m128i codes_v,
                                       __m512 am_old, __m512 av_old, int64_t i, int permute,
                                       __m512 *m_out, __m512 *v_out) {
    __m512 p = load_param(c, param);
    __m512 g = load_grad(c, grad);
    __m512 m = q8_decode(qmap + RP_QMAP_SIGNED, codes_m, am_old, permute);
    __m512 v = q8_decode(qmap + RP_QMAP_UNSIGNED, codes_v, av_old, permute);
    adam_math(c, &p, g, &m, &v, NULL);
    store_param(c, param, p, i);
    *m_out = m;
    *v_out = v;
}

/* kernel_q8_scalar (adam.c) 16 lanes at a time. Full vectors run in place; a block's last
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
    float bm[RP_QBLOCK], bv[RP_QBLOCK];
    const int permute = rp_adam_q8_permute_flag; /* once a call: the lookups' flavour */
    const q8_map smap = q8_load_map(qmap, 1, permute), umap = q8_load_map(qmap, 0, permute);
    __m512 bounds[7];
    for (int d = 0; d < 7; ++d) bounds[d] = _mm512_set1_ps(qmap[RP_QMAP_DECADE_BOUNDS + d]);
    for (int64_t b0 = begin; b0 < end; b0 += RP_QBLOCK) {
        int n = (int)(b0 + RP_QBLOCK < end ? RP_QBLOCK : end - b0);
        int full = n & ~(W - 1);
        int64_t blk = b0 / RP_QBLOCK;
        __m512 am_old = _mm512_set1_ps(am_blocks[blk]), av_old = _mm512_set1_ps(av_blocks[blk]);
        __m512 am = _mm512_setzero_ps(), av = _mm512_setzero_ps();
        __m512 m, v;
        for (int k = 0; k < full; k += W) {
            int64_t i = b0 + k;
            q8_update(c, qmap, param + i * psz, grad + i * gsz,
                      _mm_loadu_si128((const __m128i *)(cm + i)),
                      _mm_loadu_si128((const __m128i *)(cv + i)), am_old, av_old, i, permute, &m, &v);
            /* max(|x|, acc): a NaN |x| leaves acc, as the scalar comparison does */
            am = _mm512_max_ps(_mm512_abs_ps(m), am);
            av = _mm512_max_ps(_mm512_abs_ps(v), av);
            _mm512_storeu_ps(bm + k, m);
            _mm512_storeu_ps(bv + k, v);
        }
        if (full < n) {
            int64_t i = b0 + full;
            int live = n - full;
            float tp[W] = {0}, tg[W] = {0};
            uint8_t tcm[16] = {0}, tcv[16] = {0};
            memcpy(tp, param + i * psz, psz * live);
            memcpy(tg, grad + i * gsz, gsz * live);
            memcpy(tcm, cm + i, live);
            memcpy(tcv, cv + i, live);
            q8_update(c, qmap, tp, tg, _mm_loadu_si128((const __m128i *)tcm),
                      _mm_loadu_si128((const __m128i *)tcv), am_old, av_old, i, permute, &m, &v);
            memcpy(param + i * psz, tp, psz * live);
            __mmask16 lanes = (__mmask16)((1u << live) - 1u);
            am = _mm512_mask_max_ps(am, lanes, _mm512_abs_ps(m), am);
            av = _mm512_mask_max_ps(av, lanes, _mm512_abs_ps(v), av);
            _mm512_storeu_ps(bm + full, m);
            _mm512_storeu_ps(bv + full, v);
        }
        float am_s = _mm512_reduce_max_ps(am), av_s = _mm512_reduce_max_ps(av);
        /* a zero absmax encodes every element as 0 / 1 (the x = 0 of the scalar path) */
        __m512 amv = _mm512_set1_ps(am_s), avv = _mm512_set1_ps(av_s);
        __mmask16 live_m = am_s > 0.0f ? 0xFFFF : 0, live_v = av_s > 0.0f ? 0xFFFF : 0;
        for (int k = 0; k < n; k += W) {
            __m512 xm = _mm512_maskz_div_ps(live_m, _mm512_loadu_ps(bm + k), amv);
            __m512 xv = _mm512_maskz_div_ps(live_v, _mm512_loadu_ps(bv + k), avv);
            __m128i qm = q8_encode(xm, &smap, bounds);
            __m128i qv = q8_encode(xv, &umap, bounds);
            if (k < full) {
                _mm_storeu_si128((__m128i *)(cm + b0 + k), qm);
                _mm_storeu_si128((__m128i *)(cv + b0 + k), qv);
            } else {
                uint8_t tq[16];
                _mm_storeu_si128((__m128i *)tq, qm);
                memcpy(cm + b0 + k, tq, (size_t)(n - k));
                _mm_storeu_si128((__m128i *)tq, qv);
                memcpy(cv + b0 + k, tq, (size_t)(n - k));
            }
        }
        am_blocks[blk] = am_s;
        av_blocks[blk] = av_s;
    }
}

RP_TARGET void rp_adam_kernel_avx512(const rp_adam_tensor *t, const rp_adam_hyper *h,
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
        _mm512_set1_ps(h->l2_weight_decay), _mm512_set1_ps(h->decoupled_decay),
        _mm512_set1_ps(h->beta1_weight), _mm512_set1_ps(h->beta1_weight - 1.0f),
        _mm512_set1_ps(h->beta2), _mm512_set1_ps(h->one_minus_beta2),
        _mm512_set1_ps(h->inv_bias_correction2_sqrt), _mm512_set1_ps(h->eps),
        _mm512_set1_ps(h->neg_step_size), _mm512_set1_ps(-0.0f),
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
     * ownership of its cache lines (2 of the 30 bytes per parameter). They need 32-byte
     * alignment, which a 16-element stride keeps once the first store has it. */
    int stream = c.copy != RP_COPY_NONE && ((uintptr_t)(copy + i) & 31u) == 0;
    for (; i + W <= end; i += W) {
        if (prefetch) { /* past an array's end is harmless: a prefetch never faults */
            _mm_prefetch(rp_ahead((const float *)(param + i * psz)), _MM_HINT_T0);
            _mm_prefetch(rp_ahead((const float *)(grad + i * gsz)), _MM_HINT_T0);
            _mm_prefetch(rp_ahead((const float *)(exp_avg + i * ssz)), _MM_HINT_T0);
            _mm_prefetch(rp_ahead((const float *)(exp_avg_sq + i * ssz)), _MM_HINT_T0);
        }
        __m256i half = update(&c, param + i * psz, grad + i * gsz, exp_avg + i * ssz,
                              exp_avg_sq + i * ssz, c.amsgrad ? max_sq + i : NULL, i);
        if (c.copy == RP_COPY_NONE) continue;
        if (stream) _mm256_stream_si256((__m256i *)(copy + i), half);
        else _mm256_storeu_si256((__m256i *)(copy + i), half);
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
        __m256i half = update(&c, tp, tg, tm, tv, tvm, i);
        _mm256_storeu_si256((__m256i *)tc, half);
        memcpy(param + i * psz, tp, psz * n);
        memcpy(exp_avg + i * ssz, tm, ssz * n);
        memcpy(exp_avg_sq + i * ssz, tv, ssz * n);
        if (c.amsgrad) memcpy(max_sq + i, tvm, sizeof(float) * n);
        if (c.copy != RP_COPY_NONE) memcpy(copy + i, tc, sizeof(uint16_t) * n);
    }
}

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

#else /* not x86 or not GCC/clang: never called, rp_adam_isa_supported() says no */

int rp_adam_q8_calibrate_avx512(void) { return -1; }

void rp_adam_kernel_avx512(const rp_adam_tensor *t, const rp_adam_hyper *h,
                           int64_t begin, int64_t end, int prefetch) {
    (void)prefetch;
    (void)t;
    (void)h;
    (void)begin;
    (void)end;
}

#endif
