// Prefix reuse in paged_cache<cpu>: chained block hashes, adoption of the longest cached chain by
// create_with_prefix, LRU eviction of cached blocks (tail blocks first), de-duplication of
// identical blocks at commit, sequences without token ids, rewrites after truncation, adoption
// across caches sharing a pool, and forced hash collisions (token ids and parent identity are
// compared, so a collision never hands out another prefix's keys).
#include "test_paged_util.hpp"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

namespace {

using namespace paged_test;
using kvcache::errc;

const geometry g{2, 2, 8};

std::vector<std::int32_t> random_ids(std::mt19937_64& rng, std::size_t n, std::int32_t vocab = 1000) {
  std::vector<std::int32_t> ids(n);
  for (auto& t : ids) t = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(vocab));
  return ids;
}

std::vector<std::int32_t> cat(std::vector<std::int32_t> a, const std::vector<std::int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

std::vector<std::int32_t> head(const std::vector<std::int32_t>& a, std::size_t n) {
  return std::vector<std::int32_t>(a.begin(), a.begin() + static_cast<std::ptrdiff_t>(n));
}

// A sequence computed from scratch for `ids` (plain create + one reserve with ids).
seq_id compute(paged_cache<cpu>& c, const std::vector<std::int32_t>& ids) {
  const seq_id s = c.create().value();
  const auto tags = tags_of(ids);
  EXPECT_TRUE(append(c, s, tags, ids).has_value());
  return s;
}

// Adopts for `prompt`, checks the adopted content, and appends the rest of the prompt.
std::pair<seq_id, std::size_t> adopt_and_finish(paged_cache<cpu>& c, const std::vector<std::int32_t>& prompt) {
  auto r = c.create_with_prefix(prompt);
  EXPECT_TRUE(r.has_value());
  const seq_id s = r.value().seq;
  const std::size_t k = r.value().cached_tokens;
  EXPECT_EQ(c.length(s).value(), k);
  const auto all_tags = tags_of(prompt);
  EXPECT_EQ(mismatches(c, s, std::span<const std::uint64_t>(all_tags).first(k)), 0u) << "adopted wrong keys";
  const std::vector<std::int32_t> rest(prompt.begin() + static_cast<std::ptrdiff_t>(k), prompt.end());
  EXPECT_TRUE(append(c, s, std::span<const std::uint64_t>(all_tags).subspan(k), rest).has_value());
  EXPECT_EQ(mismatches(c, s, all_tags), 0u);
  return {s, k};
}

TEST(paged_prefix_hash, chained_and_deterministic) {
  const std::vector<std::int32_t> a{1, 2, 3, 4}, b{1, 2, 3, 5};
  const std::uint64_t h = kvcache::prefix_hash(kvcache::prefix_hash_root, a);
  EXPECT_EQ(h, kvcache::prefix_hash(kvcache::prefix_hash_root, a));
  EXPECT_NE(h, kvcache::prefix_hash(kvcache::prefix_hash_root, b));
  EXPECT_NE(h, kvcache::prefix_hash(h, a));  // parent matters
  EXPECT_NE(kvcache::prefix_hash(h, a), kvcache::prefix_hash(kvcache::prefix_hash(kvcache::prefix_hash_root, b), a));
}

TEST(paged_prefix, released_chain_is_adopted_and_counts_as_hits) {
  for (const format f : {format::f32, format::f16}) {
    SCOPED_TRACE(std::string(kvcache::to_string(f)));
    auto pool = make_pool(g, f, 4, 32);
    auto c = make_cache(pool);
    std::mt19937_64 rng(1);
    const auto prompt = random_ids(rng, 22);  // 5 full blocks + 2 tokens
    const seq_id a = compute(c, prompt);
    const auto a_blocks = std::vector<std::uint32_t>(c.blocks(a).value().begin(), c.blocks(a).value().end());
    ASSERT_TRUE(c.release(a).has_value());
    auto st = c.stats();
    EXPECT_EQ(st.blocks_cached, 5u);  // full blocks stay findable; the partial one is freed
    EXPECT_EQ(st.blocks_free, 27u);

    const auto [b, k] = adopt_and_finish(c, prompt);
    EXPECT_EQ(k, 20u);
    for (std::size_t i = 0; i < 5; ++i) EXPECT_EQ(c.blocks(b).value()[i], a_blocks[i]);
    st = c.stats();
    EXPECT_EQ(st.blocks_cached, 0u);
    EXPECT_EQ(st.prefix_query_tokens, 20u);
    EXPECT_EQ(st.prefix_hit_tokens, 20u);
    EXPECT_DOUBLE_EQ(st.prefix_hit_rate, 1.0);
    ASSERT_NO_FATAL_FAILURE(expect_accounting(*pool, {{&c, {b}}}));

    // A live sequence's blocks are adopted too (shared, refcount 2), up to the first difference.
    auto other = prompt;
    other[9] += 1;  // differs inside block 2
    const auto [d, kd] = adopt_and_finish(c, other);
    EXPECT_EQ(kd, 8u);
    EXPECT_EQ(c.stats().blocks_shared, 2u);
    EXPECT_EQ(mismatches(c, b, tags_of(prompt)), 0u);
    st = c.stats();
    EXPECT_EQ(st.prefix_query_tokens, 40u);
    EXPECT_EQ(st.prefix_hit_tokens, 28u);
    EXPECT_DOUBLE_EQ(st.prefix_hit_rate, 28.0 / 40.0);
    ASSERT_NO_FATAL_FAILURE(expect_accounting(*pool, {{&c, {b, d}}}));
  }
}

TEST(paged_prefix, leaves_at_least_one_token_to_compute) {
  auto pool = make_pool(g, format::f16, 4, 16);
  auto c = make_cache(pool);
  std::mt19937_64 rng(2);
  const auto prompt = random_ids(rng, 8);
  ASSERT_TRUE(c.release(compute(c, prompt)).has_value());
  EXPECT_EQ(c.create_with_prefix(prompt).value().cached_tokens, 4u);  // not 8: the last token's logits
  EXPECT_EQ(c.create_with_prefix(cat(prompt, {5})).value().cached_tokens, 8u);
  EXPECT_EQ(c.create_with_prefix(std::vector<std::int32_t>{}).value().cached_tokens, 0u);
  EXPECT_EQ(c.create_with_prefix(head(prompt, 4)).value().cached_tokens, 0u);
}

TEST(paged_prefix, chain_stops_at_first_mismatch_even_if_later_blocks_match) {
  auto pool = make_pool(g, format::f16, 4, 16);
  auto c = make_cache(pool);
  std::mt19937_64 rng(3);
  const auto p = random_ids(rng, 12);
  ASSERT_TRUE(c.release(compute(c, p)).has_value());
  auto q = p;
  q[0] += 1;  // first block differs, blocks 1 and 2 have the same token ids
  const auto [s, k] = adopt_and_finish(c, cat(q, {1}));
  EXPECT_EQ(k, 0u);
  (void)s;
}

TEST(paged_prefix, lru_evicts_oldest_release_and_tail_blocks_first) {
  auto pool = make_pool(g, format::f16, 4, 8);
  auto c = make_cache(pool);
  std::mt19937_64 rng(4);
  const auto pa = random_ids(rng, 16);  // 4 blocks
  const auto pb = random_ids(rng, 16);  // 4 blocks
  ASSERT_TRUE(c.release(compute(c, pa)).has_value());
  ASSERT_TRUE(c.release(compute(c, pb)).has_value());
  EXPECT_EQ(c.stats().blocks_cached, 8u);
  EXPECT_EQ(c.stats().blocks_free, 0u);
  // One new block: evicts pa's tail block (oldest release, last block first).
  const seq_id x = c.create().value();
  ASSERT_TRUE(append(c, x, tags_of(random_ids(rng, 3)), {}).has_value());
  EXPECT_EQ(c.stats().evictions, 1u);
  const auto ra = c.create_with_prefix(cat(pa, {0})).value();
  const auto rb = c.create_with_prefix(cat(pb, {0})).value();
  EXPECT_EQ(ra.cached_tokens, 12u);
  EXPECT_EQ(rb.cached_tokens, 16u);
  ASSERT_NO_FATAL_FAILURE(expect_accounting(*pool, {{&c, {x, ra.seq, rb.seq}}}));
}

TEST(paged_prefix, cached_blocks_are_reclaimed_before_reporting_exhaustion) {
  auto pool = make_pool(g, format::f32, 4, 6);
  auto c = make_cache(pool);
  std::mt19937_64 rng(5);
  ASSERT_TRUE(c.release(compute(c, random_ids(rng, 24))).has_value());
  EXPECT_EQ(c.stats().blocks_cached, 6u);
  const seq_id s = c.create().value();
  const auto tags = tags_of(random_ids(rng, 24));
  ASSERT_TRUE(append(c, s, tags, {}).has_value());
  EXPECT_EQ(c.stats().evictions, 6u);
  EXPECT_EQ(mismatches(c, s, tags), 0u);
  auto r = c.reserve(s, 1);
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code, errc::pool_exhausted);
}

