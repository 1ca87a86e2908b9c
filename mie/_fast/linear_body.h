/* linear_body.h: the matrix-product kernels of one instruction set.
 *
 * Included by linear_kernels.h once per instruction set, after it defines:
 *   ISA_NAME(f)   the function name with the set's suffix (f##_avx512 ...)
 *   ISA_ATTR      the set's target attribute (empty for the portable fallback)
 *   VEC, VW       the vector type and its width in floats (VW divides MIE_GROUP / 2)
 *   v_zero() v_set1(f) v_loadx(p) v_storex(p, v) v_fma(a, b, acc) v_mul(a, b) v_add(a, b)
 *   v_hsum(v)
 *   v_load_bf16(p) v_load_f16(p) v_load_i8(p)   VW narrow weights -> VW floats
 *   v_load_bf16_pair(p, &even, &odd)   2 * VW bfloat16 weights -> the VW at even offsets, the
 *                 VW at odd ones, as floats
 *   v_load_i4(p, high)   the low (high = 0) or high nibbles of VW bytes, minus 8 -> VW floats
 *   v_load_u2(p, shift)   bits shift, shift + 1 of VW bytes -> VW floats (int6's top bits)
 *   v_i6_decode(w, K, dst)   an int6 row of K inputs (whole pairs) -> K int8 values
 *   s_f16(h)      one float16 (bits) -> float, exactly (F16C where the set has it)
 *   v_qdot(fmt, x, w, k)   integer dot products of 4 * VW inputs, as floats (linear_kernels.h)
 *   v_qscale(x, s, k)  their lanes' scales (optional: by default one block's, v_set1)
 *   v_qscales(x, s, k, &first, &second)   optional: v_qscale of the steps at k and
 *                 k + 4 * VW at once (by default two v_qscale)
 *   v_q4dot(x, w, k) v_q4scale(x, s, k) v_q4scales(x, s, k, &first, &second)   optional:
 *                 int4's integer dot products of 8 * VW inputs laid out by q4_layout, as
 *                 floats, their lanes' scales, and the scales of two steps at once
 *   v_q6dot(x, w, k)   with v_q4dot: v_q4dot for int6 weights (the same lanes)
 *   v_i4x16dot(x, b, w, part)   int4x16's integer sums over block b (element w) of rows
 *                 part * VW .. part * VW + VW - 1, x's offset included, as floats
 *   v_i8x16dot(x, b, w, part)   the same for int8x16
 *   v_i6x16dot(x, b, w, part)   the same for int6x16
 *   MR, NR        the rows of x and of the weight in one register tile (M >= MR)
 *   MR16          the rows of x in one bfloat16x16 tile (tile_group_bf16)
 * and this file #undefs them at its end. Nothing here touches OpenMP, and only gemm_decoded
 * allocates memory (its decoded rows): the caller splits the N output channels into chunks, one
 * call per chunk.
 */

/* The scale of group g of a row (a float16), in the set's own conversion. */
static inline __attribute__((always_inline)) ISA_ATTR float ISA_NAME(scale)(const void *s, int64_t g)
{
    return s_f16(((const uint16_t *)s)[g]);
}

/* VW weights at input k of one row, as floats (load_w); int8, int4 and int6 are scaled
 * here, in the register, their codes' values first (load_codes). An int4 vector is one half
 * of a block (VW divides 16): inputs k..k+VW-1 are the low nibbles of the block's bytes
 * k % 32.. when k % 32 < 16, else the high nibbles of bytes k % 16..; an int6 vector is the
 * same nibbles of its pair's block plus 16 times its top bits (mie_i6_value), minus 32. */
static inline __attribute__((always_inline)) ISA_ATTR VEC
ISA_NAME(load_codes)(const int fmt, const void *w, int64_t k)
{
    if (fmt == MIE_I4) return v_load_i4(mie_i4_bytes(w, k), k % MIE_GROUP >= MIE_I4_BLOCK_BYTES);
    if (fmt == MIE_I6) {
        const uint64_t u = (uint64_t)k % (2 * MIE_GROUP), block = u / MIE_GROUP;
        const int high = u % MIE_GROUP >= 16;
        const uint8_t *pair = mie_i6_pair(w, k);
        const VEC nibbles = v_load_i4(pair + block * 16 + u % 16, high); /* nibble - 8 */
        const VEC top = v_load_u2(pair + 32 + u % 16, (int)(2 * block) + 4 * high);
        return v_fma(top, v_set1(16.0f), v_add(nibbles, v_set1(-24.0f)));
    }
    return v_load_i8((const int8_t *)w + k);
}
static inline __attribute__((always_inline)) ISA_ATTR VEC
ISA_NAME(load_w)(const int fmt, const void *w, const void *s, int64_t k)
{
    if (fmt == MIE_F32) return v_loadx((const float *)w + k);
    if (fmt == MIE_BF16) return v_load_bf16((const uint16_t *)w + k);
    if (fmt == MIE_F16) return v_load_f16((const uint16_t *)w + k);
    return v_mul(ISA_NAME(load_codes)(fmt, w, k), v_set1(ISA_NAME(scale)(s, k / MIE_GROUP)));
}

/* res[i * nr + j] = dot(x row i, weight row j) for i < mr, j < nr (compile-time constants
 * after inlining, so the accumulators live in registers). Vector loop over k, then a scalar
 * tail for the last K % VW inputs. int8 and int4 weights' float16 scales are converted once
 * a group (VW divides it), not once a vector: a conversion is several instructions where a
 * float32 scale was one broadcast load. Measured at 32 rows of x (Qwen2-0.5B's shapes and a
 * quarter of its LM head, 2 threads, AMD EPYC Zen 4): converted per vector, int8's float16
 * scales took 43-44 ms against 37-41 with float32 ones; once a group, 41-42 ms, and int4
 * 46 -> 42 ms. */
