// Zero heap allocations per token: every form of the global operator new is replaced by a counting
// one, and the per-token protocol (reserve / write every layer / commit / view / length / stats,
// truncate) of contiguous_cache<cpu> must not call any of them after the sequences exist.
#include <kvcache/contiguous_cache.hpp>
#include <kvcache/isa.hpp>

#include <gtest/gtest.h>

#include "replaced_new.hpp"

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <random>
#include <string>
#include <vector>

namespace {
std::atomic<std::size_t> g_allocations{0};
}  // namespace

void* kvcache_test_allocate(std::size_t n, std::size_t align) noexcept {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  return kvcache_test::system_allocate(n, align);
}

namespace {

using kvcache::contiguous_cache;
using kvcache::contiguous_config;
using kvcache::cpu;
using kvcache::format;
using kvcache::geometry;
using kvcache::seq_id;

std::size_t allocations() { return g_allocations.load(std::memory_order_relaxed); }

// Stores pointers where the optimizer cannot see them, so new/delete pairs are not elided.
void* volatile g_sink = nullptr;
void sink(void* p) { g_sink = p; }

TEST(alloc_counter, counts_every_form) {
  // The counter must see the allocations it is meant to catch, or a zero below proves nothing.
  const std::size_t before = allocations();
  auto* a = new int(1);
  auto* b = new int[3];
  auto* c = new (std::nothrow) double(2.0);
  struct alignas(128) wide {
    char x[128];
  };
  auto* d = new wide;
  auto* e = new wide[2];
  auto* f = new (std::nothrow) wide;
  std::vector<float> g(17);
  for (void* p : {static_cast<void*>(a), static_cast<void*>(b), static_cast<void*>(c), static_cast<void*>(d),
                  static_cast<void*>(e), static_cast<void*>(f), static_cast<void*>(g.data())})
    sink(p);
  EXPECT_EQ(allocations() - before, 7u);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(d) % 128, 0u);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(e) % 128, 0u);
  delete a;
  delete[] b;
  delete c;
  delete d;
  delete[] e;
  delete f;
  // A cache's create() allocates its sequence storage: the counter sees that too.
  auto cache = contiguous_cache<cpu>::create(contiguous_config{geometry{2, 2, 8}, format::f16, 2, 16});
  ASSERT_TRUE(cache.has_value());
  const std::size_t before_create = allocations();
  ASSERT_TRUE(cache.value().create().has_value());
  EXPECT_GE(allocations() - before_create, 1u);
}

struct step_failures {
  std::size_t calls = 0;
  std::size_t failed = 0;
  void check(bool ok) {
    ++calls;
    if (!ok) ++failed;
  }
};

void run_token_loop(format storage) {
  const geometry g{4, 2, 40};
  constexpr std::size_t sequences = 4;
  constexpr std::size_t capacity = 640;
  auto made = contiguous_cache<cpu>::create(contiguous_config{g, storage, sequences, capacity});
  ASSERT_TRUE(made.has_value()) << made.error().message;
  contiguous_cache<cpu>& c = made.value();
  std::vector<seq_id> ids;
  for (std::size_t i = 0; i < sequences; ++i) ids.push_back(c.create().value());

  // Inputs for up to 8 tokens per step, prepared before counting.
  std::mt19937 gen(std::random_device{}());
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> k(8 * g.token_width()), v(8 * g.token_width());
  for (float& x : k) x = dist(gen);
  for (float& x : v) x = dist(gen);
  std::vector<kvcache::half> kh(8 * g.token_width()), vh(8 * g.token_width());
  for (std::size_t i = 0; i < kh.size(); ++i) {
    kh[i] = kvcache::to_half(k[i]);
    vh[i] = kvcache::to_half(v[i]);
  }

  step_failures f;
  std::size_t checksum = 0;
  const std::size_t before = allocations();
  for (std::size_t step = 0; step < 600; ++step) {
    const seq_id s = ids[step % sequences];
    const std::size_t n = step % 10 == 0 ? 8 : 1;  // a burst now and then, single tokens otherwise
    f.check(c.reserve(s, n).has_value());
    for (std::uint32_t l = 0; l < g.layers; ++l) {
      if (step % 3 == 0)
        f.check(c.write(s, l, std::span<const kvcache::half>(kh.data(), n * g.token_width()),
                        std::span<const kvcache::half>(vh.data(), n * g.token_width()))
                    .has_value());
      else
        f.check(c.write(s, l, std::span<const float>(k.data(), n * g.token_width()),
                        std::span<const float>(v.data(), n * g.token_width()))
                    .has_value());
    }
    f.check(c.commit(s).has_value());
    for (std::uint32_t l = 0; l < g.layers; ++l) {
      const auto lv = c.view(s, l);
      f.check(lv.has_value());
      if (lv.has_value()) checksum += lv.value().tokens;
    }
    const auto len = c.length(s);
    f.check(len.has_value());
    checksum += c.stats().tokens;
    // Speculative rollback: drop the last token of a burst.
    if (n == 8 && len.has_value()) f.check(c.truncate(s, len.value() - 1).has_value());
  }
  const std::size_t made_allocations = allocations() - before;
  EXPECT_EQ(made_allocations, 0u) << "heap allocations in the per-token path (" << kvcache::to_string(storage) << ")";
  EXPECT_EQ(f.failed, 0u) << "of " << f.calls << " calls";
  EXPECT_GT(checksum, 0u);
  std::size_t total = 0;
  for (seq_id s : ids) total += c.length(s).value();
  EXPECT_EQ(total, 540u + 60u * 7u);  // 540 single tokens + 60 bursts of 8, each minus 1
}

TEST(alloc, per_token_path_f32) { run_token_loop(format::f32); }
TEST(alloc, per_token_path_f16) { run_token_loop(format::f16); }

TEST(alloc, per_token_path_f16_every_isa) {
  const kvcache::isa original = kvcache::active_isa();
  for (kvcache::isa i : {kvcache::isa::scalar, kvcache::isa::avx2, kvcache::isa::avx512, kvcache::isa::neon}) {
    if (!kvcache::isa_supported(i)) continue;
    SCOPED_TRACE(std::string(kvcache::to_string(i)));
    ASSERT_TRUE(kvcache::force_isa(i).has_value());
    run_token_loop(format::f16);
  }
  ASSERT_TRUE(kvcache::force_isa(original).has_value());
}

}  // namespace
