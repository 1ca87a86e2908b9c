// Paged decode attention: one query token per sequence, K/V read through block tables.
//
// Computes exactly mie.ops.paged_attention (float32):
//   out[s, h, :] = softmax_t(scale * q[s, h] . K[s, t, kvh(h)]) @ V[s, t, kvh(h)],
//                  first[s] <= t < context_lens[s]
// where token t of sequence s lives in physical block block_tables[s, t / block_size] at offset
// t % block_size, and query head h reads KV head kvh(h) = h / group, group = num_heads / num_kv_heads.
// first[s] is 0 for full attention (sliding_window == 0); with a sliding window it is
// max(0, context_lens[s] - sliding_window): the query (position context_lens[s] - 1) sees its
// own and the sliding_window - 1 positions before it, and the blocks before first[s] are never
// read (they may be -1: released to the pool).
//
// Layout (element = one float32):
//   q, out       (num_seqs, num_heads, head_dim), contiguous.
//   k_cache      one layer's K: element (block b, offset o, kv head g, dim d) is at
//                  k_cache[b * block_stride + (o * num_kv_heads + g) * head_dim + d]
//                i.e. each block is a contiguous (block_size, num_kv_heads, head_dim) slab and
//                block_stride is the distance between consecutive blocks. In mie's arena
//                (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim) the layer-l K
//                view starts at arena + l * 2 * slab and block_stride = num_layers * 2 * slab.
//   v_cache      the same for V, same block_stride.
//   block_tables (num_seqs, max_blocks_per_seq) int32, padded with -1 (padding is never read).
//   context_lens (num_seqs,) int32, each >= 1.
//   head_dim % 4 == 0 (K/V rows are loaded as float4).
//
// Launch geometry:
//   paged_attention_partition: grid (num_seqs, num_kv_heads, num_partitions), NUM_THREADS threads,
//     dynamic shared memory = shared_floats(head_dim, group) * 4 bytes (see the table below).
//     Thread block (s, g, p) handles the `group` query heads that share KV head g over the tokens
//     [first + p * partition_size, min(first + (p + 1) * partition_size, context_len)). All of those heads are
//     served from one read of each K/V row, so K/V is read from global memory exactly once per
//     (sequence, KV head). The partition is walked in tiles of TILE_TOKENS tokens with an online
//     softmax (running max m, running sum l, unnormalised accumulator acc), so any context
//     length works with fixed shared memory. Partitions only exist to give the GPU enough
//     thread blocks when the batch is small; a block whose partition starts past its sequence's
//     end exits at once.
//     With num_partitions == 1 the block writes out = acc / l directly; otherwise it writes its
//     (m, l, acc) to the partial buffers and paged_attention_reduce merges them.
//   paged_attention_reduce: grid (num_seqs, num_heads), NUM_THREADS threads, no shared memory.
//     Merges partitions p < ceil((context_len - first) / partition_size):
//       M = max_p m_p,  L = sum_p l_p exp(m_p - M),  out = sum_p acc_p exp(m_p - M) / L.
//
// Partial buffers (only used when num_partitions > 1), indexed [s][h][p] / [s][h][p][d]:
//   partial_max, partial_sum (num_seqs, num_heads, num_partitions)
//   partial_acc              (num_seqs, num_heads, num_partitions, head_dim)
//
// Coalescing: a K/V row of one KV head is head_dim contiguous floats; consecutive threads load
// consecutive float4s of a row, and a tile's rows in one block are num_kv_heads * head_dim
// apart, so every warp-wide load covers whole 128-byte segments when head_dim >= 32.

#define WARP_SIZE 32
#define NUM_THREADS 128
#define NUM_WARPS (NUM_THREADS / WARP_SIZE)
#define TILE_TOKENS 32   // one warp lane per token when scoring
#define ROW_PADDING 4    // floats: keeps rows 16-byte aligned, odd in float4 units (no bank conflicts)

__device__ __forceinline__ float negative_infinity() { return -__int_as_float(0x7f800000); }

__device__ __forceinline__ float warp_max(float x) {
    for (int mask = WARP_SIZE / 2; mask > 0; mask /= 2)
        x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, mask));
    return x;
}

__device__ __forceinline__ float warp_sum(float x) {
    for (int mask = WARP_SIZE / 2; mask > 0; mask /= 2)
        x += __shfl_xor_sync(0xffffffffu, x, mask);
    return x;
}

__device__ __forceinline__ float dot4(float4 a, float4 b) {
    return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
}

