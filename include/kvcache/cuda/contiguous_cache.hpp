#pragma once
/// @file cuda/contiguous_cache.hpp
/// Tested on an H100 and an H200 against the CPU caches and float64 references (cuda/README.md).
/// contiguous_cache<cuda>: the contiguous cache with its K/V in device memory. Same protocol and
/// errors as contiguous_cache<cpu> (create / reserve / write / commit / length / truncate / release
/// / view / stats), so an engine switches placement with the template argument; plus the batch
/// forms of the decode hot path (prepare, write_batch, attend) that run on the device.
///
/// Device layout: one device_arena allocated by create(cfg), holding for every one of the
/// max_sequences slots // [layer][K|V][kv_head][capacity_tokens][head_dim] elements (f32 or f16),
/// each K or V layer buffer padded to 256 bytes. As device_pages, slot s is page s of
/// page_tokens = capacity_tokens (a contiguous cache is a paged cache with one page per sequence).
/// Unlike the cpu cache, the storage of all max_sequences is allocated up front (cudaMalloc is
/// too slow and synchronizing for sequence creation); stats().resident_bytes reports it.
///
/// Views: view() gives one chunk whose k/v point to *device* memory; the layer_view and its chunk
/// array are host memory (inspect them, copy K/V with copy_to_host). Kernels take the device CSR
/// table of a prepared batch instead (pages(), table()).
///
/// Streams: every device operation is enqueued on the placement's stream and returns without
/// waiting; a host-span write() returns once its input has been staged. Call cuda_synchronize()
/// before reading device results on the host.

#include <kvcache/attend.hpp>
#include <kvcache/cache.hpp>
#include <kvcache/contiguous_cache.hpp>
#include <kvcache/cuda/kernels.hpp>
#include <kvcache/cuda/runtime.hpp>
#include <kvcache/error.hpp>
#include <kvcache/geometry.hpp>
#include <kvcache/half.hpp>
#include <kvcache/placement.hpp>
#include <kvcache/view.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>

namespace kvcache {

/// Options of the device decode attention of a cuda cache.
struct cuda_attend_options {
  /// Tokens per flash-decoding split (a multiple of 32), or 0: chosen per call, the largest of
  /// 1024, 512, ..., 32 whose grid (sequences x kv heads x groups of 8 query heads x splits of
  /// max_tokens) still has a block for every multiprocessor of the device (fewer blocks leave it
  /// idle; smaller splits add per-block work). For a CUDA graph it depends only on the batch
  /// size, the heads and max_tokens, which a captured graph keeps fixed anyway.
  std::uint32_t split_tokens = 0;
  /// Longest sequence the launch covers: splits per sequence = ceil(max_tokens / split_tokens).
  /// 0: the cache's capacity_tokens for a contiguous cache, the longest sequence of the prepared
  /// batch for a paged cache. A CUDA graph captured with a fixed value stays valid while every
  /// sequence stays within it; invalid_argument when a prepared sequence is longer.
  std::size_t max_tokens = 0;
  /// attend_params::prefetch_steps (0..4: how many 16-token steps ahead each warp of the f16
  /// tensor-core kernel asks L2 for), or empty: cuda_auto_prefetch_steps of the call's split and
  /// grid. Only the speed changes: every value gives the same bytes. (attend_params::bypass_l1
  /// has no option here: the caches always take cuda_auto_bypass_l1 of the grid.)
  std::optional<std::uint32_t> prefetch_steps;
};

/// Contiguous cache in CUDA device memory. Move-only; one host thread at a time.
template <>
class contiguous_cache<cuda> {
 public:
  /// The placement policy type (kvcache::Cache requirement).
  using placement_type = cuda;

  /// Validates `cfg` (errors as contiguous_cache<cpu>::create) and allocates the device storage of
  /// max_sequences sequences on `where.device`: errc::out_of_memory if cudaMalloc refuses,
  /// errc::device_error for other CUDA errors (e.g. no device).
  [[nodiscard]] static result<contiguous_cache> create(const contiguous_config& cfg, const cuda& where = {});

  contiguous_cache(contiguous_cache&&) noexcept;             ///< moves the device storage
  contiguous_cache& operator=(contiguous_cache&&) noexcept;  ///< moves the device storage
  contiguous_cache(const contiguous_cache&) = delete;
  contiguous_cache& operator=(const contiguous_cache&) = delete;
  ~contiguous_cache();  ///< frees the device storage (cudaFree synchronizes the device)

  /// The geometry of every sequence.
  [[nodiscard]] const geometry& shape() const noexcept;
  /// The configuration the cache was created with.
  [[nodiscard]] const contiguous_config& config() const noexcept;
  /// Element format of stored K and V.
  [[nodiscard]] format storage() const noexcept;
  /// Device and stream every operation uses.
  [[nodiscard]] const cuda& placement() const noexcept;
  /// Bytes of K/V storage per sequence slot (all layers, K and V, with padding).
  [[nodiscard]] std::size_t bytes_per_sequence() const noexcept;

