// contiguous_cache<cpu>: the shared Cache suite for f32 and f16 storage, plus the contiguous-only
// guarantees (configuration checks, capacity, f16 input, zero-copy views, byte accounting).
#include <kvcache/contiguous_cache.hpp>
#include <kvcache/isa.hpp>

#include "cache_suite.hpp"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace {

using kvcache::contiguous_cache;
using kvcache::contiguous_config;
using kvcache::cpu;
using kvcache::errc;
using kvcache::format;
using kvcache::geometry;
using kvcache::half;
using kvcache::seq_id;

/// Suite traits: a contiguous cache of suite_sequences sequences of suite_tokens tokens.
template <format F>
struct contiguous_traits {
  using cache_type = contiguous_cache<cpu>;
  static constexpr const char* name = F == format::f32 ? "contiguous_f32" : "contiguous_f16";
  static constexpr double tolerance = F == format::f32 ? 0.0 : 0x1p-12;
  static cache_type make(const geometry& g) {
    auto c = cache_type::create(
        contiguous_config{g, F, kvcache_test::suite_sequences, kvcache_test::suite_tokens});
    EXPECT_TRUE(c.has_value());
    return std::move(c).value();
  }
};

using contiguous_types = ::testing::Types<contiguous_traits<format::f32>, contiguous_traits<format::f16>>;
INSTANTIATE_TYPED_TEST_SUITE_P(contiguous, cache_suite, contiguous_types, kvcache_test::traits_name);

contiguous_cache<cpu> make(geometry g, format f, std::size_t seqs, std::size_t cap) {
  auto c = contiguous_cache<cpu>::create(contiguous_config{g, f, seqs, cap});
  EXPECT_TRUE(c.has_value()) << c.error().message;
  return std::move(c).value();
}

template <class R>
void expect_error(const R& r, errc code, const std::vector<std::string>& words) {
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code, code) << kvcache::to_string(r.error().code) << ": " << r.error().message;
  for (const std::string& w : words)
    EXPECT_NE(r.error().message.find(w), std::string::npos) << "'" << w << "' not in: " << r.error().message;
}

TEST(contiguous_config_check, zero_geometry_is_invalid_and_named) {
  expect_error(contiguous_cache<cpu>::create({geometry{0, 2, 8}, format::f16, 1, 4}), errc::invalid_argument,
               {"layers=0"});
  expect_error(contiguous_cache<cpu>::create({geometry{2, 0, 8}, format::f16, 1, 4}), errc::invalid_argument,
               {"kv_heads=0"});
  expect_error(contiguous_cache<cpu>::create({geometry{2, 2, 0}, format::f32, 1, 4}), errc::invalid_argument,
               {"head_dim=0"});
}

TEST(contiguous_config_check, bad_counts_and_format_are_invalid) {
  const geometry g{2, 2, 8};
  expect_error(contiguous_cache<cpu>::create({g, format::q4, 1, 4}), errc::invalid_argument, {"format=2"});
  expect_error(contiguous_cache<cpu>::create({g, format::f16, 0, 4}), errc::invalid_argument, {"max_sequences=0"});
  expect_error(contiguous_cache<cpu>::create({g, format::f16, 1, 0}), errc::invalid_argument,
               {"capacity_tokens=0"});
  expect_error(contiguous_cache<cpu>::create({g, format::f16, 1, std::size_t{1} << 32}), errc::invalid_argument,
               {"capacity_tokens=4294967296"});
}

TEST(contiguous_config_check, byte_overflow_is_reported) {
  // One head: 2^32-1 tokens * 2^31 channels * 4 bytes > 2^64.
  expect_error(contiguous_cache<cpu>::create({geometry{1, 1, 1u << 31}, format::f32, 1, 0xffffffffu}),
               errc::overflow, {});
  // One sequence fits (2^40 bytes of bookkeeping-free arithmetic) but max_sequences of them do not.
  expect_error(contiguous_cache<cpu>::create({geometry{1u << 20, 1, 1u << 10}, format::f32, 0xffffffffu, 1u << 20}),
               errc::overflow, {});
  // Large but representable configurations are accepted without allocating K/V storage.
  auto big = contiguous_cache<cpu>::create({geometry{80, 8, 128}, format::f16, 64, 1u << 20});
  ASSERT_TRUE(big.has_value()) << big.error().message;
  EXPECT_EQ(big.value().stats().resident_bytes, 0u);
  // Buffers of 1 MiB and more are staggered by 68 KiB (K and V not a power of two apart).
  EXPECT_EQ(big.value().bytes_per_sequence(), std::size_t{80} * 2 * (std::size_t{8} * (1u << 20) * 128 * 2 + (68u << 10)));
}

