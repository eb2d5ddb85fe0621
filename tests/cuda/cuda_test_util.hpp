#pragma once
// Shared helpers of the CUDA tests: the device check, device vectors, random inputs, and the CPU
// references (scalar kernels, float64 attention).
#include "../test_seed.hpp"

#include <kvcache/cuda/contiguous_cache.hpp>  // cuda_attend_options
#include <kvcache/cuda/kernels.hpp>
#include <kvcache/cuda/runtime.hpp>
#include <kvcache/format.hpp>
#include <kvcache/half.hpp>
#include <kvcache/kernels.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

/// Skips the current test with "no CUDA device: <reason>" unless device 0 is usable.
#define KVCACHE_REQUIRE_CUDA()                                                     \
  do {                                                                             \
    const ::kvcache::result<void> kvcache_avail_ = ::kvcache::cuda_available(0);   \
    if (!kvcache_avail_.has_value())                                               \
      GTEST_SKIP() << "no CUDA device: " << kvcache_avail_.error().message;        \
  } while (false)

/// Asserts a result is ok, printing its error message otherwise.
#define KVCACHE_ASSERT_OK(expr)                                                    \
  do {                                                                             \
    const auto& kvcache_r_ = (expr);                                               \
    ASSERT_TRUE(kvcache_r_.has_value()) << kvcache_r_.error().message;             \
  } while (false)

namespace kvcache_cuda_test {

/// Loop counts of the decode-step tests: `device` on a GPU, `emulated` in the *_emulated builds
/// (tests/cuda.cmake), whose CPU emulation of warps runs a few thousand times slower.
constexpr int steps(int device, int emulated) {
#if defined(KVCACHE_CUDA_EMULATED)
  (void)device;
  return emulated;
#else
  (void)emulated;
  return device;
#endif
}

/// A device copy of a host vector (or zeroed storage), freed on destruction.
template <class T>
struct device_vector {
  kvcache::device_buffer buf;
  std::size_t count = 0;
  T* data() const { return static_cast<T*>(buf.data()); }
};

/// Uploads `host` (synchronously: the copy is complete on return).
template <class T>
kvcache::result<device_vector<T>> upload(const kvcache::cuda& where, const std::vector<T>& host) {
  device_vector<T> d;
  d.count = host.size();
  kvcache::result<kvcache::device_buffer> b = kvcache::device_buffer::make(where, std::max<std::size_t>(1, host.size()) * sizeof(T));
  KVCACHE_TRY(b);
  d.buf = std::move(b).value();
  if (!host.empty()) KVCACHE_TRY(kvcache::copy_to_device(where, d.data(), host.data(), host.size() * sizeof(T)));
  KVCACHE_TRY(kvcache::cuda_synchronize(where));
  return d;
}

/// Zero-filled device storage of n elements.
template <class T>
kvcache::result<device_vector<T>> zeros(const kvcache::cuda& where, std::size_t n) {
  return upload(where, std::vector<T>(n));
}

/// Downloads n elements (waits for the stream first and after).
template <class T>
kvcache::result<std::vector<T>> download(const kvcache::cuda& where, const T* dev, std::size_t n) {
  std::vector<T> h(n);
  KVCACHE_TRY(kvcache::cuda_synchronize(where));
  if (n != 0) KVCACHE_TRY(kvcache::copy_to_host(where, h.data(), dev, n * sizeof(T)));
  KVCACHE_TRY(kvcache::cuda_synchronize(where));
  return h;
}

/// Random source seeded freshly per test, or with KVCACHE_TEST_SEED's seed (every rng then takes
/// it: to replay a failure, whose trace() prints the seed).
struct rng {
  std::uint32_t seed = test_seed_or_fresh();
  std::mt19937 gen{seed};
  std::string trace() const { return seed_trace(seed); }
  float uniform(float lo = -1.0f, float hi = 1.0f) { return std::uniform_real_distribution<float>(lo, hi)(gen); }
  std::uint32_t between(std::uint32_t lo, std::uint32_t hi) {
    return std::uniform_int_distribution<std::uint32_t>(lo, hi)(gen);
  }
  std::vector<float> floats(std::size_t n, float lo = -1.0f, float hi = 1.0f) {
    std::vector<float> v(n);
    for (float& x : v) x = uniform(lo, hi);
    return v;
  }
  std::vector<kvcache::half> halves(std::size_t n, float lo = -1.0f, float hi = 1.0f) {
    std::vector<kvcache::half> v(n);
    for (kvcache::half& x : v) x = kvcache::to_half(uniform(lo, hi));
    return v;
  }
};

/// `tokens` rows of K or V for shape g ([tokens][kv_heads][head_dim] floats in [-1, 1)), the same
/// rows for the same seed: the emulated allocation tests' inputs, which must not vary between a
/// call and its retries.
inline std::vector<float> seeded_rows(const kvcache::geometry& g, std::size_t tokens, std::uint32_t seed) {
  rng r;
  r.gen.seed(seed);
  return r.floats(tokens * g.token_width());
}

/// attention_params of `q_heads` query heads over shape g, the rest at their defaults.
inline kvcache::attention_params params_of(const kvcache::geometry& g, std::uint32_t q_heads) {
  kvcache::attention_params p;
  p.q_heads = q_heads;
  p.kv_heads = g.kv_heads;
  p.head_dim = g.head_dim;
  return p;
}

/// Attend options of the cuda caches with `tokens` per split (0: automatic), the rest at their
/// defaults (brace-initialising the options names every field, or -Wextra objects).
inline kvcache::cuda_attend_options split_of(std::uint32_t tokens) {
  kvcache::cuda_attend_options o;
  o.split_tokens = tokens;
  return o;
}

/// The scalar CPU kernels: the oracle of every CUDA kernel.
inline const kvcache::kernels::table& scalar() { return *kvcache::kernels::find(kvcache::isa::scalar); }

/// Float64 reference of decode attention for one query head over decoded keys/values
/// k, v: [tokens][head_dim]. Returns [head_dim]; zeros for no token.
inline std::vector<double> reference_attention(const float* q, const std::vector<float>& k, const std::vector<float>& v,
                                               std::size_t tokens, std::size_t head_dim, double scale) {
  std::vector<double> out(head_dim, 0.0);
  if (tokens == 0) return out;
  std::vector<double> s(tokens);
  double mx = -INFINITY;
  for (std::size_t t = 0; t < tokens; ++t) {
    double acc = 0.0;
    for (std::size_t d = 0; d < head_dim; ++d) acc += static_cast<double>(q[d]) * k[t * head_dim + d];
    s[t] = acc * scale;
    mx = std::max(mx, s[t]);
  }
  double sum = 0.0;
  for (std::size_t t = 0; t < tokens; ++t) {
    s[t] = std::exp(s[t] - mx);
    sum += s[t];
  }
  for (std::size_t t = 0; t < tokens; ++t)
    for (std::size_t d = 0; d < head_dim; ++d) out[d] += s[t] / sum * v[t * head_dim + d];
  return out;
}

}  // namespace kvcache_cuda_test
