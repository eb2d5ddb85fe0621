// two_tier_cache<cpu> allocates nothing in the per-token path: this binary replaces the global
// operator new (every form: replaced_new.hpp) with counting versions and checks that decode steps
// (reserve 1 / write every layer / commit) and views allocate only when a sequence's store needs
// a new slab (fail policy) and never in the steady state of the streaming policy.
#include <kvcache/two_tier_cache.hpp>

#include <gtest/gtest.h>

#include "replaced_new.hpp"

#include <atomic>
#include <cstdlib>
#include <new>
#include <random>
#include <span>
#include <vector>

namespace {
std::atomic<std::size_t> allocations{0};
}  // namespace

void* kvcache_test_allocate(std::size_t n, std::size_t align) noexcept {
  allocations.fetch_add(1, std::memory_order_relaxed);
  return kvcache_test::system_allocate(n, align);
}

namespace {

using kvcache::format;
using cache_t = kvcache::two_tier_cache<kvcache::cpu>;

struct stepper {
  cache_t& c;
  kvcache::seq_id id;
  std::vector<float> k, v;  // [1][kv_heads][head_dim]
  /// One decode step; returns the allocations it made.
  std::size_t step() {
    const std::size_t before = allocations.load();
    bool ok = c.reserve(id, 1).has_value();
    for (std::uint32_t l = 0; l < c.shape().layers; ++l)
      ok = ok && c.write(id, l, std::span<const float>(k), std::span<const float>(v)).has_value();
    ok = ok && c.commit(id).has_value();
    for (std::uint32_t l = 0; l < c.shape().layers; ++l) ok = ok && c.view(id, l).value().tokens > 0;
    EXPECT_TRUE(ok);
    return allocations.load() - before;
  }
};

stepper make_stepper(cache_t& c, std::uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  stepper s{c, c.create().value(), std::vector<float>(c.shape().token_width()),
            std::vector<float>(c.shape().token_width())};
  for (float& x : s.k) x = d(gen);
  for (float& x : s.v) x = d(gen);
  return s;
}

TEST(two_tier_alloc, decode_steps_allocate_only_for_a_new_slab) {
  for (const auto& [kf, vf] : {std::pair{format::q4, format::q4}, std::pair{format::f16, format::q4}}) {
    kvcache::two_tier_config cfg;
    cfg.shape = {3, 2, 64};
    cfg.tail_tokens = 64;
    cfg.key_format = kf;
    cfg.value_format = vf;
    cfg.slab_groups = 4;
    cache_t c = cache_t::create(cfg).value();
    stepper s = make_stepper(c, std::random_device{}());
    EXPECT_GT(s.step(), 0u);  // the first reserve allocates the tail ring and the tables
    std::size_t slab_steps = 0;
    for (int i = 0; i < 2000; ++i) {
      const std::size_t slabs = c.info(s.id).value().store_slabs;
      const std::size_t n = s.step();
      if (c.info(s.id).value().store_slabs != slabs) {
        ++slab_steps;
        EXPECT_GT(n, 0u);
      } else {
        ASSERT_EQ(n, 0u) << "step " << i << " allocated without a new slab";
      }
    }
    // 2000 tokens past a 64-token tail: about 60 groups, 15 slabs of 4.
    EXPECT_GE(slab_steps, 14u);
  }
}

TEST(two_tier_alloc, streaming_steady_state_allocates_nothing) {
  kvcache::two_tier_config cfg;
  cfg.shape = {2, 2, 64};
  cfg.tail_tokens = 32;
  cfg.on_full = kvcache::capacity_policy::streaming;
  cfg.max_tokens = 512;
  cfg.sink_tokens = 32;
  cache_t c = cache_t::create(cfg).value();
  stepper s = make_stepper(c, std::random_device{}());
  for (int i = 0; i < 1500; ++i) s.step();  // past max_tokens: drops under way
  ASSERT_GT(c.info(s.id).value().dropped_tokens, 0u);
  std::size_t total = 0;
  for (int i = 0; i < 3000; ++i) total += s.step();
  EXPECT_EQ(total, 0u);
  EXPECT_LE(c.length(s.id).value(), 512u);
}

}  // namespace
