#pragma once
/// @file llama2c_model.hpp
/// A llama2.c legacy checkpoint (e.g. /work/shared/data/stories260K.bin) and its forward pass with
/// a pluggable attention step, so the same model runs over any kvcache cache, or over a plain
/// float history (reference_attention) for tests. Example / test code, not part of the library.
///
/// File format (little-endian): 7 x int32 header {dim, hidden_dim, n_layers, n_heads, n_kv_heads,
/// vocab_size (negative: separate classifier), seq_len}, then float32 arrays token_embedding
/// [vocab][dim], rms_att [layers][dim], wq [layers][dim][dim], wk [layers][kv_dim][dim], wv
/// [layers][kv_dim][dim], wo [layers][dim][dim], rms_ffn [layers][dim], w1 [layers][hidden][dim],
/// w2 [layers][dim][hidden], w3 [layers][hidden][dim], rms_final [dim], two legacy RoPE tables
/// [seq_len][head_size/2] (skipped), then wcls [vocab][dim] only when vocab_size < 0.

#include <kvcache/error.hpp>
#include <kvcache/half.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace llama2c {

/// Model hyper-parameters from the checkpoint header.
struct config {
  std::uint32_t dim = 0;         ///< residual width
  std::uint32_t hidden_dim = 0;  ///< FFN width
  std::uint32_t layers = 0;
  std::uint32_t heads = 0;     ///< query heads
  std::uint32_t kv_heads = 0;  ///< key/value heads (grouped-query attention)
  std::uint32_t vocab = 0;
  std::uint32_t seq_len = 0;   ///< trained context length
  bool shared_classifier = true;

  [[nodiscard]] std::uint32_t head_size() const { return dim / heads; }
  [[nodiscard]] std::uint32_t kv_dim() const { return kv_heads * head_size(); }
};

/// Weights: one float buffer and offsets into it. Row-major matrices, W x with W [out][in].
struct model {
  config cfg;
  std::vector<float> data;
  const float* token_embedding = nullptr;  // [vocab][dim]
  const float* rms_att = nullptr;          // [layers][dim]
  const float* wq = nullptr;               // [layers][dim][dim]
  const float* wk = nullptr;               // [layers][kv_dim][dim]
  const float* wv = nullptr;               // [layers][kv_dim][dim]
  const float* wo = nullptr;               // [layers][dim][dim]
  const float* rms_ffn = nullptr;          // [layers][dim]
  const float* w1 = nullptr;               // [layers][hidden][dim]
  const float* w2 = nullptr;               // [layers][dim][hidden]
  const float* w3 = nullptr;               // [layers][hidden][dim]
  const float* rms_final = nullptr;        // [dim]
  const float* wcls = nullptr;             // [vocab][dim]

  model() = default;
  model(const model&) = delete;  // pointers alias `data`
  model& operator=(const model&) = delete;
  model(model&& o) noexcept { *this = std::move(o); }
  model& operator=(model&& o) noexcept {
    const float* old = o.data.data();
    cfg = o.cfg;
    data = std::move(o.data);
    const float* base = data.data();
    auto rebase = [&](const float* p) { return p == nullptr ? nullptr : base + (p - old); };
    token_embedding = rebase(o.token_embedding);
    rms_att = rebase(o.rms_att);
    wq = rebase(o.wq);
    wk = rebase(o.wk);
    wv = rebase(o.wv);
    wo = rebase(o.wo);
    rms_ffn = rebase(o.rms_ffn);
    w1 = rebase(o.w1);
    w2 = rebase(o.w2);
    w3 = rebase(o.w3);
    rms_final = rebase(o.rms_final);
    wcls = rebase(o.wcls);
    return *this;
  }
};

