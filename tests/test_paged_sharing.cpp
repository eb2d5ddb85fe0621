// paged_cache<cpu> beyond the shared suite: pool creation checks, block layout of views,
// exhaustion (typed error, nothing changed, nothing leaked), fork / copy_prefix with
// copy-on-write in both directions, truncation returning whole blocks, the CSR block-table
// export, internal waste, and several caches on one pool.
#include "test_paged_util.hpp"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

namespace {

using namespace paged_test;
using kvcache::block_pool_config;
using kvcache::errc;
using kvcache::paged_config;

template <class R>
void expect_error(const R& r, errc code, const std::vector<std::string>& words) {
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code, code) << kvcache::to_string(r.error().code) << ": " << r.error().message;
  for (const std::string& w : words)
    EXPECT_NE(r.error().message.find(w), std::string::npos) << "'" << w << "' not in: " << r.error().message;
}

std::vector<std::uint64_t> random_tags(std::mt19937_64& rng, std::size_t n) {
  std::vector<std::uint64_t> t(n);
  for (auto& x : t) x = rng();
  return t;
}

std::vector<std::uint64_t> concat(std::vector<std::uint64_t> a, const std::vector<std::uint64_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

const geometry g{3, 2, 16};

TEST(paged_pool, creation_checks_name_the_value) {
  block_pool_config pc;
  pc.shape = g;
  pc.budget_bytes = 1 << 20;
  pc.block_tokens = 12;
  expect_error(block_pool<cpu>::create(pc), errc::invalid_argument, {"block_tokens=12"});
  pc.block_tokens = 0;
  expect_error(block_pool<cpu>::create(pc), errc::invalid_argument, {"block_tokens=0"});
  pc.block_tokens = 16;
  pc.storage = format::q4;
  expect_error(block_pool<cpu>::create(pc), errc::invalid_argument, {"format=2"});
  pc.storage = format::f16;
  pc.budget_bytes = 100;
  // One f16 block: 3 layers * 2 (K, V) * 2 heads * 16 tokens * 16 dims * 2 bytes = 6144 bytes.
  expect_error(block_pool<cpu>::create(pc), errc::invalid_argument, {"budget_bytes=100", "block_bytes=6144"});
  pc.shape = geometry{3, 0, 16};
  pc.budget_bytes = 1 << 20;
  expect_error(block_pool<cpu>::create(pc), errc::invalid_argument, {"kv_heads=0"});
  pc.shape = geometry{1, 1u << 31, 1u << 31};
  pc.block_tokens = 65536;
  pc.storage = format::f32;
  expect_error(block_pool<cpu>::create(pc), errc::overflow, {});
}

TEST(paged_pool, sized_from_budget_aligned_and_resident) {
  block_pool_config pc;
  pc.shape = g;
  pc.block_tokens = 16;
  pc.storage = format::f16;
  pc.budget_bytes = 10 * 6144 + 6000;  // 10 blocks and change
  auto p = block_pool<cpu>::create(pc);
  ASSERT_TRUE(p.has_value()) << p.error().message;
  const auto& pool = *p.value();
  EXPECT_EQ(pool.blocks(), 10u);
  EXPECT_EQ(pool.block_bytes(), 6144u);
  EXPECT_EQ(pool.block_stride(), 2048u);
  EXPECT_EQ(pool.head_stride(), 512u);
  EXPECT_EQ(pool.v_offset(), 1024u);
  EXPECT_EQ(pool.resident_bytes(), 10u * 6144u);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(pool.layer_base(0)) % 64, 0u);
  // Layer-major layout: layer l's blocks follow layer l-1's.
  EXPECT_EQ(pool.layer_base(1) - pool.layer_base(0), static_cast<std::ptrdiff_t>(10 * 2048));
  EXPECT_EQ(pool.k_block(2, 3), pool.layer_base(2) + 3 * 2048);
  const auto st = pool.stats();
  EXPECT_EQ(st.blocks_total, 10u);
  EXPECT_EQ(st.blocks_free, 10u);
  EXPECT_EQ(st.resident_bytes, 10u * 6144u);
  EXPECT_GT(st.metadata_bytes, 0u);
}

