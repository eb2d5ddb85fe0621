#pragma once
// The seed of the tests' random sources (cache_suite.hpp's random_source, tests/cuda's rng):
// KVCACHE_TEST_SEED's where it is set, to replay a failure, else a fresh one each run.
#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>

inline std::uint32_t test_seed_or_fresh() {
  if (const char* s = std::getenv("KVCACHE_TEST_SEED")) return static_cast<std::uint32_t>(std::strtoul(s, nullptr, 10));
  return std::random_device{}();
}

/// What a failure prints: the seed, and how to replay it.
inline std::string seed_trace(std::uint32_t seed) {
  return "random seed " + std::to_string(seed) + " (KVCACHE_TEST_SEED=" + std::to_string(seed) + ")";
}