/// Parses a checkpoint held in memory. errc::invalid_argument naming the offending field for a
/// truncated file, a non-positive or inconsistent header, or trailing bytes.
[[nodiscard]] inline kvcache::result<model> parse(std::span<const std::byte> file) {
  using kvcache::errc;
  using kvcache::fail;
  std::int32_t h[7];
  if (file.size() < sizeof h)
    return fail(errc::invalid_argument, "llama2c: file shorter than its 28-byte header",
                {{"bytes", static_cast<long long>(file.size())}});
  std::memcpy(h, file.data(), sizeof h);
  const char* names[7] = {"dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len"};
  for (int i = 0; i < 7; ++i) {
    const long long v = i == 5 ? std::llabs(static_cast<long long>(h[i])) : h[i];
    if (v <= 0 || v > (1 << 20))
      return fail(errc::invalid_argument, std::string("llama2c: header field ") + names[i] + " out of range",
                  {{names[i], h[i]}});
  }
  model m;
  config& c = m.cfg;
  c.dim = static_cast<std::uint32_t>(h[0]);
  c.hidden_dim = static_cast<std::uint32_t>(h[1]);
  c.layers = static_cast<std::uint32_t>(h[2]);
  c.heads = static_cast<std::uint32_t>(h[3]);
  c.kv_heads = static_cast<std::uint32_t>(h[4]);
  c.shared_classifier = h[5] > 0;
  c.vocab = static_cast<std::uint32_t>(h[5] > 0 ? h[5] : -h[5]);
  c.seq_len = static_cast<std::uint32_t>(h[6]);
  if (c.dim % c.heads != 0 || c.head_size() % 2 != 0)
    return fail(errc::invalid_argument, "llama2c: dim must split into heads of an even size",
                {{"dim", c.dim}, {"n_heads", c.heads}});
  if (c.heads % c.kv_heads != 0)
    return fail(errc::invalid_argument, "llama2c: n_heads is not a multiple of n_kv_heads",
                {{"n_heads", c.heads}, {"n_kv_heads", c.kv_heads}});

  const std::size_t d = c.dim, hd = c.hidden_dim, L = c.layers, kv = c.kv_dim(), V = c.vocab;
  const std::size_t sizes[] = {V * d,  L * d,      L * d * d, L * kv * d, L * kv * d,  L * d * d, L * d,
                               L * hd * d, L * d * hd, L * hd * d, d, static_cast<std::size_t>(c.seq_len) * c.head_size(),
                               c.shared_classifier ? 0 : V * d};
  std::size_t total = 0;
  for (std::size_t s : sizes) total += s;  // each factor <= 2^20, at most 3 factors: no overflow
  const std::size_t expected = sizeof h + total * sizeof(float);
  if (file.size() != expected)
    return fail(errc::invalid_argument, "llama2c: file size does not match its header",
                {{"expected_bytes", static_cast<long long>(expected)}, {"bytes", static_cast<long long>(file.size())}});
  m.data.resize(total);
  std::memcpy(m.data.data(), file.data() + sizeof h, total * sizeof(float));
  const float* p = m.data.data();
  const float** fields[] = {&m.token_embedding, &m.rms_att, &m.wq, &m.wk, &m.wv, &m.wo, &m.rms_ffn,
                            &m.w1, &m.w2, &m.w3, &m.rms_final};
  for (std::size_t i = 0; i < std::size(fields); ++i) {
    *fields[i] = p;
    p += sizes[i];
  }
  p += sizes[11];  // legacy RoPE tables
  m.wcls = c.shared_classifier ? m.token_embedding : p;
  return m;
}

/// Reads and parses a checkpoint file. errc::invalid_argument if it cannot be read, else as parse().
[[nodiscard]] inline kvcache::result<model> load(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return kvcache::unexpected(kvcache::errc::invalid_argument, "llama2c: cannot open '" + path + "'");
  std::vector<std::byte> bytes;
  std::byte buf[1 << 16];
  for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) bytes.insert(bytes.end(), buf, buf + n);
  const bool bad = std::ferror(f) != 0;
  std::fclose(f);
  if (bad) return kvcache::unexpected(kvcache::errc::invalid_argument, "llama2c: read error on '" + path + "'");
  return parse(bytes);
}

/// Activations of one forward step (reused across steps: no allocation per token).
struct run_state {
  std::vector<float> x, xb, xb2, hb, hb2;  // [dim], [dim], [dim], [hidden], [hidden]
  std::vector<float> q;                    // [heads][head_size]
  std::vector<float> k, v;                 // [kv_heads][head_size] of the current token
  std::vector<float> att;                  // [heads][head_size] attention output
  std::vector<float> logits;               // [vocab]

