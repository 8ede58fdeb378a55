/* The SIMD layer for AVX2 (with FMA and F16C): 8 floats per vector (simd.h lists the
 * operations). Masks are vectors of all-ones / all-zero lanes, as AVX2's compares give.
 *
 * Functions carry a target attribute instead of the file being built with -mavx2, so one
 * build runs on any x86-64 CPU; adam.c calls this kernel only when the CPU has the ISA.
 */
#ifndef RP_SIMD_AVX2_H
#define RP_SIMD_AVX2_H

#include <immintrin.h>
#include <string.h>

#define RP_TARGET __attribute__((target("avx2,fma,f16c")))
#define RP_W 8
/* AVX2 has no permutes across more than 8 lanes: the 8-bit tables are always gathered. */
#define RP_Q8_PERMUTE 0

typedef __m256 vf;
typedef __m256i vi;
typedef __m128i vh; /* 8 x 16 bits */
typedef __m256i vm;
typedef __m256d vd; /* 4 doubles */

#define RP_SIMD static inline RP_TARGET

RP_SIMD vf vf_set1(float x) { return _mm256_set1_ps(x); }
RP_SIMD vf vf_zero(void) { return _mm256_setzero_ps(); }
RP_SIMD vf vf_load(const void *p) { return _mm256_loadu_ps((const float *)p); }
RP_SIMD void vf_store(void *p, vf x) { _mm256_storeu_ps((float *)p, x); }
/* The 8 floats at p in lanes 0..7 (all of them here). */
RP_SIMD vf vf_load8(const float *p) { return _mm256_loadu_ps(p); }
RP_SIMD vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
RP_SIMD vf vf_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
RP_SIMD vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
RP_SIMD vf vf_div(vf a, vf b) { return _mm256_div_ps(a, b); }
RP_SIMD vf vf_fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
RP_SIMD vf vf_sqrt(vf a) { return _mm256_sqrt_ps(a); }
/* maxps: b when either is NaN. */
RP_SIMD vf vf_max(vf a, vf b) { return _mm256_max_ps(a, b); }
RP_SIMD vf vf_abs(vf a) { return _mm256_and_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF))); }
RP_SIMD vf vf_neg(vf a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.0f)); }
RP_SIMD vf vf_from_bits(vi a) { return _mm256_castsi256_ps(a); }
/* Lanes table[idx] for idx in 0..7. */
RP_SIMD vf vf_permute8(vf table, vi idx) { return _mm256_permutevar8x32_ps(table, idx); }
/* table[idx] of a 256-float table. */
RP_SIMD vf vf_lookup256(const float *table, vi idx, int permute) {
    (void)permute;
    return _mm256_i32gather_ps(table, idx, 4);
}
RP_SIMD float vf_reduce_max(vf x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}
/* mask ? max(x, acc) : acc, lane by lane. */
RP_SIMD vf vf_max_where(vm mask, vf acc, vf x) {
    return _mm256_blendv_ps(acc, _mm256_max_ps(x, acc), _mm256_castsi256_ps(mask));
}
/* mask ? a / b : 0, lane by lane. */
RP_SIMD vf vf_div_or_zero(vm mask, vf a, vf b) {
    return _mm256_and_ps(_mm256_div_ps(a, b), _mm256_castsi256_ps(mask));
}

