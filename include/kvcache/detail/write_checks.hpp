#pragma once
/// @file detail/write_checks.hpp
/// Not public API. The argument checks every cache's write() makes after resolving the sequence,
/// in the order the Cache suite pins: layer_out_of_range, not_reserved, bad_shape (K, then V).

#include <kvcache/error.hpp>
#include <kvcache/geometry.hpp>

#include <cstddef>
#include <cstdint>

namespace kvcache::detail {

/// Checks write(id, layer, K, V) against the geometry and the sequence's open reservation of
/// `pending` tokens; K and V must each hold pending * kv_heads * head_dim values.
[[nodiscard]] inline result<void> check_write(const geometry& g, seq_id id, std::uint32_t layer,
                                              bool reserved, std::size_t pending, std::size_t k_size,
                                              std::size_t v_size) {
  if (layer >= g.layers)
    return fail(errc::layer_out_of_range, "write: layer", {{"layer", layer}, {"layers", g.layers}});
  if (!reserved)
    return fail(errc::not_reserved, "write: no open reservation", {{"seq", static_cast<long long>(id.value)}});
  const std::size_t expected = pending * g.token_width();  // the caches bound pending at reserve
  if (k_size != expected)
    return fail(errc::bad_shape, "write: K size (reserved tokens * kv_heads * head_dim)",
                {{"expected", static_cast<long long>(expected)}, {"got", static_cast<long long>(k_size)}});
  if (v_size != expected)
    return fail(errc::bad_shape, "write: V size (reserved tokens * kv_heads * head_dim)",
                {{"expected", static_cast<long long>(expected)}, {"got", static_cast<long long>(v_size)}});
  return {};
}

}  // namespace kvcache::detail
