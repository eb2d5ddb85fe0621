// The CUDA kernels' code (cuda/append_kernels.cuh, cuda/attend_kernels.cuh: kernels, validation
// and launchers) run on the CPU through tests/cuda/emulator.hpp, against the same references as
// the device tests. Needs no GPU: this is what stands in for a GPU run where there is none. It
// checks the kernels' logic, not nvcc's code generation or the hardware (see emulator.hpp).
#include "emulator.hpp"  // first: defines the CUDA keywords the kernel headers use

#include "append_kernels.cuh"
#include "attend_cases.hpp"
#include "attend_kernels.cuh"
#include "cuda_test_util.hpp"

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

// The launch callback of the launch_* templates, running the grid on the CPU.
auto emulate = [](auto kernel, dim3 grid, dim3 block, auto... args) -> kvcache::result<void> {
  return kvcache_emu::launch<kvcache::result<void>>(kernel, grid, block, args...);
};

struct attend_case {
  std::uint32_t q_heads, kv_heads, head_dim;
  format kf, vf;
  std::uint32_t page_tokens;
  bool two_segments;
  std::uint32_t split_tokens;
  std::vector<std::uint32_t> lens;
  float q_scale = 1.0f;  // queries uniform in [-q_scale, q_scale]
  std::uint32_t prefetch = 0;  // attend_params::prefetch_steps
  bool bypass_l1 = false;      // attend_params::bypass_l1
};

