/* The C Adam: run-time ISA dispatch, the thread split, and the scalar path.
 *
 * Numerics follow torch's _single_tensor_adam in fp32, one rounding per torch kernel:
 *   g  = grad * grad_scale                 clip_grad_norm_'s multiply (1: exact no-op)
 *   g  = maximize ? -g : g
 *   g  = fma(p, wd, g)                     L2 decay (torch's add with alpha is an fma)
 *   p  = p * (1 - lr * wd)                 decoupled decay
 *   m  = fma(w, g - m, m)                  lerp with w = 1 - beta1 when |w| < 0.5,
 *      = fma(w - 1, g - m, g)              otherwise (torch's two lerp branches)
 *   v  = fma((1 - beta2) * g, g, v * beta2) mul_ then addcmul_ (an fma in torch's kernel)
 *   vm = max(vm, v)                        amsgrad
 *   d  = sqrt(v or vm) * (1 / sqrt(bias_correction2)) + eps
 *   p  = p + ((-step_size) * m) / d        addcdiv_
 * One deliberate difference: torch divides by sqrt(bias_correction2); this multiplies by
 * its reciprocal (rounded once from double). A vector division costs as much as the
 * rest of the update, and where the kernel is compute-bound (few cores, data in cache) it
 * was ~10% slower than torch's fused AdamW with the division, faster without
 * (bench/RESULTS.md). It moves d by at most an ulp; torch's own vectorised sqrt is not
 * correctly rounded either, so neither choice is bit-identical to torch, and both stay
 * within 1e-6 of it over the tests' 10 steps.
 * Low-precision modes: a fp16/bf16 gradient is widened exactly before the first operation;
 * bf16 moments are widened on load and stored with stochastic rounding (f32_to_bf16_sr),
 * the same bits on every ISA path, so the paths still agree bit for bit.
 * Compact mode (issue 35): a bf16 parameter is widened, updated as above and stored with
 * the same stochastic rounding (its own seed); 8-bit moments (RP_DTYPE_Q8) are decoded as
 * map value * block absmax, updated in fp32 and re-encoded against the block's new absmax
 * (kernel_q8_scalar; engine/optim/_q8.py describes the maps).
 * The library is compiled with -ffp-contract=off so the compiler adds no fma of its own:
 * every ISA path performs exactly these roundings and the paths agree bit for bit.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "adam.h"

/* Threads claim work in chunks of this many elements (1 MiB of each fp32 array): large
 * enough that claiming costs nothing, small enough to even out late starters. A multiple
 * of 16 floats, so chunks of a tensor that starts on a cache line never share one. */
#define RP_CHUNK ((int64_t)1 << 18)
#define RP_MAX_THREADS 1024

typedef void (*rp_kernel_fn)(const rp_adam_tensor *, const rp_adam_hyper *, int64_t, int64_t,
                             int);

static uint32_t f32_to_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* fp32 -> bf16, round to nearest even; NaN -> 0x7FC0 (c10::BFloat16's conversion). */
static uint16_t f32_to_bf16(float f) {
    uint32_t u = f32_to_bits(f);
    if (f != f) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* fp32 -> IEEE fp16, round to nearest even, subnormals and overflow to inf included;
 * a NaN keeps its sign and top payload bits with the quiet bit set (as F16C does). */
static uint16_t f32_to_f16(float f) {
    uint32_t x = f32_to_bits(f);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t ax = x & 0x7FFFFFFFu;
    if (ax >= 0x7F800000u) {
        if (ax == 0x7F800000u) return (uint16_t)(sign | 0x7C00u);
        return (uint16_t)(sign | 0x7E00u | ((ax >> 13) & 0x3FFu));
    }
    if (ax >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u); /* >= 65520 rounds to inf */
    if (ax >= 0x38800000u) {                                   /* normal half */
        uint32_t h = ((ax >> 23) - 112u) << 10 | ((ax >> 13) & 0x3FFu);
        uint32_t rem = ax & 0x1FFFu;
        if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h += 1u; /* carry is fine */
        return (uint16_t)(sign | h);
    }
    /* subnormal half: h = mant * 2^(exp - 126) in units of 2^-24 */
    uint32_t e = ax >> 23;
    uint32_t shift = 126u - e;
    if (shift > 24u) return (uint16_t)sign; /* below 2^-25: rounds to zero */
    uint32_t mant = (ax & 0x7FFFFFu) | 0x800000u;
    uint32_t h = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (h & 1u))) h += 1u;
    return (uint16_t)(sign | h);
}

