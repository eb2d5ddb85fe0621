#pragma once
// A CPU emulation of the CUDA execution model, just large enough to run kvcache's kernels
// (cuda/*_kernels.cuh) in a host test on machines without a GPU: every block of a grid runs in
// turn on one set of std::threads (one per CUDA thread), __syncthreads / __syncwarp are barriers,
// warp shuffles go through a per-warp exchange buffer, __shared__ variables are statics (one
// block runs at a time). It checks the kernels' *logic* (indexing, softmax merging, quantization
// arithmetic) against the CPU references; it says nothing about nvcc's code generation, memory
// coherence, performance or the real hardware, which only a GPU run can check.
//
// Include this header before the kernel headers, and nothing from the CUDA toolkit.

#include <kvcache/half.hpp>

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

/// CUDA's launch-dimension type.
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) noexcept : x(a), y(b), z(c) {}
};

namespace kvcache_emu {

/// Barriers and shuffle buffers of the block being run.
struct block_context {
  explicit block_context(unsigned threads) : block(static_cast<std::ptrdiff_t>(threads)) {
    const unsigned warps = (threads + 31) / 32;
    for (unsigned w = 0; w < warps; ++w) {
      const unsigned n = std::min(32u, threads - 32 * w);
      warp.push_back(std::make_unique<std::barrier<>>(static_cast<std::ptrdiff_t>(n)));
    }
    exchange.resize(static_cast<std::size_t>(warps) * 32);
  }
  std::barrier<> block;
  std::vector<std::unique_ptr<std::barrier<>>> warp;
  std::vector<std::uint64_t> exchange;  // [warp][lane] one shuffled value
};

inline thread_local block_context* current = nullptr;

}  // namespace kvcache_emu

inline thread_local dim3 threadIdx;
inline thread_local dim3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

inline void __syncthreads() { kvcache_emu::current->block.arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { kvcache_emu::current->warp[threadIdx.x / 32]->arrive_and_wait(); }

namespace kvcache_emu {
template <class T>
T shuffle(T v, unsigned src_lane) {
  static_assert(sizeof(T) <= 8);
  block_context& c = *current;
  const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  std::memcpy(&c.exchange[warp * 32 + lane], &v, sizeof(T));
  c.warp[warp]->arrive_and_wait();
  T r;
  std::memcpy(&r, &c.exchange[warp * 32 + (src_lane & 31u)], sizeof(T));
  c.warp[warp]->arrive_and_wait();  // nobody overwrites the buffer before everyone has read
  return r;
}
}  // namespace kvcache_emu

template <class T>
T __shfl_sync(unsigned, T v, unsigned src_lane) {
  return kvcache_emu::shuffle(v, src_lane);
}
template <class T>
T __shfl_xor_sync(unsigned, T v, int mask) {
  return kvcache_emu::shuffle(v, (threadIdx.x % 32) ^ static_cast<unsigned>(mask));
}

// Round-to-nearest float intrinsics: IEEE operations on the host (the emulated TU is compiled
// with -ffp-contract=off, so nothing is fused).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline std::uint32_t min(std::uint32_t a, std::uint32_t b) { return a < b ? a : b; }

// The few cuda_fp16.h / vector types the kernels use.
struct __half {
  std::uint16_t bits;
};
struct __half2 {
  __half x, y;
};
struct float2 {
  float x, y;
};
struct uint4 {
  unsigned x, y, z, w;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
inline __half __ushort_as_half(std::uint16_t u) { return __half{u}; }
inline float __half2float(__half h) { return kvcache::f16_bits_to_f32(h.bits); }
inline float2 __half22float2(__half2 h) { return float2{__half2float(h.x), __half2float(h.y)}; }
/// Byte n of the result: byte (s >> 4 n) & 7 of the eight bytes x (0..3), y (4..7).
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const std::uint64_t v = (static_cast<std::uint64_t>(y) << 32) | x;
  unsigned r = 0;
  for (unsigned n = 0; n < 4; ++n) r |= static_cast<unsigned>((v >> (8 * ((s >> (4 * n)) & 7u))) & 0xffu) << (8 * n);
  return r;
}
inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

namespace kvcache_emu {

/// Runs `kernel(args...)` over `grid` blocks of `block.x` threads; returns ok (result-like, so
/// it plugs into the launch_* templates of the kernel headers). The block's threads are created
/// once per launch and run the blocks one after the other, separated by a barrier. Every
/// __syncthreads / __syncwarp / shuffle of kvcache's kernels is reached by all threads of the
/// block (or warp) or by none, which is what lets finished threads simply wait at the end.
template <class Result, class K, class... A>
Result launch(K kernel, dim3 grid, dim3 block, A... args) {
  gridDim = grid;
  blockDim = block;
  const unsigned threads = block.x * block.y * block.z;
  block_context ctx(threads);
  std::barrier<> block_done(static_cast<std::ptrdiff_t>(threads));
  std::vector<std::thread> ts;
  ts.reserve(threads);
  for (unsigned t = 0; t < threads; ++t)
    ts.emplace_back([&, t] {
      threadIdx = dim3(t);
      current = &ctx;
      for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
          for (unsigned bx = 0; bx < grid.x; ++bx) {
            blockIdx = dim3(bx, by, bz);
            kernel(args...);
            block_done.arrive_and_wait();  // the next block reuses the __shared__ statics
          }
    });
  for (std::thread& th : ts) th.join();
  return Result{};
}

}  // namespace kvcache_emu
