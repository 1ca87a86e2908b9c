/* linear_kernels.h: float32 activations x bfloat16 / float16 / int8 weights -> float32,
 * with one variant per instruction set, chosen at run time.
 *
 * The spec is mie/linear.py (layouts and formats are described there): the weight is (N, K)
 * row-major, one output channel per row; out[m, n] = sum_k x[m, k] * w[n, k], accumulated
 * in float32. int8 weights carry one float32 scale per MIE_GROUP inputs of a row.
 *
 * Variants: "avx512" (AVX-512 F/BW/VL/DQ + FMA), "avx2" (AVX2 + FMA + F16C) and "generic"
 * (portable C, auto-vectorized for the build's baseline: SSE2 on x86-64, NEON on arm64).
 * The x86 ones are compiled with GCC/Clang target attributes, so one build holds all three
 * and __builtin_cpu_supports picks at run time; on other architectures only "generic" exists.
 * Each variant's kernels are the same source (linear_body.h) over a few vector primitives.
 */
#ifndef MIE_LINEAR_KERNELS_H
#define MIE_LINEAR_KERNELS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* MIE_GENERIC_ONLY builds what a non-x86 machine gets (tests/test_fast_linear.py compiles it). */
#if !defined(MIE_GENERIC_ONLY) && (defined(__x86_64__) || defined(__i386__)) && \
    (defined(__GNUC__) || defined(__clang__))
#define MIE_X86 1
#include <immintrin.h>
#else
#define MIE_X86 0
#endif

#define MIE_GROUP 32
enum { MIE_BF16 = 0, MIE_F16 = 1, MIE_I8 = 2 };

/* ---- scalar conversions (exact), shared by every variant's tails --------------------------- */

