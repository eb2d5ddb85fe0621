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

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>

#include <kvcache/detail/storage.hpp>
#include <kvcache/half.hpp>
#include <kvcache/isa.hpp>

namespace kvcache::bench {

/// Name of the counter that marks a copy-like benchmark (compared with BM_memcpy).
inline constexpr const char* copy_like_counter = "copy_like";

/// Marks the running benchmark as copy-like: the report compares it with BM_memcpy.
inline void compare_to_memcpy(benchmark::State& state) { state.counters[copy_like_counter] = 1; }

/// Bytes a benchmark that streams a cache (or a copy of its store) reads in turn, at least (in
/// the data's own format), so that no layer is still in the CPU's caches when its turn comes
/// again: 4x the L3 of this project's first machines (32 MiB). Session 42's Intel VM reports
/// 480 MiB of L3, shared with other guests: a throwaway read of 48 MiB (huge pages, best of 7
/// passes) ran at 25 GB/s, of 96 MiB and more at 16-17 GB/s, its memory's speed.
inline constexpr std::size_t stream_bytes = std::size_t{128} << 20;

/// Layers (or copies) of `layer_bytes` each that make stream_bytes: at least one.
inline std::uint32_t layers_for_bytes(std::size_t layer_bytes) {
  return static_cast<std::uint32_t>(std::max<std::size_t>(1, (stream_bytes + layer_bytes - 1) / layer_bytes));
}

/// Zero-filled (so every page is touched before timing) heap buffer, allocated as the caches
/// allocate their storage (detail::allocate_storage): from one huge page (2 MiB) up, aligned to
/// a huge page and backed by huge pages where the OS grants them, else 64-byte aligned. The
/// baselines then read the same kind of pages as attention reads: on a machine with transparent
/// huge pages in "madvise" mode (Debian's default), a 256 MiB read from 4 KiB pages ran at 0.6-0.7
/// of the same read from huge pages (session 42, Intel, `BM_read` 10.4 GB/s vs 17 in a throwaway
/// program), which made attention over the caches' huge pages read at "1.7x the read bandwidth".
class buffer {
 public:
  buffer() = default;
  explicit buffer(std::size_t bytes) : bytes_(bytes), ptr_(kvcache::detail::allocate_storage(padded(bytes))) {
    if (ptr_) std::memset(ptr_.get(), 0, padded(bytes));
  }
  /// The storage as an array of T. // [bytes / sizeof(T)]
  template <class T>
  [[nodiscard]] T* as() const noexcept { return reinterpret_cast<T*>(ptr_.get()); }
  [[nodiscard]] std::size_t size() const noexcept { return bytes_; }
  [[nodiscard]] explicit operator bool() const noexcept { return ptr_ != nullptr; }

 private:
  // Whole cache lines, plus one line of slack past the end.
  static constexpr std::size_t padded(std::size_t bytes) noexcept { return (bytes + 63) / 64 * 64 + 64; }
  std::size_t bytes_ = 0;
  kvcache::detail::storage ptr_;
};

/// N(0, sd) values from a fixed seed (benchmarks are reproducible), by the polar method on the
/// generator's raw bits. Not std::normal_distribution: its uniforms come from
/// std::generate_canonical, which in libstdc++ 12 computes log2 of the generator's range in long
/// double on every call; GCC folds that constant, Clang 14 does not, and the benchmarks' set-up
/// (filling caches of up to 128 MiB) ran six times slower built by Clang (two logl a uniform).
class normal_source {
 public:
  explicit normal_source(std::uint64_t seed, float sd = 1.0f) : rng_(seed), sd_(sd) {}
  float operator()() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    float u = 0.0f, v = 0.0f, r = 0.0f;
    do {
      u = uniform();
      v = uniform();
      r = u * u + v * v;
    } while (r >= 1.0f || r == 0.0f);
    const float f = sd_ * std::sqrt(-2.0f * std::log(r) / r);
    spare_ = v * f;
    has_spare_ = true;
    return u * f;
  }

 private:
  // Uniform in [-1, 1) on a grid of 2^-23: the top 24 bits of one draw.
  float uniform() { return static_cast<float>(static_cast<std::int32_t>(rng_() >> 40) - (1 << 23)) * 0x1p-23f; }
  std::mt19937_64 rng_;
  float sd_;
  float spare_ = 0.0f;
  bool has_spare_ = false;
};

/// Fills n floats with N(0, sd) values from a fixed seed.
inline void fill_normal(float* p, std::size_t n, float sd = 1.0f, std::uint64_t seed = 42) {
  normal_source nd(seed, sd);
  for (std::size_t i = 0; i < n; ++i) p[i] = nd();
}

/// Fills n halves with N(0, sd) values from a fixed seed.
inline void fill_normal(half* p, std::size_t n, float sd = 1.0f, std::uint64_t seed = 42) {
  normal_source nd(seed, sd);
  for (std::size_t i = 0; i < n; ++i) p[i] = to_half(nd());
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
