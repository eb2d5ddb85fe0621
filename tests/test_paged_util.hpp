#pragma once
// Helpers shared by the paged-cache tests: pools and caches of a given shape, deterministic K/V
// content derived from a per-token tag (exact in f16), appends with token ids, content checks and
// a full-state snapshot (lengths, block tables, decoded views, pool counters) for
// "failed call changes nothing" assertions.
#include <kvcache/block_pool.hpp>
#include <kvcache/half.hpp>
#include <kvcache/paged_cache.hpp>

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace paged_test {

using kvcache::block_pool;
using kvcache::cpu;
using kvcache::format;
using kvcache::geometry;
using kvcache::paged_cache;
using kvcache::seq_id;

/// A pool of exactly `blocks` blocks.
inline std::shared_ptr<block_pool<cpu>> make_pool(geometry g, format f, std::uint32_t B, std::size_t blocks,
                                                  kvcache::prefix_hash_fn hash = nullptr) {
  kvcache::block_pool_config pc;
  pc.shape = g;
  pc.block_tokens = B;
  pc.storage = f;
  pc.budget_bytes = blocks * 2 * g.layers * g.token_width() * B * kvcache::dense_element_bytes(f);
  pc.hash = hash;
  auto p = block_pool<cpu>::create(pc);
  EXPECT_TRUE(p.has_value()) << p.error().message;
  EXPECT_EQ(p.value()->blocks(), blocks);
  return std::move(p).value();
}

/// A cache on `pool`.
inline paged_cache<cpu> make_cache(std::shared_ptr<block_pool<cpu>> pool, std::size_t expected_tokens = 0) {
  kvcache::paged_config<cpu> cfg;
  cfg.pool = std::move(pool);
  cfg.expected_tokens = expected_tokens;
  auto c = paged_cache<cpu>::create(cfg);
  EXPECT_TRUE(c.has_value()) << c.error().message;
  return std::move(c).value();
}

/// splitmix64 step: the tag and value mixer.
inline std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/// Tag of the token after a token tagged `prev` whose id is `id`: a chain, so the tag (and so
/// the K/V) of a position depends on every token id up to it, as real keys do.
inline std::uint64_t next_tag(std::uint64_t prev, std::int32_t id) {
  return mix(prev ^ (static_cast<std::uint64_t>(static_cast<std::uint32_t>(id)) * 0x100000001b3ull));
}
inline constexpr std::uint64_t root_tag = 0x1234567ull;

/// Element value for (tag, layer, k|v, flat index in the token): a multiple of 1/8 in
/// [-125, 125], exact in f16 and f32.
inline float value_of(std::uint64_t tag, std::uint32_t layer, int kv, std::size_t i) {
  const std::uint64_t m = mix(tag ^ (static_cast<std::uint64_t>(layer) << 40) ^ (static_cast<std::uint64_t>(kv) << 39) ^ i);
  return static_cast<float>(static_cast<int>(m % 2001) - 1000) / 8.0f;
}

/// Tags of a token-id sequence starting from the root.
inline std::vector<std::uint64_t> tags_of(std::span<const std::int32_t> ids, std::uint64_t prev = root_tag) {
  std::vector<std::uint64_t> out;
  for (const std::int32_t id : ids) out.push_back(prev = next_tag(prev, id));
  return out;
}

/// reserve (with `ids` if given) + write every layer from tags + commit. Returns the reserve
/// result (write/commit are asserted).
inline kvcache::result<void> append(paged_cache<cpu>& c, seq_id s, std::span<const std::uint64_t> tags,
                                    std::span<const std::int32_t> ids) {
  const geometry g = c.shape();
  const std::size_t n = tags.size();
  auto r = ids.empty() ? c.reserve(s, n) : c.reserve(s, n, ids);
  if (!r.has_value()) return r;
  std::vector<float> k(n * g.token_width()), v(n * g.token_width());
  for (std::uint32_t l = 0; l < g.layers; ++l) {
    for (std::size_t t = 0; t < n; ++t)
      for (std::size_t i = 0; i < g.token_width(); ++i) {
        k[t * g.token_width() + i] = value_of(tags[t], l, 0, i);
        v[t * g.token_width() + i] = value_of(tags[t], l, 1, i);
      }
    auto w = c.write(s, l, std::span<const float>(k), std::span<const float>(v));
    EXPECT_TRUE(w.has_value()) << w.error().message;
  }
  auto cm = c.commit(s);
  EXPECT_TRUE(cm.has_value()) << cm.error().message;
  return r;
}

/// Reads element i of token t of a dense chunk head.
inline float read(const kvcache::chunk& ch, bool values, std::uint32_t h, std::uint32_t t, std::uint32_t d,
                  std::uint32_t head_dim) {
  const std::byte* base = values ? ch.v_head(h) : ch.k_head(h);
  const format f = values ? ch.v_format : ch.k_format;
  const std::size_t idx = static_cast<std::size_t>(t) * head_dim + d;
  if (f == format::f32) {
    float x;
    std::memcpy(&x, base + idx * 4, 4);
    return x;
  }
  kvcache::half x;
  std::memcpy(&x, base + idx * 2, 2);
  return kvcache::to_float(x);
}

/// Counts mismatches between s's views and the values of `tags` (0: exact match).
inline std::size_t mismatches(const paged_cache<cpu>& c, seq_id s, std::span<const std::uint64_t> tags) {
  const geometry g = c.shape();
  const auto len = c.length(s);
  if (!len.has_value() || len.value() != tags.size()) return ~std::size_t{0};
  std::size_t bad = 0;
  for (std::uint32_t l = 0; l < g.layers; ++l) {
    const auto lv = c.view(s, l);
    if (!lv.has_value() || lv.value().tokens != tags.size()) return ~std::size_t{0};
    std::size_t tok = 0;
    for (const kvcache::chunk& ch : lv.value()) {
      for (std::uint32_t t = 0; t < ch.tokens; ++t, ++tok)
        for (std::uint32_t h = 0; h < g.kv_heads; ++h)
          for (std::uint32_t d = 0; d < g.head_dim; ++d) {
            const std::size_t i = static_cast<std::size_t>(h) * g.head_dim + d;
            if (read(ch, false, h, t, d, g.head_dim) != value_of(tags[tok], l, 0, i)) ++bad;
            if (read(ch, true, h, t, d, g.head_dim) != value_of(tags[tok], l, 1, i)) ++bad;
          }
    }
    if (tok != tags.size()) return ~std::size_t{0};
  }
  return bad;
}

/// Everything observable about a set of sequences and the pool.
struct full_state {
  std::vector<std::size_t> lengths;
  std::vector<std::vector<std::uint32_t>> blocks;
  std::vector<std::vector<float>> contents;  // [seq] all layers' K then V, token order
  std::vector<std::size_t> counters;
  bool operator==(const full_state&) const = default;
};

inline full_state state_of(const paged_cache<cpu>& c, std::span<const seq_id> seqs) {
  full_state st;
  const geometry g = c.shape();
  for (const seq_id s : seqs) {
    const auto len = c.length(s);
    st.lengths.push_back(len.has_value() ? len.value() : ~std::size_t{0});
    const auto bl = c.blocks(s);
    st.blocks.emplace_back();
    if (bl.has_value()) st.blocks.back().assign(bl.value().begin(), bl.value().end());
    std::vector<float> content;
    for (std::uint32_t l = 0; len.has_value() && l < g.layers; ++l) {
      const auto lv = c.view(s, l);
      for (const kvcache::chunk& ch : lv.value())
        for (std::uint32_t t = 0; t < ch.tokens; ++t)
          for (std::uint32_t h = 0; h < g.kv_heads; ++h)
            for (std::uint32_t d = 0; d < g.head_dim; ++d) {
              content.push_back(read(ch, false, h, t, d, g.head_dim));
              content.push_back(read(ch, true, h, t, d, g.head_dim));
            }
    }
    st.contents.push_back(std::move(content));
  }
  const auto s = c.stats();
  st.counters = {s.sequences,    s.tokens,        s.reserved_tokens, s.blocks_free,        s.blocks_in_use,
                 s.blocks_shared, s.blocks_cached, s.table_blocks,    s.internal_waste_tokens, s.evictions};
  for (std::uint32_t b = 0; b < c.pool()->blocks(); ++b) {
    st.counters.push_back(c.pool()->ledger().refcount(b));
    st.counters.push_back(c.pool()->ledger().indexed(b) ? 1 : 0);
  }
  return st;
}

/// Asserts the pool's bookkeeping is consistent and every block's refcount equals the number of
/// block-table entries naming it over `caches` (all caches on the pool, all their live `seqs`).
inline void expect_accounting(const block_pool<cpu>& pool,
                              const std::vector<std::pair<const paged_cache<cpu>*, std::vector<seq_id>>>& caches) {
  std::uint32_t bad = 0;
  ASSERT_TRUE(pool.ledger().check(&bad)) << "pool bookkeeping inconsistent at block " << bad;
  const auto ps = pool.stats();
  ASSERT_EQ(ps.blocks_free + ps.blocks_in_use + ps.blocks_cached, ps.blocks_total);
  std::map<std::uint32_t, std::uint32_t> refs;
  for (const auto& [c, seqs] : caches)
    for (const seq_id s : seqs) {
      const auto bl = c->blocks(s);
      ASSERT_TRUE(bl.has_value());
      for (const std::uint32_t b : bl.value()) ++refs[b];
    }
  ASSERT_EQ(refs.size(), ps.blocks_in_use) << "blocks in use differ from blocks held by sequences";
  std::size_t shared = 0;
  for (const auto& [b, n] : refs) {
    ASSERT_EQ(pool.ledger().refcount(b), n) << "block " << b;
    if (n > 1) ++shared;
  }
  ASSERT_EQ(shared, ps.blocks_shared);
}

}  // namespace paged_test