static inline float mie_bits_to_float(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint32_t mie_float_to_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float mie_bf16_to_float(uint16_t h) { return mie_bits_to_float((uint32_t)h << 16); }

/* IEEE half -> float, exactly, for every input: put the exponent and mantissa bits in place,
 * multiply by 2^112 to rebias (subnormal halves land on exact normal floats), and for
 * inf/NaN force the all-ones exponent. Needs subnormals kept (no DAZ), as CPython runs. */
static inline float mie_f16_to_float(uint16_t h)
{
    const uint32_t em = h & 0x7fffu;
    uint32_t u = mie_float_to_bits(mie_bits_to_float(em << 13) * 0x1p112f);
    if (em >= 0x7c00u) u |= 0x7f800000u;
    return mie_bits_to_float(u | ((uint32_t)(h & 0x8000u) << 16));
}

static inline float mie_scalar_w(const int fmt, const void *w, const float *s, int64_t k)
{
    if (fmt == MIE_BF16) return mie_bf16_to_float(((const uint16_t *)w)[k]);
    if (fmt == MIE_F16) return mie_f16_to_float(((const uint16_t *)w)[k]);
    return (float)((const int8_t *)w)[k] * s[k / MIE_GROUP];
}

/* ---- "generic": portable C over 4-float vectors ------------------------------------------- */
/* GCC/Clang vector extensions, 16 bytes: the baseline SIMD width everywhere (SSE2 on x86-64,
 * NEON on arm64; wider ones would change the calling convention); other compilers get plain
 * 4-float loops. */

#define MIE_G static inline __attribute__((always_inline))
#if defined(__GNUC__) || defined(__clang__)
typedef float mie_gv __attribute__((vector_size(16)));
typedef uint32_t mie_u32x4 __attribute__((vector_size(16)));
typedef int32_t mie_i32x4 __attribute__((vector_size(16)));
typedef uint16_t mie_u16x4 __attribute__((vector_size(8)));
typedef int8_t mie_i8x4 __attribute__((vector_size(4)));

MIE_G mie_gv mie_g_zero(void) { return (mie_gv){0, 0, 0, 0}; }
MIE_G mie_gv mie_g_set1(float f) { return (mie_gv){f, f, f, f}; }
MIE_G mie_gv mie_g_mul(mie_gv a, mie_gv b) { return a * b; }
MIE_G mie_gv mie_g_add(mie_gv a, mie_gv b) { return a + b; }
MIE_G mie_gv mie_g_fma(mie_gv a, mie_gv b, mie_gv c) { return c + a * b; }
MIE_G mie_gv mie_g_loadx(const float *p) { mie_gv r; memcpy(&r, p, sizeof r); return r; }
MIE_G void mie_g_storex(float *p, mie_gv a) { memcpy(p, &a, sizeof a); }
MIE_G float mie_g_hsum(mie_gv a) { return (a[0] + a[2]) + (a[1] + a[3]); }
MIE_G mie_u32x4 mie_g_load_u16(const uint16_t *p)
{
    mie_u16x4 h;
    memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, mie_u32x4);
}
MIE_G mie_gv mie_g_load_bf16(const uint16_t *p) { return (mie_gv)(mie_g_load_u16(p) << 16); }
MIE_G mie_gv mie_g_load_f16(const uint16_t *p)
{
    /* mie_f16_to_float, four lanes at a time */
    const mie_u32x4 h = mie_g_load_u16(p), em = h & 0x7fffu;
    mie_u32x4 u = (mie_u32x4)((mie_gv)(em << 13) * 0x1p112f);
    u |= (mie_u32x4)((mie_i32x4)em >= 0x7c00) & 0x7f800000u; /* signed: SSE2 has no unsigned compare */
    return (mie_gv)(u | ((h & 0x8000u) << 16));
}
MIE_G mie_gv mie_g_load_i8(const int8_t *p)
{
    mie_i8x4 q;
    memcpy(&q, p, sizeof q);
    return __builtin_convertvector(q, mie_gv);
}
#else
typedef struct { float v[4]; } mie_gv;
#define MIE_GV_LOOP(expr) { mie_gv r; for (int l = 0; l < 4; l++) r.v[l] = (expr); return r; }
MIE_G mie_gv mie_g_zero(void) MIE_GV_LOOP(0.0f)
MIE_G mie_gv mie_g_set1(float f) MIE_GV_LOOP(f)
MIE_G mie_gv mie_g_mul(mie_gv a, mie_gv b) MIE_GV_LOOP(a.v[l] * b.v[l])
MIE_G mie_gv mie_g_add(mie_gv a, mie_gv b) MIE_GV_LOOP(a.v[l] + b.v[l])
MIE_G mie_gv mie_g_fma(mie_gv a, mie_gv b, mie_gv c) MIE_GV_LOOP(c.v[l] + a.v[l] * b.v[l])
MIE_G mie_gv mie_g_loadx(const float *p) MIE_GV_LOOP(p[l])
MIE_G void mie_g_storex(float *p, mie_gv a) { memcpy(p, a.v, sizeof a.v); }
MIE_G float mie_g_hsum(mie_gv a) { return (a.v[0] + a.v[2]) + (a.v[1] + a.v[3]); }
MIE_G mie_gv mie_g_load_bf16(const uint16_t *p) MIE_GV_LOOP(mie_bf16_to_float(p[l]))
MIE_G mie_gv mie_g_load_f16(const uint16_t *p) MIE_GV_LOOP(mie_f16_to_float(p[l]))
MIE_G mie_gv mie_g_load_i8(const int8_t *p) MIE_GV_LOOP((float)p[l])
#undef MIE_GV_LOOP
#endif
#undef MIE_G

#define ISA_NAME(f) f##_generic
#define ISA_ATTR
#define VEC mie_gv
#define VW 4
#define MR 4
#define NR 2
#define v_zero mie_g_zero
#define v_set1 mie_g_set1
#define v_loadx mie_g_loadx
#define v_storex mie_g_storex
#define v_fma mie_g_fma
#define v_mul mie_g_mul
#define v_add mie_g_add
#define v_hsum mie_g_hsum
#define v_load_bf16 mie_g_load_bf16
#define v_load_f16 mie_g_load_f16
#define v_load_i8 mie_g_load_i8
#include "linear_body.h"
#undef ISA_NAME
#undef ISA_ATTR
#undef VEC
#undef VW
#undef MR
#undef NR
#undef v_zero
#undef v_set1
#undef v_loadx
#undef v_storex
#undef v_fma
#undef v_mul
#undef v_add
#undef v_hsum
#undef v_load_bf16
#undef v_load_f16
#undef v_load_i8

