// Accuracy of decode attention over a two-tier cache, measured against a float64 reference with
// no quantization, as relative L2 error of the attention output:
//   err = sqrt(sum ||o - o_ref||^2) / sqrt(sum ||o_ref||^2)   over query heads, layers, queries.
// (a) synthetic keys with strong outlier channels (a few channels 10-50x the median magnitude,
//     scaled before RoPE, RoPE applied after, as real models show);
// (b) the real activations of stories260K (../shared/data), run through its forward pass.
// Every configuration is also run with the keys of the store quantized per token instead of per
// channel (the quantize_values kernel applied to keys: the same 4 bits and group size), to show
// what per-channel grouping buys. Both are printed as a table and bounded.
//
// The attention under test is a float implementation reading the cache's views chunk by chunk
// (each chunk dequantized by the scalar reference kernels, in its own format); the reference is
// double precision over the keys and values exactly as the model produced them.
#include <kvcache/kernels.hpp>
#include <kvcache/two_tier_cache.hpp>

#include "../examples/llama2c_model.hpp"
#include "shared_model.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace {

using kvcache::chunk;
using kvcache::cpu;
using kvcache::format;
using kvcache::geometry;
using kvcache::half;
using kvcache::layer_view;
using kvcache::seq_id;
using cache_t = kvcache::two_tier_cache<cpu>;

const kvcache::kernels::table& scalar() { return *kvcache::kernels::find(kvcache::isa::scalar); }

/// A cache configuration under test.
struct setup {
  format k = format::q4;
  format v = format::q4;
  std::uint32_t tail = 128;
  std::string name() const {
    return "K " + std::string(kvcache::to_string(k)) + " / V " + std::string(kvcache::to_string(v)) + ", tail " +
           std::to_string(tail);
  }
};

const std::vector<setup> setups = {
    {format::q4, format::q4, 0},    {format::q4, format::q4, 128},  {format::f16, format::q4, 0},
    {format::f16, format::q4, 128}, {format::q4, format::f16, 0},   {format::q4, format::f16, 128},
    {format::f16, format::f16, 0},  // control: FP16 rounding only, proves the measurement itself
};

cache_t make_cache(const geometry& g, const setup& s) {
  kvcache::two_tier_config cfg;
  cfg.shape = g;
  cfg.tail_tokens = s.tail;
  cfg.key_format = s.k;
  cfg.value_format = s.v;
  auto c = cache_t::create(cfg);
  EXPECT_TRUE(c.has_value()) << c.error().message;
  return std::move(c).value();
}

/// Keys and values of one layer of one head as floats: [token][head_dim].
struct head_kv {
  std::vector<float> k, v;
};

/// Reads kv head h of a layer view into floats, each chunk decoded in its own format.
head_kv read_view(const layer_view& lv, const geometry& g, std::uint32_t h) {
  head_kv out;
  const std::uint32_t hd = g.head_dim;
  out.k.resize(std::size_t{lv.tokens} * hd);
  out.v.resize(std::size_t{lv.tokens} * hd);
  std::size_t t0 = 0;
  for (const chunk& ch : lv) {
    float* kd = out.k.data() + t0 * hd;
    float* vd = out.v.data() + t0 * hd;
    if (ch.k_format == format::q4)
      scalar().dequantize_keys(reinterpret_cast<const std::uint8_t*>(ch.k_head(h)), ch.tokens, hd, kd, hd);
    else
      scalar().f16_to_f32(reinterpret_cast<const half*>(ch.k_head(h)), kd, std::size_t{ch.tokens} * hd);
    if (ch.v_format == format::q4)
      scalar().dequantize_values(reinterpret_cast<const std::uint8_t*>(ch.v_head(h)), 0, ch.tokens, hd, vd, hd);
    else
      scalar().f16_to_f32(reinterpret_cast<const half*>(ch.v_head(h)), vd, std::size_t{ch.tokens} * hd);
    t0 += ch.tokens;
  }
  return out;
}

