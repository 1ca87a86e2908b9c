/* attention_body.h: the attention kernel of one instruction set.
 *
 * Included by attention_kernels.h once per instruction set, after it defines:
 *   ISA_NAME(f)   the function name with the set's suffix (f##_avx512 ...)
 *   ISA_ATTR      the set's target attribute (empty for the portable fallback)
 *   VEC, VW       the vector type and its width in floats (a multiple of 4)
 *   v_zero() v_set1(f) v_loadx(p) v_storex(p, v) v_fma(a, b, acc) v_mul(a, b) v_add(a, b)
 *   v_sub(a, b) v_div(a, b) v_hsum(v) v_hmax(v)
 *   v_hsum4(a, b, c, d, out)   out[0..3] = the sums of a, b, c, d
 *   v_exp(v)                   e^x for x <= 0, lane by lane (mie_exp_nonpositive's polynomial;
 *                              0 below -87, NaN for NaN)
 *   v_max(a, b)                lane by lane, b where a is NaN
 *   v_load_bf16(p) v_load_f16(p)   VW 16-bit values -> VW floats, exactly
 *   STAGE_16_BIT  1 if 16-bit K rows are widened once into scratch for all of a group's query
 *                 heads, 0 if each head widens them again in registers (cheaper where the
 *                 widening is one or two instructions: measured on AVX2 and AVX-512)
 * and this file #undefs them at its end. The cache's format (MIE_KV_F32 / F16 / BF16) is a
 * constant inside each *_fmt function, so each format gets its own inlined loads.
 */

/* VW cache elements from p (element index d), widened to floats in the register. */
static inline __attribute__((always_inline)) ISA_ATTR VEC
ISA_NAME(kv_load)(const int fmt, const void *p, int64_t d)
{
    if (fmt == MIE_KV_BF16) return v_load_bf16((const uint16_t *)p + d);
    if (fmt == MIE_KV_F16) return v_load_f16((const uint16_t *)p + d);
    return v_loadx((const float *)p + d);
}

/* The n < VW elements from p + d, widened, then zeros: a head_dim's last partial vector
 * (all of it where head_dim < VW: stories260K's 8 under AVX-512). A set with masked loads
 * does it in one instruction; the others copy through a buffer, which costs a scalar load per
 * element and a stalled vector load (stories260K's decode forward: 218 us with the buffer,
 * 127 us with masked loads). */
static inline __attribute__((always_inline)) ISA_ATTR VEC
ISA_NAME(kv_load_part)(const int fmt, const void *p, int64_t d, int64_t n)
{
#ifdef v_load_part
    return v_load_part(fmt, (const char *)p + d * (fmt == MIE_KV_F32 ? 4 : 2), n);
#else
    float part[VW] = {0};
    for (int64_t l = 0; l < n; l++) part[l] = mie_kv_scalar(fmt, p, d + l);
    return v_loadx(part);
#endif
}

static inline __attribute__((always_inline)) ISA_ATTR void
ISA_NAME(store_part)(float *p, VEC v, int64_t n)
{
#ifdef v_store_part
    v_store_part(p, v, n);
#else
    float part[VW];
    v_storex(part, v);
    memcpy(p, part, (size_t)n * sizeof(float));
#endif
}

/* Four K rows widened into dst (4 x dim floats): once, where the group's
 * query heads would each widen them again. */
static inline __attribute__((always_inline)) ISA_ATTR void
ISA_NAME(widen_rows)(const int fmt, const void *const *r, float *dst, int64_t dim)
{
    const int64_t full = dim - dim % VW;
    for (int u = 0; u < MIE_ROWS; u++) {
        for (int64_t d = 0; d < full; d += VW) v_storex(dst + u * dim + d, ISA_NAME(kv_load)(fmt, r[u], d));
        for (int64_t d = full; d < dim; d++) dst[u * dim + d] = mie_kv_scalar(fmt, r[u], d);
    }
}

/* scores[i * pitch + t + u] = queries row i . K row r[u], for every query head i < group and
 * u < 4: four dot products share each query vector (four independent FMA chains), and the
 * four horizontal sums are done together. Query rows are mie_vector_pitch(dim) apart, zeros
 * past dim, so their last vector is read whole. */
