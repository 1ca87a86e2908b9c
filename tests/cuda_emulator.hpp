// Just enough of CUDA's device model, in C++20, to run mie's kernels on the CPU in tests.
//
// Every CUDA thread of a thread block is a std::thread; the threads walk the grid one thread
// block at a time. __syncthreads is a barrier over the thread block, warp shuffles exchange
// values through a per-warp buffer between two warp barriers, and shared memory is one buffer
// that is poisoned with NaNs before each thread block (so a read of shared memory that was
// never written shows up as NaN). This checks indexing, synchronisation structure and the
// arithmetic; it says nothing about speed, coalescing or the real compiler.
#pragma once

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

struct alignas(16) float4 {
    float x, y, z, w;
};

inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

inline float __int_as_float(int bits) {
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }

using std::max;
using std::min;

namespace emu {

constexpr int kWarpSize = 32;
constexpr std::size_t kSharedBytes = 64 * 1024;

struct Launch {
    dim3 grid, block;
    std::barrier<>* block_barrier;
    std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
    std::vector<float> warp_exchange;  // kWarpSize slots per warp, 4 bytes per value
};

inline Launch* current = nullptr;
alignas(16) inline unsigned char shared_memory[kSharedBytes];
inline thread_local dim3 thread_index, block_index;

inline void sync_threads() { current->block_barrier->arrive_and_wait(); }

template <typename T>
T shfl_xor(T value, int lane_mask) {
    static_assert(sizeof(T) == sizeof(float));
    const unsigned linear = thread_index.x + current->block.x * (thread_index.y + current->block.y * thread_index.z);
    const unsigned warp = linear / kWarpSize, lane = linear % kWarpSize;
    std::barrier<>& warp_barrier = *current->warp_barriers[warp];
    float* slots = current->warp_exchange.data() + warp * kWarpSize;
    std::memcpy(&slots[lane], &value, sizeof value);
    warp_barrier.arrive_and_wait();
    T result;
    std::memcpy(&result, &slots[lane ^ lane_mask], sizeof result);
    warp_barrier.arrive_and_wait();
    return result;
}

// Run `kernel` over the grid: one std::thread per CUDA thread, one thread block at a time.
inline void launch(dim3 grid, dim3 block, std::size_t shared_bytes, const std::function<void()>& kernel) {
    const unsigned threads = block.x * block.y * block.z;
    if (threads % kWarpSize != 0 || shared_bytes > kSharedBytes) std::abort();
    std::barrier<> block_barrier(threads);
    Launch state{grid, block, &block_barrier, {}, std::vector<float>(threads)};
    for (unsigned w = 0; w < threads / kWarpSize; ++w)
        state.warp_barriers.push_back(std::make_unique<std::barrier<>>(kWarpSize));
    current = &state;
    std::vector<std::thread> workers;
    for (unsigned linear = 0; linear < threads; ++linear) {
        workers.emplace_back([&, linear] {
            thread_index = {linear % block.x, linear / block.x % block.y, linear / (block.x * block.y)};
            for (unsigned z = 0; z < grid.z; ++z)
                for (unsigned y = 0; y < grid.y; ++y)
                    for (unsigned x = 0; x < grid.x; ++x) {
                        if (linear == 0) std::memset(shared_memory, 0xff, kSharedBytes);  // NaN
                        block_barrier.arrive_and_wait();
                        block_index = {x, y, z};
                        kernel();
                        block_barrier.arrive_and_wait();  // the whole block is done
                    }
        });
    }
    for (std::thread& worker : workers) worker.join();
    current = nullptr;
}

}  // namespace emu

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __align__(n) alignas(n)
#define threadIdx (emu::thread_index)
#define blockIdx (emu::block_index)
#define blockDim (emu::current->block)
#define gridDim (emu::current->grid)
#define __syncthreads() emu::sync_threads()
#define __shfl_xor_sync(mask, value, lane_mask) emu::shfl_xor(value, lane_mask)
