/* linear_kernels.h: float32 activations x bfloat16 / float16 / int8 / int4 / int6 weights (and
 * bfloat16, int8, int4 and int6 with 16 rows interleaved) -> float32, with one variant per
 * instruction set, chosen at run time.
 *
 * The spec is mie/linear.py (layouts and formats are described there): the weight is (N, K)
 * row-major, one output channel per row; out[m, n] = sum_k x[m, k] * w[n, k], accumulated
 * in float32. int8 weights (llama.cpp's Q8_0) carry one float16 scale per MIE_GROUP inputs
 * of a row; int4 weights (llama.cpp's Q4_0) are K / 2 bytes a row, each block of MIE_GROUP
 * inputs 16 bytes (input j in the low nibble of byte j, input j + 16 in its high nibble,
 * value nibble - 8), with one float16 scale; int6 weights (mie's own, the embedding of int4
 * models) are 48 bytes per pair of blocks (64 inputs): the two blocks' low nibbles packed as
 * int4's, then 16 bytes of their top 2 bits (mie_i6_value), value code - 32, a float16 scale
 * per block; int4x16, int8x16 and int6x16 weights are int4's, int8's and int6's codes and
 * scales with 16 rows interleaved (mie.linear.group_rows): an element of 256, 512 or 384 bytes
 * per block of 16 rows, its 16 scales beside each other; bfloat16x16 weights are bfloat16's 16
 * rows interleaved, 1024 bytes per block of 32 inputs of 16 rows (64 bytes per pair of inputs,
 * a row's pair a 32-bit lane), no scales. Row strides (ldw, lds) count elements
 * of the stored arrays: bytes for int8 and int4, pairs of blocks for int6, blocks of 16 rows
 * for the row-grouped formats (from one group of rows to the next), 16-bit units for bfloat16,
 * float16 and the scales.
 *
 * With quantized weights (int8, int4, int6 and the row-grouped three) the rows of x are first
 * rounded to int8 blocks of MIE_GROUP
 * (mie.linear.quantize_activation: quantize_row in linear_body.h), and the kernels multiply
 * bytes by bytes: see "integer dot products" below.
 *
 * Variants: "avx512vnni", "avx512", "avx2vnni", "avx2" and "generic", as isa.h describes (it
 * holds the CPU check, the exact 16-bit conversions and the vector primitives shared with the
 * attention kernels; "avx512vnni" and "avx2vnni" are "avx512" and "avx2" with VPDPBUSD for
 * the integer dot products). Each variant's kernels are the same source (linear_body.h) over
 * a few vector primitives.
 */
#ifndef MIE_LINEAR_KERNELS_H
#define MIE_LINEAR_KERNELS_H

#include <float.h>
#include <math.h>
#include <stdlib.h>

#include "isa.h"

#define MIE_GROUP 32
/* linear_body.h's gemm_stream: at most this many rows of x, of at most this many floats in
 * all (20 KB: they stay in a 32 KB L1 beside the weight stream). */
#define MIE_STREAM_ROWS 5
#define MIE_STREAM_FLOATS 5120
/* linear_body.h's gemm_decoded: from this many rows of x in the register tiles, a 16-bit row
 * format's chunk is widened to float32 once instead of in every tile. */
#define MIE_WIDEN_ROWS 20
#define MIE_I4_BLOCK_BYTES (MIE_GROUP / 2)
#define MIE_I6_PAIR_BYTES 48
/* int4x16, int8x16, int6x16, bfloat16x16 (mie.linear): one element is a block of MIE_GROUP
 * inputs of MIE_GROUP_ROWS rows; int6x16's is int4x16's nibbles, then their top bits
 * from byte MIE_I4X16_BYTES on. */
#define MIE_GROUP_ROWS 16
#define MIE_I4X16_BYTES (MIE_GROUP_ROWS * MIE_I4_BLOCK_BYTES)
#define MIE_I8X16_BYTES (MIE_GROUP_ROWS * MIE_GROUP)
#define MIE_I6X16_BYTES (MIE_GROUP_ROWS * 24)
#define MIE_BF16X16_BYTES (MIE_GROUP_ROWS * MIE_GROUP * 2)
/* The quantized formats are MIE_I8 and those after it (their rows of x rounded to int8). */
enum {
    MIE_F32 = 0,
    MIE_BF16 = 1,
    MIE_F16 = 2,
    MIE_BF16X16 = 3,
    MIE_I8 = 4,
    MIE_I4 = 5,
    MIE_I6 = 6,
    MIE_I4X16 = 7,
    MIE_I8X16 = 8,
    MIE_I6X16 = 9
};

/* Whether fmt keeps 16 rows interleaved (linear_body.h's gemm_x16 and gemm_bf16x16 multiply
 * them). */
static inline int mie_row_grouped(const int fmt)
{
    return fmt == MIE_I4X16 || fmt == MIE_I8X16 || fmt == MIE_I6X16 || fmt == MIE_BF16X16;
}

/* Whether M rows of x go over a 16/32-bit weight by linear_body.h's gemm_stream (a few short
 * rows); otherwise by register tiles, and the rows they leave over one by one. */
static inline int mie_streams(const int fmt, int64_t M, int64_t K)
{
    return fmt < MIE_I8 && !mie_row_grouped(fmt) && M >= 2 && M <= MIE_STREAM_ROWS
           && M * K <= MIE_STREAM_FLOATS;
}

/* Bytes of one stored weight element (int4: one byte holds two weights; int6: an element is
 * a pair of blocks; the row-grouped formats: a block of 16 rows) and of one scale (a float16,
 * every quantized format's alike). */
static inline int64_t mie_weight_esize(const int fmt)
{
    return fmt == MIE_F32     ? 4
           : fmt == MIE_I6    ? MIE_I6_PAIR_BYTES
           : fmt == MIE_I4X16 ? MIE_I4X16_BYTES
           : fmt == MIE_I8X16 ? MIE_I8X16_BYTES
           : fmt == MIE_I6X16 ? MIE_I6X16_BYTES
           : fmt == MIE_BF16X16 ? MIE_BF16X16_BYTES
           : fmt >= MIE_I8    ? 1
                              : 2;
}
#define MIE_SCALE_ESIZE 2

/* Element `offset` of an array of `esize`-byte elements; NULL stays NULL (no scales). */
static inline const void *mie_row(const void *a, int64_t offset, int64_t esize)
{
    return a ? (const void *)((const char *)a + offset * esize) : NULL;
}

/* Software prefetch for the batch-1 rows (dot_row and its kin in linear_body.h): a step that
 * reads `bytes` weight bytes from p also asks for the cache lines MIE_PREFETCH_AHEAD bytes
 * further on, into L2 (locality 2: PREFETCHT1 on x86), so that more of the stream is in flight
 * than the hardware prefetcher keeps. Measured on the Intel Xeon VM, 2 threads: a float32 row
 * loop over Qwen2-0.5B's gate/up rows out of cache streamed 30.2-30.5 GB/s with the hardware
 * prefetcher alone, 32.3-33.3 with 1 KiB ahead into L1 (locality 3), 32.4-33.2 with 2 KiB,
 * 27 with 4 KiB (lines evicted before use), where a plain read of the same bytes took 29-30;
 * and the whole batch-1 step of the Qwen2-0.5B-shaped model (`python -m mie.bench.throughput
 * --breakdown`, two runs each) went from 70.7-73.3 to 64.1-65.9 ms in float32, 39.2-39.6 to
 * 33.4-34.6 bfloat16, 22.0-22.3 to 19.5-20.0 int8 and 15.3-16.0 to 12.8-15.3 int4. Into L2
 * instead, further ahead (the same step, one process alternating the settings each round,
 * medians of 4-8 rounds of 10 steps): 3 KiB into L2 against 2 KiB into L1, int4 11.56 against
 * 12.26 ms and 11.17 against 11.79 (faster in 8 of 8 rounds each), int8 18.27 against 18.91
 * (7 of 8), bfloat16 34.28 against 35.57 (6 of 6), float32 71.41 against 73.11 (4 of 4),
 * float16 level (33.88 against 33.63, 2 of 8); 2 KiB into L2 was between the two, 4 KiB into
 * L2 slower for int8 (20.09), 4 KiB into L1 slower for int4 (12.78). The L2 holds what is
 * in flight without the L1's evictions; the L1's own prefetcher brings each line the last
 * step in. Past the end of a thread's rows it asks for lines nobody reads: a prefetch never
 * faults. */
#define MIE_PREFETCH_AHEAD 3072
static inline __attribute__((always_inline)) void mie_prefetch(const void *p, const int64_t bytes)
{
    for (int64_t b = 0; b < bytes; b += 64)
        __builtin_prefetch((const char *)p + MIE_PREFETCH_AHEAD + b, 0, 2);
}

/* mie_prefetch for weights already in L2 (the row-grouped kernels' second and later rows of x
 * over a group, which a long row's group does not fit into L1: int8x16's at K = 4864 is 76
 * KiB): into L1, MIE_PREFETCH_NEAR_AHEAD bytes ahead. Prefetching those into L2 as well cost
 * a 128-token int8 prefill 5-10% (275 against 249-268 ms, 3 of 3 fresh-process pairs). */