/* fp16 bits -> fp32, exact (subnormals, inf and NaN included), as F16C's vcvtph2ps. */
static float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu;
    uint32_t mant = h & 0x3FFu;
    uint32_t u;
    if (exp == 0x1Fu) {
        u = sign | 0x7F800000u | (mant << 13);
    } else if (exp != 0) {
        u = sign | ((exp + 112u) << 23) | (mant << 13);
    } else if (mant == 0) {
        u = sign;
    } else { /* subnormal: normalise */
        int e = -1;
        do {
            mant <<= 1;
            ++e;
        } while (!(mant & 0x400u));
        u = sign | ((uint32_t)(112 - e) << 23) | ((mant & 0x3FFu) << 13);
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* A 32-bit integer hash with good avalanche (the "lowbias32" constants); the vector paths
 * compute the same function lane by lane. */
static uint32_t rp_hash32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    x ^= x >> 16;
    return x;
}

/* fp32 -> bf16 with stochastic rounding: add 16 random bits below the kept ones and
 * truncate, so E[result] = f. Round-to-nearest would freeze a moment whose per-step change
 * is below half a bf16 ulp (v * 0.999 == v in bf16); this keeps the average change.
 * `which` is 0 for exp_avg, 1 for exp_avg_sq. NaN -> 0x7FC0. */
static uint16_t f32_to_bf16_sr(float f, int64_t index, uint32_t which, uint32_t seed) {
    if (f != f) return 0x7FC0;
    uint32_t r = rp_hash32(((uint32_t)index * 2u + which) ^ seed) & 0xFFFFu;
    return (uint16_t)((f32_to_bits(f) + r) >> 16);
}

/* The update of one element in fp32 (the header comment's sequence); `vm` is touched only
 * with amsgrad. */
static void adam_elem(const rp_adam_hyper *h, float *p_io, float g, float *m_io, float *v_io,
                      float *vm) {
    const float w = h->beta1_weight;
    float p = *p_io, m = *m_io, v = *v_io;
    g = g * h->grad_scale;
    if (h->maximize) g = -g;
    if (h->use_l2) g = fmaf(p, h->l2_weight_decay, g);
    if (h->use_decoupled) p = p * h->decoupled_decay;
    float diff = g - m;
    m = fabsf(w) < 0.5f ? fmaf(w, diff, m) : fmaf(w - 1.0f, diff, g);
    v = v * h->beta2;
    v = fmaf(h->one_minus_beta2 * g, g, v);
    float s = v;
    if (h->amsgrad) {
        float old = *vm;
        old = old > v ? old : v; /* maxps semantics: a NaN in v propagates */
        *vm = old;
        s = old;
    }
    float denom = sqrtf(s) * h->inv_bias_correction2_sqrt + h->eps;
    *p_io = p + (h->neg_step_size * m) / denom;
    *m_io = m;
    *v_io = v;
}

static float load_grad_scalar(const rp_adam_tensor *t, int64_t i) {
    const uint16_t *g16 = (const uint16_t *)t->grad;
    if (t->grad_dtype == RP_DTYPE_FP16) return f16_to_f32(g16[i]);
    if (t->grad_dtype == RP_DTYPE_BF16) return bf16_to_f32(g16[i]);
    return ((const float *)t->grad)[i];
}

