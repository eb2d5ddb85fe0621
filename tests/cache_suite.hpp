#pragma once
/// @file cache_suite.hpp
/// The shared, type-parameterized GoogleTest suite of kvcache::Cache behaviour. Every cache type
/// (contiguous, paged, two-tier; each storage format) joins it through a *traits* struct:
///
/// ```cpp
/// struct my_traits {
///   /// The cache under test. Must model kvcache::Cache, be movable, and give views whose
///   /// pointers are readable on the host (cpu placement).
///   using cache_type = kvcache::paged_cache<kvcache::cpu>;
///   /// Suffix of the test names, e.g. "paged_f16" -> cache_suite/paged_f16.round_trip.
///   static constexpr const char* name = "paged_f16";
///   /// Largest accepted |decoded - written| per element, for written values in [-1, 1].
///   /// 0 means bit-exact (f32 storage). f16: 2^-12 (half an f16 ulp at 1). q4: about 0.08.
///   static constexpr double tolerance = 0.0;
///   /// A fresh, empty cache of geometry g that can hold at least suite_sequences (8) live
///   /// sequences of at least suite_tokens (256) committed tokens each, all at the same time.
///   static cache_type make(const kvcache::geometry& g);
/// };
///
/// using my_types = ::testing::Types<my_traits /*, ... */>;
/// INSTANTIATE_TYPED_TEST_SUITE_P(paged, cache_suite, my_types, kvcache_test::traits_name);
/// ```
///
/// Include this header in exactly one test translation unit per binary.
///
/// Chunks are decoded by their own format: f32 and f16 directly, q4 keys and values through the
/// scalar reference kernels (kernels::find(isa::scalar)->dequantize_keys / dequantize_values).
///
/// What the suite assumes of every cache (the kvcache::Cache contract):
/// - write() takes K and V as [n][kv_heads][head_dim] floats for the n reserved tokens; layers
///   may be written in any order; tokens become visible to length()/view() only at commit().
/// - Errors: unknown or released id -> unknown_sequence (every call); layer >= layers ->
///   layer_out_of_range; write/commit with no open reservation -> not_reserved (checked before
///   the K/V sizes); wrong K or V size -> bad_shape; commit before all layers were written ->
///   incomplete_write; reserve or truncate while a reservation is open -> reservation_pending;
///   truncate past the length -> out_of_range; reserve of an absurd count (2^40 tokens) ->
///   capacity_exceeded or pool_exhausted. After every failed call the whole observable state
///   (every live sequence's length and view contents, and stats) is exactly as before, and an
///   open reservation is still open with its written layers kept.
/// - The suite only truncates away recent tokens (at most 7 of a long sequence) or whole short
///   sequences (< 32 tokens), so caches that compress old tokens (two-tier) can join.

#include "test_seed.hpp"

#include <kvcache/cache.hpp>
#include <kvcache/format.hpp>
#include <kvcache/geometry.hpp>
#include <kvcache/half.hpp>
#include <kvcache/kernels.hpp>
#include <kvcache/view.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace kvcache_test {

/// Live sequences every traits::make() cache must hold at once.
inline constexpr std::size_t suite_sequences = 8;
/// Committed tokens every one of those sequences must be able to reach.
inline constexpr std::size_t suite_tokens = 256;

/// Name generator for INSTANTIATE_TYPED_TEST_SUITE_P: the traits' `name`.
struct traits_name {
  template <class T>
  static std::string GetName(int) {
    return T::name;
  }
};

/// Geometries the suite runs every test on: a ragged head_dim (not a multiple of 32, so q4 value
/// groups are partial) and a common power-of-two one.
inline std::vector<kvcache::geometry> suite_geometries() {
  return {kvcache::geometry{3, 2, 40}, kvcache::geometry{2, 4, 64}};
}

/// Random generator seeded freshly per test; the seed is printed with every failure.
struct random_source {
  std::uint32_t seed;
  std::mt19937 gen;
  /// A fresh seed each run, or KVCACHE_TEST_SEED's (to replay a failure: the trace prints it).
  random_source() : seed(test_seed_or_fresh()), gen(seed) {}
  std::string trace() const { return seed_trace(seed); }

  /// n values uniform in [-1, 1].
  std::vector<float> values(std::size_t n) {
    std::uniform_real_distribution<float> d(-1.0f, 1.0f);
    std::vector<float> out(n);
    for (float& x : out) x = d(gen);
    return out;
  }
  /// Uniform integer in [lo, hi].
  std::size_t between(std::size_t lo, std::size_t hi) {
    return std::uniform_int_distribution<std::size_t>(lo, hi)(gen);
  }
};

/// Keys and values of one layer of one sequence, decoded to floats, token-major:
/// k, v: [token][kv_head][head_dim] (the same layout write() takes).
struct decoded_layer {
  std::uint32_t chunks = 0;
  std::uint32_t tokens = 0;
  std::vector<std::uint32_t> k_bits;  // float bit patterns: NaN-safe, -0 != +0
  std::vector<std::uint32_t> v_bits;
  std::vector<float> k;
  std::vector<float> v;
  std::vector<std::uint8_t> formats;  // [chunk] k_format, v_format
  bool consistent = true;             // sum of chunk tokens == tokens
};

