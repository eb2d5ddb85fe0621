// Allocation failure in the CUDA caches (tests/oom_injection.hpp), emulated runtime only
// (tests/cuda.cmake): each call that allocates runs with its k-th allocation failing, k = 0, 1,
// 2, ..., both the caches' host allocations (operator new) and the runtime's device and pinned
// allocations (cudaMalloc, cudaMallocHost: the emulated runtime's refuse_allocation). Every run
// must return a value or errc::out_of_memory, throw nothing, and (for calls on an existing cache)
// leave the cache as it was: the same stats, lengths, and attention output of every sequence at
// every layer. Covered: create() of every CUDA cache and of block_pool<cuda>, a sequence's create,
// reserve, write (host rows), commit, fork / copy_prefix, prepare, write_batch, attend (the
// workspace grows), and for the paged cache reserve with token ids, create_with_prefix,
// reserve_table and export_block_tables.
#include "cuda_test_util.hpp"

#include <kvcache/cuda/contiguous_cache.hpp>
#include <kvcache/cuda/paged_cache.hpp>
#include <kvcache/cuda/two_tier_cache.hpp>

#include "../oom_injection.hpp"
#include "../replaced_new.hpp"

#include <cuda_runtime.h>  // the emulated one: refuse_allocation, runtime_depth

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#if !defined(KVCACHE_CUDA_EMULATED)
#error "test_cuda_oom is built against the emulated CUDA runtime only (tests/cuda.cmake)"
#endif

#if KVCACHE_HAS_EXCEPTIONS

// The caches' host allocations fail; the emulated runtime's own (its queue, graphs) do not.
void* kvcache_test_allocate(std::size_t n, std::size_t align) noexcept {
  if (kvcache_emu::runtime_depth() == 0 && kvcache_test::fail_now()) return nullptr;
  return kvcache_test::system_allocate(n, align);
}