  explicit run_state(const config& c)
      : x(c.dim), xb(c.dim), xb2(c.dim), hb(c.hidden_dim), hb2(c.hidden_dim), q(c.dim), k(c.kv_dim()),
        v(c.kv_dim()), att(c.dim), logits(c.vocab) {}
};

namespace detail {
inline void rmsnorm(float* o, const float* x, const float* w, std::size_t n) {
  float ss = 0.0f;
  for (std::size_t i = 0; i < n; ++i) ss += x[i] * x[i];
  ss = 1.0f / std::sqrt(ss / static_cast<float>(n) + 1e-5f);
  for (std::size_t i = 0; i < n; ++i) o[i] = w[i] * (ss * x[i]);
}
// o[r] = sum_c w[r][c] x[c]. // w [rows][cols]
inline void matmul(float* o, const float* x, const float* w, std::size_t rows, std::size_t cols) {
  for (std::size_t r = 0; r < rows; ++r) {
    float acc = 0.0f;
    for (std::size_t c = 0; c < cols; ++c) acc += w[r * cols + c] * x[c];
    o[r] = acc;
  }
}
// RoPE over adjacent pairs of each head: theta = pos / 10000^(2i / head_size).
inline void rope(float* x, std::size_t heads, std::size_t head_size, std::size_t pos) {
  for (std::size_t h = 0; h < heads; ++h)
    for (std::size_t i = 0; i < head_size; i += 2) {
      const float freq = 1.0f / std::pow(10000.0f, static_cast<float>(i) / static_cast<float>(head_size));
      const float a = static_cast<float>(pos) * freq;
      const float c = std::cos(a), s = std::sin(a);
      float* p = x + h * head_size + i;
      const float x0 = p[0], x1 = p[1];
      p[0] = x0 * c - x1 * s;
      p[1] = x0 * s + x1 * c;
    }
}
}  // namespace detail

/// What a forward step asks of its attention: for `layer` at position `pos`, given the query
/// [heads][head_size] and the current token's key and value [kv_heads][head_size] (after RoPE),
/// store k/v as needed and write the attention output [heads][head_size] over positions 0..pos
/// (the current token included), scores scaled by 1/sqrt(head_size).
/// Signature: void(std::uint32_t layer, std::size_t pos, std::span<const float> q,
///                 std::span<const float> k, std::span<const float> v, std::span<float> out).
///
/// Runs one token through the model; returns the logits [vocab] (in s.logits).
template <class Attention>
std::span<const float> forward(const model& m, run_state& s, std::uint32_t token, std::size_t pos,
                               Attention&& attention) {
  const config& c = m.cfg;
  const std::size_t dim = c.dim, hd = c.hidden_dim, kv = c.kv_dim(), hs = c.head_size();
  std::memcpy(s.x.data(), m.token_embedding + static_cast<std::size_t>(token) * dim, dim * sizeof(float));
  for (std::uint32_t l = 0; l < c.layers; ++l) {
    detail::rmsnorm(s.xb.data(), s.x.data(), m.rms_att + l * dim, dim);
    detail::matmul(s.q.data(), s.xb.data(), m.wq + l * dim * dim, dim, dim);
    detail::matmul(s.k.data(), s.xb.data(), m.wk + l * kv * dim, kv, dim);
    detail::matmul(s.v.data(), s.xb.data(), m.wv + l * kv * dim, kv, dim);
    detail::rope(s.q.data(), c.heads, hs, pos);
    detail::rope(s.k.data(), c.kv_heads, hs, pos);
    attention(l, pos, std::span<const float>(s.q), std::span<const float>(s.k), std::span<const float>(s.v),
              std::span<float>(s.att));
    detail::matmul(s.xb2.data(), s.att.data(), m.wo + l * dim * dim, dim, dim);
    for (std::size_t i = 0; i < dim; ++i) s.x[i] += s.xb2[i];
    detail::rmsnorm(s.xb.data(), s.x.data(), m.rms_ffn + l * dim, dim);
    detail::matmul(s.hb.data(), s.xb.data(), m.w1 + l * hd * dim, hd, dim);
    detail::matmul(s.hb2.data(), s.xb.data(), m.w3 + l * hd * dim, hd, dim);
    for (std::size_t i = 0; i < hd; ++i) {
      const float a = s.hb[i];
      s.hb[i] = a / (1.0f + std::exp(-a)) * s.hb2[i];
    }
    detail::matmul(s.xb.data(), s.hb.data(), m.w2 + l * dim * hd, dim, hd);
    for (std::size_t i = 0; i < dim; ++i) s.x[i] += s.xb[i];
  }
  detail::rmsnorm(s.x.data(), s.x.data(), m.rms_final, dim);
  detail::matmul(s.logits.data(), s.x.data(), m.wcls, c.vocab, dim);
  return s.logits;
}