TEST(contiguous, capacity_is_per_sequence_and_exact) {
  const geometry g{2, 2, 8};
  auto c = make(g, format::f32, 2, 10);
  const seq_id s = c.create().value();
  expect_error(c.reserve(s, 11), errc::capacity_exceeded, {"requested=11", "available=10"});
  ASSERT_TRUE(c.reserve(s, 10).has_value());
  const std::vector<float> kv(10 * g.token_width(), 1.0f);
  for (std::uint32_t l = 0; l < g.layers; ++l) ASSERT_TRUE(c.write(s, l, std::span(kv), std::span(kv)).has_value());
  ASSERT_TRUE(c.commit(s).has_value());
  expect_error(c.reserve(s, 1), errc::capacity_exceeded, {"requested=1", "available=0"});
  // A zero-token reservation is accepted when full; it needs empty writes of every layer.
  ASSERT_TRUE(c.reserve(s, 0).has_value());
  expect_error(c.commit(s), errc::incomplete_write, {"layer=0"});
  for (std::uint32_t l = 0; l < g.layers; ++l)
    ASSERT_TRUE(c.write(s, l, std::span<const float>(), std::span<const float>()).has_value());
  ASSERT_TRUE(c.commit(s).has_value());
  EXPECT_EQ(c.length(s).value(), 10u);
  // Truncation frees slots again.
  ASSERT_TRUE(c.truncate(s, 4).has_value());
  ASSERT_TRUE(c.reserve(s, 6).has_value());
}

TEST(contiguous, max_sequences_limits_create) {
  auto c = make(geometry{1, 1, 4}, format::f16, 3, 5);
  std::vector<seq_id> ids;
  for (int i = 0; i < 3; ++i) ids.push_back(c.create().value());
  const auto before = c.stats();
  expect_error(c.create(), errc::capacity_exceeded, {"max_sequences=3"});
  const auto after = c.stats();
  EXPECT_EQ(after.sequences, before.sequences);
  EXPECT_EQ(after.resident_bytes, before.resident_bytes);
  ASSERT_TRUE(c.release(ids[1]).has_value());
  const auto again = c.create();
  ASSERT_TRUE(again.has_value());
  EXPECT_NE(again.value(), ids[1]);
  EXPECT_EQ(c.stats().sequences, 3u);
}

TEST(contiguous, resident_bytes_are_the_allocated_bytes) {
  const geometry g{3, 2, 10};  // 2 heads * 7 tokens * 10 * 2 bytes = 280 -> padded to 320 per buffer
  auto c = make(g, format::f16, 4, 7);
  EXPECT_EQ(c.bytes_per_sequence(), 3u * 2u * 320u);
  EXPECT_EQ(c.stats().resident_bytes, 0u);
  const seq_id a = c.create().value();
  const seq_id b = c.create().value();
  auto st = c.stats();
  EXPECT_EQ(st.resident_bytes, 2 * c.bytes_per_sequence());
  EXPECT_EQ(st.capacity_tokens, 14u);
  EXPECT_EQ(st.max_sequences, 4u);
  ASSERT_TRUE(c.reserve(a, 3).has_value());
  EXPECT_EQ(c.stats().reserved_tokens, 3u);
  ASSERT_TRUE(c.release(a).has_value());
  st = c.stats();
  EXPECT_EQ(st.reserved_tokens, 0u);
  EXPECT_EQ(st.resident_bytes, c.bytes_per_sequence());
  ASSERT_TRUE(c.release(b).has_value());
  EXPECT_EQ(c.stats().resident_bytes, 0u);
}

// Appends n tokens whose K/V come from `fill` through the float interface.
void append_values(contiguous_cache<cpu>& c, seq_id s, const std::vector<float>& k, const std::vector<float>& v) {
  const geometry g = c.shape();
  const std::size_t n = k.size() / g.token_width();
  ASSERT_TRUE(c.reserve(s, n).has_value());
  for (std::uint32_t l = 0; l < g.layers; ++l) ASSERT_TRUE(c.write(s, l, std::span(k), std::span(v)).has_value());
  ASSERT_TRUE(c.commit(s).has_value());
}

