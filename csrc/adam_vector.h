/* The vector Adam kernel, written once over a SIMD layer and compiled once per ISA.
 *
 * An ISA file (adam_avx2.c, adam_avx512.c) includes its layer (simd_avx2.h, ...), names
 * the kernel it exports with RP_KERNEL, then includes this file. Every function here is
 * static to that file and carries the layer's RP_TARGET, so each ISA file builds its own
 * copy for its instruction set and one library runs on any x86-64 CPU.
 *
 * The kernel does what the scalar path (adam.c) does, RP_W lanes at a time and with the
 * same roundings: fp16/bf16 gradients, bf16 moments and parameters, 8-bit moments, the
 * fp16/bf16 model copy. Tails run the same vector code on zero-padded copies, so every
 * element gets the same operations as in the main loop. RP_SUMSQ_KERNEL is
 * rp_sumsq_kernel_scalar's sum of squares, RP_W elements a load.
 */
#if !defined(RP_KERNEL) || !defined(RP_SUMSQ_KERNEL)
#error "include simd.h and a SIMD layer, and define RP_KERNEL and RP_SUMSQ_KERNEL first"
#endif

#include <stdint.h>
#include <string.h>

/* Elements ahead to prefetch: 2 KiB of each array (512, 1024 and 2048 measured on the
 * 16-core GPU host: 512 was the steadiest). */
#define RP_PREFETCH_AHEAD 512

/* The address RP_PREFETCH_AHEAD floats on, computed as an integer: it may lie past the
 * end of the array, where pointer arithmetic would be undefined. */
static inline const char *rp_ahead(const void *p) {
    return (const char *)((uintptr_t)p + RP_PREFETCH_AHEAD * sizeof(float));
}

typedef struct {
    vf gscale, l2, decay, w, w_big, beta2, c2, inv_bc2, eps, nss;
    int small_weight, maximize, use_l2, use_decoupled, amsgrad, copy, grad_dtype, bf16_state,
        bf16_param;
    uint32_t sr_seed, param_sr_seed;
} rp_consts;

/* fp32 -> bf16 bits, round to nearest even, NaN -> 0x7FC0 (c10::BFloat16's conversion). */
RP_SIMD vh to_bf16(vf p) {
    vi u = vi_bits(p);
    vi lsb = vi_and(vi_srli(u, 16), vi_set1(1));
    vi r = vi_srli(vi_add(u, vi_add(lsb, vi_set1(0x7FFF))), 16);
    r = vi_blend(vm_nan(p), r, vi_set1(0x7FC0));
    return vh_narrow(r);
}

/* rp_hash32 (adam.c) in every lane. */
RP_SIMD vi hash32(vi x) {
    x = vi_xor(x, vi_srli(x, 16));
    x = vi_mullo(x, vi_set1(0x7FEB352D));
    x = vi_xor(x, vi_srli(x, 15));
    x = vi_mullo(x, vi_set1((int)0x846CA68Bu));
    return vi_xor(x, vi_srli(x, 16));
}

/* f32_to_bf16_sr (adam.c) of the lanes with element indices idx .. idx + RP_W - 1. */
RP_SIMD vh to_bf16_sr(vf f, int64_t idx, uint32_t which, uint32_t seed) {
    vi i = vi_add(vi_set1((int)(uint32_t)idx), vi_iota());
    vi key = vi_add(vi_slli(i, 1), vi_set1((int)which));
    vi r = vi_and(hash32(vi_xor(key, vi_set1((int)seed))), vi_set1(0xFFFF));
    vi b = vi_srli(vi_add(vi_bits(f), r), 16);
    b = vi_blend(vm_nan(f), b, vi_set1(0x7FC0));
    return vh_narrow(b);
}

RP_SIMD vf load_bf16(const void *p) { return vf_from_bits(vi_slli(vi_widen_u16(vh_load(p)), 16)); }

RP_SIMD vf load_grad(int grad_dtype, const void *p) {
    if (grad_dtype == RP_DTYPE_FP16) return vf_from_f16(vh_load(p));
    if (grad_dtype == RP_DTYPE_BF16) return load_bf16(p);
    return vf_load(p);
}

RP_SIMD vf load_param(const rp_consts *c, const void *p) {
    return c->bf16_param ? load_bf16(p) : vf_load(p);
}

/* A bf16 parameter is stored with stochastic rounding (its own seed), as in adam.c. */
RP_SIMD void store_param(const rp_consts *c, void *dst, vf p, int64_t idx) {
    if (c->bf16_param) vh_store(dst, to_bf16_sr(p, idx, 0u, c->param_sr_seed));
    else vf_store(dst, p);
}