#define MIE_PREFETCH_NEAR_AHEAD 2048
static inline __attribute__((always_inline)) void mie_prefetch_near(const void *p,
                                                                    const int64_t bytes)
{
    for (int64_t b = 0; b < bytes; b += 64)
        __builtin_prefetch((const char *)p + MIE_PREFETCH_NEAR_AHEAD + b, 0, 3);
}

/* The scale of group g of a row (a float16). */
static inline float mie_scale(const void *s, int64_t g)
{
    return mie_f16_to_float(((const uint16_t *)s)[g]);
}

/* The byte of an int4 row that holds input k (in its low nibble if k % 32 < 16). */
static inline const uint8_t *mie_i4_bytes(const void *w, int64_t k)
{
    const uint64_t u = (uint64_t)k; /* an offset, never negative: shifts, not signed division */
    return (const uint8_t *)w + u / MIE_GROUP * MIE_I4_BLOCK_BYTES + u % MIE_I4_BLOCK_BYTES;
}

/* The value of int4 input k, its code minus 8. */
static inline int mie_i4_value(const void *w, int64_t k)
{
    const uint8_t byte = *mie_i4_bytes(w, k);
    return (k % MIE_GROUP >= MIE_I4_BLOCK_BYTES ? byte >> 4 : byte & 0x0F) - 8;
}

/* The pair of blocks of an int6 row that holds input k: its 32 bytes of low nibbles (laid
 * out as an int4 pair's), then 16 bytes of top bits, byte p holding those of the pair's
 * inputs p, 32 + p, 16 + p and 48 + p in bits 0-1, 2-3, 4-5 and 6-7. */
static inline const uint8_t *mie_i6_pair(const void *w, int64_t k)
{
    return (const uint8_t *)w + (uint64_t)k / (2 * MIE_GROUP) * MIE_I6_PAIR_BYTES;
}

/* Where the weights of input k start in a row of fmt (int8, int4 or int6), k a multiple of the
 * format's unit (int4: a block, int6: a pair of blocks): linear_body.h's batch-1 loops walk a
 * row with this pointer. */
static inline const uint8_t *mie_quantized_at(const int fmt, const void *w, int64_t k)
{
    return fmt == MIE_I6 ? mie_i6_pair(w, k) : fmt == MIE_I4 ? mie_i4_bytes(w, k) : (const uint8_t *)w + k;
}

/* The value of int6 input k, its code minus 32. */
static inline int mie_i6_value(const void *w, int64_t k)
{
    const uint64_t u = (uint64_t)k % (2 * MIE_GROUP), block = u / MIE_GROUP, j = u % 16;
    const int high = u % MIE_GROUP >= 16; /* the block's second half: the high nibble */
    const uint8_t *pair = mie_i6_pair(w, k);
    const int nibble = (pair[block * 16 + j] >> (4 * high)) & 0x0F;
    const int top = (pair[32 + j] >> (2 * block + 4 * high)) & 3;
    return nibble + 16 * top - 32;
}

/* An int6 row of K inputs (K a multiple of 64) as int8 values, in input order. */
static inline void mie_g_i6_decode(const void *w, int64_t K, int8_t *dst)
{
    for (int64_t k = 0; k < K; k++) dst[k] = (int8_t)mie_i6_value(w, k);
}

static inline float mie_scalar_w(const int fmt, const void *w, const void *s, int64_t k)
{
    if (fmt == MIE_F32) return ((const float *)w)[k];
    if (fmt == MIE_BF16) return mie_bf16_to_float(((const uint16_t *)w)[k]);
    if (fmt == MIE_F16) return mie_f16_to_float(((const uint16_t *)w)[k]);
    if (fmt == MIE_I4) return (float)mie_i4_value(w, k) * mie_scale(s, k / MIE_GROUP);
    if (fmt == MIE_I6) return (float)mie_i6_value(w, k) * mie_scale(s, k / MIE_GROUP);
    return (float)((const int8_t *)w)[k] * mie_scale(s, k / MIE_GROUP);
}

/* ---- activations rounded to int8 blocks ---------------------------------------------------- */

/* One row of x as the integer kernels read it. */
typedef struct {
    const int8_t *q;       /* the K codes */
    const float *d;        /* one scale per block of MIE_GROUP inputs (NaN: the block was not finite) */
    const int32_t *offset; /* int4, int6 with v_q4dot: per lane, -8 times its codes' sum;
                            * the row-grouped formats: per block, its codes' sum
                            * (mie_block_sums) */
    const float *paired;   /* bfloat16: the row's K values laid out by mie_pair_bf16 */
} mie_xrow;

/* ---- bfloat16 weights at batch 1 ------------------------------------------------------------
 * linear_body.h's dot_row_bf16 widens 2 * VW bfloat16 weights a load into the VW at even
 * offsets and the VW at odd ones (v_load_bf16_pair: a shift and a mask, where widening in
 * input order takes a shuffle and a shift per VW), so the row of x it meets is laid out to
 * match, once per product: each whole block of MIE_BF16_PAIRED inputs as its even inputs,
 * then its odd ones; the inputs past the last whole block stay in order. The layout does not
 * depend on VW: a load of the 2 * VW weights from k + 2 * VW * j (k a block's start) meets
 * x's even values at k + VW * j and its odd ones at k + MIE_BF16_PAIRED / 2 + VW * j. */
#define MIE_BF16_PAIRED 32
static inline void mie_pair_bf16(const float *x, int64_t K, float *paired)
{
    enum { HALF = MIE_BF16_PAIRED / 2 };
    const int64_t whole = K - K % MIE_BF16_PAIRED;
    for (int64_t k = 0; k < whole; k += MIE_BF16_PAIRED)
        for (int i = 0; i < HALF; i++) {
            paired[k + i] = x[k + 2 * i];
            paired[k + HALF + i] = x[k + 2 * i + 1];
        }
    for (int64_t k = whole; k < K; k++) paired[k] = x[k];
}

/* The row-grouped formats' offsets: per block of a rounded row of x, its codes' sum. int4x16's
 * integer sums start at -8 times it (the -8 of nibble - 8), int6x16's at -32 times it (code -
 * 32), int8x16's at -128 times it where VPDPBUSD reads its codes as unsigned bytes, code + 128
 * (linear_body.h's dot_group). */
static inline void mie_block_sums(const int8_t *q, int64_t K, int32_t *sums)
{
    for (int64_t b = 0; b < K / MIE_GROUP; b++) {
        int32_t sum = 0;
        for (int j = 0; j < MIE_GROUP; j++) sum += q[b * MIE_GROUP + j];
        sums[b] = sum;
    }
}

