#pragma once
/// @file block_pool.hpp
/// The shared block pool behind paged_cache: fixed-size blocks of B tokens carved out of one
/// allocation made at creation, with reference counts, an LRU list of cached (released but still
/// findable) blocks and a chained-hash index for prefix reuse. Safe for concurrent use by several
/// caches on several threads.
///
/// Block layout: one allocation holding, for every layer, all blocks of that layer:
///
///     storage // [layer][block][k|v][kv_head][token B][head_dim]
///
/// i.e. "one pool per layer with the same block ids", laid end to end. Why this layout and not
/// "one block = all layers' K and V":
/// - a kernel for layer l needs one base pointer (layer_base(l)) plus `block * block_stride()`
///   to find a block: exactly the paged-KV shape of FlashInfer / vLLM (`[num_pages][2][kv_head]
///   [page][head_dim]` per layer), so the CSR block table (indptr, indices, last_block_len) is
///   all a kernel needs, on the CPU or on a GPU;
/// - decode attention of one layer streams only that layer's region, so its working set is
///   contiguous per layer instead of strided by the whole model's per-token size;
/// - inside a block each head's B tokens are contiguous ([token][head_dim]), so a chunk is the
///   same head-major layout the contiguous cache uses and the attention kernels need no new case.
/// The price is that copying a block (copy-on-write) is `layers` memcpys of block_stride() bytes
/// instead of one; that happens once per fork-and-diverge, never per token.
///
/// Block states (each block is in exactly one): free (refcount 0, not indexed), in use (refcount
/// >= 1: held by one or more sequences, possibly of several caches), cached (refcount 0 but still
/// indexed by its prefix hash; reused by a matching sequence, or evicted least recently used first
/// when a reserve needs space). free + in_use + cached == total at all times.

#include <kvcache/error.hpp>
#include <kvcache/format.hpp>
#include <kvcache/geometry.hpp>
#include <kvcache/placement.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

namespace kvcache {

/// A chained prefix hash: the hash of one full block given its parent block's hash (or
/// prefix_hash_root for the first block) and the block's B token ids.
using prefix_hash_fn = std::uint64_t (*)(std::uint64_t parent, std::span<const std::int32_t> tokens) noexcept;

/// Parent hash used for the first block of every sequence.
inline constexpr std::uint64_t prefix_hash_root = 0x6b7663616368652dull;

/// The library's prefix hash: 64-bit XXH3 of the block's token ids, seeded with the parent hash
/// (compiled in kvcache::cpu; xxhash.h is not part of the public headers).
[[nodiscard]] std::uint64_t prefix_hash(std::uint64_t parent, std::span<const std::int32_t> tokens) noexcept;

/// Parameters of a block pool.
struct block_pool_config {
  geometry shape{};                   ///< layers, kv_heads, head_dim of every cache using the pool
  std::uint32_t block_tokens = 16;    ///< B: tokens per block, a power of two in [1, 65536]
  format storage = format::f16;       ///< f32 or f16 (K and V alike)
  std::size_t budget_bytes = 0;       ///< K/V storage budget; blocks = budget / block_bytes (>= 1)
  /// Test hook: replaces prefix_hash (nullptr: the library's). Lets tests force collisions.
  prefix_hash_fn hash = nullptr;
};

/// Pool-wide counters. A consistent snapshot taken under the pool's lock.
struct block_pool_stats {
  std::size_t blocks_total = 0;    ///< blocks carved from the budget
  std::size_t blocks_free = 0;     ///< refcount 0 and not indexed
  std::size_t blocks_in_use = 0;   ///< refcount >= 1
  std::size_t blocks_shared = 0;   ///< refcount >= 2 (subset of in_use)
  std::size_t blocks_cached = 0;   ///< refcount 0, still findable by prefix hash (evictable, LRU)
  std::size_t resident_bytes = 0;  ///< K/V storage bytes allocated (and touched) at creation
  std::size_t metadata_bytes = 0;  ///< bookkeeping bytes (refcounts, token ids, hash index)
  std::size_t evictions = 0;       ///< cached blocks reclaimed for new data since creation
  std::size_t prefix_query_blocks = 0;  ///< full blocks looked up by adopt()
  std::size_t prefix_hit_blocks = 0;    ///< of those, found and adopted
};

namespace detail {

/// Not public API. The pool's bookkeeping: refcounts, free list, LRU of cached blocks, the hash
/// index and every block's token ids. All members that touch shared state take the mutex.
///
/// Ownership rule that makes unlocked data access safe: a block's K/V data and token ids are
/// written only by the one sequence that holds it exclusively (refcount 1) and that made sure it
/// is not indexed (acquire() un-indexes it under the lock). Indexed or shared blocks are
/// immutable. Publishing (indexing) happens under the lock after the data was written, so a
/// thread that adopts the block under the lock later sees the finished data.
class block_ledger {
 public:
  /// "No block": the parent of a sequence's first block, or no partial tail.
  static constexpr std::uint32_t no_block = 0xffffffffu;