TEST(paged_prefix, identical_blocks_are_deduplicated_at_commit) {
  auto pool = make_pool(g, format::f16, 4, 32);
  auto c = make_cache(pool);
  std::mt19937_64 rng(6);
  const auto p = random_ids(rng, 17);
  const seq_id a = compute(c, head(p, 8));  // blocks 0, 1
  const std::uint32_t a0 = c.blocks(a).value()[0], a1 = c.blocks(a).value()[1];
  // Computed again from scratch: its first two blocks are swapped for a's at commit.
  const seq_id b = compute(c, head(p, 17));
  EXPECT_EQ(c.blocks(b).value()[0], a0);
  EXPECT_EQ(c.blocks(b).value()[1], a1);
  EXPECT_EQ(mismatches(c, b, tags_of(head(p, 17))), 0u);
  EXPECT_EQ(c.stats().blocks_in_use, 2u + 3u);
  EXPECT_EQ(c.stats().blocks_shared, 2u);
  ASSERT_NO_FATAL_FAILURE(expect_accounting(*pool, {{&c, {a, b}}}));
  // b's later blocks chain from the shared ones, so the whole 16-token chain is findable.
  ASSERT_TRUE(c.release(b).has_value());
  ASSERT_TRUE(c.release(a).has_value());
  EXPECT_EQ(adopt_and_finish(c, p).second, 16u);
}