/* Four bytes as one int32 (x's codes that a product repeats in every lane). */
static inline int32_t mie_load_i32(const int8_t *p)
{
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Row r's integer sum over int4x16 block b (its element w) against x's codes, the offset
 * included: what every variant's v_i4x16dot gives in the row's lane, here in scalar code. */
static inline int32_t mie_i4x16_row_dot(const mie_xrow *x, int64_t b, const uint8_t *w, int r)
{
    const int8_t *q = x->q + b * MIE_GROUP;
    int32_t sum = -8 * x->offset[b];
    for (int c = 0; c < 4; c++)
        for (int t = 0; t < 4; t++) {
            const uint8_t byte = w[64 * c + 4 * r + t];
            sum += (byte & 0x0F) * q[4 * c + t] + (byte >> 4) * q[MIE_I4_BLOCK_BYTES + 4 * c + t];
        }
    return sum;
}

/* Row r's codes of int6x16 nibble byte 4 c + t (c < 4) of block element w: its low nibble's
 * (input 4 c + t) and its high nibble's (input 16 + 4 c + t), each with its top bits, from
 * byte 4 r + t of top-bit chunk c / 2 (bits 4 (c % 2), and 4 (c % 2) + 2: mie.linear's
 * _block_records). */
static inline void mie_i6x16_codes(const uint8_t *w, int r, int c, int t, int *lo, int *hi)
{
    const uint8_t byte = w[64 * c + 4 * r + t];
    const uint8_t top = w[MIE_I4X16_BYTES + 64 * (c / 2) + 4 * r + t] >> (4 * (c % 2));
    *lo = (byte & 0x0F) | (top & 3) << 4;
    *hi = (byte >> 4) | (top >> 2 & 3) << 4;
}

/* Row r's integer sum over int6x16 block b (its element w) against x's codes, the offset
 * included: what every variant's v_i6x16dot gives in the row's lane, here in scalar code. */
static inline int32_t mie_i6x16_row_dot(const mie_xrow *x, int64_t b, const uint8_t *w, int r)
{
    const int8_t *q = x->q + b * MIE_GROUP;
    int32_t sum = -32 * x->offset[b];
    for (int c = 0; c < 4; c++)
        for (int t = 0; t < 4; t++) {
            int lo, hi;
            mie_i6x16_codes(w, r, c, t, &lo, &hi);
            sum += lo * q[4 * c + t] + hi * q[MIE_I4_BLOCK_BYTES + 4 * c + t];
        }
    return sum;
}

/* Row r's integer sum over int8x16 block b (its element w) against x's codes: what every
 * variant's v_i8x16dot gives in the row's lane, here in scalar code. */
static inline int32_t mie_i8x16_row_dot(const mie_xrow *x, int64_t b, const uint8_t *w, int r)
{
    const int8_t *q = x->q + b * MIE_GROUP;
    int32_t sum = 0;
    for (int c = 0; c < 8; c++)
        for (int t = 0; t < 4; t++) sum += (int8_t)w[64 * c + 4 * r + t] * q[4 * c + t];
    return sum;
}

/* sum_k value(w, k) * code(x, k) for k in [k0, k1), within one block: exact, in integers. */
static inline int32_t mie_qblock_dot(const int fmt, const mie_xrow *x, const void *w, int64_t k0,
                                     int64_t k1)
{
    int32_t sum = 0;
    for (int64_t k = k0; k < k1; k++)
        sum += (fmt == MIE_I4   ? mie_i4_value(w, k)
                : fmt == MIE_I6 ? mie_i6_value(w, k)
                                : ((const int8_t *)w)[k])
               * x->q[k];
    return sum;
}

/* The blocks of [k, K) one at a time, in scalar code: what the vector loops leave. */
static inline float mie_qdot_tail(const int fmt, const mie_xrow *x, const void *w, const void *s,
                                  int64_t k, int64_t K)
{
    float r = 0.0f;
    for (; k < K; k += MIE_GROUP) {
        const int64_t end = k + MIE_GROUP < K ? k + MIE_GROUP : K;
        const float scale = mie_scale(s, k / MIE_GROUP) * x->d[k / MIE_GROUP];
        r += scale * (float)mie_qblock_dot(fmt, x, w, k, end);
    }
    return r;
}

/* ---- integer dot products ------------------------------------------------------------------
 * Each variant's v_qdot(fmt, x, w, k) gives, for the 4 * VW inputs from k (k a multiple of
 * that), one float per 4 inputs: the exact integer sum of weight value times activation
 * code over them (|sum| <= 4 * 128 * 127, exact in a float); v_qscale(x, s, k) the
 * matching lanes' scale, weight scale times activation scale of the lane's block.
 *
 * The byte products: x86 multiplies unsigned bytes by signed ones (VPMADDUBSW, VPDPBUSD),
 * so the weight goes on the unsigned side. int8 (llama.cpp's trick): |w| times x's code with
 * w's sign (_mm256_sign_epi8), and |w| <= 128 keeps VPMADDUBSW's pair sums within int16.
 * int4 (v_q4dot, the x86 variants): the code c in [0, 15] as it is, times x's code, with the
 * -8 of c - 8 folded into the accumulator's starting value (mie_xrow.offset); x's codes are
 * laid out for the nibbles (linear_body.h's q4_layout), so the weight bytes are only masked
 * and shifted. int6 (v_q6dot): int4's nibbles with the top bits put above them, the code
 * in [0, 63] as it is (VPMADDUBSW's pair sums at most 2 * 63 * 127, and the two of a step
 * at most 32,004, within int16), the -32 of c - 32 four times int4's offset. */

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
static inline __attribute__((always_inline)) mie_gv mie_g_load_u2(const uint8_t *p, int shift)
{
    mie_u8x4 b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(__builtin_convertvector((b >> shift) & 3, mie_i32x4), mie_gv);
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
static inline __attribute__((always_inline)) mie_gv mie_g_load_u2(const uint8_t *p, int shift)
{
    mie_gv r;
    for (int l = 0; l < 4; l++) r.v[l] = (float)((p[l] >> shift) & 3);
    return r;
}
#endif

/* v_qdot, one float per 4 inputs, from the scalar sums */
static inline __attribute__((always_inline)) mie_gv mie_g_qdot(const int fmt, const mie_xrow *x,
                                                               const void *w, int64_t k)
{
    float lanes[4];
    for (int l = 0; l < 4; l++) lanes[l] = (float)mie_qblock_dot(fmt, x, w, k + 4 * l, k + 4 * l + 4);
    return mie_g_loadx(lanes);
}

/* v_i4x16dot, rows 4 part .. 4 part + 3, from the scalar sums */
static inline __attribute__((always_inline)) mie_gv mie_g_i4x16dot(const mie_xrow *x, int64_t b,
                                                                   const uint8_t *w, int part)
{
    float lanes[4];
    for (int l = 0; l < 4; l++) lanes[l] = (float)mie_i4x16_row_dot(x, b, w, 4 * part + l);
    return mie_g_loadx(lanes);
}
/* v_i8x16dot, likewise */
static inline __attribute__((always_inline)) mie_gv mie_g_i8x16dot(const mie_xrow *x, int64_t b,
                                                                   const uint8_t *w, int part)
{
    float lanes[4];
    for (int l = 0; l < 4; l++) lanes[l] = (float)mie_i8x16_row_dot(x, b, w, 4 * part + l);
    return mie_g_loadx(lanes);
}
/* v_i6x16dot, likewise */
static inline __attribute__((always_inline)) mie_gv mie_g_i6x16dot(const mie_xrow *x, int64_t b,
                                                                   const uint8_t *w, int part)
{
    float lanes[4];
    for (int l = 0; l < 4; l++) lanes[l] = (float)mie_i6x16_row_dot(x, b, w, 4 * part + l);
    return mie_g_loadx(lanes);
}

#define ISA_NAME(f) f##_generic
#define ISA_ATTR
#define VEC mie_gv
#define VW 4
#define MR 4
#define NR 2
#define MR16 2 /* bfloat16x16 tiles: 2 rows of x x 16 weight rows: 8 accumulators */
#define v_zero mie_g_zero
#define v_set1 mie_g_set1
#define v_loadx mie_g_loadx
#define v_storex mie_g_storex
#define v_fma mie_g_fma
#define v_mul mie_g_mul
#define v_add mie_g_add
#define v_hsum mie_g_hsum
#define v_load_bf16 mie_g_load_bf16
#define v_load_bf16_pair mie_g_load_bf16_pair
#define v_load_f16 mie_g_load_f16
#define v_load_i8 mie_g_load_i8
#define v_load_i4 mie_g_load_i4
#define v_load_u2 mie_g_load_u2
#define v_i6_decode mie_g_i6_decode
#define v_qdot mie_g_qdot
#define v_i4x16dot mie_g_i4x16dot
#define v_i8x16dot mie_g_i8x16dot
#define v_i6x16dot mie_g_i6x16dot
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
static inline __attribute__((always_inline)) MIE_AVX2 __m256 mie_avx2_load_u2(const uint8_t *p,
                                                                              int shift)
{
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i bits = _mm256_srl_epi32(b, _mm_cvtsi32_si128(shift));
    return _mm256_cvtepi32_ps(_mm256_and_si256(bits, _mm256_set1_epi32(3)));
}

/* One int8 block: the weight's unsigned bytes times x's signed codes, by VPMADDUBSW (pairs of
 * byte products summed into int16) and VPMADDWD by ones (pairs of those into int32). */
static inline __attribute__((always_inline)) MIE_AVX2 __m256 mie_avx2_qdot(const int fmt,
                                                                           const mie_xrow *x,
                                                                           const void *w, int64_t k)
{
    (void)fmt; /* int8: int4 takes mie_avx2_q4dot */
    const __m256i xq = _mm256_loadu_si256((const __m256i *)(x->q + k));
    const __m256i wq = _mm256_loadu_si256((const __m256i *)((const int8_t *)w + k));
    /* |-128| is the byte 0x80: 128 unsigned, as it should be */
    const __m256i u = _mm256_abs_epi8(wq);
    const __m256i pairs = _mm256_maddubs_epi16(u, _mm256_sign_epi8(xq, wq));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
/* The two byte products of a step, from acc: the codes lo and hi (int4's nibbles or int6's
 * codes) times the activation codes q4_layout put beside them. */
static inline __attribute__((always_inline)) MIE_AVX2 __m256
mie_avx2_codes_dot(const mie_xrow *x, int64_t k, __m256i lo, __m256i hi, __m256i acc)
{
    const __m256i xlo = _mm256_loadu_si256((const __m256i *)(x->q + k));
    const __m256i xhi = _mm256_loadu_si256((const __m256i *)(x->q + k + 32));
    const __m256i pairs =
        _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi));
    const __m256i sums = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
    return _mm256_cvtepi32_ps(_mm256_add_epi32(acc, sums));
}
/* Two int4 blocks (64 inputs, 32 bytes): the low and the high nibbles, each times the codes
 * q4_layout put beside them; VPMADDUBSW's pair sums (at most 2 * 15 * 127) of the two add
 * within int16. 8 lanes, 4 a block. */
static inline __attribute__((always_inline)) MIE_AVX2 __m256 mie_avx2_q4dot(const mie_xrow *x,
                                                                            const void *w,
                                                                            int64_t k)
{
    const __m256i b = _mm256_loadu_si256((const __m256i *)mie_i4_bytes(w, k));
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256(b, nibble);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), nibble);
    const __m256i acc = _mm256_loadu_si256((const __m256i *)(x->offset + (uint64_t)k / 8));
    return mie_avx2_codes_dot(x, k, lo, hi, acc);
}
/* One int6 pair of blocks (64 inputs, 48 bytes) as the codes in [0, 63] that the two byte
 * products of mie_avx2_q4dot meet: the nibbles, each with its top bits above it. A lane of
 * top bits serves one block half: the 16 top bytes, in both 128-bit lanes, their 2 bits at
 * 0 and 2 (the blocks' first halves) or 4 and 6 (their second halves) shifted straight to
 * bits 4-5, where the code wants them, and masked there (one shift and one mask a half,
 * not two shifts). */
