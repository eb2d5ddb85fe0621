// Seeded random-operation fuzzer for paged_cache<cpu> on a small pool: create, adopt
// (create_with_prefix), reserve/write/commit with and without token ids, truncate, fork,
// copy_prefix, release (with and without an open reservation), and bad calls. After every
// operation the pool's bookkeeping is checked (free + in use + cached == total, each block's
// refcount equals the block-table entries naming it), failed calls must leave the full state
// unchanged, and every sequence's contents are compared with a model regularly.
#include "test_paged_util.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

namespace {

using namespace paged_test;
using kvcache::errc;

struct model_seq {
  seq_id id{};
  std::vector<std::int32_t> ids;      // token ids (given to the cache or not)
  std::vector<std::uint64_t> tags;    // tags_of(ids): what the views must hold
  std::vector<std::int32_t> plan;     // prompt tokens still to append (after an adoption)
};

struct fuzzer {
  std::mt19937_64 rng;
  std::uint32_t B;
  std::shared_ptr<block_pool<cpu>> pool;
  paged_cache<cpu> cache;
  std::vector<model_seq> live;
  std::vector<seq_id> dead;
  std::vector<std::vector<std::int32_t>> prompts;  // shared prompt bases, so prefixes repeat
  std::size_t adopted_tokens = 0, exhausted = 0, ops_ok = 0;

  fuzzer(std::uint64_t seed, format f, std::uint32_t b, std::size_t blocks, std::size_t max_seqs)
      : rng(seed), B(b), pool(make_pool(geometry{2, 2, 8}, f, b, blocks)), cache(make(pool, max_seqs)) {
    for (int p = 0; p < 4; ++p) {
      std::vector<std::int32_t> pr(between(2 * b, 6 * b));
      for (auto& t : pr) t = static_cast<std::int32_t>(between(0, 3));
      prompts.push_back(pr);
    }
  }

  static paged_cache<cpu> make(std::shared_ptr<block_pool<cpu>> p, std::size_t max_seqs) {
    kvcache::paged_config<cpu> cfg;
    cfg.pool = std::move(p);
    cfg.max_sequences = max_seqs;
    auto c = paged_cache<cpu>::create(cfg);
    EXPECT_TRUE(c.has_value());
    return std::move(c).value();
  }

  std::size_t between(std::size_t lo, std::size_t hi) { return std::uniform_int_distribution<std::size_t>(lo, hi)(rng); }

  std::vector<seq_id> ids() const {
    std::vector<seq_id> out;
    for (const model_seq& m : live) out.push_back(m.id);
    return out;
  }
  std::vector<seq_id> ids_and_dead() const {
    std::vector<seq_id> out = ids();
    out.insert(out.end(), dead.begin(), dead.end());
    return out;
  }

  template <class R>
  void expect_fails_unchanged(const char* what, errc code, R (fuzzer::*call)(model_seq&), model_seq& m) {
    const auto all = ids_and_dead();
    const full_state before = state_of(cache, all);
    const R r = (this->*call)(m);
    ASSERT_FALSE(r.has_value()) << what << " succeeded";
    EXPECT_EQ(r.error().code, code) << what << ": " << r.error().message;
    EXPECT_FALSE(r.error().message.empty());
    ASSERT_TRUE(state_of(cache, all) == before) << what << " changed the state";
  }

  kvcache::result<void> bad_truncate(model_seq& m) { return cache.truncate(m.id, m.tags.size() + 1 + between(0, 5)); }
  kvcache::result<seq_id> bad_copy(model_seq& m) { return cache.copy_prefix(m.id, m.tags.size() + 1); }
  kvcache::result<void> bad_ids(model_seq& m) {
    std::vector<std::int32_t> two{1, 2};
    return cache.reserve(m.id, 3, two);
  }
  kvcache::result<void> dead_reserve(model_seq&) { return cache.reserve(dead.back(), 1); }
  kvcache::result<seq_id> dead_fork(model_seq&) { return cache.fork(dead.back()); }
  kvcache::result<void> dead_release(model_seq&) { return cache.release(dead.back()); }
  kvcache::result<seq_id> full_create(model_seq&) { return cache.create(); }

  void check_contents() {
    for (const model_seq& m : live) ASSERT_EQ(mismatches(cache, m.id, m.tags), 0u) << "seq " << m.id.value;
  }