/// The per-token alternative: keys of the first `store` tokens rounded to FP16 then quantized
/// per token in groups of 32 channels (quantize_values applied to keys), later ones FP16.
/// k: [token][kv_heads][head_dim] floats as written.
std::vector<float> per_token_keys(std::span<const float> k, std::size_t tokens, std::size_t store,
                                  const geometry& g, std::uint32_t h) {
  const std::uint32_t hd = g.head_dim;
  const std::size_t tw = g.token_width();
  std::vector<half> k16(tokens * hd);
  for (std::size_t t = 0; t < tokens; ++t)
    for (std::uint32_t d = 0; d < hd; ++d) k16[t * hd + d] = kvcache::to_half(k[t * tw + std::size_t{h} * hd + d]);
  std::vector<float> out(tokens * hd);
  scalar().f16_to_f32(k16.data(), out.data(), out.size());
  std::vector<std::uint8_t> group(kvcache::q4_value_group_bytes(hd));
  for (std::size_t t = 0; t < store; ++t) {
    scalar().quantize_values(k16.data() + t * hd, hd, 1, hd, group.data());
    scalar().dequantize_values(group.data(), 0, 1, hd, out.data() + t * hd, hd);
  }
  return out;
}

/// Float attention of one query head over [tokens][head_dim] float keys and values.
void attend_float(const float* q, const float* k, const float* v, std::size_t tokens, std::uint32_t hd, float scale,
                  std::vector<float>& scores, float* out) {
  scores.resize(tokens);
  float mx = -INFINITY;
  for (std::size_t t = 0; t < tokens; ++t) {
    float s = 0.0f;
    for (std::uint32_t d = 0; d < hd; ++d) s += q[d] * k[t * hd + d];
    scores[t] = s * scale;
    mx = std::max(mx, scores[t]);
  }
  float sum = 0.0f;
  for (std::size_t t = 0; t < tokens; ++t) sum += (scores[t] = std::exp(scores[t] - mx));
  for (std::uint32_t d = 0; d < hd; ++d) out[d] = 0.0f;
  for (std::size_t t = 0; t < tokens; ++t)
    for (std::uint32_t d = 0; d < hd; ++d) out[d] += scores[t] * v[t * hd + d];
  for (std::uint32_t d = 0; d < hd; ++d) out[d] /= sum;
}

/// float64 reference of one query head over the unquantized keys and values of kv head h.
/// k, v: [token][kv_heads][head_dim].
void attend_reference(const float* q, std::span<const float> k, std::span<const float> v, std::size_t tokens,
                      const geometry& g, std::uint32_t h, std::vector<double>& scores, double* out) {
  const std::uint32_t hd = g.head_dim;
  const std::size_t tw = g.token_width();
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  scores.resize(tokens);
  double mx = -INFINITY;
  for (std::size_t t = 0; t < tokens; ++t) {
    double s = 0.0;
    for (std::uint32_t d = 0; d < hd; ++d) s += static_cast<double>(q[d]) * k[t * tw + std::size_t{h} * hd + d];
    scores[t] = s * scale;
    mx = std::max(mx, scores[t]);
  }
  double sum = 0.0;
  for (std::size_t t = 0; t < tokens; ++t) sum += (scores[t] = std::exp(scores[t] - mx));
  for (std::uint32_t d = 0; d < hd; ++d) out[d] = 0.0;
  for (std::size_t t = 0; t < tokens; ++t)
    for (std::uint32_t d = 0; d < hd; ++d) out[d] += scores[t] * v[t * tw + std::size_t{h} * hd + d];
  for (std::uint32_t d = 0; d < hd; ++d) out[d] /= sum;
}

/// Accumulated squared errors: two-tier (per-channel keys) and the per-token alternative.
struct error_sums {
  double ref = 0, channel = 0, token = 0;
  double channel_rel() const { return std::sqrt(channel / ref); }
  double token_rel() const { return std::sqrt(token / ref); }
};

