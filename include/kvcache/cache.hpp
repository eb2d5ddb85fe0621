#pragma once
/// @file cache.hpp
/// The kvcache::Cache concept: the protocol every cache (contiguous, paged, two-tier) implements.

#include <kvcache/error.hpp>
#include <kvcache/geometry.hpp>
#include <kvcache/placement.hpp>
#include <kvcache/view.hpp>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>

namespace kvcache {

/// Counters every cache reports; each cache's stats type extends this with its own fields.
struct cache_stats {
  std::size_t sequences = 0;       ///< live sequences
  std::size_t tokens = 0;          ///< committed tokens summed over live sequences
  std::size_t resident_bytes = 0;  ///< K/V storage bytes actually allocated right now
};

/// A KV cache. The step protocol for each new run of n tokens of sequence s:
///   1. reserve(s, n)            make room; may fail (full, pool exhausted, unknown s): then nothing
///                               changed;
///   2. write(s, layer, K, V)    for every layer; K and V are [n][kv_heads][head_dim] floats
///                               (token-major, as a projection produces them);
///   3. commit(s)                the n tokens become visible to length() and view().
/// Plus create() a new empty sequence, length(s), truncate(s, n) keeping the first n tokens
/// (rollback), release(s), view(s, layer) and stats(). Every call that can fail returns a
/// result; after a failed call the cache is exactly as before.
template <class C>
concept Cache = requires(C& c, const C& cc, seq_id s, std::uint32_t layer, std::size_t n,
                         std::span<const float> kv) {
  typename C::placement_type;
  requires Placement<typename C::placement_type>;
  { cc.shape() } -> std::convertible_to<geometry>;
  { c.create() } -> std::same_as<result<seq_id>>;
  { c.reserve(s, n) } -> std::same_as<result<void>>;
  { c.write(s, layer, kv, kv) } -> std::same_as<result<void>>;
  { c.commit(s) } -> std::same_as<result<void>>;
  { cc.length(s) } -> std::same_as<result<std::size_t>>;
  { c.truncate(s, n) } -> std::same_as<result<void>>;
  { c.release(s) } -> std::same_as<result<void>>;
  { cc.view(s, layer) } -> std::same_as<result<layer_view>>;
  { cc.stats().resident_bytes } -> std::convertible_to<std::size_t>;
  { cc.stats().tokens } -> std::convertible_to<std::size_t>;
};

}  // namespace kvcache
