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
  q4,   ///< 4-bit codes in q4_block groups of 32 (keys per channel, values per token)
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

/// Tokens (for keys) or channels (for values) quantized together in one Q4 group.
inline constexpr std::uint32_t q4_group = 32;

/// One asymmetric Q4 group of up to 32 values: value_i = min + scale * code_i, code_i in [0, 15].
/// codes[j] holds element j in its low nibble and element j + 16 in its high nibble, so one
/// 16-byte load unpacks to elements 0..15 (low) and 16..31 (high). Unused elements of a partial
/// group have code 0. 20 bytes for 32 values: exactly 5 bits per value including scale and min.
///
/// Keys use one block per (kv head, channel) covering 32 consecutive tokens: a key group of one
/// head is `q4_block[head_dim]` (// [channel] -> codes over [token]). Values use one block per
/// (kv head, token, 32 consecutive channels): `q4_block[token][ceil(head_dim / 32)]`; when
/// head_dim % 32 != 0 the last block of each token holds the remaining head_dim % 32 channels.
struct q4_block {
  half scale;
  half min;
  std::uint8_t codes[q4_group / 2];
};
static_assert(sizeof(q4_block) == 20, "q4_block must be 20 bytes: 5 bits per value all-in");
static_assert(alignof(q4_block) == 2);

/// Q4 value blocks per token for one head: ceil(head_dim / 32).
[[nodiscard]] KVCACHE_HOST_DEVICE constexpr std::uint32_t q4_value_blocks(std::uint32_t head_dim) noexcept {
  return (head_dim + q4_group - 1) / q4_group;
}

/// Code of element i (0..31) of a block.
[[nodiscard]] KVCACHE_HOST_DEVICE constexpr std::uint8_t q4_code(const q4_block& b, std::uint32_t i) noexcept {
  return i < 16 ? static_cast<std::uint8_t>(b.codes[i] & 0x0f) : static_cast<std::uint8_t>(b.codes[i - 16] >> 4);
}

/// Bytes per element of a dense format (f32, f16); 0 for q4, whose size depends on grouping.
[[nodiscard]] KVCACHE_HOST_DEVICE constexpr std::size_t dense_element_bytes(format f) noexcept {
  return f == format::f32 ? 4 : f == format::f16 ? 2 : 0;
}

}  // namespace kvcache
