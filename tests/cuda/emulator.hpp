#pragma once
// A CPU emulation of the CUDA execution model, just large enough to run kvcache's kernels
// (cuda/*_kernels.cuh) in a host test on machines without a GPU: every block of a grid runs in
// turn, its CUDA threads as fibers (ucontext) on the calling thread, switched cooperatively at
// __syncthreads / __syncwarp / warp shuffles, which are counting barriers; shuffles go through a
// per-warp exchange buffer, __shared__ variables are statics (one block runs at a time). It checks
// the kernels' *logic* (indexing, softmax merging, quantization arithmetic) against the CPU
// references; it says nothing about nvcc's code generation, memory coherence, performance or the
// real hardware, which only a GPU run can check.
//
// Fibers, not one std::thread per CUDA thread (as this emulation had before): every barrier of a
// block of 128 threads took as many context switches of the kernel's scheduler on a 2-core CI
// machine, and the emulated tests were a third of CI's time under the sanitizers. Under
// AddressSanitizer every switch is announced (__sanitizer_start_switch_fiber /
// __sanitizer_finish_switch_fiber), so that it tracks each fiber's stack.
//
// Include this header before the kernel headers, and nothing from the CUDA toolkit.

#include <kvcache/half.hpp>

#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define KVCACHE_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVCACHE_EMU_ASAN 1
#endif
#endif
#if defined(KVCACHE_EMU_ASAN)
#include <sanitizer/common_interface_defs.h>
#endif

/// CUDA's launch-dimension type.
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) noexcept : x(a), y(b), z(c) {}
};

