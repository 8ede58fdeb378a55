/* The SIMD layer for AVX-512F: 16 floats per vector (simd.h lists the operations). Masks
 * are the ISA's mask registers (one bit per lane), so the masked operations are single
 * instructions.
 *
 * Functions carry a target attribute instead of the file being built with -mavx512f, so
 * one build runs on any x86-64 CPU; adam.c calls this kernel only when the CPU has AVX-512F.
 */
#ifndef RP_SIMD_AVX512_H
#define RP_SIMD_AVX512_H

#include <immintrin.h>

#define RP_TARGET __attribute__((target("avx512f")))
#define RP_W 16
extern int rp_adam_q8_permute_flag; /* adam.c: rp_adam_set_q8_permute */
/* Read once a call: the 8-bit tables' lookups by permutes (1) or gathers (0). */
#define RP_Q8_PERMUTE rp_adam_q8_permute_flag

typedef __m512 vf;
typedef __m512i vi;
typedef __m256i vh; /* 16 x 16 bits */
typedef __mmask16 vm;
typedef __m256d vd; /* 4 doubles (AVX-512F includes AVX's 256-bit double operations) */

#define RP_SIMD static inline RP_TARGET

RP_SIMD vf vf_set1(float x) { return _mm512_set1_ps(x); }
RP_SIMD vf vf_zero(void) { return _mm512_setzero_ps(); }
RP_SIMD vf vf_load(const void *p) { return _mm512_loadu_ps(p); }
RP_SIMD void vf_store(void *p, vf x) { _mm512_storeu_ps(p, x); }
/* The 8 floats at p in lanes 0..7 (the upper lanes are left undefined). */
RP_SIMD vf vf_load8(const float *p) { return _mm512_castps256_ps512(_mm256_loadu_ps(p)); }
RP_SIMD vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
RP_SIMD vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
RP_SIMD vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
RP_SIMD vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
RP_SIMD vf vf_fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
RP_SIMD vf vf_sqrt(vf a) { return _mm512_sqrt_ps(a); }
/* maxps: b when either is NaN. */
RP_SIMD vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
RP_SIMD vf vf_abs(vf a) { return _mm512_abs_ps(a); }
/* AVX-512F has no float xor (that is AVX512DQ): flip the sign bit as integers. */
RP_SIMD vf vf_neg(vf a) {
    return _mm512_castsi512_ps(
        _mm512_xor_si512(_mm512_castps_si512(a), _mm512_castps_si512(_mm512_set1_ps(-0.0f))));
}
RP_SIMD vf vf_from_bits(vi a) { return _mm512_castsi512_ps(a); }
/* Lanes table[idx] for idx in 0..7. */
RP_SIMD vf vf_permute8(vf table, vi idx) { return _mm512_permutexvar_ps(idx, table); }
/* table[idx] of a 256-float table (idx in 0..255), by gathers or by in-register permutes:
 * eight two-table permutes pick by idx bits 0..4 from each 32-entry slice, three levels of
 * blends by bits 5..7. The same value as a gather, and faster: 1.5x the kernel's speed on
 * the AMD Zen 5 development VM, where the threshold gather of q8_encode alone took a third
 * of the time. */