/// Attention of `queries` ([n][q_heads][head_dim]) over one layer of the cache holding `tokens`
/// tokens whose unquantized K/V are k, v ([token][kv_heads][head_dim]); adds to `sums`.
void measure(const cache_t& c, seq_id id, std::uint32_t layer, std::span<const float> k, std::span<const float> v,
             std::size_t tokens, std::span<const float> queries, std::uint32_t q_heads, error_sums& sums) {
  const geometry g = c.shape();
  const std::uint32_t hd = g.head_dim;
  const std::uint32_t group = q_heads / g.kv_heads;
  const layer_view lv = c.view(id, layer).value();
  ASSERT_EQ(lv.tokens, tokens);
  const std::size_t store = c.info(id).value().store_tokens;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const std::size_t nq = queries.size() / (std::size_t{q_heads} * hd);
  std::vector<float> fs, o(hd), o2(hd);
  std::vector<double> ds, r(hd);
  for (std::uint32_t h = 0; h < g.kv_heads; ++h) {
    const head_kv kv = read_view(lv, g, h);
    const std::vector<float> kt = per_token_keys(k, tokens, store, g, h);
    for (std::size_t i = 0; i < nq; ++i)
      for (std::uint32_t j = h * group; j < (h + 1) * group; ++j) {
        const float* q = queries.data() + (i * q_heads + j) * hd;
        attend_reference(q, k, v, tokens, g, h, ds, r.data());
        attend_float(q, kv.k.data(), kv.v.data(), tokens, hd, scale, fs, o.data());
        attend_float(q, kt.data(), kv.v.data(), tokens, hd, scale, fs, o2.data());
        for (std::uint32_t d = 0; d < hd; ++d) {
          sums.ref += r[d] * r[d];
          sums.channel += (o[d] - r[d]) * (o[d] - r[d]);
          sums.token += (o2[d] - r[d]) * (o2[d] - r[d]);
        }
      }
  }
}

/// Appends tokens [from, to) of one layer's k, v ([token][kv_heads][head_dim]) per layer.
void append(cache_t& c, seq_id id, const std::vector<std::vector<float>>& k, const std::vector<std::vector<float>>& v,
            std::size_t from, std::size_t to) {
  const std::size_t tw = c.shape().token_width();
  ASSERT_TRUE(c.reserve(id, to - from).has_value());
  for (std::uint32_t l = 0; l < c.shape().layers; ++l) {
    const std::span<const float> ks(k[l].data() + from * tw, (to - from) * tw);
    const std::span<const float> vs(v[l].data() + from * tw, (to - from) * tw);
    ASSERT_TRUE(c.write(id, l, ks, vs).has_value());
  }
  ASSERT_TRUE(c.commit(id).has_value());
}

/// RoPE over adjacent pairs (2i, 2i+1) of each head at position pos: theta = pos / 10000^(2i/hd).
void rope(float* x, std::uint32_t heads, std::uint32_t hd, std::size_t pos) {
  for (std::uint32_t h = 0; h < heads; ++h)
    for (std::uint32_t i = 0; i < hd; i += 2) {
      const double a = static_cast<double>(pos) / std::pow(10000.0, static_cast<double>(i) / hd);
      const double c = std::cos(a), s = std::sin(a);
      float* p = x + std::size_t{h} * hd + i;
      const double x0 = p[0], x1 = p[1];
      p[0] = static_cast<float>(x0 * c - x1 * s);
      p[1] = static_cast<float>(x0 * s + x1 * c);
    }
}

void print_row(const char* data, const setup& s, std::size_t len, const error_sums& e) {
  std::printf("| %-9s | %-22s | %5zu | %10.3e | %10.3e | %6.1fx |\n", data, s.name().c_str(), len, e.channel_rel(),
              e.token_rel(), e.token_rel() / e.channel_rel());
}

void print_header() {
  std::printf("per-chan: the two-tier cache (store keys Q4 per channel); per-token: the same with the store's\n"
              "keys Q4 per token instead (values, tail as configured); ratio: per-token / per-chan\n");
  std::printf("| %-9s | %-22s | %5s | %10s | %10s | %7s |\n", "data", "configuration", "len", "per-chan",
              "per-token", "ratio");
  std::printf("|-----------|------------------------|-------|------------|------------|---------|\n");
}

// ---- (a) synthetic keys with outlier channels ---------------------------------------------------

/// Seeded generator of one layer's keys, values and decode queries, per kv head:
/// - keys before RoPE: most channels N(m_c, 1) with a per-channel mean m_c ~ N(0, 0.5); 4
///   outlier channels per head at s_c * (1 + 0.2 N(0, 1)) with |s_c| = U(10, 50) x median |k|
///   (the median of |N(0,1)| is 0.674), a fixed sign per channel. The outlier channels sit in the
///   low-frequency half of the RoPE pairs (channels >= head_dim / 2), where real models show their
///   massive key channels. Then RoPE at the token's position.
/// - values: N(mu_c, 1) with mu_c ~ N(0, 1) per channel: a component shared by every token, as
///   real value vectors have, so the attention output is not a cancellation of pure noise.
/// - queries: N(0, 1) per channel, RoPE at the decode position.
struct synthetic {
  geometry g{1, 2, 128};
  std::uint32_t q_heads = 8;
  std::vector<std::vector<float>> k, v;  // [layer][token][kv_head][head_dim]
  std::vector<float> queries;            // [query][q_head][head_dim]

