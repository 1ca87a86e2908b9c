/* attention_kernels.h: paged attention over a float32 / float16 / bfloat16 KV cache, one
 * variant per instruction set chosen at run time, the KV write, and the MLP's SwiGLU (which
 * shares the attention's vector exponential).
 *
 * The spec is mie/ops.py (paged_attention, prefill_attention, reshape_and_cache, swiglu; the
 * cache layout and the rounding of 16-bit writes are described there). Queries, outputs and all
 * arithmetic are float32; 16-bit cache values are widened in registers (exact).
 *
 * Variants: "avx512", "avx2" and "generic", as isa.h describes; each variant's kernel is the
 * same source (attention_body.h) over a few vector primitives. The parallel drivers (one
 * OpenMP task per query row and KV head) and the KV write are shared by all variants.
 */
#ifndef MIE_ATTENTION_KERNELS_H
#define MIE_ATTENTION_KERNELS_H

#include <math.h>

#include "isa.h"

enum { MIE_KV_F32 = 0, MIE_KV_F16 = 1, MIE_KV_BF16 = 2 };
enum { MIE_ROWS = 4 };       /* K/V rows a kernel handles together */
enum { MIE_MAX_VW = 16 };    /* the widest variant's floats per vector */

/* A cache view: element (block, offset, kv_head, d) is at
 * data + (block * s_block + offset * s_offset + kv_head * s_head + d * s_dim) * element size;
 * strides in elements (NumPy's are in bytes), any sign. */
typedef struct {
    char *data;
    int64_t s_block, s_offset, s_head, s_dim;
} mie_kv_cache;

/* ---- shared by every variant --------------------------------------------------------------- */

static inline float mie_kv_scalar(const int fmt, const void *p, int64_t d)
{
    if (fmt == MIE_KV_BF16) return mie_bf16_to_float(((const uint16_t *)p)[d]);
    if (fmt == MIE_KV_F16) return mie_f16_to_float(((const uint16_t *)p)[d]);
    return ((const float *)p)[d];
}

/* n floats rounded up to whole vectors of the widest variant: the pitch of a task's rows
 * that are read and written a vector at a time.
 * - scores, one row per query head, n = block_size: the softmax pass runs over whole vectors
 *   (-inf past the block's filled slots);
 * - scaled queries and acc, one row per query head, n = head_dim, zeros past it: a head_dim's
 *   last partial vector is read and written whole -- acc's, rewritten every four V rows, as an unmasked
 *   store that the next load takes straight from the store buffer (after a masked store, the
 *   masked load of it held 17% of stories260K's attention samples at head_dim 8). */
static inline int64_t mie_vector_pitch(int64_t n)
{
    return (n + MIE_MAX_VW - 1) / MIE_MAX_VW * MIE_MAX_VW;
}

/* Floats of per-thread scratch one task needs: scaled queries and acc (group x
 * mie_vector_pitch(dim) each), scores (group x mie_vector_pitch(block_size)), m and l (group
 * each), MIE_ROWS widened K rows, and 2 x MIE_ROWS rows of up to 4-byte elements for caches
 * whose head_dim axis is strided. */
static inline int64_t mie_attention_scratch_floats(int64_t group, int64_t block_size, int64_t dim)
{
    return 2 * group * mie_vector_pitch(dim) + group * mie_vector_pitch(block_size) + 2 * group
           + 3 * MIE_ROWS * dim;
}

/* Row (block, offset, kv_head) as dim contiguous elements: in place, or copied to buffer. */
static inline const void *mie_kv_row(const mie_kv_cache *c, int64_t esize, int64_t block,
                                     int64_t offset, int64_t kv_head, int64_t dim, char *buffer)
{
    const char *row = c->data + (block * c->s_block + offset * c->s_offset + kv_head * c->s_head) * esize;
    if (c->s_dim == 1) return row;
    for (int64_t d = 0; d < dim; d++) memcpy(buffer + d * esize, row + d * c->s_dim * esize, (size_t)esize);
    return buffer;
}

/* A hint to start loading p's cache line now (GCC and Clang; a no-op elsewhere). */
#if defined(__GNUC__) || defined(__clang__)
#define mie_prefetch(p) __builtin_prefetch(p)
#else
#define mie_prefetch(p) ((void)(p))
#endif

/* Ask for every cache line of rows first .. first + count - 1 of `block` (for kv_head). A
 * task computes too little per row for out-of-order execution to keep many misses in
 * flight: without this the kernel waits on memory at a fraction of its bandwidth. */