static inline __attribute__((always_inline)) MIE_AVX2 void
mie_avx2_q6codes(const void *w, int64_t k, __m256i *lo, __m256i *hi)
{
    const uint8_t *pair = mie_i6_pair(w, k);
    const __m256i b = _mm256_loadu_si256((const __m256i *)pair);
    const __m256i top = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(pair + 32)));
    const __m256i nibble = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30);
    const __m256i tlo =
        _mm256_and_si256(_mm256_sllv_epi64(top, _mm256_setr_epi64x(4, 4, 2, 2)), bits45);
    const __m256i thi =
        _mm256_and_si256(_mm256_srlv_epi64(top, _mm256_setr_epi64x(0, 0, 2, 2)), bits45);
    *lo = _mm256_or_si256(_mm256_and_si256(b, nibble), tlo);
    *hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), nibble), thi);
}
/* mie_g_i6_decode, a pair of blocks at a time: mie_avx2_q6codes' two halves back in input
 * order (each 128-bit lane of lo and hi is a block's first or second 16), minus 32. */
static inline __attribute__((always_inline)) MIE_AVX2 void mie_avx2_i6_decode(const void *w,
                                                                              int64_t K,
                                                                              int8_t *dst)
{
    const __m256i offset = _mm256_set1_epi8(32);
    for (int64_t k = 0; k < K; k += 2 * MIE_GROUP) {
        __m256i lo, hi;
        mie_avx2_q6codes(w, k, &lo, &hi);
        _mm256_storeu_si256((__m256i *)(dst + k),
                            _mm256_sub_epi8(_mm256_permute2x128_si256(lo, hi, 0x20), offset));
        _mm256_storeu_si256((__m256i *)(dst + k + 32),
                            _mm256_sub_epi8(_mm256_permute2x128_si256(lo, hi, 0x31), offset));
    }
}
/* mie_avx2_q4dot for an int6 pair: the codes of mie_avx2_q6codes, the offset four times. */
static inline __attribute__((always_inline)) MIE_AVX2 __m256 mie_avx2_q6dot(const mie_xrow *x,
                                                                            const void *w,
                                                                            int64_t k)
{
    __m256i lo, hi;
    mie_avx2_q6codes(w, k, &lo, &hi);
    const __m256i offset = _mm256_loadu_si256((const __m256i *)(x->offset + (uint64_t)k / 8));
    return mie_avx2_codes_dot(x, k, lo, hi, _mm256_slli_epi32(offset, 2));
}
/* The scales of the two blocks from input k: each weight scale (float16) times x's (the
 * upper two floats are zero). */
static inline __attribute__((always_inline)) MIE_AVX2 __m128
mie_avx2_block_scales2(const mie_xrow *x, const void *s, int64_t k)
{
    const uint64_t g = (uint64_t)k / MIE_GROUP;
    int32_t halves;
    memcpy(&halves, (const uint16_t *)s + g, sizeof halves);
    const __m128 two_d = _mm_castpd_ps(_mm_load_sd((const double *)(x->d + g)));
    return _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(halves)), two_d);
}

/* v_q4scale: the two blocks' scales (mie_avx2_block_scales2), each over its 4 lanes. */
static inline __attribute__((always_inline)) MIE_AVX2 __m256 mie_avx2_q4scale(const mie_xrow *x,
                                                                              const void *s,
                                                                              int64_t k)
{
    const __m256i spread = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(mie_avx2_block_scales2(x, s, k)),
                                    spread);
}

/* The scales of the four blocks from input k: each weight scale (float16) times x's. */
static inline __attribute__((always_inline)) MIE_AVX2 __m128
mie_avx2_block_scales4(const mie_xrow *x, const void *s, int64_t k)
{
    const uint64_t g = (uint64_t)k / MIE_GROUP;
    const __m128i halves = _mm_loadl_epi64((const __m128i *)((const uint16_t *)s + g));
    return _mm_mul_ps(_mm_cvtph_ps(halves), _mm_loadu_ps(x->d + g));
}

/* v_q4scales: v_q4scale of the steps at k and k + 64 at once: their four blocks' float16
 * scales converted and multiplied by x's block scales as one vector, then spread over each
 * step's lanes -- half the conversions and multiplies of two v_q4scale, the same products. */
static inline __attribute__((always_inline)) MIE_AVX2 void
mie_avx2_q4scales(const mie_xrow *x, const void *s, int64_t k, __m256 *first, __m256 *second)
{
    const __m256 four = _mm256_castps128_ps256(mie_avx2_block_scales4(x, s, k));
    *first = _mm256_permutevar8x32_ps(four, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
    *second = _mm256_permutevar8x32_ps(four, _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3));
}

/* v_i4x16dot: rows 8 part .. 8 part + 7 of int4x16 block b (the part's 32-byte half of each
 * 64-byte chunk), against x's codes 4c .. 4c + 3 (low nibbles) and 16 + 4c .. (high ones)
 * repeated in every lane. VPMADDUBSW's pair sums are added as int16 -- eight of them at most
 * 8 * 2 * 15 * 127 = 30,480 -- and VPMADDWD adds each lane's pairs once a block. */
static inline __attribute__((always_inline)) MIE_AVX2 __m256
mie_avx2_i4x16dot(const mie_xrow *x, int64_t b, const uint8_t *w, int part)
{
    const int8_t *q = x->q + b * MIE_GROUP;
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    __m256i pairs = _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(w + 64 * c + 32 * part));
        const __m256i lo = _mm256_and_si256(v, nibble);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        pairs = _mm256_add_epi16(
            pairs, _mm256_maddubs_epi16(lo, _mm256_set1_epi32(mie_load_i32(q + 4 * c))));
        pairs = _mm256_add_epi16(
            pairs, _mm256_maddubs_epi16(hi, _mm256_set1_epi32(mie_load_i32(q + 16 + 4 * c))));
    }
    const __m256i sums = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
    return _mm256_cvtepi32_ps(_mm256_add_epi32(sums, _mm256_set1_epi32(-8 * x->offset[b])));
}
/* v_i8x16dot: rows 8 part .. 8 part + 7 of int8x16 block b, llama.cpp's signed trick per
 * chunk (|w| times x's codes with w's sign: mie_avx2_qdot's), each chunk's pair sums into
 * the lanes at once (two chunks' could pass int16). */
static inline __attribute__((always_inline)) MIE_AVX2 __m256
mie_avx2_i8x16dot(const mie_xrow *x, int64_t b, const uint8_t *w, int part)
{
    const int8_t *q = x->q + b * MIE_GROUP;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i sums = _mm256_setzero_si256();
    for (int c = 0; c < 8; c++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(w + 64 * c + 32 * part));
        const __m256i sx = _mm256_sign_epi8(_mm256_set1_epi32(mie_load_i32(q + 4 * c)), v);
        const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(v), sx);
        sums = _mm256_add_epi32(sums, _mm256_madd_epi16(pairs, ones));
    }
    return _mm256_cvtepi32_ps(sums);
}

/* int6x16 chunk c (c < 4) of 8 rows (half: the element plus 32 bytes a part) as the codes in
 * [0, 63] that two byte products meet: the nibbles (v) each with its top bits above it, taken
 * from the chunk's byte of top-bit chunk c / 2 (top) -- bits 4 (c % 2) and 4 (c % 2) + 2,
 * shifted straight to bits 4-5 and masked there (mie_i6x16_codes in scalar code). */
static inline __attribute__((always_inline)) MIE_AVX2 void
mie_avx2_i6x16codes(const uint8_t *half, int c, __m256i *lo, __m256i *hi)
{
    const __m256i v = _mm256_loadu_si256((const __m256i *)(half + 64 * c));
    const __m256i top =
        _mm256_loadu_si256((const __m256i *)(half + MIE_I4X16_BYTES + 64 * (c / 2)));
    const __m256i nibble = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30);
    const __m256i tlo = c % 2 ? top : _mm256_slli_epi16(top, 4);
    const __m256i thi = c % 2 ? _mm256_srli_epi16(top, 2) : _mm256_slli_epi16(top, 2);
    *lo = _mm256_or_si256(_mm256_and_si256(v, nibble), _mm256_and_si256(tlo, bits45));
    *hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), nibble),
                          _mm256_and_si256(thi, bits45));
}
/* v_i6x16dot: mie_avx2_i4x16dot for int6x16's codes (mie_avx2_i6x16codes). A chunk's two
 * VPMADDUBSW pair sums, at most 2 * 2 * 63 * 127 = 32,004, fit int16; VPMADDWD then adds
 * them into the lanes once a chunk. */
