#pragma once
/// @file detail/protocol_checks.hpp
/// Not public API. The checks every cache (cpu and cuda) makes in write(), commit() and
/// truncate() after resolving the sequence, with the errors and the order the Cache suite pins.

#include <kvcache/error.hpp>
#include <kvcache/geometry.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>

namespace kvcache::detail {

/// A size as an error message's named value: clamped to the largest long long (a larger size_t
/// would otherwise print as a negative number).
[[nodiscard]] constexpr long long clamped(std::size_t x) noexcept {
  return static_cast<long long>(std::min<std::size_t>(x, std::numeric_limits<long long>::max()));
}

/// Checks that write(id, layer, ...) has a layer of the geometry and an open reservation.
[[nodiscard]] inline result<void> check_write_target(const geometry& g, seq_id id, std::uint32_t layer, bool reserved) {
  if (layer >= g.layers)
    return fail(errc::layer_out_of_range, "write: layer", {{"layer", layer}, {"layers", g.layers}});
  if (!reserved)
    return fail(errc::not_reserved, "write: no open reservation", {{"seq", static_cast<long long>(id.value)}});
  return {};
}

/// Checks write(id, layer, K, V) against the geometry and the sequence's open reservation of
/// `pending` tokens; K and V must each hold pending * kv_heads * head_dim values.
[[nodiscard]] inline result<void> check_write(const geometry& g, seq_id id, std::uint32_t layer,
                                              bool reserved, std::size_t pending, std::size_t k_size,
                                              std::size_t v_size) {
  KVCACHE_TRY(check_write_target(g, id, layer, reserved));
  const std::size_t expected = pending * g.token_width();  // the caches bound pending at reserve
  if (k_size != expected)
    return fail(errc::bad_shape, "write: K size (reserved tokens * kv_heads * head_dim)",
                {{"expected", static_cast<long long>(expected)}, {"got", static_cast<long long>(k_size)}});
  if (v_size != expected)
    return fail(errc::bad_shape, "write: V size (reserved tokens * kv_heads * head_dim)",
                {{"expected", static_cast<long long>(expected)}, {"got", static_cast<long long>(v_size)}});
  return {};
}

/// Checks commit(id) of a sequence: not_reserved without an open reservation, then
/// incomplete_write naming the first of the `layers` layers not written since reserve
/// (`written[l]` nonzero when layer l was; `written_count` of them).
template <class Written>
[[nodiscard]] result<void> check_commit(seq_id id, bool reserved, const Written& written, std::uint32_t written_count,
                                        std::uint32_t layers) {
  if (!reserved) return fail(errc::not_reserved, "commit: no open reservation", {{"seq", static_cast<long long>(id.value)}});
  if (written_count != layers) {
    std::uint32_t first = 0;
    while (first < layers && written[first]) ++first;
    return fail(errc::incomplete_write, "commit: a layer of the reservation was not written",
                {{"layer", first}, {"written_layers", written_count}, {"layers", layers}});
  }
  return {};
}

/// Checks truncate(id, n) of a sequence of `length` committed tokens: reservation_pending while
/// a reservation (of `pending` tokens) is open, then out_of_range if n > length.
[[nodiscard]] inline result<void> check_truncate(seq_id id, bool reserved, std::size_t pending, std::size_t n,
                                                 std::size_t length) {
  if (reserved)
    return fail(errc::reservation_pending, "truncate: a reservation is open",
                {{"seq", static_cast<long long>(id.value)}, {"pending", static_cast<long long>(pending)}});
  if (n > length)
    return fail(errc::out_of_range, "truncate: count past the sequence length",
                {{"n", clamped(n)},
                 {"length", static_cast<long long>(length)}});
  return {};
}

}  // namespace kvcache::detail