TEST(contiguous, view_is_zero_copy_aligned_and_stable) {
  kvcache_test::random_source rnd;
  SCOPED_TRACE(rnd.trace());
  const geometry g{2, 3, 24};
  const std::size_t cap = 50;
  for (format f : {format::f32, format::f16}) {
    auto c = make(g, f, 2, cap);
    const seq_id s = c.create().value();
    const seq_id other = c.create().value();
    const std::vector<float> k = rnd.values(5 * g.token_width());
    const std::vector<float> v = rnd.values(5 * g.token_width());
    append_values(c, s, k, v);
    append_values(c, other, k, v);
    const std::size_t elem = f == format::f32 ? 4 : 2;
    std::vector<kvcache::layer_view> first;
    for (std::uint32_t l = 0; l < g.layers; ++l) {
      const kvcache::layer_view lv = c.view(s, l).value();
      ASSERT_EQ(lv.count, 1u);
      const kvcache::chunk& ch = lv[0];
      EXPECT_EQ(ch.tokens, 5u);
      EXPECT_EQ(ch.k_format, f);
      EXPECT_EQ(ch.v_format, f);
      EXPECT_EQ(reinterpret_cast<std::uintptr_t>(ch.k) % 64, 0u);
      EXPECT_EQ(reinterpret_cast<std::uintptr_t>(ch.v) % 64, 0u);
      EXPECT_EQ(ch.k_head_stride, cap * g.head_dim * elem);
      EXPECT_EQ(ch.v_head_stride, cap * g.head_dim * elem);
      // The raw layout is [kv_head][token][head_dim] of the storage format.
      for (std::uint32_t h = 0; h < g.kv_heads; ++h)
        for (std::uint32_t t = 0; t < 5; ++t)
          for (std::uint32_t d = 0; d < g.head_dim; ++d) {
            const std::size_t src = t * g.token_width() + h * g.head_dim + d;
            const std::size_t dst = (static_cast<std::size_t>(t) * g.head_dim + d) * elem;
            float gk, gv;
            if (f == format::f32) {
              std::memcpy(&gk, ch.k_head(h) + dst, 4);
              std::memcpy(&gv, ch.v_head(h) + dst, 4);
              EXPECT_EQ(gk, k[src]);
              EXPECT_EQ(gv, v[src]);
            } else {
              half hk, hv;
              std::memcpy(&hk, ch.k_head(h) + dst, 2);
              std::memcpy(&hv, ch.v_head(h) + dst, 2);
              EXPECT_EQ(hk, kvcache::to_half(k[src]));
              EXPECT_EQ(hv, kvcache::to_half(v[src]));
            }
          }
      first.push_back(lv);
    }
    // Appends, truncation and moving the cache keep the same chunk arrays and buffers.
    append_values(c, s, k, v);
    ASSERT_TRUE(c.truncate(s, 7).has_value());
    contiguous_cache<cpu> moved = std::move(c);
    for (std::uint32_t l = 0; l < g.layers; ++l) {
      const kvcache::layer_view lv = moved.view(s, l).value();
      EXPECT_EQ(lv.chunks, first[l].chunks);
      EXPECT_EQ(lv[0].k, first[l][0].k);
      EXPECT_EQ(lv[0].v, first[l][0].v);
      EXPECT_EQ(lv.tokens, 7u);
      EXPECT_EQ(lv[0].tokens, 7u);
      // The earlier view reads the cache live: its chunk now says 7 tokens too.
      EXPECT_EQ(first[l][0].tokens, 7u);
    }
    // Distinct sequences and layers never share storage.
    EXPECT_NE(moved.view(s, 0).value()[0].k, moved.view(other, 0).value()[0].k);
    EXPECT_NE(moved.view(s, 0).value()[0].k, moved.view(s, 1).value()[0].k);
    // An empty sequence has no chunk.
    ASSERT_TRUE(moved.truncate(s, 0).has_value());
    EXPECT_EQ(moved.view(s, 0).value().count, 0u);
  }
}