static inline __attribute__((always_inline)) MIE_AVX2 __m256
mie_avx2_i6x16dot(const mie_xrow *x, int64_t b, const uint8_t *w, int part)
{
    const int8_t *q = x->q + b * MIE_GROUP;
    const uint8_t *half = w + 32 * part;
    __m256i sums = _mm256_set1_epi32(-32 * x->offset[b]);
    for (int c = 0; c < 4; c++) {
        __m256i lo, hi;
        mie_avx2_i6x16codes(half, c, &lo, &hi);
        const __m256i pairs = _mm256_add_epi16(
            _mm256_maddubs_epi16(lo, _mm256_set1_epi32(mie_load_i32(q + 4 * c))),
            _mm256_maddubs_epi16(hi, _mm256_set1_epi32(mie_load_i32(q + 16 + 4 * c))));
        sums = _mm256_add_epi32(sums, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
    }
    return _mm256_cvtepi32_ps(sums);
}

#define ISA_NAME(f) f##_avx2
#define ISA_ATTR MIE_AVX2
#define v_qdot mie_avx2_qdot
#define v_q4dot mie_avx2_q4dot
#define v_q6dot mie_avx2_q6dot
#define v_i4x16dot mie_avx2_i4x16dot
#define v_i8x16dot mie_avx2_i8x16dot
#define v_i6x16dot mie_avx2_i6x16dot
#include "linear_avx2.h"

#if MIE_AVXVNNI_BUILD
/* ---- "avx2vnni": "avx2" with VPDPBUSD (AVX-VNNI) ------------------------------------------ */
/* The 256-bit, VEX-encoded VPDPBUSD of CPUs with AVX2 and AVX-VNNI but no AVX-512 (Intel's
 * Alder Lake and later client cores, its E-core Xeons): the 64 byte products of a 512-bit
 * VPDPBUSD, 32 at a time. As in "avx512vnni", one instruction multiplies the byte pairs and
 * adds each 4 products into the int32 lanes, where "avx2" takes VPMADDUBSW (pairs into int16)
 * and VPMADDWD by ones (pairs of those into int32): the integer dot products in a third of
 * the instructions, and no int16 step whose range bounds what a chain may add. */

#define MIE_AVX2VNNI __attribute__((target("avx2,fma,f16c,avxvnni")))

/* v_qdot: mie_avx2_qdot's operands (|w|, x's codes with w's sign), one VPDPBUSD. */
static inline __attribute__((always_inline)) MIE_AVX2VNNI __m256
mie_avx2vnni_qdot(const int fmt, const mie_xrow *x, const void *w, int64_t k)
{
    (void)fmt; /* int8: int4 takes mie_avx2vnni_q4dot */
    const __m256i xq = _mm256_loadu_si256((const __m256i *)(x->q + k));
    const __m256i wq = _mm256_loadu_si256((const __m256i *)((const int8_t *)w + k));
    return _mm256_cvtepi32_ps(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), _mm256_abs_epi8(wq),
                                                      _mm256_sign_epi8(xq, wq)));
}
/* The two byte products of a step (mie_avx2_codes_dot), each one VPDPBUSD, from acc. */
static inline __attribute__((always_inline)) MIE_AVX2VNNI __m256
mie_avx2vnni_codes_dot(const mie_xrow *x, int64_t k, __m256i lo, __m256i hi, __m256i acc)
{
    const __m256i xlo = _mm256_loadu_si256((const __m256i *)(x->q + k));
    const __m256i xhi = _mm256_loadu_si256((const __m256i *)(x->q + k + 32));
    return _mm256_cvtepi32_ps(
        _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(acc, lo, xlo), hi, xhi));
}
static inline __attribute__((always_inline)) MIE_AVX2VNNI __m256
mie_avx2vnni_q4dot(const mie_xrow *x, const void *w, int64_t k)
{
    const __m256i b = _mm256_loadu_si256((const __m256i *)mie_i4_bytes(w, k));
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const __m256i acc = _mm256_loadu_si256((const __m256i *)(x->offset + (uint64_t)k / 8));
    return mie_avx2vnni_codes_dot(x, k, _mm256_and_si256(b, nibble),
                                  _mm256_and_si256(_mm256_srli_epi16(b, 4), nibble), acc);
}
static inline __attribute__((always_inline)) MIE_AVX2VNNI __m256
mie_avx2vnni_q6dot(const mie_xrow *x, const void *w, int64_t k)
{
    __m256i lo, hi;
    mie_avx2_q6codes(w, k, &lo, &hi);
    const __m256i offset = _mm256_loadu_si256((const __m256i *)(x->offset + (uint64_t)k / 8));
    return mie_avx2vnni_codes_dot(x, k, lo, hi, _mm256_slli_epi32(offset, 2));
}
/* v_i4x16dot: mie_avx2_i4x16dot with VPDPBUSD, the low and the high nibbles in two chains. */
static inline __attribute__((always_inline)) MIE_AVX2VNNI __m256
mie_avx2vnni_i4x16dot(const mie_xrow *x, int64_t b, const uint8_t *w, int part)
{
    const int8_t *q = x->q + b * MIE_GROUP;
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    __m256i lo = _mm256_set1_epi32(-8 * x->offset[b]), hi = _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) { /* high nibbles in place, as mie_avx512vnni_i4x16dot below */
        const __m256i v = _mm256_loadu_si256((const __m256i *)(w + 64 * c + 32 * part));
        lo = _mm256_dpbusd_avx_epi32(lo, _mm256_and_si256(v, nibble),
                                     _mm256_set1_epi32(mie_load_i32(q + 4 * c)));
        hi = _mm256_dpbusd_avx_epi32(hi, _mm256_andnot_si256(nibble, v),
                                     _mm256_set1_epi32(mie_load_i32(q + 16 + 4 * c)));
    }
    return _mm256_cvtepi32_ps(_mm256_add_epi32(lo, _mm256_srai_epi32(hi, 4)));
}
/* v_i8x16dot: mie_avx512vnni_i8x16dot's scheme on 8 rows (w's codes as unsigned bytes, code
 * + 128, the sums starting at -128 times x's block sum), two chains of four. */
static inline __attribute__((always_inline)) MIE_AVX2VNNI __m256
mie_avx2vnni_i8x16dot(const mie_xrow *x, int64_t b, const uint8_t *w, int part)
{
    const int8_t *q = x->q + b * MIE_GROUP;
    const __m256i sign = _mm256_set1_epi8((char)0x80);
    const uint8_t *half = w + 32 * part;
    __m256i even = _mm256_set1_epi32(-128 * x->offset[b]), odd = _mm256_setzero_si256();
    for (int c = 0; c < 8; c += 2) {
        even = _mm256_dpbusd_avx_epi32(
            even, _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(half + 64 * c)), sign),
            _mm256_set1_epi32(mie_load_i32(q + 4 * c)));
        odd = _mm256_dpbusd_avx_epi32(
            odd, _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(half + 64 * c + 64)), sign),
            _mm256_set1_epi32(mie_load_i32(q + 4 * c + 4)));
    }
    return _mm256_cvtepi32_ps(_mm256_add_epi32(even, odd));
}

/* v_i6x16dot: mie_avx2vnni_i4x16dot for int6x16's codes (mie_avx2_i6x16codes). */
static inline __attribute__((always_inline)) MIE_AVX2VNNI __m256
mie_avx2vnni_i6x16dot(const mie_xrow *x, int64_t b, const uint8_t *w, int part)
{
    const int8_t *q = x->q + b * MIE_GROUP;
    const uint8_t *half = w + 32 * part;
    __m256i lo_sums = _mm256_set1_epi32(-32 * x->offset[b]), hi_sums = _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {
        __m256i lo, hi;
        mie_avx2_i6x16codes(half, c, &lo, &hi);
        lo_sums = _mm256_dpbusd_avx_epi32(lo_sums, lo, _mm256_set1_epi32(mie_load_i32(q + 4 * c)));
        hi_sums =
            _mm256_dpbusd_avx_epi32(hi_sums, hi, _mm256_set1_epi32(mie_load_i32(q + 16 + 4 * c)));
    }
    return _mm256_cvtepi32_ps(_mm256_add_epi32(lo_sums, hi_sums));
}

#define ISA_NAME(f) f##_avx2vnni
#define ISA_ATTR MIE_AVX2VNNI
#define v_qdot mie_avx2vnni_qdot
#define v_q4dot mie_avx2vnni_q4dot
#define v_q6dot mie_avx2vnni_q6dot
#define v_i4x16dot mie_avx2vnni_i4x16dot
#define v_i8x16dot mie_avx2vnni_i8x16dot
#define v_i6x16dot mie_avx2vnni_i6x16dot
#include "linear_avx2.h"
#endif /* MIE_AVXVNNI_BUILD */

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
static inline __attribute__((always_inline)) MIE_AVX512 __m512
mie_avx512_load_u2(const uint8_t *p, int shift)
{
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512i bits = _mm512_srl_epi32(b, _mm_cvtsi32_si128(shift));
    return _mm512_cvtepi32_ps(_mm512_and_si512(bits, _mm512_set1_epi32(3)));
}
/* Two int8 blocks (64 inputs): the operands of mie_avx2_qdot, twice as wide. AVX-512 has no
 * VPSIGNB: x's codes are negated under the mask of w's negative bytes. */
