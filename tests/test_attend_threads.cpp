// attend()'s own thread pool and an engine-supplied parallel_for, driven hard enough for
// ThreadSanitizer (CI runs every *threads* test under -fsanitize=thread): many calls through one
// persistent pool, two engine threads each with its own workspace reading the same caches, and one
// long sequence split into parts that several workers read and attend() merges. Also: the pool
// grown after jobs have run, and a thread that cannot start (a typed error, the workspace intact).
#include <kvcache/attend.hpp>
#include <kvcache/contiguous_cache.hpp>

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <thread>
#include <vector>

// thread_that_cannot_start_...: Linux, and no address or thread sanitizer (see there).
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define KVCACHE_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define KVCACHE_TEST_SANITIZED 1
#endif
#endif
#if defined(__linux__) && !defined(KVCACHE_TEST_SANITIZED)
#define KVCACHE_TEST_THREAD_LIMIT 1
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>
#endif

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

// The pool grown after jobs have run: threads started then must take the next job, not the last
// one, for new (until session 52 they started from generation 0 and could count themselves twice
// in a job: see attention_workspace::impl). Each round a fresh workspace runs 1, 2, then up to 6
// threads, each call growing the pool by one thread after the jobs before it.
TEST(attend_threads, pool_grown_after_jobs_matches_single_thread) {
  const fixture_data d = make_data(15);
  attention_workspace ws1;
  const std::vector<float> expected = run(d, params(1), ws1);
  for (int round = 0; round < 40; ++round) {
    attention_workspace ws;
    for (unsigned threads = 1; threads <= 6; ++threads) {
      ASSERT_EQ(run(d, params(threads), ws), expected) << "round " << round << " threads " << threads;
      ASSERT_EQ(run(d, params(threads), ws), expected) << "round " << round << " threads " << threads << ", again";
      if (round % 4 == 3) std::this_thread::sleep_for(std::chrono::milliseconds(1));  // workers asleep
    }
  }
}

#if defined(KVCACHE_TEST_THREAD_LIMIT)
// The child of thread_that_cannot_start_is_a_typed_error_and_loses_nothing: exits with 0, or the
// code of the step that failed.
[[noreturn]] void thread_start_child(const fixture_data& d, const std::vector<layer_view>& views,
                                     const std::vector<float>& expected, unsigned many) {
  attention_workspace ws;
  attention_params sized = params(1);  // scratch for `many` workers, allocated before the limit
  unsigned workers = many;
  sized.pool = parallel_for{.run = engine_run, .pool = &workers, .workers = many};
  if (!ws.reserve(sized)) _exit(10);
  std::vector<float> out(d.q.size());
  rlimit old{};
  if (getrlimit(RLIMIT_AS, &old) != 0) _exit(11);
  unsigned long pages = 0;
  std::FILE* statm = std::fopen("/proc/self/statm", "r");
  if (statm == nullptr || std::fscanf(statm, "%lu", &pages) != 1) _exit(12);
  std::fclose(statm);
  rlimit tight = old;
  tight.rlim_cur = pages * static_cast<unsigned long>(sysconf(_SC_PAGESIZE)) + (256u << 10);  // no room for a stack
  if (setrlimit(RLIMIT_AS, &tight) != 0) _exit(13);
  // Where the limit does not hold (qemu user emulation maps the guest's memory itself), a mapping
  // of a stack's size still succeeds: nothing to test there.
  void* probe = mmap(nullptr, std::size_t{8} << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (probe != MAP_FAILED) _exit(77);
  const result<void> r = ws.reserve(params(many));
  if (r) _exit(20);
  if (r.error().code != errc::out_of_memory) _exit(21);
  if (r.error().message.find("thread") == std::string::npos) _exit(22);
  const result<void> a = attend(params(many), views, d.q, out, ws);
  if (a || a.error().code != errc::out_of_memory) _exit(23);
  // Nothing lost: one thread (no new one) gives the same rows.
  if (!attend(params(1), views, d.q, out, ws) || out != expected) _exit(30);
  if (setrlimit(RLIMIT_AS, &old) != 0) _exit(31);
  // Threads can start again: the pool grows to `many` and gives the same rows.
  if (!attend(params(many), views, d.q, out, ws) || out != expected) _exit(32);
  _exit(0);
}
#endif

// A worker thread that cannot start (here: no address space left for its stack, RLIMIT_AS) is
// errc::out_of_memory from reserve and attend, and the workspace stays usable: with fewer threads
// at once, with as many once threads can start again. In a child process (fork), whose address
// space limit the rest of the tests do not see; not under the address or thread sanitizers, whose
// own mappings the limit would refuse. The pool asks for 48 threads: glibc reuses the cached
// stacks of earlier tests' threads (up to 40 MiB of them) without a new mapping.
TEST(attend_threads, thread_that_cannot_start_is_a_typed_error_and_loses_nothing) {
#if !defined(KVCACHE_TEST_THREAD_LIMIT)
  GTEST_SKIP() << "needs Linux (fork, RLIMIT_AS, /proc/self/statm) and no address or thread sanitizer";
#else
  const fixture_data d = make_data(16);
  attention_workspace ws1;
  const std::vector<float> expected = run(d, params(1), ws1);
  const std::vector<layer_view> views = views_of(d);
  constexpr unsigned many = 48;
  std::fflush(nullptr);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // Exit codes name the step that went wrong; 40: an exception escaped (the library never
    // throws); 77: the limit does not hold here.
    try {
      thread_start_child(d, views, expected, many);
    } catch (...) {
      _exit(40);
    }
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << "the child ended on a signal";
  if (WEXITSTATUS(status) == 77) GTEST_SKIP() << "RLIMIT_AS does not limit mappings here (qemu user emulation?)";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the step with this exit code failed (see the test)";
#endif
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
