// Write new tokens' K and V into their cache slots: mie.ops.reshape_and_cache in CUDA.
//
//   for token t: block = slot_mapping[t] / block_size, offset = slot_mapping[t] % block_size
//                k_cache[block, offset] = k[t];  v_cache[block, offset] = v[t]
//
// Layout (element = one float32):
//   k, v          (num_tokens, num_kv_heads, head_dim), contiguous; row_len = num_kv_heads * head_dim.
//   k_cache       one layer's K: slot (block b, offset o) is the row_len contiguous floats at
//                   k_cache[b * block_stride + o * row_len]
//                 (see paged_attention.cu for how block_stride follows from mie's arena).
//   v_cache       the same for V, same block_stride.
//   slot_mapping  (num_tokens,) int64, each in [0, num_blocks * block_size).
//   row_len % 4 == 0 (rows are copied as float4).
//
// Launch geometry: grid (num_tokens,), NUM_THREADS threads, no shared memory. Block t copies
// token t's K and V rows; consecutive threads copy consecutive float4s of a row, so both the
// reads and the writes are coalesced.

#define NUM_THREADS 128

extern "C" __global__ void __launch_bounds__(NUM_THREADS) reshape_and_cache(
    float* __restrict__ k_cache,
    float* __restrict__ v_cache,
    const float* __restrict__ k,
    const float* __restrict__ v,
    const long long* __restrict__ slot_mapping,
    int row_len,
    int block_size,
    long long block_stride) {
    const int token = blockIdx.x;
    const long long slot = slot_mapping[token];
    const long long block = slot / block_size;
    const long long offset = slot % block_size;
    const long long src = (long long)token * row_len;
    const long long dst = block * block_stride + offset * row_len;
    for (int c = threadIdx.x; c < row_len / 4; c += NUM_THREADS) {
        reinterpret_cast<float4*>(k_cache + dst)[c] = reinterpret_cast<const float4*>(k + src)[c];
        reinterpret_cast<float4*>(v_cache + dst)[c] = reinterpret_cast<const float4*>(v + src)[c];
    }
}