TEST(paged_cache_config_check, shared_pool_shape_must_match) {
  auto pool = make_pool(g, format::f16, 16, 8);
  paged_config<cpu> cfg;
  cfg.pool = pool;
  cfg.shape = geometry{3, 2, 32};
  expect_error(kvcache::paged_cache<cpu>::create(cfg), errc::invalid_argument, {"head_dim=32", "pool_head_dim=16"});
  cfg.shape = g;
  auto c = kvcache::paged_cache<cpu>::create(cfg);
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c.value().shape(), g);
  EXPECT_EQ(c.value().pool(), pool);
  cfg.expected_tokens = 8 * 16 + 1;
  expect_error(kvcache::paged_cache<cpu>::create(cfg), errc::invalid_argument,
               {"expected_tokens=129", "pool_tokens=128"});
  paged_config<cpu> own;
  own.shape = g;
  own.budget_bytes = 1;
  expect_error(kvcache::paged_cache<cpu>::create(own), errc::invalid_argument, {"budget_bytes=1"});
}

TEST(paged_cache_layout, one_chunk_per_block_pointing_into_the_pool) {
  auto pool = make_pool(g, format::f16, 4, 16);
  auto c = make_cache(pool);
  const seq_id s = c.create().value();
  std::mt19937_64 rng(7);
  const auto tags = random_tags(rng, 10);
  ASSERT_TRUE(append(c, s, tags, {}).has_value());
  const auto bl = c.blocks(s).value();
  ASSERT_EQ(bl.size(), 3u);
  for (std::uint32_t l = 0; l < g.layers; ++l) {
    const auto lv = c.view(s, l).value();
    ASSERT_EQ(lv.count, 3u);
    EXPECT_EQ(lv.tokens, 10u);
    const std::uint32_t expect_tokens[] = {4, 4, 2};
    for (std::uint32_t i = 0; i < 3; ++i) {
      EXPECT_EQ(lv[i].tokens, expect_tokens[i]);
      EXPECT_EQ(lv[i].k, pool->k_block(l, bl[i]));
      EXPECT_EQ(lv[i].v, pool->v_block(l, bl[i]));
      EXPECT_EQ(lv[i].k_head_stride, 4u * 16u * 2u);
      EXPECT_EQ(lv[i].k_format, format::f16);
    }
  }
  EXPECT_EQ(mismatches(c, s, tags), 0u);
}

TEST(paged_exhaustion, reserve_fails_typed_and_changes_nothing) {
  auto pool = make_pool(g, format::f32, 4, 6);
  auto c = make_cache(pool);
  std::mt19937_64 rng(11);
  const seq_id a = c.create().value();
  const seq_id b = c.create().value();
  const auto ta = random_tags(rng, 9);   // 3 blocks
  const auto tb = random_tags(rng, 6);   // 2 blocks
  ASSERT_TRUE(append(c, a, ta, {}).has_value());
  ASSERT_TRUE(append(c, b, tb, {}).has_value());
  const std::vector<seq_id> ids{a, b};
  const full_state before = state_of(c, ids);
  // b has 2 free slots in its last block + 1 free block: 7 tokens need 2 blocks.
  const auto r = c.reserve(b, 7);
  expect_error(r, errc::pool_exhausted, {"needed=2", "free=1"});
  EXPECT_TRUE(state_of(c, ids) == before);
  ASSERT_NO_FATAL_FAILURE(expect_accounting(*pool, {{&c, ids}}));
  // Exactly what fits still works, and the failure left a usable sequence behind.
  const auto more = random_tags(rng, 6);
  ASSERT_TRUE(append(c, b, more, {}).has_value());
  EXPECT_EQ(mismatches(c, b, concat(tb, more)), 0u);
  EXPECT_EQ(mismatches(c, a, ta), 0u);
  const auto st = c.stats();
  EXPECT_EQ(st.blocks_free, 0u);
  EXPECT_EQ(st.blocks_in_use, 6u);
  // Now even one token fails (b's last block is full), with needed=1 free=0.
  expect_error(c.reserve(b, 1), errc::pool_exhausted, {"needed=1", "free=0"});
  expect_error(c.reserve(a, std::size_t{1} << 50), errc::pool_exhausted, {"pool_tokens=24"});
  // a's last block has 3 free slots: 3 tokens need no new block even with the pool empty.
  ASSERT_TRUE(append(c, a, random_tags(rng, 3), {}).has_value());
  ASSERT_TRUE(c.release(a).has_value());
  ASSERT_TRUE(c.release(b).has_value());
  const auto end = c.stats();
  EXPECT_EQ(end.blocks_free, 6u);
  EXPECT_EQ(end.blocks_in_use, 0u);
}