namespace {

using namespace kvcache;
using kvcache_cuda_test::download;
using kvcache_cuda_test::upload;
using kvcache_test::each_allocation_fails;

constexpr geometry shape{2, 2, 32};
constexpr std::uint32_t q_heads = 4;
const cuda where{};

// Device and pinned allocations fail with the host ones, counted in the same sequence.
struct refuse_device_allocations {
  refuse_device_allocations() noexcept { kvcache_emu::state().refuse_allocation = &kvcache_test::fail_now; }
  ~refuse_device_allocations() { kvcache_emu::state().refuse_allocation = nullptr; }
  refuse_device_allocations(const refuse_device_allocations&) = delete;
  refuse_device_allocations& operator=(const refuse_device_allocations&) = delete;
};

std::vector<float> rows(std::size_t tokens, std::uint32_t seed) { return kvcache_cuda_test::seeded_rows(shape, tokens, seed); }
attention_params params() { return kvcache_cuda_test::params_of(shape, q_heads); }

// What a cache holds: its stats, every sequence's length, and the bytes of every chunk of its
// views at every layer (each kv head's keys and values: a whole Q4 group, or the chunk's dense
// rows), downloaded.
template <class C>
std::pair<std::vector<std::size_t>, std::vector<unsigned char>> contents(const C& c, const std::vector<seq_id>& ids) {
  const auto st = c.stats();
  std::pair<std::vector<std::size_t>, std::vector<unsigned char>> all{{st.sequences, st.tokens, st.resident_bytes}, {}};
  for (seq_id id : ids) {
    all.first.push_back(c.length(id).value());
    for (std::uint32_t l = 0; l < shape.layers; ++l) {
      const layer_view lv = c.view(id, l).value();
      for (const chunk& ch : lv)
        for (std::uint32_t h = 0; h < shape.kv_heads; ++h)
          for (const bool key : {true, false}) {
            const format f = key ? ch.k_format : ch.v_format;
            const std::size_t bytes = f != format::q4 ? ch.tokens * shape.head_dim * dense_element_bytes(f)
                                      : key           ? q4_key_group_bytes(shape.head_dim)
                                                      : q4_value_group_bytes(shape.head_dim);
            const std::vector<unsigned char> b =
                download(where, reinterpret_cast<const unsigned char*>(key ? ch.k_head(h) : ch.v_head(h)), bytes).value();
            all.second.insert(all.second.end(), b.begin(), b.end());
          }
    }
  }
  return all;
}

// n tokens for `id` through reserve, write (host rows) and commit, each call under
// each_allocation_fails; reserve and commit must leave the cache as it was when they fail.
template <class C>
void step(C& c, const std::vector<seq_id>& ids, seq_id id, std::size_t n, std::uint32_t seed, const std::string& what) {
  const std::vector<float> k = rows(n, seed), v = rows(n, seed + 1);
  auto before = contents(c, ids);
  auto same = [&] { return contents(c, ids) == before; };
  (void)each_allocation_fails(what + " reserve", [&] { return c.reserve(id, n); }, same);
  for (std::uint32_t l = 0; l < shape.layers; ++l)
    (void)each_allocation_fails(what + " write", [&] {
      return c.write(id, l, std::span<const float>(k), std::span<const float>(v));
    });
  before = contents(c, ids);
  (void)each_allocation_fails(what + " commit", [&] { return c.commit(id); }, same);
}

// One decode step of the whole batch through prepare, write_batch (device rows) and attend,
// each under each_allocation_fails. A failed attend writes nothing to `out`.
template <class C>
void batch_step(C& c, const std::vector<seq_id>& ids, std::uint32_t seed, const std::string& what) {
  for (seq_id id : ids) ASSERT_TRUE(c.reserve(id, 1).has_value());
  const std::size_t q_count = ids.size() * q_heads * shape.head_dim;
  auto k = upload(where, rows(ids.size(), seed));
  auto v = upload(where, rows(ids.size(), seed + 1));
  auto q = upload(where, std::vector<float>(q_count, 0.5f));
  const std::vector<float> sentinel(q_count, -7.0f);
  auto out = upload(where, sentinel);
  ASSERT_TRUE(k.has_value() && v.has_value() && q.has_value() && out.has_value());
  (void)each_allocation_fails(what + " prepare", [&] { return c.prepare(ids); });
  device_buffer ws;
  for (std::uint32_t l = 0; l < shape.layers; ++l) {
    (void)each_allocation_fails(what + " write_batch", [&] { return c.write_batch(l, k->data(), v->data()); });
    (void)each_allocation_fails(
        what + " attend", [&] { return c.attend(l, params(), q->data(), out->data(), ws); },
        [&] { return download(where, out->data(), q_count).value() == sentinel; });
    ASSERT_TRUE(copy_to_device(where, out->data(), sentinel.data(), q_count * sizeof(float)).has_value());
  }
  for (seq_id id : ids) ASSERT_TRUE(c.commit(id).has_value());
}

TEST(cuda_oom, contiguous_cache) {
  const refuse_device_allocations device;
  auto cache = each_allocation_fails("contiguous<cuda> create", [] {
    return contiguous_cache<cuda>::create({.shape = shape, .storage = format::f16, .max_sequences = 3, .capacity_tokens = 120});
  });
  ASSERT_TRUE(cache.has_value());
  contiguous_cache<cuda>& c = *cache;
  std::vector<seq_id> ids;
  auto before = contents(c, ids);
  auto same = [&] { return contents(c, ids) == before; };
  ids.push_back(each_allocation_fails("contiguous<cuda> sequence", [&] { return c.create(); }, same).value());
  step(c, ids, ids[0], 40, 1, "contiguous<cuda>");
  before = contents(c, ids);
  ids.push_back(each_allocation_fails("contiguous<cuda> fork", [&] { return c.fork(ids[0]); }, same).value());
  before = contents(c, ids);
  ids.push_back(each_allocation_fails("contiguous<cuda> copy_prefix", [&] { return c.copy_prefix(ids[0], 17); }, same).value());
  step(c, ids, ids[2], 5, 3, "contiguous<cuda>, copied");
  batch_step(c, ids, 5, "contiguous<cuda>");
}

TEST(cuda_oom, paged_cache_and_shared_pool) {
  const refuse_device_allocations device;
  auto pool = each_allocation_fails("block_pool<cuda> create", [] {
    return block_pool<cuda>::create({.shape = shape, .block_tokens = 16, .storage = format::f16, .budget_bytes = 1u << 20});
  });
  ASSERT_TRUE(pool.has_value());
  for (const bool shared : {false, true}) {
    const std::string what = shared ? "paged<cuda> (shared pool)" : "paged<cuda>";
    auto cache = each_allocation_fails(what + " create", [&] {
      paged_config<cuda> cfg{.shape = shape, .storage = format::f16, .block_tokens = 16, .budget_bytes = 1u << 20};
      if (shared) cfg.pool = *pool;
      return paged_cache<cuda>::create(cfg);
    });
    ASSERT_TRUE(cache.has_value());
    paged_cache<cuda>& c = *cache;
    std::vector<seq_id> ids;
    auto before = contents(c, ids);
    auto same = [&] { return contents(c, ids) == before; };
    ids.push_back(each_allocation_fails(what + " sequence", [&] { return c.create(); }, same).value());
    step(c, ids, ids[0], 70, 5, what);  // 5 blocks: the table grows
    before = contents(c, ids);
    ids.push_back(each_allocation_fails(what + " fork", [&] { return c.fork(ids[0]); }, same).value());
    step(c, ids, ids[1], 3, 9, what + ", forked");  // copy-on-write of the shared last block
    before = contents(c, ids);
    ids.push_back(each_allocation_fails(what + " copy_prefix", [&] { return c.copy_prefix(ids[0], 33); }, same).value());
    // Prefix reuse: a sequence reserved with token ids (its full blocks published at commit),
    // then one created from the same prompt, adopting three of them.
    std::vector<std::int32_t> prompt(50);
    for (std::size_t t = 0; t < prompt.size(); ++t) prompt[t] = static_cast<std::int32_t>(1000 + t);
    before = contents(c, ids);
    ids.push_back(each_allocation_fails(what + " sequence with ids", [&] { return c.create(); }, same).value());
    const std::vector<float> k = rows(prompt.size(), 21), v = rows(prompt.size(), 22);
    before = contents(c, ids);
    (void)each_allocation_fails(what + " reserve with ids", [&] { return c.reserve(ids.back(), prompt.size(), prompt); }, same);
    for (std::uint32_t l = 0; l < shape.layers; ++l)
      (void)each_allocation_fails(what + " write", [&] {
        return c.write(ids.back(), l, std::span<const float>(k), std::span<const float>(v));
      });
    before = contents(c, ids);
    (void)each_allocation_fails(what + " commit with ids", [&] { return c.commit(ids.back()); }, same);
    before = contents(c, ids);
    auto match = each_allocation_fails(what + " create_with_prefix", [&] { return c.create_with_prefix(prompt); }, same);
    ASSERT_TRUE(match.has_value());
    EXPECT_EQ(match->cached_tokens, 48u);
    ids.push_back(match->seq);
    (void)each_allocation_fails(what + " export_block_tables", [&] { return c.export_block_tables(ids); });
    before = contents(c, ids);
    (void)each_allocation_fails(what + " reserve_table", [&] { return c.reserve_table(40, 400); }, same);
    batch_step(c, ids, 23, what);
  }
}

TEST(cuda_oom, two_tier_cache) {
  const refuse_device_allocations device;
  auto cache = each_allocation_fails("two-tier<cuda> create", [] {
    return two_tier_cache<cuda>::create({.shape = shape, .tail_tokens = 32, .max_tokens = 256, .max_sequences = 3});
  });
  ASSERT_TRUE(cache.has_value());
  two_tier_cache<cuda>& c = *cache;
  std::vector<seq_id> ids;
  auto before = contents(c, ids);
  auto same = [&] { return contents(c, ids) == before; };
  ids.push_back(each_allocation_fails("two-tier<cuda> sequence", [&] { return c.create(); }, same).value());
  step(c, ids, ids[0], 50, 11, "two-tier<cuda>");   // tail pages
  step(c, ids, ids[0], 100, 13, "two-tier<cuda>");  // migration into store pages
  before = contents(c, ids);
  ids.push_back(each_allocation_fails("two-tier<cuda> second sequence", [&] { return c.create(); }, same).value());
  step(c, ids, ids[1], 40, 15, "two-tier<cuda>, second sequence");
  batch_step(c, ids, 17, "two-tier<cuda>");
}

}  // namespace

#else
TEST(cuda_oom, needs_exceptions) { GTEST_SKIP() << "injects std::bad_alloc: built without exceptions"; }
#endif