#if MIE_X86
/* ---- "avx2": 8 floats per vector, 16 registers --------------------------------------------- */
/* Register tile 4 x 3: 12 accumulators in 16 registers; the compiler keeps some activation
 * vectors as memory operands of the FMAs. Measured on one core against 4 x 2, 6 x 2 and
 * 3 x 4 (M = 8 / 32, K = 896, N = 4864): 4 x 3 was the fastest, 1.6x / 1.1x float32 BLAS
 * where 4 x 2 was 0.85x / 0.87x. */

#define MIE_AVX2 __attribute__((target("avx2,fma,f16c")))

static inline __attribute__((always_inline)) MIE_AVX2 float mie_avx2_hsum(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
static inline __attribute__((always_inline)) MIE_AVX2 __m256 mie_avx2_load_bf16(const uint16_t *p)
{
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
static inline __attribute__((always_inline)) MIE_AVX2 __m256 mie_avx2_load_f16(const uint16_t *p)
{
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
static inline __attribute__((always_inline)) MIE_AVX2 __m256 mie_avx2_load_i8(const int8_t *p)
{
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

#define ISA_NAME(f) f##_avx2
#define ISA_ATTR MIE_AVX2
#define VEC __m256
#define VW 8
#define MR 4
#define NR 3
#define v_zero _mm256_setzero_ps
#define v_set1 _mm256_set1_ps
#define v_loadx _mm256_loadu_ps
#define v_storex _mm256_storeu_ps
#define v_fma _mm256_fmadd_ps
#define v_mul _mm256_mul_ps
#define v_add _mm256_add_ps
#define v_hsum mie_avx2_hsum
#define v_load_bf16 mie_avx2_load_bf16
#define v_load_f16 mie_avx2_load_f16
#define v_load_i8 mie_avx2_load_i8
#include "linear_body.h"
#undef ISA_NAME
#undef ISA_ATTR
#undef VEC
#undef VW
#undef MR
#undef NR
#undef v_zero
#undef v_set1
#undef v_loadx
#undef v_storex
#undef v_fma
#undef v_mul
#undef v_add
#undef v_hsum
#undef v_load_bf16
#undef v_load_f16
#undef v_load_i8

/* ---- "avx512": 16 floats per vector, 32 registers ------------------------------------------ */
/* Register tile 4 x 4 (16 accumulators, 4 activation vectors, 1 weight vector: 21 of 32). */

#define MIE_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))

static inline __attribute__((always_inline)) MIE_AVX512 __m512 mie_avx512_load_bf16(const uint16_t *p)
{
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
static inline __attribute__((always_inline)) MIE_AVX512 __m512 mie_avx512_load_f16(const uint16_t *p)
{
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
static inline __attribute__((always_inline)) MIE_AVX512 __m512 mie_avx512_load_i8(const int8_t *p)
{
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline __attribute__((always_inline)) MIE_AVX512 float mie_avx512_hsum(__m512 v)
{
    return _mm512_reduce_add_ps(v);
}

#define ISA_NAME(f) f##_avx512
#define ISA_ATTR MIE_AVX512
#define VEC __m512
#define VW 16
#define MR 4
#define NR 4
#define v_zero _mm512_setzero_ps
#define v_set1 _mm512_set1_ps
#define v_loadx _mm512_loadu_ps
#define v_storex _mm512_storeu_ps
#define v_fma _mm512_fmadd_ps
#define v_mul _mm512_mul_ps
#define v_add _mm512_add_ps
#define v_hsum mie_avx512_hsum
#define v_load_bf16 mie_avx512_load_bf16
#define v_load_f16 mie_avx512_load_f16
#define v_load_i8 mie_avx512_load_i8
#include "linear_body.h"
#undef ISA_NAME
#undef ISA_ATTR
#undef VEC
#undef VW
#undef MR
#undef NR
#undef v_zero
#undef v_set1
#undef v_loadx
#undef v_storex
#undef v_fma
#undef v_mul
#undef v_add
#undef v_hsum
#undef v_load_bf16
#undef v_load_f16
#undef v_load_i8
#endif /* MIE_X86 */

/* ---- dispatch ------------------------------------------------------------------------------ */

typedef void (*mie_gemm_fn)(int fmt, const float *x, int64_t ldx, int64_t M, const void *w,
                            int64_t ldw, const float *s, int64_t lds, int64_t K, float *out,
                            int64_t ldo, int64_t n_begin, int64_t n_end);
typedef void (*mie_widen_fn)(int fmt, const void *w, int64_t ldw, const float *s, int64_t lds,
                             int64_t K, float *dst, int64_t ldd, int64_t n_begin, int64_t n_end);

typedef struct {
    const char *name;
    mie_gemm_fn gemm;
    mie_widen_fn widen;
} mie_isa;

/* Best first: the default is the first one the CPU supports. */
static const mie_isa mie_isas[] = {
#if MIE_X86
    {"avx512", gemm_avx512, widen_avx512},
    {"avx2", gemm_avx2, widen_avx2},
#endif
    {"generic", gemm_generic, widen_generic},
};

static inline int mie_isa_count(void) { return (int)(sizeof mie_isas / sizeof mie_isas[0]); }
static inline const char *mie_isa_name(int i) { return mie_isas[i].name; }

/* Whether this CPU (and its OS, which must save the wide registers) runs variant i. */
static inline int mie_isa_supported(int i)
{
#if MIE_X86
    __builtin_cpu_init();
    if (strcmp(mie_isas[i].name, "avx512") == 0)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (strcmp(mie_isas[i].name, "avx2") == 0)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
               __builtin_cpu_supports("f16c");
#endif
    return strcmp(mie_isas[i].name, "generic") == 0;
}

static inline int mie_max_threads(void)
{
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

static inline int mie_openmp(void)
{
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* Weight rows per parallel chunk: about 64 KiB of weight (the chunk stays in L2 while every
 * group of MR activation rows passes over it), a multiple of 12 (of every variant's NR: no
 * partial tiles inside), and small enough that each thread gets several chunks (a static
 * schedule then balances). */
static inline int64_t mie_chunk_rows(int64_t N, int64_t K, int64_t esize, int nthreads)
{
    int64_t rows = (64 * 1024) / (K * esize > 0 ? K * esize : 1);
    int64_t balance = (N + 4 * (int64_t)nthreads - 1) / (4 * (int64_t)nthreads);
    if (rows > balance) rows = balance;
    rows = (rows + 11) / 12 * 12;
    return rows < 12 ? 12 : rows;
}

/* out (M, N), row stride ldo = x (M, K) @ w (N, K).T over nthreads OpenMP threads. */
static void mie_gemm(int isa, int fmt, const float *x, int64_t ldx, int64_t M, const void *w,
                     int64_t ldw, const float *s, int64_t lds, int64_t N, int64_t K, float *out,
                     int64_t ldo, int nthreads)
{
    const mie_gemm_fn gemm = mie_isas[isa].gemm;
    const int64_t esize = fmt == MIE_I8 ? 1 : 2;
    const int64_t chunk = mie_chunk_rows(N, K, esize, nthreads);
    const int64_t nchunks = (N + chunk - 1) / chunk;
    /* below ~256 KiB of weight bytes times rows, waking threads costs more than it saves */
    const int parallel = nthreads > 1 && nchunks > 1 && M * N * K * esize > (256 << 10);
    int64_t c;
    (void)parallel;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (parallel)
    for (c = 0; c < nchunks; c++) {
        const int64_t n_end = (c + 1) * chunk < N ? (c + 1) * chunk : N;
        gemm(fmt, x, ldx, M, w, ldw, s, lds, K, out, ldo, c * chunk, n_end);
    }
}

/* dst (n_end - n_begin, K), row stride ldd = float32 values of weight rows [n_begin, n_end). */
static void mie_widen(int isa, int fmt, const void *w, int64_t ldw, const float *s, int64_t lds,
                      int64_t K, float *dst, int64_t ldd, int64_t n_begin, int64_t n_end,
                      int nthreads)
{
    const mie_widen_fn widen = mie_isas[isa].widen;
    const int64_t rows = n_end - n_begin;
    const int64_t per = rows < 16 ? 16 : (rows + 4 * nthreads - 1) / (4 * nthreads);
    const int64_t nchunks = (rows + per - 1) / per;
    const int parallel = nthreads > 1 && nchunks > 1 && rows * K > (64 << 10);
    int64_t c;
    (void)parallel;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (parallel)
    for (c = 0; c < nchunks; c++) {
        const int64_t b = n_begin + c * per;
        const int64_t e = b + per < n_end ? b + per : n_end;
        widen(fmt, w, ldw, s, lds, K, dst + (b - n_begin) * ldd, ldd, b, e);
    }
}

#endif /* MIE_LINEAR_KERNELS_H */