  void check_accounting() {
    expect_accounting(*pool, {{&cache, ids()}});
    for (const model_seq& m : live) {
      const std::size_t held = cache.blocks(m.id).value().size();
      ASSERT_EQ(held, (m.tags.size() + B - 1) / B) << "blocks held beyond the length";
    }
    const auto st = cache.stats();
    ASSERT_LE(st.internal_waste_tokens, live.size() * (B - 1));
  }

  // Appends n tokens to m: from its plan (prompt continuation) or random small-vocabulary ids.
  void op_append(model_seq& m) {
    const std::size_t n = between(1, 3 * B);
    std::vector<std::int32_t> add;
    while (add.size() < n && !m.plan.empty()) {
      add.push_back(m.plan.front());
      m.plan.erase(m.plan.begin());
    }
    while (add.size() < n) add.push_back(static_cast<std::int32_t>(between(0, 3)));
    const bool give_ids = between(0, 99) < 85;
    if (!give_ids)
      for (auto& t : add) t = static_cast<std::int32_t>(1000 + between(0, 1u << 30));  // never repeats
    const std::uint64_t prev = m.tags.empty() ? root_tag : m.tags.back();
    const std::vector<std::uint64_t> tags = tags_of(add, prev);
    const auto all = ids_and_dead();
    const full_state before = state_of(cache, all);
    auto r = append(cache, m.id, tags, give_ids ? std::span<const std::int32_t>(add) : std::span<const std::int32_t>());
    if (!r.has_value()) {
      ASSERT_EQ(r.error().code, errc::pool_exhausted) << r.error().message;
      ASSERT_NE(r.error().message.find("needed="), std::string::npos) << r.error().message;
      ASSERT_NE(r.error().message.find("free="), std::string::npos) << r.error().message;
      ASSERT_TRUE(state_of(cache, all) == before) << "failed reserve changed the state";
      ++exhausted;
      m.plan.clear();
      return;
    }
    m.ids.insert(m.ids.end(), add.begin(), add.end());
    m.tags.insert(m.tags.end(), tags.begin(), tags.end());
  }

  void op_adopt() {
    std::vector<std::int32_t> prompt = prompts[between(0, prompts.size() - 1)];
    prompt.resize(between(1, prompt.size()));
    for (std::size_t extra = between(0, B); extra > 0; --extra) prompt.push_back(static_cast<std::int32_t>(between(0, 3)));
    auto r = cache.create_with_prefix(prompt);
    if (!r.has_value()) {
      ASSERT_EQ(r.error().code, errc::capacity_exceeded);
      return;
    }
    const std::size_t k = r.value().cached_tokens;
    ASSERT_EQ(k % B, 0u);
    ASSERT_LT(k, prompt.size());
    adopted_tokens += k;
    model_seq m;
    m.id = r.value().seq;
    m.ids.assign(prompt.begin(), prompt.begin() + static_cast<std::ptrdiff_t>(k));
    m.tags = tags_of(m.ids);
    m.plan.assign(prompt.begin() + static_cast<std::ptrdiff_t>(k), prompt.end());
    live.push_back(std::move(m));
    ASSERT_EQ(mismatches(cache, live.back().id, live.back().tags), 0u) << "adopted blocks hold other keys";
  }

  void op_copy(model_seq& src, bool whole) {
    const std::size_t n = whole ? src.tags.size() : between(0, src.tags.size());
    auto r = whole ? cache.fork(src.id) : cache.copy_prefix(src.id, n);
    if (!r.has_value()) {
      ASSERT_EQ(r.error().code, errc::capacity_exceeded);
      return;
    }
    model_seq m;
    m.id = r.value();
    m.ids.assign(src.ids.begin(), src.ids.begin() + static_cast<std::ptrdiff_t>(n));
    m.tags.assign(src.tags.begin(), src.tags.begin() + static_cast<std::ptrdiff_t>(n));
    live.push_back(std::move(m));
  }

  void op_release(std::size_t i, bool pending) {
    if (pending) {
      // An open reservation (partly written) is dropped with the sequence.
      if (!cache.reserve(live[i].id, between(1, 2 * B)).has_value()) return;
    }
    ASSERT_TRUE(cache.release(live[i].id).has_value());
    dead.push_back(live[i].id);
    live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
  }

