// No hidden allocation in the per-token path: a paged cache whose sequences were created with
// expected_tokens of room decodes (reserve / write / commit with token ids, block boundaries,
// copy-on-write of a forked partial block, prefix publishing), truncates, views and exports its
// block tables without a single heap allocation. Counted by replacing global operator new (every
// form: replaced_new.hpp) in this binary only.
#include "test_paged_util.hpp"

#include <gtest/gtest.h>

#include "replaced_new.hpp"

#include <atomic>
#include <cstdlib>
#include <new>
#include <vector>

namespace {
std::atomic<bool> counting{false};
std::atomic<std::size_t> allocations{0};
}  // namespace

void* kvcache_test_allocate(std::size_t n, std::size_t align) noexcept {
  if (counting.load(std::memory_order_relaxed)) allocations.fetch_add(1, std::memory_order_relaxed);
  return kvcache_test::system_allocate(n, align);
}

namespace {

using namespace paged_test;

TEST(paged_alloc, decode_path_allocates_nothing_within_expected_tokens) {
  for (const format f : {format::f16, format::f32}) {
    const geometry g{4, 2, 32};
    auto pool = make_pool(g, f, 16, 64);
    auto c = make_cache(pool, /*expected_tokens=*/512);
    const seq_id a = c.create().value();
    const std::size_t tw = g.token_width();
    std::vector<float> k(8 * tw, 0.25f), v(8 * tw, -0.5f);
    std::vector<std::int32_t> ids(8, 3);
    // Prefill 20 tokens, fork (the fork shares a partial block), then count.
    ASSERT_TRUE(c.reserve(a, 8, ids).has_value());
    for (std::uint32_t l = 0; l < g.layers; ++l)
      ASSERT_TRUE(c.write(a, l, std::span<const float>(k), std::span<const float>(v)).has_value());
    ASSERT_TRUE(c.commit(a).has_value());
    const seq_id b = c.fork(a).value();
    std::vector<seq_id> batch{a, b};
    std::vector<std::int32_t> indptr(3), indices(64), last(2);
    (void)kvcache::kernels::active();

    allocations = 0;
    counting = true;
    bool ok = true;
    for (int step = 0; step < 300 && ok; ++step) {
      const seq_id s = step % 2 == 0 ? a : b;
      const std::size_t n = step % 7 == 0 ? 5 : 1;
      ok = ok && c.reserve(s, n, std::span<const std::int32_t>(ids).first(n)).has_value();
      for (std::uint32_t l = 0; l < g.layers; ++l)
        ok = ok && c.write(s, l, std::span<const float>(k).first(n * tw), std::span<const float>(v).first(n * tw))
                       .has_value();
      ok = ok && c.commit(s).has_value();
      if (step % 50 == 49) ok = ok && c.truncate(s, c.length(s).value() - 3).has_value();
      ok = ok && c.view(s, step % g.layers).has_value();
      ok = ok && c.export_block_tables(batch, indptr, indices, last).has_value();
      (void)c.stats();
    }
    counting = false;
    ASSERT_TRUE(ok);
    EXPECT_EQ(allocations.load(), 0u) << "heap allocations in the decode path (" << kvcache::to_string(f) << ")";
    EXPECT_GT(c.length(a).value(), 200u);
  }
}

}  // namespace
