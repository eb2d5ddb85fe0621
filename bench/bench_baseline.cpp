// Memory bandwidth baselines every other benchmark is read against (see bench_common.hpp):
// BM_read streams a buffer of bench::stream_bytes() (256 MiB at least), as much as a cache of the
// attention benchmarks holds, so that both read from memory; BM_memcpy copies half as much (128 MiB
// at least) into another buffer as large (read + write counted), as the append benchmarks write
// stream_bytes() of cache. Each with 1 and 2 threads (threads split the buffer). The size matters
// to memcpy itself: glibc copies with non-temporal stores above glibc.cpu.x86_non_temporal_threshold
// (derived from the L3's size: 182 MiB on session 45's VM, whose L3 is 480 MiB), and there a
// 128 MiB copy ran at 13.9 GB/s against 25 from 256 MiB up.
#include "bench_common.hpp"

#include <cstdint>
#include <cstring>

namespace kvcache::bench {

std::size_t read_bytes() { return std::max(std::size_t{256} << 20, stream_bytes()); }

namespace {

// A buffer of distinct nonzero words (word i holds a multiple of a large odd constant), so that no
// two of its pages are alike. The buffers the baselines read were zero-filled until session 21,
// when one perf_report run on this project's VM measured BM_read with 1 thread at 0.6-0.74 GB/s in
// all five repetitions and with 2 threads at 58-64 GB/s (faster than any run before), in the same
// process: a hypervisor may merge identical pages (zero pages above all) and fault them back in,
// which no real cache's contents invite. It did not recur; with distinct words it cannot come
// from there.
buffer distinct_words(std::size_t bytes) {
  buffer b(bytes);
  if (b) {
    auto* w = b.as<std::uint64_t>();
    for (std::size_t i = 0; i < bytes / 8; ++i) w[i] = (i + 1) * 0x9E3779B97F4A7C15ull;
  }
  return b;
}

}  // namespace

const buffer& read_buffer() {
  static const buffer b = distinct_words(read_bytes());
  return b;
}

std::uint64_t sum_words(const std::uint64_t* p, std::size_t n) {
  std::uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0, a4 = 0, a5 = 0, a6 = 0, a7 = 0;
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    a0 += p[i];
    a1 += p[i + 1];
    a2 += p[i + 2];
    a3 += p[i + 3];
    a4 += p[i + 4];
    a5 += p[i + 5];
    a6 += p[i + 6];
    a7 += p[i + 7];
  }
  for (; i < n; ++i) a0 += p[i];
  return a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7;
}

}  // namespace kvcache::bench

namespace {

using kvcache::bench::read_buffer;
using kvcache::bench::read_bytes;
using kvcache::bench::sum_words;

std::size_t copy_bytes() { return std::max(std::size_t{128} << 20, kvcache::bench::stream_bytes() / 2); }

const kvcache::bench::buffer& copy_source() {
  static const kvcache::bench::buffer b = kvcache::bench::distinct_words(copy_bytes());
  return b;
}
const kvcache::bench::buffer& copy_destination() {
  static const kvcache::bench::buffer b(copy_bytes());
  return b;
}

void BM_read(benchmark::State& state) {
  const auto& buf = read_buffer();
  if (!buf) {
    state.SkipWithError("allocation failed");
    return;
  }
  const std::size_t per_thread = read_bytes() / static_cast<std::size_t>(state.threads());
  const auto* words = buf.as<std::uint64_t>() + per_thread / 8 * static_cast<std::size_t>(state.thread_index());
  for (auto _ : state) benchmark::DoNotOptimize(sum_words(words, per_thread / 8));
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * static_cast<std::int64_t>(per_thread));
}
BENCHMARK(BM_read)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_read)->UseRealTime()->Unit(benchmark::kMillisecond)->Threads(2);

void BM_memcpy(benchmark::State& state) {
  const auto& src = copy_source();
  const auto& dst = copy_destination();
  if (!src || !dst) {
    state.SkipWithError("allocation failed");
    return;
  }
  const std::size_t per_thread = copy_bytes() / static_cast<std::size_t>(state.threads());
  const std::size_t off = per_thread * static_cast<std::size_t>(state.thread_index());
  for (auto _ : state) {
    std::memcpy(dst.as<std::byte>() + off, src.as<std::byte>() + off, per_thread);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * 2 * static_cast<std::int64_t>(per_thread));
  kvcache::bench::compare_to_memcpy(state);
}
BENCHMARK(BM_memcpy)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_memcpy)->UseRealTime()->Unit(benchmark::kMillisecond)->Threads(2);

}  // namespace
