/* linear_kernels.h: float32 activations x bfloat16 / float16 / int8 / int4 weights ->
 * float32, with one variant per instruction set, chosen at run time.
 *
 * The spec is mie/linear.py (layouts and formats are described there): the weight is (N, K)
 * row-major, one output channel per row; out[m, n] = sum_k x[m, k] * w[n, k], accumulated
 * in float32. int8 weights carry one float32 scale per MIE_GROUP inputs of a row; int4
 * weights (llama.cpp's Q4_0) are K / 2 bytes a row, each block of MIE_GROUP inputs 16 bytes
 * (input j in the low nibble of byte j, input j + 16 in its high nibble, value nibble - 8),
 * with one float16 scale. Row strides (ldw, lds) count elements of the stored arrays: bytes
 * for int8 and int4, 16-bit units for bfloat16, float16 and int4 scales, floats for int8
 * scales.
 *
 * Variants: "avx512", "avx2" and "generic", as isa.h describes (it holds the CPU check, the
 * exact 16-bit conversions and the vector primitives shared with the attention kernels).
 * Each variant's kernels are the same source (linear_body.h) over a few vector primitives.
 */
#ifndef MIE_LINEAR_KERNELS_H
#define MIE_LINEAR_KERNELS_H

#include "isa.h"

#define MIE_GROUP 32
#define MIE_I4_BLOCK_BYTES (MIE_GROUP / 2)
enum { MIE_BF16 = 0, MIE_F16 = 1, MIE_I8 = 2, MIE_I4 = 3 };

/* Bytes of one stored weight element (int4: one byte holds two weights) and of one scale. */
static inline int64_t mie_weight_esize(const int fmt) { return fmt >= MIE_I8 ? 1 : 2; }
static inline int64_t mie_scale_esize(const int fmt) { return fmt == MIE_I8 ? 4 : 2; }

/* Element `offset` of an array of `esize`-byte elements; NULL stays NULL (no scales). */
static inline const void *mie_row(const void *a, int64_t offset, int64_t esize)
{
    return a ? (const void *)((const char *)a + offset * esize) : NULL;
}

/* The scale of group g of a row: float32 for int8, float16 for int4. */
static inline float mie_scale(const int fmt, const void *s, int64_t g)
{
    if (fmt == MIE_I4) return mie_f16_to_float(((const uint16_t *)s)[g]);
    return ((const float *)s)[g];
}

/* The byte of an int4 row that holds input k (in its low nibble if k % 32 < 16). */
static inline const uint8_t *mie_i4_bytes(const void *w, int64_t k)
{
    return (const uint8_t *)w + k / MIE_GROUP * MIE_I4_BLOCK_BYTES + k % MIE_I4_BLOCK_BYTES;
}

static inline float mie_scalar_w(const int fmt, const void *w, const void *s, int64_t k)
{
    if (fmt == MIE_BF16) return mie_bf16_to_float(((const uint16_t *)w)[k]);
    if (fmt == MIE_F16) return mie_f16_to_float(((const uint16_t *)w)[k]);
    if (fmt == MIE_I4) {
        const uint8_t byte = *mie_i4_bytes(w, k);
        const int code = k % MIE_GROUP >= MIE_I4_BLOCK_BYTES ? byte >> 4 : byte & 0x0F;
        return (float)(code - 8) * mie_scale(fmt, s, k / MIE_GROUP);
    }
    return (float)((const int8_t *)w)[k] * mie_scale(fmt, s, k / MIE_GROUP);
}

