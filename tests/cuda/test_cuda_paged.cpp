// paged_cache<cuda> against paged_cache<cpu>: the same random operations (reserve with token ids,
// write, commit, truncate, fork, copy-on-write, prefix adoption, release) must give the same block
// tables, stats and bytes; the batch decode path matches the float64 attention reference; failed
// calls change nothing. Every test needs a device.
#include "cuda_test_util.hpp"

#include <kvcache/cuda/paged_cache.hpp>
#include <kvcache/paged_cache.hpp>

#include <gtest/gtest.h>

#ifdef KVCACHE_CUDA_EMULATED
#include <cuda_runtime.h>  // the emulated runtime (tests/cuda/emu_runtime): its fault injection
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

using kvcache::cpu;
using kvcache::cuda;
using kvcache::errc;
using kvcache::format;
using kvcache::seq_id;
using namespace kvcache_cuda_test;

// Committed bytes of one layer, chunk by chunk: K then V, [chunk][kv_head][tokens][head_dim].
std::vector<std::uint8_t> layer_bytes(const kvcache::layer_view& lv, const kvcache::geometry& g, format f, bool device) {
  std::vector<std::uint8_t> out;
  for (std::uint32_t i = 0; i < lv.count; ++i) {
    const kvcache::chunk& c = lv.chunks[i];
    const std::size_t row = static_cast<std::size_t>(c.tokens) * g.head_dim * kvcache::dense_element_bytes(f);
    for (std::uint32_t h = 0; h < g.kv_heads; ++h)
      for (const std::byte* src : {c.k_head(h), c.v_head(h)}) {
        const std::size_t at = out.size();
        out.resize(at + row);
        if (row == 0) continue;
        if (device) {
          EXPECT_TRUE(kvcache::copy_to_host(cuda{}, out.data() + at, src, row).has_value());
        } else {
          std::memcpy(out.data() + at, src, row);
        }
      }
  }
  if (device) {
    EXPECT_TRUE(kvcache::cuda_synchronize(cuda{}).has_value());
  }
  return out;
}

template <class C>
kvcache::paged_config<typename C::placement_type> config(const kvcache::geometry& g, format f, std::uint32_t B) {
  kvcache::paged_config<typename C::placement_type> cfg;
  cfg.shape = g;
  cfg.storage = f;
  cfg.block_tokens = B;
  cfg.budget_bytes = 64 * static_cast<std::size_t>(B) * g.token_width() * 2 * g.layers * kvcache::dense_element_bytes(f);
  return cfg;
}