TEST(cuda_emulated, attend_kernels_match_float64_reference) {
  const attend_case cases[] = {
      {1, 1, 1, format::f16, format::f16, 16, false, 32, {1, 2, 33}},
      {8, 2, 40, format::f16, format::f16, 16, false, 64, {0, 1, 31, 100, 130}},
      {4, 4, 64, format::f32, format::f32, 7, false, 32, {50, 0, 64}},
      {12, 1, 72, format::f16, format::f16, 160, false, 32, {159, 130}},  // one page per sequence, gqa 12 > 8
      {16, 2, 256, format::f16, format::f16, 32, false, 64, {96, 64}},
      {8, 2, 64, format::q4, format::q4, 32, false, 64, {1, 32, 33, 100}},
      {8, 2, 40, format::q4, format::q4, 32, true, 64, {0, 31, 100}},  // two-tier shape, ragged head_dim
      {4, 1, 128, format::q4, format::f16, 32, true, 32, {129, 64}},
      {6, 3, 96, format::f16, format::q4, 32, false, 64, {95, 96, 97}},
      {4, 2, 30, format::q4, format::q4, 32, true, 32, {70, 3}},  // key channels padded to 32, a partial value column
      {2, 2, 1, format::q4, format::q4, 32, false, 64, {33, 64}},  // one channel: three padding key channels
      // attend_tc (f16 keys and values, head_dim 64 or 128): steps of 16 tokens, ragged at both
      // ends of a split; queries of any magnitude (each head scaled by a power of two into f16)
      {8, 2, 128, format::f16, format::f16, 16, false, 64, {1, 8, 9, 17, 90}},
      {4, 4, 64, format::f16, format::f16, 16, false, 32, {15, 16, 50}},  // gqa 1
      {24, 2, 128, format::f16, format::f16, 24, false, 64, {70, 33}},     // gqa 12: two groups; page 24 divides
      {6, 2, 64, format::f16, format::f16, 5, false, 32, {47, 3}},         // gqa 3, pages of 5 tokens
      {8, 1, 128, format::f16, format::f16, 16, false, 64, {40}, 1e-30f},  // tiny: uniform weights, no NaN from the head scale
      {8, 1, 128, format::f16, format::f16, 16, false, 64, {40}, 1e30f},   // far above it: one token wins
      {4, 1, 64, format::f16, format::f16, 16, false, 32, {40}, 300.0f},   // peaked softmax
      // ... asking L2 for 1 to 4 steps ahead (the emulation reads a byte of each line asked for)
      {8, 2, 128, format::f16, format::f16, 16, false, 64, {1, 8, 9, 17, 90}, 1.0f, 1},
      {6, 2, 64, format::f16, format::f16, 5, false, 96, {47, 3, 200}, 1.0f, 2},
      {8, 1, 128, format::f16, format::f16, 300, false, 256, {299, 130}, 1.0f, 4},
      {4, 1, 128, format::q4, format::q4, 32, true, 32, {129, 64}, 1.0f, 3},  // the f16 tail
      // ... loads that skip L1 (bypass_l1: the emulation reads them as any load)
      {8, 2, 128, format::f16, format::f16, 16, false, 64, {1, 8, 9, 17, 90}, 1.0f, 0, true},
      {6, 2, 64, format::f16, format::f16, 5, false, 96, {47, 3, 200}, 1.0f, 0, true},
      // attend_dense (f32, and f16 of head_dim 256): steps of 4 (f32, 64), 2 (f32, 256) and 4
      // (f16, 256) tokens
      {6, 2, 64, format::f32, format::f32, 8, false, 32, {47, 3}},  // gqa 3: a zero fourth query head
      {2, 1, 256, format::f32, format::f32, 16, false, 32, {45}},
      {4, 1, 256, format::f16, format::f16, 16, false, 32, {37}},
      // attend_q4 (q4 keys and values, head_dim 64, 128, 256); {8, 2, 64} above is one too
      {4, 1, 128, format::q4, format::q4, 32, true, 32, {129, 64}},   // then an f16 tail (attend_dense)
      {16, 2, 256, format::q4, format::q4, 32, false, 64, {40, 96}},  // gqa 8
      {3, 3, 64, format::q4, format::q4, 32, false, 96, {1, 95}},     // gqa 1
      {12, 1, 128, format::q4, format::q4, 32, true, 64, {70}},       // gqa 12: groups of 8 and 4
      {4, 2, 128, format::q4, format::q4, 32, false, 32, {33, 64}},   // gqa 2
      // attend_merge over more splits than its threads (142: two rounds of 128), unwritten
      // outputs of empty splits (the NaN workspace) never read
      {4, 1, 64, format::f16, format::f16, 16, false, 32, {4500, 0}},
  };
  for (const attend_case& c : cases) {
    rng r;
    SCOPED_TRACE(::testing::Message() << r.trace() << " q_heads=" << c.q_heads << " kv_heads=" << c.kv_heads
                                      << " head_dim=" << c.head_dim << " k=" << kvcache::to_string(c.kf)
                                      << " v=" << kvcache::to_string(c.vf) << " page=" << c.page_tokens
                                      << " two_segments=" << c.two_segments);
    const auto batch = static_cast<std::uint32_t>(c.lens.size());
    std::vector<segment_data> segs;
    segs.push_back(make_segment(r, c.kf, c.vf, c.page_tokens, c.lens, c.kv_heads, c.head_dim));
    if (c.two_segments) {
      std::vector<std::uint32_t> tail(batch);
      for (auto& t : tail) t = r.between(0, 40);
      segs.push_back(make_segment(r, format::f16, format::f16, 32, tail, c.kv_heads, c.head_dim));
    }
    std::vector<float> q = r.floats(static_cast<std::size_t>(batch) * c.q_heads * c.head_dim);
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
    for (std::size_t s = 0; s < segs.size(); ++s) {
      kvcache::device_pages& pg = p.pages[s];
      pg.k = segs[s].k_pool.data();
      pg.v = segs[s].v_pool.data();
      pg.k_page_stride = segs[s].k_page;
      pg.v_page_stride = segs[s].v_page;
      pg.k_head_stride = segs[s].k_head;
      pg.v_head_stride = segs[s].v_head;
      pg.page_tokens = segs[s].page_tokens;
      pg.k_format = segs[s].kf;
      pg.v_format = segs[s].vf;
      p.tables[s] = {segs[s].indptr.data(), segs[s].indices.data(), segs[s].last.data(), batch};
      std::size_t longest = 0;
      for (std::uint32_t b = 0; b < batch; ++b)
        longest = std::max(longest, segment_tokens(segs[s], b, static_cast<std::size_t>(c.kv_heads) * c.head_dim));
      p.max_splits[s] = static_cast<std::uint32_t>((longest + c.split_tokens - 1) / c.split_tokens) + 1;  // one empty split
    }
    // [batch][q_heads][splits][2 + head_dim] partial states (cuda_attend_workspace_bytes, which
    // lives in kvcache::cuda: this test links only kvcache::cpu).
    const std::size_t splits = p.max_splits[0] + (p.segments == 2 ? p.max_splits[1] : 0u);
    std::vector<float> out(q.size(), NAN), ws(batch * c.q_heads * splits * (2 + c.head_dim), NAN);
    p.q = q.data();
    p.out = out.data();
    p.workspace = ws.data();
    KVCACHE_ASSERT_OK(kvcache::validate_attend(p));
    KVCACHE_ASSERT_OK(kvcache::launch_attend(p, emulate));
    const std::vector<double> want = reference_over(segs, q, batch, c.q_heads, c.kv_heads, c.head_dim);
    double worst = 0.0;
    for (std::size_t i = 0; i < out.size(); ++i) {
      ASSERT_FALSE(std::isnan(out[i])) << "output " << i;
      worst = std::max(worst, std::abs(out[i] - want[i]));
    }
    EXPECT_LT(worst, 2e-4);
  }
}

