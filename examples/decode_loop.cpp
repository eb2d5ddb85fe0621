// decode_loop: a small LLaMA-style model (toy_model.hpp: RoPE, grouped-query heads, fixed-seed
// random weights) generating greedily for a batch of sequences over any kvcache cache, with
// kvcache::attend doing the attention. Prints progress, then tokens/s and the cache's bytes.
//
//   decode_loop [--cache contiguous|paged|two-tier] [--steps N] [--batch B] [--format f16|f32]
//               [--threads T] [--every K]
#include "cache_step.hpp"
#include "toy_model.hpp"

#include <kvcache/contiguous_cache.hpp>
#include <kvcache/paged_cache.hpp>
#include <kvcache/two_tier_cache.hpp>

#include <fmt/core.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

namespace {

struct options {
  std::string cache = "contiguous";
  std::size_t steps = 256;
  std::size_t batch = 4;
  kvcache::format storage = kvcache::format::f16;
  unsigned threads = 1;
  std::size_t every = 0;  // 0: steps / 8
};

int usage(std::string_view why) {
  fmt::print(stderr,
             "decode_loop: {}\nusage: decode_loop [--cache contiguous|paged|two-tier] [--steps N] [--batch B]\n"
             "                   [--format f16|f32] [--threads T] [--every K]\n",
             why);
  return 2;
}

bool parse_count(const char* s, std::size_t& out) {
  char* end = nullptr;
  const unsigned long long v = std::strtoull(s, &end, 10);
  if (end == s || *end != '\0' || v == 0 || v > (1ull << 24)) return false;
  out = static_cast<std::size_t>(v);
  return true;
}

template <kvcache::Cache C>
int run(C& cache, kvcache::format pending, const options& o, const toy::model& m) {
  std::vector<kvcache::seq_id> seqs;
  for (std::size_t b = 0; b < o.batch; ++b) {
    const kvcache::result<kvcache::seq_id> s = cache.create();
    if (!s) return fmt::print(stderr, "create: {}\n", s.error().message), 1;
    seqs.push_back(*s);
  }
  examples::cache_attention<C> attention(cache, m.cfg.q_heads, pending, o.threads);
  attention.set_sequences(seqs);
  toy::batch_state st(m.cfg, o.batch);
  std::vector<std::uint32_t> tokens(o.batch);
  std::vector<std::size_t> positions(o.batch, 0);
  for (std::size_t b = 0; b < o.batch; ++b) tokens[b] = static_cast<std::uint32_t>(1 + 7 * b) % m.cfg.vocab;
  const std::size_t every = o.every != 0 ? o.every : std::max<std::size_t>(1, o.steps / 8);

  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  for (std::size_t step = 0; step < o.steps; ++step) {
    if (auto r = attention.begin_step(); !r) return fmt::print(stderr, "reserve: {}\n", r.error().message), 1;
    toy::forward(m, st, tokens, positions, attention);
    if (auto r = attention.end_step(); !r) return fmt::print(stderr, "step: {}\n", r.error().message), 1;
    for (std::size_t b = 0; b < o.batch; ++b) {
      tokens[b] = llama2c::argmax(std::span<const float>(st.logits).subspan(b * m.cfg.vocab, m.cfg.vocab));
      ++positions[b];
    }
    if ((step + 1) % every == 0 || step + 1 == o.steps) {
      const double s = std::chrono::duration<double>(clock::now() - t0).count();
      fmt::print("step {:5}/{}  {:8.1f} tokens/s  cache {:10} bytes  next tokens:", step + 1, o.steps,
                 static_cast<double>((step + 1) * o.batch) / s, cache.stats().resident_bytes);
      for (std::uint32_t t : tokens) fmt::print(" {}", t);
      fmt::print("\n");
    }
  }
  const double secs = std::chrono::duration<double>(clock::now() - t0).count();
  const auto stats = cache.stats();
  fmt::print("{} cache: {} sequences x {} steps = {} tokens in {:.3f} s: {:.1f} tokens/s\n", o.cache, o.batch,
             o.steps, o.steps * o.batch, secs, static_cast<double>(o.steps * o.batch) / secs);
  fmt::print("cache stats: {} tokens, {} resident bytes ({:.1f} bytes per token, all {} layers)\n", stats.tokens,
             stats.resident_bytes, static_cast<double>(stats.resident_bytes) / static_cast<double>(stats.tokens),
             m.cfg.layers);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (i + 1 >= argc) return usage(fmt::format("missing value after {}", a));
    const char* v = argv[++i];
    if (a == "--cache") {
      o.cache = v;
      if (o.cache != "contiguous" && o.cache != "paged" && o.cache != "two-tier")
        return usage("bad --cache (contiguous, paged or two-tier)");
    } else if (a == "--steps") {
      if (!parse_count(v, o.steps)) return usage("bad --steps");
    } else if (a == "--batch") {
      if (!parse_count(v, o.batch) || o.batch > 4096) return usage("bad --batch");
    } else if (a == "--every") {
      if (!parse_count(v, o.every)) return usage("bad --every");
    } else if (a == "--threads") {
      std::size_t t = 0;
      if (!parse_count(v, t) || t > 256) return usage("bad --threads");
      o.threads = static_cast<unsigned>(t);
    } else if (a == "--format") {
      const std::string_view f = v;
      if (f == "f16") o.storage = kvcache::format::f16;
      else if (f == "f32") o.storage = kvcache::format::f32;
      else return usage("bad --format (f16 or f32)");
    } else {
      return usage(fmt::format("unknown option {}", a));
    }
  }

  const toy::model m = toy::model::random(toy::config{});
  const kvcache::geometry g{m.cfg.layers, m.cfg.kv_heads, m.cfg.head_dim};
  fmt::print("toy model: {} layers, {} query heads, {} kv heads x {} head_dim; {} cache, {} sequences, {} steps\n",
             g.layers, m.cfg.q_heads, g.kv_heads, g.head_dim, o.cache, o.batch, o.steps);
  if (o.cache == "contiguous") {
    auto c = kvcache::contiguous_cache<>::create({g, o.storage, o.batch, o.steps});
    if (!c) return fmt::print(stderr, "contiguous cache: {}\n", c.error().message), 1;
    return run(*c, o.storage, o, m);
  }
  if (o.cache == "paged") {
    kvcache::paged_config<> pc;
    pc.shape = g;
    pc.storage = o.storage;
    pc.block_tokens = 16;
    const std::size_t token_bytes = g.token_width() * 2 * g.layers * kvcache::dense_element_bytes(o.storage);
    pc.budget_bytes = (o.steps + 16) * o.batch * token_bytes;
    pc.expected_tokens = o.steps;
    auto c = kvcache::paged_cache<>::create(pc);
    if (!c) return fmt::print(stderr, "paged cache: {}\n", c.error().message), 1;
    return run(*c, o.storage, o, m);
  }
  if (o.cache == "two-tier") {
    kvcache::two_tier_config tc;
    tc.shape = g;
    auto c = kvcache::two_tier_cache<>::create(tc);
    if (!c) return fmt::print(stderr, "two-tier cache: {}\n", c.error().message), 1;
    return run(*c, kvcache::format::f16, o, m);  // the tail, where new tokens land, is f16
  }
  return usage("bad --cache (contiguous, paged or two-tier)");
}
