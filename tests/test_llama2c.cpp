// A real model (llama2.c stories260K) decoded over every cache with attend: greedy tokens
// identical to a forward without a cache for contiguous and paged caches in f32 and f16; for the
// two-tier cache, the KL divergence of next-token distributions against an f32 cache and the
// greedy agreement, reported and bounded. Also: the loader's errors on bad files.
#include "../examples/llama2c_decode.hpp"
#include "shared_model.hpp"

#include <kvcache/contiguous_cache.hpp>
#include <kvcache/paged_cache.hpp>
#include <kvcache/two_tier_cache.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace {

using kvcache::format;

const std::string& model_path = kvcache::test::shared_model_path();

const llama2c::model& stories() {
  static const llama2c::model m = [] {
    auto r = llama2c::load(model_path);
    EXPECT_TRUE(r.has_value()) << (r ? "" : r.error().message);
    return r ? std::move(r).value() : llama2c::model{};
  }();
  return m;
}

std::vector<std::byte> file_bytes() {
  std::vector<std::byte> b;
  std::FILE* f = std::fopen(model_path.c_str(), "rb");
  if (f == nullptr) return b;
  std::byte buf[4096];
  for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) b.insert(b.end(), buf, buf + n);
  std::fclose(f);
  return b;
}

TEST(llama2c_loader, reads_the_header) {
  KVCACHE_NEED_MODEL();
  const llama2c::config& c = stories().cfg;
  EXPECT_EQ(c.dim, 64u);
  EXPECT_EQ(c.hidden_dim, 172u);
  EXPECT_EQ(c.layers, 5u);
  EXPECT_EQ(c.heads, 8u);
  EXPECT_EQ(c.kv_heads, 4u);
  EXPECT_EQ(c.vocab, 512u);
  EXPECT_EQ(c.seq_len, 512u);
  EXPECT_TRUE(c.shared_classifier);
}

TEST(llama2c_loader, bad_files_get_errors) {
  KVCACHE_NEED_MODEL();
  const std::vector<std::byte> good = file_bytes();
  ASSERT_EQ(good.size(), 1056540u);
  auto expect_bad = [](std::span<const std::byte> b, const char* needle) {
    const auto r = llama2c::parse(b);
    ASSERT_FALSE(r.has_value()) << needle;
    EXPECT_EQ(r.error().code, kvcache::errc::invalid_argument);
    EXPECT_NE(r.error().message.find(needle), std::string::npos) << r.error().message;
  };
  expect_bad(std::span(good).first(10), "bytes=10");
  expect_bad(std::span(good).first(good.size() - 4), "bytes=1056536");
  std::vector<std::byte> longer = good;
  longer.resize(good.size() + 4);
  expect_bad(longer, "expected_bytes=1056540");
  auto with_field = [&](int index, std::int32_t value) {
    std::vector<std::byte> b = good;
    std::memcpy(b.data() + 4 * index, &value, 4);
    return b;
  };
  expect_bad(with_field(3, 0), "n_heads=0");
  expect_bad(with_field(4, 3), "n_kv_heads=3");
  expect_bad(with_field(0, 63), "dim=63");
  expect_bad(with_field(6, -5), "seq_len=-5");
  const auto missing = llama2c::load(model_path + ".missing");
  ASSERT_FALSE(missing.has_value());
  EXPECT_NE(missing.error().message.find("cannot open"), std::string::npos);
}

constexpr std::size_t steps = 512;  // the model's whole context

kvcache::geometry shape() {
  const llama2c::config& c = stories().cfg;
  return {c.layers, c.kv_heads, c.head_size()};
}

template <class C>
llama2c::decode_result decode(C& cache, format pending, std::span<const std::uint32_t> forced = {}) {
  auto r = llama2c::decode(stories(), cache, pending, steps, forced, 2);
  EXPECT_TRUE(r.has_value()) << (r ? "" : r.error().message);
  return r ? std::move(r).value() : llama2c::decode_result{};
}

kvcache::paged_cache<> make_paged(format f, std::uint32_t block) {
  kvcache::paged_config<> pc;
  pc.shape = shape();
  pc.storage = f;
  pc.block_tokens = block;
  pc.budget_bytes = std::size_t{1} << 22;
  return kvcache::paged_cache<>::create(pc).value();
}

