#pragma once
// Allocation failure, injected (test_oom, test_cuda_oom_emulated): with tests/replaced_new.hpp
// every replaceable operator new asks kvcache_test_allocate, and the including binary's hook
// refuses when fail_now() says so: armed with k, the k-th allocation from then on fails (the
// throwing forms throw std::bad_alloc, the nothrow forms return null), once.
// each_allocation_fails(what, call, same) runs call() with k = 0, 1, 2, ... until a run no longer
// meets the failure: every run must return a value or errc::out_of_memory and throw nothing, and
// after a failed run same() must hold (the object unchanged).
#include <kvcache/config.hpp>
#include <kvcache/error.hpp>

#include <gtest/gtest.h>

#include <atomic>
#include <optional>
#include <string>
#include <utility>

#if KVCACHE_HAS_EXCEPTIONS

namespace kvcache_test {

inline std::atomic<long> g_countdown{-1};  // allocations to let through before the failing one; -1: none fails
inline std::atomic<bool> g_fired{false};   // the armed failure happened

/// Whether the allocation being made is the armed one (then disarms).
inline bool fail_now() noexcept {
  if (g_countdown.load(std::memory_order_relaxed) < 0) return false;
  if (g_countdown.fetch_sub(1, std::memory_order_relaxed) != 0) return false;
  g_countdown.store(-1, std::memory_order_relaxed);
  g_fired.store(true, std::memory_order_relaxed);
  return true;
}

/// Runs call() with the k-th allocation failing, k = 0, 1, ...: each run returns a value or
/// out_of_memory and throws nothing; after a failed run same() must hold. Returns the value of
/// the first run that met no failure.
template <class Call, class Same>
auto each_allocation_fails(const std::string& what, Call call, Same same) -> decltype(call()) {
  for (long k = 0; k < 100000; ++k) {
    std::optional<decltype(call())> r;
    g_fired.store(false);
    g_countdown.store(k);
    try {
      r.emplace(call());
    } catch (...) {
      g_countdown.store(-1);
      ADD_FAILURE() << what << ": an exception escaped with allocation " << k << " failing";
      return call();
    }
    g_countdown.store(-1);
    if (!g_fired.load()) {
      EXPECT_TRUE(r->has_value()) << what << ": " << r->error().message;
      return std::move(*r);
    }
    if (!r->has_value()) {
      EXPECT_EQ(r->error().code, kvcache::errc::out_of_memory) << what << ", allocation " << k << ": " << r->error().message;
      EXPECT_TRUE(same()) << what << ": changed by a call that failed (allocation " << k << ")";
    }
  }
  ADD_FAILURE() << what << ": never ran without meeting the failure";
  return call();
}

template <class Call>
auto each_allocation_fails(const std::string& what, Call call) {
  return each_allocation_fails(what, call, [] { return true; });
}

}  // namespace kvcache_test

#endif  // KVCACHE_HAS_EXCEPTIONS
