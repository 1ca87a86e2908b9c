// The gated MLP activation: mie.ops.swiglu in CUDA.
//
//   out[i] = silu(gate[i]) * up[i],  silu(g) = g / (1 + exp(-g))
//
// (For g below about -88, exp(-g) overflows to inf and silu gives -0, as in NumPy.)
//
// Layout (element = one float32): gate, up and out are n contiguous floats (any shape,
// flattened).
//
// Launch geometry: a 1-D grid-stride loop: grid (min(ceil(n / NUM_THREADS), max_blocks),),
// NUM_THREADS threads, no shared memory; thread i handles i, i + stride, ... with
// stride = gridDim.x * NUM_THREADS, so consecutive threads touch consecutive floats.

#define NUM_THREADS 256

extern "C" __global__ void __launch_bounds__(NUM_THREADS) swiglu(
    float* __restrict__ out,
    const float* __restrict__ gate,
    const float* __restrict__ up,
    long long n) {
    const long long stride = (long long)gridDim.x * NUM_THREADS;
    for (long long i = (long long)blockIdx.x * NUM_THREADS + threadIdx.x; i < n; i += stride) {
        const float g = gate[i];
        out[i] = (g / (1.0f + expf(-g))) * up[i];
    }
}
