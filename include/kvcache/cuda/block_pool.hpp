#pragma once
/// @file cuda/block_pool.hpp
/// Tested on an H100 and an H200 against the CPU caches and float64 references (cuda/README.md).
/// block_pool<cuda>: the block pool of paged_cache<cuda>. Same layout, configuration, errors and
/// bookkeeping as block_pool<cpu> (the very same detail::block_ledger: refcounts, LRU of cached
/// blocks, prefix-hash index and token ids live on the host), with the K/V storage in one
/// cudaMalloc'ed allocation of `where.device`:
///
///     storage // [layer][block][k|v][kv_head][token B][head_dim]   (device memory)
///
/// plus a device array identity[b] == b used by the single-sequence append. Every accessor that
/// returns a K/V pointer returns a device pointer. Safe for concurrent use by several caches, as
/// the cpu pool (the ledger locks; device work is ordered by each cache's stream).

#include <kvcache/block_pool.hpp>
#include <kvcache/cuda/kernels.hpp>
#include <kvcache/cuda/runtime.hpp>
#include <kvcache/error.hpp>
#include <kvcache/placement.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>

namespace kvcache {

/// Device-memory block pool. Create with create(); share with std::shared_ptr.
template <>
class block_pool<cuda> {
 public:
  using placement_type = cuda;

  /// Creates a pool of floor(budget_bytes / block_bytes) blocks (at most 2^31 - 1) on
  /// `where.device`. Errors as block_pool<cpu>::create, plus errc::out_of_memory when cudaMalloc
  /// refuses and errc::device_error for other CUDA errors (e.g. no device).
  [[nodiscard]] static result<std::shared_ptr<block_pool>> create(const block_pool_config& cfg, const cuda& where = {});

  ~block_pool();
  block_pool(const block_pool&) = delete;
  block_pool& operator=(const block_pool&) = delete;

  /// The pool's configuration.
  [[nodiscard]] const block_pool_config& config() const noexcept { return cfg_; }
  /// Geometry shared by every cache using the pool.
  [[nodiscard]] const geometry& shape() const noexcept { return cfg_.shape; }
  /// Tokens per block (B).
  [[nodiscard]] std::uint32_t block_tokens() const noexcept { return cfg_.block_tokens; }
  /// Storage format of K and V.
  [[nodiscard]] format storage() const noexcept { return cfg_.storage; }
  /// The device the storage lives on (stream of the creating call; caches use their own).
  [[nodiscard]] const cuda& placement() const noexcept { return where_; }
  /// Number of blocks.
  [[nodiscard]] std::uint32_t blocks() const noexcept { return ledger_.blocks(); }
  /// Bytes of one block over all layers (K and V).
  [[nodiscard]] std::size_t block_bytes() const noexcept { return block_stride_ * cfg_.shape.layers; }
  /// Bytes between block b and b+1 of one layer: 2 * kv_heads * head_stride().
  [[nodiscard]] std::size_t block_stride() const noexcept { return block_stride_; }
  /// Bytes between consecutive kv heads inside a block: B * head_dim * element size.
  [[nodiscard]] std::size_t head_stride() const noexcept { return head_stride_; }
  /// Bytes from a block's K to its V: kv_heads * head_stride().
  [[nodiscard]] std::size_t v_offset() const noexcept { return head_stride_ * cfg_.shape.kv_heads; }
  /// Layer l's region (device). // [block][k|v][kv_head][token B][head_dim]
  [[nodiscard]] std::byte* layer_base(std::uint32_t layer) const noexcept {
    return storage_ + static_cast<std::size_t>(layer) * layer_bytes_;
  }
  /// Start of block b's keys in layer l (device). // [kv_head][token B][head_dim]
  [[nodiscard]] std::byte* k_block(std::uint32_t layer, std::uint32_t b) const noexcept {
    return layer_base(layer) + static_cast<std::size_t>(b) * block_stride_;
  }
  /// Start of block b's values in layer l (device). // [kv_head][token B][head_dim]
  [[nodiscard]] std::byte* v_block(std::uint32_t layer, std::uint32_t b) const noexcept {
    return k_block(layer, b) + v_offset();
  }
  /// Layer l as device_pages (page = block) for the CUDA kernels.
  [[nodiscard]] device_pages pages(std::uint32_t layer) const noexcept;
  /// Device array [blocks()] with identity()[b] == b.
  [[nodiscard]] const std::uint32_t* identity() const noexcept { return identity_; }
  /// Device bytes allocated: K/V storage plus the identity array.
  [[nodiscard]] std::size_t resident_bytes() const noexcept { return arena_.capacity(); }

  /// Pool-wide counters (one consistent snapshot); resident_bytes as resident_bytes().
  [[nodiscard]] block_pool_stats stats() const;

  /// The bookkeeping (for caches built on the pool, and tests).
  [[nodiscard]] detail::block_ledger& ledger() noexcept { return ledger_; }
  [[nodiscard]] const detail::block_ledger& ledger() const noexcept { return ledger_; }

 private:
  struct make_tag {};

 public:
  /// Use create().
  block_pool(make_tag, const block_pool_config& cfg, const cuda& where, device_arena arena, std::byte* storage,
             const std::uint32_t* identity, std::size_t layer_bytes, std::size_t block_stride, std::size_t head_stride,
             std::uint32_t blocks);

 private:
  block_pool_config cfg_;
  cuda where_;
  device_arena arena_;
  std::byte* storage_;               // device, see the file comment
  const std::uint32_t* identity_;    // device [blocks]
  std::size_t layer_bytes_;
  std::size_t block_stride_;
  std::size_t head_stride_;
  detail::block_ledger ledger_;
};

}  // namespace kvcache