static inline __attribute__((always_inline)) MIE_AVX512 void
mie_avx512_qoperands(const mie_xrow *x, const void *w, int64_t k, __m512i *u, __m512i *sx)
{
    const __m512i xq = _mm512_loadu_si512(x->q + k);
    const __m512i wq = _mm512_loadu_si512((const int8_t *)w + k);
    *u = _mm512_abs_epi8(wq);
    *sx = _mm512_mask_sub_epi8(xq, _mm512_movepi8_mask(wq), _mm512_setzero_si512(), xq);
}
static inline __attribute__((always_inline)) MIE_AVX512 __m512 mie_avx512_qdot(const int fmt,
                                                                               const mie_xrow *x,
                                                                               const void *w,
                                                                               int64_t k)
{
    (void)fmt; /* int8: int4 takes mie_avx512_q4dot */
    __m512i u, sx;
    mie_avx512_qoperands(x, w, k, &u, &sx);
    const __m512i pairs = _mm512_maddubs_epi16(u, sx);
    return _mm512_cvtepi32_ps(_mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
}
/* Four int4 blocks (128 inputs, 64 bytes): mie_avx2_q4dot, twice as wide (16 lanes). */
static inline __attribute__((always_inline)) MIE_AVX512 void
mie_avx512_q4nibbles(const void *w, int64_t k, __m512i *lo, __m512i *hi)
{
    const __m512i b = _mm512_loadu_si512(mie_i4_bytes(w, k));
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    *lo = _mm512_and_si512(b, nibble);
    *hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), nibble);
}
/* The two byte products of a step, from acc: the codes lo and hi (int4's nibbles or int6's
 * codes) times the activation codes q4_layout put beside them. */
static inline __attribute__((always_inline)) MIE_AVX512 __m512
mie_avx512_codes_dot(const mie_xrow *x, int64_t k, __m512i lo, __m512i hi, __m512i acc)
{
    const __m512i xlo = _mm512_loadu_si512(x->q + k), xhi = _mm512_loadu_si512(x->q + k + 64);
    const __m512i pairs =
        _mm512_add_epi16(_mm512_maddubs_epi16(lo, xlo), _mm512_maddubs_epi16(hi, xhi));
    const __m512i sums = _mm512_madd_epi16(pairs, _mm512_set1_epi16(1));
    return _mm512_cvtepi32_ps(_mm512_add_epi32(acc, sums));
}
static inline __attribute__((always_inline)) MIE_AVX512 __m512 mie_avx512_q4dot(const mie_xrow *x,
                                                                                const void *w,
                                                                                int64_t k)
{
    __m512i lo, hi;
    mie_avx512_q4nibbles(w, k, &lo, &hi);
    return mie_avx512_codes_dot(x, k, lo, hi, _mm512_loadu_si512(x->offset + (uint64_t)k / 8));
}
/* Two int6 pairs of blocks (128 inputs, 96 bytes): mie_avx2_q6codes, twice as wide. */
static inline __attribute__((always_inline)) MIE_AVX512 void
mie_avx512_q6codes(const void *w, int64_t k, __m512i *lo, __m512i *hi)
{
    const uint8_t *pair = mie_i6_pair(w, k), *next = pair + MIE_I6_PAIR_BYTES;
    const __m512i b = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)pair)),
        _mm256_loadu_si256((const __m256i *)next), 1);
    const __m512i top = _mm512_inserti64x4(
        _mm512_castsi256_si512(
            _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(pair + 32)))),
        _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(next + 32))), 1);
    const __m512i nibble = _mm512_set1_epi8(0x0F), bits45 = _mm512_set1_epi8(0x30);
    const __m512i tlo = _mm512_and_si512(
        _mm512_sllv_epi64(top, _mm512_setr_epi64(4, 4, 2, 2, 4, 4, 2, 2)), bits45);
    const __m512i thi = _mm512_and_si512(
        _mm512_srlv_epi64(top, _mm512_setr_epi64(0, 0, 2, 2, 0, 0, 2, 2)), bits45);
    /* (nibbles & 0x0F) | top bits in one VPTERNLOGD (0xEC: A & C | B), not an AND and an OR */
    *lo = _mm512_ternarylogic_epi32(b, tlo, nibble, 0xEC);
    *hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(b, 4), thi, nibble, 0xEC);
}
static inline __attribute__((always_inline)) MIE_AVX512 __m512 mie_avx512_q6dot(const mie_xrow *x,
                                                                                const void *w,
                                                                                int64_t k)
{
    __m512i lo, hi;
    mie_avx512_q6codes(w, k, &lo, &hi);
    const __m512i acc = _mm512_slli_epi32(_mm512_loadu_si512(x->offset + (uint64_t)k / 8), 2);
    return mie_avx512_codes_dot(x, k, lo, hi, acc);
}
/* v_q4scale: the four blocks' scales (mie_avx2_block_scales4), each over its 4 lanes. */
static inline __attribute__((always_inline)) MIE_AVX512 __m512
mie_avx512_q4scale(const mie_xrow *x, const void *s, int64_t k)
{
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    return _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(mie_avx2_block_scales4(x, s, k)));
}
/* v_q4scales: v_q4scale of the steps at k and k + 128 at once: their eight blocks' float16
 * scales converted and multiplied by x's block scales as one vector, then spread over each
 * step's lanes -- half the conversions and multiplies of two v_q4scale, the same products
 * (the scales were a quarter of int4's instructions a step). */
static inline __attribute__((always_inline)) MIE_AVX512 void
mie_avx512_q4scales(const mie_xrow *x, const void *s, int64_t k, __m512 *first, __m512 *second)
{
    const uint64_t g = (uint64_t)k / MIE_GROUP;
    const __m128i halves = _mm_loadu_si128((const __m128i *)((const uint16_t *)s + g));
    const __m512 eight = _mm512_castps256_ps512(
        _mm256_mul_ps(_mm256_cvtph_ps(halves), _mm256_loadu_ps(x->d + g)));
    *first = _mm512_permutexvar_ps(
        _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3), eight);
    *second = _mm512_permutexvar_ps(
        _mm512_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7), eight);
}
/* v_qscales: v_qscale of the steps at k and k + 64 at once: their four blocks' float16 scales
 * converted and multiplied by x's block scales as one vector, then spread over each step's
 * lanes -- half the conversions and multiplies of two v_qscale, the same products. */
static inline __attribute__((always_inline)) MIE_AVX512 void
mie_avx512_qscales(const mie_xrow *x, const void *s, int64_t k, __m512 *first, __m512 *second)
{
    const __m512 four = _mm512_castps128_ps512(mie_avx2_block_scales4(x, s, k));
    *first = _mm512_permutexvar_ps(
        _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1), four);
    *second = _mm512_permutexvar_ps(
        _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3), four);
}
/* v_qscale: the two int8 blocks' scales (mie_avx2_block_scales2), each over its 8 lanes. */
static inline __attribute__((always_inline)) MIE_AVX512 __m512
mie_avx512_qscale(const mie_xrow *x, const void *s, int64_t k)
{
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    return _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(mie_avx2_block_scales2(x, s, k)));
}

/* v_i4x16dot: mie_avx2_i4x16dot, all 16 rows in one vector (part is 0). */
static inline __attribute__((always_inline)) MIE_AVX512 __m512
mie_avx512_i4x16dot(const mie_xrow *x, int64_t b, const uint8_t *w, int part)
{
    (void)part;
    const int8_t *q = x->q + b * MIE_GROUP;
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    __m512i pairs = _mm512_setzero_si512();
    for (int c = 0; c < 4; c++) {
        const __m512i v = _mm512_loadu_si512(w + 64 * c);
        const __m512i lo = _mm512_and_si512(v, nibble);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        pairs = _mm512_add_epi16(
            pairs, _mm512_maddubs_epi16(lo, _mm512_set1_epi32(mie_load_i32(q + 4 * c))));
        pairs = _mm512_add_epi16(
            pairs, _mm512_maddubs_epi16(hi, _mm512_set1_epi32(mie_load_i32(q + 16 + 4 * c))));
    }
    const __m512i sums = _mm512_madd_epi16(pairs, _mm512_set1_epi16(1));
    return _mm512_cvtepi32_ps(_mm512_add_epi32(sums, _mm512_set1_epi32(-8 * x->offset[b])));
}
/* v_i8x16dot: mie_avx2_i8x16dot, all 16 rows in one vector (x's codes negated under the mask
 * of w's negative bytes: mie_avx512_qoperands'). */
static inline __attribute__((always_inline)) MIE_AVX512 __m512
mie_avx512_i8x16dot(const mie_xrow *x, int64_t b, const uint8_t *w, int part)
{
    (void)part;
    const int8_t *q = x->q + b * MIE_GROUP;
    const __m512i ones = _mm512_set1_epi16(1);
    __m512i sums = _mm512_setzero_si512();
    for (int c = 0; c < 8; c++) {
        const __m512i v = _mm512_loadu_si512(w + 64 * c);
        const __m512i xq = _mm512_set1_epi32(mie_load_i32(q + 4 * c));
        const __m512i sx = _mm512_mask_sub_epi8(xq, _mm512_movepi8_mask(v), _mm512_setzero_si512(), xq);
        const __m512i pairs = _mm512_maddubs_epi16(_mm512_abs_epi8(v), sx);
        sums = _mm512_add_epi32(sums, _mm512_madd_epi16(pairs, ones));
    }
    return _mm512_cvtepi32_ps(sums);
}

/* mie_avx2_i6x16codes on all 16 rows, the nibbles and their top bits merged by one
 * VPTERNLOGD each ((v & 0x0F) | top bits, imm 0xEC). */