/// Decodes dense rows [t][head_dim] of format f starting at p into out rows of stride `stride`.
inline void decode_dense(kvcache::format f, const std::byte* p, std::uint32_t tokens,
                         std::uint32_t head_dim, float* out, std::size_t stride) {
  for (std::uint32_t t = 0; t < tokens; ++t)
    for (std::uint32_t d = 0; d < head_dim; ++d) {
      const std::size_t i = static_cast<std::size_t>(t) * head_dim + d;
      if (f == kvcache::format::f32) {
        float x;
        std::memcpy(&x, p + i * sizeof(float), sizeof(float));
        out[t * stride + d] = x;
      } else {
        kvcache::half h;
        std::memcpy(&h, p + i * sizeof(kvcache::half), sizeof(kvcache::half));
        out[t * stride + d] = kvcache::to_float(h);
      }
    }
}

/// Decodes a whole layer view (every chunk, in its own format).
inline decoded_layer decode(const kvcache::layer_view& lv, const kvcache::geometry& g) {
  decoded_layer out;
  out.chunks = lv.count;
  out.tokens = lv.tokens;
  const std::size_t tw = g.token_width();
  out.k.assign(static_cast<std::size_t>(lv.tokens) * tw, 0.0f);
  out.v.assign(static_cast<std::size_t>(lv.tokens) * tw, 0.0f);
  const kvcache::kernels::table* ref = kvcache::kernels::find(kvcache::isa::scalar);
  std::size_t tok0 = 0;
  for (std::uint32_t c = 0; c < lv.count; ++c) {
    const kvcache::chunk& ch = lv.chunks[c];
    out.formats.push_back(static_cast<std::uint8_t>(ch.k_format));
    out.formats.push_back(static_cast<std::uint8_t>(ch.v_format));
    if (tok0 + ch.tokens > lv.tokens) {
      out.consistent = false;
      return out;
    }
    for (std::uint32_t h = 0; h < g.kv_heads; ++h) {
      float* kd = out.k.data() + tok0 * tw + static_cast<std::size_t>(h) * g.head_dim;
      float* vd = out.v.data() + tok0 * tw + static_cast<std::size_t>(h) * g.head_dim;
      if (ch.k_format == kvcache::format::q4)
        ref->dequantize_keys(reinterpret_cast<const std::uint8_t*>(ch.k_head(h)), ch.tokens, g.head_dim, kd, tw);
      else
        decode_dense(ch.k_format, ch.k_head(h), ch.tokens, g.head_dim, kd, tw);
      if (ch.v_format == kvcache::format::q4)
        ref->dequantize_values(reinterpret_cast<const std::uint8_t*>(ch.v_head(h)), 0, ch.tokens, g.head_dim, vd, tw);
      else
        decode_dense(ch.v_format, ch.v_head(h), ch.tokens, g.head_dim, vd, tw);
    }
    tok0 += ch.tokens;
  }
  if (tok0 != lv.tokens) out.consistent = false;
  out.k_bits.resize(out.k.size());
  out.v_bits.resize(out.v.size());
  for (std::size_t i = 0; i < out.k.size(); ++i) out.k_bits[i] = std::bit_cast<std::uint32_t>(out.k[i]);
  for (std::size_t i = 0; i < out.v.size(); ++i) out.v_bits[i] = std::bit_cast<std::uint32_t>(out.v[i]);
  return out;
}

/// The full observable state of a cache over a given set of sequence ids, through the concept
/// only: each id's length (or error code) and every layer's decoded view, plus stats.
struct cache_snapshot {
  struct seq {
    std::uint64_t id = 0;
    int length_error = 0;  // errc of length() if it failed, else 0
    std::size_t length = 0;
    std::vector<std::vector<std::uint32_t>> k_bits, v_bits;  // [layer]
    std::vector<std::uint32_t> chunks, tokens;               // [layer]
    std::vector<std::vector<std::uint8_t>> formats;          // [layer]
    friend bool operator==(const seq&, const seq&) = default;
  };
  std::vector<seq> seqs;
  std::size_t stats_sequences = 0;
  std::size_t stats_tokens = 0;
  std::size_t stats_resident_bytes = 0;
  friend bool operator==(const cache_snapshot&, const cache_snapshot&) = default;
};

/// Takes a snapshot of `c` over `ids` (live or not).
template <kvcache::Cache C>
cache_snapshot snapshot(const C& c, std::span<const kvcache::seq_id> ids) {
  cache_snapshot s;
  const kvcache::geometry g = c.shape();
  for (kvcache::seq_id id : ids) {
    cache_snapshot::seq q;
    q.id = id.value;
    const auto len = c.length(id);
    if (!len.has_value()) {
      q.length_error = static_cast<int>(len.error().code);
    } else {
      q.length = len.value();
      for (std::uint32_t l = 0; l < g.layers; ++l) {
        const auto lv = c.view(id, l);
        if (!lv.has_value()) {
          q.chunks.push_back(0xffffffffu);
          q.tokens.push_back(static_cast<std::uint32_t>(lv.error().code));
          q.k_bits.emplace_back();
          q.v_bits.emplace_back();
          q.formats.emplace_back();
          continue;
        }
        decoded_layer d = decode(lv.value(), g);
        q.chunks.push_back(d.chunks);
        q.tokens.push_back(d.tokens);
        q.k_bits.push_back(std::move(d.k_bits));
        q.v_bits.push_back(std::move(d.v_bits));
        q.formats.push_back(std::move(d.formats));
      }
    }
    s.seqs.push_back(std::move(q));
  }
  const auto st = c.stats();
  if constexpr (requires { st.sequences; }) s.stats_sequences = st.sequences;
  s.stats_tokens = st.tokens;
  s.stats_resident_bytes = st.resident_bytes;
  return s;
}