static inline __attribute__((always_inline)) ISA_ATTR void
ISA_NAME(scores4)(const int fmt, const void *const *r, const float *queries, float *scores,
                  int64_t pitch, int64_t group, int64_t dim)
{
    const int64_t full = dim - dim % VW, rest = dim % VW, head_pitch = mie_vector_pitch(dim);
    float sums[4];
    for (int64_t i = 0; i < group; i++) {
        const float *qi = queries + i * head_pitch;
        VEC a0 = v_zero(), a1 = v_zero(), a2 = v_zero(), a3 = v_zero();
        for (int64_t d = 0; d < full; d += VW) {
            const VEC x = v_loadx(qi + d);
            a0 = v_fma(x, ISA_NAME(kv_load)(fmt, r[0], d), a0);
            a1 = v_fma(x, ISA_NAME(kv_load)(fmt, r[1], d), a1);
            a2 = v_fma(x, ISA_NAME(kv_load)(fmt, r[2], d), a2);
            a3 = v_fma(x, ISA_NAME(kv_load)(fmt, r[3], d), a3);
        }
        if (rest) {
            const VEC x = v_loadx(qi + full);
            a0 = v_fma(x, ISA_NAME(kv_load_part)(fmt, r[0], full, rest), a0);
            a1 = v_fma(x, ISA_NAME(kv_load_part)(fmt, r[1], full, rest), a1);
            a2 = v_fma(x, ISA_NAME(kv_load_part)(fmt, r[2], full, rest), a2);
            a3 = v_fma(x, ISA_NAME(kv_load_part)(fmt, r[3], full, rest), a3);
        }
        v_hsum4(a0, a1, a2, a3, sums);
        memcpy(scores + i * pitch, sums, sizeof sums);
    }
}

/* Attention of `group` query heads (rows of q, contiguous, dim floats each) over KV head
 * `kv_head`: positions first .. context_len - 1 of the sequence whose blocks are `blocks`
 * (first > 0 under a sliding window: the blocks before first's are not read, and first's own
 * rows before it get weight 0). Writes `group` rows of out.
 * scratch: mie_attention_scratch_floats(group, block_size, dim).
 *
 * Each block is three passes, ROWS = 4 K/V rows at a time:
 * 1. scores q.k (scores4); where STAGE_16_BIT, a 16-bit cache's four K rows are first
 *    widened into a small float32 buffer (widen_rows) that the group's query heads share;
 * 2. online softmax: the running maximum m grows to the block's, the running sum acc and
 *    normaliser l are rescaled by exp(m_old - m_new) (skipped when m did not move), and the
 *    block's scores become weights exp(s - m_new), VW at a time;
 * 3. acc += weight x v: one vector of each of the four V rows is widened once and serves
 *    every query head of the group.
 * While computing a block's scores, the next block's K and V rows are prefetched (blocks are
 * scattered: the hardware prefetcher cannot guess them). 16-bit rows are widened in registers
 * as they are used (or four K rows at a time into scratch); the cache is never copied to
 * float32. */