TEST(paged_exhaustion, cow_copy_counts_towards_needed_blocks) {
  auto pool = make_pool(g, format::f16, 4, 3);
  auto c = make_cache(pool);
  std::mt19937_64 rng(3);
  const seq_id a = c.create().value();
  ASSERT_TRUE(append(c, a, random_tags(rng, 6), {}).has_value());  // 2 blocks, last partial
  const seq_id f = c.fork(a).value();
  // Writing into f's shared partial block needs a copy (1 block) + 1 more block for 6 tokens.
  const std::vector<seq_id> ids{a, f};
  const full_state before = state_of(c, ids);
  expect_error(c.reserve(f, 6), errc::pool_exhausted, {"needed=2", "free=1"});
  EXPECT_TRUE(state_of(c, ids) == before);
  ASSERT_TRUE(c.reserve(f, 2).has_value());  // copy only
  EXPECT_EQ(c.stats().blocks_free, 0u);
}

TEST(paged_sharing, fork_shares_blocks_and_copies_on_write_both_ways) {
  for (const format f : {format::f32, format::f16}) {
    SCOPED_TRACE(std::string(kvcache::to_string(f)));
    auto pool = make_pool(g, f, 4, 32);
    auto c = make_cache(pool);
    std::mt19937_64 rng(5);
    const seq_id a = c.create().value();
    const auto base = random_tags(rng, 10);  // blocks: 4, 4, 2 (partial)
    ASSERT_TRUE(append(c, a, base, {}).has_value());
    const seq_id b = c.fork(a).value();
    EXPECT_EQ(c.length(b).value(), 10u);
    const auto ba = c.blocks(a).value(), bb = c.blocks(b).value();
    ASSERT_EQ(std::vector<std::uint32_t>(ba.begin(), ba.end()), std::vector<std::uint32_t>(bb.begin(), bb.end()));
    auto st = c.stats();
    EXPECT_EQ(st.blocks_in_use, 3u);
    EXPECT_EQ(st.blocks_shared, 3u);
    EXPECT_EQ(mismatches(c, b, base), 0u);

    // Write through a: its shared partial block is copied; b still sees the old tokens.
    const auto ta = random_tags(rng, 3);
    ASSERT_TRUE(append(c, a, ta, {}).has_value());
    EXPECT_EQ(mismatches(c, a, concat(base, ta)), 0u);
    EXPECT_EQ(mismatches(c, b, base), 0u);
    EXPECT_NE(c.blocks(a).value()[2], c.blocks(b).value()[2]);
    EXPECT_EQ(c.blocks(a).value()[1], c.blocks(b).value()[1]);  // full blocks stay shared
    st = c.stats();
    EXPECT_EQ(st.blocks_in_use, 5u);  // 3 shared before, the copy and one new block
    EXPECT_EQ(st.blocks_shared, 2u);

    // Write through b: its partial block is no longer shared, so it is written in place; a
    // does not see it.
    const std::uint32_t b_last = c.blocks(b).value()[2];
    const auto tb = random_tags(rng, 5);
    ASSERT_TRUE(append(c, b, tb, {}).has_value());
    EXPECT_EQ(c.blocks(b).value()[2], b_last);
    EXPECT_EQ(mismatches(c, b, concat(base, tb)), 0u);
    EXPECT_EQ(mismatches(c, a, concat(base, ta)), 0u);

    // Truncate a into a shared full block and write: copied, b unaffected.
    ASSERT_TRUE(c.truncate(a, 5).has_value());
    const auto ta2 = random_tags(rng, 2);
    ASSERT_TRUE(append(c, a, ta2, {}).has_value());
    EXPECT_EQ(mismatches(c, a, concat(std::vector<std::uint64_t>(base.begin(), base.begin() + 5), ta2)), 0u);
    EXPECT_EQ(mismatches(c, b, concat(base, tb)), 0u);
    EXPECT_NE(c.blocks(a).value()[1], c.blocks(b).value()[1]);
    EXPECT_EQ(c.blocks(a).value()[0], c.blocks(b).value()[0]);
    ASSERT_NO_FATAL_FAILURE(expect_accounting(*pool, {{&c, {a, b}}}));
  }
}

