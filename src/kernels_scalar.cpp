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

// The FP16 scale and minimum of a Q4 group, and what quantizing with them needs.
struct q4_fit {
  half scale, min;
  float minf, inv;
};

// Fits n (1..32) values x[i * stride]. The inputs are halves, so the minimum is exact in FP16;
// the scale is rounded *up* to FP16 so that min + 15 * scale covers the maximum and every value
// lies within half a step of its code.
q4_fit fit_group(const half* x, std::size_t stride, std::uint32_t n) {
  float mn = to_float(x[0]);
  float mx = mn;
  for (std::uint32_t i = 1; i < n; ++i) {
    const float f = to_float(x[i * stride]);
    mn = std::min(mn, f);
    mx = std::max(mx, f);
  }
  q4_fit r{};
  // + 0.0f turns -0 into +0, so the stored minimum does not depend on which zero min() kept
  // (SIMD min reductions compare in another order). Groups containing NaN get unspecified codes.
  r.min = to_half(mn + 0.0f);
  r.minf = to_float(r.min);
  const float step = (mx - r.minf) / 15.0f + 0.0f;  // + 0.0f: a zero range gives +0, whichever zero max() kept
  r.scale = scale_round_up(step);
  const float s = to_float(r.scale);
  r.inv = s > 0.0f ? 1.0f / s : 0.0f;
  return r;
}

// The code of x: round((x - min) / scale), clamped to [0, 15] (NaN -> 0).
std::uint8_t code_of(half x, const q4_fit& f) {
  float c = (to_float(x) - f.minf) * f.inv;
  c = !(c >= 0.0f) ? 0.0f : (c > 15.0f ? 15.0f : c);
  return static_cast<std::uint8_t>(c + 0.5f);
}

half* halves_at(std::uint8_t* group, std::size_t offset) { return reinterpret_cast<half*>(group + offset); }

void quantize_keys(const half* src, std::size_t src_stride, std::uint32_t tokens, std::uint32_t head_dim,
                   std::uint8_t* dst) {
  std::fill(dst, dst + q4_key_group_bytes(head_dim), std::uint8_t{0});
  half* scales = halves_at(dst, q4_key_scales_offset(head_dim));
  half* mins = halves_at(dst, q4_key_mins_offset(head_dim));
  for (std::uint32_t d = 0; d < head_dim; ++d) {
    const q4_fit f = fit_group(src + d, src_stride, tokens);
    scales[d] = f.scale;
    mins[d] = f.min;
    for (std::uint32_t t = 0; t < tokens; ++t)
      dst[q4_key_code_byte(d, t)] |= static_cast<std::uint8_t>(code_of(src[t * src_stride + d], f) << (t < 16 ? 0 : 4));
  }
}

void dequantize_keys(const std::uint8_t* src, std::uint32_t tokens, std::uint32_t head_dim, float* dst,
                     std::size_t dst_stride) {
  const half* scales = q4_key_scales(src, head_dim);
  const half* mins = q4_key_mins(src, head_dim);
  for (std::uint32_t d = 0; d < head_dim; ++d) {
    const float s = to_float(scales[d]), m = to_float(mins[d]);
    for (std::uint32_t t = 0; t < tokens; ++t)
      dst[t * dst_stride + d] = m + s * static_cast<float>(q4_key_code(src, d, t));
  }
}

void quantize_values(const half* src, std::size_t src_stride, std::uint32_t tokens, std::uint32_t head_dim,
                     std::uint8_t* dst) {
  std::fill(dst, dst + q4_value_group_bytes(head_dim), std::uint8_t{0});
  half* scales = halves_at(dst, q4_value_scales_offset(head_dim));
  half* mins = halves_at(dst, q4_value_mins_offset(head_dim));
  const std::uint32_t nb = q4_value_blocks(head_dim);
  for (std::uint32_t t = 0; t < tokens; ++t)
    for (std::uint32_t g = 0; g < nb; ++g) {
      const std::uint32_t n = std::min(q4_group, head_dim - g * q4_group);
      const half* x = src + t * src_stride + g * q4_group;
      const q4_fit f = fit_group(x, 1, n);
      scales[g * q4_group + t] = f.scale;
      mins[g * q4_group + t] = f.min;
      for (std::uint32_t j = 0; j < n; ++j)
        dst[q4_value_code_byte(t, g * q4_group + j)] |= static_cast<std::uint8_t>(code_of(x[j], f) << (j < 16 ? 0 : 4));
    }
}