// Greedy decoding over 512 steps: a cache changes only the float summation order of attention,
// so the tokens must equal those of a forward without a cache holding K/V in the same format.
TEST(llama2c_decode, contiguous_and_paged_greedy_tokens_equal_the_reference) {
  KVCACHE_NEED_MODEL();
  for (format f : {format::f32, format::f16}) {
    const llama2c::decode_result ref = llama2c::decode_reference(stories(), steps, {}, f == format::f16);
    ASSERT_EQ(ref.tokens.size(), steps);
    auto contiguous = kvcache::contiguous_cache<>::create({shape(), f, 1, steps}).value();
    EXPECT_EQ(decode(contiguous, f).tokens, ref.tokens) << "contiguous " << kvcache::to_string(f);
    for (std::uint32_t block : {4u, 16u}) {
      auto paged = make_paged(f, block);
      EXPECT_EQ(decode(paged, f).tokens, ref.tokens) << "paged B=" << block << " " << kvcache::to_string(f);
    }
  }
}

struct agreement {
  double mean_kl = 0.0;  // mean over steps of KL(p_f32 || p_cache), nats
  double max_kl = 0.0;
  double greedy = 0.0;   // fraction of steps with the same argmax
};

agreement compare(const llama2c::decode_result& base, const llama2c::decode_result& other, std::size_t vocab) {
  agreement a;
  const std::size_t n = std::min(base.tokens.size(), other.tokens.size());
  for (std::size_t s = 0; s < n; ++s) {
    const float* lp = base.logits.data() + s * vocab;
    const float* lq = other.logits.data() + s * vocab;
    double mp = lp[0], mq = lq[0];
    for (std::size_t i = 1; i < vocab; ++i) mp = std::max(mp, static_cast<double>(lp[i])), mq = std::max(mq, static_cast<double>(lq[i]));
    double zp = 0.0, zq = 0.0;
    for (std::size_t i = 0; i < vocab; ++i) zp += std::exp(lp[i] - mp), zq += std::exp(lq[i] - mq);
    double kl = 0.0;
    for (std::size_t i = 0; i < vocab; ++i) {
      const double logp = lp[i] - mp - std::log(zp), logq = lq[i] - mq - std::log(zq);
      kl += std::exp(logp) * (logp - logq);
    }
    a.mean_kl += kl;
    a.max_kl = std::max(a.max_kl, kl);
    a.greedy += base.tokens[s] == other.tokens[s] ? 1.0 : 0.0;
  }
  a.mean_kl /= static_cast<double>(n);
  a.greedy /= static_cast<double>(n);
  return a;
}

// Two-tier: teacher-forced with the f32 cache's greedy tokens so both see the same context at
// every step; then the next-token distributions are compared.
TEST(llama2c_decode, two_tier_kl_divergence_and_greedy_agreement_against_f32) {
  KVCACHE_NEED_MODEL();
  auto base_cache = kvcache::contiguous_cache<>::create({shape(), format::f32, 1, steps}).value();
  const llama2c::decode_result base = decode(base_cache, format::f32);
  ASSERT_EQ(base.tokens.size(), steps);
  struct variant {
    const char* name;
    std::uint32_t tail;
    format k, v;
    double max_mean_kl;
    double min_greedy;
  };
  // Measured (AVX-512 and scalar alike): tail 128: mean KL 0.066 nats, greedy 0.895; tail 32:
  // 0.139, 0.842; Q4 keys only, tail 32: 0.117, 0.846 (keys carry most of the loss: head_size 8
  // gives each key channel group little to average); f16 store: 1e-5, 0.996. Bounds: about 2x
  // the measured KL and 5-10 points of agreement, so a broken quantizer or attend path fails
  // while the deterministic numbers of this fixed model pass on every ISA.
  const variant variants[] = {
      {"q4 store, tail 128", 128, format::q4, format::q4, 0.15, 0.80},
      {"q4 store, tail 32", 32, format::q4, format::q4, 0.30, 0.75},
      {"q4 keys, f16 values, tail 32", 32, format::q4, format::f16, 0.25, 0.75},
      {"f16 store, tail 32", 32, format::f16, format::f16, 1e-3, 0.98},
  };
  for (const variant& v : variants) {
    kvcache::two_tier_config tc;
    tc.shape = shape();
    tc.tail_tokens = v.tail;
    tc.key_format = v.k;
    tc.value_format = v.v;
    auto cache = kvcache::two_tier_cache<>::create(tc).value();
    const llama2c::decode_result r = decode(cache, format::f16, base.tokens);
    ASSERT_EQ(r.tokens.size(), steps);
    const agreement a = compare(base, r, stories().cfg.vocab);
    std::printf("[ two-tier %s ] %zu steps: mean KL %.5f nats (max %.4f), greedy agreement %.3f vs f32 cache\n",
                v.name, steps, a.mean_kl, a.max_kl, a.greedy);
    EXPECT_LE(a.mean_kl, v.max_mean_kl) << v.name;
    EXPECT_GE(a.greedy, v.min_greedy) << v.name;
  }
}

}  // namespace