/// Reference attention without a cache: keeps every key and value in float (rounded to FP16
/// first when `f16_storage`, as an f16 cache holds them) and computes attention in float64. Also
/// the way to capture real K/V activations: keys(layer) is [pos][kv_heads][head_size]
/// (post-RoPE), values(layer) likewise.
class reference_attention {
 public:
  explicit reference_attention(const config& c, bool f16_storage = false)
      : c_(c), f16_(f16_storage), k_(c.layers), v_(c.layers) {}

  void operator()(std::uint32_t layer, std::size_t pos, std::span<const float> q, std::span<const float> k,
                  std::span<const float> v, std::span<float> out) {
    const std::size_t kv = c_.kv_dim(), hs = c_.head_size(), group = c_.heads / c_.kv_heads;
    std::vector<float>& K = k_[layer];
    std::vector<float>& V = v_[layer];
    K.resize(pos * kv);  // rewinds on a restart at an earlier position
    V.resize(pos * kv);
    K.insert(K.end(), k.begin(), k.end());
    V.insert(V.end(), v.begin(), v.end());
    if (f16_)
      for (std::size_t i = pos * kv; i < K.size(); ++i) {
        K[i] = kvcache::to_float(kvcache::to_half(K[i]));
        V[i] = kvcache::to_float(kvcache::to_half(V[i]));
      }
    const std::size_t n = pos + 1;
    scores_.resize(n);
    const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
    for (std::size_t h = 0; h < c_.heads; ++h) {
      const std::size_t kh = h / group;
      double mx = -std::numeric_limits<double>::infinity();
      for (std::size_t t = 0; t < n; ++t) {
        double dot = 0.0;
        for (std::size_t i = 0; i < hs; ++i) dot += static_cast<double>(q[h * hs + i]) * K[t * kv + kh * hs + i];
        scores_[t] = dot * scale;
        mx = std::max(mx, scores_[t]);
      }
      double sum = 0.0;
      for (std::size_t t = 0; t < n; ++t) sum += (scores_[t] = std::exp(scores_[t] - mx));
      for (std::size_t i = 0; i < hs; ++i) {
        double acc = 0.0;
        for (std::size_t t = 0; t < n; ++t) acc += scores_[t] * V[t * kv + kh * hs + i];
        out[h * hs + i] = static_cast<float>(acc / sum);
      }
    }
  }

  /// Keys stored so far for `layer`: [pos][kv_heads][head_size].
  [[nodiscard]] const std::vector<float>& keys(std::uint32_t layer) const { return k_[layer]; }
  /// Values stored so far for `layer`: [pos][kv_heads][head_size].
  [[nodiscard]] const std::vector<float>& values(std::uint32_t layer) const { return v_[layer]; }

 private:
  config c_;
  bool f16_;
  std::vector<std::vector<float>> k_, v_;  // [layer][pos][kv_heads][head_size]
  std::vector<double> scores_;
};

/// Index of the largest logit (first on ties).
[[nodiscard]] inline std::uint32_t argmax(std::span<const float> logits) {
  std::size_t best = 0;
  for (std::size_t i = 1; i < logits.size(); ++i)
    if (logits[i] > logits[best]) best = i;
  return static_cast<std::uint32_t>(best);
}

}  // namespace llama2c
