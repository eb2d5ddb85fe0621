#pragma once
/// @file geometry.hpp
/// The shape every cache stores, strong ids for sequences, and checked size arithmetic.

#include <kvcache/config.hpp>
#include <kvcache/error.hpp>

#include <compare>
#include <cstddef>
#include <cstdint>
#include <limits>

namespace kvcache {

/// Shape of the K/V store: every token holds, per layer, one key and one value vector of
/// head_dim numbers for each of kv_heads heads.
struct geometry {
  std::uint32_t layers = 0;
  std::uint32_t kv_heads = 0;
  std::uint32_t head_dim = 0;

  /// kv_heads * head_dim: the numbers of one token's K (or V) in one layer.
  [[nodiscard]] constexpr std::size_t token_width() const noexcept {
    return static_cast<std::size_t>(kv_heads) * head_dim;
  }
  friend constexpr bool operator==(const geometry&, const geometry&) = default;
};

/// Identifies one sequence inside one cache. Strong type: never confused with a layer or a count.
/// Opaque: caches encode a slot and a generation so that a released id is never valid again.
struct seq_id {
  std::uint64_t value = 0;
  friend constexpr auto operator<=>(seq_id, seq_id) = default;
};

/// a * b, or an errc::overflow error naming both factors.
[[nodiscard]] inline result<std::size_t> checked_mul(std::size_t a, std::size_t b, std::string_view what) {
  if (a != 0 && b > std::numeric_limits<std::size_t>::max() / a)
    return fail(errc::overflow, what, {{"a", static_cast<long long>(a)}, {"b", static_cast<long long>(b)}});
  return a * b;
}

/// a + b, or an errc::overflow error.
[[nodiscard]] inline result<std::size_t> checked_add(std::size_t a, std::size_t b, std::string_view what) {
  if (b > std::numeric_limits<std::size_t>::max() - a)
    return fail(errc::overflow, what, {{"a", static_cast<long long>(a)}, {"b", static_cast<long long>(b)}});
  return a + b;
}

/// Checks that no dimension is zero.
[[nodiscard]] inline result<void> validate(const geometry& g) {
  if (g.layers == 0 || g.kv_heads == 0 || g.head_dim == 0)
    return fail(errc::invalid_argument, "geometry has a zero dimension",
                {{"layers", g.layers}, {"kv_heads", g.kv_heads}, {"head_dim", g.head_dim}});
  return {};
}

}  // namespace kvcache
