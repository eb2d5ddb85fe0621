// Paged cache benchmarks, with the contiguous cache at the same shapes for comparison
// (8 layers, 8 KV heads x 128 head_dim, active ISA for the f32 -> f16 conversion):
//   BM_append/<cache>/<format>/tokens:<n>  reserve + write every layer + commit of n tokens, into a
//       sequence of append_capacity(format) tokens (truncated to 0 when full): bench::stream_bytes()
//       of K+V, so that the writes go to memory as BM_memcpy's do (until session 45: 4096 tokens,
//       128 MiB of f16, which a VM with 480 MiB of L3 partly kept there).
//       Bytes = f32 K+V read + stored K+V written (copy-like: compared with BM_memcpy).
//   BM_view/<cache>/<format>/ctx:<tokens>  view() of every layer of a `tokens`-token sequence and
//       a streaming read of every chunk's K and V. Bytes = K+V bytes read (compared with BM_read).
//   BM_reserve_release/paged/<format>/blocks:<n>  create + reserve n blocks + release (no writes).
//       Items = blocks; bytes = K/V storage handed out and back (bookkeeping only, nothing copied).
//   BM_adopt/paged/<format>/prefix:4096  create_with_prefix of a cached 4096-token prefix (256
//       blocks) + release. Items = tokens adopted; bytes = K/V bytes adopted (not recomputed).
#include "bench_common.hpp"

#include <kvcache/contiguous_cache.hpp>
#include <kvcache/paged_cache.hpp>

#include <string>
#include <vector>

