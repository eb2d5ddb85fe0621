// The CUDA kernels against the scalar CPU reference on fresh random inputs, ragged sizes
// included. Every test needs a device and skips with "no CUDA device: <reason>" without one.
#include "attend_cases.hpp"
#include "cuda_test_util.hpp"

#include <kvcache/cuda/kernels.hpp>
#include <kvcache/cuda/runtime.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

namespace {

using kvcache::format;
using kvcache::half;
using namespace kvcache_cuda_test;

// ---- append ----------------------------------------------------------------------------------

struct append_case {
  std::uint32_t kv_heads, head_dim, page_tokens;
  format src, dst;
};

// A batch of sequences with random old lengths and ragged new rows, pages in shuffled order;
// the whole pool is compared byte for byte with the host expectation (untouched bytes included).
void run_append(const append_case& c, bool single) {
  rng r;
  SCOPED_TRACE(r.trace());
  const kvcache::cuda where{};
  const std::uint32_t batch = single ? 1 : r.between(1, 5);
  const std::size_t elem = kvcache::dense_element_bytes(c.dst);
  std::vector<std::uint32_t> old_len(batch), n_new(batch), indptr{0}, src_indptr{0}, last(batch);
  std::uint32_t pages_total = 0;
  for (std::uint32_t b = 0; b < batch; ++b) {
    old_len[b] = r.between(0, 3 * c.page_tokens + 1);
    n_new[b] = r.between(b == 0 ? 1 : 0, 2 * c.page_tokens + 3);
    const std::uint32_t len = old_len[b] + n_new[b];
    const std::uint32_t np = (len + c.page_tokens - 1) / c.page_tokens;
    pages_total += np;
    indptr.push_back(pages_total);
    last[b] = np == 0 ? 0 : len - (np - 1) * c.page_tokens;
    src_indptr.push_back(src_indptr.back() + n_new[b]);
  }
  const std::uint32_t pool_pages = pages_total + 3;
  std::vector<std::uint32_t> perm(pool_pages);
  std::iota(perm.begin(), perm.end(), 0u);
  std::shuffle(perm.begin(), perm.end(), r.gen);
  std::vector<std::uint32_t> indices(perm.begin(), perm.begin() + pages_total);

  const std::size_t head_stride = static_cast<std::size_t>(c.page_tokens) * c.head_dim * elem + 32;  // padded
  const std::size_t page_stride = head_stride * c.kv_heads + 64;
  std::vector<std::uint8_t> pool_k(page_stride * pool_pages), pool_v(pool_k.size());
  for (auto& x : pool_k) x = static_cast<std::uint8_t>(r.between(0, 255));
  for (auto& x : pool_v) x = static_cast<std::uint8_t>(r.between(0, 255));

  const std::uint32_t rows = src_indptr.back();
  const std::size_t tw = static_cast<std::size_t>(c.kv_heads) * c.head_dim;
  std::vector<float> kf = r.floats(rows * tw, -4.0f, 4.0f), vf = r.floats(rows * tw, -4.0f, 4.0f);
  if (!kf.empty()) kf[0] = -0.0f;  // signed zero and a value that rounds to a subnormal half
  if (kf.size() > 1) kf[1] = 3.0e-6f;
  std::vector<half> kh(kf.size()), vh(vf.size());
  for (std::size_t i = 0; i < kf.size(); ++i) {
    kh[i] = kvcache::to_half(kf[i]);
    vh[i] = kvcache::to_half(vf[i]);
  }

  // Host expectation.
  std::vector<std::uint8_t> want_k = pool_k, want_v = pool_v;
  for (std::uint32_t b = 0; b < batch; ++b)
    for (std::uint32_t i = 0; i < n_new[b]; ++i) {
      const std::uint32_t row = src_indptr[b] + i, pos = old_len[b] + i;
      const std::uint32_t page = indices[indptr[b] + pos / c.page_tokens], slot = pos % c.page_tokens;
      for (std::uint32_t h = 0; h < c.kv_heads; ++h)
        for (std::uint32_t d = 0; d < c.head_dim; ++d) {
          const std::size_t si = (static_cast<std::size_t>(row) * c.kv_heads + h) * c.head_dim + d;
          const std::size_t off = page * page_stride + h * head_stride + (static_cast<std::size_t>(slot) * c.head_dim + d) * elem;
          const float xk = c.src == format::f32 ? kf[si] : kvcache::to_float(kh[si]);
          const float xv = c.src == format::f32 ? vf[si] : kvcache::to_float(vh[si]);
          if (c.dst == format::f32) {
            std::memcpy(&want_k[off], &xk, 4);
            std::memcpy(&want_v[off], &xv, 4);
          } else {
            const half hk = kvcache::to_half(xk), hv = kvcache::to_half(xv);
            std::memcpy(&want_k[off], &hk, 2);
            std::memcpy(&want_v[off], &hv, 2);
          }
        }
    }

  auto dk = upload(where, pool_k);
  auto dv = upload(where, pool_v);
  auto sk = c.src == format::f32 ? upload(where, std::vector<std::uint8_t>(reinterpret_cast<std::uint8_t*>(kf.data()), reinterpret_cast<std::uint8_t*>(kf.data() + kf.size())))
                                 : upload(where, std::vector<std::uint8_t>(reinterpret_cast<std::uint8_t*>(kh.data()), reinterpret_cast<std::uint8_t*>(kh.data() + kh.size())));
  auto sv = c.src == format::f32 ? upload(where, std::vector<std::uint8_t>(reinterpret_cast<std::uint8_t*>(vf.data()), reinterpret_cast<std::uint8_t*>(vf.data() + vf.size())))
                                 : upload(where, std::vector<std::uint8_t>(reinterpret_cast<std::uint8_t*>(vh.data()), reinterpret_cast<std::uint8_t*>(vh.data() + vh.size())));
  auto d_indptr = upload(where, indptr);
  auto d_indices = upload(where, indices);
  auto d_last = upload(where, last);
  auto d_src_indptr = upload(where, src_indptr);
  for (const auto* x : {&dk, &dv, &sk, &sv}) KVCACHE_ASSERT_OK(*x);
  for (const auto* x : {&d_indptr, &d_indices, &d_last, &d_src_indptr}) KVCACHE_ASSERT_OK(*x);

  kvcache::append_params p;
  p.dst.k = dk->data();
  p.dst.v = dv->data();
  p.dst.k_page_stride = p.dst.v_page_stride = page_stride;
  p.dst.k_head_stride = p.dst.v_head_stride = head_stride;
  p.dst.page_tokens = c.page_tokens;
  p.dst.k_format = p.dst.v_format = c.dst;
  p.k = sk->data();
  p.v = sv->data();
  p.src_format = c.src;
  p.kv_heads = c.kv_heads;
  p.head_dim = c.head_dim;
  if (single) {
    p.single_pages = d_indices->data();
    p.single_length = old_len[0] + n_new[0];
    p.max_rows = n_new[0];
  } else {
    p.table = {d_indptr->data(), d_indices->data(), d_last->data(), batch};
    p.src_indptr = d_src_indptr->data();
    p.max_rows = rows + 7;  // a loose grid bound: the extra rows must be skipped
  }
  KVCACHE_ASSERT_OK(kvcache::cuda_append(where, p));
  auto got_k = download(where, dk->data(), pool_k.size());
  auto got_v = download(where, dv->data(), pool_v.size());
  KVCACHE_ASSERT_OK(got_k);
  KVCACHE_ASSERT_OK(got_v);
  EXPECT_TRUE(got_k.value() == want_k) << "K pool differs";
  EXPECT_TRUE(got_v.value() == want_v) << "V pool differs";
}

TEST(cuda_kernels, append_matches_host_conversion) {
  KVCACHE_REQUIRE_CUDA();
  const append_case cases[] = {
      {1, 1, 1, format::f32, format::f16},   {2, 40, 16, format::f32, format::f16},
      {3, 64, 5, format::f16, format::f16},  {2, 128, 32, format::f32, format::f32},
      {4, 72, 16, format::f16, format::f32}, {1, 256, 7, format::f32, format::f16},
      {8, 130, 16, format::f16, format::f16},
  };
  for (const append_case& c : cases)
    for (bool single : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "kv_heads=" << c.kv_heads << " head_dim=" << c.head_dim << " page_tokens="
                                        << c.page_tokens << " single=" << single);
      run_append(c, single);
    }
}