static inline void mie_prefetch_rows(const mie_kv_cache *c, int64_t esize, int64_t block,
                                     int64_t first, int64_t count, int64_t kv_head, int64_t dim)
{
    int64_t span = dim * c->s_dim * esize;
    for (int64_t t = first; t < first + count; t++) {
        const char *row = c->data + (block * c->s_block + t * c->s_offset + kv_head * c->s_head) * esize;
        if (span >= 0)
            for (int64_t b = 0; b < span; b += 64) mie_prefetch(row + b);
        else
            for (int64_t b = 0; b > span; b -= 64) mie_prefetch(row + b);
    }
}

/* exp(x) for x <= 0, in plain arithmetic. Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2, a
 * degree-7 polynomial for exp(r), and 2^n built in the exponent bits; about 1 ulp. Inputs
 * below -87 (including -inf) give 0 (exp(-87) ~ 1.6e-38 is 0 next to any weight >= 1: every
 * block's largest weight is exp(0) = 1), NaN gives NaN. The vector variants compute the same
 * steps. */
#define MIE_EXP_LOG2E 1.44269504088896341f
#define MIE_EXP_C1 0.693359375f
#define MIE_EXP_C2 -2.12194440e-4f
#define MIE_EXP_P0 1.9875691500e-4f
#define MIE_EXP_P1 1.3981999507e-3f
#define MIE_EXP_P2 8.3334519073e-3f
#define MIE_EXP_P3 4.1665795894e-2f
#define MIE_EXP_P4 1.6666665459e-1f
#define MIE_EXP_P5 5.0000001201e-1f

static inline float mie_exp_nonpositive(float x)
{
    const float c = x < -87.0f ? -87.0f : x; /* selects, not branches: the lanes vectorize */
    const int n = (int)(c * MIE_EXP_LOG2E - 0.5f); /* round(c / ln2): truncation, c <= 0 */
    const float r = c - (float)n * MIE_EXP_C1 - (float)n * MIE_EXP_C2;
    float y = MIE_EXP_P0;
    y = y * r + MIE_EXP_P1;
    y = y * r + MIE_EXP_P2;
    y = y * r + MIE_EXP_P3;
    y = y * r + MIE_EXP_P4;
    y = y * r + MIE_EXP_P5;
    y = y * r * r + r + 1.0f;
    y *= mie_bits_to_float((uint32_t)(n + 127) << 23);
    return x < -87.0f ? 0.0f : y;
}

/* ---- "generic" ----------------------------------------------------------------------------- */

#define MIE_G static inline __attribute__((always_inline))
MIE_G mie_gv mie_g_sub(mie_gv a, mie_gv b) { return mie_g_add(a, mie_g_mul(b, mie_g_set1(-1.0f))); }
MIE_G void mie_g_hsum4(mie_gv a, mie_gv b, mie_gv c, mie_gv d, float *out)
{
    out[0] = mie_g_hsum(a);
    out[1] = mie_g_hsum(b);
    out[2] = mie_g_hsum(c);
    out[3] = mie_g_hsum(d);
}
MIE_G mie_gv mie_g_max(mie_gv a, mie_gv b)
{
    float x[4], y[4];
    mie_g_storex(x, a);
    mie_g_storex(y, b);
    for (int l = 0; l < 4; l++) x[l] = x[l] > y[l] ? x[l] : y[l];
    return mie_g_loadx(x);
}
MIE_G float mie_g_hmax(mie_gv a)
{
    float x[4];
    mie_g_storex(x, a);
    const float left = x[0] > x[1] ? x[0] : x[1], right = x[2] > x[3] ? x[2] : x[3];
    return left > right ? left : right;
}
#if MIE_VECTOR_EXTENSIONS
MIE_G mie_gv mie_g_exp(mie_gv x) /* mie_exp_nonpositive, four lanes at a time */
{
    const mie_i32x4 low = x < mie_g_set1(-87.0f); /* all ones where x < -87 (not NaN) */
    const mie_gv c = (mie_gv)((low & (mie_i32x4)mie_g_set1(-87.0f)) | (~low & (mie_i32x4)x));
    const mie_i32x4 n = __builtin_convertvector(c * MIE_EXP_LOG2E - 0.5f, mie_i32x4);
    const mie_gv nf = __builtin_convertvector(n, mie_gv);
    const mie_gv r = c - nf * MIE_EXP_C1 - nf * MIE_EXP_C2;
    mie_gv y = mie_g_set1(MIE_EXP_P0);
    y = y * r + MIE_EXP_P1;
    y = y * r + MIE_EXP_P2;
    y = y * r + MIE_EXP_P3;
    y = y * r + MIE_EXP_P4;
    y = y * r + MIE_EXP_P5;
    y = y * r * r + r + 1.0f;
    y *= (mie_gv)((n + 127) << 23);
    return (mie_gv)(~low & (mie_i32x4)y);
}
#else
MIE_G mie_gv mie_g_exp(mie_gv x)
{
    float lanes[4];
    mie_g_storex(lanes, x);
    for (int l = 0; l < 4; l++) lanes[l] = mie_exp_nonpositive(lanes[l]);
    return mie_g_loadx(lanes);
}
#endif
#undef MIE_G