  /// Outcome of acquire().
  struct grant {
    bool ok = false;            ///< false: nothing changed
    bool copy = false;          ///< `tail` was shared: *copy_target receives its copy
    std::size_t needed = 0;     ///< blocks the request needed (copy included)
    std::size_t available = 0;  ///< free + cached blocks at the time
  };

  /// `blocks` free blocks of `block_tokens` tokens; `hash` replaces prefix_hash when non-null.
  block_ledger(std::uint32_t blocks, std::uint32_t block_tokens, prefix_hash_fn hash);

  /// Makes `tail` (the partial last block new tokens go into; no_block if none) writable and
  /// takes `fresh` new blocks into out[0..fresh). If tail is shared, one more block is taken
  /// into *copy_target (the caller copies tail into it, then unref()s tail). If tail is
  /// exclusively held but indexed, it is un-indexed. Evicts cached blocks (LRU first) when the
  /// free list runs short. All or nothing.
  [[nodiscard]] grant acquire(std::uint32_t tail, std::size_t fresh, std::uint32_t* out,
                              std::uint32_t* copy_target);

  /// refcount += 1 for every block (fork / copy_prefix).
  void add_refs(std::span<const std::uint32_t> blocks);

  /// refcount -= 1 for every block, last one first (so a released sequence's tail blocks are
  /// evicted before its head). A block reaching 0 becomes cached if indexed, else free.
  void unref(std::span<const std::uint32_t> blocks);

  /// Indexes the full blocks blocks[0..n) of one sequence, a chain whose parent is `parent`
  /// (no_block: blocks[0] is the sequence's first block). A block identical to an indexed one
  /// (same parent block, same token ids) is replaced in `blocks` by that one (its refcount taken,
  /// the duplicate freed). Returns how many entries of `blocks` changed.
  std::size_t publish(std::span<std::uint32_t> blocks, std::uint32_t parent);

  /// Adopts the longest indexed chain matching tokens[0 .. max_blocks * B), one block at a time:
  /// a block matches when its hash, its parent block and its token ids all match (token ids are
  /// compared, so a hash collision never adopts another prefix's keys). Writes the blocks to out
  /// (refcounts taken) and returns how many.
  std::size_t adopt(std::span<const std::int32_t> tokens, std::size_t max_blocks, std::uint32_t* out);

  /// Token ids of block b: int32[B]. Written only by b's exclusive holder (see class comment).
  [[nodiscard]] std::int32_t* tokens(std::uint32_t b) noexcept {
    return token_ids_.data() + static_cast<std::size_t>(b) * block_tokens_;
  }

  /// Current refcount of b (locked read; tests and assertions).
  [[nodiscard]] std::uint32_t refcount(std::uint32_t b) const;
  /// Whether b is indexed by its prefix hash (locked read; tests).
  [[nodiscard]] bool indexed(std::uint32_t b) const;

  /// Counters under the lock (resident_bytes left 0: the pool fills it).
  [[nodiscard]] block_pool_stats stats() const;

  /// Walks every block and list and checks each block is in exactly one state consistent with
  /// the lists, the index and the counters. Returns false (and the first bad block in *bad) on
  /// a violation. O(blocks); for tests.
  [[nodiscard]] bool check(std::uint32_t* bad = nullptr) const;

  /// Number of blocks.
  [[nodiscard]] std::uint32_t blocks() const noexcept { return blocks_; }
  /// Tokens per block (B).
  [[nodiscard]] std::uint32_t block_tokens() const noexcept { return block_tokens_; }

 private:
  [[nodiscard]] std::uint64_t chain_hash(std::uint32_t parent, const std::int32_t* toks) const noexcept;
  [[nodiscard]] std::uint32_t find_locked(std::uint64_t h, std::uint32_t parent, const std::int32_t* toks,
                                          std::uint32_t exclude) const noexcept;
  void index_locked(std::uint32_t b, std::uint64_t h, std::uint32_t parent) noexcept;
  void unindex_locked(std::uint32_t b) noexcept;
  void lru_push_locked(std::uint32_t b) noexcept;
  void lru_remove_locked(std::uint32_t b) noexcept;
  void ref_locked(std::uint32_t b) noexcept;
  void unref_locked(std::uint32_t b) noexcept;
  [[nodiscard]] std::uint32_t take_locked() noexcept;

