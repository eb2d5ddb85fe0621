// Allocation failure, injected (tests/oom_injection.hpp): each call below that allocates runs with
// its k-th allocation failing, k = 0, 1, 2, ..., until it no longer meets the failure: every run
// must return a value or errc::out_of_memory, throw nothing, and (for calls on an existing cache)
// leave the cache as it was: the same stats and contents (what attention reads). Covered: create()
// of every CPU cache, a sequence's create, fork, create_with_prefix, reserve (with and without
// token ids), write, commit, export_block_tables, and attend(). The CUDA caches: tests/cuda/test_cuda_oom.cpp.
#include <kvcache/attend.hpp>
#include <kvcache/block_pool.hpp>
#include <kvcache/contiguous_cache.hpp>
#include <kvcache/paged_cache.hpp>
#include <kvcache/two_tier_cache.hpp>

#include <gtest/gtest.h>

#include "oom_injection.hpp"
#include "replaced_new.hpp"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>
#include <random>
#include <string>
#include <vector>

#include <unistd.h>

#if KVCACHE_HAS_EXCEPTIONS

// Under AddressSanitizer a refused malloc returns null (as the system allocator's does) rather
// than ending the program, so that sequence_table_beyond_memory runs there too.
#if defined(__SANITIZE_ADDRESS__)
#define KVCACHE_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVCACHE_TEST_ASAN 1
#endif
#endif
#if defined(KVCACHE_TEST_ASAN)
extern "C" const char* __asan_default_options() { return "allocator_may_return_null=1"; }
#endif

// Allocations above this many bytes are refused (and counted in g_refused_large) while it is set.
std::atomic<std::size_t> g_refuse_above{0};
std::atomic<long> g_refused_large{0};

void* kvcache_test_allocate(std::size_t n, std::size_t align) noexcept {
  const std::size_t limit = g_refuse_above.load(std::memory_order_relaxed);
  if (limit != 0 && n > limit) {
    g_refused_large.fetch_add(1, std::memory_order_relaxed);
    return nullptr;
  }
  return kvcache_test::fail_now() ? nullptr : kvcache_test::system_allocate(n, align);
}

