// attend()'s own thread pool and an engine-supplied parallel_for, driven hard enough for
// ThreadSanitizer (CI runs every *threads* test under -fsanitize=thread): many calls through one
// persistent pool, two engine threads each with its own workspace reading the same caches, and one
// long sequence split into parts that several workers read and attend() merges.
#include <kvcache/attend.hpp>
#include <kvcache/contiguous_cache.hpp>

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <random>
#include <thread>
#include <vector>

namespace {

using namespace kvcache;

constexpr geometry shape{1, 4, 64};
constexpr std::uint32_t q_heads = 8;
constexpr std::uint32_t sequences = 5;

struct fixture_data {
  contiguous_cache<cpu> cache;
  std::vector<seq_id> ids;
  std::vector<float> q;  // [sequence][q_head][head_dim]
};

// `count` sequences of ragged lengths (a few hundred tokens), or one of `long_tokens`.
fixture_data make_data(std::uint32_t seed, std::uint32_t count = sequences, std::uint32_t long_tokens = 0) {
  auto cache = contiguous_cache<cpu>::create({.shape = shape, .storage = format::f16, .max_sequences = count,
                                              .capacity_tokens = long_tokens > 0 ? long_tokens : 600});
  EXPECT_TRUE(cache.has_value());
  fixture_data d{std::move(cache).value(), {}, {}};
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (std::uint32_t s = 0; s < count; ++s) {
    const seq_id id = d.cache.create().value();
    const std::size_t n = long_tokens > 0 ? long_tokens : 37 + 113 * s;
    std::vector<float> k(n * shape.token_width()), v(k.size());
    for (float& x : k) x = nd(rng);
    for (float& x : v) x = nd(rng);
    EXPECT_TRUE(d.cache.reserve(id, n).has_value());
    EXPECT_TRUE(d.cache.write(id, 0, k, v).has_value());
    EXPECT_TRUE(d.cache.commit(id).has_value());
    d.ids.push_back(id);
  }
  d.q.resize(std::size_t{count} * q_heads * shape.head_dim);
  for (float& x : d.q) x = nd(rng);
  return d;
}

std::vector<layer_view> views_of(const fixture_data& d) {
  std::vector<layer_view> views;
  for (seq_id id : d.ids) views.push_back(d.cache.view(id, 0).value());
  return views;
}

std::vector<float> run(const fixture_data& d, const attention_params& p, attention_workspace& ws) {
  const std::vector<layer_view> views = views_of(d);
  std::vector<float> out(d.q.size(), -1.0f);
  const result<void> r = attend(p, views, d.q, out, ws);
  EXPECT_TRUE(r.has_value()) << (r ? "" : r.error().message);
  return out;
}

attention_params params(unsigned threads) {
  return attention_params{.q_heads = q_heads, .kv_heads = shape.kv_heads, .head_dim = shape.head_dim,
                          .threads = threads};
}

TEST(attend_threads, own_pool_matches_single_thread_over_many_calls) {
  const fixture_data d = make_data(11);
  attention_workspace ws1, ws3;
  const std::vector<float> expected = run(d, params(1), ws1);
  for (int call = 0; call < 200; ++call) {
    const std::vector<float> got = run(d, params(3), ws3);
    ASSERT_EQ(got, expected) << "call " << call;  // per-row work is identical: bitwise equal
  }
}

// The pool's workers spin a while between calls before they sleep: calls back to back (workers
// spinning), calls after an idle pause (workers asleep), calls that use fewer workers than the
// pool has, and workspaces destroyed while their workers spin or sleep.
TEST(attend_threads, own_pool_spinning_sleeping_and_partly_used) {
  const fixture_data d = make_data(14);
  attention_workspace ws1;
  const std::vector<float> expected = run(d, params(1), ws1);
  for (int round = 0; round < 4; ++round) {
    attention_workspace ws;
    for (int call = 0; call < 24; ++call) {
      const unsigned threads = call % 3 == 0 ? 4 : call % 3 == 1 ? 2 : 3;  // the pool grows to 3 helpers
      ASSERT_EQ(run(d, params(threads), ws), expected) << "round " << round << " call " << call;
      if (call % 4 == 3) std::this_thread::sleep_for(std::chrono::milliseconds(2));  // past the spin
    }
    if (round % 2 == 1) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }  // each round's workspace is destroyed right after a call (spinning) or after a pause (asleep)
}

// A tiny engine pool: one std::thread per worker, joined before run() returns.
void engine_run(void* pool, std::size_t count, parallel_for::task_fn task, void* ctx) {
  const unsigned workers = *static_cast<unsigned*>(pool);
  std::vector<std::thread> threads;
  for (unsigned w = 0; w < workers; ++w)
    threads.emplace_back([=] {
      for (std::size_t i = w; i < count; i += workers) task(ctx, i, w);
    });
  for (std::thread& t : threads) t.join();
}

TEST(attend_threads, engine_pool_and_concurrent_workspaces) {
  const fixture_data d = make_data(12);
  attention_workspace ref_ws;
  const std::vector<float> expected = run(d, params(1), ref_ws);

  unsigned workers = 2;
  attention_params engine = params(1);
  engine.pool = parallel_for{.run = engine_run, .pool = &workers, .workers = workers};

  // Two engine threads, each with its own workspace, attend over the same (read-only) caches.
  std::vector<std::vector<float>> results(2);
  std::vector<std::thread> callers;
  for (int c = 0; c < 2; ++c)
    callers.emplace_back([&, c] {
      attention_workspace ws;
      for (int call = 0; call < 30; ++call)
        results[c] = run(d, c == 0 ? engine : params(2), ws);
    });
  for (std::thread& t : callers) t.join();
  EXPECT_EQ(results[0], expected);
  EXPECT_EQ(results[1], expected);
}

// One sequence of 5000 tokens over 4 workers (attend's own, then an engine's): its tokens are
// split into 4 parts, each part's partial result written by one worker and merged by the caller.
TEST(attend_threads, split_sequence_over_many_calls) {
  const fixture_data d = make_data(13, 1, 5000);
  attention_workspace ws1, ws4, wse;
  const std::vector<float> single = run(d, params(1), ws1);
  const std::vector<float> expected = run(d, params(4), ws4);
  for (std::size_t i = 0; i < single.size(); ++i) ASSERT_NEAR(expected[i], single[i], 1e-4f) << i;
  unsigned workers = 4;
  attention_params engine = params(1);
  engine.pool = parallel_for{.run = engine_run, .pool = &workers, .workers = workers};
  for (int call = 0; call < 100; ++call) {
    ASSERT_EQ(run(d, params(4), ws4), expected) << "call " << call;  // the same parts: bitwise equal
    if (call % 10 == 0) {
      ASSERT_EQ(run(d, engine, wse), expected) << "call " << call;
    }
  }
}

}  // namespace