TEST(cuda_paged, mirrors_the_cpu_cache_operation_for_operation) {
  KVCACHE_REQUIRE_CUDA();
  for (format f : {format::f16, format::f32})
    for (std::uint32_t B : {4u, 16u}) {
      rng r;
      SCOPED_TRACE(::testing::Message() << r.trace() << " format=" << kvcache::to_string(f) << " B=" << B);
      const kvcache::geometry g{2, 2, 40};
      auto gc = kvcache::paged_cache<cuda>::create(config<kvcache::paged_cache<cuda>>(g, f, B));
      auto cc = kvcache::paged_cache<cpu>::create(config<kvcache::paged_cache<cpu>>(g, f, B));
      KVCACHE_ASSERT_OK(gc);
      KVCACHE_ASSERT_OK(cc);
      std::vector<std::pair<seq_id, seq_id>> live;  // (gpu id, cpu id)
      std::vector<std::int32_t> prompt(3 * B + 2);
      for (auto& t : prompt) t = static_cast<std::int32_t>(r.between(0, 50));
      for (int op = 0; op < 120; ++op) {
        const std::uint32_t what = live.empty() ? 0 : r.between(0, 9);
        if (what == 0 && live.size() < 6) {  // new sequence, half of them from the shared prompt
          if (r.between(0, 1) == 0) {
            auto a = gc->create_with_prefix(prompt);
            auto b = cc->create_with_prefix(prompt);
            KVCACHE_ASSERT_OK(a);
            KVCACHE_ASSERT_OK(b);
            ASSERT_EQ(a->cached_tokens, b->cached_tokens);
            live.emplace_back(a->seq, b->seq);
          } else {
            live.emplace_back(gc->create().value(), cc->create().value());
          }
        } else if (what <= 5) {  // a step of n tokens with ids (prefix continuation when possible)
          auto& [gs, cs] = live[r.between(0, static_cast<std::uint32_t>(live.size() - 1))];
          const std::size_t len = gc->length(gs).value();
          const std::size_t n = r.between(0, 2 * B + 1);
          std::vector<std::int32_t> tok(n);
          for (std::size_t i = 0; i < n; ++i)
            tok[i] = len + i < prompt.size() ? prompt[len + i] : static_cast<std::int32_t>(r.between(0, 50));
          const kvcache::result<void> rg = gc->reserve(gs, n, tok);
          const kvcache::result<void> rc = cc->reserve(cs, n, tok);
          ASSERT_EQ(rg.has_value(), rc.has_value());
          if (!rg.has_value()) {
            EXPECT_EQ(rg.error().code, rc.error().code);
            continue;
          }
          for (std::uint32_t l = 0; l < g.layers; ++l) {
            const std::vector<float> k = r.floats(n * g.token_width()), v = r.floats(n * g.token_width());
            KVCACHE_ASSERT_OK(gc->write(gs, l, std::span<const float>(k), std::span<const float>(v)));
            KVCACHE_ASSERT_OK(cc->write(cs, l, std::span<const float>(k), std::span<const float>(v)));
          }
          KVCACHE_ASSERT_OK(gc->commit(gs));
          KVCACHE_ASSERT_OK(cc->commit(cs));
        } else if (what == 6) {  // fork (the next write into a shared partial block copies it)
          auto& [gs, cs] = live[r.between(0, static_cast<std::uint32_t>(live.size() - 1))];
          auto a = gc->fork(gs);
          auto b = cc->fork(cs);
          ASSERT_EQ(a.has_value(), b.has_value());
          if (a.has_value()) live.emplace_back(a.value(), b.value());
        } else if (what == 7) {
          auto& [gs, cs] = live[r.between(0, static_cast<std::uint32_t>(live.size() - 1))];
          const std::size_t keep = r.between(0, static_cast<std::uint32_t>(gc->length(gs).value()));
          KVCACHE_ASSERT_OK(gc->truncate(gs, keep));
          KVCACHE_ASSERT_OK(cc->truncate(cs, keep));
        } else {
          const std::size_t i = r.between(0, static_cast<std::uint32_t>(live.size() - 1));
          KVCACHE_ASSERT_OK(gc->release(live[i].first));
          KVCACHE_ASSERT_OK(cc->release(live[i].second));
          live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
        }
        for (const auto& [gs, cs] : live) {
          const auto gb = gc->blocks(gs).value();
          const auto cb = cc->blocks(cs).value();
          ASSERT_TRUE(std::equal(gb.begin(), gb.end(), cb.begin(), cb.end())) << "block tables differ at op " << op;
        }
      }
      std::vector<seq_id> gids, cids;
      for (const auto& [gs, cs] : live) {
        gids.push_back(gs);
        cids.push_back(cs);
      }
      const auto gt = gc->export_block_tables(gids), ct = cc->export_block_tables(cids);
      KVCACHE_ASSERT_OK(gt);
      KVCACHE_ASSERT_OK(ct);
      ASSERT_EQ(gt->batch, ct->batch);
      for (std::uint32_t i = 0; i <= gt->batch; ++i) ASSERT_EQ(gt->indptr[i], ct->indptr[i]);
      for (std::int32_t i = 0; i < gt->indptr[gt->batch]; ++i) ASSERT_EQ(gt->indices[i], ct->indices[i]);
      for (std::uint32_t i = 0; i < gt->batch; ++i) ASSERT_EQ(gt->last_block_len[i], ct->last_block_len[i]);
      for (const auto& [gs, cs] : live)
        for (std::uint32_t l = 0; l < g.layers; ++l)
          EXPECT_TRUE(layer_bytes(gc->view(gs, l).value(), g, f, true) == layer_bytes(cc->view(cs, l).value(), g, f, false));
      const kvcache::paged_stats sg = gc->stats(), sc = cc->stats();
      EXPECT_EQ(sg.tokens, sc.tokens);
      EXPECT_EQ(sg.blocks_in_use, sc.blocks_in_use);
      EXPECT_EQ(sg.blocks_shared, sc.blocks_shared);
      EXPECT_EQ(sg.blocks_cached, sc.blocks_cached);
      EXPECT_EQ(sg.prefix_hit_tokens, sc.prefix_hit_tokens);
      EXPECT_EQ(sg.internal_waste_tokens, sc.internal_waste_tokens);
    }
}

