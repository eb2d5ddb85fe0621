#pragma once
/// @file cuda/paged_cache.hpp
/// Tested on an H100 and an H200 against the CPU caches and float64 references (cuda/README.md).
/// paged_cache<cuda>: the paged cache with its blocks in device memory (block_pool<cuda>). The
/// same protocol, semantics and errors as paged_cache<cpu> — block tables, ref-counted forks with
/// copy-on-write of a shared partial block (a device-to-device copy per layer), chained-hash
/// prefix reuse with an LRU of cached blocks, host CSR export — since the bookkeeping is the same
/// host code: detail::paged_book (paged_cache.hpp) over the pool's detail::block_ledger. Device
/// work: writes go through the append kernel, copy-on-write through cudaMemcpyAsync, and the
/// batch decode path (prepare / write_batch / attend) mirrors the prepared batch's block tables
/// to device memory in CSR form (indptr, indices, last_page_len).
///
/// Views: one chunk per block whose k/v are device pointers (the layer_view and chunks are host
/// memory). Streams: everything is enqueued on the cache's placement stream; a host-span write
/// returns once its input has been staged.

#include <kvcache/attend.hpp>
#include <kvcache/cache.hpp>
#include <kvcache/cuda/block_pool.hpp>
#include <kvcache/cuda/contiguous_cache.hpp>
#include <kvcache/cuda/kernels.hpp>
#include <kvcache/cuda/runtime.hpp>
#include <kvcache/error.hpp>
#include <kvcache/paged_cache.hpp>
#include <kvcache/placement.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

namespace kvcache {

/// Paged cache in CUDA device memory. Move-only; one host thread at a time (the pool may be
/// shared by caches on several threads).
template <>
class paged_cache<cuda> {
 public:
  /// The placement policy type (kvcache::Cache requirement).
  using placement_type = cuda;
  /// The pool type.
  using pool_type = block_pool<cuda>;

  /// Builds an empty cache on cfg.pool, or on a new block_pool<cuda> made from cfg's fields on
  /// `where.device`. Errors: those of block_pool<cuda>::create; errc::invalid_argument when
  /// cfg.shape is non-zero and differs from the shared pool's, when the pool is on another
  /// device, when max_sequences >= 2^32, or when expected_tokens exceeds the tokens the pool holds.
  [[nodiscard]] static result<paged_cache> create(const paged_config<cuda>& cfg, const cuda& where = {});

  paged_cache(paged_cache&&) noexcept;             ///< views stay valid
  paged_cache& operator=(paged_cache&&) noexcept;  ///< releases this cache's blocks first
  paged_cache(const paged_cache&) = delete;
  paged_cache& operator=(const paged_cache&) = delete;
  ~paged_cache();  ///< gives every block back to the pool

  /// The geometry of every sequence (the pool's).
  [[nodiscard]] const geometry& shape() const noexcept;
  /// The configuration the cache was created with (pool, shape, storage and B filled in).
  [[nodiscard]] const paged_config<cuda>& config() const noexcept;
  /// Storage format of K and V.
  [[nodiscard]] format storage() const noexcept;
  /// Tokens per block (B).
  [[nodiscard]] std::uint32_t block_tokens() const noexcept;
  /// The block pool.
  [[nodiscard]] const std::shared_ptr<pool_type>& pool() const noexcept;
  /// Device and stream every operation uses.
  [[nodiscard]] const cuda& placement() const noexcept;