static inline __attribute__((always_inline)) MIE_AVX512 void
mie_avx512_i6x16codes(const uint8_t *w, int c, __m512i *lo, __m512i *hi)
{
    const __m512i v = _mm512_loadu_si512(w + 64 * c);
    const __m512i top = _mm512_loadu_si512(w + MIE_I4X16_BYTES + 64 * (c / 2));
    const __m512i nibble = _mm512_set1_epi8(0x0F), bits45 = _mm512_set1_epi8(0x30);
    const __m512i tlo = c % 2 ? top : _mm512_slli_epi16(top, 4);
    const __m512i thi = c % 2 ? _mm512_srli_epi16(top, 2) : _mm512_slli_epi16(top, 2);
    *lo = _mm512_ternarylogic_epi32(v, _mm512_and_si512(tlo, bits45), nibble, 0xEC);
    *hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), _mm512_and_si512(thi, bits45),
                                    nibble, 0xEC);
}
/* v_i6x16dot: mie_avx2_i6x16dot, all 16 rows in one vector (part is 0). */
static inline __attribute__((always_inline)) MIE_AVX512 __m512
mie_avx512_i6x16dot(const mie_xrow *x, int64_t b, const uint8_t *w, int part)
{
    (void)part;
    const int8_t *q = x->q + b * MIE_GROUP;
    __m512i sums = _mm512_set1_epi32(-32 * x->offset[b]);
    for (int c = 0; c < 4; c++) {
        __m512i lo, hi;
        mie_avx512_i6x16codes(w, c, &lo, &hi);
        const __m512i pairs = _mm512_add_epi16(
            _mm512_maddubs_epi16(lo, _mm512_set1_epi32(mie_load_i32(q + 4 * c))),
            _mm512_maddubs_epi16(hi, _mm512_set1_epi32(mie_load_i32(q + 16 + 4 * c))));
        sums = _mm512_add_epi32(sums, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
    }
    return _mm512_cvtepi32_ps(sums);
}

#define ISA_NAME(f) f##_avx512
#define ISA_ATTR MIE_AVX512
#define v_qdot mie_avx512_qdot
#define v_q4dot mie_avx512_q4dot
#define v_q6dot mie_avx512_q6dot
#define v_i4x16dot mie_avx512_i4x16dot
#define v_i8x16dot mie_avx512_i8x16dot
#define v_i6x16dot mie_avx512_i6x16dot
#include "linear_avx512.h"

/* ---- "avx512vnni": "avx512" with VPDPBUSD ---------------------------------------------------- */
/* One instruction multiplies the 64 byte pairs and adds each 4 products into the int32 lanes
 * (no int16 step): the integer dot products in a third of the instructions. */

#define MIE_AVX512VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))

static inline __attribute__((always_inline)) MIE_AVX512VNNI __m512
mie_avx512vnni_qdot(const int fmt, const mie_xrow *x, const void *w, int64_t k)
{
    (void)fmt;
    __m512i u, sx;
    mie_avx512_qoperands(x, w, k, &u, &sx);
    return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u, sx));
}
static inline __attribute__((always_inline)) MIE_AVX512VNNI __m512
mie_avx512vnni_q4dot(const mie_xrow *x, const void *w, int64_t k)
{
    __m512i lo, hi;
    mie_avx512_q4nibbles(w, k, &lo, &hi);
    const __m512i acc = _mm512_loadu_si512(x->offset + (uint64_t)k / 8);
    return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(
        _mm512_dpbusd_epi32(acc, lo, _mm512_loadu_si512(x->q + k)), hi,
        _mm512_loadu_si512(x->q + k + 64)));
}

static inline __attribute__((always_inline)) MIE_AVX512VNNI __m512
mie_avx512vnni_q6dot(const mie_xrow *x, const void *w, int64_t k)
{
    __m512i lo, hi;
    mie_avx512_q6codes(w, k, &lo, &hi);
    const __m512i acc = _mm512_slli_epi32(_mm512_loadu_si512(x->offset + (uint64_t)k / 8), 2);
    return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(
        _mm512_dpbusd_epi32(acc, lo, _mm512_loadu_si512(x->q + k)), hi,
        _mm512_loadu_si512(x->q + k + 64)));
}

/* v_i4x16dot with VPDPBUSD: the low and the high nibbles in two chains of four. The high
 * nibbles are multiplied where they lie, as 16 times their value (the byte with its low
 * nibble cleared: one AND, where moving them down takes a shift too), and their sums
 * divided by 16 once at the end -- exact, the sums being multiples of 16 (at most 240 * 128
 * * 16 in magnitude: far inside int32). Measured on the Intel Xeon VM, one thread, a stand-
 * alone copy of dot_group's loop from L2 against the shifting version: 2-4% faster (in 25-37
 * of 40 alternating rounds); the batch-1 step out of cache is level here (memory-bound), the
 * headroom is for faster memory (the EPYC's fast moments, docs/fast.md). */
static inline __attribute__((always_inline)) MIE_AVX512VNNI __m512
mie_avx512vnni_i4x16dot(const mie_xrow *x, int64_t b, const uint8_t *w, int part)
{
    (void)part;
    const int8_t *q = x->q + b * MIE_GROUP;
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    __m512i lo = _mm512_set1_epi32(-8 * x->offset[b]), hi = _mm512_setzero_si512();
    for (int c = 0; c < 4; c++) {
        const __m512i v = _mm512_loadu_si512(w + 64 * c);
        lo = _mm512_dpbusd_epi32(lo, _mm512_and_si512(v, nibble),
                                 _mm512_set1_epi32(mie_load_i32(q + 4 * c)));
        hi = _mm512_dpbusd_epi32(hi, _mm512_andnot_si512(nibble, v),
                                 _mm512_set1_epi32(mie_load_i32(q + 16 + 4 * c)));
    }
    return _mm512_cvtepi32_ps(_mm512_add_epi32(lo, _mm512_srai_epi32(hi, 4)));
}
/* v_i8x16dot with VPDPBUSD: w's codes as unsigned bytes, code + 128 (the sign bit flipped),
 * the sums starting at -128 times x's block sum; two chains of four. */
static inline __attribute__((always_inline)) MIE_AVX512VNNI __m512
mie_avx512vnni_i8x16dot(const mie_xrow *x, int64_t b, const uint8_t *w, int part)
{
    (void)part;
    const int8_t *q = x->q + b * MIE_GROUP;
    const __m512i sign = _mm512_set1_epi8((char)0x80);
    __m512i even = _mm512_set1_epi32(-128 * x->offset[b]), odd = _mm512_setzero_si512();
    for (int c = 0; c < 8; c += 2) {
        even = _mm512_dpbusd_epi32(even, _mm512_xor_si512(_mm512_loadu_si512(w + 64 * c), sign),
                                   _mm512_set1_epi32(mie_load_i32(q + 4 * c)));
        odd = _mm512_dpbusd_epi32(odd, _mm512_xor_si512(_mm512_loadu_si512(w + 64 * c + 64), sign),
                                  _mm512_set1_epi32(mie_load_i32(q + 4 * c + 4)));
    }
    return _mm512_cvtepi32_ps(_mm512_add_epi32(even, odd));
}

/* v_i6x16dot with VPDPBUSD: the low and the high codes in two chains of four. */
static inline __attribute__((always_inline)) MIE_AVX512VNNI __m512
mie_avx512vnni_i6x16dot(const mie_xrow *x, int64_t b, const uint8_t *w, int part)
{
    (void)part;
    const int8_t *q = x->q + b * MIE_GROUP;
    __m512i lo_sums = _mm512_set1_epi32(-32 * x->offset[b]), hi_sums = _mm512_setzero_si512();
    for (int c = 0; c < 4; c++) {
        __m512i lo, hi;
        mie_avx512_i6x16codes(w, c, &lo, &hi);
        lo_sums = _mm512_dpbusd_epi32(lo_sums, lo, _mm512_set1_epi32(mie_load_i32(q + 4 * c)));
        hi_sums = _mm512_dpbusd_epi32(hi_sums, hi, _mm512_set1_epi32(mie_load_i32(q + 16 + 4 * c)));
    }
    return _mm512_cvtepi32_ps(_mm512_add_epi32(lo_sums, hi_sums));
}

#define ISA_NAME(f) f##_avx512vnni
#define ISA_ATTR MIE_AVX512VNNI
#define v_qdot mie_avx512vnni_qdot
#define v_q4dot mie_avx512vnni_q4dot
#define v_q6dot mie_avx512vnni_q6dot
#define v_i4x16dot mie_avx512vnni_i4x16dot
#define v_i8x16dot mie_avx512vnni_i8x16dot
#define v_i6x16dot mie_avx512vnni_i6x16dot
#include "linear_avx512.h"
#endif /* MIE_X86 */

/* ---- dispatch ------------------------------------------------------------------------------ */

typedef void (*mie_gemm_fn)(int fmt, const float *x, int64_t ldx, int64_t M, const mie_xrow *xq,
                            const void *w, int64_t ldw, const void *s, int64_t lds, int64_t K,
                            float *out, int64_t ldo, int64_t n_begin, int64_t n_end);
typedef void (*mie_widen_fn)(int fmt, const void *w, int64_t ldw, const void *s, int64_t lds,
                             int64_t K, float *dst, int64_t ldd, int64_t n_begin, int64_t n_end);