TEST(cuda_paged, pool_exhaustion_changes_nothing) {
  KVCACHE_REQUIRE_CUDA();
  const kvcache::geometry g{2, 1, 32};
  auto cfg = config<kvcache::paged_cache<cuda>>(g, format::f16, 8);
  cfg.budget_bytes = 4 * 8 * g.token_width() * 2 * g.layers * 2;  // 4 blocks
  auto c = kvcache::paged_cache<cuda>::create(cfg);
  KVCACHE_ASSERT_OK(c);
  const seq_id a = c->create().value();
  KVCACHE_ASSERT_OK(c->reserve(a, 20));
  const std::vector<float> rows(20 * g.token_width(), 0.5f);
  for (std::uint32_t l = 0; l < g.layers; ++l) KVCACHE_ASSERT_OK(c->write(a, l, std::span<const float>(rows), std::span<const float>(rows)));
  KVCACHE_ASSERT_OK(c->commit(a));
  const auto before_blocks = std::vector<std::uint32_t>(c->blocks(a)->begin(), c->blocks(a)->end());
  const kvcache::paged_stats before = c->stats();
  const kvcache::result<void> r = c->reserve(a, 20);
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code, errc::pool_exhausted) << r.error().message;
  EXPECT_EQ(std::vector<std::uint32_t>(c->blocks(a)->begin(), c->blocks(a)->end()), before_blocks);
  const kvcache::paged_stats after = c->stats();
  EXPECT_EQ(after.blocks_free, before.blocks_free);
  EXPECT_EQ(after.tokens, before.tokens);
  EXPECT_EQ(after.reserved_tokens, before.reserved_tokens);
  const kvcache::result<void> stale = c->write_batch(0, rows.data(), rows.data());
  ASSERT_FALSE(stale.has_value());
  EXPECT_EQ(stale.error().code, errc::invalid_argument);
}

