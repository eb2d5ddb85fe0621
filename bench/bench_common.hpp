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
// Baselines: BM_read over stream_bytes() (256 MiB at least: beyond the caches, as the attention
// benchmarks' caches are) and BM_memcpy of stream_bytes() / 2 into as much, 1 and 2 threads
// (BM_read/real_time/threads:2 ...). Their names start with "BM_read" / "BM_memcpy".
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif

#include <kvcache/detail/storage.hpp>
#include <kvcache/half.hpp>
#include <kvcache/isa.hpp>

namespace kvcache::bench {

/// Name of the counter that marks a copy-like benchmark (compared with BM_memcpy).
inline constexpr const char* copy_like_counter = "copy_like";

/// Marks the running benchmark as copy-like: the report compares it with BM_memcpy.
inline void compare_to_memcpy(benchmark::State& state) { state.counters[copy_like_counter] = 1; }

/// Bytes a benchmark that streams a cache (or a copy of its store) reads in turn, at least (in the
/// data's own format), so that no layer is still in the CPU's caches when its turn comes again:
/// twice the largest cache Google Benchmark finds (the L3; glibc's L3 or L2 size where it finds
/// none), at least 128 MiB (4x the L3 of this project's first machines), at most a sixteenth of the
/// memory (where that is known) but never below 128 MiB. It was a fixed 128 MiB until session 45,
/// whose Intel VM (480 MiB of L3, shared with other guests) kept much of that in its L3: a
/// throwaway read (huge pages, best of 7 passes) ran at 30 GB/s over 32 MiB, 24.6 over 128 MiB and
/// 16 over 512 MiB and 2 GiB, and attention over a contiguous f16 cache at 32k tokens (one 128 MiB
/// layer) read at 1.11x BM_read, over 1 GiB of layers at 0.78x (session 42 had measured 16-17 GB/s
/// from 96 MiB up on the same kind of VM: how much of the L3 a guest gets changes from day to day).
inline std::size_t stream_bytes() {
  static const std::size_t bytes = [] {
    constexpr std::size_t floor = std::size_t{128} << 20;
    std::size_t largest = 0;
    for (const auto& c : benchmark::CPUInfo::Get().caches)
      if (c.type != "Instruction" && c.size > 0) largest = std::max(largest, static_cast<std::size_t>(c.size));
#if defined(_SC_LEVEL3_CACHE_SIZE) && defined(_SC_LEVEL2_CACHE_SIZE)
    // Google Benchmark reads the caches from /sys/devices/system/cpu/cpu0/cache, which some VMs
    // lack (the Zen 5 VM of session 55: no caches found, so 128 MiB, and a 32k f16 cache of one
    // 128 MiB layer partly kept in the L3 of two cores, which read at 1.3x BM_read): glibc's
    // figures (from CPUID on x86) then.
    if (largest == 0)
      for (const long c : {::sysconf(_SC_LEVEL3_CACHE_SIZE), ::sysconf(_SC_LEVEL2_CACHE_SIZE)})
        if (c > 0) largest = std::max(largest, static_cast<std::size_t>(c));
#endif
    std::size_t b = std::max(floor, 2 * largest);
#if defined(_SC_PHYS_PAGES) && defined(_SC_PAGESIZE)
    const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
    if (pages > 0 && page > 0) {
      const std::size_t memory = static_cast<std::size_t>(pages) * static_cast<std::size_t>(page);
      b = std::min(b, std::max(floor, memory / 16));
    }
#endif
    return b;
  }();
  return bytes;
}

/// Layers (or copies) of `layer_bytes` each that make stream_bytes(): at least one.
inline std::uint32_t layers_for_bytes(std::size_t layer_bytes) {
  return static_cast<std::uint32_t>(std::max<std::size_t>(1, (stream_bytes() + layer_bytes - 1) / layer_bytes));
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

/// The streaming-read baseline (bench_baseline.cpp): BM_read reads read_buffer(), read_bytes()
/// of distinct words (256 MiB at least, stream_bytes() where that is more), with sum_words, a
/// sum in eight independent accumulators so the loop is bound by loads, not by an add chain.
/// BM_attend_paired reads slices of the same buffer with the same loop between attention steps.
std::size_t read_bytes();
const buffer& read_buffer();
std::uint64_t sum_words(const std::uint64_t* p, std::size_t n);

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

/// Fills n floats with N(0, 1) values, fast, for caches of stream_bytes() (a gigabyte and more,
/// which normal_source took tens of seconds to fill, most of a benchmark's run): runs of 1024
/// (one 8 x 128 token row) copied from a table of 2^20 values drawn once by normal_source, each
/// from an offset drawn from `seed` (splitmix64). Every value is N(0, 1) and no two rows of a
/// cache are likely alike; values within a run are independent, runs may overlap in the table.
inline void fill_normal_fast(float* p, std::size_t n, std::uint64_t seed) {
  static const std::vector<float> table = [] {
    std::vector<float> t(std::size_t{1} << 20);
    normal_source nd(0x5EEDF00Dull);
    for (float& x : t) x = nd();
    return t;
  }();
  constexpr std::size_t run = 1024;
  std::uint64_t state = seed;
  for (std::size_t i = 0; i < n; i += run) {
    state += 0x9E3779B97F4A7C15ull;  // splitmix64
    std::uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const std::size_t at = static_cast<std::size_t>(z % (table.size() - run + 1));
    std::memcpy(p + i, table.data() + at, std::min(run, n - i) * sizeof(float));
  }
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
