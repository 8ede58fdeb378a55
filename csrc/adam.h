/* The C Adam: what cffi sees (csrc/build_adam.py feeds this header to cdef).
 *
 * One call updates a list of fp32 parameters (with exp_avg, exp_avg_sq and, with amsgrad,
 * max_exp_avg_sq) and optionally writes the fp16/bf16 model copy of each param in the same
 * pass. The gradient may be fp32, fp16 or bf16 (read and widened exactly: no fp32 gradient
 * buffer is needed); the moments fp32 or bf16 (computed in fp32, stored with stochastic
 * rounding driven by a hash of the element index and the step, so it is reproducible) or
 * 8-bit with one fp32 absmax per block of RP_QBLOCK elements (block-wise dynamic
 * quantization, RP_DTYPE_Q8). The parameter itself may be bf16 (the master: computed in
 * fp32, stored with the same stochastic rounding). The work is split over threads in chunks
 * of each tensor; every element goes through the same sequence of fp32 operations on every
 * ISA path, so results are bit-identical whatever the ISA or the thread count.
 *
 * Keep this header free of preprocessor directives and includes: cffi's cdef parses it.
 */

/* Hyper-parameters of one (param group, step) pair, already rounded to fp32 the way
 * torch rounds its Python scalars when it hands them to its fp32 kernels. */
typedef struct {
    float l2_weight_decay;    /* grad += p * l2_weight_decay (0: off) */
    float decoupled_decay;    /* p *= decoupled_decay (1: off), i.e. 1 - lr * wd */
    float beta1_weight;       /* lerp weight 1 - beta1 */
    float beta2;
    float one_minus_beta2;
    float inv_bias_correction2_sqrt; /* 1 / sqrt(1 - beta2 ** step) */
    float eps;
    float neg_step_size;      /* -lr / (1 - beta1 ** step) */
    float grad_scale;         /* the gradient is multiplied by this first (1: as it is); the
                               * clip of clip_grad_norm_ without a pass over the gradients */
    int maximize;
    int use_l2;
    int use_decoupled;
    int amsgrad;
    uint32_t sr_seed;         /* mixes the step into the bf16 moments' rounding bits */
    uint32_t param_sr_seed;   /* the same for a bf16 parameter's rounding bits */
    uintptr_t qmap;           /* const float[RP_QMAP_SIZE]: the 8-bit maps (RP_QMAP_*), 0 unless Q8 */
} rp_adam_hyper;

/* One tensor to update. Addresses are plain integers (torch's data_ptr()) so Python can
 * fill the array without a cast per pointer. */
typedef struct {
    uintptr_t param;          /* float*, or uint16_t* bf16 (param_dtype), read and written */
    uintptr_t grad;           /* const float*, or const uint16_t* (fp16 / bf16) */
    uintptr_t exp_avg;        /* float*, uint16_t* bf16, or uint8_t* codes (Q8) */
    uintptr_t exp_avg_sq;     /* float*, uint16_t* bf16, or uint8_t* codes (Q8) */
    uintptr_t exp_avg_absmax;    /* float* per RP_QBLOCK block, Q8 only */
    uintptr_t exp_avg_sq_absmax; /* float* per RP_QBLOCK block, Q8 only */
    uintptr_t max_exp_avg_sq; /* float*, 0 unless amsgrad */
    uintptr_t model_copy;     /* uint16_t* fp16 or bf16, 0: none */
    int64_t numel;
    int32_t copy_dtype;       /* RP_COPY_NONE / RP_COPY_FP16 / RP_COPY_BF16 */
    int32_t hyper;            /* index into the hyper array */
    int32_t grad_dtype;       /* RP_DTYPE_FP32 / RP_DTYPE_FP16 / RP_DTYPE_BF16 */
    int32_t state_dtype;      /* RP_DTYPE_FP32 / BF16 / Q8 (m and v; amsgrad: fp32 only) */
    int32_t param_dtype;      /* RP_DTYPE_FP32 / RP_DTYPE_BF16 (bf16: no model copy) */
} rp_adam_tensor;

#define RP_ISA_SCALAR 0
#define RP_ISA_AVX2 1
#define RP_ISA_AVX512 2
#define RP_COPY_NONE 0
#define RP_COPY_FP16 1
#define RP_COPY_BF16 2
#define RP_DTYPE_FP32 0
#define RP_DTYPE_FP16 1
#define RP_DTYPE_BF16 2
#define RP_DTYPE_Q8 3
/* Elements per 8-bit block: one absmax each for exp_avg and exp_avg_sq. */
#define RP_QBLOCK 256
/* Offsets of the four 256-float tables in rp_adam_hyper.qmap: the signed map's values
 * (exp_avg, sorted), its thresholds (midpoints of neighbours; entry 255 is +inf), then the
 * unsigned map's (exp_avg_sq). A code is the index of the value in its sorted map. */
