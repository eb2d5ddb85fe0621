// two_tier_cache<cuda> against two_tier_cache<cpu>: the same steps give the same tokens, bit for
// bit after decoding (Q4 groups quantized by the migration kernel equal the CPU's), the same tier
// occupancy; the documented limits answer with typed errors; the batch decode over store + tail
// matches the float64 reference. Every test but the limits one needs a device.
#include "cuda_test_util.hpp"

#include <kvcache/cuda/two_tier_cache.hpp>
#include <kvcache/two_tier_cache.hpp>

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using kvcache::cpu;
using kvcache::cuda;
using kvcache::errc;
using kvcache::format;
using kvcache::seq_id;
using namespace kvcache_cuda_test;

// Bytes of one chunk's K (or V) region for kv head h, copied to the host.
std::vector<std::uint8_t> fetch(const void* p, std::size_t bytes, bool device) {
  std::vector<std::uint8_t> out(bytes);
  if (bytes == 0) return out;
  if (device) {
    EXPECT_TRUE(kvcache::copy_to_host(cuda{}, out.data(), p, bytes).has_value());
    EXPECT_TRUE(kvcache::cuda_synchronize(cuda{}).has_value());
  } else {
    std::memcpy(out.data(), p, bytes);
  }
  return out;
}

// Decodes a view to float bit patterns, token-major: [token][kv_head][head_dim] for K then V.
std::vector<std::uint32_t> decode(const kvcache::layer_view& lv, const kvcache::geometry& g, bool device) {
  const std::size_t D = g.head_dim, tw = g.token_width();
  std::vector<float> k(lv.tokens * tw), v(lv.tokens * tw);
  std::size_t t0 = 0;
  for (std::uint32_t c = 0; c < lv.count; ++c) {
    const kvcache::chunk& ch = lv.chunks[c];
    for (std::uint32_t h = 0; h < g.kv_heads; ++h) {
      std::vector<float> rows(ch.tokens * D);
      for (int kv = 0; kv < 2; ++kv) {
        const format f = kv == 0 ? ch.k_format : ch.v_format;
        const std::byte* base = kv == 0 ? ch.k_head(h) : ch.v_head(h);
        if (f == format::q4 && kv == 0) {  // one key group: whole, whatever its token count
          const auto b = fetch(base, kvcache::q4_key_group_bytes(g.head_dim), device);
          scalar().dequantize_keys(b.data(), ch.tokens, g.head_dim, rows.data(), D);
        } else if (f == format::q4) {
          const auto b = fetch(base, kvcache::q4_value_group_bytes(g.head_dim), device);
          scalar().dequantize_values(b.data(), 0, ch.tokens, g.head_dim, rows.data(), D);
        } else {
          const auto b = fetch(base, ch.tokens * D * sizeof(kvcache::half), device);
          scalar().f16_to_f32(reinterpret_cast<const kvcache::half*>(b.data()), rows.data(), ch.tokens * D);
        }
        std::vector<float>& out = kv == 0 ? k : v;
        for (std::size_t t = 0; t < ch.tokens; ++t)
          std::memcpy(&out[(t0 + t) * tw + h * D], &rows[t * D], D * sizeof(float));
      }
    }
    t0 += ch.tokens;
  }
  std::vector<std::uint32_t> bits;
  for (float x : k) bits.push_back(std::bit_cast<std::uint32_t>(x));
  for (float x : v) bits.push_back(std::bit_cast<std::uint32_t>(x));
  return bits;
}

kvcache::two_tier_config config(const kvcache::geometry& g, format kf, format vf, std::uint32_t tail) {
  kvcache::two_tier_config c;
  c.shape = g;
  c.tail_tokens = tail;
  c.key_format = kf;
  c.value_format = vf;
  c.max_tokens = 600;
  c.max_sequences = 3;
  return c;
}