/* adam_elem (adam.c) in RP_W lanes; `max_sq` is touched only with amsgrad. */
RP_SIMD void adam_math(const rp_consts *c, vf *p_io, vf g, vf *m_io, vf *v_io, float *max_sq) {
    vf p = *p_io, m = *m_io, v = *v_io;
    g = vf_mul(g, c->gscale);
    if (c->maximize) g = vf_neg(g);
    if (c->use_l2) g = vf_fmadd(p, c->l2, g);
    if (c->use_decoupled) p = vf_mul(p, c->decay);
    vf diff = vf_sub(g, m);
    m = c->small_weight ? vf_fmadd(c->w, diff, m) : vf_fmadd(c->w_big, diff, g);
    v = vf_mul(v, c->beta2);
    v = vf_fmadd(vf_mul(c->c2, g), g, v);
    vf s = v;
    if (c->amsgrad) {
        s = vf_max(vf_load(max_sq), v);
        vf_store(max_sq, s);
    }
    vf denom = vf_add(vf_mul(vf_sqrt(s), c->inv_bc2), c->eps);
    *p_io = vf_add(p, vf_div(vf_mul(c->nss, m), denom));
    *m_io = m;
    *v_io = v;
}

/* One vector of the update at element index `idx`; `max_sq` is touched only with amsgrad.
 * Pointers are already offset to `idx`. Returns the model copy's lanes (zero: no copy). */
RP_SIMD vh update(const rp_consts *c, void *param, const void *grad, void *exp_avg,
                  void *exp_avg_sq, float *max_sq, int64_t idx) {
    vf p = load_param(c, param);
    vf g = load_grad(c->grad_dtype, grad);
    vf m = c->bf16_state ? load_bf16(exp_avg) : vf_load(exp_avg);
    vf v = c->bf16_state ? load_bf16(exp_avg_sq) : vf_load(exp_avg_sq);
    adam_math(c, &p, g, &m, &v, max_sq);
    store_param(c, param, p, idx);
    if (c->bf16_state) {
        vh_store(exp_avg, to_bf16_sr(m, idx, 0u, c->sr_seed));
        vh_store(exp_avg_sq, to_bf16_sr(v, idx, 1u, c->sr_seed));
    } else {
        vf_store(exp_avg, m);
        vf_store(exp_avg_sq, v);
    }
    if (c->copy == RP_COPY_FP16) return vh_f16(p);
    if (c->copy == RP_COPY_BF16) return to_bf16(p);
    return vh_zero();
}

/* RP_W codes -> map value * absmax (q8 decoding in adam.c). */
RP_SIMD vf q8_decode(const float *map, const uint8_t *codes, vf absmax, int permute) {
    return vf_mul(vf_lookup256(map, vi_load_u8(codes), permute), absmax);
}

/* One map's decade tables (RP_QMAP_*_DECADES) in registers, lanes 0..7 used. */
typedef struct {
    vf lo, inv_step, base;
    const float *thresholds;
    int signed_map;
    int permute; /* table lookups by permutes (1) or gathers (0): rp_adam_set_q8_permute */
} q8_map;

RP_SIMD q8_map q8_load_map(const float *qmap, int signed_map, int permute) {
    const float *dec = qmap + (signed_map ? RP_QMAP_SIGNED_DECADES : RP_QMAP_UNSIGNED_DECADES);
    q8_map m = {
        vf_load8(dec),
        vf_load8(dec + 8),
        vf_load8(dec + 16),
        qmap + (signed_map ? RP_QMAP_SIGNED_THRESHOLDS : RP_QMAP_UNSIGNED_THRESHOLDS),
        signed_map,
        permute,
    };
    return m;
}

/* q8_encode (adam.c) in RP_W lanes: the decade by seven compares, the guess from permuted
 * decade constants, one looked-up threshold to correct it. Returns the codes as lanes. */
RP_SIMD vi q8_encode(vf x, const q8_map *map, const vf *bounds) {
    vf a = vf_abs(x);
    vi z = vi_zero();
    for (int d = 0; d < 7; ++d) z = vi_inc_where(vm_le(a, bounds[d]), z);
    vf lo = vf_permute8(map->lo, z);
    vf inv_step = vf_permute8(map->inv_step, z);
    vi below = vi_add(vi_cvtt(vf_permute8(map->base, z)), vi_cvtt(vf_mul(vf_sub(a, lo), inv_step)));
    vi code = below;
    if (map->signed_map)
        code = vi_blend(vm_ge(x, vf_zero()), vi_sub(vi_set1(126), below),
                        vi_add(vi_set1(127), below));
    code = vi_min(vi_max(code, vi_zero()), vi_set1(255));
    code = vi_zero_unless(vm_ord(x), code); /* NaN: 0 */
    vf t = vf_lookup256(map->thresholds, code, map->permute);
    code = vi_inc_where(vm_lt(t, x), code);
    if (!map->signed_map) code = vi_at_least_one_where(vm_gt(x, vf_zero()), code);
    return code;
}

