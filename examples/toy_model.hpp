#pragma once
/// @file toy_model.hpp
/// A small LLaMA-style decoder with fixed-seed random weights, batched over sequences, with a
/// pluggable attention step: what decode_loop runs over each cache, and what tests/test_examples
/// drives to check the cached attention against attention recomputed without a cache.
/// Per layer: RMSNorm, q/k/v projections, RoPE, grouped-query attention (the plug), output
/// projection, residual, RMSNorm, SiLU FFN, residual; then RMSNorm and the classifier.

#include "llama2c_model.hpp"  // rmsnorm, matmul, rope

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <span>
#include <vector>

namespace toy {

/// Shape of the toy model. dim = q_heads * head_dim.
struct config {
  std::uint32_t layers = 4;
  std::uint32_t q_heads = 4;
  std::uint32_t kv_heads = 2;
  std::uint32_t head_dim = 64;
  std::uint32_t hidden = 512;
  std::uint32_t vocab = 512;
  std::uint64_t seed = 42;

  [[nodiscard]] std::uint32_t dim() const { return q_heads * head_dim; }
  [[nodiscard]] std::uint32_t kv_dim() const { return kv_heads * head_dim; }
};

/// Weights, N(0, 1/fan_in) so activations stay O(1). W x with W [out][in].
struct model {
  config cfg;
  std::vector<float> embed;  // [vocab][dim]
  std::vector<float> wq;     // [layers][dim][dim]
  std::vector<float> wk;     // [layers][kv_dim][dim]
  std::vector<float> wv;     // [layers][kv_dim][dim]
  std::vector<float> wo;     // [layers][dim][dim]
  std::vector<float> w1;     // [layers][hidden][dim]
  std::vector<float> w2;     // [layers][dim][hidden]
  std::vector<float> wcls;   // [vocab][dim]
  std::vector<float> norm;   // [dim] of ones (RMSNorm weights)

  /// The model of cfg.seed.
  static model random(const config& c) {
    model m;
    m.cfg = c;
    std::mt19937_64 rng(c.seed);
    auto fill = [&](std::vector<float>& w, std::size_t n, std::size_t fan_in) {
      std::normal_distribution<float> nd(0.0f, 1.0f / std::sqrt(static_cast<float>(fan_in)));
      w.resize(n);
      for (float& x : w) x = nd(rng);
    };
    const std::size_t d = c.dim(), kv = c.kv_dim(), h = c.hidden, L = c.layers;
    fill(m.embed, static_cast<std::size_t>(c.vocab) * d, 1);
    fill(m.wq, L * d * d, d);
    // Keys a little larger than queries: sharper attention, like trained models.
    fill(m.wk, L * kv * d, d / 4);
    fill(m.wv, L * kv * d, d);
    fill(m.wo, L * d * d, d);
    fill(m.w1, L * h * d, d);
    fill(m.w2, L * d * h, h);
    fill(m.wcls, static_cast<std::size_t>(c.vocab) * d, d);
    m.norm.assign(d, 1.0f);
    return m;
  }
};

/// Activations of one batched step. // every buffer [batch][width]
struct batch_state {
  std::size_t batch;
  std::vector<float> x, xb, xb2, q, k, v, att, hb, logits;
  batch_state(const config& c, std::size_t b)
      : batch(b), x(b * c.dim()), xb(b * c.dim()), xb2(b * c.dim()), q(b * c.dim()), k(b * c.kv_dim()),
        v(b * c.kv_dim()), att(b * c.dim()), hb(b * c.hidden), logits(b * c.vocab) {}
};

/// One decode step for a batch: tokens[i] at positions[i] of sequence row i. `attention(layer,
/// q, k, v, out)` gets q [batch][q_heads][head_dim], the new k and v [batch][kv_heads][head_dim]
/// (after RoPE) and writes out [batch][q_heads][head_dim]. Logits land in s.logits
/// ([batch][vocab]).
template <class Attention>
void forward(const model& m, batch_state& s, std::span<const std::uint32_t> tokens,
             std::span<const std::size_t> positions, Attention&& attention) {
  namespace d = llama2c::detail;
  const config& c = m.cfg;
  const std::size_t dim = c.dim(), kv = c.kv_dim(), hid = c.hidden, B = s.batch;
  for (std::size_t b = 0; b < B; ++b)
    std::copy_n(m.embed.data() + tokens[b] * dim, dim, s.x.data() + b * dim);
  for (std::uint32_t l = 0; l < c.layers; ++l) {
    for (std::size_t b = 0; b < B; ++b) {
      d::rmsnorm(s.xb.data() + b * dim, s.x.data() + b * dim, m.norm.data(), dim);
      d::matmul(s.q.data() + b * dim, s.xb.data() + b * dim, m.wq.data() + l * dim * dim, dim, dim);
      d::matmul(s.k.data() + b * kv, s.xb.data() + b * dim, m.wk.data() + l * kv * dim, kv, dim);
      d::matmul(s.v.data() + b * kv, s.xb.data() + b * dim, m.wv.data() + l * kv * dim, kv, dim);
      d::rope(s.q.data() + b * dim, c.q_heads, c.head_dim, positions[b]);
      d::rope(s.k.data() + b * kv, c.kv_heads, c.head_dim, positions[b]);
    }
    attention(l, std::span<const float>(s.q), std::span<const float>(s.k), std::span<const float>(s.v),
              std::span<float>(s.att));
    for (std::size_t b = 0; b < B; ++b) {
      float* x = s.x.data() + b * dim;
      d::matmul(s.xb2.data() + b * dim, s.att.data() + b * dim, m.wo.data() + l * dim * dim, dim, dim);
      for (std::size_t i = 0; i < dim; ++i) x[i] += s.xb2[b * dim + i];
      d::rmsnorm(s.xb.data() + b * dim, x, m.norm.data(), dim);
      float* hb = s.hb.data() + b * hid;
      d::matmul(hb, s.xb.data() + b * dim, m.w1.data() + l * hid * dim, hid, dim);
      for (std::size_t i = 0; i < hid; ++i) hb[i] = hb[i] / (1.0f + std::exp(-hb[i]));
      d::matmul(s.xb2.data() + b * dim, hb, m.w2.data() + l * dim * hid, dim, hid);
      for (std::size_t i = 0; i < dim; ++i) x[i] += s.xb2[b * dim + i];
    }
  }
  for (std::size_t b = 0; b < B; ++b) {
    d::rmsnorm(s.xb.data() + b * dim, s.x.data() + b * dim, m.norm.data(), dim);
    d::matmul(s.logits.data() + b * c.vocab, s.xb.data() + b * dim, m.wcls.data(), c.vocab, dim);
  }
}

}  // namespace toy
