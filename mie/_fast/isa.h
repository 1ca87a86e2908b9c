/* isa.h: what the C kernels of mie._fast share about instruction sets -- which ones this
 * build compiles, whether the CPU runs them, exact 16-bit conversions, and the vector
 * primitives each set's kernels are written over.
 *
 * Variants: "avx512" (AVX-512 F/BW/VL/DQ + FMA), "avx2" (AVX2 + FMA + F16C) and "generic"
 * (portable C, auto-vectorized for the build's baseline: SSE2 on x86-64, NEON on arm64);
 * the matrix products add "avx512vnni" and "avx2vnni", each with VPDPBUSD (linear_kernels.h).
 * The x86 ones are compiled with GCC/Clang target attributes, so one build holds all three
 * and __builtin_cpu_supports picks at run time; on other architectures only "generic" exists.
 * Included by linear_kernels.h (mie._fast.linear) and attention_kernels.h (mie._fast.ops).
 */
#ifndef MIE_ISA_H
#define MIE_ISA_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* MIE_GENERIC_ONLY builds what a non-x86 machine gets (the tests compile the headers so). */
#if !defined(MIE_GENERIC_ONLY) && (defined(__x86_64__) || defined(__i386__)) && \
    (defined(__GNUC__) || defined(__clang__))
#define MIE_X86 1
#include <immintrin.h>
#else
#define MIE_X86 0
#endif

/* Whether this compiler knows AVX-VNNI (the "avxvnni" target and _mm256_dpbusd_avx_epi32):
 * GCC from 11, Clang from 12. An older one builds every variant but "avx2vnni". */
#if MIE_X86 && ((defined(__clang__) && __clang_major__ >= 12) || \
                (!defined(__clang__) && __GNUC__ >= 11))
#define MIE_AVXVNNI_BUILD 1
#else
#define MIE_AVXVNNI_BUILD 0
#endif

/* Whether this CPU (and its OS, which must save the wide registers) runs variant `name`. */
static inline int mie_cpu_runs(const char *name)
{
#if MIE_X86
    __builtin_cpu_init();
    if (strcmp(name, "avx512vnni") == 0)
        return mie_cpu_runs("avx512") && __builtin_cpu_supports("avx512vnni");
    if (strcmp(name, "avx512") == 0)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (strcmp(name, "avx2") == 0)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
               __builtin_cpu_supports("f16c");
#if MIE_AVXVNNI_BUILD
    if (strcmp(name, "avx2vnni") == 0)
        return mie_cpu_runs("avx2") && __builtin_cpu_supports("avxvnni");
#endif
#endif
    return strcmp(name, "generic") == 0;
}

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

/* A non-negative float rounded to the nearest IEEE half (ties to even), as a float: what
 * llama.cpp stores as an activation block's scale. Only in float16's normal range,
 * [2^-14, 65520): below, a half has fewer bits (or is 0), above it is infinite, and the
 * float is kept (mie.linear.half_rounded). Rounding drops 13 mantissa bits, with the carry
 * of a round to nearest even. */
static inline float mie_round_to_half(float x)
{
    if (!(x >= 0x1p-14f && x < 65520.0f)) return x;
    uint32_t u = mie_float_to_bits(x);
    u += 0xfffu + ((u >> 13) & 1u);
    return mie_bits_to_float(u & ~0x1fffu);
}

/* ---- "generic": portable C over 4-float vectors ------------------------------------------- */
/* GCC/Clang vector extensions, 16 bytes: the baseline SIMD width everywhere (SSE2 on x86-64,
 * NEON on arm64; wider ones would change the calling convention); other compilers get plain
 * 4-float loops. */

#define MIE_G static inline __attribute__((always_inline))
#if defined(__GNUC__) || defined(__clang__)
#define MIE_VECTOR_EXTENSIONS 1
typedef float mie_gv __attribute__((vector_size(16)));
typedef uint32_t mie_u32x4 __attribute__((vector_size(16)));
typedef int32_t mie_i32x4 __attribute__((vector_size(16)));
typedef uint16_t mie_u16x4 __attribute__((vector_size(8)));

