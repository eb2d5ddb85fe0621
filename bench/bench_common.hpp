#pragma once
// Shared conventions of kvcache_bench (one binary built from every bench/*.cpp).
//
// Registering a benchmark: use BENCHMARK(...) or benchmark::RegisterBenchmark in any bench/*.cpp
// (per-ISA variants: register one per ISA in kvcache::kernels::find(i) != nullptr, at static
// initialisation, e.g. with a `const bool registered = [] { ...; return true; }();`).
//   - Name it `BM_<op>/<cache>/<format>/<isa>` (drop parts that do not apply), e.g.
//     BM_scores/f16/avx512/nq:4, BM_append/paged/f16, BM_attend/two_tier/q4/avx512/tokens:32768.
//   - Call state.SetBytesProcessed(<bytes the op must move: read + written>) on every benchmark,
//     and SetItemsProcessed where values/s or tokens/s is the figure of merit.
//   - Prefer ->UseRealTime() (the baselines use it; multi-threaded results then read correctly).
//
// Baselines and the report: main() (bench_main.cpp) accepts `--kvcache_report`. After the run it
// prints one line per benchmark with its GB/s, items/s and its ratio to a baseline measured in the
// same run with the same thread count:
//   - BM_memcpy (bytes read + bytes written) for copy-like benchmarks: those that call
//     kvcache::bench::compare_to_memcpy(state) (sets the counter "copy_like" = 1);
//   - BM_read (bytes read) for every other benchmark.
// It also prints GB/s over the run's CPU time and that ratio: on a shared, loaded machine these
// approximate an unloaded core (memory-bound runs still share the memory bandwidth).
// Baselines: BM_read and BM_memcpy over 256 MiB (well beyond the caches), 1 and 2 threads
// (BM_read/real_time/threads:2 ...). Their names start with "BM_read" / "BM_memcpy".
#include <benchmark/benchmark.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>

#include <kvcache/half.hpp>
#include <kvcache/isa.hpp>

namespace kvcache::bench {

/// Name of the counter that marks a copy-like benchmark (compared with BM_memcpy).
inline constexpr const char* copy_like_counter = "copy_like";

/// Marks the running benchmark as copy-like: the report compares it with BM_memcpy.
inline void compare_to_memcpy(benchmark::State& state) { state.counters[copy_like_counter] = 1; }

/// 64-byte aligned, zero-filled (so every page is touched before timing) heap buffer.
class buffer {
 public:
  buffer() = default;
  explicit buffer(std::size_t bytes) : bytes_(bytes) {
    const std::size_t rounded = (bytes + 63) / 64 * 64 + 64;
    ptr_.reset(static_cast<std::byte*>(std::aligned_alloc(64, rounded)));
    if (ptr_) std::memset(ptr_.get(), 0, rounded);
  }
  /// The storage as an array of T. // [bytes / sizeof(T)]
  template <class T>
  [[nodiscard]] T* as() const noexcept { return reinterpret_cast<T*>(ptr_.get()); }
  [[nodiscard]] std::size_t size() const noexcept { return bytes_; }
  [[nodiscard]] explicit operator bool() const noexcept { return ptr_ != nullptr; }

 private:
  struct deleter {
    void operator()(std::byte* p) const noexcept { std::free(p); }
  };
  std::unique_ptr<std::byte, deleter> ptr_;
  std::size_t bytes_ = 0;
};

/// Fills n floats with N(0, sd) values from a fixed seed (benchmarks are reproducible).
inline void fill_normal(float* p, std::size_t n, float sd = 1.0f, std::uint64_t seed = 42) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, sd);
  for (std::size_t i = 0; i < n; ++i) p[i] = nd(rng);
}

/// Fills n halves with N(0, sd) values from a fixed seed.
inline void fill_normal(half* p, std::size_t n, float sd = 1.0f, std::uint64_t seed = 42) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, sd);
  for (std::size_t i = 0; i < n; ++i) p[i] = to_half(nd(rng));
}

/// Makes `i` the active ISA for the lifetime of the object (ok: whether it could), then restores
/// the one before, on every way out of a benchmark.
struct isa_scope {
  isa saved = active_isa();
  bool ok = false;
  explicit isa_scope(isa i) : ok(force_isa(i).has_value()) {}
  isa_scope(const isa_scope&) = delete;
  isa_scope& operator=(const isa_scope&) = delete;
  ~isa_scope() { (void)force_isa(saved); }
};

}  // namespace kvcache::bench