static inline __attribute__((always_inline)) ISA_ATTR void
ISA_NAME(attend_fmt)(const int fmt, const float *q, float *out, const mie_kv_cache *k,
                     const mie_kv_cache *v, const int64_t *blocks, int64_t first,
                     int64_t context_len, int64_t kv_head, int64_t group, int64_t block_size,
                     int64_t dim, float scale, float *scratch)
{
    const int64_t esize = fmt == MIE_KV_F32 ? 4 : 2;
    const int64_t full = dim - dim % VW, rest = dim % VW;
    const int64_t pitch = mie_vector_pitch(block_size); /* floats per head's scores */
    const int64_t head_pitch = mie_vector_pitch(dim); /* floats per head's query and acc */
    float *queries = scratch;
    float *acc = queries + group * head_pitch;
    float *scores = acc + group * head_pitch;
    float *m = scores + group * pitch;
    float *l = m + group;
    float *k_wide = l + group; /* four K rows widened for the group (16-bit caches) */
    char *k_buffer = (char *)(k_wide + MIE_ROWS * dim); /* rows copied when head_dim is strided */
    char *v_buffer = k_buffer + MIE_ROWS * dim * esize;
    const int stage = STAGE_16_BIT && fmt != MIE_KV_F32 && group > 1;

    for (int64_t i = 0; i < group; i++) {
        m[i] = -INFINITY;
        l[i] = 0;
        for (int64_t d = 0; d < head_pitch; d++) {
            /* scaled once, not every score; zeros past dim */
            queries[i * head_pitch + d] = d < dim ? q[i * dim + d] * scale : 0;
            acc[i * head_pitch + d] = 0;
        }
    }
    const int64_t num_blocks = (context_len + block_size - 1) / block_size;
    for (int64_t j = first / block_size; j < num_blocks; j++) {
        const int64_t block = blocks[j];
        const int64_t filled = context_len - j * block_size < block_size
                                   ? context_len - j * block_size : block_size;
        /* rows before `seen` lie before the window (only in first's block); the loops start at
         * the group of MIE_ROWS holding it, and 2. gives the rows before it weight 0 */
        const int64_t seen = j * block_size < first ? first - j * block_size : 0;
        const int64_t begin = seen - seen % MIE_ROWS;
        const int64_t next = j + 1 < num_blocks ? blocks[j + 1] : -1;
        const void *r[MIE_ROWS];

        /* 1. scores (pitch >= t + 4); past the block's end the last row stands in, its scores
         * overwritten in 2. */
        for (int64_t t = begin; t < filled; t += MIE_ROWS) {
            if (next >= 0) {
                const int64_t count = block_size - t < MIE_ROWS ? block_size - t : MIE_ROWS;
                mie_prefetch_rows(k, esize, next, t, count, kv_head, dim);
                mie_prefetch_rows(v, esize, next, t, count, kv_head, dim);
            }
            for (int u = 0; u < MIE_ROWS; u++)
                r[u] = mie_kv_row(k, esize, block, t + u < filled ? t + u : filled - 1, kv_head,
                                  dim, k_buffer + u * dim * esize);
            if (stage) {
                const void *w[MIE_ROWS] = {k_wide, k_wide + dim, k_wide + 2 * dim, k_wide + 3 * dim};
                ISA_NAME(widen_rows)(fmt, r, k_wide, dim);
                ISA_NAME(scores4)(MIE_KV_F32, w, queries, scores + t, pitch, group, dim);
            } else {
                ISA_NAME(scores4)(fmt, r, queries, scores + t, pitch, group, dim);
            }
        }

        /* 2. fold the block into the running softmax */
        const int64_t padded = (filled + VW - 1) / VW * VW; /* <= pitch */
        for (int64_t i = 0; i < group; i++) {
            float *s = scores + i * pitch;
            for (int64_t t = 0; t < seen; t++) s[t] = -INFINITY; /* before the window */
            for (int64_t t = filled; t < padded; t++) s[t] = -INFINITY; /* past the block */
            VEC maxima = v_set1(-INFINITY); /* v_max(NaN, m) is m: a NaN score is no maximum */
            for (int64_t t = 0; t < padded; t += VW) maxima = v_max(v_loadx(s + t), maxima);
            const float block_max = v_hmax(maxima);
            const float new_max = block_max > m[i] ? block_max : m[i];
            if (new_max != m[i]) {
                /* 0 on the first block (m = -inf), where acc and l are 0 anyway */
                const float correction = mie_exp_nonpositive(m[i] - new_max);
                const VEC c = v_set1(correction);
                float *ai = acc + i * head_pitch;
                for (int64_t d = 0; d < dim; d += VW) v_storex(ai + d, v_mul(v_loadx(ai + d), c));
                l[i] *= correction;
                m[i] = new_max;
            }
            const VEC mv = v_set1(new_max);
            VEC total = v_zero();
            for (int64_t t = 0; t < padded; t += VW) { /* past the block: exp(-inf) = 0 */
                const VEC p = v_exp(v_sub(v_loadx(s + t), mv)); /* a NaN score stays NaN */
                v_storex(s + t, p);
                total = v_add(total, p);
            }
            l[i] += v_hsum(total);
        }

        /* 3. acc += weights x V */
        for (int64_t t = begin; t < filled; t += MIE_ROWS) {
            for (int u = 0; u < MIE_ROWS; u++)
                r[u] = mie_kv_row(v, esize, block, t + u < filled ? t + u : filled - 1, kv_head,
                                  dim, v_buffer + u * dim * esize);
            for (int64_t d = 0; d < full; d += VW) {
                const VEC w0 = ISA_NAME(kv_load)(fmt, r[0], d), w1 = ISA_NAME(kv_load)(fmt, r[1], d);
                const VEC w2 = ISA_NAME(kv_load)(fmt, r[2], d), w3 = ISA_NAME(kv_load)(fmt, r[3], d);
                for (int64_t i = 0; i < group; i++) {
                    const float *p = scores + i * pitch + t; /* 0 past the block's end */
                    float *ai = acc + i * head_pitch + d;
                    VEC a = v_loadx(ai);
                    a = v_fma(v_set1(p[0]), w0, a);
                    a = v_fma(v_set1(p[1]), w1, a);
                    a = v_fma(v_set1(p[2]), w2, a);
                    a = v_fma(v_set1(p[3]), w3, a);
                    v_storex(ai, a);
                }
            }
            if (rest) {
                const VEC w0 = ISA_NAME(kv_load_part)(fmt, r[0], full, rest);
                const VEC w1 = ISA_NAME(kv_load_part)(fmt, r[1], full, rest);
                const VEC w2 = ISA_NAME(kv_load_part)(fmt, r[2], full, rest);
                const VEC w3 = ISA_NAME(kv_load_part)(fmt, r[3], full, rest);
                for (int64_t i = 0; i < group; i++) {
                    const float *p = scores + i * pitch + t;
                    float *ai = acc + i * head_pitch + full; /* zeros past dim stay 0 */
                    VEC a = v_loadx(ai);
                    a = v_fma(v_set1(p[0]), w0, a);
                    a = v_fma(v_set1(p[1]), w1, a);
                    a = v_fma(v_set1(p[2]), w2, a);
                    a = v_fma(v_set1(p[3]), w3, a);
                    v_storex(ai, a);
                }
            }
        }
    }
    for (int64_t i = 0; i < group; i++) {
        const VEC inverse = v_set1(1.0f / l[i]);
        const float *ai = acc + i * head_pitch;
        float *oi = out + i * dim;
        for (int64_t d = 0; d < full; d += VW) v_storex(oi + d, v_mul(v_loadx(ai + d), inverse));
        for (int64_t d = full; d < dim; d++) oi[d] = ai[d] * (1.0f / l[i]);
    }
}

