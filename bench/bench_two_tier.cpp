// Two-tier cache benchmarks: BM_<op>/two_tier/<format>/<isa>[/...], format = store formats of
// keys and values: q4 (both), kf16_vq4, kq4_vf16, f16 (both).
//   - BM_append: decode steps (reserve 1 / write every layer / commit) and prefill chunks of 512
//     tokens, in steady state at 4k tokens of context, migration included (every 32 tokens a group
//     of every layer is quantized) and streaming drops included (max_tokens = 4096, so the store
//     recycles its slots and the run allocates nothing). Input is FP16 (the write overload taking
//     halves): bytes = the f16 K and V written; items = tokens.
//   - BM_prefill: fills an empty sequence to 4k, 32k and 128k tokens in chunks of 512 (one
//     iteration) and reports the footprint as counters: bytes_per_token (all-in: tail + store +
//     metadata), f16_bytes_per_token and vs_f16 (their ratio).
// Geometry: 4 layers (append) or 2 layers (prefill, to keep 128k tokens modest) of 8 KV heads x 128.
#include "bench_common.hpp"

#include <kvcache/isa.hpp>
#include <kvcache/kernels.hpp>
#include <kvcache/two_tier_cache.hpp>

#include <span>
#include <string>
#include <vector>

namespace {

using kvcache::format;
using kvcache::half;
using kvcache::isa;
namespace kb = kvcache::bench;
using cache_t = kvcache::two_tier_cache<kvcache::cpu>;

constexpr std::uint32_t kv_heads = 8;
constexpr std::uint32_t head_dim = 128;
constexpr std::size_t width = std::size_t{kv_heads} * head_dim;

struct formats {
  format k, v;
  const char* name;
};
constexpr formats all_formats[] = {{format::q4, format::q4, "q4"},
                                   {format::f16, format::q4, "kf16_vq4"},
                                   {format::q4, format::f16, "kq4_vf16"},
                                   {format::f16, format::f16, "f16"}};

std::int64_t i64(std::size_t x) { return static_cast<std::int64_t>(x); }

/// FP16 input rows, N(0, 1): [512 tokens][kv_heads][head_dim].
const half* input() {
  static const kb::buffer b = [] {
    kb::buffer x(std::size_t{512} * width * sizeof(half));
    kb::fill_normal(x.as<half>(), 512 * width);
    return x;
  }();
  return b.as<half>();
}

void append(benchmark::State& s, formats f, isa which, std::size_t step) {
  const kb::isa_scope scope(which);
  if (!scope.ok) {
    s.SkipWithError("ISA not supported");
    return;
  }
  constexpr std::uint32_t layers = 4;
  constexpr std::size_t context = 4096;
  kvcache::two_tier_config cfg;
  cfg.shape = {layers, kv_heads, head_dim};
  cfg.key_format = f.k;
  cfg.value_format = f.v;
  cfg.on_full = kvcache::capacity_policy::streaming;
  cfg.max_tokens = context;
  auto made = cache_t::create(cfg);
  if (!made) {
    s.SkipWithError(made.error().message.c_str());
    return;
  }
  cache_t c = std::move(made).value();
  const kvcache::seq_id id = c.create().value();
  const std::span<const half> rows(input(), step * width);
  auto one_step = [&] {
    bool ok = c.reserve(id, step).has_value();
    for (std::uint32_t l = 0; l < layers; ++l) ok = ok && c.write(id, l, rows, rows).has_value();
    return ok && c.commit(id).has_value();
  };
  // Warm up to the steady state: the context full, the store recycling dropped groups' slots.
  while (c.length(id).value() + step <= context || c.stats().dropped_tokens < 2 * context)
    if (!one_step()) {
      s.SkipWithError("append failed");
      return;
    }
  for (auto _ : s)
    if (!one_step()) {
      s.SkipWithError("append failed");
      return;
    }
  const std::size_t tokens = s.iterations() * step;
  s.SetItemsProcessed(i64(tokens));
  s.SetBytesProcessed(i64(tokens * layers * 2 * width * sizeof(half)));
}

void prefill(benchmark::State& s, formats f, std::size_t tokens) {
  constexpr std::uint32_t layers = 2;
  constexpr std::size_t chunk = 512;
  kvcache::two_tier_config cfg;
  cfg.shape = {layers, kv_heads, head_dim};
  cfg.key_format = f.k;
  cfg.value_format = f.v;
  const std::span<const half> rows(input(), chunk * width);
  kvcache::two_tier_stats st;
  for (auto _ : s) {
    auto made = cache_t::create(cfg);
    if (!made) {
      s.SkipWithError(made.error().message.c_str());
      return;
    }
    cache_t c = std::move(made).value();
    const kvcache::seq_id id = c.create().value();
    for (std::size_t done = 0; done < tokens; done += chunk) {
      bool ok = c.reserve(id, chunk).has_value();
      for (std::uint32_t l = 0; l < layers; ++l) ok = ok && c.write(id, l, rows, rows).has_value();
      if (!ok || !c.commit(id).has_value()) {
        s.SkipWithError("prefill failed");
        return;
      }
    }
    st = c.stats();
  }
  s.SetItemsProcessed(i64(s.iterations() * tokens));
  s.SetBytesProcessed(i64(s.iterations() * tokens * layers * 2 * width * sizeof(half)));
  const double t = static_cast<double>(st.tokens);
  s.counters["bytes_per_token"] = static_cast<double>(st.resident_bytes + st.metadata_bytes) / t;
  s.counters["f16_bytes_per_token"] = static_cast<double>(st.f16_bytes) / t;
  s.counters["vs_f16"] = static_cast<double>(st.resident_bytes + st.metadata_bytes) / static_cast<double>(st.f16_bytes);
  s.counters["tail_bytes"] = static_cast<double>(st.tail_bytes);
  s.counters["store_bytes"] = static_cast<double>(st.store_bytes);
  s.counters["metadata_bytes"] = static_cast<double>(st.metadata_bytes);
}

[[maybe_unused]] const bool registered = [] {
  const std::string best(kvcache::to_string(kvcache::active_isa()));
  for (const formats& f : all_formats) {
    std::vector<isa> isas{kvcache::active_isa()};
    if (f.k == format::q4 && f.v == format::q4 && kvcache::active_isa() != isa::scalar) isas.push_back(isa::scalar);
    for (isa i : isas)
      for (std::size_t step : {std::size_t{1}, std::size_t{512}}) {
        const std::string name = std::string("BM_append/two_tier/") + f.name + "/" + std::string(kvcache::to_string(i)) +
                                 "/step:" + std::to_string(step);
        benchmark::RegisterBenchmark(name.c_str(), [f, i, step](benchmark::State& s) { append(s, f, i, step); })
            ->UseRealTime();
      }
    if (f.k == format::f16 && f.v == format::f16) continue;
    for (std::size_t tokens : {std::size_t{4096}, std::size_t{32768}, std::size_t{131072}}) {
      const std::string name =
          std::string("BM_prefill/two_tier/") + f.name + "/" + best + "/tokens:" + std::to_string(tokens);
      benchmark::RegisterBenchmark(name.c_str(), [f, tokens](benchmark::State& s) { prefill(s, f, tokens); })
          ->UseRealTime()
          ->Iterations(1)
          ->Unit(benchmark::kMillisecond);
    }
  }
  return true;
}();

}  // namespace