/* The first half of kernel_q8 for one vector at element `i`: decode m and v, update, store
 * the parameter; pointers are already offset to `i`. */
RP_SIMD void q8_update(const rp_consts *c, const float *qmap, void *param, const void *grad,
                       const uint8_t *codes_m, const uint8_t *codes_v, vf am_old, vf av_old,
                       int64_t i, int permute, vf *m_out, vf *v_out) {
    vf p = load_param(c, param);
    vf g = load_grad(c->grad_dtype, grad);
    vf m = q8_decode(qmap + RP_QMAP_SIGNED, codes_m, am_old, permute);
    vf v = q8_decode(qmap + RP_QMAP_UNSIGNED, codes_v, av_old, permute);
    adam_math(c, &p, g, &m, &v, NULL);
    store_param(c, param, p, i);
    *m_out = m;
    *v_out = v;
}

/* kernel_q8_scalar (adam.c) RP_W lanes at a time. Full vectors run in place; a block's last
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
    const int permute = RP_Q8_PERMUTE; /* once a call: the lookups' flavour */
    const q8_map smap = q8_load_map(qmap, 1, permute), umap = q8_load_map(qmap, 0, permute);
    vf bounds[7];
    for (int d = 0; d < 7; ++d) bounds[d] = vf_set1(qmap[RP_QMAP_DECADE_BOUNDS + d]);
    for (int64_t b0 = begin; b0 < end; b0 += RP_QBLOCK) {
        int n = (int)(b0 + RP_QBLOCK < end ? RP_QBLOCK : end - b0);
        int full = n & ~(RP_W - 1);
        int64_t blk = b0 / RP_QBLOCK;
        vf am_old = vf_set1(am_blocks[blk]), av_old = vf_set1(av_blocks[blk]);
        vf am = vf_zero(), av = vf_zero();
        vf m, v;
        for (int k = 0; k < full; k += RP_W) {
            int64_t i = b0 + k;
            q8_update(c, qmap, param + i * psz, grad + i * gsz, cm + i, cv + i, am_old, av_old,
                      i, permute, &m, &v);
            /* max(|x|, acc): a NaN |x| leaves acc, as the scalar comparison does */
            am = vf_max(vf_abs(m), am);
            av = vf_max(vf_abs(v), av);
            vf_store(bm + k, m);
            vf_store(bv + k, v);
        }
        if (full < n) {
            int64_t i = b0 + full;
            int live = n - full;
            float tp[RP_W] = {0}, tg[RP_W] = {0};
            uint8_t tcm[RP_W] = {0}, tcv[RP_W] = {0};
            memcpy(tp, param + i * psz, psz * live);
            memcpy(tg, grad + i * gsz, gsz * live);
            memcpy(tcm, cm + i, live);
            memcpy(tcv, cv + i, live);
            q8_update(c, qmap, tp, tg, tcm, tcv, am_old, av_old, i, permute, &m, &v);
            memcpy(param + i * psz, tp, psz * live);
            vm lanes = vm_first(live);
            am = vf_max_where(lanes, am, vf_abs(m));
            av = vf_max_where(lanes, av, vf_abs(v));
            vf_store(bm + full, m);
            vf_store(bv + full, v);
        }
        float am_s = vf_reduce_max(am), av_s = vf_reduce_max(av);
        /* a zero absmax encodes every element as 0 / 1 (the x = 0 of the scalar path) */
        vf amv = vf_set1(am_s), avv = vf_set1(av_s);
        vm live_m = vm_all(am_s > 0.0f), live_v = vm_all(av_s > 0.0f);
        for (int k = 0; k < n; k += RP_W) {
            vf xm = vf_div_or_zero(live_m, vf_load(bm + k), amv);
            vf xv = vf_div_or_zero(live_v, vf_load(bv + k), avv);
            vi qm = q8_encode(xm, &smap, bounds);
            vi qv = q8_encode(xv, &umap, bounds);
            if (k < full) {
                vi_store_u8(cm + b0 + k, qm);
                vi_store_u8(cv + b0 + k, qv);
            } else {
                uint8_t tq[RP_W];
                vi_store_u8(tq, qm);
                memcpy(cm + b0 + k, tq, (size_t)(n - k));
                vi_store_u8(tq, qv);
                memcpy(cv + b0 + k, tq, (size_t)(n - k));
            }
        }
        am_blocks[blk] = am_s;
        av_blocks[blk] = av_s;
    }
}