MIE_G mie_gv mie_g_zero(void) { return (mie_gv){0, 0, 0, 0}; }
MIE_G mie_gv mie_g_set1(float f) { return (mie_gv){f, f, f, f}; }
MIE_G mie_gv mie_g_mul(mie_gv a, mie_gv b) { return a * b; }
MIE_G mie_gv mie_g_add(mie_gv a, mie_gv b) { return a + b; }
MIE_G mie_gv mie_g_div(mie_gv a, mie_gv b) { return a / b; }
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
#else
#define MIE_VECTOR_EXTENSIONS 0
typedef struct { float v[4]; } mie_gv;
#define MIE_GV_LOOP(expr) { mie_gv r; for (int l = 0; l < 4; l++) r.v[l] = (expr); return r; }
MIE_G mie_gv mie_g_zero(void) MIE_GV_LOOP(0.0f)
MIE_G mie_gv mie_g_set1(float f) MIE_GV_LOOP(f)
MIE_G mie_gv mie_g_mul(mie_gv a, mie_gv b) MIE_GV_LOOP(a.v[l] * b.v[l])
MIE_G mie_gv mie_g_add(mie_gv a, mie_gv b) MIE_GV_LOOP(a.v[l] + b.v[l])
MIE_G mie_gv mie_g_div(mie_gv a, mie_gv b) MIE_GV_LOOP(a.v[l] / b.v[l])
MIE_G mie_gv mie_g_fma(mie_gv a, mie_gv b, mie_gv c) MIE_GV_LOOP(c.v[l] + a.v[l] * b.v[l])
MIE_G mie_gv mie_g_loadx(const float *p) MIE_GV_LOOP(p[l])
MIE_G void mie_g_storex(float *p, mie_gv a) { memcpy(p, a.v, sizeof a.v); }
MIE_G float mie_g_hsum(mie_gv a) { return (a.v[0] + a.v[2]) + (a.v[1] + a.v[3]); }
MIE_G mie_gv mie_g_load_bf16(const uint16_t *p) MIE_GV_LOOP(mie_bf16_to_float(p[l]))
MIE_G mie_gv mie_g_load_f16(const uint16_t *p) MIE_GV_LOOP(mie_f16_to_float(p[l]))
#undef MIE_GV_LOOP
#endif
/* 8 bfloat16 values -> the 4 at even offsets (even) and the 4 at odd ones (odd), as floats:
 * the avx2 / avx512 variants' shift and mask, here element by element. */
MIE_G void mie_g_load_bf16_pair(const uint16_t *p, mie_gv *even, mie_gv *odd)
{
    const uint16_t e[4] = {p[0], p[2], p[4], p[6]}, o[4] = {p[1], p[3], p[5], p[7]};
    *even = mie_g_load_bf16(e);
    *odd = mie_g_load_bf16(o);
}
#undef MIE_G

#if MIE_X86
/* ---- "avx2": 8 floats per vector, 16 registers --------------------------------------------- */

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
/* 16 bfloat16 values -> the 8 at even offsets and the 8 at odd ones, as floats, in two
 * instructions: each 32-bit lane holds an even value in its low half and the next, odd one
 * in its high half (x86 is little-endian), so a shift left by 16 makes the even one a float
 * and clearing the low half leaves the odd one. Widening in order takes a shuffle and a
 * shift per 8. */
static inline __attribute__((always_inline)) MIE_AVX2 void
mie_avx2_load_bf16_pair(const uint16_t *p, __m256 *even, __m256 *odd)
{
    const __m256i v = _mm256_loadu_si256((const __m256i *)p);
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    *odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
}
static inline __attribute__((always_inline)) MIE_AVX2 __m256 mie_avx2_load_f16(const uint16_t *p)
{
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* ---- "avx512": 16 floats per vector, 32 registers ------------------------------------------ */

#define MIE_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))

static inline __attribute__((always_inline)) MIE_AVX512 __m512 mie_avx512_load_bf16(const uint16_t *p)
{
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
/* 32 bfloat16 values -> the 16 at even offsets and the 16 at odd ones (mie_avx2_load_bf16_pair) */
static inline __attribute__((always_inline)) MIE_AVX512 void
mie_avx512_load_bf16_pair(const uint16_t *p, __m512 *even, __m512 *odd)
{
    const __m512i v = _mm512_loadu_si512(p);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));
}
/* Two 256-bit conversions, not one 512-bit VCVTPH2PS: on AMD Zen 4 the wide one streamed
 * float16 weights from memory at 19 GB/s on one core against 29.5 GB/s for the 256-bit one
 * (bfloat16's shifts: 28 GB/s), and 33.5 against 44 GB/s on two. */
static inline __attribute__((always_inline)) MIE_AVX512 __m512 mie_avx512_load_f16(const uint16_t *p)
{
    const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)));
    return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}
static inline __attribute__((always_inline)) MIE_AVX512 float mie_avx512_hsum(__m512 v)
{
    return _mm512_reduce_add_ps(v);
}
#endif /* MIE_X86 */

/* OpenMP, where the build has it (setup.py adds -fopenmp when the compiler takes it). */
static inline int mie_openmp(void)
{
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* Threads a parallel region gets: OpenMP's limit (OMP_NUM_THREADS), 1 without OpenMP. */
static inline int mie_max_threads(void)
{
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

/* Run the parallel regions the calling thread opens from now on with n threads (at least
 * 1): what mie_max_threads returns next. No-op without OpenMP. */
static inline void mie_set_threads(int n)
{
#ifdef _OPENMP
    omp_set_num_threads(n > 0 ? n : 1);
#else
    (void)n;
#endif
}

/* The calling thread's number in its parallel region (0 outside one, or without OpenMP). */
static inline int mie_thread(void)
{
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

#endif /* MIE_ISA_H */