namespace {

using namespace kvcache;

constexpr geometry shape{2, 2, 32};

using kvcache_test::each_allocation_fails;

std::vector<float> rows(std::size_t tokens, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<float> x(tokens * shape.token_width());
  for (float& v : x) v = nd(rng);
  return x;
}

// What a cache holds, as attend reads it: every sequence's length and its attention output.
template <class C>
std::vector<float> outputs(const C& cache, const std::vector<seq_id>& ids) {
  std::vector<float> all;
  attention_workspace ws;
  const attention_params p{.q_heads = 4, .kv_heads = shape.kv_heads, .head_dim = shape.head_dim};
  const std::vector<float> q(std::size_t{4} * shape.head_dim, 0.25f);
  for (seq_id id : ids) {
    all.push_back(static_cast<float>(cache.length(id).value()));
    for (std::uint32_t l = 0; l < shape.layers; ++l) {
      const layer_view v = cache.view(id, l).value();
      std::vector<float> out(q.size());
      EXPECT_TRUE(attend(p, std::span(&v, 1), q, out, ws).has_value());
      all.insert(all.end(), out.begin(), out.end());
    }
  }
  return all;
}

// A run of n tokens through the step protocol, each call under each_allocation_fails, the cache
// compared with itself before the call after every failure.
template <class C>
void step(C& cache, const std::vector<seq_id>& ids, seq_id id, std::size_t n, std::uint32_t seed,
          const std::string& what) {
  const std::vector<float> k = rows(n, seed), v = rows(n, seed + 1);
  auto state = [&] { return std::make_pair(outputs(cache, ids), cache.stats().resident_bytes); };
  auto before = state();
  auto same = [&] { return state() == before; };
  (void)each_allocation_fails(what + " reserve", [&] { return cache.reserve(id, n); }, same);
  for (std::uint32_t l = 0; l < shape.layers; ++l)
    (void)each_allocation_fails(what + " write", [&] { return cache.write(id, l, k, v); });
  before = state();
  (void)each_allocation_fails(what + " commit", [&] { return cache.commit(id); }, same);
}

TEST(oom, contiguous_cache) {
  auto cache = each_allocation_fails("contiguous create", [] {
    return contiguous_cache<cpu>::create({.shape = shape, .storage = format::f16, .max_sequences = 3, .capacity_tokens = 200});
  });
  ASSERT_TRUE(cache.has_value());
  contiguous_cache<cpu>& c = *cache;
  std::vector<seq_id> ids;
  auto same = [&] { return c.stats().sequences == ids.size() && outputs(c, ids) == outputs(c, ids); };
  ids.push_back(each_allocation_fails("contiguous sequence", [&] { return c.create(); }, same).value());
  step(c, ids, ids[0], 70, 1, "contiguous");
  ids.push_back(each_allocation_fails("contiguous fork", [&] { return c.fork(ids[0]); }, same).value());
  step(c, ids, ids[1], 5, 3, "contiguous, forked");
}

TEST(oom, paged_cache_and_shared_pool) {
  auto pool = each_allocation_fails("block_pool create", [] {
    return block_pool<cpu>::create({.shape = shape, .block_tokens = 16, .storage = format::f16, .budget_bytes = 1u << 20});
  });
  ASSERT_TRUE(pool.has_value());
  for (const bool shared : {false, true}) {
    const std::string what = shared ? "paged (shared pool)" : "paged";
    auto cache = each_allocation_fails(what + " create", [&] {
      paged_config<cpu> cfg{.shape = shape, .storage = format::f16, .block_tokens = 16, .budget_bytes = 1u << 20};
      if (shared) cfg.pool = *pool;
      return paged_cache<cpu>::create(cfg);
    });
    ASSERT_TRUE(cache.has_value());
    paged_cache<cpu>& c = *cache;
    std::vector<seq_id> ids;
    auto same = [&] { return c.stats().sequences == ids.size(); };
    ids.push_back(each_allocation_fails(what + " sequence", [&] { return c.create(); }, same).value());
    step(c, ids, ids[0], 70, 5, what);  // 5 blocks: the table grows
    step(c, ids, ids[0], 40, 7, what);
    ids.push_back(each_allocation_fails(what + " fork", [&] { return c.fork(ids[0]); }, same).value());
    step(c, ids, ids[1], 3, 9, what + ", forked");  // copy-on-write of the shared last block
    // Prefix reuse: a sequence reserved with token ids (its full blocks published at commit),
    // then one created from the same prompt, adopting three of them.
    std::vector<std::int32_t> prompt(50);
    for (std::size_t t = 0; t < prompt.size(); ++t) prompt[t] = static_cast<std::int32_t>(1000 + t);
    ids.push_back(each_allocation_fails(what + " sequence with ids", [&] { return c.create(); }, same).value());
    const std::vector<float> k = rows(prompt.size(), 21), v = rows(prompt.size(), 22);
    auto before = outputs(c, ids);
    auto unchanged = [&] { return outputs(c, ids) == before; };
    (void)each_allocation_fails(what + " reserve with ids", [&] { return c.reserve(ids.back(), prompt.size(), prompt); },
                                unchanged);
    for (std::uint32_t l = 0; l < shape.layers; ++l)
      (void)each_allocation_fails(what + " write", [&] { return c.write(ids.back(), l, k, v); });
    (void)each_allocation_fails(what + " commit with ids", [&] { return c.commit(ids.back()); }, unchanged);
    auto match = each_allocation_fails(what + " create_with_prefix", [&] { return c.create_with_prefix(prompt); }, same);
    ASSERT_TRUE(match.has_value());
    EXPECT_EQ(match->cached_tokens, 48u);
    ids.push_back(match->seq);
    (void)each_allocation_fails(what + " export_block_tables", [&] { return c.export_block_tables(ids); });
  }
}

// A batch whose CSR export overflows int32 indices is errc::overflow before anything is
// allocated for it: until session 54 the cache's own buffers grew to the batch's size first (8
// GiB here; refused below, which made the call out_of_memory). One sequence of 2^16 one-token
// blocks, listed 2^15 + 1 times: 2^31 + 2^16 entries.
TEST(oom, export_block_tables_overflow_before_allocating) {
  constexpr geometry tiny{1, 1, 16};
  constexpr std::size_t tokens = std::size_t{1} << 16;
  auto made = paged_cache<cpu>::create(
      {.shape = tiny, .storage = format::f16, .block_tokens = 1, .budget_bytes = tokens * tiny.token_width() * 2 * 2});
  ASSERT_TRUE(made.has_value()) << made.error().message;
  paged_cache<cpu>& c = *made;
  const seq_id s = c.create().value();
  ASSERT_TRUE(c.reserve(s, tokens).has_value());
  const std::vector<float> k(tokens * tiny.token_width(), 0.5f);
  ASSERT_TRUE(c.write(s, 0, k, k).has_value());
  ASSERT_TRUE(c.commit(s).has_value());
  const std::vector<seq_id> batch((std::size_t{1} << 15) + 1, s);
  g_refused_large.store(0);
  g_refuse_above.store(std::size_t{1} << 20);
  const auto r = c.export_block_tables(batch);
  g_refuse_above.store(0);
  EXPECT_EQ(g_refused_large.load(), 0) << "export_block_tables allocated for a batch it cannot export";
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code, errc::overflow) << r.error().message;
  EXPECT_NE(r.error().message.find("blocks=2147549184"), std::string::npos) << r.error().message;
  // The batch that fits still exports (the buffers were not left in a bad state).
  const auto one = c.export_block_tables(std::span(batch).first(1));
  ASSERT_TRUE(one.has_value()) << one.error().message;
  EXPECT_EQ(one->indptr[1], static_cast<std::int32_t>(tokens));
}