#ifdef KVCACHE_CUDA_EMULATED
// With the emulated runtime's fault injection (tests/cuda/emu_runtime): where the device copy of
// reserve's copy-on-write fails, reserve returns device_error and gives back every block it took,
// the shared block's references included: both sequences and the pool are as before the call.
TEST(cuda_paged, failed_copy_on_write_changes_nothing) {
  const kvcache::geometry g{2, 1, 32};
  auto c = kvcache::paged_cache<cuda>::create(config<kvcache::paged_cache<cuda>>(g, format::f16, 8));
  KVCACHE_ASSERT_OK(c);
  const seq_id a = c->create().value();
  KVCACHE_ASSERT_OK(c->reserve(a, 12));  // one full block and a partial one of 4 tokens
  const std::vector<float> rows(12 * g.token_width(), 0.25f);
  for (std::uint32_t l = 0; l < g.layers; ++l) KVCACHE_ASSERT_OK(c->write(a, l, std::span<const float>(rows), std::span<const float>(rows)));
  KVCACHE_ASSERT_OK(c->commit(a));
  const seq_id b = c->fork(a).value();  // shares both blocks, the partial one too
  auto blocks_of = [&](seq_id s) { return std::vector<std::uint32_t>(c->blocks(s)->begin(), c->blocks(s)->end()); };
  const std::vector<std::uint32_t> a_before = blocks_of(a), b_before = blocks_of(b);
  ASSERT_EQ(a_before, b_before);
  const kvcache::paged_stats before = c->stats();
  EXPECT_EQ(before.blocks_shared, 2u);

  kvcache_emu::state().fail_device_copies = 1;
  const kvcache::result<void> r = c->reserve(b, 1);  // b's partial block is shared: copy-on-write
  kvcache_emu::state().fail_device_copies = 0;
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code, errc::device_error) << r.error().message;
  EXPECT_EQ(blocks_of(a), a_before);
  EXPECT_EQ(blocks_of(b), b_before);
  const kvcache::paged_stats after = c->stats();
  EXPECT_EQ(after.blocks_free, before.blocks_free);
  EXPECT_EQ(after.blocks_in_use, before.blocks_in_use);
  EXPECT_EQ(after.blocks_shared, before.blocks_shared);
  EXPECT_EQ(after.tokens, before.tokens);
  EXPECT_EQ(after.reserved_tokens, 0u);
  EXPECT_EQ(c->view(b, 0)->tokens, 12u);

  // The same reserve without the fault copies the block: b's last block is its own now.
  KVCACHE_ASSERT_OK(c->reserve(b, 1));
  const std::vector<std::uint32_t> b_after = blocks_of(b);
  ASSERT_EQ(b_after.size(), 2u);
  EXPECT_EQ(b_after[0], a_before[0]);
  EXPECT_NE(b_after[1], a_before[1]);
  EXPECT_EQ(c->stats().blocks_shared, 1u);
  EXPECT_EQ(blocks_of(a), a_before);
}
#endif

TEST(cuda_paged, expected_tokens_beyond_the_pool_is_refused) {
  KVCACHE_REQUIRE_CUDA();
  const kvcache::geometry g{2, 1, 32};
  auto cfg = config<kvcache::paged_cache<cuda>>(g, format::f16, 8);
  cfg.budget_bytes = 4 * 8 * g.token_width() * 2 * g.layers * 2;  // 4 blocks: 32 tokens
  cfg.expected_tokens = 33;
  const auto refused = kvcache::paged_cache<cuda>::create(cfg);
  ASSERT_FALSE(refused.has_value());
  EXPECT_EQ(refused.error().code, errc::invalid_argument);
  const std::string& what = refused.error().message;
  EXPECT_NE(what.find("expected_tokens=33"), std::string::npos) << what;
  EXPECT_NE(what.find("pool_tokens=32"), std::string::npos) << what;
  cfg.expected_tokens = 32;
  KVCACHE_ASSERT_OK(kvcache::paged_cache<cuda>::create(cfg));
}