TEST(paged_prefix, no_token_ids_means_no_reuse_from_there_on) {
  auto pool = make_pool(g, format::f16, 4, 32);
  auto c = make_cache(pool);
  std::mt19937_64 rng(7);
  const auto p = random_ids(rng, 16);
  const seq_id a = c.create().value();
  const auto tags = tags_of(p);
  ASSERT_TRUE(append(c, a, std::span<const std::uint64_t>(tags).first(6), head(p, 6)).has_value());
  // Tokens 6..9 without ids: block 1 and every later block stay unindexed.
  ASSERT_TRUE(append(c, a, std::span<const std::uint64_t>(tags).subspan(6, 4), {}).has_value());
  const std::vector<std::int32_t> tail(p.begin() + 10, p.end());
  ASSERT_TRUE(append(c, a, std::span<const std::uint64_t>(tags).subspan(10), tail).has_value());
  ASSERT_TRUE(c.release(a).has_value());
  EXPECT_EQ(c.stats().blocks_cached, 1u);
  EXPECT_EQ(c.create_with_prefix(cat(p, {0})).value().cached_tokens, 4u);
  // Wrong id count is a typed error and changes nothing.
  const seq_id s = c.create().value();
  const std::vector<std::int32_t> two{1, 2};
  auto r = c.reserve(s, 3, two);
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code, errc::bad_shape);
  EXPECT_NE(r.error().message.find("token_ids=2"), std::string::npos);
  EXPECT_EQ(c.blocks(s).value().size(), 0u);
}

TEST(paged_prefix, rewritten_block_after_truncate_is_not_found_for_old_tokens) {
  auto pool = make_pool(g, format::f16, 4, 32);
  auto c = make_cache(pool);
  std::mt19937_64 rng(8);
  const auto t = random_ids(rng, 12);
  const seq_id a = compute(c, t);
  ASSERT_TRUE(c.truncate(a, 6).has_value());  // block 1 now partial (2 tokens), block 2 cached
  const auto u = random_ids(rng, 6);
  ASSERT_TRUE(append(c, a, tags_of(u, tags_of(head(t, 6)).back()), u).has_value());
  ASSERT_TRUE(c.release(a).has_value());
  // Block 1 was rewritten in place (it was not shared), so only block 0 matches t; block 2 is
  // cached but its parent changed, so it must not be adopted either.
  EXPECT_EQ(adopt_and_finish(c, cat(t, {3})).second, 4u);
  EXPECT_EQ(adopt_and_finish(c, cat(cat(head(t, 6), u), {3})).second, 12u);
}