RP_SIMD vf vf_lookup256(const float *table, vi idx, int permute) {
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
RP_SIMD float vf_reduce_max(vf x) { return _mm512_reduce_max_ps(x); }
/* mask ? max(x, acc) : acc, lane by lane. */
RP_SIMD vf vf_max_where(vm mask, vf acc, vf x) { return _mm512_mask_max_ps(acc, mask, x, acc); }
/* mask ? a / b : 0, lane by lane. */
RP_SIMD vf vf_div_or_zero(vm mask, vf a, vf b) { return _mm512_maskz_div_ps(mask, a, b); }

RP_SIMD vi vi_set1(int x) { return _mm512_set1_epi32(x); }
RP_SIMD vi vi_zero(void) { return _mm512_setzero_si512(); }
/* 0, 1, .. RP_W - 1 */
RP_SIMD vi vi_iota(void) {
    return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
RP_SIMD vi vi_add(vi a, vi b) { return _mm512_add_epi32(a, b); }
RP_SIMD vi vi_sub(vi a, vi b) { return _mm512_sub_epi32(a, b); }
RP_SIMD vi vi_and(vi a, vi b) { return _mm512_and_si512(a, b); }
RP_SIMD vi vi_xor(vi a, vi b) { return _mm512_xor_si512(a, b); }
RP_SIMD vi vi_mullo(vi a, vi b) { return _mm512_mullo_epi32(a, b); }
RP_SIMD vi vi_min(vi a, vi b) { return _mm512_min_epi32(a, b); }
RP_SIMD vi vi_max(vi a, vi b) { return _mm512_max_epi32(a, b); }
#define vi_srli(a, n) _mm512_srli_epi32((a), (n))
#define vi_slli(a, n) _mm512_slli_epi32((a), (n))
RP_SIMD vi vi_bits(vf a) { return _mm512_castps_si512(a); }
/* float -> int32, truncating. */
RP_SIMD vi vi_cvtt(vf a) { return _mm512_cvttps_epi32(a); }
/* mask ? b : a, lane by lane. */
RP_SIMD vi vi_blend(vm mask, vi a, vi b) { return _mm512_mask_blend_epi32(mask, a, b); }
/* mask ? a + 1 : a */
RP_SIMD vi vi_inc_where(vm mask, vi a) {
    return _mm512_mask_add_epi32(a, mask, a, _mm512_set1_epi32(1));
}
RP_SIMD vi vi_zero_unless(vm mask, vi a) { return _mm512_maskz_mov_epi32(mask, a); }
/* mask ? max(a, 1) : a */
RP_SIMD vi vi_at_least_one_where(vm mask, vi a) {
    return _mm512_mask_max_epi32(a, mask, a, _mm512_set1_epi32(1));
}
/* RP_W bytes -> RP_W lanes. */
RP_SIMD vi vi_load_u8(const uint8_t *p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
}
/* The low byte of each lane -> RP_W bytes at p. */
RP_SIMD void vi_store_u8(uint8_t *p, vi a) {
    _mm_storeu_si128((__m128i *)p, _mm512_cvtepi32_epi8(a));
}

RP_SIMD vh vh_load(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
RP_SIMD void vh_store(void *p, vh a) { _mm256_storeu_si256((__m256i *)p, a); }
/* A non-temporal store; p aligned to sizeof(vh). */
RP_SIMD void vh_stream(void *p, vh a) { _mm256_stream_si256((__m256i *)p, a); }
RP_SIMD vh vh_zero(void) { return _mm256_setzero_si256(); }
RP_SIMD vi vi_widen_u16(vh a) { return _mm512_cvtepu16_epi32(a); }
/* Lanes holding values <= 0xFFFF -> 16 bits each (truncating, exact for such values). */
RP_SIMD vh vh_narrow(vi a) { return _mm512_cvtepi32_epi16(a); }
RP_SIMD vf vf_from_f16(vh a) { return _mm512_cvtph_ps(a); }
/* fp32 -> IEEE fp16, round to nearest even. */
RP_SIMD vh vh_f16(vf a) { return _mm512_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

RP_SIMD vd vd_zero(void) { return _mm256_setzero_pd(); }
RP_SIMD void vd_store(double *p, vd a) { _mm256_storeu_pd(p, a); }
/* acc + the squares of x's lanes, widened to double, four lanes at a time in lane order:
 * lane j's square is added to acc's lane j % 4, as on AVX2 (the additions of one lane wait
 * on each other, so wider vectors would not be faster and would change the sums). */
RP_SIMD vd vd_add_squares(vd acc, vf x) {
    __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    /* the upper 8 floats by a 64-bit extract: extractf32x8 is AVX512DQ */
    __m256 upper = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1));
    __m512d hi = _mm512_cvtps_pd(upper);
    vd q[4] = {_mm512_castpd512_pd256(lo), _mm512_extractf64x4_pd(lo, 1),
               _mm512_castpd512_pd256(hi), _mm512_extractf64x4_pd(hi, 1)};
    for (int k = 0; k < 4; ++k) acc = _mm256_add_pd(acc, _mm256_mul_pd(q[k], q[k]));
    return acc;
}

RP_SIMD vm vm_le(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_LE_OQ); }
RP_SIMD vm vm_lt(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
RP_SIMD vm vm_ge(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
RP_SIMD vm vm_gt(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
RP_SIMD vm vm_ord(vf a) { return _mm512_cmp_ps_mask(a, a, _CMP_ORD_Q); }
RP_SIMD vm vm_nan(vf a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
/* Lanes 0 .. n - 1 (n <= RP_W). */
RP_SIMD vm vm_first(int n) { return (__mmask16)((1u << n) - 1u); }
RP_SIMD vm vm_all(int on) { return on ? (__mmask16)0xFFFF : (__mmask16)0; }

#endif