  synthetic(std::size_t tokens, std::size_t n_queries, std::uint32_t seed) {
    std::mt19937 gen(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_real_distribution<float> uni(10.0f, 50.0f);
    const std::uint32_t hd = g.head_dim;
    const std::size_t tw = g.token_width();
    std::vector<float> mean(tw), scale(tw, 0.0f), vmean(tw);
    for (std::uint32_t h = 0; h < g.kv_heads; ++h) {
      for (std::uint32_t d = 0; d < hd; ++d) {
        mean[h * hd + d] = 0.5f * normal(gen);
        vmean[h * hd + d] = normal(gen);
      }
      for (int o = 0; o < 4;) {
        const std::uint32_t d = hd / 2 + static_cast<std::uint32_t>(gen() % (hd / 2));
        if (scale[h * hd + d] != 0.0f) continue;
        scale[h * hd + d] = (gen() % 2 == 0 ? 1.0f : -1.0f) * uni(gen) * 0.674f;
        ++o;
      }
    }
    k.assign(1, std::vector<float>(tokens * tw));
    v.assign(1, std::vector<float>(tokens * tw));
    for (std::size_t t = 0; t < tokens; ++t) {
      float* kt = k[0].data() + t * tw;
      float* vt = v[0].data() + t * tw;
      for (std::size_t i = 0; i < tw; ++i) {
        kt[i] = scale[i] != 0.0f ? scale[i] * (1.0f + 0.2f * normal(gen)) : mean[i] + normal(gen);
        vt[i] = vmean[i] + normal(gen);
      }
      rope(kt, g.kv_heads, hd, t);
    }
    queries.resize(n_queries * q_heads * hd);
    for (float& x : queries) x = normal(gen);
    for (std::size_t i = 0; i < n_queries; ++i) rope(queries.data() + i * q_heads * hd, q_heads, hd, tokens);
  }
};

TEST(two_tier_accuracy, synthetic_outlier_keys) {
  constexpr std::uint32_t seed = 20240607;  // fixed: the table is reproducible
  std::printf("\n(a) synthetic keys, 4 outlier channels per head at 10-50x the median (before RoPE),\n"
              "    2 kv heads x 128, 8 query heads, 16 decode queries, seed %u\n",
              seed);
  print_header();
  for (std::size_t len : {256u, 1024u, 4096u}) {
    const synthetic data(len, 16, seed + static_cast<std::uint32_t>(len));
    for (const setup& s : setups) {
      cache_t c = make_cache(data.g, s);
      const seq_id id = c.create().value();
      for (std::size_t t = 0; t < len; t += 256) append(c, id, data.k, data.v, t, std::min(len, t + 256));
      error_sums e;
      measure(c, id, 0, data.k[0], data.v[0], len, data.queries, data.q_heads, e);
      print_row("synthetic", s, len, e);
      if (s.k == format::f16 && s.v == format::f16) {
        EXPECT_LE(e.channel_rel(), 1e-3) << "control";
      } else if (s.v == format::f16) {
        // DESIGN §3: relative L2 <= 2e-2 with per-channel Q4 keys on keys with outlier channels
        // (the keys' share of the error: values kept in FP16).
        EXPECT_LE(e.channel_rel(), 2e-2) << s.name() << ", " << len << " tokens";
      } else {
        // Q4 values add their own error (K f16 / V q4 alone reaches 2.0e-2 at 256 tokens here):
        // K q4 / V q4 measured 1.2e-2 .. 2.6e-2; bound with margin.
        EXPECT_LE(e.channel_rel(), 3.5e-2) << s.name() << ", " << len << " tokens";
      }
      if (s.k == format::q4 && 32u * 2 <= len - s.tail) {
        // Per-token grouping puts each outlier in a group with 31 ordinary channels: much worse.
        EXPECT_GT(e.token_rel(), 3.0 * e.channel_rel()) << s.name() << ", " << len << " tokens";
      }
    }
  }
}

// ---- (b) real activations of stories260K ------------------------------------------------------

TEST(two_tier_accuracy, stories260k_activations) {
  KVCACHE_NEED_MODEL();
  const std::string& path = kvcache::test::shared_model_path();
  auto loaded = llama2c::load(path);
  ASSERT_TRUE(loaded.has_value()) << loaded.error().message;
  const llama2c::model& model = loaded.value();
  const llama2c::config& mc = model.cfg;
  const geometry g{mc.layers, mc.kv_heads, mc.head_size()};
  // Under qemu (KVCACHE_TEST_EMULATED=1, scripts/cross_aarch64.sh) up to 1024 tokens: the forward
  // pass to 4096 took 7 of that stage's minutes there; the x86 stages run every length.
  const bool emulated = std::getenv("KVCACHE_TEST_EMULATED") != nullptr;
  const std::size_t max_len = emulated ? 1024 : 4096;
  constexpr std::uint32_t seed = 260;

  // Run the model: sampled tokens (temperature 1, fixed seed) from BOS, the reference attention
  // keeping every key and value in float; record each position's queries (after RoPE).
  llama2c::run_state state(mc);
  llama2c::reference_attention ref(mc);
  std::vector<std::vector<float>> queries(mc.layers);  // [layer][pos][heads][head_size]
  auto attention = [&](std::uint32_t layer, std::size_t pos, std::span<const float> q, std::span<const float> k,
                       std::span<const float> v, std::span<float> out) {
    queries[layer].insert(queries[layer].end(), q.begin(), q.end());
    ref(layer, pos, q, k, v, out);
  };
  std::mt19937 gen(seed);
  std::uint32_t token = 1;
  for (std::size_t pos = 0; pos < max_len; ++pos) {
    const std::span<const float> logits = llama2c::forward(model, state, token, pos, attention);
    std::vector<double> p(logits.size());
    const float mx = *std::max_element(logits.begin(), logits.end());
    for (std::size_t i = 0; i < p.size(); ++i) p[i] = std::exp(static_cast<double>(logits[i] - mx));
    token = static_cast<std::uint32_t>(std::discrete_distribution<std::size_t>(p.begin(), p.end())(gen));
  }
  std::vector<std::vector<float>> k(mc.layers), v(mc.layers);
  for (std::uint32_t l = 0; l < mc.layers; ++l) {
    k[l] = ref.keys(l);
    v[l] = ref.values(l);
  }

  std::printf("\n(b) stories260K activations (%u layers, %u kv heads x %u, %u query heads), sampled from BOS,\n"
              "    seed %u; decode queries at 8 positions in (len/2, len]; note: positions past the\n"
              "    model's trained context of %u\n",
              mc.layers, mc.kv_heads, mc.head_size(), mc.heads, seed, mc.seq_len);
  print_header();
  for (const setup& s : setups) {
    cache_t c = make_cache(g, s);
    const seq_id id = c.create().value();
    std::size_t have = 0;
    for (std::size_t len : {256u, 1024u, 4096u}) {
      if (len > max_len) continue;
      error_sums e;
      for (std::size_t j = 1; j <= 8; ++j) {
        const std::size_t at = len / 2 + j * len / 16;  // cache holds `at` tokens; query of at - 1
        append(c, id, k, v, have, at);
        have = at;
        for (std::uint32_t l = 0; l < mc.layers; ++l) {
          const std::size_t qw = std::size_t{mc.heads} * mc.head_size();
          const std::span<const float> q(queries[l].data() + (at - 1) * qw, qw);
          measure(c, id, l, k[l], v[l], at, q, mc.heads, e);
        }
      }
      print_row("260K", s, len, e);
      // Bounds: the measured errors with a margin of about 1.3x. This model's heads are 8 wide with
      // large query components, so 4-bit keys cost it 8-10 % whichever the grouping (its keys have
      // only mild outlier channels, and RoPE turns its fast channels over within 32 tokens).
      if (s.k == format::f16 && s.v == format::f16) {
        EXPECT_LE(e.channel_rel(), 2e-3) << "control";
      } else if (s.k == format::f16) {
        EXPECT_LE(e.channel_rel(), 5e-2) << s.name() << ", " << len << " tokens";
      } else {
        EXPECT_LE(e.channel_rel(), 0.13) << s.name() << ", " << len << " tokens";
      }
    }
  }
}

}  // namespace
