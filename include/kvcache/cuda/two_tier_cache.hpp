#pragma once
/// @file cuda/two_tier_cache.hpp
/// Tested on an H100 and an H200 against the CPU caches and float64 references (cuda/README.md).
/// two_tier_cache<cuda>: recent tokens in an FP16 tail, older ones in 32-token store groups (Q4 or
/// FP16, keys per channel over 32 tokens, values per token over 32 channels; a Q4 group of a kv
/// head is the packed key or value group of format.hpp, as on the cpu), in device memory.
/// Same configuration type, protocol and errors as two_tier_cache<cpu>, with these differences
/// (each checked, with a typed error, never silently different):
/// - create() needs max_sequences > 0 and max_tokens > 0: device memory is allocated up front,
///   for every sequence's store (ceil(max_tokens / 32) groups) and tail (tail_tokens / 32 + 2
///   pages of 32 FP16 tokens), plus a shared overflow of ceil(max_tokens / 32) tail pages for
///   reservations longer than the tail; errc::invalid_argument otherwise.
/// - capacity_policy::streaming (and sink_tokens) are not implemented: errc::unsupported.
/// - truncate() into the store only at a group boundary (n a multiple of 32, or n >= the store's
///   tokens); a cut inside a store group is errc::unsupported (the cpu cache keeps a shortened
///   group; device tables only allow a partial last page).
/// - the tail is a list of 32-token FP16 pages (not a ring): the oldest full page migrates as one
///   group at commit, by the migration kernel (bit-identical to the scalar CPU quantizer), when the
///   tail holds tail_tokens + 32 or more tokens (repeatedly, for a long reservation).
/// - reserve() fails with errc::pool_exhausted when the shared overflow pages are taken by other
///   open long reservations.
///
/// Views: store groups first (one chunk each, in the store formats) then one FP16 chunk per tail
/// page; chunk k/v are device pointers, the chunk arrays host memory. The batch decode path
/// (prepare / write_batch / attend) attends over two device segments, store then tail, whose
/// flash-decoding partial states are merged together.

#include <kvcache/attend.hpp>
#include <kvcache/cache.hpp>
#include <kvcache/cuda/contiguous_cache.hpp>
#include <kvcache/cuda/kernels.hpp>
#include <kvcache/cuda/runtime.hpp>
#include <kvcache/error.hpp>
#include <kvcache/placement.hpp>
#include <kvcache/two_tier_cache.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

namespace kvcache {

/// Two-tier cache in CUDA device memory. Move-only; one host thread at a time.
template <>
class two_tier_cache<cuda> {
 public:
  using placement_type = cuda;        ///< where the memory lives
  using stats_type = two_tier_stats;  ///< what stats() returns

  /// Validates `cfg` (as two_tier_cache<cpu>::create, plus the limits in the file comment) and
  /// allocates the device memory on `where.device`.
  [[nodiscard]] static result<two_tier_cache> create(const two_tier_config& cfg, const cuda& where = {});

  two_tier_cache(two_tier_cache&&) noexcept;             ///< moves the device memory
  two_tier_cache& operator=(two_tier_cache&&) noexcept;  ///< moves the device memory
  two_tier_cache(const two_tier_cache&) = delete;
  two_tier_cache& operator=(const two_tier_cache&) = delete;
  ~two_tier_cache();

  /// The geometry every sequence stores.
  [[nodiscard]] geometry shape() const noexcept;
  /// The configuration the cache was created with.
  [[nodiscard]] const two_tier_config& settings() const noexcept;
  /// Device and stream every operation uses.
  [[nodiscard]] const cuda& placement() const noexcept;

  /// A new empty sequence. errc::capacity_exceeded when max_sequences are live.
  [[nodiscard]] result<seq_id> create();
  /// Opens a reservation of n tokens, taking the tail pages they land in and the store groups
  /// their commit will fill. Errors: unknown_sequence, reservation_pending, capacity_exceeded
  /// (past max_tokens), pool_exhausted (overflow tail pages in use).
  [[nodiscard]] result<void> reserve(seq_id s, std::size_t n);
  /// Writes the reserved tokens of one layer into the tail (staged host floats, append kernel).
  /// Errors as two_tier_cache<cpu>::write, plus out_of_memory (staging) and device_error.
  [[nodiscard]] result<void> write(seq_id s, std::uint32_t layer, std::span<const float> k, std::span<const float> v);
  /// The same from binary16 host rows.
  [[nodiscard]] result<void> write(seq_id s, std::uint32_t layer, std::span<const half> k, std::span<const half> v);
  /// The same from device rows [n][kv_heads][head_dim] of `src` (f32 or f16).
  [[nodiscard]] result<void> write_device(seq_id s, std::uint32_t layer, const void* k, const void* v,
                                          format src = format::f32);
  /// Makes the reserved tokens visible and migrates the oldest full tail pages into the store
  /// (one migration launch per 32 groups). Errors as two_tier_cache<cpu>::commit, plus device_error
  /// (then nothing changed).
  [[nodiscard]] result<void> commit(seq_id s);
  /// Tokens held (store + tail), or unknown_sequence.
  [[nodiscard]] result<std::size_t> length(seq_id s) const;
  /// Tokens dropped by streaming: always 0 here (streaming is not implemented).
  [[nodiscard]] result<std::size_t> dropped_tokens(seq_id s) const;
  /// Tier occupancy of one sequence (store_slabs counts store groups: one page each).
  [[nodiscard]] result<two_tier_sequence_info> info(seq_id s) const;
  /// Keeps the first n tokens; see the file comment for the store-boundary restriction.
  [[nodiscard]] result<void> truncate(seq_id s, std::size_t n);
  /// Releases a sequence and gives its pages back.
  [[nodiscard]] result<void> release(seq_id s);
  /// Store group chunks then tail page chunks (device pointers).
  [[nodiscard]] result<layer_view> view(seq_id s, std::uint32_t layer) const;
  /// Counters; byte counts are the device memory allocated (tail pool, store pool) and the host
  /// metadata; compression_ratio compares with FP16 K/V of the tokens held.
  [[nodiscard]] two_tier_stats stats() const;

  // ---- batch decode path (device) --------------------------------------------------------

  /// Uploads the device tables (store and tail CSR) of `batch`; the tail counts the open
  /// reservation. Invalidated by reserve, commit, truncate, create and release. Errors as
  /// contiguous_cache<cuda>::prepare.
  [[nodiscard]] result<void> prepare(std::span<const seq_id> batch);
  /// One append launch into the tails of the prepared batch; as contiguous_cache<cuda>::write_batch.
  [[nodiscard]] result<void> write_batch(std::uint32_t layer, const void* k, const void* v, format src = format::f32);
  /// Host bookkeeping after a graph replay; as contiguous_cache<cuda>::mark_batch_written.
  [[nodiscard]] result<void> mark_batch_written();
  /// Decode attention over store (Q4 read in place) and tail of the prepared batch; as
  /// contiguous_cache<cuda>::attend. opt.max_tokens 0 means max_tokens of the configuration.
  [[nodiscard]] result<void> attend(std::uint32_t layer, const attention_params& p, const float* q, float* out,
                                    device_buffer& workspace, const cuda_attend_options& opt = {});

  struct impl;  ///< internal (cuda/two_tier_cache.cpp)

 private:
  explicit two_tier_cache(std::unique_ptr<impl> p) noexcept;
  std::unique_ptr<impl> impl_;
};

static_assert(Cache<two_tier_cache<cuda>>);

}  // namespace kvcache
