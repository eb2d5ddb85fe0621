// paged_cache<cpu>: the shared Cache suite (f32, f16) and the paged-only guarantees: pool
// creation checks, exhaustion, fork / copy_prefix with copy-on-write, truncation, CSR export,
// internal waste and allocation-free decode.
#include <kvcache/block_pool.hpp>
#include <kvcache/paged_cache.hpp>

#include "cache_suite.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace {

using kvcache::block_pool;
using kvcache::block_pool_config;
using kvcache::cpu;
using kvcache::errc;
using kvcache::format;
using kvcache::geometry;
using kvcache::paged_cache;
using kvcache::paged_config;
using kvcache::seq_id;

/// Suite traits: a paged cache (B = 16) with room for suite_sequences * suite_tokens tokens.
template <format F, std::uint32_t B = 16>
struct paged_traits {
  using cache_type = paged_cache<cpu>;
  static constexpr const char* name = F == format::f32 ? (B == 16 ? "paged_f32" : "paged_f32_b4")
                                                       : (B == 16 ? "paged_f16" : "paged_f16_b4");
  static constexpr double tolerance = F == format::f32 ? 0.0 : 0x1p-12;
  static cache_type make(const geometry& g) {
    paged_config<cpu> cfg;
    cfg.shape = g;
    cfg.storage = F;
    cfg.block_tokens = B;
    const std::size_t blocks = kvcache_test::suite_sequences * (kvcache_test::suite_tokens / B + 2);
    cfg.budget_bytes = blocks * 2 * g.layers * g.token_width() * B * (F == format::f32 ? 4 : 2);
    auto c = cache_type::create(cfg);
    EXPECT_TRUE(c.has_value()) << c.error().message;
    return std::move(c).value();
  }
};

using paged_types = ::testing::Types<paged_traits<format::f32>, paged_traits<format::f16>,
                                     paged_traits<format::f16, 4>>;
INSTANTIATE_TYPED_TEST_SUITE_P(paged, cache_suite, paged_types, kvcache_test::traits_name);

}  // namespace