TEST(contiguous, f16_storage_rounds_like_to_half_on_every_isa) {
  const geometry g{1, 2, 37};  // ragged head_dim for SIMD tails
  kvcache_test::random_source rnd;
  SCOPED_TRACE(rnd.trace());
  const kvcache::isa original = kvcache::active_isa();
  std::vector<float> k = rnd.values(9 * g.token_width());
  // Special values: halfway points, subnormal boundary, overflow boundary, signed zero, inf, NaN.
  const float specials[] = {0.0f, -0.0f, 65504.0f, 65519.99f, 65520.0f, -65520.0f, 0x1p-24f, 0x1p-25f,
                            0x1.8p-25f, 0x1p-14f, 0x1.ffcp-15f, 1.0f + 0x1p-11f, 1.0f + 0x3p-11f,
                            std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN(), 1e-30f, -3e38f};
  for (std::size_t i = 0; i < std::size(specials); ++i) k[i * 3] = specials[i];
  for (kvcache::isa i : {kvcache::isa::scalar, kvcache::isa::avx2, kvcache::isa::avx512, kvcache::isa::neon}) {
    if (!kvcache::isa_supported(i)) continue;
    SCOPED_TRACE(std::string(kvcache::to_string(i)));
    ASSERT_TRUE(kvcache::force_isa(i).has_value());
    auto c = make(g, format::f16, 1, 9);
    const seq_id s = c.create().value();
    append_values(c, s, k, k);
    const kvcache::chunk ch = c.view(s, 0).value()[0];
    for (std::uint32_t h = 0; h < g.kv_heads; ++h)
      for (std::uint32_t t = 0; t < 9; ++t)
        for (std::uint32_t d = 0; d < g.head_dim; ++d) {
          half got;
          std::memcpy(&got, ch.k_head(h) + (t * g.head_dim + d) * 2, 2);
          const float x = k[t * g.token_width() + h * g.head_dim + d];
          EXPECT_EQ(got.bits, kvcache::to_half(x).bits) << "input " << x;
        }
  }
  ASSERT_TRUE(kvcache::force_isa(original).has_value());
}

TEST(contiguous, half_input_overload) {
  const geometry g{2, 2, 19};
  kvcache_test::random_source rnd;
  SCOPED_TRACE(rnd.trace());
  const std::size_t n = 6;
  std::vector<half> k(n * g.token_width()), v(n * g.token_width());
  std::uniform_int_distribution<unsigned> bits(0, 0xffff);
  for (half& x : k) x.bits = static_cast<std::uint16_t>(bits(rnd.gen));
  for (half& x : v) x.bits = static_cast<std::uint16_t>(bits(rnd.gen));
  for (format f : {format::f16, format::f32}) {
    auto c = make(g, f, 1, 8);
    const seq_id s = c.create().value();
    ASSERT_TRUE(c.reserve(s, n).has_value());
    expect_error(c.write(s, 0, std::span<const half>(k).first(3), std::span<const half>(v)), errc::bad_shape,
                 {"expected=228", "got=3"});
    expect_error(c.write(s, 2, std::span<const half>(k), std::span<const half>(v)), errc::layer_out_of_range,
                 {"layer=2"});
    for (std::uint32_t l = 0; l < g.layers; ++l)
      ASSERT_TRUE(c.write(s, l, std::span<const half>(k), std::span<const half>(v)).has_value());
    ASSERT_TRUE(c.commit(s).has_value());
    for (std::uint32_t l = 0; l < g.layers; ++l) {
      const kvcache::chunk ch = c.view(s, l).value()[0];
      const std::size_t elem = f == format::f32 ? 4 : 2;
      for (std::uint32_t h = 0; h < g.kv_heads; ++h)
        for (std::uint32_t t = 0; t < n; ++t)
          for (std::uint32_t d = 0; d < g.head_dim; ++d) {
            const std::size_t src = t * g.token_width() + h * g.head_dim + d;
            const std::size_t off = (t * g.head_dim + d) * elem;
            if (f == format::f16) {
              half gk, gv;
              std::memcpy(&gk, ch.k_head(h) + off, 2);
              std::memcpy(&gv, ch.v_head(h) + off, 2);
              EXPECT_EQ(gk.bits, k[src].bits);
              EXPECT_EQ(gv.bits, v[src].bits);
            } else {
              float gk, gv;
              std::memcpy(&gk, ch.k_head(h) + off, 4);
              std::memcpy(&gv, ch.v_head(h) + off, 4);
              const float ek = kvcache::to_float(k[src]), ev = kvcache::to_float(v[src]);
              EXPECT_EQ(std::bit_cast<std::uint32_t>(gk), std::bit_cast<std::uint32_t>(ek));
              EXPECT_EQ(std::bit_cast<std::uint32_t>(gv), std::bit_cast<std::uint32_t>(ev));
            }
          }
    }
  }
}