// Which segments attend_dense takes: both formats dense and equal, head_dim 64, 128 or 256, every
// row 16-byte aligned; the others go to attend_partial (covered above: head_dim 40, 72, 96, q4...).
TEST(cuda_emulated, dense_path_needs_equal_dense_formats_and_aligned_rows) {
  alignas(16) static std::uint8_t pool[64];
  kvcache::attend_params p;
  p.head_dim = 128;
  kvcache::device_pages& pg = p.pages[0];
  pg.k = pool;
  pg.v = pool + 16;
  pg.k_page_stride = pg.v_page_stride = 16 * 128 * 2 * 8;
  pg.k_head_stride = pg.v_head_stride = 16 * 128 * 2;
  pg.k_format = pg.v_format = format::f16;
  EXPECT_TRUE(kvcache::dense_fast_path(p, 0));
  pg.k_format = pg.v_format = format::f32;
  EXPECT_TRUE(kvcache::dense_fast_path(p, 0));
  for (const std::uint32_t d : {64u, 256u}) {
    p.head_dim = d;
    EXPECT_TRUE(kvcache::dense_fast_path(p, 0)) << d;
  }
  for (const std::uint32_t d : {32u, 40u, 96u, 255u}) {
    p.head_dim = d;
    EXPECT_FALSE(kvcache::dense_fast_path(p, 0)) << d;
  }
  p.head_dim = 128;
  pg.v_format = format::f16;
  EXPECT_FALSE(kvcache::dense_fast_path(p, 0)) << "mixed formats";
  pg.k_format = pg.v_format = format::q4;
  EXPECT_FALSE(kvcache::dense_fast_path(p, 0)) << "q4";
  pg.k_format = pg.v_format = format::f16;
  pg.v = pool + 8;
  EXPECT_FALSE(kvcache::dense_fast_path(p, 0)) << "v 8-byte aligned";
  pg.v = pool + 16;
  pg.k_head_stride = 16 * 128 * 2 + 8;
  EXPECT_FALSE(kvcache::dense_fast_path(p, 0)) << "head stride";
  pg.k_head_stride = 16 * 128 * 2;
  pg.v_page_stride += 4;
  EXPECT_FALSE(kvcache::dense_fast_path(p, 0)) << "page stride";
}