/// What a sequence should hold: per layer, K and V as [token][kv_head][head_dim] floats.
struct model_seq {
  kvcache::seq_id id{};
  std::vector<std::vector<float>> k, v;  // [layer] -> [token][kv_head][head_dim]
  std::size_t length(const kvcache::geometry& g) const { return k.empty() ? 0 : k[0].size() / g.token_width(); }
};

/// Creates a sequence and its empty model.
template <kvcache::Cache C>
model_seq create_seq(C& c) {
  model_seq m;
  auto id = c.create();
  EXPECT_TRUE(id.has_value()) << (id.has_value() ? "" : id.error().message);
  if (id.has_value()) m.id = id.value();
  m.k.assign(c.shape().layers, {});
  m.v.assign(c.shape().layers, {});
  return m;
}

/// Appends n random tokens through reserve / write (every layer, in a random order when
/// `shuffle`) / commit, and records them in the model. Returns false on any failure.
template <kvcache::Cache C>
bool append(C& c, model_seq& m, std::size_t n, random_source& rnd, bool shuffle = false) {
  const kvcache::geometry g = c.shape();
  const std::size_t tw = g.token_width();
  auto r = c.reserve(m.id, n);
  EXPECT_TRUE(r.has_value()) << (r.has_value() ? "" : r.error().message);
  if (!r.has_value()) return false;
  std::vector<std::uint32_t> order(g.layers);
  std::iota(order.begin(), order.end(), 0u);
  if (shuffle) std::shuffle(order.begin(), order.end(), rnd.gen);
  for (std::uint32_t l : order) {
    const std::vector<float> k = rnd.values(n * tw);
    const std::vector<float> v = rnd.values(n * tw);
    auto w = c.write(m.id, l, std::span<const float>(k), std::span<const float>(v));
    EXPECT_TRUE(w.has_value()) << (w.has_value() ? "" : w.error().message);
    if (!w.has_value()) return false;
    m.k[l].insert(m.k[l].end(), k.begin(), k.end());
    m.v[l].insert(m.v[l].end(), v.begin(), v.end());
  }
  auto cm = c.commit(m.id);
  EXPECT_TRUE(cm.has_value()) << (cm.has_value() ? "" : cm.error().message);
  return cm.has_value();
}

/// Cuts the model to its first n tokens.
inline void truncate_model(model_seq& m, std::size_t n, const kvcache::geometry& g) {
  for (auto& k : m.k) k.resize(n * g.token_width());
  for (auto& v : m.v) v.resize(n * g.token_width());
}

/// Checks that the cache's length and every layer's view of m.id match the model within tol.
template <kvcache::Cache C>
void expect_matches(const C& c, const model_seq& m, double tol) {
  const kvcache::geometry g = c.shape();
  const auto len = c.length(m.id);
  ASSERT_TRUE(len.has_value()) << len.error().message;
  ASSERT_EQ(len.value(), m.length(g));
  for (std::uint32_t l = 0; l < g.layers; ++l) {
    SCOPED_TRACE("layer " + std::to_string(l));
    const auto lv = c.view(m.id, l);
    ASSERT_TRUE(lv.has_value()) << lv.error().message;
    ASSERT_EQ(lv.value().tokens, m.length(g));
    const decoded_layer d = decode(lv.value(), g);
    ASSERT_TRUE(d.consistent) << "chunk token counts do not sum to the view's tokens";
    ASSERT_EQ(d.k.size(), m.k[l].size());
    std::size_t bad = 0;
    for (std::size_t i = 0; i < d.k.size(); ++i) {
      const bool ok_k = tol == 0.0 ? std::bit_cast<std::uint32_t>(d.k[i]) == std::bit_cast<std::uint32_t>(m.k[l][i])
                                   : std::fabs(static_cast<double>(d.k[i]) - m.k[l][i]) <= tol;
      const bool ok_v = tol == 0.0 ? std::bit_cast<std::uint32_t>(d.v[i]) == std::bit_cast<std::uint32_t>(m.v[l][i])
                                   : std::fabs(static_cast<double>(d.v[i]) - m.v[l][i]) <= tol;
      if ((!ok_k || !ok_v) && ++bad <= 5)
        ADD_FAILURE() << "element " << i << " (token " << i / g.token_width() << "): K " << d.k[i] << " vs "
                      << m.k[l][i] << ", V " << d.v[i] << " vs " << m.v[l][i] << " (tolerance " << tol << ")";
    }
    ASSERT_EQ(bad, 0u) << "mismatching elements";
  }
}

/// The error code of a failed result, or nullopt if it succeeded.
template <class R>
std::optional<kvcache::errc> code_of(const R& r) {
  if (r.has_value()) return std::nullopt;
  return r.error().code;
}

/// Pretty-prints an optional errc in assertion messages.
inline std::string show(std::optional<kvcache::errc> e) {
  return e ? std::string(kvcache::to_string(*e)) : std::string("success");
}

}  // namespace kvcache_test

/// The typed fixture. T is a traits struct (see the top of this file).
template <class T>
class cache_suite : public ::testing::Test {};

TYPED_TEST_SUITE_P(cache_suite);