/* The 8-bit code of x (normalised to [-1, 1]): how many of the map's thresholds lie below
 * it (the index of the nearest map value). Rather than searching the 255 thresholds, it
 * guesses: x's decade z (how many of 1e-1 .. 1e-7 are >= |x|), then the magnitude just below
 * |x| from its linear position in the decade (RP_QMAP_*_DECADES, engine/optim/_q8.py
 * _decades). The guess is off by at most one only where |x| is next to a map value, so one
 * compare with the threshold above the guessed code gives the exact count (checked against
 * the binary search for every float in [-1, 1]). The vector paths do the same operations.
 * `signed_map`: exp_avg's map (code 127 is 0); else exp_avg_sq's, where a positive x never
 * gets code 0 (the map's zero). NaN: code 0. */
static uint8_t q8_encode(float x, const float *qmap, int signed_map) {
    if (x != x) return 0;
    const float *dec = qmap + (signed_map ? RP_QMAP_SIGNED_DECADES : RP_QMAP_UNSIGNED_DECADES);
    const float *thresholds =
        qmap + (signed_map ? RP_QMAP_SIGNED_THRESHOLDS : RP_QMAP_UNSIGNED_THRESHOLDS);
    float a = fabsf(x);
    int z = 0;
    for (int d = 0; d < 7; ++d) z += a <= qmap[RP_QMAP_DECADE_BOUNDS + d];
    int below = (int)dec[16 + z] + (int)((a - dec[z]) * dec[8 + z]);
    int code = signed_map ? (x >= 0.0f ? 127 + below : 126 - below) : below;
    code = code < 0 ? 0 : code > 255 ? 255 : code;
    code += thresholds[code] < x; /* entry 255 is +inf: never below */
    if (!signed_map && code == 0 && x > 0.0f) code = 1;
    return (uint8_t)code;
}

/* Q8 moments: per block, decode m and v (map value * the block's absmax), update, then
 * quantise the new m and v against the new block absmax (the largest |value|, NaN
 * ignored). A positive v is never stored as zero: m / (sqrt(0) + eps) would blow up. */
static void kernel_q8_scalar(const rp_adam_tensor *t, const rp_adam_hyper *h, int64_t begin,
                             int64_t end) {
    const float *qmap = (const float *)h->qmap;
    uint8_t *cm = (uint8_t *)t->exp_avg;
    uint8_t *cv = (uint8_t *)t->exp_avg_sq;
    float *am_blocks = (float *)t->exp_avg_absmax;
    float *av_blocks = (float *)t->exp_avg_sq_absmax;
    float *param = (float *)t->param;
    uint16_t *param16 = (uint16_t *)t->param;
    const int bf16_param = t->param_dtype == RP_DTYPE_BF16;
    float bm[RP_QBLOCK], bv[RP_QBLOCK];
    for (int64_t b0 = begin; b0 < end; b0 += RP_QBLOCK) {
        int64_t b1 = b0 + RP_QBLOCK < end ? b0 + RP_QBLOCK : end;
        int64_t blk = b0 / RP_QBLOCK;
        float am_old = am_blocks[blk], av_old = av_blocks[blk];
        float am = 0.0f, av = 0.0f;
        for (int64_t i = b0; i < b1; ++i) {
            float p = bf16_param ? bf16_to_f32(param16[i]) : param[i];
            float m = qmap[RP_QMAP_SIGNED + cm[i]] * am_old;
            float v = qmap[RP_QMAP_UNSIGNED + cv[i]] * av_old;
            adam_elem(h, &p, load_grad_scalar(t, i), &m, &v, NULL);
            if (bf16_param) param16[i] = f32_to_bf16_sr(p, i, 0u, h->param_sr_seed);
            else param[i] = p;
            float am_i = fabsf(m), av_i = fabsf(v);
            am = am_i > am ? am_i : am;
            av = av_i > av ? av_i : av;
            bm[i - b0] = m;
            bv[i - b0] = v;
        }
        for (int64_t i = b0; i < b1; ++i) {
            float xm = am > 0.0f ? bm[i - b0] / am : 0.0f;
            float xv = av > 0.0f ? bv[i - b0] / av : 0.0f;
            cm[i] = q8_encode(xm, qmap, 1);
            cv[i] = q8_encode(xv, qmap, 0);
        }
        am_blocks[blk] = am;
        av_blocks[blk] = av;
    }
}