// Shared memory of one thread block, in floats (the host computes the same sum):
//   k_tile, v_tile  TILE_TOKENS rows of (head_dim + ROW_PADDING)   this tile's K and V rows
//   q_heads         group * head_dim                                 the group's queries
//   acc             group * head_dim                                 unnormalised outputs
//   probs           group * TILE_TOKENS                              exp(score - m) of the tile
//   run_max, run_sum, rescale   group each                          online-softmax state

extern "C" __global__ void __launch_bounds__(NUM_THREADS) paged_attention_partition(
    float* __restrict__ out,
    float* __restrict__ partial_max,
    float* __restrict__ partial_sum,
    float* __restrict__ partial_acc,
    const float* __restrict__ q,
    const float* __restrict__ k_cache,
    const float* __restrict__ v_cache,
    const int* __restrict__ block_tables,
    const int* __restrict__ context_lens,
    float scale,
    int group,
    int head_dim,
    int block_size,
    long long block_stride,
    int max_blocks_per_seq,
    int partition_size,
    int sliding_window) {
    const int seq = blockIdx.x;
    const int kv_head = blockIdx.y;
    const int partition = blockIdx.z;
    const int num_kv_heads = gridDim.y;
    const int num_partitions = gridDim.z;
    const int num_heads = num_kv_heads * group;
    const int context_len = context_lens[seq];
    const int first = sliding_window > 0 && context_len > sliding_window ? context_len - sliding_window : 0;
    const int begin = first + partition * partition_size;
    if (begin >= context_len) return;  // uniform over the block: nothing of this sequence here
    const int end = min(begin + partition_size, context_len);

    const int row = head_dim + ROW_PADDING;
    const int vecs_per_row = head_dim / 4;
    extern __shared__ __align__(16) float shared[];
    float* k_tile = shared;
    float* v_tile = k_tile + TILE_TOKENS * row;
    float* q_heads = v_tile + TILE_TOKENS * row;
    float* acc = q_heads + group * head_dim;
    float* probs = acc + group * head_dim;
    float* run_max = probs + group * TILE_TOKENS;
    float* run_sum = run_max + group;
    float* rescale = run_sum + group;

    // Query heads kv_head * group + j (j < group) are contiguous in q: element (j, d) of the
    // group sits at q[(seq * num_heads + kv_head * group) * head_dim + j * head_dim + d].
    const float* q_group = q + ((long long)seq * num_heads + kv_head * group) * head_dim;
    for (int i = threadIdx.x; i < group * head_dim; i += NUM_THREADS) {
        q_heads[i] = q_group[i];
        acc[i] = 0.0f;
    }
    for (int j = threadIdx.x; j < group; j += NUM_THREADS) {
        run_max[j] = negative_infinity();
        run_sum[j] = 0.0f;
    }

    const int* table = block_tables + (long long)seq * max_blocks_per_seq;
    const int lane = threadIdx.x % WARP_SIZE;
    const int warp = threadIdx.x / WARP_SIZE;

    for (int tile = begin; tile < end; tile += TILE_TOKENS) {
        const int tile_len = min(TILE_TOKENS, end - tile);
        __syncthreads();  // the previous tile's k/v/probs are consumed (and the init is visible)

        // 1. Load the tile's K and V rows: vector i is (token t = i / vecs_per_row,
        //    float4 c = i % vecs_per_row) of position tile + t, in physical block
        //    table[(tile + t) / block_size] at offset (tile + t) % block_size.
        //    Rows past the end are zero-filled (their probabilities are zero too).
#pragma unroll 4
        for (int i = threadIdx.x; i < TILE_TOKENS * vecs_per_row; i += NUM_THREADS) {
            const int t = i / vecs_per_row;
            const int c = i - t * vecs_per_row;
            float4 k4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            float4 v4 = k4;
            if (t < tile_len) {
                const int position = tile + t;
                const long long block = table[position / block_size];
                const int offset = position % block_size;
                const long long at =
                    block * block_stride + ((long long)offset * num_kv_heads + kv_head) * head_dim + 4 * c;
                k4 = *reinterpret_cast<const float4*>(k_cache + at);
                v4 = *reinterpret_cast<const float4*>(v_cache + at);
            }
            *reinterpret_cast<float4*>(k_tile + t * row + 4 * c) = k4;
            *reinterpret_cast<float4*>(v_tile + t * row + 4 * c) = v4;
        }
        __syncthreads();

        // 2. Scores and the online-softmax update, one warp per query head j, one lane per token:
        //    s = scale * q_j . k_t; m' = max(m, max_t s); p_t = exp(s - m');
        //    l' = l * exp(m - m') + sum_t p_t. Every lane computes the same m', l'; lane 0 stores
        //    them after both reductions, which every lane's read of run_max[j] feeds.
        for (int j = warp; j < group; j += NUM_WARPS) {
            float score = negative_infinity();
            if (lane < tile_len) {
                const float4* qv = reinterpret_cast<const float4*>(q_heads + j * head_dim);
                const float4* kv = reinterpret_cast<const float4*>(k_tile + lane * row);
                float dot = 0.0f;
                for (int c = 0; c < vecs_per_row; ++c) dot += dot4(qv[c], kv[c]);
                score = dot * scale;
            }
            const float old_max = run_max[j];
            const float new_max = fmaxf(old_max, warp_max(score));  // finite: lane 0 is in range
            const float p = lane < tile_len ? expf(score - new_max) : 0.0f;
            const float tile_sum = warp_sum(p);
            probs[j * TILE_TOKENS + lane] = p;
            if (lane == 0) {
                const float factor = expf(old_max - new_max);  // 0 on the first tile (m = -inf)
                rescale[j] = factor;
                run_sum[j] = run_sum[j] * factor + tile_sum;
                run_max[j] = new_max;
            }
        }
        __syncthreads();

        // 3. acc_j = acc_j * exp(m - m') + sum_t p_t v_t: vector i is (head j = i / vecs_per_row,
        //    float4 c = i % vecs_per_row); each thread owns its acc entries, so no races.
        for (int i = threadIdx.x; i < group * vecs_per_row; i += NUM_THREADS) {
            const int j = i / vecs_per_row;
            const int c = i - j * vecs_per_row;
            float4* a4 = reinterpret_cast<float4*>(acc + j * head_dim + 4 * c);
            float4 a = *a4;
            const float factor = rescale[j];
            a.x *= factor;
            a.y *= factor;
            a.z *= factor;
            a.w *= factor;
            for (int t = 0; t < tile_len; ++t) {
                const float p = probs[j * TILE_TOKENS + t];
                const float4 v = *reinterpret_cast<const float4*>(v_tile + t * row + 4 * c);
                a.x += p * v.x;
                a.y += p * v.y;
                a.z += p * v.z;
                a.w += p * v.w;
            }
            *a4 = a;
        }
    }
    __syncthreads();  // acc and the softmax state of the last tile are complete

    // Head j of this group is query head h = kv_head * group + j.
    const long long first_head = (long long)seq * num_heads + kv_head * group;
    if (num_partitions == 1) {
        for (int i = threadIdx.x; i < group * head_dim; i += NUM_THREADS)
            out[first_head * head_dim + i] = acc[i] / run_sum[i / head_dim];
        return;
    }
    for (int i = threadIdx.x; i < group * head_dim; i += NUM_THREADS) {
        const int j = i / head_dim;
        const int d = i - j * head_dim;
        partial_acc[((first_head + j) * num_partitions + partition) * head_dim + d] = acc[i];
    }
    for (int j = threadIdx.x; j < group; j += NUM_THREADS) {
        partial_max[(first_head + j) * num_partitions + partition] = run_max[j];
        partial_sum[(first_head + j) * num_partitions + partition] = run_sum[j];
    }
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS) paged_attention_reduce(
    float* __restrict__ out,
    const float* __restrict__ partial_max,
    const float* __restrict__ partial_sum,
    const float* __restrict__ partial_acc,
    const int* __restrict__ context_lens,
    int head_dim,
    int num_partitions,
    int partition_size,
    int sliding_window) {
    const int seq = blockIdx.x;
    const int head = blockIdx.y;
    const int num_heads = gridDim.y;
    const long long seq_head = (long long)seq * num_heads + head;
    const int context_len = context_lens[seq];
    const int first = sliding_window > 0 && context_len > sliding_window ? context_len - sliding_window : 0;
    const int used = (context_len - first + partition_size - 1) / partition_size;
    const float* m = partial_max + seq_head * num_partitions;
    const float* l = partial_sum + seq_head * num_partitions;
    const float* acc = partial_acc + seq_head * num_partitions * head_dim;

    float global_max = negative_infinity();
    for (int p = 0; p < used; ++p) global_max = fmaxf(global_max, m[p]);
    float total = 0.0f;
    for (int p = 0; p < used; ++p) total += l[p] * expf(m[p] - global_max);

    for (int d = threadIdx.x; d < head_dim; d += NUM_THREADS) {
        float sum = 0.0f;
        for (int p = 0; p < used; ++p) sum += acc[p * head_dim + d] * expf(m[p] - global_max);
        out[seq_head * head_dim + d] = sum / total;
    }
}