TEST(cuda_paged, batch_decode_matches_reference) {
  KVCACHE_REQUIRE_CUDA();
  rng r;
  SCOPED_TRACE(r.trace());
  const cuda where{};
  const kvcache::geometry g{2, 2, 72};
  const std::uint32_t q_heads = 6, batch = 3, B = 16;
  auto cfg = config<kvcache::paged_cache<cuda>>(g, format::f16, B);
  cfg.budget_bytes *= 4;
  auto c = kvcache::paged_cache<cuda>::create(cfg, where);
  KVCACHE_ASSERT_OK(c);
  std::vector<seq_id> ids;
  std::vector<std::vector<float>> hist(batch * 2 * g.layers);  // [b][layer][k|v] -> [token][kv_head][head_dim]
  auto h = [&](std::uint32_t b, std::uint32_t l, std::uint32_t kv) -> std::vector<float>& { return hist[(b * g.layers + l) * 2 + kv]; };
  for (std::uint32_t b = 0; b < batch; ++b) ids.push_back(c->create().value());
  // A fork shares the first sequence's blocks: its first write copies the shared partial block.
  KVCACHE_ASSERT_OK(c->reserve(ids[0], 21));
  for (std::uint32_t l = 0; l < g.layers; ++l) {
    std::vector<float> k = r.floats(21 * g.token_width()), v = r.floats(21 * g.token_width());
    KVCACHE_ASSERT_OK(c->write(ids[0], l, std::span<const float>(k), std::span<const float>(v)));
    for (float& x : k) x = kvcache::to_float(kvcache::to_half(x));
    for (float& x : v) x = kvcache::to_float(kvcache::to_half(x));
    h(0, l, 0) = h(1, l, 0) = k;
    h(0, l, 1) = h(1, l, 1) = v;
  }
  KVCACHE_ASSERT_OK(c->commit(ids[0]));
  KVCACHE_ASSERT_OK(c->release(ids[1]));
  ids[1] = c->fork(ids[0]).value();
  const std::size_t q_count = static_cast<std::size_t>(batch) * q_heads * g.head_dim;
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
  for (int step = 0; step < steps(40, 5); ++step) {
    for (seq_id id : ids) KVCACHE_ASSERT_OK(c->reserve(id, 1));
    KVCACHE_ASSERT_OK(c->prepare(ids));
    for (std::uint32_t l = 0; l < g.layers; ++l) {
      std::vector<float> k = r.floats(batch * g.token_width()), v = r.floats(k.size()), q = r.floats(q_count);
      KVCACHE_ASSERT_OK(kvcache::copy_to_device(where, d_k->data(), k.data(), k.size() * 4));
      KVCACHE_ASSERT_OK(kvcache::copy_to_device(where, d_v->data(), v.data(), v.size() * 4));
      KVCACHE_ASSERT_OK(kvcache::copy_to_device(where, d_q->data(), q.data(), q.size() * 4));
      KVCACHE_ASSERT_OK(c->write_batch(l, d_k->data(), d_v->data()));
      // Layer 1: the automatic split (split_tokens 0).
      KVCACHE_ASSERT_OK(c->attend(l, ap, d_q->data(), d_out->data(), ws, split_of(l == 0 ? 32u : 0u)));
      auto out = download(where, d_out->data(), q_count);
      KVCACHE_ASSERT_OK(out);
      double worst = 0.0;
      for (std::uint32_t b = 0; b < batch; ++b) {
        for (std::size_t i = 0; i < g.token_width(); ++i) {
          h(b, l, 0).push_back(kvcache::to_float(kvcache::to_half(k[b * g.token_width() + i])));
          h(b, l, 1).push_back(kvcache::to_float(kvcache::to_half(v[b * g.token_width() + i])));
        }
        const std::size_t len = h(b, l, 0).size() / g.token_width();
        for (std::uint32_t qh = 0; qh < q_heads; ++qh) {
          const std::uint32_t kvh = qh / (q_heads / g.kv_heads);
          std::vector<float> kk, vv;
          for (std::size_t t = 0; t < len; ++t)
            for (std::uint32_t d = 0; d < g.head_dim; ++d) {
              kk.push_back(h(b, l, 0)[(t * g.kv_heads + kvh) * g.head_dim + d]);
              vv.push_back(h(b, l, 1)[(t * g.kv_heads + kvh) * g.head_dim + d]);
            }
          const std::size_t o = (static_cast<std::size_t>(b) * q_heads + qh) * g.head_dim;
          const auto want = reference_attention(q.data() + o, kk, vv, len, g.head_dim, 1.0 / std::sqrt(72.0));
          for (std::uint32_t d = 0; d < g.head_dim; ++d) worst = std::max(worst, std::abs(out.value()[o + d] - want[d]));
        }
      }
      ASSERT_LT(worst, 2e-4) << "step " << step << " layer " << l;
    }
    for (seq_id id : ids) KVCACHE_ASSERT_OK(c->commit(id));
  }
  EXPECT_EQ(c->stats().blocks_shared, 1u);  // the fork still shares the first full block
}

}  // namespace