static inline __attribute__((always_inline)) ISA_ATTR void
ISA_NAME(tile)(const int fmt, const int mr, const int nr, const float *const *xr,
               const void *const *wr, const void *const *sr, int64_t K, float *res)
{
    VEC acc[MR][NR], scale[NR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = v_zero();
    for (int j = 0; j < nr; j++) scale[j] = v_zero();
    const int64_t kv = K - K % VW;
    for (int64_t k = 0; k < kv; k += VW) {
        VEC xv[MR];
        for (int i = 0; i < mr; i++) xv[i] = v_loadx(xr[i] + k);
        if (fmt >= MIE_I8 && k % MIE_GROUP == 0)
            for (int j = 0; j < nr; j++) scale[j] = v_set1(ISA_NAME(scale)(sr[j], k / MIE_GROUP));
        for (int j = 0; j < nr; j++) {
            const VEC wv = fmt >= MIE_I8 ? v_mul(ISA_NAME(load_codes)(fmt, wr[j], k), scale[j])
                                         : ISA_NAME(load_w)(fmt, wr[j], sr[j], k);
            for (int i = 0; i < mr; i++) acc[i][j] = v_fma(xv[i], wv, acc[i][j]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) res[i * nr + j] = v_hsum(acc[i][j]);
    for (int64_t k = kv; k < K; k++)
        for (int j = 0; j < nr; j++) {
            const float wj = mie_scalar_w(fmt, wr[j], sr[j], k);
            for (int i = 0; i < mr; i++) res[i * nr + j] += xr[i][k] * wj;
        }
}

/* dot(x, weight row) for one row of x and a float32, bfloat16 or float16 weight: the matrix-vector
 * product of batch-1 decode, bound by memory bandwidth. One weight row at a time, so each
 * thread reads its rows as one sequential stream (four rows side by side were ~40% slower:
 * four short streams restarting every row defeat the hardware prefetcher); four independent
 * accumulators keep the FMA latency hidden. */
static inline __attribute__((always_inline)) ISA_ATTR float
ISA_NAME(dot_row)(const int fmt, const float *x, const void *w, const void *s, int64_t K)
{
    VEC a[4] = {v_zero(), v_zero(), v_zero(), v_zero()};
    int64_t k = 0;
    const int64_t k4 = K - K % (4 * VW);
    for (; k < k4; k += 4 * VW) {
        mie_prefetch(mie_row(w, k, mie_weight_esize(fmt)), 4 * VW * mie_weight_esize(fmt));
        for (int u = 0; u < 4; u++)
            a[u] = v_fma(v_loadx(x + k + u * VW), ISA_NAME(load_w)(fmt, w, s, k + u * VW), a[u]);
    }
    const int64_t kv = K - K % VW;
    for (; k < kv; k += VW) a[0] = v_fma(v_loadx(x + k), ISA_NAME(load_w)(fmt, w, s, k), a[0]);
    float r = v_hsum(v_add(v_add(a[0], a[1]), v_add(a[2], a[3])));
    for (; k < K; k++) r += x[k] * mie_scalar_w(fmt, w, s, k);
    return r;
}

/* dot_row for a bfloat16 weight, x laid out by mie_pair_bf16 (paired): 2 * VW weights
 * widened a load, two instructions (v_load_bf16_pair), where dot_row's loads take four.
 * Measured on one core of an AMD EPYC Zen 4 (AVX-512), Qwen2-0.5B's gate/up rows (K = 896)
 * out of cache, 6 interleaved rounds: 22.6-28.5 GB/s against dot_row's 18.4-27.1 (faster
 * in every round), level with a loop that only reads the weight (20.6-28.5). */
static inline __attribute__((always_inline)) ISA_ATTR float
ISA_NAME(dot_row_bf16)(const float *paired, const uint16_t *w, int64_t K)
{
    enum { BLOCK = MIE_BF16_PAIRED, HALF = MIE_BF16_PAIRED / 2 };
    VEC a[4] = {v_zero(), v_zero(), v_zero(), v_zero()};
    const int64_t whole = K - K % BLOCK;
    int64_t k = 0;
    /* two blocks a pass, into four accumulators: the multiply-adds' latency hidden */
    for (; k + 2 * BLOCK <= whole; k += 2 * BLOCK) {
        mie_prefetch(w + k, 2 * BLOCK * 2);
        for (int b = 0; b < 2; b++)
            for (int j = 0; j < HALF / VW; j++) {
                VEC even, odd;
                v_load_bf16_pair(w + k + b * BLOCK + 2 * VW * j, &even, &odd);
                a[2 * b] = v_fma(v_loadx(paired + k + b * BLOCK + VW * j), even, a[2 * b]);
                a[2 * b + 1] = v_fma(v_loadx(paired + k + b * BLOCK + HALF + VW * j), odd, a[2 * b + 1]);
            }
    }
    for (; k < whole; k += BLOCK)
        for (int j = 0; j < HALF / VW; j++) {
            VEC even, odd;
            v_load_bf16_pair(w + k + 2 * VW * j, &even, &odd);
            a[0] = v_fma(v_loadx(paired + k + VW * j), even, a[0]);
            a[1] = v_fma(v_loadx(paired + k + HALF + VW * j), odd, a[1]);
        }
    float r = v_hsum(v_add(v_add(a[0], a[1]), v_add(a[2], a[3])));
    for (; k < K; k++) r += paired[k] * mie_bf16_to_float(w[k]);
    return r;
}

/* res[i] = dot(x row i, weight row) for the mc rows of x (2 <= mc <= MIE_STREAM_ROWS, a
 * compile-time constant after inlining): one pass over the weight row for all of them, a
 * single sequential stream as dot_row reads, and the x rows re-read from L1 for every
 * weight row. A few short rows -- the positions speculative decoding verifies, a small
 * batch -- then cost less than the register tiles, which read four weight rows side by side
 * (the streams problem dot_row describes), and than the rows the tiles leave over, which go
 * over the weight again one by one. Measured on Qwen2-0.5B's gate/up product (bfloat16,
 * K = 896, N = 4864, out of cache, 2 threads, AMD EPYC Zen 4; best of 12 interleaved
 * rounds): 2, 3, 4, 5 rows took 1.2, 1.1, 1.5, 1.6x one row's time, against 1.3, 1.5, 2.4,
 * 2.6x before. With longer rows (its down product, K = 4864: 19 KB of x a row) the x rows
 * no longer stay in L1 and the tiles are faster from 4 rows on: gemm_fmt streams only while
 * the x rows fit MIE_STREAM_FLOATS. */
static inline __attribute__((always_inline)) ISA_ATTR void
ISA_NAME(dot_rows)(const int fmt, const int mc, const float *const *xr, const void *w,
                   const void *s, int64_t K, float *res)
{
    VEC acc[MIE_STREAM_ROWS];
    for (int i = 0; i < mc; i++) acc[i] = v_zero();
    const int64_t kv = K - K % VW;
    for (int64_t k = 0; k < kv; k += VW) {
        const VEC wv = ISA_NAME(load_w)(fmt, w, s, k);
#pragma GCC unroll 8
        for (int i = 0; i < mc; i++) acc[i] = v_fma(v_loadx(xr[i] + k), wv, acc[i]);
    }
    for (int i = 0; i < mc; i++) res[i] = v_hsum(acc[i]);
    for (int64_t k = kv; k < K; k++) {
        const float wk = mie_scalar_w(fmt, w, s, k);
        for (int i = 0; i < mc; i++) res[i] += xr[i][k] * wk;
    }
}

/* out[m, n] for the M (2..MIE_STREAM_ROWS) rows of x and the 16/32-bit weight rows n in
 * [n_begin, n_end), each weight row read once for all of them (dot_rows, instantiated per
 * row count so that the accumulators live in registers). */
static inline __attribute__((always_inline)) ISA_ATTR void
ISA_NAME(gemm_stream)(const int fmt, const float *x, int64_t ldx, int64_t M, const void *w,
                      int64_t ldw, const void *s, int64_t lds, int64_t K, float *out,
                      int64_t ldo, int64_t n_begin, int64_t n_end)
{
    const float *xr[MIE_STREAM_ROWS];
    float res[MIE_STREAM_ROWS];
    for (int i = 0; i < M; i++) xr[i] = x + i * ldx;
    for (int64_t n = n_begin; n < n_end; n++) {
        const void *wn = mie_row(w, n * ldw, mie_weight_esize(fmt));
        const void *sn = mie_row(s, n * lds, MIE_SCALE_ESIZE);
        switch (M) {
        case 2: ISA_NAME(dot_rows)(fmt, 2, xr, wn, sn, K, res); break;
        case 3: ISA_NAME(dot_rows)(fmt, 3, xr, wn, sn, K, res); break;
        case 4: ISA_NAME(dot_rows)(fmt, 4, xr, wn, sn, K, res); break;
        default: ISA_NAME(dot_rows)(fmt, 5, xr, wn, sn, K, res); break;
        }
        for (int i = 0; i < M; i++) out[i * ldo + n] = res[i];
    }
}

#ifdef v_q4dot
/* int4's layout of a rounded row of x, for v_q4dot. A step of 8 * VW inputs is VW / 4 blocks,
 * 4 * VW bytes of weight: the weight's low nibbles hold each block's first 16 inputs, its high
 * nibbles the last 16. So each step's codes are laid out as the two byte products read them
 * -- every block's first 16, block after block, then every block's last 16 -- and no weight
 * byte is ever moved. Lane j of a block (4 lanes a block) meets its codes 4j..4j+3 and
 * 16+4j..16+4j+3: per lane, -8 times those 8 codes' sum (the -8 of nibble - 8, as the
 * accumulator's start). The inputs past the last whole step stay in
 * order, for the scalar tail. */
static ISA_ATTR void ISA_NAME(q4_layout)(int64_t K, int8_t *q, int32_t *offset)
{
    enum { STEP = 8 * VW, BLOCKS = VW / 4, HALF = MIE_I4_BLOCK_BYTES };
    int8_t laid[STEP];
    for (int64_t k0 = 0; k0 + STEP <= K; k0 += STEP) {
        for (int b = 0; b < BLOCKS; b++) {
            const int8_t *block = q + k0 + b * MIE_GROUP;
            for (int j = 0; j < 4; j++) {
                int32_t sum = 0;
                for (int t = 0; t < 4; t++) sum += block[4 * j + t] + block[HALF + 4 * j + t];
                offset[k0 / 8 + 4 * b + j] = -8 * sum;
            }
            memcpy(laid + b * HALF, block, HALF);
            memcpy(laid + STEP / 2 + b * HALF, block + HALF, HALF);
        }
        memcpy(q + k0, laid, STEP);
    }
}
#endif

/* The rounding of mie.linear.quantize_activation (quantize_int8's rule), in the same float32
 * operations, so the codes and scales are the reference's bit for bit: scale = max|x| / 127,
 * code = rint(x / scale) in [-127, 127], where rint is nearest-even (adding and subtracting
 * 1.5 * 2^23 rounds a float below 2^22 so, in the default rounding mode); a block of zeros
 * divides by 1; the scale kept is the float32 one rounded to float16 (mie_round_to_half),
 * as llama.cpp keeps it. Also, for int4 and int6 weights (offset not NULL), q4_layout's
 * offsets and the codes laid out for it (variants with v_q4dot); and, for the register-tiled
 * rows (xdq not NULL), the rounded row's float32 values code * scale, in input order.
 * Written so that the compiler vectorizes every loop for the variant's instruction set:
 * max|x| is the largest of the values' bits with the sign cleared (non-negative floats order
 * as their bits do, and bits from 0x7f800000 up are infinity and NaN), and the codes are
 * clamped as integers. */
static ISA_ATTR void ISA_NAME(quantize_row)(const float *x, int64_t K, int8_t *q, float *d,
                                            int32_t *offset, float *xdq)
{
    for (int64_t k0 = 0; k0 < K; k0 += MIE_GROUP) {
        const int n = K - k0 < MIE_GROUP ? (int)(K - k0) : MIE_GROUP;
        const float *xb = x + k0;
        uint32_t top = 0;
        for (int j = 0; j < n; j++) {
            uint32_t bits;
            memcpy(&bits, xb + j, sizeof bits);
            bits &= 0x7fffffffu;
            top = bits > top ? bits : top;
        }
        const int finite = top < 0x7f800000u;
        const float scale = finite ? mie_bits_to_float(top) / 127.0f : NAN;
        const float divisor = finite && scale != 0.0f ? scale : 1.0f;
        for (int j = 0; j < n; j++) {
            const int32_t r = (int32_t)((xb[j] / divisor + 12582912.0f) - 12582912.0f);
            q[k0 + j] = (int8_t)(r > 127 ? 127 : r < -127 ? -127 : r);
        }
        if (!finite) memset(q + k0, 0, (size_t)n);
        const float kept = mie_round_to_half(scale);
        d[k0 / MIE_GROUP] = kept;
        if (xdq)
            for (int j = 0; j < n; j++) xdq[k0 + j] = (float)q[k0 + j] * kept;
    }
#ifdef v_q4dot
    if (offset) ISA_NAME(q4_layout)(K, q, offset);
#else
    (void)offset; /* int4 reads the codes in order here */
#endif
}

/* The scales of v_qdot's lanes: weight scale times activation scale, per block (variants
 * whose 4 * VW inputs span two blocks define v_qscale themselves). */
#ifndef v_qscale
static inline __attribute__((always_inline)) ISA_ATTR VEC
ISA_NAME(qscale)(const mie_xrow *x, const void *s, int64_t k)
{
    const uint64_t g = (uint64_t)k / MIE_GROUP;
    return v_set1(ISA_NAME(scale)(s, g) * x->d[g]);
}
#define v_qscale ISA_NAME(qscale)
#endif

/* The scales of two consecutive steps (variants that can take both at once define
 * v_qscales themselves). */
#ifndef v_qscales
static inline __attribute__((always_inline)) ISA_ATTR void
ISA_NAME(qscales)(const mie_xrow *x, const void *s, int64_t k, VEC *first, VEC *second)
{
    *first = v_qscale(x, s, k);
    *second = v_qscale(x, s, k + 4 * VW);
}
#define v_qscales ISA_NAME(qscales)
#endif

/* dot(x row, weight row) for int8 and int4 weights, x rounded to int8 blocks: the
 * matrix-vector product of batch-1 decode. Each step's integer sums (v_qdot) are exact; one
 * multiply-add per 4 * VW inputs scales them, into two float accumulators that alternate so
 * that the multiply-adds' latency hides. One weight row at a time, as dot_row (four rows
 * side by side, sharing the loads of x, read 3x slower from memory here too). */
static inline __attribute__((always_inline)) ISA_ATTR float
ISA_NAME(dot_row_q)(const int fmt, const mie_xrow *x, const void *w, const void *s, int64_t K)
{
    enum { STEP = 4 * VW };
    /* The walk below moves from unit to unit of the weight (mie_quantized_at); "generic"'s two
     * steps (32 inputs) are half an int6 pair: its int6 rows go a block at a time. */
    if (fmt == MIE_I6 && 2 * STEP < 2 * MIE_GROUP) return mie_qdot_tail(fmt, x, w, s, 0, K);
    VEC a0 = v_zero(), a1 = v_zero();
    int64_t k = 0;
    /* x, w and s from input k on, moved along as pointers so that each step reads at fixed
     * offsets from them. Indexed by k, gcc spent about as many integer instructions on the
     * addresses as vector ones on the products (out of L2 on the Intel Xeon VM, one thread,
     * a 2048 x 896 product, the C kernels alone: int4 35.2 us indexed, 31.6 walked; int8
     * 51.8 and 49). */
    mie_xrow xk = *x;
    const uint8_t *wk = w;
    const uint16_t *sk = s;
    for (; k + 2 * STEP <= K; k += 2 * STEP) {
        VEC first, second;
        mie_prefetch(wk, 2 * STEP);
        v_qscales(&xk, sk, 0, &first, &second);
        a0 = v_fma(v_qdot(fmt, &xk, wk, 0), first, a0);
        a1 = v_fma(v_qdot(fmt, &xk, wk, STEP), second, a1);
        xk.q += 2 * STEP;
        xk.d += 2 * STEP / MIE_GROUP;
        wk = mie_quantized_at(fmt, wk, 2 * STEP);
        sk += 2 * STEP / MIE_GROUP;
    }
    for (; k + STEP <= K; k += STEP)
        a0 = v_fma(v_qdot(fmt, x, w, k), v_qscale(x, s, k), a0);
    return v_hsum(v_add(a0, a1)) + mie_qdot_tail(fmt, x, w, s, k, K);
}

#ifdef v_q4dot
/* dot_row_q for int4 and int6 weights (fmt), a step of 8 * VW inputs at a time (q4_layout):
 * two byte products per step, 4 * VW weight bytes of int4 (v_q4dot) or 6 * VW of int6
 * (v_q6dot: the same lanes and scales), against dot_row_q's one product per 2 * VW. */
static inline __attribute__((always_inline)) ISA_ATTR float
ISA_NAME(dot_row_q4)(const int fmt, const mie_xrow *x, const void *w, const void *s, int64_t K)
{
    enum { STEP = 8 * VW };
#define MIE_Q46DOT(x, w, k) (fmt == MIE_I6 ? v_q6dot((x), (w), (k)) : v_q4dot((x), (w), (k)))
    VEC a0 = v_zero(), a1 = v_zero();
    int64_t k = 0;
    mie_xrow xk = *x; /* x, w and s from input k on, as in dot_row_q */
    const uint8_t *wk = w;
    const uint16_t *sk = s;
    for (; k + 2 * STEP <= K; k += 2 * STEP) {
        VEC first, second;
        const uint8_t *next = mie_quantized_at(fmt, wk, 2 * STEP);
        mie_prefetch(wk, next - wk);
        v_q4scales(&xk, sk, 0, &first, &second);
        a0 = v_fma(MIE_Q46DOT(&xk, wk, 0), first, a0);
        a1 = v_fma(MIE_Q46DOT(&xk, wk, STEP), second, a1);
        xk.q += 2 * STEP;
        xk.d += 2 * STEP / MIE_GROUP;
        xk.offset += 2 * STEP / 8;
        wk = next;
        sk += 2 * STEP / MIE_GROUP;
    }
    for (; k + STEP <= K; k += STEP) a0 = v_fma(MIE_Q46DOT(x, w, k), v_q4scale(x, s, k), a0);
#undef MIE_Q46DOT
    return v_hsum(v_add(a0, a1)) + mie_qdot_tail(fmt, x, w, s, k, K);
}
#endif

/* Weight rows [n, n + nr) of a chunk ending at n_end: row pointers, the rows past the end
 * pointing at the last real row (computed, never stored), so every tile has full width. */
static inline __attribute__((always_inline)) ISA_ATTR void
ISA_NAME(rows)(const int fmt, const int nr, const void *w, int64_t ldw, const void *s,
               int64_t lds, int64_t n, int64_t n_end, const void **wr, const void **sr)
{
    for (int j = 0; j < nr; j++) {
        const int64_t row = n + j < n_end ? n + j : n_end - 1;
        wr[j] = mie_row(w, row * ldw, mie_weight_esize(fmt));
        sr[j] = mie_row(s, row * lds, MIE_SCALE_ESIZE);
    }
}

/* out[m, n] for all M rows of x and the weight rows n in [n_begin, n_end). A few short rows
 * of x and a 16/32-bit weight: gemm_stream. Otherwise rows of x go
 * MR at a time over every NR-row tile of the chunk (the chunk's weight rows stay in cache
 * across those passes); the M % MR rows left (all of them at batch 1) go one at a time,
 * one weight row at a time. With int8 and int4 weights x holds the rounded rows' float32
 * values (for the tiles) and xq the same rows as int8 blocks (for the rows left); with
 * bfloat16 ones xq holds the rows left as mie_pair_bf16 lays them out (dot_row_bf16). */
static inline __attribute__((always_inline)) ISA_ATTR void
ISA_NAME(gemm_fmt)(const int fmt, const float *x, int64_t ldx, int64_t M, const mie_xrow *xq,
                   const void *w, int64_t ldw, const void *s, int64_t lds, int64_t K,
                   float *out, int64_t ldo, int64_t n_begin, int64_t n_end)
{
    if (mie_streams(fmt, M, K)) {
        ISA_NAME(gemm_stream)(fmt, x, ldx, M, w, ldw, s, lds, K, out, ldo, n_begin, n_end);
        return;
    }
    const void *wr[NR];
    const void *sr[NR];
    const float *xr[MR];
    float res[MR * NR];
    int64_t m = 0;
    for (; m + MR <= M; m += MR) {
        for (int i = 0; i < MR; i++) xr[i] = x + (m + i) * ldx;
        for (int64_t n = n_begin; n < n_end; n += NR) {
            ISA_NAME(rows)(fmt, NR, w, ldw, s, lds, n, n_end, wr, sr);
            ISA_NAME(tile)(fmt, MR, NR, xr, wr, sr, K, res);
            const int64_t nr = n_end - n < NR ? n_end - n : NR;
            for (int i = 0; i < MR; i++)
                for (int64_t j = 0; j < nr; j++) out[(m + i) * ldo + n + j] = res[i * NR + j];
        }
    }
    for (; m < M; m++)
        for (int64_t n = n_begin; n < n_end; n++) {
            const void *wn = mie_row(w, n * ldw, mie_weight_esize(fmt));
            const void *sn = mie_row(s, n * lds, MIE_SCALE_ESIZE);
#ifdef v_q4dot
            if (fmt == MIE_I4 || fmt == MIE_I6) {
                out[m * ldo + n] = ISA_NAME(dot_row_q4)(fmt, xq + m, wn, sn, K);
                continue;
            }
#endif
            if (fmt == MIE_BF16) {
                out[m * ldo + n] = ISA_NAME(dot_row_bf16)(xq[m].paired, wn, K);
                continue;
            }
            out[m * ldo + n] = fmt >= MIE_I8 ? ISA_NAME(dot_row_q)(fmt, xq + m, wn, sn, K)
                                             : ISA_NAME(dot_row)(fmt, x + m * ldx, wn, sn, K);
        }
}

/* dst[(n - n_begin) * ldd + k] = float32 value of weight row n, input k, for n in
 * [n_begin, n_end): the panel that the prefill path hands to BLAS, and gemm_decoded's copy. */
static inline __attribute__((always_inline)) ISA_ATTR void
ISA_NAME(widen_fmt)(const int fmt, const void *w, int64_t ldw, const void *s, int64_t lds,
                    int64_t K, float *dst, int64_t ldd, int64_t n_begin, int64_t n_end)
{
    const int64_t kv = K - K % VW;
    for (int64_t n = n_begin; n < n_end; n++) {
        const void *row = mie_row(w, n * ldw, mie_weight_esize(fmt));
        const void *srow = mie_row(s, n * lds, MIE_SCALE_ESIZE);
        float *d = dst + (n - n_begin) * ldd;
        for (int64_t k = 0; k < kv; k += VW) v_storex(d + k, ISA_NAME(load_w)(fmt, row, srow, k));
        for (int64_t k = kv; k < K; k++) d[k] = mie_scalar_w(fmt, row, srow, k);
    }
}

/* gemm_fmt for the weights whose register tiles read a decoded copy of the chunk's rows: int6
 * (fmt) decoded to int8 codes (v_i6_decode; the same float16 scales), bfloat16 and float16
 * widened to float32 (widen_fmt). The copy is made once, into memory of its own (64-byte
 * aligned; it stays in L2), and every group of MR rows of x passes over it; the rows of x the
 * tiles leave (all of them at batch 1) read the stored rows. Without memory for the copy, the
 * tiles decode in place.
 * - int6, from MR rows: widening 6-bit codes inside the tiles (load_codes: two loads and a
 *   shift per vector, where int8 takes one) made Qwen2-0.5B's LM head at 32 rows of x 1.7x
 *   slower than in int8 on the Intel Xeon, 2 threads (106 against 63 ms); decoded first, as
 *   fast as int8 (61 against 61 ms; at 8 rows 21 against 25).
 * - bfloat16 and float16, from MIE_WIDEN_ROWS rows: the tiles widened every weight vector
 *   they load once per MR rows of x, and the conversions took the ports the multiply-adds
 *   need. Measured on the Intel Xeon VM (2 threads, Qwen2-0.5B's four products of two
 *   layers, the copy against the tiles widening in place, in fresh processes, three
 *   alternating rounds): float16 on AVX-512 1.08-1.16x as fast at 20 rows, 1.21-1.31x at
 *   32, 1.17-1.19x at 64, 1.07-1.13x at 128, 1.15-1.20x at 512 (at 16, where the copy would
 *   cost about four passes of tiles, it is not made); on AVX2 1.03x at 20, 1.01-1.18x from
 *   24 to 60 (from 64 it hands these to BLAS), bfloat16 rows there 1.02-1.10x. The model's
 *   128-token prefill in float16 went from 1.04-1.05x float32's time to 0.90-0.97x. */
static inline __attribute__((always_inline)) ISA_ATTR void
ISA_NAME(gemm_decoded)(const int fmt, const float *x, int64_t ldx, int64_t M, const mie_xrow *xq,
                       const void *w, int64_t ldw, const void *s, int64_t lds, int64_t K,
                       float *out, int64_t ldo, int64_t n_begin, int64_t n_end)
{
    const int decoded = fmt == MIE_I6 ? MIE_I8 : MIE_F32;
    const int64_t tiled = M - M % MR, rows = n_end - n_begin;
    const size_t bytes = ((size_t)(rows * K * mie_weight_esize(decoded)) + 63) / 64 * 64;
    void *copy = tiled >= (fmt == MIE_I6 ? MR : MIE_WIDEN_ROWS) ? aligned_alloc(64, bytes) : NULL;
    if (!copy) {
        ISA_NAME(gemm_fmt)(fmt, x, ldx, M, xq, w, ldw, s, lds, K, out, ldo, n_begin, n_end);
        return;
    }
    if (fmt == MIE_I6)
        for (int64_t n = 0; n < rows; n++)
            v_i6_decode(mie_row(w, (n_begin + n) * ldw, MIE_I6_PAIR_BYTES), K,
                        (int8_t *)copy + n * K);
    else
        ISA_NAME(widen_fmt)(fmt, w, ldw, s, lds, K, (float *)copy, K, n_begin, n_end);
    const void *scales = mie_row(s, n_begin * lds, MIE_SCALE_ESIZE); /* int8's; unused by float32 */
    ISA_NAME(gemm_fmt)(decoded, x, ldx, tiled, xq, copy, K, scales, lds, K, out + n_begin, ldo, 0,
                       rows);
    free(copy);
    if (tiled < M) /* xq's rows (int6's rounded x, bfloat16's laid-out x) from row tiled on */
        ISA_NAME(gemm_fmt)(fmt, x + tiled * ldx, ldx, M - tiled, xq ? xq + tiled : NULL, w, ldw, s,
                           lds, K, out + tiled * ldo, ldo, n_begin, n_end);
}

/* int4x16, int8x16 and int6x16 (fmt) at batch 1: the 16 outputs of one group of rows (w, s: its first
 * element and scales), x rounded to int8 blocks. Each block's integer sums come a row per lane
 * (v_i4x16dot, v_i8x16dot), so no lane is ever added to another, and they meet their scales
 * -- the 16 rows' float16 ones times x's -- in one multiply-add per VW rows. Measured out of
 * cache on the AMD EPYC (Zen 4, 2 threads), a stand-alone copy of the int4x16 loop against
 * int4's one-row loop (dot_row_q4) on the same codes, alternating: 57.0 against 42.5 GB/s at
 * K = 896 and 43.9 against 39.5 at K = 4864 (faster in 40 of 40 rounds each); at a slower
 * moment of the VM's memory 40.7-42.1 against 32.3-38.3 and 38.4-42.3 against 36.4-38.1
 * (faster in 25-28 of 30); from L2, one thread, 62.5 against 40.3 GB/s. `cached`: the group
 * was just read for another row of x (mie_prefetch_near instead of mie_prefetch). */
static inline __attribute__((always_inline)) ISA_ATTR void
ISA_NAME(dot_group)(const int fmt, const mie_xrow *x, const uint8_t *w, const uint16_t *s,
                    int64_t K, float *res, const int cached)
{
    enum { PARTS = MIE_GROUP_ROWS / VW };
    const int64_t bytes = mie_weight_esize(fmt);
    VEC acc[PARTS];
    for (int p = 0; p < PARTS; p++) acc[p] = v_zero();
    for (int64_t b = 0; b < K / MIE_GROUP; b++, w += bytes, s += MIE_GROUP_ROWS) {
        if (cached)
            mie_prefetch_near(w, bytes);
        else
            mie_prefetch(w, bytes);
        const VEC dx = v_set1(x->d[b]);
        for (int p = 0; p < PARTS; p++) {
            const VEC sums = fmt == MIE_I4X16   ? v_i4x16dot(x, b, w, p)
                             : fmt == MIE_I6X16 ? v_i6x16dot(x, b, w, p)
                                                : v_i8x16dot(x, b, w, p);
            acc[p] = v_fma(sums, v_mul(v_load_f16(s + p * VW), dx), acc[p]);
        }
    }
    for (int p = 0; p < PARTS; p++) v_storex(res + p * VW, acc[p]);
}

/* gemm for the row-grouped formats' weights, rows [n_begin, n_end) whole groups of 16: every row
 * of x, one at a time, over each group (whose elements stay in cache for the next row of x). */
static inline __attribute__((always_inline)) ISA_ATTR void
ISA_NAME(gemm_x16)(const int fmt, int64_t M, const mie_xrow *xq, const void *w, int64_t ldw,
                   const void *s, int64_t lds, int64_t K, float *out, int64_t ldo,
                   int64_t n_begin, int64_t n_end)
{
    if (M < 1) return;
    for (int64_t n = n_begin; n < n_end; n += MIE_GROUP_ROWS) {
        const int64_t g = n / MIE_GROUP_ROWS;
        const uint8_t *wg = (const uint8_t *)mie_row(w, g * ldw, mie_weight_esize(fmt));
        const uint16_t *sg = (const uint16_t *)mie_row(s, g * lds, MIE_SCALE_ESIZE);
        /* the first row of x reads the group from memory, the others from cache */
        ISA_NAME(dot_group)(fmt, xq, wg, sg, K, out + n, 0);
        for (int64_t m = 1; m < M; m++)
            ISA_NAME(dot_group)(fmt, xq + m, wg, sg, K, out + m * ldo + n, 1);
    }
}

/* bfloat16x16 at batch 1: the 16 outputs of one group of rows (w: its first element, whose
 * elements follow one another, 32 inputs each), res[r] = dot(x, row r). The group holds inputs
 * k and k + 1 of its 16 rows in the 64 bytes from w + 16 k, a row's pair a 32-bit lane, which
 * v_load_bf16_pair widens VW rows at a time (a shift and a mask); each meets its input of x
 * broadcast. So no lane is ever added to another (a row-per-output loop ends each row with a
 * horizontal sum) and x is read once per 16 rows instead of once per row. Two pairs of inputs a
 * pass, into four accumulators per VW rows: the multiply-adds' latency hidden. Measured on the
 * Intel Xeon VM (AVX-512), 64-byte-aligned weights, alternating rounds: from L2, one thread, a
 * 512 x 896 product 16.3 us against dot_row_bf16's 21.1 (56.4 against 43.5 GB/s); out of
 * cache, 2 threads, the 24 layers of a Qwen2-0.5B-shaped model (716 MB) level, 23.8-24.7
 * against 24.8-24.9 ms (faster in 8, 8 and 10 of 10 rounds), where the rows read ~85% of
 * what stream_read reads. */
static inline __attribute__((always_inline)) ISA_ATTR void
ISA_NAME(dot_group_bf16)(const float *x, const uint16_t *w, int64_t K, float *res)
{
    enum { PARTS = MIE_GROUP_ROWS / VW };
    VEC acc[4][PARTS];
    for (int a = 0; a < 4; a++)
        for (int p = 0; p < PARTS; p++) acc[a][p] = v_zero();
    for (int64_t k = 0; k < K; k += 4) { /* K is whole blocks of 32 */
        mie_prefetch(w + MIE_GROUP_ROWS * k, 4 * MIE_GROUP_ROWS * 2);
        for (int h = 0; h < 2; h++) {
            const VEC xe = v_set1(x[k + 2 * h]), xo = v_set1(x[k + 2 * h + 1]);
            for (int p = 0; p < PARTS; p++) {
                VEC even, odd;
                v_load_bf16_pair(w + MIE_GROUP_ROWS * (k + 2 * h) + 2 * VW * p, &even, &odd);
                acc[2 * h][p] = v_fma(xe, even, acc[2 * h][p]);
                acc[2 * h + 1][p] = v_fma(xo, odd, acc[2 * h + 1][p]);
            }
        }
    }
    for (int p = 0; p < PARTS; p++)
        v_storex(res + p * VW, v_add(v_add(acc[0][p], acc[1][p]), v_add(acc[2][p], acc[3][p])));
}

/* dot_group_bf16 for mr rows of x (xr; mr <= MR16, a compile-time constant after inlining):
 * out[i * ldo + r] = dot(x row i, row r). Each pair of inputs is widened once for all mr rows,
 * whose inputs come broadcast, each row's two broadcasts used at once (broadcast for all rows
 * first, gcc kept them in registers and moved AVX2's accumulators to the stack: 0.92-0.94x the
 * row layout's tiles at 8-32 rows there, 1.11-1.13x now); one accumulator per row of x and VW
 * rows of the weight. */
static inline __attribute__((always_inline)) ISA_ATTR void
ISA_NAME(tile_group_bf16)(const int mr, const float *const *xr, const uint16_t *w, int64_t K,
                          float *out, int64_t ldo)
{
    enum { PARTS = MIE_GROUP_ROWS / VW };
    VEC acc[MR16][PARTS];
    for (int i = 0; i < mr; i++)
        for (int p = 0; p < PARTS; p++) acc[i][p] = v_zero();
    for (int64_t k = 0; k < K; k += 2) {
        VEC even[PARTS], odd[PARTS];
        for (int p = 0; p < PARTS; p++)
            v_load_bf16_pair(w + MIE_GROUP_ROWS * k + 2 * VW * p, &even[p], &odd[p]);
        for (int i = 0; i < mr; i++) { /* each row's two broadcasts used at once */
            const VEC xe = v_set1(xr[i][k]), xo = v_set1(xr[i][k + 1]);
            for (int p = 0; p < PARTS; p++) {
                acc[i][p] = v_fma(xe, even[p], acc[i][p]);
                acc[i][p] = v_fma(xo, odd[p], acc[i][p]);
            }
        }
    }
    for (int i = 0; i < mr; i++)
        for (int p = 0; p < PARTS; p++) v_storex(out + i * ldo + p * VW, acc[i][p]);
}

/* gemm for bfloat16x16 weights, rows [n_begin, n_end) whole groups of 16: at batch 1 each
 * group by dot_group_bf16; otherwise MR16 rows of x at a time (the rows left over as one
 * smaller tile) over every group of the chunk, whose weights stay in cache for the next rows
 * of x, as gemm_fmt's tiles go over a chunk. Measured on the Intel Xeon VM (2 threads, 4
 * layers of a Qwen2-0.5B-shaped model, alternating rounds) against the row layout's tiles
 * and gemm_stream: AVX-512 1.06-1.09x as fast at 2 rows, 1.05-1.07x at 8, 1.19-1.25x at
 * 16-128, 1.30x at 512; AVX2 (4 rows a tile) 1.11-1.13x at 8-32 rows, and from 64 rows on,
 * where both go to BLAS through their widened panels, 0.91-0.96x (widen_x16's gather, with
 * this machine's OpenBLAS running AVX-512 kernels: on an AVX2 CPU the product is slower and
 * the gather a smaller share). */
static inline __attribute__((always_inline)) ISA_ATTR void
ISA_NAME(gemm_bf16x16)(const float *x, int64_t ldx, int64_t M, const void *w, int64_t ldw,
                       int64_t K, float *out, int64_t ldo, int64_t n_begin, int64_t n_end)
{
#define MIE_GROUP_AT(n) ((const uint16_t *)mie_row(w, (n) / MIE_GROUP_ROWS * ldw, MIE_BF16X16_BYTES))
    if (M == 1) {
        for (int64_t n = n_begin; n < n_end; n += MIE_GROUP_ROWS)
            ISA_NAME(dot_group_bf16)(x, MIE_GROUP_AT(n), K, out + n);
        return;
    }
    const float *xr[MR16];
    for (int64_t m = 0; m < M; m += MR16) {
        const int mr = M - m < MR16 ? (int)(M - m) : MR16;
        for (int i = 0; i < mr; i++) xr[i] = x + (m + i) * ldx;
        for (int64_t n = n_begin; n < n_end; n += MIE_GROUP_ROWS) {
            const uint16_t *wg = MIE_GROUP_AT(n);
            float *o = out + m * ldo + n;
            switch (mr) { /* each tile height its own instantiation: accumulators in registers */
#if MR16 >= 8
            case 8: ISA_NAME(tile_group_bf16)(8, xr, wg, K, o, ldo); break;
            case 7: ISA_NAME(tile_group_bf16)(7, xr, wg, K, o, ldo); break;
#endif
#if MR16 >= 6
            case 6: ISA_NAME(tile_group_bf16)(6, xr, wg, K, o, ldo); break;
            case 5: ISA_NAME(tile_group_bf16)(5, xr, wg, K, o, ldo); break;
#endif
#if MR16 >= 4
            case 4: ISA_NAME(tile_group_bf16)(4, xr, wg, K, o, ldo); break;
            case 3: ISA_NAME(tile_group_bf16)(3, xr, wg, K, o, ldo); break;
#endif
            case 2: ISA_NAME(tile_group_bf16)(2, xr, wg, K, o, ldo); break;
            default: ISA_NAME(tile_group_bf16)(1, xr, wg, K, o, ldo); break;
            }
        }
    }
#undef MIE_GROUP_AT
}

/* widen_fmt for the row-grouped formats' weights: row n's blocks gathered back into int4's,
 * int8's or bfloat16's order (4-byte pieces, one per chunk), then widened as those are;
 * int6x16's codes one by one (mie_i6x16_codes). */
static inline __attribute__((always_inline)) ISA_ATTR void
ISA_NAME(widen_x16)(const int fmt, const void *w, int64_t ldw, const void *s, int64_t lds,
                    int64_t K, float *dst, int64_t ldd, int64_t n_begin, int64_t n_end)
{
    const int64_t bytes = mie_weight_esize(fmt), chunks = bytes / MIE_GROUP_ROWS / 4;
    for (int64_t n = n_begin; n < n_end; n++) {
        const int64_t g = n / MIE_GROUP_ROWS, r = n % MIE_GROUP_ROWS;
        const uint8_t *wg = (const uint8_t *)mie_row(w, g * ldw, bytes);
        const uint16_t *sg = (const uint16_t *)mie_row(s, g * lds, MIE_SCALE_ESIZE); /* or NULL */
        float *d = dst + (n - n_begin) * ldd;
        for (int64_t b = 0; b < K / MIE_GROUP; b++) {
            const uint8_t *element = wg + b * bytes;
            uint16_t block16[MIE_GROUP]; /* room for a bfloat16 block: 64 bytes */
            uint8_t *block = (uint8_t *)block16;
            if (fmt == MIE_I6X16) /* its values, code - 32, in input order */
                for (int c = 0; c < 4; c++)
                    for (int t = 0; t < 4; t++) {
                        int lo, hi;
                        mie_i6x16_codes(element, (int)r, c, t, &lo, &hi);
                        block[4 * c + t] = (uint8_t)(lo - 32);
                        block[MIE_I4_BLOCK_BYTES + 4 * c + t] = (uint8_t)(hi - 32);
                    }
            else
                for (int c = 0; c < chunks; c++)
                    memcpy(block + 4 * c, element + MIE_GROUP_ROWS * 4 * c + 4 * r, 4);
            if (fmt == MIE_BF16X16) { /* no scale: the values themselves */
                for (int j = 0; j < MIE_GROUP; j += VW)
                    v_storex(d + b * MIE_GROUP + j, v_load_bf16(block16 + j));
                continue;
            }
            const VEC scale = v_set1(ISA_NAME(scale)(sg, b * MIE_GROUP_ROWS + r));
            for (int j = 0; j < MIE_GROUP; j += VW) {
                const VEC codes = fmt == MIE_I4X16
                                      ? v_load_i4(block + j % MIE_I4_BLOCK_BYTES, j >= MIE_I4_BLOCK_BYTES)
                                      : v_load_i8((const int8_t *)block + j); /* int8, int6 */
                v_storex(d + b * MIE_GROUP + j, v_mul(codes, scale));
            }
        }
    }
}

/* One function per format, so that each inlines its own loads (fmt is a constant there). */
static ISA_ATTR void
ISA_NAME(gemm)(int fmt, const float *x, int64_t ldx, int64_t M, const mie_xrow *xq,
               const void *w, int64_t ldw, const void *s, int64_t lds, int64_t K, float *out,
               int64_t ldo, int64_t n_begin, int64_t n_end)
{
    if (fmt == MIE_F32)
        ISA_NAME(gemm_fmt)(MIE_F32, x, ldx, M, xq, w, ldw, s, lds, K, out, ldo, n_begin, n_end);
    else if (fmt == MIE_BF16)
        ISA_NAME(gemm_decoded)(MIE_BF16, x, ldx, M, xq, w, ldw, s, lds, K, out, ldo, n_begin, n_end);
    else if (fmt == MIE_F16)
        ISA_NAME(gemm_decoded)(MIE_F16, x, ldx, M, xq, w, ldw, s, lds, K, out, ldo, n_begin, n_end);
    else if (fmt == MIE_I4)
        ISA_NAME(gemm_fmt)(MIE_I4, x, ldx, M, xq, w, ldw, s, lds, K, out, ldo, n_begin, n_end);
    else if (fmt == MIE_I6)
        ISA_NAME(gemm_decoded)(MIE_I6, x, ldx, M, xq, w, ldw, s, lds, K, out, ldo, n_begin, n_end);
    else if (fmt == MIE_I4X16)
        ISA_NAME(gemm_x16)(MIE_I4X16, M, xq, w, ldw, s, lds, K, out, ldo, n_begin, n_end);
    else if (fmt == MIE_I8X16)
        ISA_NAME(gemm_x16)(MIE_I8X16, M, xq, w, ldw, s, lds, K, out, ldo, n_begin, n_end);
    else if (fmt == MIE_I6X16)
        ISA_NAME(gemm_x16)(MIE_I6X16, M, xq, w, ldw, s, lds, K, out, ldo, n_begin, n_end);
    else if (fmt == MIE_BF16X16)
        ISA_NAME(gemm_bf16x16)(x, ldx, M, w, ldw, K, out, ldo, n_begin, n_end);
    else
        ISA_NAME(gemm_fmt)(MIE_I8, x, ldx, M, xq, w, ldw, s, lds, K, out, ldo, n_begin, n_end);
}

static ISA_ATTR void
ISA_NAME(widen)(int fmt, const void *w, int64_t ldw, const void *s, int64_t lds, int64_t K,
                float *dst, int64_t ldd, int64_t n_begin, int64_t n_end)
{
    if (fmt == MIE_F32)
        ISA_NAME(widen_fmt)(MIE_F32, w, ldw, s, lds, K, dst, ldd, n_begin, n_end);
    else if (fmt == MIE_BF16)
        ISA_NAME(widen_fmt)(MIE_BF16, w, ldw, s, lds, K, dst, ldd, n_begin, n_end);
    else if (fmt == MIE_F16)
        ISA_NAME(widen_fmt)(MIE_F16, w, ldw, s, lds, K, dst, ldd, n_begin, n_end);
    else if (fmt == MIE_I4)
        ISA_NAME(widen_fmt)(MIE_I4, w, ldw, s, lds, K, dst, ldd, n_begin, n_end);
    else if (fmt == MIE_I6)
        ISA_NAME(widen_fmt)(MIE_I6, w, ldw, s, lds, K, dst, ldd, n_begin, n_end);
    else if (fmt == MIE_I4X16)
        ISA_NAME(widen_x16)(MIE_I4X16, w, ldw, s, lds, K, dst, ldd, n_begin, n_end);
    else if (fmt == MIE_I8X16)
        ISA_NAME(widen_x16)(MIE_I8X16, w, ldw, s, lds, K, dst, ldd, n_begin, n_end);
    else if (fmt == MIE_I6X16)
        ISA_NAME(widen_x16)(MIE_I6X16, w, ldw, s, lds, K, dst, ldd, n_begin, n_end);
    else if (fmt == MIE_BF16X16)
        ISA_NAME(widen_x16)(MIE_BF16X16, w, ldw, s, lds, K, dst, ldd, n_begin, n_end);
    else
        ISA_NAME(widen_fmt)(MIE_I8, w, ldw, s, lds, K, dst, ldd, n_begin, n_end);
}

/* This instantiation is done: free the parameters for the next one. */
#undef ISA_NAME
#undef ISA_ATTR
#undef VEC
#undef VW
#undef MR
#undef NR
#undef MR16
#undef v_zero
#undef v_set1
#undef v_loadx
#undef v_storex
#undef v_fma
#undef v_mul
#undef v_add
#undef v_hsum
#undef v_load_bf16
#undef v_load_bf16_pair
#undef v_load_f16
#undef v_load_i8
#undef v_load_i4
#undef v_load_u2
#undef v_i6_decode
#undef v_qdot
#undef v_qscale
#undef v_qscales
#undef v_q4dot
#undef v_q4scale
#undef v_q4scales
#undef v_q6dot
#undef v_i4x16dot
#undef v_i8x16dot
#undef v_i6x16dot
#undef s_f16