TEST(contiguous, fork_and_copy_prefix_copy_rows) {
  using namespace kvcache_test;
  const geometry g{3, 2, 40};
  for (format f : {format::f32, format::f16}) {
    random_source rnd;
    SCOPED_TRACE(rnd.trace() + ", " + std::string(kvcache::to_string(f)));
    const double tol = f == format::f32 ? 0.0 : 0x1p-12;
    auto c = make(g, f, 4, 64);
    model_seq src = create_seq(c);
    ASSERT_TRUE(append(c, src, 23, rnd));

    model_seq whole = src;
    const auto forked = c.fork(src.id);
    ASSERT_TRUE(forked.has_value()) << forked.error().message;
    whole.id = forked.value();
    model_seq part = src;
    const auto copied = c.copy_prefix(src.id, 9);
    ASSERT_TRUE(copied.has_value()) << copied.error().message;
    part.id = copied.value();
    truncate_model(part, 9, g);
    EXPECT_EQ(c.stats().tokens, 23u + 23u + 9u);
    expect_matches(c, whole, tol);
    expect_matches(c, part, tol);
    // Copies, not shared storage: each sequence grows on its own.
    EXPECT_NE(c.view(whole.id, 0).value()[0].k, c.view(src.id, 0).value()[0].k);
    ASSERT_TRUE(append(c, src, 5, rnd));
    ASSERT_TRUE(append(c, whole, 3, rnd));
    ASSERT_TRUE(append(c, part, 7, rnd));
    expect_matches(c, src, tol);
    expect_matches(c, whole, tol);
    expect_matches(c, part, tol);

    // Failures leave everything as it was.
    const std::vector<seq_id> ids{src.id, whole.id, part.id};
    KVCACHE_SUITE_EXPECT_FAILS_UNCHANGED(c, ids, errc::out_of_range, c.copy_prefix(src.id, 29));
    KVCACHE_SUITE_EXPECT_FAILS_UNCHANGED(c, ids, errc::unknown_sequence, c.fork(seq_id{999}));
    ASSERT_TRUE(c.reserve(src.id, 1).has_value());
    KVCACHE_SUITE_EXPECT_FAILS_UNCHANGED(c, ids, errc::reservation_pending, c.fork(src.id));
    const auto empty = c.copy_prefix(whole.id, 0);  // fills the last slot
    ASSERT_TRUE(empty.has_value());
    EXPECT_EQ(c.length(empty.value()).value(), 0u);
    EXPECT_EQ(c.view(empty.value(), 0).value().count, 0u);
    KVCACHE_SUITE_EXPECT_FAILS_UNCHANGED(c, ids, errc::capacity_exceeded, c.fork(whole.id));
    ASSERT_TRUE(c.release(src.id).has_value());
    KVCACHE_SUITE_EXPECT_FAILS_UNCHANGED(c, ids, errc::unknown_sequence, c.fork(src.id));
    expect_matches(c, whole, tol);
    expect_matches(c, part, tol);
  }
}

TEST(contiguous, error_messages_name_the_values) {
  const geometry g{2, 2, 8};
  auto c = make(g, format::f32, 1, 16);
  const seq_id s = c.create().value();
  ASSERT_TRUE(c.reserve(s, 2).has_value());
  const std::vector<float> kv(2 * g.token_width(), 0.25f);
  expect_error(c.write(s, 7, std::span(kv), std::span(kv)), errc::layer_out_of_range, {"layer=7", "layers=2"});
  expect_error(c.write(s, 0, std::span(kv).first(5), std::span(kv)), errc::bad_shape, {"K", "expected=32", "got=5"});
  expect_error(c.write(s, 0, std::span(kv), std::span(kv).first(31)), errc::bad_shape, {"V", "got=31"});
  ASSERT_TRUE(c.write(s, 1, std::span(kv), std::span(kv)).has_value());
  expect_error(c.commit(s), errc::incomplete_write, {"layer=0"});
  expect_error(c.reserve(s, 1), errc::reservation_pending, {"pending=2"});
  expect_error(c.truncate(s, 0), errc::reservation_pending, {});
  ASSERT_TRUE(c.write(s, 0, std::span(kv), std::span(kv)).has_value());
  ASSERT_TRUE(c.commit(s).has_value());
  expect_error(c.truncate(s, 3), errc::out_of_range, {"n=3", "length=2"});
  expect_error(c.view(s, 2), errc::layer_out_of_range, {"layer=2"});
  expect_error(c.length(seq_id{12345}), errc::unknown_sequence, {"seq=12345"});
}

}  // namespace
