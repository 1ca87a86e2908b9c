// Rotary position embedding, Hugging Face rotate-half convention: mie.ops.rope in CUDA.
//
//   half = head_dim / 2; for i < half:
//     inv_freq_i = 1 / theta^(2i / head_dim);  angle = positions[t] * inv_freq_i   (float64)
//     c = (float)cos(angle), s = (float)sin(angle)                                  (rounded once)
//     out[t, h, i]        = x[t, h, i] * c - x[t, h, i + half] * s
//     out[t, h, i + half] = x[t, h, i + half] * c + x[t, h, i] * s
//
// which is x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x[half:], x[:half]) and
// cos/sin repeated over both halves. Angles are computed in double precision and rounded once,
// as the NumPy reference does, so long positions lose no precision.
//
// Layout (element = one float32): x and out (num_tokens, num_heads, head_dim), contiguous;
// positions (num_tokens,) int64; head_dim even.
//
// Launch geometry: grid (num_tokens,), NUM_THREADS threads, dynamic shared memory
// head_dim * 4 bytes. Block t first computes the half cos/sin pairs of its token once
// (thread i -> frequency i) into shared memory, then rotates every (head, i) pair: pair
// p = h * half + i, consecutive threads -> consecutive i of a head, so reads and writes of
// each half-row are coalesced.

#define NUM_THREADS 128

extern "C" __global__ void __launch_bounds__(NUM_THREADS) rope(
    float* __restrict__ out,
    const float* __restrict__ x,
    const long long* __restrict__ positions,
    int num_heads,
    int head_dim,
    double theta) {
    extern __shared__ float cos_sin[];  // cos of frequency i at [i], sin at [half + i]
    const int half = head_dim / 2;
    const int token = blockIdx.x;
    const double position = (double)positions[token];
    for (int i = threadIdx.x; i < half; i += NUM_THREADS) {
        const double inv_freq = 1.0 / pow(theta, (double)(2 * i) / head_dim);
        const double angle = position * inv_freq;
        cos_sin[i] = (float)cos(angle);
        cos_sin[half + i] = (float)sin(angle);
    }
    __syncthreads();

    const float* x_token = x + (long long)token * num_heads * head_dim;
    float* out_token = out + (long long)token * num_heads * head_dim;
    for (int p = threadIdx.x; p < num_heads * half; p += NUM_THREADS) {
        const int h = p / half;
        const int i = p - h * half;
        const float c = cos_sin[i];
        const float s = cos_sin[half + i];
        const float first = x_token[h * head_dim + i];
        const float second = x_token[h * head_dim + half + i];
        out_token[h * head_dim + i] = first * c - second * s;
        out_token[h * head_dim + half + i] = second * c + first * s;
    }
}
