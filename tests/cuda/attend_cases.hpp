#pragma once
// Synthetic paged K/V segments for the attention tests (device and emulated): pages in shuffled
// order, f32 / f16 / q4 (quantized by the scalar reference), and the decoded floats the float64
// reference attends over.
#include "cuda_test_util.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

namespace kvcache_cuda_test {

using kvcache::format;
using kvcache::half;

// One segment of a synthetic cache: pages in the given formats, with the decoded floats kept for
// the reference ([b][token][kv_head][head_dim] per sequence).
struct segment_data {
  format kf, vf;
  std::uint32_t page_tokens;
  std::size_t k_head, v_head, k_page, v_page;
  std::vector<std::uint8_t> k_pool, v_pool;
  std::vector<std::uint32_t> indptr{0}, indices, last;
  std::vector<std::vector<float>> k_dec, v_dec;  // [b] -> [token][kv_head][head_dim]
};

inline std::size_t dense_or_q4_head_bytes(format f, bool keys, std::uint32_t page_tokens, std::uint32_t D) {
  if (f != format::q4) return static_cast<std::size_t>(page_tokens) * D * kvcache::dense_element_bytes(f);
  return keys ? kvcache::q4_key_group_bytes(D) : kvcache::q4_value_group_bytes(D);  // one group: page_tokens is 32
}

/// Fills the codes, scales and minimums of a value group's token slots n..31 with garbage that
/// must never reach a result (format.hpp: unspecified; here NaN and infinite scales and minimums,
/// arbitrary codes), as a group whose slots held other tokens before would.
inline void poison_value_slots(std::uint8_t* group, std::uint32_t n, std::uint32_t D) {
  const std::uint16_t bad[] = {0x7e00, 0x7c00, 0xfc00, 0x7bff};  // NaN, +inf, -inf, 65504
  auto* scales = reinterpret_cast<std::uint16_t*>(group + kvcache::q4_value_scales_offset(D));
  auto* mins = reinterpret_cast<std::uint16_t*>(group + kvcache::q4_value_mins_offset(D));
  for (std::uint32_t g = 0; g < kvcache::q4_value_blocks(D); ++g)
    for (std::uint32_t t = n; t < kvcache::q4_group; ++t) {
      scales[g * kvcache::q4_group + t] = bad[(g + t) % 4];
      mins[g * kvcache::q4_group + t] = bad[(g + t + 1) % 4];
      for (std::uint32_t j = 0; j < kvcache::q4_group / 2; ++j)
        group[kvcache::q4_value_code_byte(t, g * kvcache::q4_group + j)] = static_cast<std::uint8_t>(0x5a + 7 * t + j);
    }
}

inline segment_data make_segment(rng& r, format kf, format vf, std::uint32_t page_tokens, const std::vector<std::uint32_t>& lens,
                          std::uint32_t kv_heads, std::uint32_t D) {
  segment_data s;
  s.kf = kf;
  s.vf = vf;
  s.page_tokens = page_tokens;
  s.k_head = dense_or_q4_head_bytes(kf, true, page_tokens, D);
  s.v_head = dense_or_q4_head_bytes(vf, false, page_tokens, D);
  s.k_page = s.k_head * kv_heads;
  s.v_page = s.v_head * kv_heads;
  std::uint32_t total = 0;
  for (std::uint32_t len : lens) total += (len + page_tokens - 1) / page_tokens;
  const std::uint32_t pool_pages = total + 2;
  std::vector<std::uint32_t> perm(pool_pages);
  std::iota(perm.begin(), perm.end(), 0u);
  std::shuffle(perm.begin(), perm.end(), r.gen);
  s.k_pool.assign(s.k_page * pool_pages, 0);
  s.v_pool.assign(s.v_page * pool_pages, 0);
  const std::size_t tw = static_cast<std::size_t>(kv_heads) * D;
  std::uint32_t next = 0;
  for (std::uint32_t len : lens) {
    const std::uint32_t np = (len + page_tokens - 1) / page_tokens;
    std::vector<float> kd(len * tw), vd(len * tw);
    for (std::uint32_t pi = 0; pi < np; ++pi) {
      const std::uint32_t page = perm[next++];
      s.indices.push_back(page);
      const std::uint32_t n = std::min(page_tokens, len - pi * page_tokens);
      for (std::uint32_t h = 0; h < kv_heads; ++h) {
        std::vector<half> kh = r.halves(static_cast<std::size_t>(n) * D), vh = r.halves(static_cast<std::size_t>(n) * D);
        if (h == 0 && D > 3)  // an outlier key channel
          for (std::uint32_t t = 0; t < n; ++t) kh[static_cast<std::size_t>(t) * D + 3] = kvcache::to_half(8.0f + r.uniform());
        std::vector<float> kx(static_cast<std::size_t>(n) * D), vx(kx.size());
        std::uint8_t* kp = &s.k_pool[page * s.k_page + h * s.k_head];
        std::uint8_t* vp = &s.v_pool[page * s.v_page + h * s.v_head];
        if (kf == format::q4) {  // straight into the page: the quantizer writes the whole group
          scalar().quantize_keys(kh.data(), D, n, D, kp);
          scalar().dequantize_keys(kp, n, D, kx.data(), D);
        } else if (kf == format::f16) {
          std::memcpy(kp, kh.data(), kh.size() * sizeof(half));
          scalar().f16_to_f32(kh.data(), kx.data(), kh.size());
        } else {
          scalar().f16_to_f32(kh.data(), kx.data(), kh.size());
          std::memcpy(kp, kx.data(), kx.size() * sizeof(float));
        }
        if (vf == format::q4) {
          scalar().quantize_values(vh.data(), D, n, D, vp);
          if (n < kvcache::q4_group) poison_value_slots(vp, n, D);
          scalar().dequantize_values(vp, 0, n, D, vx.data(), D);
        } else if (vf == format::f16) {
          std::memcpy(vp, vh.data(), vh.size() * sizeof(half));
          scalar().f16_to_f32(vh.data(), vx.data(), vh.size());
        } else {
          scalar().f16_to_f32(vh.data(), vx.data(), vh.size());
          std::memcpy(vp, vx.data(), vx.size() * sizeof(float));
        }
        for (std::uint32_t t = 0; t < n; ++t)
          for (std::uint32_t d = 0; d < D; ++d) {
            const std::size_t tok = pi * page_tokens + t;
            kd[(tok * kv_heads + h) * D + d] = kx[static_cast<std::size_t>(t) * D + d];
            vd[(tok * kv_heads + h) * D + d] = vx[static_cast<std::size_t>(t) * D + d];
          }
      }
    }
    s.indptr.push_back(static_cast<std::uint32_t>(s.indices.size()));
    s.last.push_back(np == 0 ? 0 : len - (np - 1) * page_tokens);
    s.k_dec.push_back(std::move(kd));
    s.v_dec.push_back(std::move(vd));
  }
  // A segment without pages (every length 0) still hands attend an indices array, as the caches'
  // device tables do: validate_attend rejects a null one. One entry past indptr's last, unused.
  if (s.indices.empty()) s.indices.push_back(0);
  return s;
}


/// Tokens of sequence b in segment s.
inline std::size_t segment_tokens(const segment_data& s, std::size_t b, std::size_t token_width) {
  return s.k_dec[b].size() / token_width;
}

/// Float64 reference of every (sequence, query head) over the segments in order; returns
/// [batch][q_heads][head_dim].
inline std::vector<double> reference_over(const std::vector<segment_data>& segs, const std::vector<float>& q,
                                          std::uint32_t batch, std::uint32_t q_heads, std::uint32_t kv_heads,
                                          std::uint32_t D) {
  std::vector<double> out(static_cast<std::size_t>(batch) * q_heads * D);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  const std::uint32_t gqa = q_heads / kv_heads;
  for (std::uint32_t b = 0; b < batch; ++b)
    for (std::uint32_t qh = 0; qh < q_heads; ++qh) {
      const std::uint32_t h = qh / gqa;
      std::vector<float> k, v;
      for (const segment_data& s : segs) {
        const std::size_t n = segment_tokens(s, b, static_cast<std::size_t>(kv_heads) * D);
        for (std::size_t t = 0; t < n; ++t)
          for (std::uint32_t d = 0; d < D; ++d) {
            k.push_back(s.k_dec[b][(t * kv_heads + h) * D + d]);
            v.push_back(s.v_dec[b][(t * kv_heads + h) * D + d]);
          }
      }
      const std::size_t o = (static_cast<std::size_t>(b) * q_heads + qh) * D;
      const std::vector<double> r = reference_attention(q.data() + o, k, v, k.size() / D, D, scale);
      std::copy(r.begin(), r.end(), out.begin() + static_cast<std::ptrdiff_t>(o));
    }
  return out;
}

}  // namespace kvcache_cuda_test
