// The CUDA caches' memory stats against the runtime's own ledger, emulated runtime only
// (tests/cuda.cmake): the emulated cudaMalloc and cudaMallocHost record every live allocation, so
// what a cache holds from the runtime is known exactly. After every call that may allocate
// (create, a sequence's create, reserve, write from host rows, commit, fork, prepare,
// write_batch, attend, reserve_table, release), the bytes the runtime has handed out, less the
// test's own buffers, must be what the cache's stats say it holds:
//   contiguous_cache<cuda>, paged_cache<cuda>: resident_bytes, device and pinned together (the
//     paged cache's includes its pool's arena);
//   two_tier_cache<cuda>: resident_bytes the device bytes, and the pinned bytes within
//     metadata_bytes (which also counts host tables the runtime does not see).
// And once a cache is destroyed the runtime holds nothing of it.
#include "cuda_test_util.hpp"

#include <kvcache/cuda/contiguous_cache.hpp>
#include <kvcache/cuda/paged_cache.hpp>
#include <kvcache/cuda/two_tier_cache.hpp>

#include <cuda_runtime.h>  // the emulated one: its ledger of allocations

#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#if !defined(KVCACHE_CUDA_EMULATED)
#error "test_cuda_stats is built against the emulated CUDA runtime only (tests/cuda.cmake)"
#endif

