// contiguous_cache<cuda> against contiguous_cache<cpu> (the same protocol, the same bytes) and the
// float64 attention reference; error paths leave the whole state unchanged; the batch decode step
// captured in a CUDA graph replays while sequences grow. Every test needs a device.
#include "cuda_test_util.hpp"

#include <kvcache/contiguous_cache.hpp>
#include <kvcache/cuda/contiguous_cache.hpp>

#include <cuda_runtime.h>
#include <gtest/gtest.h>

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
using gpu_cache = kvcache::contiguous_cache<cuda>;
using cpu_cache = kvcache::contiguous_cache<cpu>;

// The committed bytes of one layer of one sequence: K then V, each [kv_head][length][head_dim].
std::vector<std::uint8_t> committed_bytes(const kvcache::layer_view& lv, const kvcache::geometry& g, format f, bool device) {
  std::vector<std::uint8_t> out;
  if (lv.count == 0) return out;
  const kvcache::chunk& c = lv.chunks[0];
  const std::size_t row = static_cast<std::size_t>(lv.tokens) * g.head_dim * kvcache::dense_element_bytes(f);
  out.resize(2 * g.kv_heads * row);
  for (std::uint32_t h = 0; h < g.kv_heads; ++h) {
    std::uint8_t* kd = out.data() + h * row;
    std::uint8_t* vd = out.data() + (g.kv_heads + h) * row;
    if (device) {
      EXPECT_TRUE(kvcache::copy_to_host(cuda{}, kd, c.k_head(h), row).has_value());
      EXPECT_TRUE(kvcache::copy_to_host(cuda{}, vd, c.v_head(h), row).has_value());
    } else {
      std::memcpy(kd, c.k_head(h), row);
      std::memcpy(vd, c.v_head(h), row);
    }
  }
  if (device) {
    EXPECT_TRUE(kvcache::cuda_synchronize(cuda{}).has_value());
  }
  return out;
}

// Everything observable about a set of sequences: lengths, stats, committed bytes of every layer.
struct snapshot {
  std::vector<std::size_t> lengths;
  std::vector<std::vector<std::uint8_t>> bytes;
  std::size_t tokens = 0, resident = 0, reserved = 0, sequences = 0;
  bool operator==(const snapshot&) const = default;
};
snapshot take(const gpu_cache& c, const std::vector<seq_id>& ids) {
  snapshot s;
  for (seq_id id : ids) {
    s.lengths.push_back(c.length(id).value());
    for (std::uint32_t l = 0; l < c.shape().layers; ++l)
      s.bytes.push_back(committed_bytes(c.view(id, l).value(), c.shape(), c.storage(), true));
  }
  const kvcache::contiguous_stats st = c.stats();
  s.tokens = st.tokens;
  s.resident = st.resident_bytes;
  s.reserved = st.reserved_tokens;
  s.sequences = st.sequences;
  return s;
}