// ---- Q4 migration ----------------------------------------------------------------------------

TEST(cuda_kernels, migrate_is_bit_identical_to_scalar_quantize) {
  KVCACHE_REQUIRE_CUDA();
  const kvcache::cuda where{};
  const std::uint32_t dims[] = {1, 31, 32, 40, 64, 100, 128, 256};
  const std::uint32_t token_counts[] = {1, 7, 31, 32};
  for (std::uint32_t D : dims)
    for (std::uint32_t tokens : token_counts) {
      rng r;
      SCOPED_TRACE(::testing::Message() << r.trace() << " head_dim=" << D << " tokens=" << tokens);
      const std::uint32_t layers = 2, kv_heads = 3, src_pages = 5, dst_pages = 4, count = 3;
      const std::size_t s_head = static_cast<std::size_t>(32) * D * sizeof(half);
      const std::size_t s_page = s_head * kv_heads;
      const std::size_t s_layer = s_page * src_pages;
      // One group per head, head strides padded by 4 bytes: each group is written whole, nothing past it.
      const std::size_t dk_group = kvcache::q4_key_group_bytes(D), dv_group = kvcache::q4_value_group_bytes(D);
      const std::size_t dk_head = dk_group + 4, dv_head = dv_group + 4;
      const std::size_t dk_page = dk_head * kv_heads, dv_page = dv_head * kv_heads;
      const std::size_t dk_layer = dk_page * dst_pages, dv_layer = dv_page * dst_pages;
      std::vector<half> sk = r.halves(s_layer / sizeof(half) * layers, -3.0f, 3.0f);
      std::vector<half> sv = r.halves(sk.size(), -3.0f, 3.0f);
      // Special groups: constant (scale 0), signed zeros, an outlier channel.
      for (std::uint32_t t = 0; t < 32; ++t) {
        sk[static_cast<std::size_t>(t) * D] = kvcache::to_half(0.25f);
        if (D > 1) sk[static_cast<std::size_t>(t) * D + 1] = kvcache::to_half(t % 2 ? -0.0f : 0.0f);
        if (D > 2) sk[static_cast<std::size_t>(t) * D + 2] = kvcache::to_half(t == 3 ? 900.0f : 0.5f);
        if (D > 3) sk[static_cast<std::size_t>(t) * D + 3] = kvcache::to_half(-0.0f);  // all -0: scale, min +0
      }
      for (std::uint32_t d = 0; d < std::min(D, 32u); ++d) sv[5 * D + d] = kvcache::to_half(-0.0f);  // a -0 value block
      std::vector<std::uint8_t> dk(dk_layer * layers), dv(dv_layer * layers);
      for (auto& x : dk) x = static_cast<std::uint8_t>(r.between(0, 255));
      for (auto& x : dv) x = static_cast<std::uint8_t>(r.between(0, 255));

      kvcache::migrate_params p;
      p.layers = layers;
      p.kv_heads = kv_heads;
      p.head_dim = D;
      p.count = count;
      p.tokens = tokens;
      const std::uint32_t srcs[] = {4, 0, 2}, dsts[] = {1, 3, 0};
      std::vector<std::uint8_t> want_k = dk, want_v = dv;
      for (std::uint32_t i = 0; i < count; ++i) {
        p.src_page[i] = srcs[i];
        p.dst_page[i] = dsts[i];
        for (std::uint32_t l = 0; l < layers; ++l)
          for (std::uint32_t h = 0; h < kv_heads; ++h) {
            const std::size_t so = (l * s_layer + srcs[i] * s_page + h * s_head) / sizeof(half);
            std::vector<std::uint8_t> kg(dk_group), vg(dv_group);  // whole groups, as the scalar quantizer writes them
            scalar().quantize_keys(sk.data() + so, D, tokens, D, kg.data());
            scalar().quantize_values(sv.data() + so, D, tokens, D, vg.data());
            std::memcpy(&want_k[l * dk_layer + dsts[i] * dk_page + h * dk_head], kg.data(), kg.size());
            std::memcpy(&want_v[l * dv_layer + dsts[i] * dv_page + h * dv_head], vg.data(), vg.size());
          }
      }
      auto d_sk = upload(where, sk);
      auto d_sv = upload(where, sv);
      auto d_dk = upload(where, dk);
      auto d_dv = upload(where, dv);
      for (const auto* x : {&d_dk, &d_dv}) KVCACHE_ASSERT_OK(*x);
      KVCACHE_ASSERT_OK(d_sk);
      KVCACHE_ASSERT_OK(d_sv);
      p.src.k = d_sk->data();
      p.src.v = d_sv->data();
      p.src.k_page_stride = p.src.v_page_stride = s_page;
      p.src.k_head_stride = p.src.v_head_stride = s_head;
      p.src.page_tokens = 32;
      p.src.k_format = p.src.v_format = format::f16;
      p.src_layer_stride_k = p.src_layer_stride_v = s_layer;
      p.dst.k = d_dk->data();
      p.dst.v = d_dv->data();
      p.dst.k_page_stride = dk_page;
      p.dst.v_page_stride = dv_page;
      p.dst.k_head_stride = dk_head;
      p.dst.v_head_stride = dv_head;
      p.dst.page_tokens = 32;
      p.dst.k_format = p.dst.v_format = format::q4;
      p.dst_layer_stride_k = dk_layer;
      p.dst_layer_stride_v = dv_layer;
      KVCACHE_ASSERT_OK(kvcache::cuda_migrate(where, p));
      auto got_k = download(where, d_dk->data(), dk.size());
      auto got_v = download(where, d_dv->data(), dv.size());
      KVCACHE_ASSERT_OK(got_k);
      KVCACHE_ASSERT_OK(got_v);
      EXPECT_TRUE(got_k.value() == want_k) << "Q4 keys differ from the scalar reference";
      EXPECT_TRUE(got_v.value() == want_v) << "Q4 values differ from the scalar reference";
    }
}