/* int8 and int4 loads (the other primitives are isa.h's) */
#if MIE_VECTOR_EXTENSIONS
typedef int8_t mie_i8x4 __attribute__((vector_size(4)));
typedef uint8_t mie_u8x4 __attribute__((vector_size(4)));
static inline __attribute__((always_inline)) mie_gv mie_g_load_i8(const int8_t *p)
{
    mie_i8x4 q;
    memcpy(&q, p, sizeof q);
    return __builtin_convertvector(q, mie_gv);
}
static inline __attribute__((always_inline)) mie_gv mie_g_load_i4(const uint8_t *p, int high)
{
    mie_u8x4 b;
    memcpy(&b, p, sizeof b);
    const mie_i32x4 nibbles = __builtin_convertvector((b >> (high ? 4 : 0)) & 0x0F, mie_i32x4);
    return __builtin_convertvector(nibbles - 8, mie_gv);
}
#else
static inline __attribute__((always_inline)) mie_gv mie_g_load_i8(const int8_t *p)
{
    mie_gv r;
    for (int l = 0; l < 4; l++) r.v[l] = (float)p[l];
    return r;
}
static inline __attribute__((always_inline)) mie_gv mie_g_load_i4(const uint8_t *p, int high)
{
    mie_gv r;
    for (int l = 0; l < 4; l++) r.v[l] = (float)(((high ? p[l] >> 4 : p[l]) & 0x0F) - 8);
    return r;
}
#endif

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
#define v_load_i4 mie_g_load_i4
#define s_f16 mie_f16_to_float
#include "linear_body.h"

#if MIE_X86
/* ---- "avx2": 8 floats per vector, 16 registers --------------------------------------------- */
/* Register tile 4 x 3: 12 accumulators in 16 registers; the compiler keeps some activation
 * vectors as memory operands of the FMAs. Measured on one core against 4 x 2, 6 x 2 and
 * 3 x 4 (M = 8 / 32, K = 896, N = 4864): 4 x 3 was the fastest, 1.6x / 1.1x float32 BLAS
 * where 4 x 2 was 0.85x / 0.87x. */

static inline __attribute__((always_inline)) MIE_AVX2 __m256 mie_avx2_load_i8(const int8_t *p)
{
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline __attribute__((always_inline)) MIE_AVX2 __m256 mie_avx2_load_i4(const uint8_t *p,
                                                                               int high)
{
    /* bytes zero-extended: the high nibble is a shift, the low one a mask */
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    b = high ? _mm256_srli_epi32(b, 4) : _mm256_and_si256(b, _mm256_set1_epi32(0x0F));
    return _mm256_cvtepi32_ps(_mm256_sub_epi32(b, _mm256_set1_epi32(8)));
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
#define v_load_i4 mie_avx2_load_i4
#define s_f16 _cvtsh_ss
#include "linear_body.h"

/* ---- "avx512": 16 floats per vector, 32 registers ------------------------------------------ */
/* Register tile 4 x 4 (16 accumulators, 4 activation vectors, 1 weight vector: 21 of 32). */

static inline __attribute__((always_inline)) MIE_AVX512 __m512 mie_avx512_load_i8(const int8_t *p)
{
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline __attribute__((always_inline)) MIE_AVX512 __m512
mie_avx512_load_i4(const uint8_t *p, int high)
{
    /* A table lookup turns a nibble into its float value: vpermps reads only the low 4 bits
     * of each index, so the low nibble needs no mask, and a 16-float table (one register)
     * replaces the mask, the subtraction and the conversion. */
    const __m512 values = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    if (high) b = _mm512_srli_epi32(b, 4);
    return _mm512_permutexvar_ps(b, values);
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
#define v_load_i4 mie_avx512_load_i4
#define s_f16 _cvtsh_ss
#include "linear_body.h"
#endif /* MIE_X86 */

/* ---- dispatch ------------------------------------------------------------------------------ */

typedef void (*mie_gemm_fn)(int fmt, const float *x, int64_t ldx, int64_t M, const void *w,
                            int64_t ldw, const void *s, int64_t lds, int64_t K, float *out,
                            int64_t ldo, int64_t n_begin, int64_t n_end);
typedef void (*mie_widen_fn)(int fmt, const void *w, int64_t ldw, const void *s, int64_t lds,
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
static inline int mie_isa_supported(int i) { return mie_cpu_runs(mie_isas[i].name); }

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
                     int64_t ldw, const void *s, int64_t lds, int64_t N, int64_t K, float *out,
                     int64_t ldo, int nthreads)
{
    const mie_gemm_fn gemm = mie_isas[isa].gemm;
    const int64_t esize = mie_weight_esize(fmt); /* int4: overstated 2x, chunks of ~32 KiB */
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
static void mie_widen(int isa, int fmt, const void *w, int64_t ldw, const void *s, int64_t lds,
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
