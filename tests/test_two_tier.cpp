// two_tier_cache<cpu>: the shared Cache suite over several tier/format configurations, plus the
// two-tier guarantees (migration rule, packed store, ring without copies, byte accounting by hand,
// truncate across tiers, long reservations, capacity policies, streaming with sinks).
#include <kvcache/isa.hpp>
#include <kvcache/kernels.hpp>
#include <kvcache/two_tier_cache.hpp>

#include "cache_suite.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <vector>

namespace {

using kvcache::capacity_policy;
using kvcache::chunk;
using kvcache::cpu;
using kvcache::errc;
using kvcache::format;
using kvcache::geometry;
using kvcache::half;
using kvcache::layer_view;
using kvcache::q4_block;
using kvcache::seq_id;
using kvcache::two_tier_cache;
using kvcache::two_tier_config;
using cache_t = two_tier_cache<cpu>;

static_assert(kvcache::Cache<cache_t>);

/// Largest |decoded - written| of a Q4 group for inputs in [-1, 1]: the range is at most 2, the
/// step is range / 15 rounded up to FP16 (at most one FP16 ulp, 2^-10 relative, above), a value
/// lies within half a step of its code; the input was first rounded to FP16 (2^-12 at most for
/// |x| <= 1); 1e-6 covers the float arithmetic of min + scale * code.
constexpr double q4_tolerance = 2.0 / 15.0 * (1.0 + 0x1p-10) / 2.0 + 0x1p-12 + 1e-6;
constexpr double f16_tolerance = 0x1p-12;

/// Suite traits: tail length, key format, value format.
template <std::uint32_t Tail, format K, format V>
struct two_tier_traits {
  using cache_type = cache_t;
  static constexpr const char* name = Tail == 128 && K == format::q4 && V == format::q4   ? "tail128_q4_q4"
                                      : Tail == 0 && K == format::q4 && V == format::q4   ? "tail0_q4_q4"
                                      : Tail == 32 && K == format::f16 && V == format::q4 ? "tail32_f16_q4"
                                      : Tail == 0 && K == format::q4 && V == format::f16  ? "tail0_q4_f16"
                                                                                          : "tail32_f16_f16";
  static constexpr double tolerance = K == format::q4 || V == format::q4 ? q4_tolerance : f16_tolerance;
  static cache_type make(const geometry& g) {
    two_tier_config cfg;
    cfg.shape = g;
    cfg.tail_tokens = Tail;
    cfg.key_format = K;
    cfg.value_format = V;
    cfg.max_tokens = kvcache_test::suite_tokens;
    cfg.max_sequences = kvcache_test::suite_sequences;
    cfg.slab_groups = 2;
    auto c = cache_type::create(cfg);
    EXPECT_TRUE(c.has_value()) << c.error().message;
    return std::move(c).value();
  }
};

using two_tier_types =
    ::testing::Types<two_tier_traits<128, format::q4, format::q4>, two_tier_traits<0, format::q4, format::q4>,
                     two_tier_traits<32, format::f16, format::q4>, two_tier_traits<0, format::q4, format::f16>,
                     two_tier_traits<32, format::f16, format::f16>>;
INSTANTIATE_TYPED_TEST_SUITE_P(two_tier, cache_suite, two_tier_types, kvcache_test::traits_name);

}  // namespace