#define ISA_NAME(f) f##_generic
/* SSE2 widens float16 in ~10 instructions per vector: once per group (f16 6.0 -> 3.0 ms) */
#define STAGE_16_BIT 1
#define ISA_ATTR
#define VEC mie_gv
#define VW 4
#define v_zero mie_g_zero
#define v_set1 mie_g_set1
#define v_loadx mie_g_loadx
#define v_storex mie_g_storex
#define v_fma mie_g_fma
#define v_mul mie_g_mul
#define v_div mie_g_div
#define v_add mie_g_add
#define v_sub mie_g_sub
#define v_max mie_g_max
#define v_hsum mie_g_hsum
#define v_hmax mie_g_hmax
#define v_hsum4 mie_g_hsum4
#define v_exp mie_g_exp
#define v_load_bf16 mie_g_load_bf16
#define v_load_f16 mie_g_load_f16
#include "attention_body.h"

#if MIE_X86
/* ---- "avx2" -------------------------------------------------------------------------------- */

#define MIE_AI static inline __attribute__((always_inline))

/* out[0..3] = sums of a, b, c, d: two rounds of pairwise adds, then the two 128-bit halves. */
MIE_AI MIE_AVX2 void mie_avx2_hsum4(__m256 a, __m256 b, __m256 c, __m256 d, float *out)
{
    const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
    const __m256 abcd = _mm256_hadd_ps(ab, cd);
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
}

MIE_AI MIE_AVX2 float mie_avx2_hmax(__m256 v)
{
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

MIE_AI MIE_AVX2 __m256 mie_avx2_exp(__m256 x)
{
    const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_NLT_UQ); /* NaN too */
    x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x); /* max(a, NaN) is NaN */
    const __m256i n = _mm256_cvttps_epi32(
        _mm256_fmsub_ps(x, _mm256_set1_ps(MIE_EXP_LOG2E), _mm256_set1_ps(0.5f)));
    const __m256 nf = _mm256_cvtepi32_ps(n);
    const __m256 r = _mm256_fnmadd_ps(nf, _mm256_set1_ps(MIE_EXP_C2),
                                      _mm256_fnmadd_ps(nf, _mm256_set1_ps(MIE_EXP_C1), x));
    __m256 y = _mm256_set1_ps(MIE_EXP_P0);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(MIE_EXP_P1));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(MIE_EXP_P2));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(MIE_EXP_P3));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(MIE_EXP_P4));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(MIE_EXP_P5));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(two_n)), keep);
}

#define ISA_NAME(f) f##_avx2
#define STAGE_16_BIT 0
#define ISA_ATTR MIE_AVX2
#define VEC __m256
#define VW 8
#define v_zero _mm256_setzero_ps
#define v_set1 _mm256_set1_ps
#define v_loadx _mm256_loadu_ps
#define v_storex _mm256_storeu_ps
#define v_fma _mm256_fmadd_ps
#define v_mul _mm256_mul_ps
#define v_div _mm256_div_ps
#define v_add _mm256_add_ps
#define v_sub _mm256_sub_ps
#define v_max _mm256_max_ps
#define v_hsum mie_avx2_hsum
#define v_hmax mie_avx2_hmax
#define v_hsum4 mie_avx2_hsum4
#define v_exp mie_avx2_exp
#define v_load_bf16 mie_avx2_load_bf16
#define v_load_f16 mie_avx2_load_f16
#include "attention_body.h"

/* ---- "avx512" ------------------------------------------------------------------------------ */