TEST(paged_sharing, copy_prefix_mid_block_and_bad_calls) {
  auto pool = make_pool(g, format::f16, 8, 16);
  auto c = make_cache(pool);
  std::mt19937_64 rng(9);
  const seq_id a = c.create().value();
  const auto base = random_tags(rng, 20);
  ASSERT_TRUE(append(c, a, base, {}).has_value());
  for (const std::size_t n : {std::size_t{0}, std::size_t{3}, std::size_t{8}, std::size_t{13}, std::size_t{20}}) {
    SCOPED_TRACE(n);
    const seq_id p = c.copy_prefix(a, n).value();
    const std::vector<std::uint64_t> head(base.begin(), base.begin() + static_cast<std::ptrdiff_t>(n));
    EXPECT_EQ(mismatches(c, p, head), 0u);
    const auto more = random_tags(rng, 7);
    ASSERT_TRUE(append(c, p, more, {}).has_value());
    EXPECT_EQ(mismatches(c, p, concat(head, more)), 0u);
    EXPECT_EQ(mismatches(c, a, base), 0u);
    ASSERT_NO_FATAL_FAILURE(expect_accounting(*pool, {{&c, {a, p}}}));
    ASSERT_TRUE(c.release(p).has_value());
  }
  // Bad calls change nothing.
  const std::vector<seq_id> ids{a};
  const full_state before = state_of(c, ids);
  expect_error(c.copy_prefix(a, 21), errc::out_of_range, {"n=21", "length=20"});
  expect_error(c.copy_prefix(seq_id{12345}, 1), errc::unknown_sequence, {"seq=12345"});
  EXPECT_TRUE(state_of(c, ids) == before);
  ASSERT_TRUE(c.reserve(a, 1).has_value());
  expect_error(c.fork(a), errc::reservation_pending, {});
  expect_error(c.copy_prefix(a, 2), errc::reservation_pending, {});
  ASSERT_TRUE(c.release(a).has_value());
  const auto st = c.stats();
  EXPECT_EQ(st.blocks_in_use, 0u);
  EXPECT_EQ(st.sequences, 0u);
}

TEST(paged_sharing, max_sequences_limits_create_fork_and_adopt) {
  auto pool = make_pool(g, format::f16, 4, 8);
  paged_config<cpu> cfg;
  cfg.pool = pool;
  cfg.max_sequences = 2;
  auto c = kvcache::paged_cache<cpu>::create(cfg).value();
  const seq_id a = c.create().value();
  std::mt19937_64 rng(1);
  ASSERT_TRUE(append(c, a, random_tags(rng, 5), {}).has_value());
  ASSERT_TRUE(c.fork(a).has_value());
  const full_state before = state_of(c, std::vector<seq_id>{a});
  expect_error(c.create(), errc::capacity_exceeded, {"max_sequences=2"});
  expect_error(c.fork(a), errc::capacity_exceeded, {});
  const std::vector<std::int32_t> toks(9, 1);
  expect_error(c.create_with_prefix(toks), errc::capacity_exceeded, {});
  EXPECT_TRUE(state_of(c, std::vector<seq_id>{a}) == before);
}

