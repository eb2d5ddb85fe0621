#pragma once
/// @file cache_step.hpp
/// The attention step of a decoder over any kvcache::Cache, for the examples and their tests:
/// per step, reserve one token for every sequence of a batch; per layer, write the new keys and
/// values and run kvcache::attend over each sequence's committed tokens plus the new token;
/// after the last layer, commit. Example code, not part of the library.
///
/// The new token is not visible in view() until commit, yet the layer's attention must include
/// it, so its K/V join the view as one extra chunk, stored in the cache's format (f16 for f16 and
/// two-tier tails, f32 for f32 caches): attention sees exactly the values the cache will hold.

#include <kvcache/attend.hpp>
#include <kvcache/cache.hpp>
#include <kvcache/error.hpp>
#include <kvcache/format.hpp>
#include <kvcache/half.hpp>
#include <kvcache/view.hpp>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <utility>
#include <vector>

namespace examples {

/// Decode attention over cache `C` for a batch of sequences, one token per step.
template <kvcache::Cache C>
class cache_attention {
 public:
  /// `pending` is the format the new token's K/V are held in for this step's attention (the
  /// format the cache stores recent tokens in: f32 or f16). `threads`: attend's thread count.
  cache_attention(C& cache, std::uint32_t q_heads, kvcache::format pending, unsigned threads = 1)
      : cache_(cache), pending_(pending) {
    const kvcache::geometry g = cache.shape();
    params_.q_heads = q_heads;
    params_.kv_heads = g.kv_heads;
    params_.head_dim = g.head_dim;
    params_.threads = threads;
  }

  /// The sequences of the batch, in the order of the batch rows.
  void set_sequences(std::span<const kvcache::seq_id> seqs) {
    seqs_.assign(seqs.begin(), seqs.end());
    const std::size_t width = cache_.shape().token_width();
    chunks_.resize(seqs_.size());
    views_.resize(seqs_.size());
    pending_k_.resize(seqs_.size() * width * 2);  // [sequence][kv_head][head_dim], f32 or f16 bits
    pending_v_.resize(seqs_.size() * width * 2);
  }

  /// Reserves one token for every sequence. On failure (cache full) the sequences before the
  /// failing one keep their reservation: the examples stop there.
  [[nodiscard]] kvcache::result<void> begin_step() {
    for (kvcache::seq_id s : seqs_) KVCACHE_TRY(cache_.reserve(s, 1));
    error_.reset();
    return {};
  }

  /// Commits the step's token of every sequence; reports the first error of the step's layers.
  [[nodiscard]] kvcache::result<void> end_step() {
    if (error_) return kvcache::unexpected(*error_);
    for (kvcache::seq_id s : seqs_) KVCACHE_TRY(cache_.commit(s));
    return {};
  }

  /// The attention of one layer for the whole batch (the toy and llama2c models call this):
  /// q [batch][q_heads][head_dim], k and v [batch][kv_heads][head_dim] of the new token,
  /// out [batch][q_heads][head_dim]. An error is kept for end_step().
  void operator()(std::uint32_t layer, std::span<const float> q, std::span<const float> k,
                  std::span<const float> v, std::span<float> out) {
    if (error_) return;
    if (auto r = run(layer, q, k, v, out); !r.has_value()) error_ = std::move(r).error();
  }

  /// Settings passed to attend (threads, pool hook).
  kvcache::attention_params& params() { return params_; }

 private:
  kvcache::result<void> run(std::uint32_t layer, std::span<const float> q, std::span<const float> k,
                            std::span<const float> v, std::span<float> out) {
    const kvcache::geometry g = cache_.shape();
    const std::size_t width = g.token_width();
    const std::size_t elem = pending_ == kvcache::format::f32 ? 4 : 2;
    for (std::size_t i = 0; i < seqs_.size(); ++i) {
      const auto ki = k.subspan(i * width, width), vi = v.subspan(i * width, width);
      KVCACHE_TRY(cache_.write(seqs_[i], layer, ki, vi));
      const kvcache::result<kvcache::layer_view> view = cache_.view(seqs_[i], layer);
      KVCACHE_TRY(view);
      std::vector<kvcache::chunk>& cs = chunks_[i];
      cs.assign(view->begin(), view->end());
      std::byte* pk = reinterpret_cast<std::byte*>(pending_k_.data() + i * width * 2);
      std::byte* pv = reinterpret_cast<std::byte*>(pending_v_.data() + i * width * 2);
      for (std::size_t e = 0; e < width; ++e) store(pk, e, ki[e]), store(pv, e, vi[e]);
      cs.push_back(kvcache::chunk{pk, pv, g.head_dim * elem, g.head_dim * elem, 1, pending_, pending_});
      views_[i] = kvcache::layer_view{cs.data(), static_cast<std::uint32_t>(cs.size()), view->tokens + 1};
    }
    return kvcache::attend(params_, views_, q, out, ws_);
  }

  void store(std::byte* base, std::size_t e, float x) const {
    if (pending_ == kvcache::format::f32) reinterpret_cast<float*>(base)[e] = x;
    else reinterpret_cast<kvcache::half*>(base)[e] = kvcache::to_half(x);
  }

  C& cache_;
  kvcache::format pending_;
  kvcache::attention_params params_{};
  kvcache::attention_workspace ws_;
  std::vector<kvcache::seq_id> seqs_;
  std::vector<std::vector<kvcache::chunk>> chunks_;  // [sequence][chunk], reused across steps
  std::vector<kvcache::layer_view> views_;           // [sequence]
  std::vector<float> pending_k_, pending_v_;         // [sequence][kv_head][head_dim] (f32 or f16)
  std::optional<kvcache::error> error_;
};

}  // namespace examples