TEST(cuda_two_tier, limits_are_typed_errors) {
  // Validation happens before any device call: runs without a device too.
  const kvcache::geometry g{2, 2, 64};
  auto no_max = config(g, format::q4, format::q4, 64);
  no_max.max_tokens = 0;
  auto r1 = kvcache::two_tier_cache<cuda>::create(no_max);
  ASSERT_FALSE(r1.has_value());
  EXPECT_EQ(r1.error().code, errc::invalid_argument);
  auto streaming = config(g, format::q4, format::q4, 64);
  streaming.on_full = kvcache::capacity_policy::streaming;
  auto r2 = kvcache::two_tier_cache<cuda>::create(streaming);
  ASSERT_FALSE(r2.has_value());
  EXPECT_EQ(r2.error().code, errc::unsupported);
  auto bad_tail = config(g, format::q4, format::q4, 48);
  auto r3 = kvcache::two_tier_cache<cuda>::create(bad_tail);
  ASSERT_FALSE(r3.has_value());
  EXPECT_EQ(r3.error().code, errc::invalid_argument);
  auto bad_format = config(g, format::f32, format::q4, 64);
  auto r4 = kvcache::two_tier_cache<cuda>::create(bad_format);
  ASSERT_FALSE(r4.has_value());
  EXPECT_EQ(r4.error().code, errc::invalid_argument);
}

TEST(cuda_two_tier, same_tokens_as_the_cpu_cache) {
  KVCACHE_REQUIRE_CUDA();
  struct tt_case {
    kvcache::geometry g;
    format kf, vf;
    std::uint32_t tail;
  };
  std::vector<tt_case> cases;
  for (const auto& [kf, vf] : {std::pair{format::q4, format::q4}, std::pair{format::q4, format::f16},
                               std::pair{format::f16, format::q4}})
    for (std::uint32_t tail : {0u, 64u}) cases.push_back({{2, 2, 40}, kf, vf, tail});
  cases.push_back({{1, 2, 30}, format::q4, format::q4, 0});  // Q4 key groups with padding channels, a partial value column
  for (const tt_case& tc : cases) {
    const kvcache::geometry& g = tc.g;
    const format kf = tc.kf, vf = tc.vf;
    const std::uint32_t tail = tc.tail;
    rng r;
    SCOPED_TRACE(::testing::Message() << r.trace() << " head_dim=" << g.head_dim << " k=" << kvcache::to_string(kf)
                                      << " v=" << kvcache::to_string(vf) << " tail=" << tail);
    const auto cfg = config(g, kf, vf, tail);
    auto gc = kvcache::two_tier_cache<cuda>::create(cfg);
    auto cc = kvcache::two_tier_cache<cpu>::create(cfg);
    KVCACHE_ASSERT_OK(gc);
    KVCACHE_ASSERT_OK(cc);
    std::vector<std::pair<seq_id, seq_id>> ids;
    for (int i = 0; i < 3; ++i) ids.emplace_back(gc->create().value(), cc->create().value());
    for (int step = 0; step < 40; ++step)
      for (auto& [gs, cs] : ids) {
        const std::size_t len = gc->length(gs).value();
        std::size_t n = r.between(0, 3) == 0 ? r.between(0, 70) : r.between(0, 3);
        n = std::min(n, cfg.max_tokens - len);
        KVCACHE_ASSERT_OK(gc->reserve(gs, n));
        KVCACHE_ASSERT_OK(cc->reserve(cs, n));
        for (std::uint32_t l = 0; l < g.layers; ++l) {
          const std::vector<float> k = r.floats(n * g.token_width(), -2.0f, 2.0f), v = r.floats(n * g.token_width());
          KVCACHE_ASSERT_OK(gc->write(gs, l, std::span<const float>(k), std::span<const float>(v)));
          KVCACHE_ASSERT_OK(cc->write(cs, l, std::span<const float>(k), std::span<const float>(v)));
        }
        KVCACHE_ASSERT_OK(gc->commit(gs));
        KVCACHE_ASSERT_OK(cc->commit(cs));
        if (step % 9 == 8) {  // roll back a few tokens, within the tail or at a group boundary
          const auto info = gc->info(gs).value();
          const std::size_t cut = info.tail_tokens > 0 ? std::min<std::size_t>(info.tail_tokens, r.between(1, 7))
                                                       : (info.store_tokens >= 32 ? 32 : 0);
          KVCACHE_ASSERT_OK(gc->truncate(gs, gc->length(gs).value() - cut));
          KVCACHE_ASSERT_OK(cc->truncate(cs, cc->length(cs).value() - cut));
        }
      }
    for (auto& [gs, cs] : ids) {
      ASSERT_EQ(gc->length(gs).value(), cc->length(cs).value());
      const auto gi = gc->info(gs).value(), ci = cc->info(cs).value();
      EXPECT_EQ(gi.store_groups, ci.store_groups);
      EXPECT_EQ(gi.tail_tokens, ci.tail_tokens);
      for (std::uint32_t l = 0; l < g.layers; ++l)
        EXPECT_TRUE(decode(gc->view(gs, l).value(), g, true) == decode(cc->view(cs, l).value(), g, false)) << "layer " << l;
    }
    EXPECT_EQ(gc->stats().store_tokens, cc->stats().store_tokens);
    // A cut inside a store group is the documented gap: typed error, nothing changed.
    auto& [gs, cs] = ids[0];
    const auto info = gc->info(gs).value();
    if (info.store_tokens >= 32) {
      const std::size_t before = gc->length(gs).value();
      const kvcache::result<void> cut = gc->truncate(gs, info.store_tokens - 5);
      ASSERT_FALSE(cut.has_value());
      EXPECT_EQ(cut.error().code, errc::unsupported);
      EXPECT_EQ(gc->length(gs).value(), before);
    }
  }
}