/* Each vector folded to 256 bits, then the AVX2 way. */
MIE_AI MIE_AVX512 void mie_avx512_hsum4(__m512 a, __m512 b, __m512 c, __m512 d, float *out)
{
#define MIE_FOLD(x) _mm256_add_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1))
    mie_avx2_hsum4(MIE_FOLD(a), MIE_FOLD(b), MIE_FOLD(c), MIE_FOLD(d), out);
#undef MIE_FOLD
}

MIE_AI MIE_AVX512 __m512 mie_avx512_exp(__m512 x)
{
    const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_NLT_UQ);
    x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x); /* max(a, NaN) is NaN */
    const __m512i n = _mm512_cvttps_epi32(
        _mm512_fmsub_ps(x, _mm512_set1_ps(MIE_EXP_LOG2E), _mm512_set1_ps(0.5f)));
    const __m512 nf = _mm512_cvtepi32_ps(n);
    const __m512 r = _mm512_fnmadd_ps(nf, _mm512_set1_ps(MIE_EXP_C2),
                                      _mm512_fnmadd_ps(nf, _mm512_set1_ps(MIE_EXP_C1), x));
    __m512 y = _mm512_set1_ps(MIE_EXP_P0);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(MIE_EXP_P1));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(MIE_EXP_P2));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(MIE_EXP_P3));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(MIE_EXP_P4));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(MIE_EXP_P5));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i two_n = _mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps(keep, y, _mm512_castsi512_ps(two_n));
}
/* The first n < 16 elements at p, widened, then zeros: masked loads (the lanes past n are
 * not read, so they may lie past the cache's end). */
MIE_AI MIE_AVX512 __m512 mie_avx512_load_part(const int fmt, const void *p, int64_t n)
{
    const __mmask16 lanes = (__mmask16)((1u << n) - 1);
    if (fmt == MIE_KV_F32) return _mm512_maskz_loadu_ps(lanes, p);
    const __m256i half = _mm256_maskz_loadu_epi16(lanes, p);
    if (fmt == MIE_KV_F16) return _mm512_cvtph_ps(half);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
MIE_AI MIE_AVX512 void mie_avx512_store_part(float *p, __m512 v, int64_t n)
{
    _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), v);
}
#undef MIE_AI

#define ISA_NAME(f) f##_avx512
#define STAGE_16_BIT 0
#define ISA_ATTR MIE_AVX512
#define VEC __m512
#define VW 16
#define v_zero _mm512_setzero_ps
#define v_set1 _mm512_set1_ps
#define v_loadx _mm512_loadu_ps
#define v_storex _mm512_storeu_ps
#define v_fma _mm512_fmadd_ps
#define v_mul _mm512_mul_ps
#define v_div _mm512_div_ps
#define v_add _mm512_add_ps
#define v_sub _mm512_sub_ps
#define v_max _mm512_max_ps
#define v_hsum mie_avx512_hsum
#define v_hmax _mm512_reduce_max_ps
#define v_hsum4 mie_avx512_hsum4
#define v_exp mie_avx512_exp
#define v_load_bf16 mie_avx512_load_bf16
#define v_load_f16 mie_avx512_load_f16
#define v_load_part mie_avx512_load_part
#define v_store_part mie_avx512_store_part
#include "attention_body.h"
#endif /* MIE_X86 */

/* ---- dispatch ------------------------------------------------------------------------------ */

typedef void (*mie_attend_fn)(int fmt, const float *q, float *out, const mie_kv_cache *k,
                              const mie_kv_cache *v, const int64_t *blocks, int64_t first,
                              int64_t context_len, int64_t kv_head, int64_t group,
                              int64_t block_size, int64_t dim, float scale, float *scratch);

typedef void (*mie_swiglu_fn)(const float *gate, const float *up, float *out, int64_t n);

/* One instruction set's kernels: the attention, and the MLP's activation (which shares its
 * exponential). */
typedef struct {
    const char *name;
    int width; /* floats per vector */
    mie_attend_fn attend;
    mie_swiglu_fn swiglu;
} mie_attention_isa;

/* Best first, each narrower than the one before: the default is the first one the CPU
 * supports. */
static const mie_attention_isa mie_attention_isas[] = {
#if MIE_X86
    {"avx512", 16, attend_avx512, swiglu_avx512},
    {"avx2", 8, attend_avx2, swiglu_avx2},
#endif
    {"generic", 4, attend_generic, swiglu_generic},
};

static inline int mie_attention_isa_count(void)
{
    return (int)(sizeof mie_attention_isas / sizeof mie_attention_isas[0]);
}
static inline const char *mie_attention_isa_name(int i) { return mie_attention_isas[i].name; }
static inline int mie_attention_isa_supported(int i) { return mie_cpu_runs(mie_attention_isas[i].name); }

