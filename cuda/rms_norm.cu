// RMSNorm over the last axis: mie.ops.rms_norm in CUDA.
//
//   out[r, i] = (x[r, i] / sqrt(mean_i(x[r, i]^2) + eps)) * weight[i]
//
// Layout (element = one float32): x and out (num_rows, hidden), contiguous (every leading axis
// of the NumPy op flattened into rows); weight (hidden,).
//
// Launch geometry: grid (num_rows,), NUM_THREADS threads, no dynamic shared memory. Block r
// owns row r: each thread sums the squares of elements threadIdx.x, threadIdx.x + NUM_THREADS,
// ... (consecutive threads read consecutive floats: coalesced), the sum is reduced within each
// warp by shuffles and across the NUM_WARPS warps through shared memory, then every thread
// scales its own elements.

#define WARP_SIZE 32
#define NUM_THREADS 128
#define NUM_WARPS (NUM_THREADS / WARP_SIZE)

__device__ __forceinline__ float warp_sum(float x) {
    for (int mask = WARP_SIZE / 2; mask > 0; mask /= 2)
        x += __shfl_xor_sync(0xffffffffu, x, mask);
    return x;
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS) rms_norm(
    float* __restrict__ out,
    const float* __restrict__ x,
    const float* __restrict__ weight,
    int hidden,
    float eps) {
    __shared__ float warp_sums[NUM_WARPS];
    const long long row = (long long)blockIdx.x * hidden;

    float squares = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += NUM_THREADS) squares += x[row + i] * x[row + i];
    squares = warp_sum(squares);
    if (threadIdx.x % WARP_SIZE == 0) warp_sums[threadIdx.x / WARP_SIZE] = squares;
    __syncthreads();
    float total = 0.0f;
    for (int w = 0; w < NUM_WARPS; ++w) total += warp_sums[w];

    const float norm = sqrtf(total / hidden + eps);
    for (int i = threadIdx.x; i < hidden; i += NUM_THREADS) out[row + i] = (x[row + i] / norm) * weight[i];
}