TEST(cuda_emulated, append_kernel_scatters_like_the_host) {
  for (const format src : {format::f32, format::f16})
    for (const format dst : {format::f32, format::f16})
      for (std::uint32_t page : {1u, 5u, 16u}) {
        rng r;
        SCOPED_TRACE(::testing::Message() << r.trace() << " src=" << kvcache::to_string(src) << " dst="
                                          << kvcache::to_string(dst) << " page=" << page);
        const std::uint32_t kv_heads = 2, D = 40, batch = 4;
        const std::size_t elem = kvcache::dense_element_bytes(dst), tw = kv_heads * D;
        std::vector<std::uint32_t> old_len(batch), n_new(batch), indptr{0}, src_indptr{0}, last(batch);
        std::uint32_t pages = 0;
        for (std::uint32_t b = 0; b < batch; ++b) {
          old_len[b] = r.between(0, 2 * page + 1);
          n_new[b] = r.between(b == 0 ? 1 : 0, page + 3);
          const std::uint32_t len = old_len[b] + n_new[b], np = (len + page - 1) / page;
          pages += np;
          indptr.push_back(pages);
          last[b] = np == 0 ? 0 : len - (np - 1) * page;
          src_indptr.push_back(src_indptr.back() + n_new[b]);
        }
        std::vector<std::uint32_t> indices(pages + 2);
        std::iota(indices.begin(), indices.end(), 0u);
        std::shuffle(indices.begin(), indices.end(), r.gen);
        const std::size_t head_stride = page * D * elem + 16, page_stride = head_stride * kv_heads + 32;
        std::vector<std::uint8_t> pool(page_stride * (pages + 2));
        for (auto& x : pool) x = static_cast<std::uint8_t>(r.between(0, 255));
        std::vector<std::uint8_t> pool_v = pool;
        const std::uint32_t rows = src_indptr.back();
        std::vector<float> kf = r.floats(rows * tw, -3.0f, 3.0f), vf = r.floats(rows * tw);
        std::vector<half> kh(kf.size()), vh(vf.size());
        for (std::size_t i = 0; i < kf.size(); ++i) {
          kh[i] = kvcache::to_half(kf[i]);
          vh[i] = kvcache::to_half(vf[i]);
        }
        std::vector<std::uint8_t> want_k = pool, want_v = pool_v;
        for (std::uint32_t b = 0; b < batch; ++b)
          for (std::uint32_t i = 0; i < n_new[b]; ++i) {
            const std::uint32_t row = src_indptr[b] + i, pos = old_len[b] + i;
            const std::uint32_t pg = indices[indptr[b] + pos / page], slot = pos % page;
            for (std::uint32_t h = 0; h < kv_heads; ++h)
              for (std::uint32_t d = 0; d < D; ++d) {
                const std::size_t si = (static_cast<std::size_t>(row) * kv_heads + h) * D + d;
                const std::size_t off = pg * page_stride + h * head_stride + (static_cast<std::size_t>(slot) * D + d) * elem;
                for (int kv = 0; kv < 2; ++kv) {
                  const float x = src == format::f32 ? (kv == 0 ? kf : vf)[si] : kvcache::to_float((kv == 0 ? kh : vh)[si]);
                  std::uint8_t* w = (kv == 0 ? want_k : want_v).data() + off;
                  if (dst == format::f32) {
                    std::memcpy(w, &x, 4);
                  } else {
                    const half hx = kvcache::to_half(x);
                    std::memcpy(w, &hx, 2);
                  }
                }
              }
          }
        kvcache::append_params p;
        p.dst.k = pool.data();
        p.dst.v = pool_v.data();
        p.dst.k_page_stride = p.dst.v_page_stride = page_stride;
        p.dst.k_head_stride = p.dst.v_head_stride = head_stride;
        p.dst.page_tokens = page;
        p.dst.k_format = p.dst.v_format = dst;
        p.k = src == format::f32 ? static_cast<const void*>(kf.data()) : kh.data();
        p.v = src == format::f32 ? static_cast<const void*>(vf.data()) : vh.data();
        p.src_format = src;
        p.table = {indptr.data(), indices.data(), last.data(), batch};
        p.src_indptr = src_indptr.data();
        p.max_rows = rows + 3;
        p.kv_heads = kv_heads;
        p.head_dim = D;
        KVCACHE_ASSERT_OK(kvcache::validate_append(p));
        KVCACHE_ASSERT_OK(kvcache::launch_append(p, emulate));
        EXPECT_TRUE(pool == want_k);
        EXPECT_TRUE(pool_v == want_v);
      }
}