TEST(oom, two_tier_cache) {
  auto cache = each_allocation_fails("two-tier create", [] {
    return two_tier_cache<cpu>::create({.shape = shape, .tail_tokens = 32});
  });
  ASSERT_TRUE(cache.has_value());
  two_tier_cache<cpu>& c = *cache;
  std::vector<seq_id> ids;
  auto same = [&] { return c.stats().sequences == ids.size(); };
  ids.push_back(each_allocation_fails("two-tier sequence", [&] { return c.create(); }, same).value());
  step(c, ids, ids[0], 50, 11, "two-tier");   // the tail ring
  step(c, ids, ids[0], 100, 13, "two-tier");  // migration: store slabs
  ids.push_back(each_allocation_fails("two-tier second sequence", [&] { return c.create(); }, same).value());
  step(c, ids, ids[1], 40, 15, "two-tier, second sequence");
}

// A configuration whose sequence table alone is beyond memory (2^32 - 1 sequences): an error
// from create(), which allocates the table (the sequences' storage waits for create(seq)).
TEST(oom, sequence_table_beyond_memory) {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0 || static_cast<double>(pages) * static_cast<double>(page) > 128.0 * (1u << 30))
    GTEST_SKIP() << "more than 128 GiB of memory (or unknown): the table might fit";
  auto c = contiguous_cache<cpu>::create(
      {.shape = shape, .storage = format::f16, .max_sequences = 0xffffffffu, .capacity_tokens = 16});
  ASSERT_FALSE(c.has_value());
  EXPECT_EQ(c.error().code, errc::out_of_memory) << c.error().message;
}

TEST(oom, attention_workspace) {
  auto cache = contiguous_cache<cpu>::create({.shape = shape, .storage = format::f16, .max_sequences = 1, .capacity_tokens = 64});
  ASSERT_TRUE(cache.has_value());
  const seq_id id = cache->create().value();
  const std::vector<float> k = rows(64, 17), v = rows(64, 18);
  ASSERT_TRUE(cache->reserve(id, 64) && cache->write(id, 0, k, v) && cache->write(id, 1, k, v) && cache->commit(id));
  const layer_view view = cache->view(id, 0).value();
  const std::vector<float> q(4 * shape.head_dim, 0.5f);
  for (const unsigned threads : {1u, 2u}) {
    attention_workspace ws;
    std::vector<float> out(q.size());
    const attention_params p{.q_heads = 4, .kv_heads = shape.kv_heads, .head_dim = shape.head_dim, .threads = threads};
    (void)each_allocation_fails(
        "attend, threads " + std::to_string(threads),
        [&] {
          std::fill(out.begin(), out.end(), -7.0f);
          return attend(p, std::span(&view, 1), q, out, ws);
        },
        [&] { return std::all_of(out.begin(), out.end(), [](float x) { return x == -7.0f; }); });  // nothing written
  }
}

// The error of a call that fails for want of memory needs memory for its message: where even
// that is refused, make_error and detail::fail_joined still return the typed error (with as much
// of the message as fits without allocating) instead of throwing.
TEST(oom, error_whose_message_cannot_be_allocated) {
  const std::string_view what = "pool_exhausted: no free block for the reservation of this sequence";
  const std::string full = std::string(what) + " (seq=12345, blocks=678)";
  for (const bool joined : {false, true}) {
    for (long k = 0; k < 10; ++k) {
      kvcache_test::g_fired.store(false);
      kvcache_test::g_countdown.store(k);
      const error e = joined ? result<void>(detail::fail_joined(errc::pool_exhausted, {what.substr(0, 20), what.substr(20)},
                                                                {{"seq", 12345}, {"blocks", 678}}))
                                   .error()
                             : make_error(errc::pool_exhausted, what, {{"seq", 12345}, {"blocks", 678}});
      kvcache_test::g_countdown.store(-1);
      EXPECT_EQ(e.code, errc::pool_exhausted);
      if (!kvcache_test::g_fired.load()) {
        EXPECT_EQ(e.message, full);
        break;
      }
      // fail_joined falls back to its first part (with the arguments) where the join is refused.
      const bool first_part = joined && e.message == std::string(what.substr(0, 20)) + " (seq=12345, blocks=678)";
      EXPECT_TRUE(first_part || what.substr(0, e.message.size()) == e.message)
          << "joined " << joined << ", allocation " << k << ": " << e.message;
    }
  }
}

}  // namespace

#else
TEST(oom, needs_exceptions) { GTEST_SKIP() << "injects std::bad_alloc: built without exceptions"; }
#endif
