#pragma once
/// @file detail/store_row.hpp
/// Not public API. One token of a write() into a CPU cache's dense storage, row by row: copied
/// where the element types match, converted by the active kernels where they do not.

#include <kvcache/format.hpp>
#include <kvcache/half.hpp>
#include <kvcache/kernels.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace kvcache::detail {

/// head_dim elements of src to dst in format fmt (f32 or f16): f32 <- f32 and f16 <- f16 copy,
/// f16 <- f32 and f32 <- f16 convert.
inline void store_row(const kernels::table& kt, const float* src, std::uint32_t head_dim, format fmt,
                      std::byte* dst) noexcept {
  if (fmt == format::f32) std::memcpy(dst, src, std::size_t{head_dim} * sizeof(float));
  else kt.f32_to_f16(src, reinterpret_cast<half*>(dst), head_dim);
}
inline void store_row(const kernels::table& kt, const half* src, std::uint32_t head_dim, format fmt,
                      std::byte* dst) noexcept {
  if (fmt == format::f16) std::memcpy(dst, src, std::size_t{head_dim} * sizeof(half));
  else kt.f16_to_f32(src, reinterpret_cast<float*>(dst), head_dim);
}

/// One token's K or V (kv_heads rows of head_dim, contiguous at src) to head h's row at
/// dst + h * head_stride, in head order.
template <class T>
void store_token(const kernels::table& kt, const T* src, std::uint32_t kv_heads, std::uint32_t head_dim, format fmt,
                 std::byte* dst, std::size_t head_stride) noexcept {
  for (std::uint32_t h = 0; h < kv_heads; ++h)
    store_row(kt, src + std::size_t{h} * head_dim, head_dim, fmt, dst + h * head_stride);
}

}  // namespace kvcache::detail
