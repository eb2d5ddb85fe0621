// Concurrency contract of the paged cache: one block pool shared by several caches, each cache
// driven by its own thread. Threads create sequences (plain and by prefix adoption of shared
// prompts, so they adopt blocks other threads published), reserve/write/commit with token ids,
// fork, copy_prefix, truncate and release, all concurrently, on a pool small enough to run out.
// Each thread checks its own sequences' contents against its model; the pool's accounting is
// checked concurrently and at the end. CI runs this binary under ThreadSanitizer.
#include "test_paged_util.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace paged_test;
using kvcache::errc;

struct model {
  seq_id id{};
  std::vector<std::uint64_t> tags;
  std::vector<std::int32_t> plan;
};

struct worker_result {
  std::size_t failures = 0;     // unexpected errors or content mismatches
  std::size_t ops = 0;
  std::size_t adopted = 0;      // tokens adopted by create_with_prefix
  std::size_t exhausted = 0;    // reserves refused with pool_exhausted
  std::string first_failure;
};

void fail(worker_result& r, const std::string& what) {
  if (r.failures++ == 0) r.first_failure = what;
}

void worker(std::shared_ptr<block_pool<cpu>> pool, const std::vector<std::vector<std::int32_t>>& prompts,
            std::uint64_t seed, int ops, worker_result& out) {
  auto c = make_cache(pool);
  std::mt19937_64 rng(seed);
  auto between = [&](std::size_t lo, std::size_t hi) { return std::uniform_int_distribution<std::size_t>(lo, hi)(rng); };
  std::vector<model> live;
  const std::uint32_t B = pool->block_tokens();
  for (int op = 0; op < ops; ++op) {
    const std::size_t kind = between(0, 99);
    if (live.empty() || (kind < 15 && live.size() < 6)) {
      std::vector<std::int32_t> prompt = prompts[between(0, prompts.size() - 1)];
      prompt.resize(between(1, prompt.size()));
      auto r = c.create_with_prefix(prompt);
      if (!r.has_value()) { fail(out, r.error().message); continue; }
      model m;
      m.id = r.value().seq;
      const std::size_t k = r.value().cached_tokens;
      out.adopted += k;
      const auto all = tags_of(prompt);
      m.tags.assign(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(k));
      m.plan.assign(prompt.begin() + static_cast<std::ptrdiff_t>(k), prompt.end());
      if (mismatches(c, m.id, m.tags) != 0) fail(out, "adopted blocks hold other keys");
      live.push_back(std::move(m));
    } else if (kind < 60) {
      model& m = live[between(0, live.size() - 1)];
      std::vector<std::int32_t> add;
      const std::size_t n = between(1, 2 * B);
      while (add.size() < n && !m.plan.empty()) {
        add.push_back(m.plan.front());
        m.plan.erase(m.plan.begin());
      }
      while (add.size() < n) add.push_back(static_cast<std::int32_t>(between(0, 3)));
      const auto tags = tags_of(add, m.tags.empty() ? root_tag : m.tags.back());
      auto r = append(c, m.id, tags, add);
      if (!r.has_value()) {
        if (r.error().code != errc::pool_exhausted) fail(out, r.error().message);
        ++out.exhausted;
        m.plan.clear();
        continue;
      }
      m.tags.insert(m.tags.end(), tags.begin(), tags.end());
    } else if (kind < 70) {
      model& m = live[between(0, live.size() - 1)];
      const std::size_t n = between(0, m.tags.size());
      if (!c.truncate(m.id, n).has_value()) fail(out, "truncate");
      m.tags.resize(n);
      m.plan.clear();
    } else if (kind < 82) {
      if (live.size() >= 8) continue;
      const model& src = live[between(0, live.size() - 1)];
      const std::size_t n = kind < 76 ? src.tags.size() : between(0, src.tags.size());
      auto r = kind < 76 ? c.fork(src.id) : c.copy_prefix(src.id, n);
      if (!r.has_value()) { fail(out, r.error().message); continue; }
      model m;
      m.id = r.value();
      m.tags.assign(src.tags.begin(), src.tags.begin() + static_cast<std::ptrdiff_t>(n));
      live.push_back(std::move(m));
    } else if (kind < 95) {
      const std::size_t i = between(0, live.size() - 1);
      if (mismatches(c, live[i].id, live[i].tags) != 0) fail(out, "contents before release");
      if (!c.release(live[i].id).has_value()) fail(out, "release");
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      // Pool-wide snapshot taken while the other threads run: always consistent.
      const auto st = pool->stats();
      if (st.blocks_free + st.blocks_in_use + st.blocks_cached != st.blocks_total) fail(out, "pool snapshot");
      for (const model& m : live)
        if (mismatches(c, m.id, m.tags) != 0) fail(out, "contents");
    }
    ++out.ops;
  }
  for (const model& m : live) {
    if (mismatches(c, m.id, m.tags) != 0) fail(out, "final contents");
    if (!c.release(m.id).has_value()) fail(out, "final release");
  }
}

TEST(paged_threads, caches_on_one_pool_run_concurrently) {
  const geometry g{2, 2, 16};
  for (const format f : {format::f16, format::f32}) {
    SCOPED_TRACE(std::string(kvcache::to_string(f)));
    auto pool = make_pool(g, f, 4, 96);
    std::mt19937_64 rng(std::random_device{}());
    std::vector<std::vector<std::int32_t>> prompts;
    for (int p = 0; p < 3; ++p) {
      std::vector<std::int32_t> pr(24);
      for (auto& t : pr) t = static_cast<std::int32_t>(rng() % 4);
      prompts.push_back(pr);
    }
    constexpr int threads = 4;
    std::vector<worker_result> results(threads);
    std::vector<std::thread> pool_threads;
    const std::uint64_t base_seed = rng();
    for (int t = 0; t < threads; ++t)
      pool_threads.emplace_back(worker, pool, std::cref(prompts), base_seed + static_cast<std::uint64_t>(t), 600,
                                std::ref(results[t]));
    for (auto& t : pool_threads) t.join();
    std::size_t adopted = 0, ops = 0;
    for (int t = 0; t < threads; ++t) {
      EXPECT_EQ(results[t].failures, 0u) << "thread " << t << " (base seed " << base_seed << "): "
                                         << results[t].first_failure;
      adopted += results[t].adopted;
      ops += results[t].ops;
    }
    EXPECT_GT(ops, 0u);
    EXPECT_GT(adopted, 0u) << "no prefix was adopted: the test exercised no cross-thread sharing";
    const auto st = pool->stats();
    EXPECT_EQ(st.blocks_in_use, 0u);
    EXPECT_EQ(st.blocks_shared, 0u);
    EXPECT_EQ(st.blocks_free + st.blocks_cached, st.blocks_total);
    std::uint32_t bad = 0;
    EXPECT_TRUE(pool->ledger().check(&bad)) << "block " << bad;
  }
}

}  // namespace
