// Scalar reference kernels: the oracle every SIMD and CUDA implementation is tested against.
#include "kernels_internal.hpp"

#include <algorithm>
#include <cmath>

namespace kvcache::kernels::scalar {
namespace {

void f32_to_f16(const float* src, half* dst, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) dst[i] = to_half(src[i]);
}

void f16_to_f32(const half* src, float* dst, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

void set_code(q4_block& b, std::uint32_t i, std::uint32_t c) {
  if (i < 16) b.codes[i] = static_cast<std::uint8_t>((b.codes[i] & 0xf0u) | c);
  else b.codes[i - 16] = static_cast<std::uint8_t>((b.codes[i - 16] & 0x0fu) | (c << 4));
}

// Quantizes n (1..32) values x[i * stride]. The inputs are halves, so the minimum is exact in
// FP16; the scale is rounded *up* to FP16 so that min + 15 * scale covers the maximum and every
// value lies within half a step of its code.
void quantize_group(const half* x, std::size_t stride, std::uint32_t n, q4_block& b) {
  float mn = to_float(x[0]);
  float mx = mn;
  for (std::uint32_t i = 1; i < n; ++i) {
    const float f = to_float(x[i * stride]);
    mn = std::min(mn, f);
    mx = std::max(mx, f);
  }
  b = q4_block{};
  // + 0.0f turns -0 into +0, so the stored minimum does not depend on which zero min() kept
  // (SIMD min reductions compare in another order). Groups containing NaN get unspecified codes.
  b.min = to_half(mn + 0.0f);
  const float minf = to_float(b.min);
  const float step = (mx - minf) / 15.0f + 0.0f;  // + 0.0f: a zero range gives +0, whichever zero max() kept
  b.scale = scale_round_up(step);
  const float s = to_float(b.scale);
  const float inv = s > 0.0f ? 1.0f / s : 0.0f;
  for (std::uint32_t i = 0; i < n; ++i) {
    float c = (to_float(x[i * stride]) - minf) * inv;
    c = !(c >= 0.0f) ? 0.0f : (c > 15.0f ? 15.0f : c);
    set_code(b, i, static_cast<std::uint32_t>(c + 0.5f));
  }
}

void quantize_keys(const half* src, std::size_t src_stride, std::uint32_t tokens,
                   std::uint32_t head_dim, q4_block* dst) {
  for (std::uint32_t d = 0; d < head_dim; ++d) quantize_group(src + d, src_stride, tokens, dst[d]);
}

void dequantize_keys(const q4_block* src, std::uint32_t tokens, std::uint32_t head_dim, float* dst,
                     std::size_t dst_stride) {
  for (std::uint32_t d = 0; d < head_dim; ++d) {
    const float s = to_float(src[d].scale), m = to_float(src[d].min);
    for (std::uint32_t t = 0; t < tokens; ++t)
      dst[t * dst_stride + d] = m + s * static_cast<float>(q4_code(src[d], t));
  }
}

void quantize_values(const half* src, std::size_t src_stride, std::uint32_t tokens,
                     std::uint32_t head_dim, q4_block* dst) {
  const std::uint32_t nb = q4_value_blocks(head_dim);
  for (std::uint32_t t = 0; t < tokens; ++t)
    for (std::uint32_t g = 0; g < nb; ++g) {
      const std::uint32_t n = std::min(q4_group, head_dim - g * q4_group);
      quantize_group(src + t * src_stride + g * q4_group, 1, n, dst[t * nb + g]);
    }
}

void dequantize_values(const q4_block* src, std::uint32_t tokens, std::uint32_t head_dim, float* dst,
                       std::size_t dst_stride) {
  const std::uint32_t nb = q4_value_blocks(head_dim);
  for (std::uint32_t t = 0; t < tokens; ++t)
    for (std::uint32_t d = 0; d < head_dim; ++d) {
      const q4_block& b = src[t * nb + d / q4_group];
      dst[t * dst_stride + d] = to_float(b.min) + to_float(b.scale) * static_cast<float>(q4_code(b, d % q4_group));
    }
}

template <class K>
void scores_dense(const float* q, std::uint32_t nq, const K* k, std::uint32_t tokens,
                  std::uint32_t head_dim, float* out, std::size_t out_stride) {
  for (std::uint32_t i = 0; i < nq; ++i)
    for (std::uint32_t t = 0; t < tokens; ++t) {
      float acc = 0.0f;
      for (std::uint32_t d = 0; d < head_dim; ++d) acc += q[i * head_dim + d] * load(k[t * head_dim + d]);
      out[i * out_stride + t] = acc;
    }
}

void scores_f16(const float* q, std::uint32_t nq, const half* k, std::uint32_t tokens,
                std::uint32_t head_dim, float* out, std::size_t out_stride, prefetch_region) {  // no prefetch here
  scores_dense(q, nq, k, tokens, head_dim, out, out_stride);
}

void scores_f32(const float* q, std::uint32_t nq, const float* k, std::uint32_t tokens,
                std::uint32_t head_dim, float* out, std::size_t out_stride, prefetch_region) {  // no prefetch here
  scores_dense(q, nq, k, tokens, head_dim, out, out_stride);
}

void scores_q4(const float* q, std::uint32_t nq, const q4_block* k, std::uint32_t tokens,
               std::uint32_t head_dim, float* out, std::size_t out_stride, prefetch_region) {  // no prefetch here
  for (std::uint32_t i = 0; i < nq; ++i) {
    float acc[q4_group] = {};
    float folded_min = 0.0f;
    for (std::uint32_t d = 0; d < head_dim; ++d) {
      const float qd = q[i * head_dim + d];
      const float qs = qd * to_float(k[d].scale);
      folded_min += qd * to_float(k[d].min);
      for (std::uint32_t t = 0; t < tokens; ++t) acc[t] += qs * static_cast<float>(q4_code(k[d], t));
    }
    for (std::uint32_t t = 0; t < tokens; ++t) out[i * out_stride + t] = acc[t] + folded_min;
  }
}

template <class V>
void accumulate_dense(const float* p, std::size_t p_stride, std::uint32_t nq, const V* v,
                      std::uint32_t tokens, std::uint32_t head_dim, float* acc) {
  for (std::uint32_t i = 0; i < nq; ++i)
    for (std::uint32_t t = 0; t < tokens; ++t) {
      const float w = p[i * p_stride + t];
      for (std::uint32_t d = 0; d < head_dim; ++d) acc[i * head_dim + d] += w * load(v[t * head_dim + d]);
    }
}

void accumulate_f16(const float* p, std::size_t p_stride, std::uint32_t nq, const half* v,
                    std::uint32_t tokens, std::uint32_t head_dim, float* acc, prefetch_region) {
  accumulate_dense(p, p_stride, nq, v, tokens, head_dim, acc);
}

void accumulate_f32(const float* p, std::size_t p_stride, std::uint32_t nq, const float* v,
                    std::uint32_t tokens, std::uint32_t head_dim, float* acc, prefetch_region) {
  accumulate_dense(p, p_stride, nq, v, tokens, head_dim, acc);
}

void accumulate_q4(const float* p, std::size_t p_stride, std::uint32_t nq, const q4_block* v,
                   std::uint32_t tokens, std::uint32_t head_dim, float* acc, prefetch_region) {
  const std::uint32_t nb = q4_value_blocks(head_dim);
  for (std::uint32_t i = 0; i < nq; ++i)
    for (std::uint32_t t = 0; t < tokens; ++t) {
      const float w = p[i * p_stride + t];
      for (std::uint32_t g = 0; g < nb; ++g) {
        const q4_block& b = v[t * nb + g];
        const float ws = w * to_float(b.scale), wm = w * to_float(b.min);
        const std::uint32_t n = std::min(q4_group, head_dim - g * q4_group);
        for (std::uint32_t j = 0; j < n; ++j)
          acc[i * head_dim + g * q4_group + j] += ws * static_cast<float>(q4_code(b, j)) + wm;
      }
    }
}

}  // namespace

const table& get() noexcept {
  static const table t{isa::scalar,     f32_to_f16,      f16_to_f32,     quantize_keys,
                       dequantize_keys, quantize_values, dequantize_values, scores_f16,
                       scores_f32,      scores_q4,       accumulate_f16, accumulate_f32,
                       accumulate_q4};
  return t;
}

}  // namespace kvcache::kernels::scalar