/* The variant whose kernel attends heads of dim floats when variant isa is chosen: the next
 * narrower one where its vectors fill a head exactly and isa's leave a partial vector (AVX-512
 * at a head_dim of 8 or 24 runs the AVX2 kernel; AVX2 at 4 or 12 the generic one), else isa.
 * A partial vector costs more than a narrower whole one: prefill_attention of 5 rows at a
 * context of 200 (8 query heads over 4 KV heads, a float32 cache, one thread; the 2-core AMD
 * EPYC, Zen 4; both variants in one process, alternating, 20 rounds) took AVX-512 1.18-1.22x
 * AVX2's time at a head_dim of 8 and 1.41x at 24, the same at 64 (0.99x); where both leave a
 * partial vector (4, 6, 10, 12, 13) AVX2 took 2.4-2.9x AVX-512's (it copies the part through
 * a buffer, AVX-512 masks it), and the generic kernel 0.35-0.41x AVX2's at 4 and 12 but
 * 1.02-1.25x AVX-512's at 4, 8 and 12 -- so only the next narrower variant is worth a look.
 * It runs wherever the chosen one does (every x86 CPU with AVX-512 has AVX2). */
static inline int mie_attention_isa_for(int isa, int64_t dim)
{
    const int narrower = isa + 1;
    if (dim % mie_attention_isas[isa].width == 0 || narrower >= mie_attention_isa_count())
        return isa;
    return dim % mie_attention_isas[narrower].width == 0 ? narrower : isa;
}

/* The least work (multiply-adds, about) mie_attention shares among its threads: below it the
 * calling thread does it all, since handing out the tasks and waiting for them costs more than
 * the work. Measured on stories260K (4 KV heads of 8 dims, 2 queries each) in the one-call
 * layer loop, 1-5 rows at contexts 64, 128 and 300, serial against parallel (the 2-core Xeon
 * VM of bench/RESULTS.md): serial was faster up to ~50,000 (a decode at 300 positions, 38,000:
 * 85 against 109 us a forward pass; 2 rows at 128, 33,000: 93 against 120), level at
 * 66,000-77,000, parallel faster from ~82,000 (5 rows at 128: 175 against 184; 3 at 300,
 * 115,000: 182 against 200). Qwen2-0.5B's decode at a context of 128 is ~230,000. */
#define MIE_ATTENTION_PARALLEL_WORK (1 << 16)

/* Attention for `rows` query rows: q and out (rows, num_kv_heads * group, dim) contiguous.
 * Row r reads the blocks at tables + r * table_stride and attends to lens[r] positions
 * (decode), or, when lens is NULL, to start + r + 1 positions (a prefill chunk: table_stride 0,
 * one block table) -- with a sliding window (window > 0; 0 is full attention) only to the
 * last `window` of them: positions max(0, len - window) .. len - 1, where len is that count.
 * Blocks before the first of them are never read (they may be -1: released). One OpenMP task
 * per (row, KV head), each on its thread's scratch
 * (nthreads x scratch_floats floats): a task's result depends on nothing else, so the output
 * is bit-identical for any thread count. */
static void mie_attention(int isa, int fmt, const float *q, float *out, mie_kv_cache k,
                          mie_kv_cache v, const int64_t *tables, int64_t table_stride,
                          const int64_t *lens, int64_t start, int64_t window, int64_t rows,
                          int64_t num_kv_heads, int64_t group, int64_t block_size, int64_t dim,
                          float scale, float *scratch, int64_t scratch_floats, int nthreads)
{
    const mie_attend_fn attend = mie_attention_isas[mie_attention_isa_for(isa, dim)].attend;
    const int64_t tasks = rows * num_kv_heads, head_floats = group * dim;
    int64_t task, positions = 0;
    for (int64_t row = 0; row < rows; row++) {
        const int64_t len = lens ? lens[row] : start + row + 1;
        positions += window > 0 && len > window ? window : len;
    }
    /* multiply-adds, about: each position's K row meets group queries, its V row group rows */
    const int64_t work = positions * num_kv_heads * dim * 2 * group;
    (void)nthreads;
    (void)work;
#pragma omp parallel for schedule(dynamic) num_threads(nthreads) if (nthreads > 1 && work >= MIE_ATTENTION_PARALLEL_WORK)
    for (task = 0; task < tasks; task++) {
        const int64_t row = task / num_kv_heads, kv_head = task % num_kv_heads;
        const int64_t offset = (row * num_kv_heads + kv_head) * head_floats;
        const int64_t len = lens ? lens[row] : start + row + 1;
        const int64_t first = window > 0 && len > window ? len - window : 0;
        attend(fmt, q + offset, out + offset, &k, &v, tables + row * table_stride, first, len,
               kv_head, group, block_size, dim, scale, scratch + mie_thread() * scratch_floats);
    }
}

