#pragma once
/// @file llama2c_decode.hpp
/// Greedy decoding of a llama2.c model (llama2c_model.hpp) from BOS over any kvcache cache, or
/// without a cache (reference_attention), for examples/llama2c.cpp and tests/test_llama2c.cpp.

#include "cache_step.hpp"
#include "llama2c_model.hpp"

#include <kvcache/cache.hpp>
#include <kvcache/error.hpp>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace llama2c {

/// The llama2.c BOS token.
inline constexpr std::uint32_t bos = 1;

/// What a decode produced: the greedy token after each step, and every step's logits.
struct decode_result {
  std::vector<std::uint32_t> tokens;  // [step]: argmax of that step's logits
  std::vector<float> logits;          // [step][vocab]
};

namespace detail {
template <class Step>
decode_result decode_with(const model& m, std::size_t steps, std::span<const std::uint32_t> forced, Step&& step) {
  decode_result r;
  run_state s(m.cfg);
  std::uint32_t token = bos;
  for (std::size_t pos = 0; pos < steps; ++pos) {
    const std::span<const float> logits = step(s, token, pos);
    if (logits.empty()) break;  // the step failed; the caller reports why
    r.tokens.push_back(argmax(logits));
    r.logits.insert(r.logits.end(), logits.begin(), logits.end());
    token = pos < forced.size() ? forced[pos] : r.tokens.back();
  }
  return r;
}
}  // namespace detail

/// Decodes `steps` tokens from BOS without a cache (float64 attention over the float history,
/// FP16-rounded when `f16_storage`). The input after step t is forced[t] when given (teacher
/// forcing), else the greedy token.
inline decode_result decode_reference(const model& m, std::size_t steps, std::span<const std::uint32_t> forced = {},
                                      bool f16_storage = false) {
  reference_attention ref(m.cfg, f16_storage);
  return detail::decode_with(m, steps, forced, [&](run_state& s, std::uint32_t token, std::size_t pos) {
    return forward(m, s, token, pos, ref);
  });
}

/// Decodes `steps` tokens from BOS as one sequence of `cache`, attention by kvcache::attend.
/// `pending`: the format the cache holds new tokens in (see cache_step.hpp). Inputs as
/// decode_reference. Errors: the cache's (create, reserve, write, view) or attend's.
template <kvcache::Cache C>
kvcache::result<decode_result> decode(const model& m, C& cache, kvcache::format pending, std::size_t steps,
                                      std::span<const std::uint32_t> forced = {}, unsigned threads = 1) {
  const kvcache::result<kvcache::seq_id> seq = cache.create();
  KVCACHE_TRY(seq);
  examples::cache_attention<C> att(cache, m.cfg.heads, pending, threads);
  att.set_sequences(std::span(&seq.value(), 1));
  kvcache::result<void> failed{};
  auto step = [&](run_state& s, std::uint32_t token, std::size_t pos) -> std::span<const float> {
    if (auto r = att.begin_step(); !r) return failed = std::move(r), std::span<const float>{};
    std::span<const float> logits = forward(m, s, token, pos,
        [&](std::uint32_t layer, std::size_t, std::span<const float> q, std::span<const float> k,
            std::span<const float> v, std::span<float> out) { att(layer, q, k, v, out); });
    if (auto r = att.end_step(); !r) return failed = std::move(r), std::span<const float>{};
    return logits;
  };
  decode_result r = detail::decode_with(m, steps, forced, step);
  KVCACHE_TRY(failed);
  KVCACHE_TRY(cache.release(seq.value()));
  return r;
}

}  // namespace llama2c