  /// A new empty sequence. errc::capacity_exceeded when max_sequences are live. No allocation.
  [[nodiscard]] result<seq_id> create();
  /// Opens a reservation of n tokens; errors as contiguous_cache<cpu>::reserve.
  [[nodiscard]] result<void> reserve(seq_id id, std::size_t n);
  /// Writes the reserved tokens of one layer from host memory: K, V [n][kv_heads][head_dim]
  /// floats. Staged to the device (the first write of a larger n grows the staging buffer: an
  /// allocation), then scattered by the append kernel; f16 storage rounds to nearest even, bit
  /// for bit as to_half. Errors as contiguous_cache<cpu>::write, plus out_of_memory/device_error.
  [[nodiscard]] result<void> write(seq_id id, std::uint32_t layer, std::span<const float> k, std::span<const float> v);
  /// The same from binary16 host rows.
  [[nodiscard]] result<void> write(seq_id id, std::uint32_t layer, std::span<const half> k, std::span<const half> v);
  /// Writes the reserved tokens of one layer from device memory: k, v point to device
  /// [n][kv_heads][head_dim] elements of `src` (f32 or f16), n the reserved count. No staging.
  /// Errors: unknown_sequence, layer_out_of_range, not_reserved, invalid_argument (null pointer
  /// with n > 0, src not f32/f16), device_error.
  [[nodiscard]] result<void> write_device(seq_id id, std::uint32_t layer, const void* k, const void* v,
                                          format src = format::f32);
  /// Makes the reserved tokens visible; errors as contiguous_cache<cpu>::commit.
  [[nodiscard]] result<void> commit(seq_id id);
  /// Committed tokens of a sequence, or unknown_sequence.
  [[nodiscard]] result<std::size_t> length(seq_id id) const;
  /// Keeps the first n tokens; errors as contiguous_cache<cpu>::truncate.
  [[nodiscard]] result<void> truncate(seq_id id, std::size_t n);
  /// A new sequence holding a copy of src's first n tokens (device-to-device copies of the rows,
  /// enqueued on the stream). Errors: unknown_sequence; reservation_pending if src has an open
  /// reservation; out_of_range if n > src's length; capacity_exceeded when max_sequences are
  /// live; device_error. Nothing changes on failure.
  [[nodiscard]] result<seq_id> copy_prefix(seq_id src, std::size_t n);
  /// A new sequence holding a copy of all of src's committed tokens (see copy_prefix).
  [[nodiscard]] result<seq_id> fork(seq_id src);
  /// Releases a sequence (its slot's storage stays allocated for the next create()).
  [[nodiscard]] result<void> release(seq_id id);
  /// The committed tokens of one layer: zero chunks or one chunk with device k/v pointers,
  /// // [kv_head][capacity_tokens][head_dim]. Errors: unknown_sequence, layer_out_of_range.
  [[nodiscard]] result<layer_view> view(seq_id id, std::uint32_t layer) const;
  /// Counters, O(1). resident_bytes: every byte the cache holds from the runtime: the device
  /// arena (all slots and the batch tables), the host-write staging on the device, and the
  /// pinned host memory the batch tables are uploaded from.
  [[nodiscard]] contiguous_stats stats() const noexcept;

  // ---- batch decode path (device) --------------------------------------------------------

  /// Uploads the device table of `batch` (distinct live sequences, at most max_sequences) for
  /// the next write_batch / attend calls. Each sequence's table length counts its committed tokens
  /// plus its open reservation, so write_batch fills the reservation and attend sees it (a decode
  /// step attends to its own new token). The table stays at the same device addresses, so a
  /// graph captured over write_batch/attend replays correctly after any later prepare().
  /// Invalidated by reserve, commit, truncate and release. Errors: invalid_argument (empty,
  /// too large or duplicate batch), unknown_sequence, device_error.
  [[nodiscard]] result<void> prepare(std::span<const seq_id> batch);
  /// One append launch for the prepared batch and one layer: k, v are device
  /// [rows][kv_heads][head_dim] in `src` format, rows = sum of the batch's reservations, in batch
  /// order. Errors: invalid_argument (no fresh prepared batch, null pointer, bad format),
  /// layer_out_of_range, device_error.
  [[nodiscard]] result<void> write_batch(std::uint32_t layer, const void* k, const void* v, format src = format::f32);
  /// Host bookkeeping only: records every layer of the prepared batch's reservations as written,
  /// for a replayed CUDA graph that contains write_batch for every layer (the replay runs the
  /// device work without the host calls). errc::invalid_argument when no batch is fresh.
  [[nodiscard]] result<void> mark_batch_written();
  /// Decode attention of the prepared batch over one layer: q, out device
  /// [batch][p.q_heads][head_dim] floats. p.kv_heads and p.head_dim must match the geometry
  /// (bad_shape otherwise); p.threads and p.pool are ignored. `workspace` grows (cudaMalloc) when
  /// too small: call once before capturing a graph. Errors as write_batch, plus bad_shape,
  /// unsupported (head_dim > cuda_max_head_dim).
  [[nodiscard]] result<void> attend(std::uint32_t layer, const attention_params& p, const float* q, float* out,
                                    device_buffer& workspace, const cuda_attend_options& opt = {});
  /// Device pages of one layer (page id = sequence slot) for the caller's own kernels.
  [[nodiscard]] result<device_pages> pages(std::uint32_t layer) const;
  /// Device CSR table of the prepared batch (invalid_argument when none is fresh).
  [[nodiscard]] result<device_table> table() const;

  struct impl;  ///< internal (cuda/contiguous_cache.cu)

 private:
  explicit contiguous_cache(std::unique_ptr<impl> p) noexcept;
  std::unique_ptr<impl> impl_;
};

static_assert(Cache<contiguous_cache<cuda>>);

}  // namespace kvcache