TEST(cuda_contiguous, same_bytes_as_the_cpu_cache) {
  KVCACHE_REQUIRE_CUDA();
  for (format f : {format::f16, format::f32})
    for (const kvcache::geometry g : {kvcache::geometry{3, 2, 40}, kvcache::geometry{2, 4, 128}}) {
      rng r;
      SCOPED_TRACE(::testing::Message() << r.trace() << " format=" << kvcache::to_string(f) << " head_dim=" << g.head_dim);
      const kvcache::contiguous_config cfg{g, f, 3, 200};
      auto gc = gpu_cache::create(cfg);
      auto cc = cpu_cache::create(cfg);
      KVCACHE_ASSERT_OK(gc);
      KVCACHE_ASSERT_OK(cc);
      std::vector<seq_id> gid, cid;
      for (int i = 0; i < 3; ++i) {
        gid.push_back(gc->create().value());
        cid.push_back(cc->create().value());
      }
      for (int step = 0; step < 12; ++step)
        for (std::size_t s = 0; s < gid.size(); ++s) {
          const std::size_t n = r.between(0, 13);
          if (gc->length(gid[s]).value() + n > cfg.capacity_tokens) continue;
          KVCACHE_ASSERT_OK(gc->reserve(gid[s], n));
          KVCACHE_ASSERT_OK(cc->reserve(cid[s], n));
          for (std::uint32_t l = 0; l < g.layers; ++l) {
            const bool halves = r.between(0, 1) == 1;
            if (halves) {
              const std::vector<kvcache::half> k = r.halves(n * g.token_width(), -8.0f, 8.0f), v = r.halves(n * g.token_width());
              KVCACHE_ASSERT_OK(gc->write(gid[s], l, std::span<const kvcache::half>(k), std::span<const kvcache::half>(v)));
              KVCACHE_ASSERT_OK(cc->write(cid[s], l, std::span<const kvcache::half>(k), std::span<const kvcache::half>(v)));
            } else {
              const std::vector<float> k = r.floats(n * g.token_width(), -8.0f, 8.0f), v = r.floats(n * g.token_width());
              KVCACHE_ASSERT_OK(gc->write(gid[s], l, std::span<const float>(k), std::span<const float>(v)));
              KVCACHE_ASSERT_OK(cc->write(cid[s], l, std::span<const float>(k), std::span<const float>(v)));
            }
          }
          KVCACHE_ASSERT_OK(gc->commit(gid[s]));
          KVCACHE_ASSERT_OK(cc->commit(cid[s]));
          if (step == 6 && s == 1) {  // a rollback in the middle
            const std::size_t keep = gc->length(gid[s]).value() / 2;
            KVCACHE_ASSERT_OK(gc->truncate(gid[s], keep));
            KVCACHE_ASSERT_OK(cc->truncate(cid[s], keep));
          }
        }
      // Deep copies: a fork replaces sequence 0, a half-length copy_prefix sequence 2.
      for (const std::size_t s : {std::size_t{0}, std::size_t{2}}) {
        const std::size_t n = s == 0 ? gc->length(gid[s]).value() : gc->length(gid[s]).value() / 2;
        KVCACHE_ASSERT_OK(gc->release(gid[1]));  // make room (max_sequences 3)
        KVCACHE_ASSERT_OK(cc->release(cid[1]));
        auto g2 = s == 0 ? gc->fork(gid[s]) : gc->copy_prefix(gid[s], n);
        auto c2 = s == 0 ? cc->fork(cid[s]) : cc->copy_prefix(cid[s], n);
        KVCACHE_ASSERT_OK(g2);
        KVCACHE_ASSERT_OK(c2);
        gid[1] = g2.value();
        cid[1] = c2.value();
        ASSERT_EQ(gc->length(gid[1]).value(), n);
      }
      const kvcache::result<seq_id> full = gc->fork(gid[0]);
      ASSERT_FALSE(full.has_value());
      EXPECT_EQ(full.error().code, errc::capacity_exceeded);
      for (std::size_t s = 0; s < gid.size(); ++s) {
        ASSERT_EQ(gc->length(gid[s]).value(), cc->length(cid[s]).value());
        for (std::uint32_t l = 0; l < g.layers; ++l) {
          const kvcache::layer_view gv = gc->view(gid[s], l).value(), cv = cc->view(cid[s], l).value();
          ASSERT_EQ(gv.tokens, cv.tokens);
          ASSERT_EQ(gv.count, cv.count);
          EXPECT_TRUE(committed_bytes(gv, g, f, true) == committed_bytes(cv, g, f, false)) << "seq " << s << " layer " << l;
        }
      }
      EXPECT_EQ(gc->stats().tokens, cc->stats().tokens);
      EXPECT_GE(gc->stats().resident_bytes, gc->bytes_per_sequence() * cfg.max_sequences);
    }
}