  /// A new empty sequence; as paged_cache<cpu>::create.
  [[nodiscard]] result<seq_id> create();
  /// A new sequence adopting cached full blocks matching `tokens`; as paged_cache<cpu>.
  [[nodiscard]] result<prefix_match> create_with_prefix(std::span<const std::int32_t> tokens);
  /// Opens a reservation of n tokens, taking its blocks now (copy-on-write of a shared partial
  /// last block is enqueued here). Errors as paged_cache<cpu>::reserve, plus device_error.
  [[nodiscard]] result<void> reserve(seq_id id, std::size_t n);
  /// reserve() with the new tokens' ids (prefix reuse); as paged_cache<cpu>.
  [[nodiscard]] result<void> reserve(seq_id id, std::size_t n, std::span<const std::int32_t> token_ids);
  /// Writes the reserved tokens of one layer from host floats [n][kv_heads][head_dim]; staged,
  /// then one append launch per block the reservation touches. Errors as paged_cache<cpu>::write,
  /// plus out_of_memory (staging growth) and device_error.
  [[nodiscard]] result<void> write(seq_id id, std::uint32_t layer, std::span<const float> k, std::span<const float> v);
  /// The same from binary16 host rows.
  [[nodiscard]] result<void> write(seq_id id, std::uint32_t layer, std::span<const half> k, std::span<const half> v);
  /// The same from device rows of format `src` (f32 or f16); as contiguous_cache<cuda>::write_device.
  [[nodiscard]] result<void> write_device(seq_id id, std::uint32_t layer, const void* k, const void* v,
                                          format src = format::f32);
  /// Makes the reserved tokens visible (and indexes full blocks with known ids); as paged_cache<cpu>.
  [[nodiscard]] result<void> commit(seq_id id);
  /// Committed tokens of a sequence, or unknown_sequence.
  [[nodiscard]] result<std::size_t> length(seq_id id) const;
  /// Keeps the first n tokens, freeing whole blocks past n; as paged_cache<cpu>.
  [[nodiscard]] result<void> truncate(seq_id id, std::size_t n);
  /// A new sequence sharing all of src's committed tokens.
  [[nodiscard]] result<seq_id> fork(seq_id src);
  /// A new sequence sharing src's first n tokens; as paged_cache<cpu>.
  [[nodiscard]] result<seq_id> copy_prefix(seq_id src, std::size_t n);
  /// Releases a sequence; its blocks go back to the pool.
  [[nodiscard]] result<void> release(seq_id id);
  /// One chunk per block (device k/v pointers): // [kv_head][token < B][head_dim].
  [[nodiscard]] result<layer_view> view(seq_id id, std::uint32_t layer) const;
  /// Every block a sequence holds, committed and reserved, in token order.
  [[nodiscard]] result<std::span<const std::uint32_t>> blocks(seq_id id) const;
  /// Host CSR block tables of `seqs` (committed tokens only) into caller buffers; as paged_cache<cpu>.
  [[nodiscard]] result<block_table_csr> export_block_tables(std::span<const seq_id> seqs, std::span<std::int32_t> indptr,
                                                            std::span<std::int32_t> indices,
                                                            std::span<std::int32_t> last_block_len) const;
  /// The same into host buffers owned by the cache (grown as needed, reused), valid until the
  /// next export_block_tables call or cache move; out_of_memory where they cannot grow.
  [[nodiscard]] result<block_table_csr> export_block_tables(std::span<const seq_id> seqs);
  /// Counters; resident_bytes is the pool's device allocation (shared by every cache on it) plus
  /// this cache's own from the runtime: the host-write staging and batch tables on the device, and
  /// the pinned host memory the tables are uploaded from.
  [[nodiscard]] paged_stats stats() const;

  // ---- batch decode path (device) --------------------------------------------------------

  /// Sizes the device table for batches of up to `batch` sequences and `entries` block-table
  /// entries (allocation; prepare() grows it on demand otherwise, which moves its device
  /// addresses: size it before capturing a CUDA graph).
  [[nodiscard]] result<void> reserve_table(std::size_t batch, std::size_t entries);
  /// Uploads the CSR block tables of `batch` (distinct live sequences) to device memory; each
  /// sequence's table covers its committed tokens plus its open reservation (whose blocks
  /// reserve() already took). Invalidated by any later reserve, commit, truncate, fork, copy,
  /// create or release of this cache. Errors: invalid_argument (empty or duplicate batch),
  /// unknown_sequence, out_of_memory, device_error.
  [[nodiscard]] result<void> prepare(std::span<const seq_id> batch);
  /// One append launch for the prepared batch; as contiguous_cache<cuda>::write_batch.
  [[nodiscard]] result<void> write_batch(std::uint32_t layer, const void* k, const void* v, format src = format::f32);
  /// Host bookkeeping after a graph replay; as contiguous_cache<cuda>::mark_batch_written.
  [[nodiscard]] result<void> mark_batch_written();
  /// Decode attention of the prepared batch over one layer; as contiguous_cache<cuda>::attend.
  /// Splits per sequence are fixed from the pool's token capacity.
  [[nodiscard]] result<void> attend(std::uint32_t layer, const attention_params& p, const float* q, float* out,
                                    device_buffer& workspace, const cuda_attend_options& opt = {});
  /// Device pages of one layer (page = pool block).
  [[nodiscard]] result<device_pages> pages(std::uint32_t layer) const;
  /// Device CSR table of the prepared batch (invalid_argument when none is fresh).
  [[nodiscard]] result<device_table> table() const;

  struct impl;  ///< internal (cuda/paged_cache.cpp)

 private:
  explicit paged_cache(std::unique_ptr<impl> p) noexcept;
  std::unique_ptr<impl> impl_;
};

static_assert(Cache<paged_cache<cuda>>);

}  // namespace kvcache