void rp_adam_kernel_scalar(const rp_adam_tensor *t, const rp_adam_hyper *h,
                           int64_t begin, int64_t end, int prefetch) {
    (void)prefetch; /* the hardware prefetchers keep up with the scalar loop */
    if (t->state_dtype == RP_DTYPE_Q8) {
        kernel_q8_scalar(t, h, begin, end);
        return;
    }
    float *param = (float *)t->param;
    uint16_t *param16 = (uint16_t *)t->param;
    float *exp_avg = (float *)t->exp_avg;
    float *exp_avg_sq = (float *)t->exp_avg_sq;
    uint16_t *exp_avg16 = (uint16_t *)t->exp_avg;
    uint16_t *exp_avg_sq16 = (uint16_t *)t->exp_avg_sq;
    float *max_sq = (float *)t->max_exp_avg_sq;
    uint16_t *copy = (uint16_t *)t->model_copy;
    const int copy_dtype = copy ? t->copy_dtype : RP_COPY_NONE;
    const int bf16_state = t->state_dtype == RP_DTYPE_BF16;
    const int bf16_param = t->param_dtype == RP_DTYPE_BF16;
    for (int64_t i = begin; i < end; ++i) {
        float p = bf16_param ? bf16_to_f32(param16[i]) : param[i];
        float m = bf16_state ? bf16_to_f32(exp_avg16[i]) : exp_avg[i];
        float v = bf16_state ? bf16_to_f32(exp_avg_sq16[i]) : exp_avg_sq[i];
        adam_elem(h, &p, load_grad_scalar(t, i), &m, &v, h->amsgrad ? &max_sq[i] : NULL);
        if (bf16_param) param16[i] = f32_to_bf16_sr(p, i, 0u, h->param_sr_seed);
        else param[i] = p;
        if (bf16_state) {
            exp_avg16[i] = f32_to_bf16_sr(m, i, 0u, h->sr_seed);
            exp_avg_sq16[i] = f32_to_bf16_sr(v, i, 1u, h->sr_seed);
        } else {
            exp_avg[i] = m;
            exp_avg_sq[i] = v;
        }
        if (copy_dtype == RP_COPY_FP16) copy[i] = f32_to_f16(p);
        else if (copy_dtype == RP_COPY_BF16) copy[i] = f32_to_bf16(p);
    }
}

int rp_adam_abi_version(void) { return RP_ADAM_ABI_VERSION; }

/* Read by the AVX-512 kernel once per call (adam_avx512.c). */
int rp_adam_q8_permute_flag = 1;

void rp_adam_set_q8_permute(int on) { rp_adam_q8_permute_flag = on ? 1 : 0; }

int rp_adam_get_q8_permute(void) { return rp_adam_q8_permute_flag; }

int rp_adam_q8_calibrate(void) {
    if (!rp_adam_isa_supported(RP_ISA_AVX512)) return -1;
    return rp_adam_q8_calibrate_avx512();
}

int rp_adam_isa_supported(int isa) {
    switch (isa) {
    case RP_ISA_SCALAR:
        return 1;
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
    case RP_ISA_AVX2:
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
               __builtin_cpu_supports("f16c");
    case RP_ISA_AVX512:
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx512f");
#endif
    default:
        return 0;
    }
}

int rp_adam_best_isa(void) {
    if (rp_adam_isa_supported(RP_ISA_AVX512)) return RP_ISA_AVX512;
    if (rp_adam_isa_supported(RP_ISA_AVX2)) return RP_ISA_AVX2;
    return RP_ISA_SCALAR;
}

/* Whether the vector loops should issue software prefetches. Measured with bench/adam.py
 * (bench/RESULTS.md): +5-10% on the 16-core Intel GPU host, where the hardware prefetchers
 * alone leave bandwidth unused, and -5-10% on the 2-core AMD development VM. */
static int rp_prefetch_pays(void) {
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    return __builtin_cpu_is("intel");
#else
    return 0;
#endif
}