TEST(cuda_contiguous, failed_calls_change_nothing) {
  KVCACHE_REQUIRE_CUDA();
  rng r;
  SCOPED_TRACE(r.trace());
  const kvcache::geometry g{2, 2, 40};
  auto c = gpu_cache::create({g, format::f16, 2, 64});
  KVCACHE_ASSERT_OK(c);
  const seq_id a = c->create().value(), b = c->create().value();
  for (seq_id id : {a, b}) {
    KVCACHE_ASSERT_OK(c->reserve(id, 10));
    for (std::uint32_t l = 0; l < g.layers; ++l) {
      const std::vector<float> k = r.floats(10 * g.token_width()), v = r.floats(10 * g.token_width());
      KVCACHE_ASSERT_OK(c->write(id, l, std::span<const float>(k), std::span<const float>(v)));
    }
    KVCACHE_ASSERT_OK(c->commit(id));
  }
  const std::vector<seq_id> ids{a, b};
  const snapshot before = take(*c, ids);
  auto expect = [&](errc code, const kvcache::result<void>& res, const char* what) {
    ASSERT_FALSE(res.has_value()) << what;
    EXPECT_EQ(res.error().code, code) << what << ": " << res.error().message;
    EXPECT_TRUE(take(*c, ids) == before) << what << " changed the cache";
  };
  const seq_id ghost{a.value + (1ull << 32)};  // a's slot, a later generation
  const std::vector<float> one(g.token_width());
  expect(errc::unknown_sequence, c->reserve(ghost, 1), "reserve unknown");
  expect(errc::capacity_exceeded, c->reserve(a, 1ull << 40), "reserve absurd");
  expect(errc::capacity_exceeded, c->reserve(a, 55), "reserve past capacity");
  expect(errc::not_reserved, c->write(a, 0, std::span<const float>(one), std::span<const float>(one)), "write unreserved");
  expect(errc::layer_out_of_range, c->write(a, 2, std::span<const float>(one), std::span<const float>(one)), "write layer");
  expect(errc::not_reserved, c->commit(a), "commit unreserved");
  expect(errc::out_of_range, c->truncate(a, 11), "truncate past length");
  expect(errc::invalid_argument, c->prepare(std::vector<seq_id>{a, a}), "prepare duplicate");
  expect(errc::unknown_sequence, c->prepare(std::vector<seq_id>{a, ghost}), "prepare unknown");
  expect(errc::invalid_argument, c->write_batch(0, one.data(), one.data()), "write_batch without prepare");
  const kvcache::result<seq_id> third = c->create();
  ASSERT_FALSE(third.has_value());
  EXPECT_EQ(third.error().code, errc::capacity_exceeded);

  // With a reservation open: bad shapes, incomplete commit, pending reserve/truncate.
  KVCACHE_ASSERT_OK(c->reserve(a, 2));
  const std::vector<float> two(2 * g.token_width());
  KVCACHE_ASSERT_OK(c->write(a, 0, std::span<const float>(two), std::span<const float>(two)));
  const snapshot open = take(*c, ids);
  auto expect_open = [&](errc code, const kvcache::result<void>& res, const char* what) {
    ASSERT_FALSE(res.has_value()) << what;
    EXPECT_EQ(res.error().code, code) << what << ": " << res.error().message;
    EXPECT_TRUE(take(*c, ids) == open) << what << " changed the cache";
  };
  expect_open(errc::bad_shape, c->write(a, 1, std::span<const float>(one), std::span<const float>(two)), "K size");
  expect_open(errc::bad_shape, c->write(a, 1, std::span<const float>(two), std::span<const float>(one)), "V size");
  expect_open(errc::incomplete_write, c->commit(a), "commit with layer 1 unwritten");
  expect_open(errc::reservation_pending, c->reserve(a, 1), "reserve while pending");
  expect_open(errc::reservation_pending, c->truncate(a, 0), "truncate while pending");
  expect_open(errc::invalid_argument, c->write_device(a, 1, nullptr, nullptr), "write_device null");
  KVCACHE_ASSERT_OK(c->write(a, 1, std::span<const float>(two), std::span<const float>(two)));
  KVCACHE_ASSERT_OK(c->commit(a));
  EXPECT_EQ(c->length(a).value(), 12u);
}

