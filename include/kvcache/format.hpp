#pragma once
/// @file format.hpp
/// Storage formats of keys and values, and the packed Q4 group layout shared by C++ and CUDA.

#include <kvcache/config.hpp>
#include <kvcache/half.hpp>

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace kvcache {

/// How keys or values of a chunk are stored.
enum class format : std::uint8_t {
  f32,  ///< IEEE binary32, dense [token][head_dim] per head
  f16,  ///< IEEE binary16, dense [token][head_dim] per head
  q4,   ///< 4-bit codes in groups of 32 tokens (keys per channel, values per token): see below
};

/// "f32", "f16" or "q4".
[[nodiscard]] constexpr std::string_view to_string(format f) noexcept {
  switch (f) {
    case format::f32: return "f32";
    case format::f16: return "f16";
    case format::q4: return "q4";
  }
  return "unknown";
}

/// Tokens quantized together in one Q4 group: a Q4 chunk of a view holds one group of each head.
inline constexpr std::uint32_t q4_group = 32;

// ---- Q4 groups -------------------------------------------------------------------------------
// Codes are asymmetric 4-bit: value = min + scale * code, code in [0, 15], scale and min FP16.
// One group holds up to 32 tokens of one kv head, keys and values in separate groups, each a
// packed byte array laid out for the integer dot products of decode attention (four bytes side by
// side that one 32-bit lane of vpdpbusd / sdot sums): 20 bytes per 32 values, 5 bits per value
// including scales and minimums.
//
// Key group (per channel over the group's tokens), C = q4_key_channels(head_dim):
//   codes   [C / 4][16][4] bytes  channel quad c / 4, byte j, channel c % 4:
//                                 token j in the low nibble, token j + 16 in the high nibble
//   scales  [C] half              at q4_key_scales_offset(head_dim)
//   mins    [C] half              at q4_key_mins_offset(head_dim)
// Value group (per token over 32 consecutive channels, a "block column"), B = q4_value_blocks(head_dim):
//   codes   [B][8][16][4] bytes   column g, token quad t / 4, byte j, token t % 4:
//                                 channel 32 g + j in the low nibble, 32 g + j + 16 in the high
//   scales  [B][32] half          at q4_value_scales_offset(head_dim), column-major: [g][t]
//   mins    [B][32] half          at q4_value_mins_offset(head_dim)
// Channels past head_dim (up to C, or to 32 B for values) have code 0, and key channels past
// head_dim scale and min 0. Key codes of tokens past the group's count are 0; a value group's
// codes, scales and minimums of tokens past its count are unspecified (kernels give those tokens
// no weight and must not let them reach a result, not even through a maximum).

/// Key channels of a Q4 key group: head_dim rounded up to a multiple of 4 (whole channel quads).
[[nodiscard]] KVCACHE_HOST_DEVICE constexpr std::uint32_t q4_key_channels(std::uint32_t head_dim) noexcept {
  return (head_dim + 3) / 4 * 4;
}
/// Value blocks (columns of 32 channels) per token: ceil(head_dim / 32).
[[nodiscard]] KVCACHE_HOST_DEVICE constexpr std::uint32_t q4_value_blocks(std::uint32_t head_dim) noexcept {
  return (head_dim + q4_group - 1) / q4_group;
}
/// Bytes of one Q4 key group of one head: 20 per key channel.
[[nodiscard]] KVCACHE_HOST_DEVICE constexpr std::size_t q4_key_group_bytes(std::uint32_t head_dim) noexcept {
  return std::size_t{20} * q4_key_channels(head_dim);
}
/// Bytes of one Q4 value group of one head: 640 per block column.
[[nodiscard]] KVCACHE_HOST_DEVICE constexpr std::size_t q4_value_group_bytes(std::uint32_t head_dim) noexcept {
  return std::size_t{640} * q4_value_blocks(head_dim);
}
/// Byte offset of the key scales (half[q4_key_channels]) in a key group.
[[nodiscard]] KVCACHE_HOST_DEVICE constexpr std::size_t q4_key_scales_offset(std::uint32_t head_dim) noexcept {
  return std::size_t{16} * q4_key_channels(head_dim);
}
/// Byte offset of the key minimums (half[q4_key_channels]) in a key group.
[[nodiscard]] KVCACHE_HOST_DEVICE constexpr std::size_t q4_key_mins_offset(std::uint32_t head_dim) noexcept {
  return std::size_t{18} * q4_key_channels(head_dim);
}
/// Byte offset of the value scales (half[B][32]) in a value group.
[[nodiscard]] KVCACHE_HOST_DEVICE constexpr std::size_t q4_value_scales_offset(std::uint32_t head_dim) noexcept {
  return std::size_t{512} * q4_value_blocks(head_dim);
}
/// Byte offset of the value minimums (half[B][32]) in a value group.
[[nodiscard]] KVCACHE_HOST_DEVICE constexpr std::size_t q4_value_mins_offset(std::uint32_t head_dim) noexcept {
  return std::size_t{576} * q4_value_blocks(head_dim);
}
/// Byte of a key group holding the code of channel c, token t (0..31): nibble t / 16.
[[nodiscard]] KVCACHE_HOST_DEVICE constexpr std::size_t q4_key_code_byte(std::uint32_t c, std::uint32_t t) noexcept {
  return std::size_t{c / 4} * 64 + (t % 16) * 4 + c % 4;
}
/// Byte of a value group holding the code of token t (0..31), channel c: nibble (c % 32) / 16.
[[nodiscard]] KVCACHE_HOST_DEVICE constexpr std::size_t q4_value_code_byte(std::uint32_t t, std::uint32_t c) noexcept {
  return std::size_t{c / 32} * 512 + (t / 4) * 64 + (c % 16) * 4 + t % 4;
}
/// Code of channel c, token t of a key group.
[[nodiscard]] KVCACHE_HOST_DEVICE constexpr std::uint8_t q4_key_code(const std::uint8_t* group, std::uint32_t c,
                                                                     std::uint32_t t) noexcept {
  const std::uint8_t b = group[q4_key_code_byte(c, t)];
  return static_cast<std::uint8_t>(t < 16 ? b & 0x0f : b >> 4);
}
/// Code of token t, channel c of a value group.
[[nodiscard]] KVCACHE_HOST_DEVICE constexpr std::uint8_t q4_value_code(const std::uint8_t* group, std::uint32_t t,
                                                                       std::uint32_t c) noexcept {
  const std::uint8_t b = group[q4_value_code_byte(t, c)];
  return static_cast<std::uint8_t>(c % 32 < 16 ? b & 0x0f : b >> 4);
}
/// The key scales and minimums of a group (its address must be 2-byte aligned).
[[nodiscard]] KVCACHE_HOST_DEVICE inline const half* q4_key_scales(const std::uint8_t* group, std::uint32_t head_dim) noexcept {
  return reinterpret_cast<const half*>(group + q4_key_scales_offset(head_dim));
}
[[nodiscard]] KVCACHE_HOST_DEVICE inline const half* q4_key_mins(const std::uint8_t* group, std::uint32_t head_dim) noexcept {
  return reinterpret_cast<const half*>(group + q4_key_mins_offset(head_dim));
}
/// The value scales and minimums of a group, [g][t]: index g * 32 + t.
[[nodiscard]] KVCACHE_HOST_DEVICE inline const half* q4_value_scales(const std::uint8_t* group, std::uint32_t head_dim) noexcept {
  return reinterpret_cast<const half*>(group + q4_value_scales_offset(head_dim));
}
[[nodiscard]] KVCACHE_HOST_DEVICE inline const half* q4_value_mins(const std::uint8_t* group, std::uint32_t head_dim) noexcept {
  return reinterpret_cast<const half*>(group + q4_value_mins_offset(head_dim));
}

/// Bytes per element of a dense format (f32, f16); 0 for q4, whose size depends on grouping.
[[nodiscard]] KVCACHE_HOST_DEVICE constexpr std::size_t dense_element_bytes(format f) noexcept {
  return f == format::f32 ? 4 : f == format::f16 ? 2 : 0;
}

}  // namespace kvcache