TEST(paged_truncate, whole_blocks_return_partial_block_kept) {
  auto pool = make_pool(g, format::f32, 4, 8);
  auto c = make_cache(pool);
  std::mt19937_64 rng(2);
  const seq_id a = c.create().value();
  const auto tags = random_tags(rng, 15);  // 4 blocks
  ASSERT_TRUE(append(c, a, tags, {}).has_value());
  EXPECT_EQ(c.stats().blocks_in_use, 4u);
  const std::uint32_t second = c.blocks(a).value()[1];
  ASSERT_TRUE(c.truncate(a, 6).has_value());  // keeps blocks 0 and 1 (2 tokens)
  EXPECT_EQ(c.blocks(a).value().size(), 2u);
  EXPECT_EQ(c.blocks(a).value()[1], second);
  EXPECT_EQ(c.stats().blocks_in_use, 2u);
  EXPECT_EQ(c.stats().blocks_free, 6u);
  EXPECT_EQ(mismatches(c, a, std::vector<std::uint64_t>(tags.begin(), tags.begin() + 6)), 0u);
  // Refill over the kept partial block in place.
  const auto more = random_tags(rng, 3);
  ASSERT_TRUE(append(c, a, more, {}).has_value());
  EXPECT_EQ(c.blocks(a).value()[1], second);
  EXPECT_EQ(mismatches(c, a, concat(std::vector<std::uint64_t>(tags.begin(), tags.begin() + 6), more)), 0u);
  ASSERT_TRUE(c.truncate(a, 8).has_value());  // exact block boundary
  EXPECT_EQ(c.blocks(a).value().size(), 2u);
  ASSERT_TRUE(c.truncate(a, 0).has_value());
  EXPECT_EQ(c.blocks(a).value().size(), 0u);
  EXPECT_EQ(c.stats().blocks_free, 8u);
  EXPECT_EQ(c.view(a, 0).value().count, 0u);
}

TEST(paged_csr, export_matches_block_tables) {
  auto pool = make_pool(g, format::f16, 4, 32);
  auto c = make_cache(pool);
  std::mt19937_64 rng(4);
  std::vector<seq_id> seqs;
  for (const std::size_t n : {9, 0, 4, 13, 1}) {
    seqs.push_back(c.create().value());
    if (n > 0) {
      ASSERT_TRUE(append(c, seqs.back(), random_tags(rng, n), {}).has_value());
    }
  }
  // An open reservation's blocks are not part of the export.
  ASSERT_TRUE(c.reserve(seqs[2], 3).has_value());
  auto csr = c.export_block_tables(seqs);
  ASSERT_TRUE(csr.has_value()) << csr.error().message;
  const kvcache::block_table_csr t = csr.value();
  ASSERT_EQ(t.batch, 5u);
  EXPECT_EQ(t.block_tokens, 4u);
  const std::vector<std::int32_t> indptr(t.indptr, t.indptr + 6);
  EXPECT_EQ(indptr, (std::vector<std::int32_t>{0, 3, 3, 4, 8, 9}));
  const std::vector<std::int32_t> last(t.last_block_len, t.last_block_len + 5);
  EXPECT_EQ(last, (std::vector<std::int32_t>{1, 0, 4, 1, 1}));
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    const auto bl = c.blocks(seqs[i]).value();
    for (std::int32_t j = t.indptr[i]; j < t.indptr[i + 1]; ++j)
      EXPECT_EQ(static_cast<std::uint32_t>(t.indices[j]), bl[static_cast<std::size_t>(j - t.indptr[i])]);
  }
  // Caller buffers: exact sizes work, short ones fail naming the buffer and sizes, untouched.
  std::vector<std::int32_t> ip(6, -7), ix(9, -7), lb(5, -7);
  ASSERT_TRUE(c.export_block_tables(seqs, ip, ix, lb).has_value());
  EXPECT_EQ(ip, indptr);
  std::vector<std::int32_t> ip2(6, -7), ix2(8, -7), lb2(5, -7);
  expect_error(c.export_block_tables(seqs, ip2, ix2, lb2), errc::bad_shape, {"indices", "needed=9", "got=8"});
  EXPECT_EQ(ip2, std::vector<std::int32_t>(6, -7));
  expect_error(c.export_block_tables(seqs, std::span<std::int32_t>(ip).first(5), ix, lb), errc::bad_shape,
               {"indptr", "needed=6", "got=5"});
  expect_error(c.export_block_tables(seqs, ip, ix, std::span<std::int32_t>(lb).first(4)), errc::bad_shape,
               {"last_block_len"});
  std::vector<seq_id> with_dead = seqs;
  with_dead.push_back(seq_id{999});
  expect_error(c.export_block_tables(with_dead), errc::unknown_sequence, {"seq=999"});
}