RP_TARGET void RP_KERNEL(const rp_adam_tensor *t, const rp_adam_hyper *h, int64_t begin,
                         int64_t end, int prefetch) {
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
        vf_set1(h->grad_scale), vf_set1(h->l2_weight_decay), vf_set1(h->decoupled_decay),
        vf_set1(h->beta1_weight), vf_set1(h->beta1_weight - 1.0f),
        vf_set1(h->beta2), vf_set1(h->one_minus_beta2),
        vf_set1(h->inv_bias_correction2_sqrt), vf_set1(h->eps),
        vf_set1(h->neg_step_size),
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
     * ownership of its cache lines (2 of the 30 bytes per parameter). They need the copy
     * vector's alignment, which an RP_W-element stride keeps once the first store has it. */
    int stream = c.copy != RP_COPY_NONE && ((uintptr_t)(copy + i) & (sizeof(vh) - 1)) == 0;
    for (; i + RP_W <= end; i += RP_W) {
        if (prefetch) { /* past an array's end is harmless: a prefetch never faults */
            _mm_prefetch(rp_ahead(param + i * psz), _MM_HINT_T0);
            _mm_prefetch(rp_ahead(grad + i * gsz), _MM_HINT_T0);
            _mm_prefetch(rp_ahead(exp_avg + i * ssz), _MM_HINT_T0);
            _mm_prefetch(rp_ahead(exp_avg_sq + i * ssz), _MM_HINT_T0);
        }
        vh half = update(&c, param + i * psz, grad + i * gsz, exp_avg + i * ssz,
                         exp_avg_sq + i * ssz, c.amsgrad ? max_sq + i : NULL, i);
        if (c.copy == RP_COPY_NONE) continue;
        if (stream) vh_stream(copy + i, half);
        else vh_store(copy + i, half);
    }
    if (stream) _mm_sfence();
    if (i < end) {
        /* Tail: run the same vector code on padded copies, so every element gets the
         * same roundings as in the main loop. */
        int n = (int)(end - i);
        float tp[RP_W] = {0}, tg[RP_W] = {0}, tm[RP_W] = {0}, tv[RP_W] = {0}, tvm[RP_W] = {0};
        uint16_t tc[RP_W];
        memcpy(tp, param + i * psz, psz * n);
        memcpy(tg, grad + i * gsz, gsz * n);
        memcpy(tm, exp_avg + i * ssz, ssz * n);
        memcpy(tv, exp_avg_sq + i * ssz, ssz * n);
        if (c.amsgrad) memcpy(tvm, max_sq + i, sizeof(float) * n);
        vh half = update(&c, tp, tg, tm, tv, tvm, i);
        vh_store(tc, half);
        memcpy(param + i * psz, tp, psz * n);
        memcpy(exp_avg + i * ssz, tm, ssz * n);
        memcpy(exp_avg_sq + i * ssz, tv, ssz * n);
        if (c.amsgrad) memcpy(max_sq + i, tvm, sizeof(float) * n);
        if (c.copy != RP_COPY_NONE) memcpy(copy + i, tc, sizeof(uint16_t) * n);
    }
}

/* rp_sumsq_kernel_scalar (adam.c): element i's square, in double, added to running sum
 * i % 4 (`begin` is a multiple of 4, so a vector's lanes j go to vd lane j % 4), then
 * (s0 + s1) + (s2 + s3). The half gradient is widened in registers: it is read at 2 bytes
 * an element, with no fp32 copy. The tail runs on a zero-padded copy: adding the padding's
 * +0.0 squares leaves every running sum as it is (they start at +0.0 and only grow). */
RP_TARGET double RP_SUMSQ_KERNEL(const rp_adam_tensor *t, int64_t begin, int64_t end) {
    const char *grad = (const char *)t->grad;
    const size_t gsz = t->grad_dtype == RP_DTYPE_FP32 ? 4 : 2;
    vd acc = vd_zero();
    int64_t i = begin;
    for (; i + RP_W <= end; i += RP_W)
        acc = vd_add_squares(acc, load_grad(t->grad_dtype, grad + i * gsz));
    if (i < end) {
        float tg[RP_W] = {0};
        memcpy(tg, grad + i * gsz, gsz * (size_t)(end - i));
        acc = vd_add_squares(acc, load_grad(t->grad_dtype, tg));
    }
    double a[4];
    vd_store(a, acc);
    return (a[0] + a[1]) + (a[2] + a[3]);
}