void dequantize_values(const std::uint8_t* src, std::uint32_t first, std::uint32_t tokens, std::uint32_t head_dim,
                       float* dst, std::size_t dst_stride) {
  const half* scales = q4_value_scales(src, head_dim);
  const half* mins = q4_value_mins(src, head_dim);
  for (std::uint32_t r = 0; r < tokens; ++r) {
    const std::uint32_t t = first + r;
    for (std::uint32_t d = 0; d < head_dim; ++d) {
      const std::uint32_t k = d / q4_group * q4_group + t;
      dst[r * dst_stride + d] = to_float(mins[k]) + to_float(scales[k]) * static_cast<float>(q4_value_code(src, t, d));
    }
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

template <class K>
void scores_dense_heads(const float* q, std::size_t q_head_stride, std::uint32_t nq, const K* k, std::size_t k_head_stride,
                        std::uint32_t heads, std::uint32_t tokens, std::uint32_t head_dim, float* out,
                        std::size_t out_head_stride, std::size_t out_stride) {
  for (std::uint32_t h = 0; h < heads; ++h)
    scores_dense(q + h * q_head_stride, nq, k + h * k_head_stride, tokens, head_dim, out + h * out_head_stride, out_stride);
}

void scores_f16_heads(const float* q, std::size_t q_head_stride, std::uint32_t nq, const half* k, std::size_t k_head_stride,
                      std::uint32_t heads, std::uint32_t tokens, std::uint32_t head_dim, float* out,
                      std::size_t out_head_stride, std::size_t out_stride, prefetch_region) {  // no prefetch here
  scores_dense_heads(q, q_head_stride, nq, k, k_head_stride, heads, tokens, head_dim, out, out_head_stride, out_stride);
}

void scores_f32_heads(const float* q, std::size_t q_head_stride, std::uint32_t nq, const float* k, std::size_t k_head_stride,
                      std::uint32_t heads, std::uint32_t tokens, std::uint32_t head_dim, float* out,
                      std::size_t out_head_stride, std::size_t out_stride, prefetch_region) {  // no prefetch here
  scores_dense_heads(q, q_head_stride, nq, k, k_head_stride, heads, tokens, head_dim, out, out_head_stride, out_stride);
}

template <class K>
void scores_dense_segments(const float* q, std::uint32_t nq, const key_segment* segs, std::uint32_t count,
                           std::uint32_t head_dim, float* out, std::size_t out_stride) {
  for (std::uint32_t j = 0; j < count; ++j)
    scores_dense(q, nq, static_cast<const K*>(segs[j].k), segs[j].tokens, head_dim, out + segs[j].out_offset, out_stride);
}

void scores_f16_segments(const float* q, std::uint32_t nq, const key_segment* segs, std::uint32_t count,
                         std::uint32_t head_dim, float* out, std::size_t out_stride, prefetch_region) {  // no prefetch here
  scores_dense_segments<half>(q, nq, segs, count, head_dim, out, out_stride);
}

void scores_f32_segments(const float* q, std::uint32_t nq, const key_segment* segs, std::uint32_t count,
                         std::uint32_t head_dim, float* out, std::size_t out_stride, prefetch_region) {  // no prefetch here
  scores_dense_segments<float>(q, nq, segs, count, head_dim, out, out_stride);
}

void scores_q4(const float* q, std::uint32_t nq, const std::uint8_t* k, std::uint32_t tokens,
               std::uint32_t head_dim, float* out, std::size_t out_stride, prefetch_region) {  // no prefetch here
  const half* scales = q4_key_scales(k, head_dim);
  const half* mins = q4_key_mins(k, head_dim);
  for (std::uint32_t i = 0; i < nq; ++i) {
    float acc[q4_group] = {};
    float folded_min = 0.0f;
    for (std::uint32_t d = 0; d < head_dim; ++d) {
      const float qd = q[i * head_dim + d];
      const float qs = qd * to_float(scales[d]);
      folded_min += qd * to_float(mins[d]);
      for (std::uint32_t t = 0; t < tokens; ++t) acc[t] += qs * static_cast<float>(q4_key_code(k, d, t));
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

void accumulate_q4(const float* p, std::size_t p_stride, std::uint32_t nq, const std::uint8_t* v, std::uint32_t first,
                   std::uint32_t tokens, std::uint32_t head_dim, float* acc, prefetch_region) {
  const half* scales = q4_value_scales(v, head_dim);
  const half* mins = q4_value_mins(v, head_dim);
  const std::uint32_t nb = q4_value_blocks(head_dim);
  for (std::uint32_t i = 0; i < nq; ++i)
    for (std::uint32_t r = 0; r < tokens; ++r) {
      const std::uint32_t t = first + r;
      const float w = p[i * p_stride + r];
      for (std::uint32_t g = 0; g < nb; ++g) {
        const float ws = w * to_float(scales[g * q4_group + t]), wm = w * to_float(mins[g * q4_group + t]);
        const std::uint32_t n = std::min(q4_group, head_dim - g * q4_group);
        for (std::uint32_t j = 0; j < n; ++j)
          acc[i * head_dim + g * q4_group + j] += ws * static_cast<float>(q4_value_code(v, t, g * q4_group + j)) + wm;
      }
    }
}

}  // namespace

const table& get() noexcept {
  static const table t = [] {
    table x{isa::scalar,     f32_to_f16,      f16_to_f32,     quantize_keys,
            dequantize_keys, quantize_values, dequantize_values, scores_f16,
            scores_f32,      scores_q4,       accumulate_f16, accumulate_f32,
            accumulate_q4};
    x.scores_f16_heads = scores_f16_heads;
    x.scores_f32_heads = scores_f32_heads;
    x.scores_f16_segments = scores_f16_segments;
    x.scores_f32_segments = scores_f32_segments;
    return x;
  }();
  return t;
}

}  // namespace kvcache::kernels::scalar