/// Expects `call` to fail with `code` and the snapshot over `ids` to be unchanged by it.
#define KVCACHE_SUITE_EXPECT_FAILS_UNCHANGED(cache, ids, code, call)                                  \
  do {                                                                                               \
    const auto kvs_before_ = ::kvcache_test::snapshot(cache, ids);                                   \
    const auto kvs_result_ = (call);                                                                 \
    EXPECT_EQ(::kvcache_test::show(::kvcache_test::code_of(kvs_result_)), ::kvcache_test::show(code)) \
        << #call;                                                                                    \
    if (!kvs_result_.has_value()) { EXPECT_FALSE(kvs_result_.error().message.empty()) << #call; } \
    EXPECT_TRUE(::kvcache_test::snapshot(cache, ids) == kvs_before_) << "state changed by " #call;   \
  } while (false)

TYPED_TEST_P(cache_suite, round_trip) {
  using namespace kvcache_test;
  for (const kvcache::geometry g : suite_geometries()) {
    random_source rnd;
    SCOPED_TRACE(rnd.trace() + ", head_dim " + std::to_string(g.head_dim));
    auto c = TypeParam::make(g);
    EXPECT_EQ(c.shape(), g);
    model_seq m = create_seq(c);
    const auto len0 = c.length(m.id);
    ASSERT_TRUE(len0.has_value());
    EXPECT_EQ(len0.value(), 0u);
    for (std::uint32_t l = 0; l < g.layers; ++l) {
      const auto lv = c.view(m.id, l);
      ASSERT_TRUE(lv.has_value());
      EXPECT_EQ(lv.value().tokens, 0u);
    }
    ASSERT_TRUE(append(c, m, 5, rnd));
    expect_matches(c, m, TypeParam::tolerance);
    ASSERT_TRUE(append(c, m, 1, rnd, /*shuffle=*/true));
    expect_matches(c, m, TypeParam::tolerance);
  }
}

TYPED_TEST_P(cache_suite, multi_step_appends) {
  using namespace kvcache_test;
  for (const kvcache::geometry g : suite_geometries()) {
    random_source rnd;
    SCOPED_TRACE(rnd.trace() + ", head_dim " + std::to_string(g.head_dim));
    auto c = TypeParam::make(g);
    model_seq m = create_seq(c);
    // Prefill, then single-token decode steps and a few speculative bursts, up to suite_tokens.
    ASSERT_TRUE(append(c, m, 37, rnd));
    expect_matches(c, m, TypeParam::tolerance);
    while (m.length(g) < suite_tokens) {
      const std::size_t room = suite_tokens - m.length(g);
      const std::size_t n = std::min(room, rnd.between(0, 3) == 0 ? rnd.between(2, 9) : std::size_t{1});
      ASSERT_TRUE(append(c, m, n, rnd, rnd.between(0, 1) == 1));
      if (m.length(g) % 16 < n || m.length(g) == suite_tokens) expect_matches(c, m, TypeParam::tolerance);
    }
    expect_matches(c, m, TypeParam::tolerance);
    EXPECT_EQ(c.stats().tokens, suite_tokens);
  }
}

TYPED_TEST_P(cache_suite, pending_reservation_is_invisible) {
  using namespace kvcache_test;
  const kvcache::geometry g = suite_geometries()[0];
  random_source rnd;
  SCOPED_TRACE(rnd.trace());
  auto c = TypeParam::make(g);
  model_seq m = create_seq(c);
  ASSERT_TRUE(append(c, m, 9, rnd));
  const std::vector<kvcache::seq_id> ids{m.id};
  const auto before = snapshot(c, ids);
  ASSERT_TRUE(c.reserve(m.id, 4).has_value());
  EXPECT_TRUE(snapshot(c, ids) == before) << "reserve changed the visible state";
  const auto k = rnd.values(4 * g.token_width());
  const auto v = rnd.values(4 * g.token_width());
  for (std::uint32_t l = 0; l < g.layers; ++l) {
    ASSERT_TRUE(c.write(m.id, l, std::span<const float>(k), std::span<const float>(v)).has_value());
    EXPECT_TRUE(snapshot(c, ids) == before) << "write changed the visible state, layer " << l;
    m.k[l].insert(m.k[l].end(), k.begin(), k.end());
    m.v[l].insert(m.v[l].end(), v.begin(), v.end());
  }
  ASSERT_TRUE(c.commit(m.id).has_value());
  expect_matches(c, m, TypeParam::tolerance);
}

TYPED_TEST_P(cache_suite, many_sequences_independent) {
  using namespace kvcache_test;
  for (const kvcache::geometry g : suite_geometries()) {
    random_source rnd;
    SCOPED_TRACE(rnd.trace() + ", head_dim " + std::to_string(g.head_dim));
    auto c = TypeParam::make(g);
    std::vector<model_seq> seqs;
    for (std::size_t i = 0; i < suite_sequences; ++i) seqs.push_back(create_seq(c));
    for (std::size_t i = 0; i < seqs.size(); ++i)
      for (std::size_t j = i + 1; j < seqs.size(); ++j) EXPECT_NE(seqs[i].id, seqs[j].id);
    // Interleaved appends of uneven sizes; sequence i reaches about (i + 1) * suite_tokens / 8.
    for (int round = 0; round < 12; ++round)
      for (std::size_t i = 0; i < seqs.size(); ++i) {
        const std::size_t target = (i + 1) * suite_tokens / suite_sequences;
        const std::size_t have = seqs[i].length(g);
        if (have >= target) continue;
        const std::size_t n = std::min(target - have, rnd.between(1, 12));
        ASSERT_TRUE(append(c, seqs[i], n, rnd));
      }
    std::size_t total = 0;
    for (const model_seq& m : seqs) {
      expect_matches(c, m, TypeParam::tolerance);
      total += m.length(g);
    }
    EXPECT_EQ(c.stats().tokens, total);
    // Releasing some sequences leaves the others intact.
    ASSERT_TRUE(c.release(seqs[2].id).has_value());
    ASSERT_TRUE(c.release(seqs[5].id).has_value());
    total -= seqs[2].length(g) + seqs[5].length(g);
    for (std::size_t i = 0; i < seqs.size(); ++i)
      if (i != 2 && i != 5) expect_matches(c, seqs[i], TypeParam::tolerance);
    EXPECT_EQ(c.stats().tokens, total);
    // New sequences in the freed room are independent of the survivors too.
    model_seq a = create_seq(c);
    model_seq b = create_seq(c);
    ASSERT_TRUE(append(c, a, 20, rnd));
    ASSERT_TRUE(append(c, b, 3, rnd));
    ASSERT_TRUE(append(c, seqs[0], 2, rnd));
    expect_matches(c, a, TypeParam::tolerance);
    expect_matches(c, b, TypeParam::tolerance);
    for (std::size_t i = 0; i < seqs.size(); ++i)
      if (i != 2 && i != 5) expect_matches(c, seqs[i], TypeParam::tolerance);
  }
}

TYPED_TEST_P(cache_suite, truncate_then_append) {
  using namespace kvcache_test;
  for (const kvcache::geometry g : suite_geometries()) {
    random_source rnd;
    SCOPED_TRACE(rnd.trace() + ", head_dim " + std::to_string(g.head_dim));
    auto c = TypeParam::make(g);
    model_seq m = create_seq(c);
    ASSERT_TRUE(append(c, m, 50, rnd));
    // Speculative decoding: draft 6, keep 2 of them, repeat.
    for (int step = 0; step < 10; ++step) {
      const std::size_t keep = m.length(g) + rnd.between(0, 6);
      ASSERT_TRUE(append(c, m, 6, rnd));
      ASSERT_TRUE(c.truncate(m.id, keep).has_value());
      truncate_model(m, keep, g);
      expect_matches(c, m, TypeParam::tolerance);
    }
    // Truncating to the current length is a no-op.
    const std::size_t len = m.length(g);
    ASSERT_TRUE(c.truncate(m.id, len).has_value());
    expect_matches(c, m, TypeParam::tolerance);
    ASSERT_TRUE(append(c, m, 9, rnd));
    expect_matches(c, m, TypeParam::tolerance);
    EXPECT_EQ(c.stats().tokens, m.length(g));
    // A short sequence can be truncated to empty and refilled.
    model_seq s = create_seq(c);
    ASSERT_TRUE(append(c, s, 12, rnd));
    ASSERT_TRUE(c.truncate(s.id, 0).has_value());
    truncate_model(s, 0, g);
    expect_matches(c, s, TypeParam::tolerance);
    for (std::uint32_t l = 0; l < g.layers; ++l) {
      const auto lv = c.view(s.id, l);
      ASSERT_TRUE(lv.has_value());
      EXPECT_EQ(lv.value().tokens, 0u);
    }
    ASSERT_TRUE(append(c, s, 7, rnd));
    expect_matches(c, s, TypeParam::tolerance);
    expect_matches(c, m, TypeParam::tolerance);
    EXPECT_EQ(c.stats().tokens, m.length(g) + s.length(g));
  }
}

TYPED_TEST_P(cache_suite, release_rejects_id) {
  using namespace kvcache_test;
  const kvcache::geometry g = suite_geometries()[0];
  random_source rnd;
  SCOPED_TRACE(rnd.trace());
  auto c = TypeParam::make(g);
  model_seq keep = create_seq(c);
  ASSERT_TRUE(append(c, keep, 4, rnd));
  model_seq m = create_seq(c);
  ASSERT_TRUE(append(c, m, 10, rnd));
  const auto before_stats = c.stats();
  ASSERT_TRUE(c.release(m.id).has_value());
  const auto after_stats = c.stats();
  EXPECT_EQ(after_stats.tokens, before_stats.tokens - 10);
  if constexpr (requires { after_stats.sequences; }) { EXPECT_EQ(after_stats.sequences, before_stats.sequences - 1); }

  const std::vector<kvcache::seq_id> ids{keep.id, m.id};
  const auto k = rnd.values(g.token_width());
  const std::span<const float> ks(k);
  constexpr auto unknown = kvcache::errc::unknown_sequence;
  KVCACHE_SUITE_EXPECT_FAILS_UNCHANGED(c, ids, unknown, c.length(m.id));
  KVCACHE_SUITE_EXPECT_FAILS_UNCHANGED(c, ids, unknown, c.view(m.id, 0));
  KVCACHE_SUITE_EXPECT_FAILS_UNCHANGED(c, ids, unknown, c.reserve(m.id, 1));
  KVCACHE_SUITE_EXPECT_FAILS_UNCHANGED(c, ids, unknown, c.write(m.id, 0, ks, ks));
  KVCACHE_SUITE_EXPECT_FAILS_UNCHANGED(c, ids, unknown, c.commit(m.id));
  KVCACHE_SUITE_EXPECT_FAILS_UNCHANGED(c, ids, unknown, c.truncate(m.id, 0));
  KVCACHE_SUITE_EXPECT_FAILS_UNCHANGED(c, ids, unknown, c.release(m.id));

  // The id stays dead after its slot is reused by new sequences.
  std::vector<model_seq> fresh;
  for (int i = 0; i < 3; ++i) {
    fresh.push_back(create_seq(c));
    EXPECT_NE(fresh.back().id, m.id);
    EXPECT_NE(fresh.back().id, keep.id);
    ASSERT_TRUE(append(c, fresh.back(), 2, rnd));
  }
  KVCACHE_SUITE_EXPECT_FAILS_UNCHANGED(c, ids, unknown, c.length(m.id));
  KVCACHE_SUITE_EXPECT_FAILS_UNCHANGED(c, ids, unknown, c.reserve(m.id, 1));
  expect_matches(c, keep, TypeParam::tolerance);
  for (const model_seq& f : fresh) expect_matches(c, f, TypeParam::tolerance);

  // Release with a reservation open drops the reservation with the sequence.
  ASSERT_TRUE(c.reserve(fresh[0].id, 3).has_value());
  ASSERT_TRUE(c.release(fresh[0].id).has_value());
  KVCACHE_SUITE_EXPECT_FAILS_UNCHANGED(c, ids, unknown, c.commit(fresh[0].id));
  EXPECT_EQ(c.stats().tokens, keep.length(g) + fresh[1].length(g) + fresh[2].length(g));
}

TYPED_TEST_P(cache_suite, bad_input_leaves_state_unchanged) {
  using namespace kvcache_test;
  using kvcache::errc;
  for (const kvcache::geometry g : suite_geometries()) {
    random_source rnd;
    SCOPED_TRACE(rnd.trace() + ", head_dim " + std::to_string(g.head_dim));
    auto c = TypeParam::make(g);
    const std::size_t tw = g.token_width();
    model_seq a = create_seq(c);  // will hold an open, partly written reservation
    model_seq b = create_seq(c);  // committed tokens, no reservation
    model_seq e = create_seq(c);  // empty
    ASSERT_TRUE(append(c, a, 21, rnd));
    ASSERT_TRUE(append(c, b, 13, rnd));
    model_seq dead = create_seq(c);
    ASSERT_TRUE(append(c, dead, 2, rnd));
    ASSERT_TRUE(c.release(dead.id).has_value());
    const std::vector<kvcache::seq_id> ids{a.id, b.id, e.id, dead.id};

    // a: reserve 3, write layer 0 only.
    constexpr std::size_t n = 3;
    ASSERT_TRUE(c.reserve(a.id, n).has_value());
    std::vector<std::vector<float>> pk, pv;
    for (std::uint32_t l = 0; l < g.layers; ++l) {
      pk.push_back(rnd.values(n * tw));
      pv.push_back(rnd.values(n * tw));
    }
    ASSERT_TRUE(c.write(a.id, 0, std::span<const float>(pk[0]), std::span<const float>(pv[0])).has_value());

    const std::span<const float> k0(pk[0]), v0(pv[0]);
    const std::vector<float> one = rnd.values(tw);
    const std::span<const float> k1(one);
    const kvcache::seq_id never{0x7777'0000'0000'1234ull};

    // Unknown ids (never created, released) on every call.
    for (kvcache::seq_id bad : {never, dead.id}) {
      KVCACHE_SUITE_EXPECT_FAILS_UNCHANGED(c, ids, errc::unknown_sequence, c.length(bad));
      KVCACHE_SUITE_EXPECT_FAILS_UNCHANGED(c, ids, errc::unknown_sequence, c.view(bad, 0));
      KVCACHE_SUITE_EXPECT_FAILS_UNCHANGED(c, ids, errc::unknown_sequence, c.reserve(bad, 1));
      KVCACHE_SUITE_EXPECT_FAILS_UNCHANGED(c, ids, errc::unknown_sequence, c.write(bad, 0, k1, k1));
      KVCACHE_SUITE_EXPECT_FAILS_UNCHANGED(c, ids, errc::unknown_sequence, c.commit(bad));
      KVCACHE_SUITE_EXPECT_FAILS_UNCHANGED(c, ids, errc::unknown_sequence, c.truncate(bad, 0));
      KVCACHE_SUITE_EXPECT_FAILS_UNCHANGED(c, ids, errc::unknown_sequence, c.release(bad));
    }
    // Protocol misuse.
    KVCACHE_SUITE_EXPECT_FAILS_UNCHANGED(c, ids, errc::not_reserved, c.write(b.id, 0, k1, k1));
    KVCACHE_SUITE_EXPECT_FAILS_UNCHANGED(c, ids, errc::not_reserved, c.write(e.id, 0, k1, k1));
    KVCACHE_SUITE_EXPECT_FAILS_UNCHANGED(c, ids, errc::not_reserved, c.commit(b.id));
    KVCACHE_SUITE_EXPECT_FAILS_UNCHANGED(c, ids, errc::not_reserved, c.commit(e.id));
    if (g.layers > 1) KVCACHE_SUITE_EXPECT_FAILS_UNCHANGED(c, ids, errc::incomplete_write, c.commit(a.id));
    KVCACHE_SUITE_EXPECT_FAILS_UNCHANGED(c, ids, errc::reservation_pending, c.reserve(a.id, 1));
    KVCACHE_SUITE_EXPECT_FAILS_UNCHANGED(c, ids, errc::reservation_pending, c.truncate(a.id, 0));
    // Shapes and layers.
    KVCACHE_SUITE_EXPECT_FAILS_UNCHANGED(c, ids, errc::layer_out_of_range, c.write(a.id, g.layers, k0, v0));
    KVCACHE_SUITE_EXPECT_FAILS_UNCHANGED(c, ids, errc::layer_out_of_range, c.write(a.id, 1000000, k0, v0));
    KVCACHE_SUITE_EXPECT_FAILS_UNCHANGED(c, ids, errc::layer_out_of_range, c.view(b.id, g.layers));
    KVCACHE_SUITE_EXPECT_FAILS_UNCHANGED(c, ids, errc::bad_shape, c.write(a.id, 1 % g.layers, k1, k1));
    KVCACHE_SUITE_EXPECT_FAILS_UNCHANGED(c, ids, errc::bad_shape, c.write(a.id, 0, k0.first(n * tw - 1), v0));
    KVCACHE_SUITE_EXPECT_FAILS_UNCHANGED(c, ids, errc::bad_shape, c.write(a.id, 0, k0, v0.first(n * tw - 1)));
    KVCACHE_SUITE_EXPECT_FAILS_UNCHANGED(c, ids, errc::bad_shape,
                                         c.write(a.id, 0, k0, std::span<const float>(pv[0].data(), 0)));
    {
      std::vector<float> big(n * tw + 1, 0.5f);
      KVCACHE_SUITE_EXPECT_FAILS_UNCHANGED(c, ids, errc::bad_shape,
                                           c.write(a.id, 0, std::span<const float>(big), v0));
    }
    // Counts.
    KVCACHE_SUITE_EXPECT_FAILS_UNCHANGED(c, ids, errc::out_of_range, c.truncate(b.id, 14));
    KVCACHE_SUITE_EXPECT_FAILS_UNCHANGED(c, ids, errc::out_of_range, c.truncate(e.id, 1));
    KVCACHE_SUITE_EXPECT_FAILS_UNCHANGED(c, ids, errc::out_of_range, c.truncate(b.id, ~std::size_t{0}));
    {
      const auto before = snapshot(c, ids);
      const auto r = c.reserve(b.id, std::size_t{1} << 40);
      ASSERT_FALSE(r.has_value()) << "reserving 2^40 tokens succeeded";
      EXPECT_TRUE(r.error().code == errc::capacity_exceeded || r.error().code == errc::pool_exhausted)
          << kvcache::to_string(r.error().code);
      EXPECT_TRUE(snapshot(c, ids) == before);
    }
    // No failed write counted as written: the reservation of a is still incomplete.
    if (g.layers > 1) KVCACHE_SUITE_EXPECT_FAILS_UNCHANGED(c, ids, errc::incomplete_write, c.commit(a.id));
    // b is still usable after the failed reserve; e likewise.
    ASSERT_TRUE(append(c, b, 2, rnd));
    ASSERT_TRUE(append(c, e, 1, rnd));

    // The open reservation of a survived every failure with its layer 0 written: finish it.
    for (std::uint32_t l = 1; l < g.layers; ++l)
      ASSERT_TRUE(c.write(a.id, l, std::span<const float>(pk[l]), std::span<const float>(pv[l])).has_value());
    ASSERT_TRUE(c.commit(a.id).has_value());
    for (std::uint32_t l = 0; l < g.layers; ++l) {
      a.k[l].insert(a.k[l].end(), pk[l].begin(), pk[l].end());
      a.v[l].insert(a.v[l].end(), pv[l].begin(), pv[l].end());
    }
    // Committing twice: no reservation is open any more.
    KVCACHE_SUITE_EXPECT_FAILS_UNCHANGED(c, ids, errc::not_reserved, c.commit(a.id));
    KVCACHE_SUITE_EXPECT_FAILS_UNCHANGED(c, ids, errc::not_reserved, c.write(a.id, 0, k0, v0));
    expect_matches(c, a, TypeParam::tolerance);
    expect_matches(c, b, TypeParam::tolerance);
    expect_matches(c, e, TypeParam::tolerance);
  }
}

TYPED_TEST_P(cache_suite, rewriting_a_layer_keeps_the_last_write) {
  using namespace kvcache_test;
  const kvcache::geometry g = suite_geometries()[0];
  random_source rnd;
  SCOPED_TRACE(rnd.trace());
  auto c = TypeParam::make(g);
  model_seq m = create_seq(c);
  ASSERT_TRUE(append(c, m, 8, rnd));
  const std::size_t tw = g.token_width();
  ASSERT_TRUE(c.reserve(m.id, 2).has_value());
  for (std::uint32_t l = 0; l < g.layers; ++l) {
    const auto k_first = rnd.values(2 * tw);
    ASSERT_TRUE(c.write(m.id, l, std::span<const float>(k_first), std::span<const float>(k_first)).has_value());
    const auto k = rnd.values(2 * tw);
    const auto v = rnd.values(2 * tw);
    ASSERT_TRUE(c.write(m.id, l, std::span<const float>(k), std::span<const float>(v)).has_value());
    m.k[l].insert(m.k[l].end(), k.begin(), k.end());
    m.v[l].insert(m.v[l].end(), v.begin(), v.end());
  }
  ASSERT_TRUE(c.commit(m.id).has_value());
  expect_matches(c, m, TypeParam::tolerance);
}

TYPED_TEST_P(cache_suite, random_operations_match_model) {
  using namespace kvcache_test;
  for (const kvcache::geometry g : suite_geometries()) {
    random_source rnd;
    SCOPED_TRACE(rnd.trace() + ", head_dim " + std::to_string(g.head_dim));
    auto c = TypeParam::make(g);
    std::vector<model_seq> live;
    std::vector<kvcache::seq_id> released;
    for (int op = 0; op < 300; ++op) {
      const std::size_t kind = rnd.between(0, 9);
      if (live.empty() || (kind == 0 && live.size() < suite_sequences)) {
        live.push_back(create_seq(c));
      } else if (kind == 1 && live.size() > 1) {
        const std::size_t i = rnd.between(0, live.size() - 1);
        ASSERT_TRUE(c.release(live[i].id).has_value());
        released.push_back(live[i].id);
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
      } else if (kind == 2) {
        model_seq& m = live[rnd.between(0, live.size() - 1)];
        const std::size_t len = m.length(g);
        const std::size_t keep = len < 32 ? rnd.between(0, len) : len - rnd.between(0, std::min<std::size_t>(7, len));
        ASSERT_TRUE(c.truncate(m.id, keep).has_value());
        truncate_model(m, keep, g);
      } else {
        model_seq& m = live[rnd.between(0, live.size() - 1)];
        const std::size_t room = suite_tokens - m.length(g);
        if (room == 0) continue;
        ASSERT_TRUE(append(c, m, std::min(room, rnd.between(1, 10)), rnd, kind == 9));
      }
      std::size_t total = 0;
      for (const model_seq& m : live) total += m.length(g);
      const auto st = c.stats();
      ASSERT_EQ(st.tokens, total) << "after op " << op;
      if constexpr (requires { st.sequences; }) { ASSERT_EQ(st.sequences, live.size()); }
      if (op % 25 == 0)
        for (const model_seq& m : live) expect_matches(c, m, TypeParam::tolerance);
    }
    for (const model_seq& m : live) expect_matches(c, m, TypeParam::tolerance);
    for (kvcache::seq_id id : released) {
      const auto r = c.length(id);
      ASSERT_FALSE(r.has_value());
      EXPECT_EQ(r.error().code, kvcache::errc::unknown_sequence);
    }
    // Releasing everything returns the token count to zero.
    for (const model_seq& m : live) ASSERT_TRUE(c.release(m.id).has_value());
    const auto st = c.stats();
    EXPECT_EQ(st.tokens, 0u);
    if constexpr (requires { st.sequences; }) { EXPECT_EQ(st.sequences, 0u); }
  }
}

TYPED_TEST_P(cache_suite, stats_track_lengths) {
  using namespace kvcache_test;
  const kvcache::geometry g = suite_geometries()[1];
  random_source rnd;
  SCOPED_TRACE(rnd.trace());
  auto c = TypeParam::make(g);
  const auto empty = c.stats();
  EXPECT_EQ(empty.tokens, 0u);
  if constexpr (requires { empty.sequences; }) { EXPECT_EQ(empty.sequences, 0u); }
  model_seq a = create_seq(c);
  model_seq b = create_seq(c);
  ASSERT_TRUE(append(c, a, 30, rnd));
  ASSERT_TRUE(append(c, b, 17, rnd));
  auto st = c.stats();
  EXPECT_EQ(st.tokens, 47u);
  if constexpr (requires { st.sequences; }) { EXPECT_EQ(st.sequences, 2u); }
  EXPECT_GT(st.resident_bytes, 0u);
  // Every committed token's K and V (2 * layers * token_width values) are resident somewhere, at
  // no less than 4 bits per value: at least tokens * layers * token_width bytes.
  EXPECT_GE(st.resident_bytes, st.tokens * g.layers * g.token_width());
  // A pending reservation is not counted as tokens.
  ASSERT_TRUE(c.reserve(a.id, 5).has_value());
  EXPECT_EQ(c.stats().tokens, 47u);
  EXPECT_EQ(c.length(a.id).value(), 30u);
  const auto k = rnd.values(5 * g.token_width());
  for (std::uint32_t l = 0; l < g.layers; ++l)
    ASSERT_TRUE(c.write(a.id, l, std::span<const float>(k), std::span<const float>(k)).has_value());
  EXPECT_EQ(c.stats().tokens, 47u);
  ASSERT_TRUE(c.commit(a.id).has_value());
  EXPECT_EQ(c.stats().tokens, 52u);
  EXPECT_EQ(c.length(a.id).value(), 35u);
  ASSERT_TRUE(c.truncate(a.id, 33).has_value());
  EXPECT_EQ(c.stats().tokens, 50u);
  ASSERT_TRUE(c.release(b.id).has_value());
  st = c.stats();
  EXPECT_EQ(st.tokens, 33u);
  if constexpr (requires { st.sequences; }) { EXPECT_EQ(st.sequences, 1u); }
}

REGISTER_TYPED_TEST_SUITE_P(cache_suite, round_trip, multi_step_appends, pending_reservation_is_invisible,
                            many_sequences_independent, truncate_then_append, release_rejects_id,
                            bad_input_leaves_state_unchanged, rewriting_a_layer_keeps_the_last_write,
                            random_operations_match_model, stats_track_lengths);