namespace {

using namespace kvcache;

const geometry shape{8, 8, 128};
constexpr std::uint32_t block = 16;
constexpr std::size_t view_tokens = 4096;  // sequence length in the view benchmarks

std::size_t stored_bytes_per_token(format f) { return 2 * shape.layers * shape.token_width() * dense_element_bytes(f); }

// Tokens per sequence in the append benchmarks: bench::stream_bytes() of K+V in format f, at least
// 4096, a multiple of 256 (the largest append).
std::size_t append_capacity(format f) {
  return std::max<std::size_t>(4096, bench::stream_bytes() / stored_bytes_per_token(f) / 256 * 256);
}

result<paged_cache<>> make_paged(format f, std::size_t tokens) {
  paged_config<> pc;
  pc.shape = shape;
  pc.storage = f;
  pc.block_tokens = block;
  pc.budget_bytes = (tokens + 2 * block) * stored_bytes_per_token(f);
  pc.expected_tokens = tokens;
  return paged_cache<>::create(pc);
}

result<contiguous_cache<>> make_contiguous(format f, std::size_t tokens) {
  return contiguous_cache<>::create(contiguous_config{shape, f, 1, tokens});
}

/// Appends n tokens per iteration to one sequence (truncated to 0 when it would overflow).
template <class C>
void append(benchmark::State& state, result<C> made, format f, std::size_t n, std::size_t capacity) {
  if (!made) return state.SkipWithError(made.error().message.c_str());
  C& c = made.value();
  const auto s = c.create();
  if (!s) return state.SkipWithError(s.error().message.c_str());
  const std::size_t tw = shape.token_width();
  // Distinct K and V input per layer, so every layer's input is read from memory. // [layer][n][tw]
  bench::buffer k(shape.layers * n * tw * sizeof(float)), v(k.size());
  bench::fill_normal(k.as<float>(), shape.layers * n * tw, 1.0f, 1);
  bench::fill_normal(v.as<float>(), shape.layers * n * tw, 1.0f, 2);
  // Touch every slot once before timing, so neither cache pays first-touch page faults inside
  // the loop (the pool is touched at creation; contiguous storage is not).
  for (std::size_t t = 0; t + n <= capacity; t += n) {
    if (!c.reserve(s.value(), n)) return state.SkipWithError("warm-up reserve failed");
    for (std::uint32_t l = 0; l < shape.layers; ++l) {
      const std::span<const float> ks(k.as<float>() + l * n * tw, n * tw), vs(v.as<float>() + l * n * tw, n * tw);
      if (!c.write(s.value(), l, ks, vs)) return state.SkipWithError("warm-up write failed");
    }
    if (!c.commit(s.value())) return state.SkipWithError("warm-up commit failed");
  }
  if (!c.truncate(s.value(), 0)) return state.SkipWithError("truncate failed");
  std::size_t length = 0;
  for (auto _ : state) {
    if (length + n > capacity) {
      if (!c.truncate(s.value(), 0)) return state.SkipWithError("truncate failed");
      length = 0;
    }
    if (!c.reserve(s.value(), n)) return state.SkipWithError("reserve failed");
    for (std::uint32_t l = 0; l < shape.layers; ++l) {
      const std::span<const float> ks(k.as<float>() + l * n * tw, n * tw), vs(v.as<float>() + l * n * tw, n * tw);
      if (!c.write(s.value(), l, ks, vs)) return state.SkipWithError("write failed");
    }
    if (!c.commit(s.value())) return state.SkipWithError("commit failed");
    length += n;
  }
  const std::size_t per_iter = n * 2 * shape.layers * tw * (sizeof(float) + dense_element_bytes(f));
  state.SetBytesProcessed(static_cast<std::int64_t>(per_iter * state.iterations()));
  state.SetItemsProcessed(static_cast<std::int64_t>(n * state.iterations()));
  bench::compare_to_memcpy(state);
}

/// Streams every 8-byte word of a dense chunk head (rows of head_dim elements, `tokens` rows).
inline std::uint64_t read_words(const std::byte* p, std::size_t bytes) {
  std::uint64_t acc = 0;
  const auto* w = reinterpret_cast<const std::uint64_t*>(p);
  for (std::size_t i = 0; i < bytes / 8; ++i) acc += w[i];
  return acc;
}

/// view() of every layer plus a read of all K and V bytes through the chunks.
template <class C>
void view(benchmark::State& state, result<C> made, format f, std::size_t tokens) {
  if (!made) return state.SkipWithError(made.error().message.c_str());
  C& c = made.value();
  const auto s = c.create();
  if (!s) return state.SkipWithError(s.error().message.c_str());
  const std::size_t tw = shape.token_width();
  constexpr std::size_t step = 512;
  std::vector<float> k(step * tw), v(step * tw);
  bench::fill_normal(k.data(), k.size(), 1.0f, 3);
  bench::fill_normal(v.data(), v.size(), 1.0f, 4);
  for (std::size_t t = 0; t < tokens; t += step) {
    const std::size_t n = std::min(step, tokens - t);
    if (!c.reserve(s.value(), n)) return state.SkipWithError("reserve failed");
    for (std::uint32_t l = 0; l < shape.layers; ++l)
      if (!c.write(s.value(), l, std::span<const float>(k.data(), n * tw), std::span<const float>(v.data(), n * tw)))
        return state.SkipWithError("write failed");
    if (!c.commit(s.value())) return state.SkipWithError("commit failed");
  }
  const std::size_t row = shape.head_dim * dense_element_bytes(f);
  for (auto _ : state) {
    std::uint64_t acc = 0;
    for (std::uint32_t l = 0; l < shape.layers; ++l) {
      const auto lv = c.view(s.value(), l);
      // Keys of every head, then values: memory order for both layouts.
      for (const chunk& ch : lv.value()) {
        for (std::uint32_t h = 0; h < shape.kv_heads; ++h) acc += read_words(ch.k_head(h), ch.tokens * row);
        for (std::uint32_t h = 0; h < shape.kv_heads; ++h) acc += read_words(ch.v_head(h), ch.tokens * row);
      }
    }
    benchmark::DoNotOptimize(acc);
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(tokens * stored_bytes_per_token(f) * state.iterations()));
  state.SetItemsProcessed(static_cast<std::int64_t>(tokens * state.iterations()));
}

void reserve_release(benchmark::State& state, format f, std::size_t blocks) {
  auto made = make_paged(f, blocks * block);
  if (!made) return state.SkipWithError(made.error().message.c_str());
  paged_cache<>& c = made.value();
  for (auto _ : state) {
    const auto s = c.create();
    if (!s || !c.reserve(s.value(), blocks * block) || !c.release(s.value()))
      return state.SkipWithError("create/reserve/release failed");
  }
  const std::size_t block_bytes = c.pool()->block_bytes();
  state.SetBytesProcessed(static_cast<std::int64_t>(blocks * block_bytes * state.iterations()));
  state.SetItemsProcessed(static_cast<std::int64_t>(blocks * state.iterations()));
}

void adopt(benchmark::State& state, format f, std::size_t prefix) {
  auto made = make_paged(f, prefix + block);
  if (!made) return state.SkipWithError(made.error().message.c_str());
  paged_cache<>& c = made.value();
  std::vector<std::int32_t> ids(prefix + 1);
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<std::int32_t>((i * 2654435761u) % 32000);
  const std::size_t tw = shape.token_width();
  {
    // Compute the prefix once (with its token ids) and release it: its blocks stay cached.
    const auto s = c.create();
    std::vector<float> k(prefix * tw), v(prefix * tw);
    bench::fill_normal(k.data(), k.size(), 1.0f, 5);
    bench::fill_normal(v.data(), v.size(), 1.0f, 6);
    if (!s || !c.reserve(s.value(), prefix, std::span<const std::int32_t>(ids).first(prefix)))
      return state.SkipWithError("prefix reserve failed");
    for (std::uint32_t l = 0; l < shape.layers; ++l)
      if (!c.write(s.value(), l, std::span<const float>(k), std::span<const float>(v)))
        return state.SkipWithError("prefix write failed");
    if (!c.commit(s.value()) || !c.release(s.value())) return state.SkipWithError("prefix commit failed");
  }
  for (auto _ : state) {
    const auto m = c.create_with_prefix(ids);
    if (!m || m.value().cached_tokens != prefix) return state.SkipWithError("prefix not adopted");
    if (!c.release(m.value().seq)) return state.SkipWithError("release failed");
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(prefix * stored_bytes_per_token(f) * state.iterations()));
  state.SetItemsProcessed(static_cast<std::int64_t>(prefix * state.iterations()));
}

const bool registered = [] {
  for (const format f : {format::f16, format::f32}) {
    const std::string fs(to_string(f));
    for (const std::size_t n : {std::size_t{1}, std::size_t{16}, std::size_t{256}}) {
      benchmark::RegisterBenchmark(("BM_append/paged/" + fs + "/tokens:" + std::to_string(n)).c_str(),
                                   [f, n](benchmark::State& st) {
                                     append(st, make_paged(f, append_capacity(f)), f, n, append_capacity(f));
                                   })
          ->UseRealTime();
      benchmark::RegisterBenchmark(("BM_append/contiguous/" + fs + "/tokens:" + std::to_string(n)).c_str(),
                                   [f, n](benchmark::State& st) {
                                     append(st, make_contiguous(f, append_capacity(f)), f, n, append_capacity(f));
                                   })
          ->UseRealTime();
    }
    benchmark::RegisterBenchmark(("BM_view/paged/" + fs + "/ctx:" + std::to_string(view_tokens)).c_str(),
                                 [f](benchmark::State& st) { view(st, make_paged(f, view_tokens), f, view_tokens); })
        ->UseRealTime();
    benchmark::RegisterBenchmark(
        ("BM_view/contiguous/" + fs + "/ctx:" + std::to_string(view_tokens)).c_str(),
        [f](benchmark::State& st) { view(st, make_contiguous(f, view_tokens), f, view_tokens); })
        ->UseRealTime();
  }
  for (const std::size_t blocks : {std::size_t{1}, std::size_t{64}})
    benchmark::RegisterBenchmark(("BM_reserve_release/paged/f16/blocks:" + std::to_string(blocks)).c_str(),
                                 [blocks](benchmark::State& st) { reserve_release(st, format::f16, blocks); })
        ->UseRealTime();
  benchmark::RegisterBenchmark("BM_adopt/paged/f16/prefix:4096",
                               [](benchmark::State& st) { adopt(st, format::f16, 4096); })
      ->UseRealTime();
  return true;
}();

}  // namespace
