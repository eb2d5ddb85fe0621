// llama2c: greedy decoding of a real llama2.c model (e.g. /work/shared/data/stories260K.bin)
// from BOS over any kvcache cache, printing token ids and tokens/s.
//
//   llama2c <model.bin> [--cache contiguous|paged|two-tier] [--format f16|f32] [--steps N]
//           [--reference]   (--reference: also decode without a cache and compare the tokens)
#include "llama2c_decode.hpp"

#include <kvcache/contiguous_cache.hpp>
#include <kvcache/paged_cache.hpp>
#include <kvcache/two_tier_cache.hpp>

#include <fmt/core.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <string_view>

namespace {

int usage(std::string_view why) {
  fmt::print(stderr,
             "llama2c: {}\nusage: llama2c <model.bin> [--cache contiguous|paged|two-tier] [--format f16|f32]\n"
             "               [--steps N] [--reference]\n",
             why);
  return 2;
}

template <kvcache::Cache C>
int run(const llama2c::model& m, C& cache, kvcache::format pending, std::size_t steps, bool reference,
        std::string_view name) {
  // For the comparison: a reference holding K/V as the cache holds its newest tokens.
  const bool f16_reference = pending == kvcache::format::f16;
  const auto t0 = std::chrono::steady_clock::now();
  const kvcache::result<llama2c::decode_result> r = llama2c::decode(m, cache, pending, steps);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!r) return fmt::print(stderr, "decode: {}\n", r.error().message), 1;
  fmt::print("tokens:");
  for (std::uint32_t t : r->tokens) fmt::print(" {}", t);
  fmt::print("\n{} cache: {} tokens in {:.3f} s: {:.1f} tokens/s\n", name, r->tokens.size(), secs,
             static_cast<double>(r->tokens.size()) / secs);
  if (reference) {
    const llama2c::decode_result ref = llama2c::decode_reference(m, steps, {}, f16_reference);
    std::size_t same = 0;
    while (same < ref.tokens.size() && same < r->tokens.size() && ref.tokens[same] == r->tokens[same]) ++same;
    fmt::print("reference (no cache, K/V in {}): first {} of {} tokens identical\n", f16_reference ? "f16" : "f32",
               same, ref.tokens.size());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return usage("missing model path");
  std::string cache = "contiguous";
  kvcache::format storage = kvcache::format::f16;
  std::size_t steps = 256;
  bool reference = false;
  for (int i = 2; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a == "--reference") {
      reference = true;
      continue;
    }
    if (i + 1 >= argc) return usage(fmt::format("missing value after {}", a));
    const std::string_view v = argv[++i];
    if (a == "--cache") {
      cache = v;
    } else if (a == "--format") {
      if (v == "f16") storage = kvcache::format::f16;
      else if (v == "f32") storage = kvcache::format::f32;
      else return usage("bad --format (f16 or f32)");
    } else if (a == "--steps") {
      char* end = nullptr;
      const std::string s(v);
      steps = std::strtoull(s.c_str(), &end, 10);
      if (end == s.c_str() || *end != '\0' || steps == 0) return usage("bad --steps");
    } else {
      return usage(fmt::format("unknown option {}", a));
    }
  }
  auto loaded = llama2c::load(argv[1]);
  if (!loaded) return fmt::print(stderr, "{}\n", loaded.error().message), 1;
  const llama2c::model& m = *loaded;
  const llama2c::config& c = m.cfg;
  if (steps > c.seq_len) return usage(fmt::format("--steps beyond the model's seq_len {}", c.seq_len));
  fmt::print("model: dim {}, {} layers, {} heads, {} kv heads x {}, vocab {}, seq_len {}\n", c.dim, c.layers,
             c.heads, c.kv_heads, c.head_size(), c.vocab, c.seq_len);
  const kvcache::geometry g{c.layers, c.kv_heads, c.head_size()};
  if (cache == "contiguous") {
    auto cc = kvcache::contiguous_cache<>::create({g, storage, 1, steps});
    if (!cc) return fmt::print(stderr, "{}\n", cc.error().message), 1;
    return run(m, *cc, storage, steps, reference, cache);
  }
  if (cache == "paged") {
    kvcache::paged_config<> pc;
    pc.shape = g;
    pc.storage = storage;
    pc.budget_bytes = (steps + 16) * g.token_width() * 2 * g.layers * kvcache::dense_element_bytes(storage);
    auto pcache = kvcache::paged_cache<>::create(pc);
    if (!pcache) return fmt::print(stderr, "{}\n", pcache.error().message), 1;
    return run(m, *pcache, storage, steps, reference, cache);
  }
  if (cache == "two-tier") {
    kvcache::two_tier_config tc;
    tc.shape = g;
    auto tt = kvcache::two_tier_cache<>::create(tc);
    if (!tt) return fmt::print(stderr, "{}\n", tt.error().message), 1;
    return run(m, *tt, kvcache::format::f16, steps, reference, cache);
  }
  return usage("bad --cache (contiguous, paged or two-tier)");
}
