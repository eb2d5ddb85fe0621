#pragma once
// Append (scatter) and Q4 migration kernels of kvcache::cuda, with their host-side validation and
// a launcher template. Internal to cuda/ (included by append.cu, and by the CPU emulation test);
// includes no CUDA header.
#include "device_math.cuh"

#include <kvcache/cuda/kernels.hpp>
#include <kvcache/error.hpp>

#include <cstddef>
#include <cstdint>

namespace kvcache {
namespace {

// ---- append ----------------------------------------------------------------------------------

// One block per (source row, kv head); threads stride over head_dim.
__global__ void append_kernel(append_params p) {
  const std::uint32_t row = blockIdx.x;
  const std::uint32_t head = blockIdx.y;
  std::uint32_t n = 0, len = 0, first_row = 0, first_page = 0;
  const std::uint32_t* pages = nullptr;
  if (p.single_pages != nullptr) {
    if (row >= p.max_rows) return;
    n = p.max_rows;
    len = p.single_length;
    pages = p.single_pages;
    first_page = p.single_first_page;
  } else {
    const std::uint32_t batch = p.table.batch;
    if (row >= p.src_indptr[batch]) return;
    // The batch entry owning this row: the last b with src_indptr[b] <= row.
    std::uint32_t lo = 0, hi = batch;  // invariant: src_indptr[lo] <= row < src_indptr[hi]
    while (hi - lo > 1) {
      const std::uint32_t mid = (lo + hi) / 2;
      if (p.src_indptr[mid] <= row) lo = mid;
      else hi = mid;
    }
    first_row = p.src_indptr[lo];
    n = p.src_indptr[lo + 1] - first_row;
    const std::uint32_t p0 = p.table.indptr[lo];
    const std::uint32_t np = p.table.indptr[lo + 1] - p0;
    len = np == 0 ? 0 : (np - 1) * p.dst.page_tokens + p.table.last_page_len[lo];
    pages = p.table.indices + p0;
  }
  if (n > len) return;  // table does not count the new rows: nothing valid to write
  const std::uint32_t pos = len - n + (row - first_row);
  if (pos / p.dst.page_tokens < first_page) return;  // outside the pages given
  const std::uint32_t page = pages[pos / p.dst.page_tokens - first_page];
  const std::uint32_t slot = pos % p.dst.page_tokens;
  const std::size_t src_off = (static_cast<std::size_t>(row) * p.kv_heads + head) * p.head_dim;
  const std::size_t dst_elem = static_cast<std::size_t>(slot) * p.head_dim;
  std::byte* kd = static_cast<std::byte*>(p.dst.k) + page * p.dst.k_page_stride + head * p.dst.k_head_stride;
  std::byte* vd = static_cast<std::byte*>(p.dst.v) + page * p.dst.v_page_stride + head * p.dst.v_head_stride;
  const auto* ks = static_cast<const std::byte*>(p.k);
  const auto* vs = static_cast<const std::byte*>(p.v);
  for (std::uint32_t c = threadIdx.x; c < p.head_dim; c += blockDim.x) {
    const std::size_t si = src_off + c;
    const std::size_t di = dst_elem + c;
    if (p.src_format == format::f16 && p.dst.k_format == format::f16) {
      reinterpret_cast<std::uint16_t*>(kd)[di] = reinterpret_cast<const std::uint16_t*>(ks)[si];
    } else {
      const float x = detail::load_dense(ks, p.src_format, si);
      if (p.dst.k_format == format::f32) reinterpret_cast<float*>(kd)[di] = x;
      else reinterpret_cast<std::uint16_t*>(kd)[di] = detail::f2h(x);
    }
    if (p.src_format == format::f16 && p.dst.v_format == format::f16) {
      reinterpret_cast<std::uint16_t*>(vd)[di] = reinterpret_cast<const std::uint16_t*>(vs)[si];
    } else {
      const float x = detail::load_dense(vs, p.src_format, si);
      if (p.dst.v_format == format::f32) reinterpret_cast<float*>(vd)[di] = x;
      else reinterpret_cast<std::uint16_t*>(vd)[di] = detail::f2h(x);
    }
  }
}

bool dense(format f) { return f == format::f32 || f == format::f16; }

// ---- Q4 migration ----------------------------------------------------------------------------

// The scalar reference's quantize_group (src/kernels_scalar.cpp), operation for operation; the
// explicit _rn intrinsics keep nvcc from contracting into FMAs, so codes are bit-identical.
__device__ void quantize_group(const std::uint16_t* x, std::size_t stride, std::uint32_t n, q4_block* out) {
  float mn = detail::h2f(x[0]);
  float mx = mn;
  for (std::uint32_t i = 1; i < n; ++i) {
    const float f = detail::h2f(x[i * stride]);
    mn = f < mn ? f : mn;  // std::min / std::max semantics (signed zeros, NaN) as the reference
    mx = mx < f ? f : mx;
  }
  const std::uint16_t min_bits = detail::f2h(__fadd_rn(mn, 0.0f));  // -0 -> +0, as the reference
  const float minf = detail::h2f(min_bits);
  const float step = __fdiv_rn(__fsub_rn(mx, minf), 15.0f);
  std::uint16_t scale_bits = detail::f2h(step);
  if (detail::h2f(scale_bits) < step) ++scale_bits;  // round the scale up (scale_round_up)
  const float s = detail::h2f(scale_bits);
  const float inv = s > 0.0f ? __fdiv_rn(1.0f, s) : 0.0f;
  std::uint8_t codes[q4_group / 2] = {};
  for (std::uint32_t i = 0; i < n; ++i) {
    float c = __fmul_rn(__fsub_rn(detail::h2f(x[i * stride]), minf), inv);
    c = !(c >= 0.0f) ? 0.0f : (c > 15.0f ? 15.0f : c);
    const auto code = static_cast<std::uint32_t>(__fadd_rn(c, 0.5f));
    if (i < 16) codes[i] = static_cast<std::uint8_t>(codes[i] | code);
    else codes[i - 16] = static_cast<std::uint8_t>(codes[i - 16] | (code << 4));
  }
  out->scale.bits = scale_bits;
  out->min.bits = min_bits;
  for (std::uint32_t i = 0; i < q4_group / 2; ++i) out->codes[i] = codes[i];
}

// One block per (pair, layer, kv head): threads take key channels, then (token, value group) pairs.
__global__ void migrate_kernel(migrate_params p) {
  const std::uint32_t pair = blockIdx.x, layer = blockIdx.y, head = blockIdx.z;
  const std::uint32_t D = p.head_dim;
  const auto* sk = reinterpret_cast<const std::uint16_t*>(
      static_cast<const std::byte*>(p.src.k) + layer * p.src_layer_stride_k +
      p.src_page[pair] * p.src.k_page_stride + head * p.src.k_head_stride);  // [token][D]
  const auto* sv = reinterpret_cast<const std::uint16_t*>(
      static_cast<const std::byte*>(p.src.v) + layer * p.src_layer_stride_v +
      p.src_page[pair] * p.src.v_page_stride + head * p.src.v_head_stride);  // [token][D]
  auto* dk = reinterpret_cast<q4_block*>(static_cast<std::byte*>(p.dst.k) + layer * p.dst_layer_stride_k +
                                         p.dst_page[pair] * p.dst.k_page_stride + head * p.dst.k_head_stride);  // [D]
  auto* dv = reinterpret_cast<q4_block*>(static_cast<std::byte*>(p.dst.v) + layer * p.dst_layer_stride_v +
                                         p.dst_page[pair] * p.dst.v_page_stride + head * p.dst.v_head_stride);  // [token][nb]
  if (p.dst.k_format == format::q4) {
    for (std::uint32_t d = threadIdx.x; d < D; d += blockDim.x) quantize_group(sk + d, D, p.tokens, dk + d);
  } else {  // f16 store group: a plain copy of the rows
    auto* out = reinterpret_cast<std::uint16_t*>(dk);
    for (std::uint32_t i = threadIdx.x; i < p.tokens * D; i += blockDim.x) out[i] = sk[i];
  }
  if (p.dst.v_format == format::q4) {
    const std::uint32_t nb = q4_value_blocks(D);
    for (std::uint32_t i = threadIdx.x; i < p.tokens * nb; i += blockDim.x) {
      const std::uint32_t t = i / nb, g = i % nb;
      const std::uint32_t n = min(q4_group, D - g * q4_group);
      quantize_group(sv + static_cast<std::size_t>(t) * D + g * q4_group, 1, n, dv + i);
    }
  } else {
    auto* out = reinterpret_cast<std::uint16_t*>(dv);
    for (std::uint32_t i = threadIdx.x; i < p.tokens * D; i += blockDim.x) out[i] = sv[i];
  }
}

/// Host-side validation of cuda_append (no CUDA call).
inline result<void> validate_append(const append_params& p) {
  if (p.kv_heads == 0 || p.head_dim == 0)
    return fail(errc::invalid_argument, "cuda_append: zero dimension", {{"kv_heads", p.kv_heads}, {"head_dim", p.head_dim}});
  if (p.kv_heads > 65535)
    return fail(errc::invalid_argument, "cuda_append: kv_heads above the grid limit", {{"kv_heads", p.kv_heads}});
  if (!dense(p.dst.k_format) || !dense(p.dst.v_format) || !dense(p.src_format))
    return fail(errc::invalid_argument, "cuda_append: formats must be f32 or f16 (q4 is written by cuda_migrate)",
                {{"k_format", static_cast<long long>(p.dst.k_format)},
                 {"v_format", static_cast<long long>(p.dst.v_format)},
                 {"src_format", static_cast<long long>(p.src_format)}});
  if (p.dst.page_tokens == 0) return fail(errc::invalid_argument, "cuda_append: page_tokens is 0");
  if (p.dst.k == nullptr || p.dst.v == nullptr || p.k == nullptr || p.v == nullptr)
    return fail(errc::invalid_argument, "cuda_append: null K/V pointer");
  if (p.single_pages == nullptr &&
      (p.src_indptr == nullptr || p.table.indptr == nullptr || p.table.indices == nullptr ||
       p.table.last_page_len == nullptr || p.table.batch == 0))
    return fail(errc::invalid_argument, "cuda_append: incomplete batch table", {{"batch", p.table.batch}});
  return {};
}

/// Host-side validation of cuda_migrate (no CUDA call).
inline result<void> validate_migrate(const migrate_params& p) {
  if (p.kv_heads == 0 || p.head_dim == 0 || p.layers == 0)
    return fail(errc::invalid_argument, "cuda_migrate: zero dimension",
                {{"layers", p.layers}, {"kv_heads", p.kv_heads}, {"head_dim", p.head_dim}});
  if (p.count == 0 || p.count > cuda_max_migrations)
    return fail(errc::invalid_argument, "cuda_migrate: pair count", {{"count", p.count}, {"max", cuda_max_migrations}});
  if (p.tokens == 0 || p.tokens > q4_group)
    return fail(errc::invalid_argument, "cuda_migrate: tokens per group must be 1..32", {{"tokens", p.tokens}});
  auto store = [](format f) { return f == format::q4 || f == format::f16; };
  if (p.src.k_format != format::f16 || p.src.v_format != format::f16 || !store(p.dst.k_format) ||
      !store(p.dst.v_format))
    return fail(errc::invalid_argument, "cuda_migrate: source must be f16 and destination q4 or f16",
                {{"dst_k_format", static_cast<long long>(p.dst.k_format)},
                 {"dst_v_format", static_cast<long long>(p.dst.v_format)}});
  if (p.src.k == nullptr || p.src.v == nullptr || p.dst.k == nullptr || p.dst.v == nullptr)
    return fail(errc::invalid_argument, "cuda_migrate: null page pointer");
  if (p.kv_heads > 65535 || p.layers > 65535)
    return fail(errc::invalid_argument, "cuda_migrate: grid limit", {{"layers", p.layers}, {"kv_heads", p.kv_heads}});
  return {};
}

/// Launches a validated append (nothing for max_rows == 0); `launch` as in launch_attend.
template <class Launch>
result<void> launch_append(const append_params& p, Launch&& launch) {
  if (p.max_rows == 0) return {};
  const unsigned threads = p.head_dim >= 128 ? 128u : (p.head_dim + 31u) / 32u * 32u;
  return launch(append_kernel, dim3(p.max_rows, p.kv_heads), dim3(threads), p);
}

/// Launches a validated migration.
template <class Launch>
result<void> launch_migrate(const migrate_params& p, Launch&& launch) {
  return launch(migrate_kernel, dim3(p.count, p.layers, p.kv_heads), dim3(128), p);
}

}  // namespace
}  // namespace kvcache