typedef void (*mie_quantize_fn)(const float *x, int64_t K, int8_t *q, float *d, int32_t *offset,
                                float *xdq);

typedef struct {
    const char *name;
    mie_gemm_fn gemm;
    mie_widen_fn widen;
    mie_quantize_fn quantize_row;
} mie_isa;

/* Best first: the default is the first one the CPU supports. */
static const mie_isa mie_isas[] = {
#if MIE_X86
    {"avx512vnni", gemm_avx512vnni, widen_avx512vnni, quantize_row_avx512vnni},
    {"avx512", gemm_avx512, widen_avx512, quantize_row_avx512},
#if MIE_AVXVNNI_BUILD
    {"avx2vnni", gemm_avx2vnni, widen_avx2vnni, quantize_row_avx2vnni},
#endif
    {"avx2", gemm_avx2, widen_avx2, quantize_row_avx2},
#endif
    {"generic", gemm_generic, widen_generic, quantize_row_generic},
};

static inline int mie_isa_count(void) { return (int)(sizeof mie_isas / sizeof mie_isas[0]); }
static inline const char *mie_isa_name(int i) { return mie_isas[i].name; }

/* Whether this CPU (and its OS, which must save the wide registers) runs variant i. */
static inline int mie_isa_supported(int i) { return mie_cpu_runs(mie_isas[i].name); }

/* Weight rows per parallel chunk: about 64 KiB of weight (the chunk stays in L2 while every
 * group of MR activation rows passes over it), a multiple of 12 (of every variant's NR: no
 * partial tiles inside), and small enough that each thread gets several chunks (the guided
 * schedule then balances: mie_gemm). */
static inline int64_t mie_chunk_rows(int64_t N, int64_t K, int64_t esize, int nthreads)
{
    int64_t rows = (64 * 1024) / (K * esize > 0 ? K * esize : 1);
    int64_t balance = (N + 4 * (int64_t)nthreads - 1) / (4 * (int64_t)nthreads);
    if (rows > balance) rows = balance;
    rows = (rows + 11) / 12 * 12;
    return rows < 12 ? 12 : rows;
}

/* out (M, N), row stride ldo = x (M, K) @ w (N, K).T over nthreads OpenMP threads. With int8,
 * int4 and int6 weights, x is rounded first (quantize_row), once for all the weight's rows; with
 * bfloat16 ones, the rows the register tiles leave over (all of them at batch 1) are laid out
 * by mie_pair_bf16, once. Returns 0, or -1 when the memory for either cannot be had (nothing
 * is written). */
static int mie_gemm(int isa, int fmt, const float *x, int64_t ldx, int64_t M, const void *w,
                    int64_t ldw, const void *s, int64_t lds, int64_t N, int64_t K, float *out,
                    int64_t ldo, int nthreads)
{
    const mie_gemm_fn gemm = mie_isas[isa].gemm;
    const mie_quantize_fn quantize_row = mie_isas[isa].quantize_row;
    /* a row's bytes as K * esize: int4's overstated 2x (chunks of ~32 KiB), int6's 1.3x;
     * the row-grouped formats' chunks whole groups of rows */
    const int64_t esize = fmt == MIE_BF16X16                      ? 2
                          : fmt == MIE_I6 || mie_row_grouped(fmt) ? 1
                                                                  : mie_weight_esize(fmt);
    const int64_t rows = mie_chunk_rows(N, K, esize, nthreads);
    const int64_t chunk =
        mie_row_grouped(fmt) ? (rows + MIE_GROUP_ROWS - 1) / MIE_GROUP_ROWS * MIE_GROUP_ROWS : rows;
    const int64_t nchunks = (N + chunk - 1) / chunk;
    /* Threads pay when there are weight bytes to stream (from ~256 KiB: the memory-bound
     * batch-1 product) or multiply-adds to share (from ~128K).
     * Below both, handing the other threads their chunks and waiting for them costs more than
     * it saves: stories260K's layers verifying 3 speculated positions (its gate/up and LM head
     * products parallel) ran in 133-137 us on two threads, 97 us on one. */
    const int parallel = nthreads > 1 && nchunks > 1
                         && (N * K * esize > (256 << 10) || M * N * K > (1 << 17));
    /* the rows the register tiles take (every MR is 4); row-grouped formats take each row alone */
    const int64_t tiled = mie_row_grouped(fmt) ? 0 : M - M % 4;
    mie_xrow *xq = NULL;
    void *scratch = NULL;
    int64_t c;
    (void)parallel;
    if (fmt >= MIE_I8) {
        /* per row: K codes, int4's and int6's offsets, the scales, each on a cache line of its
         * own (a vector load of them never straddles two: out of L2 on the Intel Xeon VM, a
         * 2048 x 896 product at batch 1 took 37.4 us in int4 and 54.5 in int8 with them 32
         * and 48 bytes off, 35.2 and 51.7 aligned); the tiles' rows also as floats */
        const int laid = fmt == MIE_I4 || fmt == MIE_I6 || mie_row_grouped(fmt);
        const int64_t groups = (K + MIE_GROUP - 1) / MIE_GROUP;
        const int64_t lines = (K + 63) / 64 * 64; /* K bytes, or room for K / 4 offsets */
        const int64_t row_bytes = lines + (laid ? lines : 0) + (groups * 4 + 63) / 64 * 64;
        const int64_t head = (M * sizeof(mie_xrow) + tiled * K * sizeof(float) + 63) / 64 * 64;
        scratch = aligned_alloc(64, head + M * row_bytes);
        if (!scratch) return -1;
        xq = (mie_xrow *)scratch;
        float *xdq = (float *)(xq + M);
        char *rows = (char *)scratch + head;
        int64_t m;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && M * K > (1 << 16))
        for (m = 0; m < M; m++) {
            char *row = rows + m * row_bytes;
            int8_t *q = (int8_t *)row;
            /* q4_layout's offsets (int4, int6): K / 8 lanes, room for K / 4; block sums: K / 32 */
            int32_t *offset = laid ? (int32_t *)(row + lines) : NULL;
            float *d = (float *)(row + lines + (laid ? lines : 0));
            quantize_row(x + m * ldx, K, q, d, mie_row_grouped(fmt) ? NULL : offset,
                         m < tiled ? xdq + m * K : NULL);
            if (mie_row_grouped(fmt)) mie_block_sums(q, K, offset);
            xq[m] = (mie_xrow){q, d, offset, NULL};
        }
        x = xdq;
        ldx = K;
    } else if (fmt == MIE_BF16 && !mie_streams(fmt, M, K) && tiled < M) {
        /* the rows the tiles leave over */
        scratch = malloc(M * sizeof(mie_xrow) + (M - tiled) * K * sizeof(float));
        if (!scratch) return -1;
        xq = (mie_xrow *)scratch;
        float *paired = (float *)(xq + M);
        for (int64_t m = tiled; m < M; m++) {
            mie_pair_bf16(x + m * ldx, K, paired + (m - tiled) * K);
            xq[m] = (mie_xrow){.paired = paired + (m - tiled) * K};
        }
    }
    /* Guided: each thread starts on a long run of adjacent chunks (one sequential stream, as
     * with a static split) and the runs handed out shrink towards the end, so the thread the
     * memory served faster takes more of the tail instead of waiting at the barrier for the
     * other. Measured on the Intel Xeon VM, 2 threads, Qwen2-0.5B-shaped batch-1 step (one
     * build with schedule(runtime), OMP_SCHEDULE alternating, each process's median step):
     * int8 18.7-20.1 ms guided, 18.8-19.8 static (median 18.9 / 19.3 over 5 rounds),
     * 20.2-21.5 dynamic,4; int4 12.1-12.8 / 12.3-13.1 (median 12.4 / 12.8), 13.4-14.5;
     * float32, bfloat16 and float16 within each other's noise. The per-format table of
     * python -m mie.bench.throughput (prefill, decode at batch 1, 8, 32) was as fast or
     * faster in every cell. Chunks are still whole: which thread takes one changes nothing
     * in how it is computed. */
#pragma omp parallel for schedule(guided) num_threads(nthreads) if (parallel)
    for (c = 0; c < nchunks; c++) {
        const int64_t n_end = (c + 1) * chunk < N ? (c + 1) * chunk : N;
        gemm(fmt, x, ldx, M, xq, w, ldw, s, lds, K, out, ldo, c * chunk, n_end);
    }
    free(scratch);
    return 0;
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

/* The xor of the n words of a, read front to back by nthreads threads, each a contiguous
 * share: mie.linear.stream_read, the memory roofline's probe. (Handed out as the products'
 * chunks are, guided, it read no faster: 37.6-40.6 GB/s against 38.4-40.5 on the Xeon.) */
static uint64_t mie_stream_read(const uint64_t *a, int64_t n, int nthreads)
{
    uint64_t acc = 0;
    int64_t i;
    (void)nthreads; /* unused without OpenMP */
#pragma omp parallel for schedule(static) num_threads(nthreads) reduction(^ : acc) if (nthreads > 1 && n > (1 << 15))
    for (i = 0; i < n; i++) acc ^= a[i];
    return acc;
}

#endif /* MIE_LINEAR_KERNELS_H */
