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

// The FP16 scale and minimum of one Q4 group, and what quantizing with them needs (the scalar
// reference's q4_fit, src/kernels_scalar.cpp).
struct q4_fit {
  std::uint16_t scale_bits, min_bits;
  float minf, inv;
};

// The scalar reference's fit_group, operation for operation, over n (1..32) halves x[i * stride];
// the explicit _rn intrinsics keep nvcc from contracting into FMAs, so results are bit-identical.
__device__ q4_fit fit_group(const std::uint16_t* x, std::size_t stride, std::uint32_t n) {
  float mn = detail::h2f(x[0]);
  float mx = mn;
  for (std::uint32_t i = 1; i < n; ++i) {
    const float f = detail::h2f(x[i * stride]);
    mn = f < mn ? f : mn;  // std::min / std::max semantics (signed zeros, NaN) as the reference
    mx = mx < f ? f : mx;
  }
  q4_fit r;
  r.min_bits = detail::f2h(__fadd_rn(mn, 0.0f));  // -0 -> +0, as the reference
  r.minf = detail::h2f(r.min_bits);
  const float step = __fadd_rn(__fdiv_rn(__fsub_rn(mx, r.minf), 15.0f), 0.0f);  // + 0: +0 for a zero range
  r.scale_bits = detail::f2h(step);
  if (detail::h2f(r.scale_bits) < step) ++r.scale_bits;  // round the scale up (scale_round_up)
  const float s = detail::h2f(r.scale_bits);
  r.inv = s > 0.0f ? __fdiv_rn(1.0f, s) : 0.0f;
  return r;
}

// The reference's code_of: round((x - min) / scale) as (x - min) * (1 / scale) + 0.5 truncated,
// clamped to [0, 15] (NaN -> 0).
__device__ __forceinline__ std::uint32_t code_of(std::uint16_t x, const q4_fit& f) {
  float c = __fmul_rn(__fsub_rn(detail::h2f(x), f.minf), f.inv);
  c = !(c >= 0.0f) ? 0.0f : (c > 15.0f ? 15.0f : c);
  return static_cast<std::uint32_t>(__fadd_rn(c, 0.5f));
}

// Channel c (< q4_key_channels(D)) of a key group (format.hpp) from `tokens` rows x[t * D]: its
// 16 code bytes (token j low nibble, j + 16 high; 0 for missing tokens), scale and minimum; a
// padding channel (c >= D) gets codes, scale and minimum 0. Every byte of the channel is written.
__device__ void quantize_key_channel(const std::uint16_t* x, std::uint32_t D, std::uint32_t tokens, std::uint32_t c,
                                     std::byte* group) {
  auto* codes = reinterpret_cast<std::uint8_t*>(group);
  q4_fit f{0, 0, 0.0f, 0.0f};
  if (c < D) f = fit_group(x + c, D, tokens);
  for (std::uint32_t j = 0; j < q4_group / 2; ++j) {
    const std::uint32_t lo = c < D && j < tokens ? code_of(x[static_cast<std::size_t>(j) * D + c], f) : 0u;
    const std::uint32_t hi = c < D && j + 16 < tokens ? code_of(x[static_cast<std::size_t>(j + 16) * D + c], f) : 0u;
    codes[q4_key_code_byte(c, j)] = static_cast<std::uint8_t>(lo | (hi << 4));
  }
  reinterpret_cast<std::uint16_t*>(group + q4_key_scales_offset(D))[c] = f.scale_bits;
  reinterpret_cast<std::uint16_t*>(group + q4_key_mins_offset(D))[c] = f.min_bits;
}

// Token t (0..31), column g of a value group (format.hpp) from the row x[D] of that token (null
// for a token past the group's count, which gets codes, scale and minimum 0, as the reference
// writes them): its 16 code bytes (channel 32 g + j low nibble, 32 g + j + 16 high; 0 past D),
// scale and minimum.
__device__ void quantize_value_block(const std::uint16_t* x, std::uint32_t D, std::uint32_t t, std::uint32_t g,
                                     std::byte* group) {
  auto* codes = reinterpret_cast<std::uint8_t*>(group);
  const std::uint32_t n = x != nullptr ? min(q4_group, D - g * q4_group) : 0u;  // channels of the column
  const std::uint16_t* col = x != nullptr ? x + g * q4_group : nullptr;
  q4_fit f{0, 0, 0.0f, 0.0f};
  if (n > 0) f = fit_group(col, 1, n);
  for (std::uint32_t j = 0; j < q4_group / 2; ++j) {
    const std::uint32_t lo = j < n ? code_of(col[j], f) : 0u;
    const std::uint32_t hi = j + 16 < n ? code_of(col[j + 16], f) : 0u;
    codes[q4_value_code_byte(t, g * q4_group + j)] = static_cast<std::uint8_t>(lo | (hi << 4));
  }
  reinterpret_cast<std::uint16_t*>(group + q4_value_scales_offset(D))[g * q4_group + t] = f.scale_bits;
  reinterpret_cast<std::uint16_t*>(group + q4_value_mins_offset(D))[g * q4_group + t] = f.min_bits;
}