// ---- attention -------------------------------------------------------------------------------

struct device_segment {
  device_vector<std::uint8_t> k, v;
  device_vector<std::uint32_t> indptr, indices, last;
};

struct attend_case {
  std::uint32_t q_heads, kv_heads, head_dim;
  format kf0, vf0;
  std::uint32_t page_tokens0;
  bool two_segments;  // a second f16 segment of 16-token pages follows (the two-tier shape)
  std::uint32_t split_tokens;
  std::vector<std::uint32_t> lens;
  float q_scale = 1.0f;  // queries uniform in [-q_scale, q_scale]
  std::uint32_t prefetch = 0;  // attend_params::prefetch_steps
  bool bypass_l1 = false;      // attend_params::bypass_l1
};

void run_attend(const attend_case& c) {
  rng r;
  SCOPED_TRACE(r.trace());
  const kvcache::cuda where{};
  const std::uint32_t batch = static_cast<std::uint32_t>(c.lens.size());
  std::vector<segment_data> segs;
  segs.push_back(make_segment(r, c.kf0, c.vf0, c.page_tokens0, c.lens, c.kv_heads, c.head_dim));
  if (c.two_segments) {
    std::vector<std::uint32_t> tail(batch);
    for (auto& t : tail) t = r.between(0, 40);
    segs.push_back(make_segment(r, format::f16, format::f16, 16, tail, c.kv_heads, c.head_dim));
  }
  const std::size_t qn = static_cast<std::size_t>(batch) * c.q_heads * c.head_dim;
  std::vector<float> q = r.floats(qn);
  for (float& x : q) x *= c.q_scale;

  kvcache::attend_params p;
  p.segments = static_cast<std::uint32_t>(segs.size());
  p.batch = batch;
  p.q_heads = c.q_heads;
  p.kv_heads = c.kv_heads;
  p.head_dim = c.head_dim;
  p.split_tokens = c.split_tokens;
  p.prefetch_steps = c.prefetch;
  p.bypass_l1 = c.bypass_l1;
  std::vector<device_segment> dsegs(segs.size());
  for (std::size_t s = 0; s < segs.size(); ++s) {
    auto k = upload(where, segs[s].k_pool);
    auto v = upload(where, segs[s].v_pool);
    auto ip = upload(where, segs[s].indptr);
    auto ix = upload(where, segs[s].indices);
    auto la = upload(where, segs[s].last);
    KVCACHE_ASSERT_OK(k);
    KVCACHE_ASSERT_OK(v);
    KVCACHE_ASSERT_OK(ip);
    KVCACHE_ASSERT_OK(ix);
    KVCACHE_ASSERT_OK(la);
    dsegs[s] = {std::move(k).value(), std::move(v).value(), std::move(ip).value(), std::move(ix).value(), std::move(la).value()};
    kvcache::device_pages& pg = p.pages[s];
    pg.k = dsegs[s].k.data();
    pg.v = dsegs[s].v.data();
    pg.k_page_stride = segs[s].k_page;
    pg.v_page_stride = segs[s].v_page;
    pg.k_head_stride = segs[s].k_head;
    pg.v_head_stride = segs[s].v_head;
    pg.page_tokens = segs[s].page_tokens;
    pg.k_format = segs[s].kf;
    pg.v_format = segs[s].vf;
    p.tables[s] = {dsegs[s].indptr.data(), dsegs[s].indices.data(), dsegs[s].last.data(), batch};
    std::uint32_t longest = 0;
    for (std::uint32_t b = 0; b < batch; ++b)
      longest = std::max(longest, static_cast<std::uint32_t>(segs[s].k_dec[b].size() / (c.kv_heads * c.head_dim)));
    p.max_splits[s] = std::max(1u, (longest + c.split_tokens - 1) / c.split_tokens) + 1;  // one spare, empty split
  }
  auto dq = upload(where, q);
  auto dout = upload(where, std::vector<float>(qn, NAN));
  // NaN: the outputs of empty splits, which the kernels leave unwritten, must never be read.
  auto dws = upload(where, std::vector<float>(kvcache::cuda_attend_workspace_bytes(p) / sizeof(float), NAN));
  KVCACHE_ASSERT_OK(dq);
  KVCACHE_ASSERT_OK(dout);
  KVCACHE_ASSERT_OK(dws);
  p.q = dq->data();
  p.out = dout->data();
  p.workspace = dws->data();
  KVCACHE_ASSERT_OK(kvcache::cuda_attend(where, p));
  auto got = download(where, dout->data(), qn);
  KVCACHE_ASSERT_OK(got);
  if (c.bypass_l1) {  // the same arithmetic as the loads through L1: the same bytes
    p.bypass_l1 = false;
    KVCACHE_ASSERT_OK(kvcache::cuda_attend(where, p));
    auto through_l1 = download(where, dout->data(), qn);
    KVCACHE_ASSERT_OK(through_l1);
    EXPECT_EQ(std::memcmp(got->data(), through_l1->data(), qn * sizeof(float)), 0) << "bypass_l1 changed the output";
  }

  const double scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
  const std::uint32_t gqa = c.q_heads / c.kv_heads;
  double worst = 0.0;
  for (std::uint32_t b = 0; b < batch; ++b)
    for (std::uint32_t qh = 0; qh < c.q_heads; ++qh) {
      const std::uint32_t h = qh / gqa;
      std::vector<float> k, v;  // [token][head_dim] of kv head h over every segment
      for (const segment_data& s : segs) {
        const std::size_t n = s.k_dec[b].size() / (c.kv_heads * c.head_dim);
        for (std::size_t t = 0; t < n; ++t)
          for (std::uint32_t d = 0; d < c.head_dim; ++d) {
            k.push_back(s.k_dec[b][(t * c.kv_heads + h) * c.head_dim + d]);
            v.push_back(s.v_dec[b][(t * c.kv_heads + h) * c.head_dim + d]);
          }
      }
      const float* qrow = q.data() + (static_cast<std::size_t>(b) * c.q_heads + qh) * c.head_dim;
      const std::vector<double> want = reference_attention(qrow, k, v, k.size() / c.head_dim, c.head_dim, scale);
      for (std::uint32_t d = 0; d < c.head_dim; ++d) {
        const float g = got.value()[(static_cast<std::size_t>(b) * c.q_heads + qh) * c.head_dim + d];
        ASSERT_FALSE(std::isnan(g)) << "b=" << b << " qh=" << qh << " d=" << d;
        worst = std::max(worst, std::abs(static_cast<double>(g) - want[d]));
      }
    }
  // Values are within [-1, 1] (q4: within a few % of it), outputs are convex combinations: an
  // absolute bound reads as a relative one. Float accumulation over <= a few thousand tokens.
  EXPECT_LT(worst, 2e-4) << "max |gpu - float64 reference|";
}