RP_SIMD vi vi_set1(int x) { return _mm256_set1_epi32(x); }
RP_SIMD vi vi_zero(void) { return _mm256_setzero_si256(); }
/* 0, 1, .. RP_W - 1 */
RP_SIMD vi vi_iota(void) { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
RP_SIMD vi vi_add(vi a, vi b) { return _mm256_add_epi32(a, b); }
RP_SIMD vi vi_sub(vi a, vi b) { return _mm256_sub_epi32(a, b); }
RP_SIMD vi vi_and(vi a, vi b) { return _mm256_and_si256(a, b); }
RP_SIMD vi vi_xor(vi a, vi b) { return _mm256_xor_si256(a, b); }
RP_SIMD vi vi_mullo(vi a, vi b) { return _mm256_mullo_epi32(a, b); }
RP_SIMD vi vi_min(vi a, vi b) { return _mm256_min_epi32(a, b); }
RP_SIMD vi vi_max(vi a, vi b) { return _mm256_max_epi32(a, b); }
#define vi_srli(a, n) _mm256_srli_epi32((a), (n))
#define vi_slli(a, n) _mm256_slli_epi32((a), (n))
RP_SIMD vi vi_bits(vf a) { return _mm256_castps_si256(a); }
/* float -> int32, truncating. */
RP_SIMD vi vi_cvtt(vf a) { return _mm256_cvttps_epi32(a); }
/* mask ? b : a, lane by lane. */
RP_SIMD vi vi_blend(vm mask, vi a, vi b) { return _mm256_blendv_epi8(a, b, mask); }
/* mask ? a + 1 : a (a true lane is -1). */
RP_SIMD vi vi_inc_where(vm mask, vi a) { return _mm256_sub_epi32(a, mask); }
RP_SIMD vi vi_zero_unless(vm mask, vi a) { return _mm256_and_si256(a, mask); }
/* mask ? max(a, 1) : a, for a >= 0. */
RP_SIMD vi vi_at_least_one_where(vm mask, vi a) {
    return _mm256_max_epi32(a, _mm256_and_si256(mask, _mm256_set1_epi32(1)));
}
/* RP_W bytes -> RP_W lanes. */
RP_SIMD vi vi_load_u8(const uint8_t *p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
/* The low byte of each lane -> RP_W bytes at p. */
RP_SIMD void vi_store_u8(uint8_t *p, vi a) {
    __m256i bytes = _mm256_shuffle_epi8(
        a, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8,
                            12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
    uint32_t lo = (uint32_t)_mm_cvtsi128_si32(_mm256_castsi256_si128(bytes));
    uint32_t hi = (uint32_t)_mm_cvtsi128_si32(_mm256_extracti128_si256(bytes, 1));
    uint64_t codes = (uint64_t)lo | (uint64_t)hi << 32; /* little-endian: lane 0 first */
    memcpy(p, &codes, sizeof codes);
}

RP_SIMD vh vh_load(const void *p) { return _mm_loadu_si128((const __m128i *)p); }
RP_SIMD void vh_store(void *p, vh a) { _mm_storeu_si128((__m128i *)p, a); }
/* A non-temporal store; p aligned to sizeof(vh). */
RP_SIMD void vh_stream(void *p, vh a) { _mm_stream_si128((__m128i *)p, a); }
RP_SIMD vh vh_zero(void) { return _mm_setzero_si128(); }
RP_SIMD vi vi_widen_u16(vh a) { return _mm256_cvtepu16_epi32(a); }
/* Lanes holding values <= 0xFFFF -> 16 bits each. The unsigned-saturating pack is exact for
 * such values; it packs per 128-bit lane, the permute gathers the two halves. */
RP_SIMD vh vh_narrow(vi a) {
    __m256i packed = _mm256_packus_epi32(a, a);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0xD8));
}
RP_SIMD vf vf_from_f16(vh a) { return _mm256_cvtph_ps(a); }
/* fp32 -> IEEE fp16, round to nearest even. */
RP_SIMD vh vh_f16(vf a) { return _mm256_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

RP_SIMD vd vd_zero(void) { return _mm256_setzero_pd(); }
RP_SIMD void vd_store(double *p, vd a) { _mm256_storeu_pd(p, a); }
/* acc + the squares of x's lanes, widened to double, four lanes at a time in lane order:
 * lane j's square is added to acc's lane j % 4 (one rounding per addition). */
RP_SIMD vd vd_add_squares(vd acc, vf x) {
    vd lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
    vd hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    acc = _mm256_add_pd(acc, _mm256_mul_pd(lo, lo));
    return _mm256_add_pd(acc, _mm256_mul_pd(hi, hi));
}

RP_SIMD vm vm_le(vf a, vf b) { return _mm256_castps_si256(_mm256_cmp_ps(a, b, _CMP_LE_OQ)); }
RP_SIMD vm vm_lt(vf a, vf b) { return _mm256_castps_si256(_mm256_cmp_ps(a, b, _CMP_LT_OQ)); }
RP_SIMD vm vm_ge(vf a, vf b) { return _mm256_castps_si256(_mm256_cmp_ps(a, b, _CMP_GE_OQ)); }
RP_SIMD vm vm_gt(vf a, vf b) { return _mm256_castps_si256(_mm256_cmp_ps(a, b, _CMP_GT_OQ)); }
RP_SIMD vm vm_ord(vf a) { return _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_ORD_Q)); }
RP_SIMD vm vm_nan(vf a) { return _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)); }
/* Lanes 0 .. n - 1. */
RP_SIMD vm vm_first(int n) { return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), vi_iota()); }
RP_SIMD vm vm_all(int on) { return _mm256_set1_epi32(on ? -1 : 0); }

#endif