TEST(paged_prefix, adoption_across_caches_on_one_pool) {
  auto pool = make_pool(g, format::f16, 4, 32);
  auto c1 = make_cache(pool);
  auto c2 = make_cache(pool);
  std::mt19937_64 rng(9);
  const auto p = random_ids(rng, 13);
  const seq_id a = compute(c1, p);
  const auto [b, k] = adopt_and_finish(c2, p);
  EXPECT_EQ(k, 12u);
  EXPECT_EQ(c1.stats().blocks_shared, 3u);
  ASSERT_NO_FATAL_FAILURE(expect_accounting(*pool, {{&c1, {a}}, {&c2, {b}}}));
  // Writes after the shared prefix stay private to each cache.
  ASSERT_TRUE(c1.truncate(a, 10).has_value());
  const auto x = random_ids(rng, 5);
  ASSERT_TRUE(append(c1, a, tags_of(x, tags_of(head(p, 10)).back()), x).has_value());
  EXPECT_EQ(mismatches(c2, b, tags_of(p)), 0u);
  ASSERT_NO_FATAL_FAILURE(expect_accounting(*pool, {{&c1, {a}}, {&c2, {b}}}));
}

// Test hooks that force collisions.
std::uint64_t constant_hash(std::uint64_t, std::span<const std::int32_t>) noexcept { return 42; }
std::uint64_t tokens_only_hash(std::uint64_t, std::span<const std::int32_t> t) noexcept {
  return kvcache::prefix_hash(0, t);  // ignores the parent: equal blocks collide across chains
}

TEST(paged_prefix_collision, every_hash_equal_still_adopts_only_matching_tokens) {
  auto pool = make_pool(g, format::f16, 4, 32, &constant_hash);
  auto c = make_cache(pool);
  std::mt19937_64 rng(10);
  const auto x = random_ids(rng, 8), y = random_ids(rng, 8);
  ASSERT_TRUE(c.release(compute(c, x)).has_value());
  ASSERT_TRUE(c.release(compute(c, y)).has_value());
  EXPECT_EQ(c.stats().blocks_cached, 4u);  // all four indexed under the same hash
  EXPECT_EQ(adopt_and_finish(c, cat(x, {1})).second, 8u);
  EXPECT_EQ(adopt_and_finish(c, cat(y, {1})).second, 8u);
  EXPECT_EQ(adopt_and_finish(c, cat(cat(head(x, 4), head(y, 4)), {1})).second, 4u);
  EXPECT_EQ(adopt_and_finish(c, random_ids(rng, 9)).second, 0u);
}

TEST(paged_prefix_collision, same_block_tokens_under_a_different_parent_are_not_adopted) {
  auto pool = make_pool(g, format::f32, 4, 32, &tokens_only_hash);
  auto c = make_cache(pool);
  std::mt19937_64 rng(11);
  const auto p = random_ids(rng, 4), r = random_ids(rng, 4), q = random_ids(rng, 4);
  // Chains [p, q] and [r, q]: their second blocks have equal token ids and (with this hook)
  // equal hashes, but different keys, because the keys depend on the whole prefix.
  ASSERT_TRUE(c.release(compute(c, cat(p, q))).has_value());
  ASSERT_TRUE(c.release(compute(c, cat(r, q))).has_value());
  EXPECT_EQ(adopt_and_finish(c, cat(cat(r, q), {7})).second, 8u);
  EXPECT_EQ(adopt_and_finish(c, cat(cat(p, q), {7})).second, 8u);
  // A chain [s, q] never computed: the first block misses, so nothing is adopted.
  EXPECT_EQ(adopt_and_finish(c, cat(cat(random_ids(rng, 4), q), {7})).second, 0u);
}

TEST(paged_prefix_collision, stale_children_of_a_rewritten_block_are_never_adopted) {
  auto pool = make_pool(g, format::f16, 4, 32, &tokens_only_hash);
  auto c = make_cache(pool);
  std::mt19937_64 rng(12);
  const auto t = random_ids(rng, 12);
  const seq_id a = compute(c, t);
  ASSERT_TRUE(c.truncate(a, 6).has_value());
  // Rewrite block 1 in place with other tokens, then the same block-2 tokens as before: the old
  // block 2 (cached, same ids, same hash under this hook) was computed under the old block 1.
  auto u = cat(random_ids(rng, 2, 1000), std::vector<std::int32_t>(t.begin() + 8, t.end()));
  u[0] = t[6] + 1;
  const auto tail_tags = tags_of(u, tags_of(head(t, 6)).back());
  ASSERT_TRUE(append(c, a, tail_tags, u).has_value());
  const auto now = cat(head(t, 6), u);
  EXPECT_EQ(mismatches(c, a, tags_of(now)), 0u);
  ASSERT_TRUE(c.release(a).has_value());
  EXPECT_EQ(adopt_and_finish(c, cat(now, {3})).second, 12u);
  EXPECT_EQ(adopt_and_finish(c, cat(t, {3})).second, 4u);
}

}  // namespace