/* The ISA dispatch table of the update (rp_sumsq_kernels: of the sums), constant. */
static const rp_kernel_fn rp_kernels[3] = {
    rp_adam_kernel_scalar,
    rp_adam_kernel_avx2,
    rp_adam_kernel_avx512,
};

/* One call's shared work list: every tensor is cut into chunks of RP_CHUNK elements from
 * its own element 0 (so a chunk of Q8 state starts on a block), and threads claim chunks
 * from an atomic counter, so a thread that started late (threads are created one after
 * the other) simply takes fewer. The split cannot change results: every element (every
 * Q8 block) is updated independently, with the same operations. */
typedef struct {
    const rp_adam_tensor *tensors;
    int n_tensors;
    const rp_adam_hyper *hypers;
    rp_kernel_fn kernel;
    const int64_t *first_chunk; /* n_tensors + 1 prefix sums of the tensors' chunk counts */
    int prefetch;
    int64_t next_chunk; /* claimed with atomic adds */
} rp_work;

static void run_chunks(rp_work *w) {
    int ti = 0; /* the tensor of the last claimed chunk; claims only grow */
    const int64_t total = w->first_chunk[w->n_tensors];
    for (;;) {
        int64_t chunk = __atomic_fetch_add(&w->next_chunk, 1, __ATOMIC_RELAXED);
        if (chunk >= total) return;
        while (w->first_chunk[ti + 1] <= chunk) ++ti;
        const rp_adam_tensor *t = &w->tensors[ti];
        int64_t lo = (chunk - w->first_chunk[ti]) * RP_CHUNK;
        int64_t hi = lo + RP_CHUNK < t->numel ? lo + RP_CHUNK : t->numel;
        w->kernel(t, &w->hypers[t->hyper], lo, hi, w->prefetch);
    }
}

static void *run_chunks_thread(void *arg) {
    run_chunks((rp_work *)arg);
    return NULL;
}

typedef double (*rp_sumsq_fn)(const rp_adam_tensor *, int64_t, int64_t);

/* The ISA dispatch table of the sums of squares. */
static const rp_sumsq_fn rp_sumsq_kernels[3] = {
    rp_sumsq_kernel_scalar,
    rp_sumsq_kernel_avx2,
    rp_sumsq_kernel_avx512,
};

/* rp_grad_sumsq's shared work: chunks of RP_CHUNK elements as in rp_adam_step, each one's
 * sum written to its own slot. */
typedef struct {
    const rp_adam_tensor *tensors;
    const int64_t *first_chunk;
    int n_tensors;
    rp_sumsq_fn kernel;
    double *sums; /* one per chunk */
    int64_t next_chunk;
} rp_sumsq_work;

/* Four running sums (the additions of one chain wait on each other), combined in a
 * fixed order: the same value on every run and thread count. The vector paths keep the
 * four in the lanes of one vector of doubles and add in the same order. */
double rp_sumsq_kernel_scalar(const rp_adam_tensor *t, int64_t begin, int64_t end) {
    double a[4] = {0.0, 0.0, 0.0, 0.0};
    int64_t i = begin;
    if (t->grad_dtype == RP_DTYPE_FP32) {
        const float *g = (const float *)t->grad;
        for (; i + 4 <= end; i += 4)
            for (int k = 0; k < 4; ++k) a[k] += (double)g[i + k] * (double)g[i + k];
    }
    for (; i < end; ++i) {
        double x = (double)load_grad_scalar(t, i);
        a[i & 3] += x * x;
    }
    return (a[0] + a[1]) + (a[2] + a[3]);
}

static void *run_sumsq(void *arg) {
    rp_sumsq_work *w = (rp_sumsq_work *)arg;
    int ti = 0;
    const int64_t total = w->first_chunk[w->n_tensors];
    for (;;) {
        int64_t chunk = __atomic_fetch_add(&w->next_chunk, 1, __ATOMIC_RELAXED);
        if (chunk >= total) return NULL;
        while (w->first_chunk[ti + 1] <= chunk) ++ti;
        const rp_adam_tensor *t = &w->tensors[ti];
        int64_t lo = (chunk - w->first_chunk[ti]) * RP_CHUNK;
        int64_t hi = lo + RP_CHUNK < t->numel ? lo + RP_CHUNK : t->numel;
        w->sums[chunk] = w->kernel(t, lo, hi);
    }
}

