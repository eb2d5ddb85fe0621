#pragma once
/// @file detail/store_row.hpp
/// Not public API. One row of a write() into a CPU cache's dense storage: copied where the
/// element types match, converted by the active kernels where they do not.

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

}  // namespace kvcache::detail