// cuda_attend_options::prefetch_steps changes how far ahead the f16 tensor-core kernel asks L2
// for its rows, never the result: every value gives the automatic choice's bytes, splits long
// enough for several steps a warp. Above 4 is a typed error.
TEST(cuda_contiguous, attend_prefetch_steps_change_no_byte) {
  KVCACHE_REQUIRE_CUDA();
  rng r;
  SCOPED_TRACE(r.trace());
  const kvcache::geometry g{1, 2, 128};  // head_dim 128 and f16: the tensor-core kernel
  const std::uint32_t q_heads = 8, batch = 3;
  auto c = gpu_cache::create({g, format::f16, batch, 320});
  KVCACHE_ASSERT_OK(c);
  std::vector<seq_id> ids;
  for (std::uint32_t b = 0; b < batch; ++b) {
    ids.push_back(c->create().value());
    const std::size_t n = r.between(150, 320);
    KVCACHE_ASSERT_OK(c->reserve(ids[b], n));
    const std::vector<float> k = r.floats(n * g.token_width()), v = r.floats(n * g.token_width());
    KVCACHE_ASSERT_OK(c->write(ids[b], 0, std::span<const float>(k), std::span<const float>(v)));
    KVCACHE_ASSERT_OK(c->commit(ids[b]));
  }
  KVCACHE_ASSERT_OK(c->prepare(ids));
  const std::size_t q_count = static_cast<std::size_t>(batch) * q_heads * g.head_dim;
  const std::vector<float> q = r.floats(q_count);
  auto d_q = zeros<float>(cuda{}, q_count);
  auto d_out = zeros<float>(cuda{}, q_count);
  KVCACHE_ASSERT_OK(d_q);
  KVCACHE_ASSERT_OK(d_out);
  KVCACHE_ASSERT_OK(kvcache::copy_to_device(cuda{}, d_q->data(), q.data(), q.size() * 4));
  kvcache::device_buffer ws;
  kvcache::attention_params ap;
  ap.q_heads = q_heads;
  ap.kv_heads = g.kv_heads;
  ap.head_dim = g.head_dim;
  auto run = [&](const kvcache::cuda_attend_options& opt) -> std::vector<float> {
    EXPECT_TRUE(c->attend(0, ap, d_q->data(), d_out->data(), ws, opt).has_value());
    auto out = download(cuda{}, d_out->data(), q_count);
    EXPECT_TRUE(out.has_value());
    return out.has_value() ? out.value() : std::vector<float>{};
  };
  for (const std::uint32_t split : {0u, 64u, 320u}) {
    kvcache::cuda_attend_options opt;
    opt.split_tokens = split;
    const std::vector<float> automatic = run(opt);
    ASSERT_EQ(automatic.size(), q_count);
    for (std::uint32_t steps = 0; steps <= 4; ++steps) {
      opt.prefetch_steps = steps;
      EXPECT_TRUE(run(opt) == automatic) << "split_tokens " << split << ", prefetch_steps " << steps;
    }
  }
  kvcache::cuda_attend_options bad;
  bad.prefetch_steps = 5;
  const kvcache::result<void> res = c->attend(0, ap, d_q->data(), d_out->data(), ws, bad);
  ASSERT_FALSE(res.has_value());
  EXPECT_EQ(res.error().code, errc::invalid_argument);
  EXPECT_NE(res.error().message.find("prefetch_steps"), std::string::npos) << res.error().message;
}