int rp_grad_sumsq(const rp_adam_tensor *tensors, int n_tensors, double *out, int n_threads,
                  int isa) {
    if (isa < 0 || isa > RP_ISA_AVX512 || !rp_adam_isa_supported(isa)) return -1;
    int64_t *first = malloc(sizeof *first * (size_t)(n_tensors + 1));
    if (!first) return -2;
    first[0] = 0;
    for (int i = 0; i < n_tensors; ++i)
        first[i + 1] = first[i] + (tensors[i].numel + RP_CHUNK - 1) / RP_CHUNK;
    int64_t chunks = first[n_tensors];
    double *sums = malloc(sizeof *sums * (size_t)(chunks > 0 ? chunks : 1));
    if (!sums) {
        free(first);
        return -2;
    }
    int n = n_threads < 1 ? 1 : n_threads;
    if (n > RP_MAX_THREADS) n = RP_MAX_THREADS;
    if (n > chunks) n = chunks > 0 ? (int)chunks : 1;
    rp_sumsq_work work = {tensors, first, n_tensors, rp_sumsq_kernels[isa], sums, 0};
    pthread_t stack_ids[16];
    pthread_t *ids = n > 16 ? malloc(sizeof *ids * (size_t)n) : stack_ids;
    int started = 0;
    if (ids) {
        while (started + 1 < n && pthread_create(&ids[started + 1], NULL, run_sumsq, &work) == 0)
            ++started;
    }
    run_sumsq(&work);
    for (int k = 1; k <= started; ++k) pthread_join(ids[k], NULL);
    if (ids && ids != stack_ids) free(ids);
    for (int i = 0; i < n_tensors; ++i) {
        double s = 0.0;
        for (int64_t c = first[i]; c < first[i + 1]; ++c) s += sums[c];
        out[i] = s;
    }
    free(sums);
    free(first);
    return 0;
}

int rp_adam_step(const rp_adam_tensor *tensors, int n_tensors,
                 const rp_adam_hyper *hypers, int n_threads, int isa) {
    if (isa < 0 || isa > RP_ISA_AVX512 || !rp_adam_isa_supported(isa)) return -1;
    int64_t stack_first[65];
    int64_t *first = n_tensors < 65 ? stack_first : malloc(sizeof *first * (size_t)(n_tensors + 1));
    if (!first) return -2;
    first[0] = 0;
    for (int i = 0; i < n_tensors; ++i)
        first[i + 1] = first[i] + (tensors[i].numel + RP_CHUNK - 1) / RP_CHUNK;
    int64_t chunks = first[n_tensors];
    if (chunks == 0) {
        if (first != stack_first) free(first);
        return 0;
    }

    int n = n_threads < 1 ? 1 : n_threads;
    if (n > RP_MAX_THREADS) n = RP_MAX_THREADS;
    if (n > chunks) n = (int)chunks; /* no thread gets less than one chunk */

    rp_work work = {tensors, n_tensors, hypers, rp_kernels[isa], first, rp_prefetch_pays(), 0};
    pthread_t stack_ids[16];
    pthread_t *ids = n > 16 ? malloc(sizeof *ids * (size_t)n) : stack_ids;
    int started = 0; /* threads 1..started are running */
    if (ids) {
        while (started + 1 < n &&
               pthread_create(&ids[started + 1], NULL, run_chunks_thread, &work) == 0)
            ++started;
    }
    run_chunks(&work); /* a thread that failed to start leaves its chunks to the others */
    for (int k = 1; k <= started; ++k) pthread_join(ids[k], NULL);
    if (ids && ids != stack_ids) free(ids);
    if (first != stack_first) free(first);
    return 0;
}