TEST(cuda_two_tier, batch_decode_over_store_and_tail_matches_reference) {
  KVCACHE_REQUIRE_CUDA();
  rng r;
  SCOPED_TRACE(r.trace());
  const cuda where{};
  const kvcache::geometry g{1, 2, 64};
  const std::uint32_t q_heads = 8;
  auto cfg = config(g, format::q4, format::q4, 32);
  cfg.max_tokens = 1024;
  auto c = kvcache::two_tier_cache<cuda>::create(cfg, where);
  KVCACHE_ASSERT_OK(c);
  std::vector<seq_id> ids;
  for (std::uint32_t b = 0; b < 3; ++b) {
    ids.push_back(c->create().value());
    // The first sequence is long enough (three tails) that store groups exist whatever the seed and
    // the step count; the others may be empty.
    const std::size_t n = r.between(b == 0 ? 96 : 0, 300);
    KVCACHE_ASSERT_OK(c->reserve(ids[b], n));
    const std::vector<float> k = r.floats(n * g.token_width()), v = r.floats(n * g.token_width());
    KVCACHE_ASSERT_OK(c->write(ids[b], 0, std::span<const float>(k), std::span<const float>(v)));
    KVCACHE_ASSERT_OK(c->commit(ids[b]));
  }
  const std::size_t batch = ids.size(), q_count = batch * q_heads * g.head_dim;
  auto d_k = zeros<float>(where, batch * g.token_width());
  auto d_v = zeros<float>(where, batch * g.token_width());
  auto d_q = zeros<float>(where, q_count);
  auto d_out = zeros<float>(where, q_count);
  for (const auto* x : {&d_k, &d_v, &d_q, &d_out}) KVCACHE_ASSERT_OK(*x);
  kvcache::device_buffer ws;
  kvcache::attention_params ap;
  ap.q_heads = q_heads;
  ap.kv_heads = g.kv_heads;
  ap.head_dim = g.head_dim;
  // Each step: the reference is the view before commit (what attention saw: Q4 store groups,
  // FP16 tail) plus the step's own token; commit then migrates full tail pages.
  for (int step = 0; step < steps(70, 6); ++step) {
    for (seq_id id : ids) KVCACHE_ASSERT_OK(c->reserve(id, 1));
    KVCACHE_ASSERT_OK(c->prepare(ids));
    const std::vector<float> k = r.floats(batch * g.token_width()), v = r.floats(k.size()), q = r.floats(q_count);
    KVCACHE_ASSERT_OK(kvcache::copy_to_device(where, d_k->data(), k.data(), k.size() * 4));
    KVCACHE_ASSERT_OK(kvcache::copy_to_device(where, d_v->data(), v.data(), v.size() * 4));
    KVCACHE_ASSERT_OK(kvcache::copy_to_device(where, d_q->data(), q.data(), q.size() * 4));
    KVCACHE_ASSERT_OK(c->write_batch(0, d_k->data(), d_v->data()));
    // Odd steps: the automatic split (cuda_attend_options{} : split_tokens 0).
    KVCACHE_ASSERT_OK(c->attend(0, ap, d_q->data(), d_out->data(), ws, split_of(step % 2 == 0 ? 64u : 0u)));
    auto out = download(where, d_out->data(), q_count);
    KVCACHE_ASSERT_OK(out);
    double worst = 0.0;
    for (std::size_t b = 0; b < batch; ++b) {
      // Committed tokens as stored (store groups decoded from Q4, tail FP16) + this step's token.
      const std::vector<std::uint32_t> bits = decode(c->view(ids[b], 0).value(), g, true);
      const std::size_t len = bits.size() / (2 * g.token_width());
      std::vector<float> kall(bits.size() / 2 + g.token_width()), vall(kall.size());
      for (std::size_t i = 0; i < len * g.token_width(); ++i) {
        kall[i] = std::bit_cast<float>(bits[i]);
        vall[i] = std::bit_cast<float>(bits[len * g.token_width() + i]);
      }
      for (std::size_t i = 0; i < g.token_width(); ++i) {
        kall[len * g.token_width() + i] = kvcache::to_float(kvcache::to_half(k[b * g.token_width() + i]));
        vall[len * g.token_width() + i] = kvcache::to_float(kvcache::to_half(v[b * g.token_width() + i]));
      }
      for (std::uint32_t qh = 0; qh < q_heads; ++qh) {
        const std::uint32_t h = qh / (q_heads / g.kv_heads);
        std::vector<float> kk, vv;
        for (std::size_t t = 0; t <= len; ++t)
          for (std::uint32_t d = 0; d < g.head_dim; ++d) {
            kk.push_back(kall[(t * g.kv_heads + h) * g.head_dim + d]);
            vv.push_back(vall[(t * g.kv_heads + h) * g.head_dim + d]);
          }
        const std::size_t o = (b * q_heads + qh) * g.head_dim;
        const auto want = reference_attention(q.data() + o, kk, vv, len + 1, g.head_dim, 1.0 / 8.0);
        for (std::uint32_t d = 0; d < g.head_dim; ++d) worst = std::max(worst, std::abs(out.value()[o + d] - want[d]));
      }
    }
    ASSERT_LT(worst, 2e-4) << "step " << step;
    for (seq_id id : ids) KVCACHE_ASSERT_OK(c->commit(id));
  }
  EXPECT_GT(c->stats().store_groups, 0u);
  // The commits changed the cache: every batch call fails until the batch is prepared again.
  for (const kvcache::result<void>& stale : {c->write_batch(0, d_k->data(), d_v->data()), c->mark_batch_written(),
                                             c->attend(0, ap, d_q->data(), d_out->data(), ws, split_of(64))}) {
    ASSERT_FALSE(stale.has_value());
    EXPECT_EQ(stale.error().code, errc::invalid_argument) << stale.error().message;
  }
  KVCACHE_ASSERT_OK(c->prepare(ids));
  const kvcache::result<void> bad_split = c->attend(0, ap, d_q->data(), d_out->data(), ws, split_of(48));
  ASSERT_FALSE(bad_split.has_value());
  EXPECT_EQ(bad_split.error().code, errc::invalid_argument) << bad_split.error().message;
  EXPECT_NE(bad_split.error().message.find("split_tokens"), std::string::npos) << bad_split.error().message;
  const kvcache::result<void> bad_layer = c->attend(g.layers, ap, d_q->data(), d_out->data(), ws, split_of(64));
  ASSERT_FALSE(bad_layer.has_value());
  EXPECT_EQ(bad_layer.error().code, errc::layer_out_of_range) << bad_layer.error().message;
}

}  // namespace