// One block per (pair, layer, kv head). Q4 keys: a thread per key channel (neighbouring threads
// write neighbouring code bytes of a channel quad and neighbouring scales); Q4 values: a thread
// per (column, token slot) of all 32 slots, token fastest (neighbouring bytes of a token quad,
// neighbouring scales). Both groups are written whole, bit-identical to the scalar quantizer.
__global__ void migrate_kernel(migrate_params p) {
  const std::uint32_t pair = blockIdx.x, layer = blockIdx.y, head = blockIdx.z;
  const std::uint32_t D = p.head_dim;
  const auto* sk = reinterpret_cast<const std::uint16_t*>(
      static_cast<const std::byte*>(p.src.k) + layer * p.src_layer_stride_k +
      p.src_page[pair] * p.src.k_page_stride + head * p.src.k_head_stride);  // [token][D]
  const auto* sv = reinterpret_cast<const std::uint16_t*>(
      static_cast<const std::byte*>(p.src.v) + layer * p.src_layer_stride_v +
      p.src_page[pair] * p.src.v_page_stride + head * p.src.v_head_stride);  // [token][D]
  std::byte* dk = static_cast<std::byte*>(p.dst.k) + layer * p.dst_layer_stride_k + p.dst_page[pair] * p.dst.k_page_stride +
                  head * p.dst.k_head_stride;  // key group, or [token][D] halves
  std::byte* dv = static_cast<std::byte*>(p.dst.v) + layer * p.dst_layer_stride_v + p.dst_page[pair] * p.dst.v_page_stride +
                  head * p.dst.v_head_stride;  // value group, or [token][D] halves
  if (p.dst.k_format == format::q4) {
    const std::uint32_t C = q4_key_channels(D);
    for (std::uint32_t c = threadIdx.x; c < C; c += blockDim.x) quantize_key_channel(sk, D, p.tokens, c, dk);
  } else {  // f16 store group: a plain copy of the rows
    auto* out = reinterpret_cast<std::uint16_t*>(dk);
    for (std::uint32_t i = threadIdx.x; i < p.tokens * D; i += blockDim.x) out[i] = sk[i];
  }
  if (p.dst.v_format == format::q4) {
    const std::uint32_t slots = q4_value_blocks(D) * q4_group;
    for (std::uint32_t i = threadIdx.x; i < slots; i += blockDim.x) {
      const std::uint32_t g = i / q4_group, t = i % q4_group;
      quantize_value_block(t < p.tokens ? sv + static_cast<std::size_t>(t) * D : nullptr, D, t, g, dv);
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
  for (const bool keys : {true, false}) {  // Q4 destinations: whole, aligned groups per head
    if ((keys ? p.dst.k_format : p.dst.v_format) != format::q4) continue;
    const std::size_t group = keys ? q4_key_group_bytes(p.head_dim) : q4_value_group_bytes(p.head_dim);
    const std::uint64_t head = keys ? p.dst.k_head_stride : p.dst.v_head_stride;
    if (p.kv_heads > 1 && head < group)
      return fail(errc::invalid_argument, "cuda_migrate: Q4 head stride smaller than one group",
                  {{"keys", keys ? 1 : 0}, {"head_stride", static_cast<long long>(head)}, {"group_bytes", static_cast<long long>(group)}});
    if (keys ? !detail::q4_aligned(p.dst.k, p.dst.k_page_stride, p.dst.k_head_stride, p.dst_layer_stride_k)
             : !detail::q4_aligned(p.dst.v, p.dst.v_page_stride, p.dst.v_head_stride, p.dst_layer_stride_v))
      return fail(errc::invalid_argument, "cuda_migrate: Q4 pages and strides must be 4-byte aligned", {{"keys", keys ? 1 : 0}});
  }
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