namespace kvcache_emu {

/// A counting barrier of the fibers of one block (all its threads, or one warp's).
struct barrier {
  unsigned count = 0;       // participants
  unsigned arrived = 0;     // of the current generation
  unsigned generation = 0;  // barriers completed
};

/// One CUDA thread of the block being run. Fibers are kept per host thread and reused by every
/// block of every launch: each runs the kernel, marks itself finished and returns to the
/// scheduler, which resumes it for the next block (AddressSanitizer's fake stack of a fiber, with
/// detect_stack_use_after_return, is a fresh mapping of several megabytes per fiber otherwise).
struct fiber {
  ucontext_t context{};
  void* stack = nullptr;
  const barrier* waits_on = nullptr;  // runnable again once its generation moves past wait_generation
  unsigned wait_generation = 0;
  bool finished = false;
};

/// The block being run: its fibers, barriers and shuffle buffers, and the scheduler's context.
struct block_context {
  ucontext_t scheduler{};
  std::vector<fiber*> fibers;  // [threadIdx.x]; the one being run is fibers[threadIdx.x]
  barrier block;
  std::vector<barrier> warp;
  std::vector<std::uint64_t> exchange;  // [warp][lane] one shuffled value
  std::vector<std::uint32_t> fragments;  // [warp][lane][6] the operands of a warp's mma (A, B)
  void (*body)(void*) = nullptr;        // runs the kernel for the current threadIdx / blockIdx
  void* body_arg = nullptr;
};

inline thread_local block_context* current = nullptr;

#if defined(KVCACHE_EMU_ASAN)
/// The host thread's own stack (the scheduler's), as AddressSanitizer reports it when a fiber
/// starts or resumes.
inline thread_local const void* scheduler_stack = nullptr;
inline thread_local std::size_t scheduler_stack_size = 0;
#endif

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

namespace kvcache_emu {

/// From the running fiber back to the scheduler; returns when the scheduler resumes it (in a
/// later launch, for a finished fiber: `current` is then another block_context).
inline void to_scheduler() {
  block_context& c = *current;
  fiber& f = *c.fibers[threadIdx.x];
#if defined(KVCACHE_EMU_ASAN)
  void* fake_stack = nullptr;
  __sanitizer_start_switch_fiber(&fake_stack, scheduler_stack, scheduler_stack_size);
#endif
  swapcontext(&f.context, &c.scheduler);
#if defined(KVCACHE_EMU_ASAN)
  __sanitizer_finish_switch_fiber(fake_stack, &scheduler_stack, &scheduler_stack_size);
#endif
}

/// Arrives at b and returns once all its participants have.
inline void arrive_and_wait(barrier& b) {
  const unsigned generation = b.generation;
  if (++b.arrived == b.count) {
    b.arrived = 0;
    ++b.generation;
    return;
  }
  fiber& f = *current->fibers[threadIdx.x];
  f.waits_on = &b;
  f.wait_generation = generation;
  to_scheduler();
}

}  // namespace kvcache_emu

inline void __syncthreads() { kvcache_emu::arrive_and_wait(kvcache_emu::current->block); }
inline void __syncwarp(unsigned = 0xffffffffu) { kvcache_emu::arrive_and_wait(kvcache_emu::current->warp[threadIdx.x / 32]); }

namespace kvcache_emu {
template <class T>
T shuffle(T v, unsigned src_lane) {
  static_assert(sizeof(T) <= 8);
  block_context& c = *current;
  const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  std::memcpy(&c.exchange[warp * 32 + lane], &v, sizeof(T));
  arrive_and_wait(c.warp[warp]);
  T r;
  std::memcpy(&r, &c.exchange[warp * 32 + (src_lane & 31u)], sizeof(T));
  arrive_and_wait(c.warp[warp]);  // nobody overwrites the buffer before everyone has read
  return r;
}

/// mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 of the calling warp, d += A B: each lane
/// publishes its fragments (A 16x16 row-major in a[0..3], B 16x8 in b0, b1: two f16 per register,
/// the lower-indexed element in the low half), then computes its own four accumulators (rows
/// lane / 4 and lane / 4 + 8, columns 2 (lane % 4) and 2 (lane % 4) + 1), per the PTX ISA's
/// "Matrix Fragments for mma.m16n8k16 with floating point type". The products of two halves are
/// exact in float; they are summed in double and added to d once (the hardware's rounding of the
/// sum may differ in the last bit).
inline void mma_m16n8k16(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1) {
  block_context& c = *current;
  const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  std::uint32_t* mine = &c.fragments[(warp * 32 + lane) * 6];
  for (int i = 0; i < 4; ++i) mine[i] = a[i];
  mine[4] = b0;
  mine[5] = b1;
  arrive_and_wait(c.warp[warp]);
  const std::uint32_t* all = &c.fragments[warp * 32 * 6];
  auto half_of = [](std::uint32_t reg, unsigned k) {
    return static_cast<double>(kvcache::f16_bits_to_f32(static_cast<std::uint16_t>(reg >> (16 * (k & 1u)))));
  };
  const unsigned g = lane / 4, t = lane % 4;
  for (unsigned i = 0; i < 4; ++i) {
    const unsigned row = g + 8 * (i / 2), col = 2 * t + (i % 2);
    double sum = 0.0;
    for (unsigned k = 0; k < 16; ++k) {
      const unsigned src = (k % 8) / 2;  // threadID_in_group holding column (A) or row (B) k
      const std::uint32_t areg = all[(4 * (row % 8) + src) * 6 + (row / 8) + 2 * (k / 8)];
      const std::uint32_t breg = all[(4 * col + src) * 6 + 4 + k / 8];
      sum += half_of(areg, k) * half_of(breg, k);
    }
    d[i] = static_cast<float>(static_cast<double>(d[i]) + sum);
  }
  arrive_and_wait(c.warp[warp]);  // nobody overwrites the fragments before everyone has read
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
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

namespace kvcache_emu {

/// Bytes reserved for each fiber's stack; only the pages a kernel touches are ever backed.
inline constexpr std::size_t fiber_stack_bytes = std::size_t{1} << 20;

/// A fiber's life: run the kernel for the current block and thread, mark itself finished, return
/// to the scheduler; again when the scheduler resumes it for the next block.
inline void fiber_main() {
#if defined(KVCACHE_EMU_ASAN)
  __sanitizer_finish_switch_fiber(nullptr, &scheduler_stack, &scheduler_stack_size);
#endif
  for (;;) {
    block_context& c = *current;
    c.body(c.body_arg);
    c.fibers[threadIdx.x]->finished = true;
    to_scheduler();
  }
}

/// Makes f start at fiber_main on its stack. Out of line: getcontext returns twice, which would
/// make GCC warn about (and keep in memory) every local variable of its caller.
[[gnu::noinline]] inline void start_fiber(fiber& f) {
  getcontext(&f.context);
  f.context.uc_stack.ss_sp = f.stack;
  f.context.uc_stack.ss_size = fiber_stack_bytes;
  f.context.uc_link = nullptr;
  makecontext(&f.context, fiber_main, 0);
  // uc_stack is makecontext's input only. AddressSanitizer's swapcontext clears the shadow of the
  // target context's uc_stack on every switch (a fiber's whole stack, each time): with none
  // recorded it leaves each fiber's shadow to the switch annotations, as it should.
  f.context.uc_stack.ss_sp = nullptr;
  f.context.uc_stack.ss_size = 0;
}

/// This host thread's fibers: at(i) is the fiber of CUDA thread i, made on first use.
class fiber_pool {
 public:
  fiber_pool() = default;
  fiber_pool(const fiber_pool&) = delete;
  fiber_pool& operator=(const fiber_pool&) = delete;
  ~fiber_pool() {
    for (auto& f : fibers_) munmap(f->stack, fiber_stack_bytes);
  }
  fiber* at(unsigned i) {
    while (fibers_.size() <= i) {
      auto f = std::make_unique<fiber>();  // never moves: getcontext's state points into itself
      f->stack = mmap(nullptr, fiber_stack_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (f->stack == MAP_FAILED) {
        std::fputs("kvcache_emu: no memory for a fiber's stack\n", stderr);
        std::abort();
      }
      start_fiber(*f);
      fibers_.push_back(std::move(f));
    }
    return fibers_[i].get();
  }

 private:
  std::vector<std::unique_ptr<fiber>> fibers_;
};
inline fiber_pool& fibers() {
  thread_local fiber_pool pool;
  return pool;
}

/// Runs `kernel(args...)` over `grid` blocks of `block.x` threads; returns ok (result-like, so
/// it plugs into the launch_* templates of the kernel headers). The blocks run one after the
/// other; a block's threads are fibers that the scheduler below runs in turn, each until it
/// waits at a barrier (or returns), skipping those whose barrier is still incomplete. Every
/// __syncthreads / __syncwarp / shuffle of kvcache's kernels is reached by all threads of the
/// block (or warp) or by none; a kernel that breaks this leaves every fiber waiting, which is
/// reported and aborts the test.
template <class Result, class K, class... A>
Result launch(K kernel, dim3 grid, dim3 block, A... args) {
  gridDim = grid;
  blockDim = block;
  const unsigned threads = block.x * block.y * block.z;
  const unsigned warps = (threads + 31) / 32;
  block_context c;
  for (unsigned t = 0; t < threads; ++t) c.fibers.push_back(fibers().at(t));
  c.block.count = threads;
  c.warp.resize(warps);
  for (unsigned w = 0; w < warps; ++w) c.warp[w].count = std::min(32u, threads - 32 * w);
  c.exchange.resize(static_cast<std::size_t>(warps) * 32);
  c.fragments.resize(static_cast<std::size_t>(warps) * 32 * 6);
  auto body = [&] { kernel(args...); };
  c.body = [](void* b) { (*static_cast<decltype(body)*>(b))(); };
  c.body_arg = &body;
  current = &c;
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        blockIdx = dim3(bx, by, bz);
        for (fiber* f : c.fibers) {
          f->waits_on = nullptr;
          f->finished = false;
        }
        for (unsigned left = threads; left > 0;) {
          bool ran = false;
          for (unsigned t = 0; t < threads; ++t) {
            fiber& f = *c.fibers[t];
            if (f.finished) continue;
            if (f.waits_on != nullptr) {
              if (f.waits_on->generation == f.wait_generation) continue;
              f.waits_on = nullptr;
            }
            ran = true;
            threadIdx = dim3(t);
#if defined(KVCACHE_EMU_ASAN)
            void* fake_stack = nullptr;
            __sanitizer_start_switch_fiber(&fake_stack, f.stack, fiber_stack_bytes);
#endif
            swapcontext(&c.scheduler, &f.context);
#if defined(KVCACHE_EMU_ASAN)
            __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
#endif
            if (f.finished) --left;
          }
          if (!ran) {
            std::fprintf(stderr, "kvcache_emu: block (%u, %u, %u): %u threads wait at barriers that the others never reach\n",
                         bx, by, bz, left);
            std::abort();
          }
        }
      }
  current = nullptr;
  return Result{};
}

}  // namespace kvcache_emu