// Decode steps through the batch path (device rows, one append launch per layer, attention of
// the prepared batch), first eagerly, then captured once in a CUDA graph and replayed.
TEST(cuda_contiguous, batch_decode_matches_reference_eager_and_in_a_graph) {
  KVCACHE_REQUIRE_CUDA();
  rng r;
  SCOPED_TRACE(r.trace());
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const cuda where = cuda{0}.on(stream);
  const kvcache::geometry g{2, 2, 64};
  const std::uint32_t q_heads = 8, batch = 3;
  auto c = gpu_cache::create({g, format::f16, 4, 300}, where);
  KVCACHE_ASSERT_OK(c);
  std::vector<seq_id> ids;
  std::vector<std::vector<std::vector<float>>> hist(batch, std::vector<std::vector<float>>(2 * g.layers));  // [b][layer*2+kv]
  for (std::uint32_t b = 0; b < batch; ++b) {
    ids.push_back(c->create().value());
    const std::size_t n = r.between(0, 70);
    KVCACHE_ASSERT_OK(c->reserve(ids[b], n));
    for (std::uint32_t l = 0; l < g.layers; ++l) {
      std::vector<float> k = r.floats(n * g.token_width()), v = r.floats(n * g.token_width());
      KVCACHE_ASSERT_OK(c->write(ids[b], l, std::span<const float>(k), std::span<const float>(v)));
      for (float& x : k) x = kvcache::to_float(kvcache::to_half(x));
      for (float& x : v) x = kvcache::to_float(kvcache::to_half(x));
      hist[b][2 * l] = k;
      hist[b][2 * l + 1] = v;
    }
    KVCACHE_ASSERT_OK(c->commit(ids[b]));
  }
  const std::size_t q_count = static_cast<std::size_t>(batch) * q_heads * g.head_dim;
  auto d_k = zeros<float>(where, g.layers * batch * g.token_width());
  auto d_v = zeros<float>(where, g.layers * batch * g.token_width());
  auto d_q = zeros<float>(where, g.layers * q_count);
  auto d_out = zeros<float>(where, g.layers * q_count);
  for (const auto* x : {&d_k, &d_v, &d_q, &d_out}) KVCACHE_ASSERT_OK(*x);
  kvcache::device_buffer ws;
  kvcache::attention_params ap;
  ap.q_heads = q_heads;
  ap.kv_heads = g.kv_heads;
  ap.head_dim = g.head_dim;
  const kvcache::cuda_attend_options opt{};  // the automatic split, also in the captured graph

  auto enqueue_step = [&]() -> kvcache::result<void> {
    for (std::uint32_t l = 0; l < g.layers; ++l) {
      KVCACHE_TRY(c->write_batch(l, d_k->data() + l * batch * g.token_width(), d_v->data() + l * batch * g.token_width()));
      KVCACHE_TRY(c->attend(l, ap, d_q->data() + l * q_count, d_out->data() + l * q_count, ws, opt));
    }
    return {};
  };

  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  const int total_steps = steps(30, 6), eager_steps = total_steps / 3;
  for (int step = 0; step < total_steps; ++step) {
    for (seq_id id : ids) KVCACHE_ASSERT_OK(c->reserve(id, 1));
    KVCACHE_ASSERT_OK(c->prepare(ids));
    std::vector<float> k = r.floats(g.layers * batch * g.token_width()), v = r.floats(k.size()), q = r.floats(g.layers * q_count);
    KVCACHE_ASSERT_OK(kvcache::copy_to_device(where, d_k->data(), k.data(), k.size() * 4));
    KVCACHE_ASSERT_OK(kvcache::copy_to_device(where, d_v->data(), v.data(), v.size() * 4));
    KVCACHE_ASSERT_OK(kvcache::copy_to_device(where, d_q->data(), q.data(), q.size() * 4));
    if (step < eager_steps) {
      KVCACHE_ASSERT_OK(enqueue_step());  // eager; also sizes the workspace before the capture
    } else {
      if (exec == nullptr) {
        ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
        const kvcache::result<void> captured = enqueue_step();
        ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
        KVCACHE_ASSERT_OK(captured);
        ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
      } else {
        // The replay writes every layer on the device; tell the host bookkeeping.
        KVCACHE_ASSERT_OK(c->mark_batch_written());
      }
      ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    }
    for (std::uint32_t b = 0; b < batch; ++b)
      for (std::uint32_t l = 0; l < g.layers; ++l)
        for (std::size_t i = 0; i < g.token_width(); ++i) {
          hist[b][2 * l].push_back(kvcache::to_float(kvcache::to_half(k[(l * batch + b) * g.token_width() + i])));
          hist[b][2 * l + 1].push_back(kvcache::to_float(kvcache::to_half(v[(l * batch + b) * g.token_width() + i])));
        }
    auto out = download(where, d_out->data(), g.layers * q_count);
    KVCACHE_ASSERT_OK(out);
    double worst = 0.0;
    for (std::uint32_t l = 0; l < g.layers; ++l)
      for (std::uint32_t b = 0; b < batch; ++b)
        for (std::uint32_t qh = 0; qh < q_heads; ++qh) {
          const std::uint32_t h = qh / (q_heads / g.kv_heads);
          const std::size_t len = hist[b][2 * l].size() / g.token_width();
          std::vector<float> kk, vv;
          for (std::size_t t = 0; t < len; ++t)
            for (std::uint32_t d = 0; d < g.head_dim; ++d) {
              kk.push_back(hist[b][2 * l][(t * g.kv_heads + h) * g.head_dim + d]);
              vv.push_back(hist[b][2 * l + 1][(t * g.kv_heads + h) * g.head_dim + d]);
            }
          const std::size_t o = l * q_count + (static_cast<std::size_t>(b) * q_heads + qh) * g.head_dim;
          const std::vector<double> want = reference_attention(q.data() + o, kk, vv, len, g.head_dim, 1.0 / std::sqrt(64.0));
          for (std::uint32_t d = 0; d < g.head_dim; ++d) worst = std::max(worst, std::abs(out.value()[o + d] - want[d]));
        }
    ASSERT_LT(worst, 2e-4) << "step " << step;
    for (seq_id id : ids) KVCACHE_ASSERT_OK(c->commit(id));
  }
  if (exec != nullptr) (void)cudaGraphExecDestroy(exec);
  if (graph != nullptr) (void)cudaGraphDestroy(graph);
  (void)cudaStreamDestroy(stream);
}

}  // namespace
