#pragma once
/// @file view.hpp
/// Zero-copy views of a sequence's cached tokens: plain, trivially copyable structs usable from
/// CUDA kernels as well as host code.

#include <kvcache/config.hpp>
#include <kvcache/format.hpp>

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace kvcache {

/// A run of consecutive tokens of one layer of one sequence, keys in one format and values in
/// one format. Pointers are to host memory for cpu placement and device memory for cuda.
///
/// Layouts (head-major), with h = kv head, t = token in chunk, d = channel:
/// - f32 / f16:  k + h * k_head_stride bytes -> [t][head_dim] dense elements (same for v)
/// - q4 keys:    k + h * k_head_stride bytes -> one Q4 key group (format.hpp) of tokens
///               0..tokens-1 (tokens <= 32; the group starts at the chunk's first token)
/// - q4 values:  v + h * v_head_stride bytes -> one Q4 value group (format.hpp), tokens as keys
/// A chunk with Q4 keys or values holds at most 32 tokens. Q4 groups are 2-byte aligned (4 on
/// CUDA); with several kv heads the Q4 head strides are at least q4_key_group_bytes(head_dim) and
/// q4_value_group_bytes(head_dim).
struct chunk {
  const void* k = nullptr;
  const void* v = nullptr;
  std::size_t k_head_stride = 0;  ///< bytes between consecutive kv heads of k
  std::size_t v_head_stride = 0;  ///< bytes between consecutive kv heads of v
  std::uint32_t tokens = 0;       ///< valid tokens in this chunk
  format k_format = format::f16;
  format v_format = format::f16;

  /// Start of kv head h's keys.
  [[nodiscard]] KVCACHE_HOST_DEVICE const std::byte* k_head(std::uint32_t h) const noexcept {
    return static_cast<const std::byte*>(k) + h * k_head_stride;
  }
  /// Start of kv head h's values.
  [[nodiscard]] KVCACHE_HOST_DEVICE const std::byte* v_head(std::uint32_t h) const noexcept {
    return static_cast<const std::byte*>(v) + h * v_head_stride;
  }
};
static_assert(std::is_trivially_copyable_v<chunk>);

/// All committed tokens of one (sequence, layer), as an ordered list of chunks: a contiguous cache
/// gives one chunk, a paged cache one per block, a two-tier cache its Q4 store groups then its
/// FP16 tail. The chunk array is owned by the cache and stays valid until the next call that
/// mutates that sequence (reserve, commit, truncate, release, fork into it).
struct layer_view {
  const chunk* chunks = nullptr;
  std::uint32_t count = 0;   ///< number of chunks
  std::uint32_t tokens = 0;  ///< sum of chunks[i].tokens

  [[nodiscard]] KVCACHE_HOST_DEVICE const chunk* begin() const noexcept { return chunks; }
  [[nodiscard]] KVCACHE_HOST_DEVICE const chunk* end() const noexcept { return chunks + count; }
  [[nodiscard]] KVCACHE_HOST_DEVICE const chunk& operator[](std::uint32_t i) const noexcept { return chunks[i]; }
};
static_assert(std::is_trivially_copyable_v<layer_view>);

}  // namespace kvcache