TEST(cuda_emulated, migrate_kernel_is_bit_identical_to_scalar_quantize) {
  for (std::uint32_t D : {1u, 31u, 40u, 64u, 100u})
    for (std::uint32_t tokens : {1u, 7u, 32u})
      for (const format kf : {format::q4, format::f16}) {
        rng r;
        SCOPED_TRACE(::testing::Message() << r.trace() << " head_dim=" << D << " tokens=" << tokens
                                          << " key store=" << kvcache::to_string(kf));
        const std::uint32_t kv_heads = 2, layers = 2;
        const std::size_t s_head = 32 * D, s_page = s_head * kv_heads, s_layer = s_page * 3;  // halves
        std::vector<half> sk = r.halves(s_layer * layers, -3.0f, 3.0f), sv = r.halves(s_layer * layers);
        for (std::uint32_t t = 0; t < 32 && D > 2; ++t) {  // constant, signed-zero and outlier channels
          sk[t * D] = kvcache::to_half(0.25f);
          sk[t * D + 1] = kvcache::to_half(t % 2 ? -0.0f : 0.0f);
          sk[t * D + 2] = kvcache::to_half(t == 3 ? 900.0f : 0.5f);
          if (D > 3) sk[t * D + 3] = kvcache::to_half(-0.0f);  // all -0: scale and minimum +0
        }
        for (std::uint32_t d = 0; d < std::min(D, 32u); ++d) sv[5 * D + d] = kvcache::to_half(-0.0f);  // a -0 value block
        // Head strides padded by 12 bytes: the kernel writes each group whole and nothing past it.
        const std::size_t dk_group = kf == format::q4 ? kvcache::q4_key_group_bytes(D) : 32 * D * sizeof(half);
        const std::size_t dv_group = kvcache::q4_value_group_bytes(D);
        const std::size_t dk_head = dk_group + 12, dv_head = dv_group + 12;
        const std::size_t dk_layer = dk_head * kv_heads * 2, dv_layer = dv_head * kv_heads * 2;
        std::vector<std::uint8_t> dk(dk_layer * layers, 0xAB), dv(dv_layer * layers, 0xCD);
        std::vector<std::uint8_t> want_k = dk, want_v = dv;
        const std::uint32_t src_page[2] = {2, 0}, dst_page[2] = {1, 0};
        for (std::uint32_t i = 0; i < 2; ++i)
          for (std::uint32_t l = 0; l < layers; ++l)
            for (std::uint32_t h = 0; h < kv_heads; ++h) {
              const half* src_k = sk.data() + l * s_layer + src_page[i] * s_page + h * s_head;
              const half* src_v = sv.data() + l * s_layer + src_page[i] * s_page + h * s_head;
              std::uint8_t* wk = want_k.data() + l * dk_layer + (dst_page[i] * kv_heads + h) * dk_head;
              std::uint8_t* wv = want_v.data() + l * dv_layer + (dst_page[i] * kv_heads + h) * dv_head;
              if (kf == format::q4) {  // the whole group, as the scalar quantizer writes it
                std::vector<std::uint8_t> kg(dk_group);
                scalar().quantize_keys(src_k, D, tokens, D, kg.data());
                std::memcpy(wk, kg.data(), kg.size());
              } else {
                std::memcpy(wk, src_k, static_cast<std::size_t>(tokens) * D * sizeof(half));
              }
              std::vector<std::uint8_t> vg(dv_group);
              scalar().quantize_values(src_v, D, tokens, D, vg.data());
              std::memcpy(wv, vg.data(), vg.size());
            }
        kvcache::migrate_params p;
        p.src.k = sk.data();
        p.src.v = sv.data();
        p.src.k_page_stride = p.src.v_page_stride = s_page * sizeof(half);
        p.src.k_head_stride = p.src.v_head_stride = s_head * sizeof(half);
        p.src.page_tokens = 32;
        p.src.k_format = p.src.v_format = format::f16;
        p.src_layer_stride_k = p.src_layer_stride_v = s_layer * sizeof(half);
        p.dst.k = dk.data();
        p.dst.v = dv.data();
        p.dst.k_page_stride = dk_head * kv_heads;
        p.dst.v_page_stride = dv_head * kv_heads;
        p.dst.k_head_stride = dk_head;
        p.dst.v_head_stride = dv_head;
        p.dst.page_tokens = 32;
        p.dst.k_format = kf;
        p.dst.v_format = format::q4;
        p.dst_layer_stride_k = dk_layer;
        p.dst_layer_stride_v = dv_layer;
        p.layers = layers;
        p.kv_heads = kv_heads;
        p.head_dim = D;
        p.count = 2;
        p.tokens = tokens;
        for (std::uint32_t i = 0; i < 2; ++i) {
          p.src_page[i] = src_page[i];
          p.dst_page[i] = dst_page[i];
        }
        KVCACHE_ASSERT_OK(kvcache::validate_migrate(p));
        KVCACHE_ASSERT_OK(kvcache::launch_migrate(p, emulate));
        EXPECT_TRUE(dk == want_k) << "keys differ from the scalar reference";
        EXPECT_TRUE(dv == want_v) << "values differ from the scalar reference";
      }
}

}  // namespace