TEST(cuda_kernels, attend_matches_float64_reference) {
  KVCACHE_REQUIRE_CUDA();
  const attend_case cases[] = {
      // q_heads, kv_heads, head_dim, k, v, page_tokens, two segments, split_tokens, lengths
      {1, 1, 1, format::f16, format::f16, 16, false, 32, {1, 2, 33}},
      {8, 2, 40, format::f16, format::f16, 16, false, 64, {0, 1, 31, 100, 257}},
      {32, 8, 128, format::f16, format::f16, 16, false, 512, {1500, 3, 513}},
      {4, 4, 64, format::f32, format::f32, 7, false, 32, {50, 0, 64}},
      {12, 1, 72, format::f16, format::f16, 1000, false, 128, {999, 130}},  // contiguous-like, gqa 12 > 8
      {16, 2, 256, format::f16, format::f16, 32, false, 256, {700, 64}},
      {8, 2, 64, format::q4, format::q4, 32, false, 64, {1, 32, 33, 300}},
      {8, 2, 40, format::q4, format::q4, 32, true, 96, {0, 31, 200}},  // two-tier shape, ragged head_dim
      {4, 1, 128, format::q4, format::f16, 32, true, 32, {129, 64}},
      {6, 3, 96, format::f16, format::q4, 32, false, 64, {95, 96, 97}},
      {4, 2, 30, format::q4, format::q4, 32, true, 32, {70, 3}},  // key channels padded to 32, a partial value column
      {2, 2, 1, format::q4, format::q4, 32, false, 64, {33, 64}},  // one channel: three padding key channels
      {8, 1, 250, format::q4, format::q4, 32, false, 128, {400}},  // 8 value columns, the last partial
      // attend_tc (f16 keys and values, head_dim 64 or 128): ragged steps and splits, queries of
      // any magnitude
      {32, 8, 128, format::f16, format::f16, 16, false, 256, {1, 8, 9, 16, 17, 31, 33, 1000, 4099}},
      {4, 4, 64, format::f16, format::f16, 16, false, 64, {5, 200, 16}},    // gqa 1
      {24, 2, 128, format::f16, format::f16, 24, false, 128, {300, 77}},    // gqa 12: two groups; page 24 divides
      {8, 1, 128, format::f16, format::f16, 5000, false, 512, {4999, 130}},  // contiguous-like, gqa 8
      {6, 2, 64, format::f16, format::f16, 5, false, 64, {47, 3, 1024}},   // gqa 3, pages of 5 tokens
      {8, 1, 128, format::f16, format::f16, 16, false, 64, {40, 300}, 1e-30f},  // tiny: uniform weights, no NaN from the head scale
      {8, 1, 128, format::f16, format::f16, 16, false, 64, {40, 300}, 1e30f},   // far above it: one token wins
      {4, 1, 64, format::f16, format::f16, 16, false, 64, {40, 300}, 300.0f},   // peaked softmax
      // ... asking L2 for 1 to 4 steps ahead
      {32, 8, 128, format::f16, format::f16, 16, false, 256, {1, 9, 17, 33, 1000, 4099}, 1.0f, 2},
      {6, 2, 64, format::f16, format::f16, 5, false, 96, {47, 3, 1024}, 1.0f, 1},
      {8, 1, 128, format::f16, format::f16, 5000, false, 512, {4999, 130}, 1.0f, 4},
      {32, 8, 128, format::q4, format::q4, 32, true, 256, {31, 1000}, 1.0f, 3},  // the f16 tail
      // ... loads that skip L1 (bypass_l1, without prefetch)
      {32, 8, 128, format::f16, format::f16, 16, false, 256, {1, 9, 17, 33, 1000, 4099}, 1.0f, 0, true},
      {6, 2, 64, format::f16, format::f16, 5, false, 96, {47, 3, 1024}, 1.0f, 0, true},
      {8, 1, 128, format::f16, format::f16, 5000, false, 512, {4999, 130}, 1.0f, 0, true},
      {32, 8, 128, format::q4, format::q4, 32, true, 256, {31, 1000}, 1.0f, 0, true},  // the f16 tail
      // attend_dense (f32 keys and values, and f16 of head_dim 256)
      {6, 2, 64, format::f32, format::f32, 8, false, 32, {47, 3, 1024}},    // gqa 3: a zero fourth query head
      {2, 1, 256, format::f32, format::f32, 16, false, 64, {130, 1}},
      {4, 1, 256, format::f16, format::f16, 16, false, 64, {37, 700}},
      // attend_q4 (q4 keys and values, head_dim 64, 128, 256)
      {32, 8, 128, format::q4, format::q4, 32, true, 256, {1, 31, 32, 33, 1000, 4099}},  // then an f16 tail
      {16, 2, 256, format::q4, format::q4, 32, false, 128, {700, 64}},  // gqa 8
      {3, 3, 64, format::q4, format::q4, 32, false, 96, {1, 95, 2000}},   // gqa 1
      // attend_merge over more splits than its 128 threads (158: two rounds), some of them empty
      {8, 2, 128, format::f16, format::f16, 16, false, 32, {5000, 100}},
      {12, 1, 128, format::q4, format::q4, 32, true, 64, {700}},          // gqa 12: groups of 8 and 4
      {6, 3, 128, format::q4, format::q4, 32, false, 32, {33, 64, 65}},   // gqa 2
  };
  for (attend_case c : cases) {
    for (std::uint32_t& len : c.lens) len = std::min<std::uint32_t>(len, static_cast<std::uint32_t>(steps(1 << 30, 96)));
    SCOPED_TRACE(::testing::Message() << "q_heads=" << c.q_heads << " kv_heads=" << c.kv_heads << " head_dim="
                                      << c.head_dim << " k=" << kvcache::to_string(c.kf0) << " v="
                                      << kvcache::to_string(c.vf0) << " page_tokens=" << c.page_tokens0
                                      << " two_segments=" << c.two_segments << " split=" << c.split_tokens);
    run_attend(c);
  }
}

}  // namespace