TEST(paged_stats, internal_waste_under_one_block_per_sequence) {
  auto pool = make_pool(g, format::f16, 16, 64);
  auto c = make_cache(pool);
  std::mt19937_64 rng(6);
  std::vector<seq_id> seqs;
  std::size_t expect_waste = 0;
  for (const std::size_t n : {1, 15, 16, 17, 40, 64}) {
    seqs.push_back(c.create().value());
    ASSERT_TRUE(append(c, seqs.back(), random_tags(rng, n), {}).has_value());
    expect_waste += (16 - n % 16) % 16;
  }
  auto st = c.stats();
  EXPECT_EQ(st.internal_waste_tokens, expect_waste);
  EXPECT_LT(st.internal_waste_tokens, seqs.size() * 16);
  EXPECT_EQ(st.internal_waste_bytes, expect_waste * (pool->block_bytes() / 16));
  EXPECT_EQ(st.tokens, 1u + 15 + 16 + 17 + 40 + 64);
  EXPECT_EQ(st.table_blocks, 1u + 1 + 1 + 2 + 3 + 4);
  EXPECT_EQ(st.block_tokens, 16u);
  EXPECT_EQ(st.resident_bytes, pool->resident_bytes());
  // A reservation counts as filled slots, not waste.
  ASSERT_TRUE(c.reserve(seqs[0], 15).has_value());
  st = c.stats();
  EXPECT_EQ(st.internal_waste_tokens, expect_waste - 15);
  EXPECT_EQ(st.reserved_tokens, 15u);
}

TEST(paged_shared_pool, caches_share_one_pool_and_its_accounting) {
  auto pool = make_pool(g, format::f16, 4, 10);
  auto c1 = make_cache(pool);
  auto c2 = make_cache(pool);
  std::mt19937_64 rng(8);
  const seq_id a = c1.create().value();
  const seq_id b = c2.create().value();
  const auto ta = random_tags(rng, 20);  // 5 blocks
  ASSERT_TRUE(append(c1, a, ta, {}).has_value());
  const auto tb = random_tags(rng, 16);  // 4 blocks
  ASSERT_TRUE(append(c2, b, tb, {}).has_value());
  EXPECT_EQ(c2.stats().blocks_free, 1u);
  EXPECT_EQ(c1.stats().blocks_in_use, 9u);
  expect_error(c1.reserve(a, 8), errc::pool_exhausted, {"needed=2", "free=1"});
  ASSERT_NO_FATAL_FAILURE(expect_accounting(*pool, {{&c1, {a}}, {&c2, {b}}}));
  // Destroying a cache gives its blocks back to the shared pool.
  { auto gone = std::move(c2); }
  EXPECT_EQ(c1.stats().blocks_free, 5u);
  const auto more = random_tags(rng, 8);
  ASSERT_TRUE(append(c1, a, more, {}).has_value());
  EXPECT_EQ(mismatches(c1, a, concat(ta, more)), 0u);
  EXPECT_EQ(c1.stats().blocks_free, 3u);
}

}  // namespace