  mutable std::mutex mu_;
  std::uint32_t blocks_;
  std::uint32_t block_tokens_;
  prefix_hash_fn hash_fn_;
  std::vector<std::uint32_t> ref_;         // [block] refcount
  std::vector<std::uint32_t> free_;        // stack of free blocks
  std::vector<std::uint32_t> lru_prev_;    // [block] cached-list links (no_block at the ends)
  std::vector<std::uint32_t> lru_next_;
  std::uint32_t lru_oldest_ = no_block;
  std::uint32_t lru_newest_ = no_block;
  std::vector<std::uint8_t> indexed_;      // [block] 1 when in the hash index
  std::vector<std::uint64_t> hash_;        // [block] chained hash (valid when indexed)
  std::vector<std::uint32_t> parent_;      // [block] parent block when indexed (no_block: first)
  std::vector<std::uint32_t> parent_gen_;  // [block] parent's generation when indexed
  std::vector<std::uint32_t> gen_;         // [block] bumped whenever b leaves the index
  std::vector<std::uint32_t> bucket_;      // [bucket] first block of the hash chain
  std::vector<std::uint32_t> bucket_next_; // [block] next block in the same bucket
  std::vector<std::int32_t> token_ids_;    // [block][B]
  std::size_t n_free_ = 0, n_cached_ = 0, n_in_use_ = 0, n_shared_ = 0, evictions_ = 0;
  std::size_t query_blocks_ = 0, hit_blocks_ = 0;
};

}  // namespace detail

/// A pool of KV blocks in memory of placement P. Declared for every placement; defined for cpu
/// here (a cuda specialization lives with the CUDA backend).
template <Placement P = cpu>
class block_pool;

/// Host-memory block pool: one 64-byte-aligned allocation made (and zero-filled, so it is
/// resident) at creation, never grown. Share it between caches with std::shared_ptr; every member
/// is safe to call concurrently from several threads.
template <>
class block_pool<cpu> {
 public:
  using placement_type = cpu;

  /// Creates a pool of floor(budget_bytes / block_bytes) blocks (at most 2^31 - 1).
  /// errc::invalid_argument for a zero geometry, a block size that is not a power of two, a
  /// storage format other than f32/f16 or a budget below one block; errc::overflow /
  /// errc::out_of_memory for sizes that do not fit.
  [[nodiscard]] static result<std::shared_ptr<block_pool>> create(const block_pool_config& cfg);

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
  /// Number of blocks.
  [[nodiscard]] std::uint32_t blocks() const noexcept { return ledger_.blocks(); }
  /// Bytes of one block over all layers (K and V): layers * block_stride().
  [[nodiscard]] std::size_t block_bytes() const noexcept { return block_stride_ * cfg_.shape.layers; }
  /// Bytes between block b and b+1 of one layer: 2 * kv_heads * head_stride().
  [[nodiscard]] std::size_t block_stride() const noexcept { return block_stride_; }
  /// Bytes between consecutive kv heads inside a block: B * head_dim * element size.
  [[nodiscard]] std::size_t head_stride() const noexcept { return head_stride_; }
  /// Bytes from a block's K to its V: kv_heads * head_stride().
  [[nodiscard]] std::size_t v_offset() const noexcept { return head_stride_ * cfg_.shape.kv_heads; }
  /// Layer l's region. // [block][k|v][kv_head][token B][head_dim]
  [[nodiscard]] std::byte* layer_base(std::uint32_t layer) const noexcept {
    return storage_ + static_cast<std::size_t>(layer) * layer_bytes_;
  }
  /// Start of block b's keys in layer l. // [kv_head][token B][head_dim]
  [[nodiscard]] std::byte* k_block(std::uint32_t layer, std::uint32_t b) const noexcept {
    return layer_base(layer) + static_cast<std::size_t>(b) * block_stride_;
  }
  /// Start of block b's values in layer l. // [kv_head][token B][head_dim]
  [[nodiscard]] std::byte* v_block(std::uint32_t layer, std::uint32_t b) const noexcept {
    return k_block(layer, b) + v_offset();
  }
  /// Bytes allocated for K/V storage.
  [[nodiscard]] std::size_t resident_bytes() const noexcept { return resident_; }

  /// Pool-wide counters (one consistent snapshot).
  [[nodiscard]] block_pool_stats stats() const;

  /// The bookkeeping (for caches built on the pool, and tests).
  [[nodiscard]] detail::block_ledger& ledger() noexcept { return ledger_; }
  [[nodiscard]] const detail::block_ledger& ledger() const noexcept { return ledger_; }

 private:
  struct make_tag {};

 public:
  /// Use create().
  block_pool(make_tag, const block_pool_config& cfg, std::byte* storage, std::size_t resident,
             std::size_t layer_bytes, std::size_t block_stride, std::size_t head_stride,
             std::uint32_t blocks);

 private:
  block_pool_config cfg_;
  std::byte* storage_;  // [layer][block][k|v][kv_head][token B][head_dim], 64-byte aligned
  std::size_t resident_;
  std::size_t layer_bytes_;
  std::size_t block_stride_;
  std::size_t head_stride_;
  detail::block_ledger ledger_;
};

}  // namespace kvcache