/* out[i] = silu(gate[i]) * up[i] for i < n, with instruction set `isa` (its swiglu). */
static inline void mie_swiglu(int isa, const float *gate, const float *up, float *out, int64_t n)
{
    mie_attention_isas[isa].swiglu(gate, up, out, n);
}

/* ---- the KV write -------------------------------------------------------------------------- */

/* float -> IEEE half, rounded to nearest, ties to even, as NumPy's cast -- except that a finite
 * value beyond the largest half (65504) saturates to it instead of becoming infinite (see
 * mie/ops.py). NaN as NumPy: the top 10 bits of the payload, kept non-zero. Integer arithmetic
 * only, so no floating-point flag or compiler reassociation can change it. */
static inline uint16_t mie_float_to_f16(float f)
{
    const uint32_t u = mie_float_to_bits(f), a = u & 0x7fffffffu;
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    if (a > 0x7f800000u) { /* NaN */
        uint16_t h = (uint16_t)(0x7c00u | ((a >> 13) & 0x3ffu));
        return (uint16_t)(sign | (h == 0x7c00u ? 0x7c01u : h));
    }
    if (a == 0x7f800000u) return (uint16_t)(sign | 0x7c00u);
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7bffu); /* rounds to 65520 or more */
    if (a >= 0x38800000u) { /* a normal half: rebias the exponent, round off 13 bits */
        uint32_t h = (a - 0x38000000u) >> 13;
        const uint32_t rest = a & 0x1fffu;
        if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++;
        return (uint16_t)(sign | h);
    }
    const uint32_t e = a >> 23; /* a subnormal half (or 0): units of 2^-24 */
    if (e < 102) return sign; /* below 2^-25: rounds to 0 (2^-25 itself ties to even 0) */
    const uint32_t mant = (a & 0x7fffffu) | 0x800000u, shift = 126 - e; /* 14 .. 24 */
    uint32_t h = mant >> shift;
    const uint32_t rest = mant & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rest > half || (rest == half && (h & 1u))) h++;
    return (uint16_t)(sign | h);
}

/* float -> bfloat16, rounded to nearest, ties to even, as ml_dtypes -- except that a finite
 * value that would round to infinity saturates to the largest bfloat16. NaN as ml_dtypes:
 * the quiet NaN 0x7fc0 with the sign. */
static inline uint16_t mie_float_to_bf16(float f)
{
    const uint32_t u = mie_float_to_bits(f), a = u & 0x7fffffffu;
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7fc0u);
    if (a == 0x7f800000u) return (uint16_t)(sign | 0x7f80u);
    const uint32_t h = (a + 0x7fffu + ((a >> 16) & 1u)) >> 16;
    return (uint16_t)(sign | (h == 0x7f80u ? 0x7f7fu : h));
}

/* cache[slot] = src[i] for each token i (src: (tokens, num_kv_heads, dim) contiguous float32),
 * converted to the cache's format. A repeated slot keeps the last write. */
static void mie_cache_write(int fmt, const float *src, mie_kv_cache c, const int64_t *slots,
                            int64_t tokens, int64_t num_kv_heads, int64_t dim, int64_t block_size)
{
    const int64_t esize = fmt == MIE_KV_F32 ? 4 : 2;
    for (int64_t i = 0; i < tokens; i++)
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const int64_t block = slots[i] / block_size, offset = slots[i] % block_size;
            char *row = c.data + (block * c.s_block + offset * c.s_offset + h * c.s_head) * esize;
            const float *x = src + (i * num_kv_heads + h) * dim;
            for (int64_t d = 0; d < dim; d++) {
                char *dst = row + d * c.s_dim * esize;
                if (fmt == MIE_KV_F32) {
                    memcpy(dst, x + d, 4);
                } else {
                    const uint16_t bits = fmt == MIE_KV_F16 ? mie_float_to_f16(x[d])
                                                            : mie_float_to_bf16(x[d]);
                    memcpy(dst, &bits, 2);
                }
            }
        }
}

#endif /* MIE_ATTENTION_KERNELS_H */