#define RP_QMAP_SIGNED 0
#define RP_QMAP_SIGNED_THRESHOLDS 256
#define RP_QMAP_UNSIGNED 512
#define RP_QMAP_UNSIGNED_THRESHOLDS 768
/* Then the encoder's decade tables (engine/optim/_q8.py _decades): 8 bounds 1e-1 .. 1e-7
 * (and 0), then per map 8 lo, 8 inv_step and 8 base values, one per decade. */
#define RP_QMAP_DECADE_BOUNDS 1024
#define RP_QMAP_SIGNED_DECADES 1032
#define RP_QMAP_UNSIGNED_DECADES 1056
#define RP_QMAP_SIZE 1080
#define RP_ADAM_ABI_VERSION 8

/* RP_ADAM_ABI_VERSION of the compiled library (a stale build is rebuilt). */
int rp_adam_abi_version(void);

/* The sum of squares of each tensor's gradient (grad, grad_dtype, numel; nothing else is
 * read) into out[i], accumulated in double over fixed chunks that are added in order, so
 * the result does not depend on the thread count. Within a chunk, element i's square goes
 * to running sum i % 4, and the four are added as (s0 + s1) + (s2 + s3): the same sums on
 * every ISA path, and for a half gradient the same as for its fp32 copy (the widening and
 * the double square are exact). With up to n_threads threads; returns 0, -1 when the ISA
 * is not supported, or -2 when memory for the chunks' sums cannot be had. */
int rp_grad_sumsq(const rp_adam_tensor *tensors, int n_tensors, double *out, int n_threads,
                  int isa);

/* 1 when this build has the ISA path and the CPU can run it. */
int rp_adam_isa_supported(int isa);

/* The best ISA the CPU supports. */
int rp_adam_best_isa(void);

/* Update every tensor with up to n_threads threads (the calling one included); returns
 * 0, or -1 when the ISA is not supported (nothing was touched). A thread that cannot be
 * started leaves its range to the calling thread, so the work is always complete. */
int rp_adam_step(const rp_adam_tensor *tensors, int n_tensors,
                 const rp_adam_hyper *hypers, int n_threads, int isa);

/* The AVX-512 path's 8-bit moments look their 256-entry tables up with in-register
 * permutes (1, the default) or with gathers (0). Both give the same values; which is faster
 * depends on the CPU (permutes: 1.5x the kernel on AMD Zen; Intel runs every permute on one
 * port and its gathers are cheaper). rp_adam_q8_calibrate() times both on a small tensor,
 * keeps the faster and returns it (-1 without an AVX-512 path). */
void rp_adam_set_q8_permute(int on);
int rp_adam_get_q8_permute(void);
int rp_adam_q8_calibrate(void);
int rp_adam_q8_calibrate_avx512(void);

/* The per-ISA kernels: update elements [begin, end) of one tensor (with Q8 state, `begin`
 * is a multiple of RP_QBLOCK and `end` one or the tensor's end); `prefetch` asks the
 * vector paths for software prefetches (rp_prefetch_pays() in adam.c). Each ISA file always
 * defines its kernel (a stub where the compiler cannot target the ISA), so the library
 * links on every architecture; rp_adam_isa_supported() says which ones may run. */
void rp_adam_kernel_scalar(const rp_adam_tensor *t, const rp_adam_hyper *h,
                           int64_t begin, int64_t end, int prefetch);
void rp_adam_kernel_avx2(const rp_adam_tensor *t, const rp_adam_hyper *h,
                         int64_t begin, int64_t end, int prefetch);
void rp_adam_kernel_avx512(const rp_adam_tensor *t, const rp_adam_hyper *h,
                           int64_t begin, int64_t end, int prefetch);
/* The per-ISA sums of squares of grad elements [begin, end) of one tensor (`begin` a
 * multiple of 4), as rp_grad_sumsq describes them; stubs where the compiler cannot target
 * the ISA, like the kernels above. */
double rp_sumsq_kernel_scalar(const rp_adam_tensor *t, int64_t begin, int64_t end);
double rp_sumsq_kernel_avx2(const rp_adam_tensor *t, int64_t begin, int64_t end);
double rp_sumsq_kernel_avx512(const rp_adam_tensor *t, int64_t begin, int64_t end);