/* One function per format, so that each inlines its own loads (fmt is a constant there). */
static ISA_ATTR void
ISA_NAME(attend)(int fmt, const float *q, float *out, const mie_kv_cache *k,
                 const mie_kv_cache *v, const int64_t *blocks, int64_t first,
                 int64_t context_len, int64_t kv_head, int64_t group, int64_t block_size,
                 int64_t dim, float scale, float *scratch)
{
    if (fmt == MIE_KV_F16)
        ISA_NAME(attend_fmt)(MIE_KV_F16, q, out, k, v, blocks, first, context_len, kv_head,
                             group, block_size, dim, scale, scratch);
    else if (fmt == MIE_KV_BF16)
        ISA_NAME(attend_fmt)(MIE_KV_BF16, q, out, k, v, blocks, first, context_len, kv_head,
                             group, block_size, dim, scale, scratch);
    else
        ISA_NAME(attend_fmt)(MIE_KV_F32, q, out, k, v, blocks, first, context_len, kv_head,
                             group, block_size, dim, scale, scratch);
}

/* ---- the MLP's activation ------------------------------------------------------------------ */

/* silu(x) * u, lane by lane: silu(x) = x * sigmoid(x), and sigmoid(x) = exp(min(x, 0)) /
 * (1 + exp(-|x|)) takes exponentials of non-positive values only (v_exp), so none overflows;
 * for x < 0 it is e / (1 + e) with e = exp(x), for x >= 0 1 / (1 + exp(-x)). NaN stays NaN
 * (v_max gives its second operand where the first is NaN); -inf gives NaN, as x / (1 +
 * exp(-x)) does. */
static inline __attribute__((always_inline)) ISA_ATTR VEC
ISA_NAME(silu_times)(VEC x, VEC u)
{
    const VEC zero = v_zero(), minus_x = v_sub(zero, x);
    const VEC below_zero = v_sub(zero, v_max(minus_x, zero)); /* min(x, 0) */
    const VEC minus_abs = v_sub(zero, v_max(x, minus_x));    /* -|x|; NaN for NaN */
    const VEC sigmoid = v_div(v_exp(below_zero), v_add(v_set1(1.0f), v_exp(minus_abs)));
    return v_mul(v_mul(x, sigmoid), u);
}

/* out[i] = silu(gate[i]) * up[i], i < n; the last n % VW through a zero-padded vector. */
static ISA_ATTR void
ISA_NAME(swiglu)(const float *gate, const float *up, float *out, int64_t n)
{
    int64_t i = 0;
    for (; i + VW <= n; i += VW)
        v_storex(out + i, ISA_NAME(silu_times)(v_loadx(gate + i), v_loadx(up + i)));
    if (i < n) {
        float g[VW] = {0}, u[VW] = {0};
        memcpy(g, gate + i, (size_t)(n - i) * sizeof(float));
        memcpy(u, up + i, (size_t)(n - i) * sizeof(float));
        ISA_NAME(store_part)(out + i, ISA_NAME(silu_times)(v_loadx(g), v_loadx(u)), n - i);
    }
}

/* This instantiation is done: free the parameters for the next one. */
#undef ISA_NAME
#undef STAGE_16_BIT
#undef ISA_ATTR
#undef VEC
#undef VW
#undef v_zero
#undef v_set1
#undef v_loadx
#undef v_storex
#undef v_fma
#undef v_mul
#undef v_div
#undef v_add
#undef v_sub
#undef v_max
#undef v_hsum
#undef v_hmax
#undef v_hsum4
#undef v_exp
#undef v_load_bf16
#undef v_load_f16
#undef v_load_part
#undef v_store_part