  void run(int ops) {
    for (int op = 0; op < ops; ++op) {
      SCOPED_TRACE("op " + std::to_string(op));
      const std::size_t kind = between(0, 99);
      if (live.empty() || kind < 6) {
        auto r = cache.create();
        if (r.has_value()) {
          live.push_back(model_seq{r.value(), {}, {}, {}});
        } else {
          ASSERT_EQ(r.error().code, errc::capacity_exceeded);
        }
      } else if (kind < 14) {
        ASSERT_NO_FATAL_FAILURE(op_adopt());
      } else if (kind < 54) {
        ASSERT_NO_FATAL_FAILURE(op_append(live[between(0, live.size() - 1)]));
      } else if (kind < 66) {
        model_seq& m = live[between(0, live.size() - 1)];
        const std::size_t n = between(0, m.tags.size());
        ASSERT_TRUE(cache.truncate(m.id, n).has_value());
        m.tags.resize(n);
        m.ids.resize(n);
        m.plan.clear();
      } else if (kind < 80) {
        const std::size_t i = between(0, live.size() - 1);
        ASSERT_NO_FATAL_FAILURE(op_copy(live[i], kind < 73));
      } else if (kind < 92) {
        ASSERT_NO_FATAL_FAILURE(op_release(between(0, live.size() - 1), kind >= 89));
      } else {
        model_seq& m = live[between(0, live.size() - 1)];
        switch (between(0, 4)) {
          case 0: ASSERT_NO_FATAL_FAILURE(expect_fails_unchanged("truncate past length", errc::out_of_range, &fuzzer::bad_truncate, m)); break;
          case 1: ASSERT_NO_FATAL_FAILURE(expect_fails_unchanged("copy_prefix past length", errc::out_of_range, &fuzzer::bad_copy, m)); break;
          case 2: ASSERT_NO_FATAL_FAILURE(expect_fails_unchanged("reserve with 2 ids for 3 tokens", errc::bad_shape, &fuzzer::bad_ids, m)); break;
          default:
            if (!dead.empty()) {
              ASSERT_NO_FATAL_FAILURE(expect_fails_unchanged("reserve dead", errc::unknown_sequence, &fuzzer::dead_reserve, m));
              ASSERT_NO_FATAL_FAILURE(expect_fails_unchanged("fork dead", errc::unknown_sequence, &fuzzer::dead_fork, m));
              ASSERT_NO_FATAL_FAILURE(expect_fails_unchanged("release dead", errc::unknown_sequence, &fuzzer::dead_release, m));
            }
        }
      }
      ASSERT_NO_FATAL_FAILURE(check_accounting());
      if (op % 40 == 0) {
        ASSERT_NO_FATAL_FAILURE(check_contents());
      }
      ++ops_ok;
    }
    ASSERT_NO_FATAL_FAILURE(check_contents());
    // Everything released: no block in use, none leaked.
    while (!live.empty()) ASSERT_NO_FATAL_FAILURE(op_release(live.size() - 1, false));
    const auto ps = pool->stats();
    EXPECT_EQ(ps.blocks_in_use, 0u);
    EXPECT_EQ(ps.blocks_free + ps.blocks_cached, ps.blocks_total);
    std::uint32_t bad = 0;
    EXPECT_TRUE(pool->ledger().check(&bad)) << bad;
  }
};

struct fuzz_case {
  format f;
  std::uint32_t B;
  std::size_t blocks;
};

class paged_fuzz : public ::testing::TestWithParam<fuzz_case> {};

TEST_P(paged_fuzz, random_operations_keep_accounting_and_contents) {
  const fuzz_case fc = GetParam();
  std::vector<std::uint64_t> seeds{1, 2, 3, std::random_device{}()};
  std::size_t exhausted = 0, adopted = 0;
  for (const std::uint64_t seed : seeds) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    fuzzer fz(seed, fc.f, fc.B, fc.blocks, 10);
    fz.run(1500);
    if (HasFatalFailure()) return;
    exhausted += fz.exhausted;
    adopted += fz.adopted_tokens;
  }
  // The pool is small enough that exhaustion and prefix adoption both happen.
  EXPECT_GT(exhausted, 0u);
  EXPECT_GT(adopted, 0u);
}

INSTANTIATE_TEST_SUITE_P(paged, paged_fuzz,
                         ::testing::Values(fuzz_case{format::f16, 4, 40}, fuzz_case{format::f32, 4, 24},
                                           fuzz_case{format::f16, 8, 20}, fuzz_case{format::f32, 1, 64}),
                         [](const ::testing::TestParamInfo<fuzz_case>& i) {
                           return std::string(kvcache::to_string(i.param.f)) + "_b" + std::to_string(i.param.B) +
                                  "_" + std::to_string(i.param.blocks) + "blocks";
                         });

}  // namespace