namespace {

using namespace kvcache;
using kvcache_cuda_test::upload;

constexpr geometry shape{2, 2, 32};
constexpr std::uint32_t q_heads = 4;
const cuda where{};

// Bytes the emulated runtime has handed out and not taken back.
struct held {
  std::size_t device = 0, pinned = 0;
};
std::size_t total(const std::map<const char*, std::size_t>& m) {
  std::size_t n = 0;
  for (const auto& [p, bytes] : m) n += bytes;
  return n;
}
held runtime_held() { return {total(kvcache_emu::state().device), total(kvcache_emu::state().pinned)}; }

std::vector<float> rows(std::size_t tokens, std::uint32_t seed) { return kvcache_cuda_test::seeded_rows(shape, tokens, seed); }
attention_params params() { return kvcache_cuda_test::params_of(shape, q_heads); }

// What the runtime holds beyond `base` and the test's own device bytes `own`, against a cache's
// stats (two-tier: device and pinned apart).
void expect_resident(const held& base, std::size_t own, std::size_t resident, const std::string& what) {
  const held now = runtime_held();
  EXPECT_EQ(now.device + now.pinned - base.device - base.pinned - own, resident) << what;
}
void expect_two_tier(const held& base, std::size_t own, const two_tier_stats& st, const std::string& what) {
  const held now = runtime_held();
  EXPECT_EQ(now.device - base.device - own, st.resident_bytes) << what;
  EXPECT_GT(now.pinned - base.pinned, 0u) << what;
  EXPECT_LE(now.pinned - base.pinned, st.metadata_bytes) << what;
  EXPECT_LE(st.tail_bytes + st.store_bytes, st.resident_bytes) << what;
}

// Once a cache is gone the runtime holds what it held before the cache was made.
void expect_nothing_held(const held& base, const std::string& what) {
  const held after = runtime_held();
  EXPECT_EQ(after.device, base.device) << what;
  EXPECT_EQ(after.pinned, base.pinned) << what;
}

// n tokens for `id` (reserve, host-row writes, commit), `check` after each call.
template <class C, class Check>
void step(C& c, seq_id id, std::size_t n, std::uint32_t seed, Check check, const std::string& what) {
  const std::vector<float> k = rows(n, seed), v = rows(n, seed + 1);
  KVCACHE_ASSERT_OK(c.reserve(id, n));
  check(0, what + " reserve");
  for (std::uint32_t l = 0; l < shape.layers; ++l) {
    KVCACHE_ASSERT_OK(c.write(id, l, std::span<const float>(k), std::span<const float>(v)));
    check(0, what + " write");
  }
  KVCACHE_ASSERT_OK(c.commit(id));
  check(0, what + " commit");
}

// One decode step of the batch: prepare, write_batch and attend every layer (the workspace is
// the caller's: `check` is told its bytes and the test's rows').
template <class C, class Check>
void batch_step(C& c, const std::vector<seq_id>& ids, std::uint32_t seed, Check check, const std::string& what) {
  for (seq_id id : ids) KVCACHE_ASSERT_OK(c.reserve(id, 1));
  const std::size_t q_count = ids.size() * q_heads * shape.head_dim;
  auto k = upload(where, rows(ids.size(), seed));
  auto v = upload(where, rows(ids.size(), seed + 1));
  auto q = upload(where, std::vector<float>(q_count, 0.5f));
  auto out = upload(where, std::vector<float>(q_count, 0.0f));
  ASSERT_TRUE(k.has_value() && v.has_value() && q.has_value() && out.has_value());
  const std::size_t rows_bytes = k->buf.size() + v->buf.size() + q->buf.size() + out->buf.size();
  KVCACHE_ASSERT_OK(c.prepare(ids));
  check(rows_bytes, what + " prepare");
  device_buffer ws;
  for (std::uint32_t l = 0; l < shape.layers; ++l) {
    KVCACHE_ASSERT_OK(c.write_batch(l, k->data(), v->data()));
    check(rows_bytes + ws.size(), what + " write_batch");
    KVCACHE_ASSERT_OK(c.attend(l, params(), q->data(), out->data(), ws));
    check(rows_bytes + ws.size(), what + " attend");
  }
  for (seq_id id : ids) KVCACHE_ASSERT_OK(c.commit(id));
  check(rows_bytes + ws.size(), what + " commit");
}

TEST(cuda_stats, contiguous_resident_bytes_are_the_runtime_allocations) {
  const held base = runtime_held();
  {
    auto cache = contiguous_cache<cuda>::create({.shape = shape, .storage = format::f16, .max_sequences = 3, .capacity_tokens = 120});
    KVCACHE_ASSERT_OK(cache);
    contiguous_cache<cuda>& c = *cache;
    auto check = [&](std::size_t own, const std::string& what) { expect_resident(base, own, c.stats().resident_bytes, what); };
    check(0, "create");
    EXPECT_GT(runtime_held().pinned, base.pinned);  // the tables' upload staging
    std::vector<seq_id> ids{c.create().value()};
    check(0, "sequence");
    step(c, ids[0], 40, 1, check, "first");
    ids.push_back(c.fork(ids[0]).value());
    check(0, "fork");
    step(c, ids[1], 70, 3, check, "longer rows");  // the host-write staging grows
    batch_step(c, ids, 5, check, "batch");
    KVCACHE_ASSERT_OK(c.release(ids[0]));
    check(0, "release");
  }
  expect_nothing_held(base, "destroyed");
}

TEST(cuda_stats, paged_resident_bytes_are_the_runtime_allocations) {
  for (const bool shared : {false, true}) {
    const std::string what = shared ? "shared pool: " : "own pool: ";
    const held base = runtime_held();
    {
      std::shared_ptr<block_pool<cuda>> pool;
      if (shared) {
        auto made = block_pool<cuda>::create({.shape = shape, .block_tokens = 16, .storage = format::f16, .budget_bytes = 1u << 20});
        KVCACHE_ASSERT_OK(made);
        pool = *made;
        expect_resident(base, 0, pool->stats().resident_bytes, what + "pool");
      }
      paged_config<cuda> cfg{.shape = shape, .storage = format::f16, .block_tokens = 16, .budget_bytes = 1u << 20};
      cfg.pool = pool;
      auto cache = paged_cache<cuda>::create(cfg);
      KVCACHE_ASSERT_OK(cache);
      paged_cache<cuda>& c = *cache;
      auto check = [&](std::size_t own, const std::string& w) { expect_resident(base, own, c.stats().resident_bytes, what + w); };
      check(0, "create");
      std::vector<seq_id> ids{c.create().value()};
      check(0, "sequence");
      step(c, ids[0], 70, 7, check, "first");
      ids.push_back(c.fork(ids[0]).value());
      check(0, "fork");
      step(c, ids[1], 90, 9, check, "forked, longer rows");
      KVCACHE_ASSERT_OK(c.reserve_table(40, 400));  // the device tables and their pinned staging grow
      check(0, "reserve_table");
      batch_step(c, ids, 11, check, "batch");
      KVCACHE_ASSERT_OK(c.release(ids[0]));
      check(0, "release");
    }
    expect_nothing_held(base, what + "destroyed");
  }
}

TEST(cuda_stats, two_tier_device_and_pinned_bytes_are_the_runtime_allocations) {
  const held base = runtime_held();
  {
    auto cache = two_tier_cache<cuda>::create({.shape = shape, .tail_tokens = 32, .max_tokens = 256, .max_sequences = 3});
    KVCACHE_ASSERT_OK(cache);
    two_tier_cache<cuda>& c = *cache;
    auto check = [&](std::size_t own, const std::string& what) { expect_two_tier(base, own, c.stats(), what); };
    check(0, "create");
    std::vector<seq_id> ids{c.create().value()};
    check(0, "sequence");
    step(c, ids[0], 50, 13, check, "tail");
    step(c, ids[0], 100, 15, check, "migration");  // the host-write staging grows
    ids.push_back(c.create().value());
    check(0, "second sequence");
    step(c, ids[1], 40, 17, check, "second");
    batch_step(c, ids, 19, check, "batch");
    KVCACHE_ASSERT_OK(c.release(ids[0]));
    check(0, "release");
  }
  expect_nothing_held(base, "destroyed");
}

}  // namespace
