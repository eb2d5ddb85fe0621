#pragma once
/// @file paged_cache.hpp
/// The paged cache: sequences hold block tables into a (possibly shared) block_pool of B-token
/// blocks. Forks share blocks by reference count with copy-on-write of a shared partial block;
/// full blocks are indexed by a chained hash of their token ids so a new sequence with the same
/// prefix adopts them instead of recomputing them; released blocks stay cached (LRU) until their
/// space is needed. See block_pool.hpp for the block layout.
///
/// Per sequence: a block table (block i holds tokens [i*B, (i+1)*B)) and, per layer, one chunk per
/// block (`layer_view` chunks point into the pool). Both arrays grow geometrically at reserve when
/// a new block is needed and never shrink, so a sequence created with
/// paged_config::expected_tokens of room allocates nothing per token.
///
/// Thread safety: one paged_cache is used by one thread at a time. Several caches on one shared
/// pool may be used concurrently from different threads (the pool locks its bookkeeping).

#include <kvcache/block_pool.hpp>
#include <kvcache/cache.hpp>
#include <kvcache/config.hpp>
#include <kvcache/error.hpp>
#include <kvcache/format.hpp>
#include <kvcache/geometry.hpp>
#include <kvcache/half.hpp>
#include <kvcache/kernels.hpp>
#include <kvcache/placement.hpp>
#include <kvcache/view.hpp>
#include <kvcache/detail/id_table.hpp>
#include <kvcache/detail/protocol_checks.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

namespace kvcache {

/// Configuration of a paged cache with placement P.
template <Placement P = cpu>
struct paged_config {
  geometry shape{};                ///< layers, kv_heads, head_dim (must match the pool's if `pool` is set)
  format storage = format::f16;    ///< f32 or f16; ignored when `pool` is set (the pool's format)
  std::uint32_t block_tokens = 16; ///< B, a power of two; ignored when `pool` is set
  std::size_t budget_bytes = 0;    ///< K/V bytes of the cache's own pool; ignored when `pool` is set
  std::size_t max_sequences = 0;   ///< most live sequences at once (0: unbounded)
  /// Tokens per sequence to size each new sequence's block table and chunk arrays for (0: grow
  /// on demand). A sequence that stays within it allocates nothing after create().
  std::size_t expected_tokens = 0;
  /// A pool shared with other caches (nullptr: the cache creates its own from the fields above).
  std::shared_ptr<block_pool<P>> pool{};
};

/// Statistics of a paged cache. Block counts are pool-wide (shared by every cache of the pool).
struct paged_stats : cache_stats {
  std::size_t reserved_tokens = 0;  ///< tokens of open (uncommitted) reservations
  std::size_t block_tokens = 0;     ///< B
  std::size_t block_bytes = 0;      ///< K/V bytes of one block, all layers
  std::size_t blocks_total = 0;     ///< pool: all blocks
  std::size_t blocks_free = 0;      ///< pool: refcount 0, not cached
  std::size_t blocks_in_use = 0;    ///< pool: refcount >= 1
  std::size_t blocks_shared = 0;    ///< pool: refcount >= 2
  std::size_t blocks_cached = 0;    ///< pool: refcount 0, findable by prefix hash (evictable)
  std::size_t evictions = 0;        ///< pool: cached blocks reclaimed so far
  std::size_t table_blocks = 0;     ///< this cache: block-table entries over live sequences
  /// This cache: token slots held but not filled, sum over sequences of
  /// blocks * B - (length + reserved); less than B per sequence.
  std::size_t internal_waste_tokens = 0;
  std::size_t internal_waste_bytes = 0;  ///< internal_waste_tokens * bytes per token (all layers)
  std::size_t prefix_query_tokens = 0;   ///< this cache: tokens of full blocks looked up by create_with_prefix
  std::size_t prefix_hit_tokens = 0;     ///< of those, adopted from the pool
  double prefix_hit_rate = 0.0;          ///< hit / query tokens (0 before any query)
};

/// Result of create_with_prefix: the new sequence and how many leading tokens it already holds.
struct prefix_match {
  seq_id seq{};                    ///< the new sequence
  std::size_t cached_tokens = 0;   ///< its length: a multiple of B, < tokens.size(); skip computing these
};

/// A batch of block tables in CSR form, as paged attention kernels take them (FlashInfer's
/// indptr / indices / last_page_len). Sequence i holds blocks indices[indptr[i] .. indptr[i+1]);
/// its last block holds last_block_len[i] tokens (1..B; 0 only for an empty sequence). Plain
/// pointers: trivially copyable, usable from device code once copied there.
struct block_table_csr {
  const std::int32_t* indptr = nullptr;          ///< [batch + 1]
  const std::int32_t* indices = nullptr;         ///< [indptr[batch]] block ids in the pool
  const std::int32_t* last_block_len = nullptr;  ///< [batch]
  std::uint32_t batch = 0;                       ///< number of sequences
  std::uint32_t block_tokens = 0;                ///< B
};
static_assert(std::is_trivially_copyable_v<block_table_csr>);

/// A paged KV cache with placement P. Declared for every placement; cpu is defined here.
template <Placement P = cpu>
class paged_cache;

/// Paged cache in host memory. Move-only; views and block tables stay valid across a move.
template <>
class paged_cache<cpu> {
 public:
  /// The placement policy type (kvcache::Cache requirement).
  using placement_type = cpu;
  /// The pool type.
  using pool_type = block_pool<cpu>;

  /// Builds an empty cache on cfg.pool, or on a new pool made from cfg's shape, storage,
  /// block_tokens and budget_bytes. Errors: those of block_pool::create; errc::invalid_argument
  /// when cfg.shape is non-zero and differs from the shared pool's (naming both), when
  /// max_sequences >= 2^32, or when expected_tokens exceeds the tokens the pool holds.
  [[nodiscard]] static result<paged_cache> create(const paged_config<cpu>& cfg) {
    std::shared_ptr<pool_type> pool = cfg.pool;
    if (pool) {
      const geometry& ps = pool->shape();
      if (cfg.shape != geometry{} && cfg.shape != ps)
        return fail(errc::invalid_argument, "paged_config.shape differs from the shared pool's",
                    {{"layers", cfg.shape.layers}, {"pool_layers", ps.layers}, {"kv_heads", cfg.shape.kv_heads},
                     {"pool_kv_heads", ps.kv_heads}, {"head_dim", cfg.shape.head_dim},
                     {"pool_head_dim", ps.head_dim}});
    } else {
      block_pool_config pc;
      pc.shape = cfg.shape;
      pc.block_tokens = cfg.block_tokens;
      pc.storage = cfg.storage;
      pc.budget_bytes = cfg.budget_bytes;
      auto made = pool_type::create(pc);
      KVCACHE_TRY(made);
      pool = std::move(made).value();
    }
    if (cfg.max_sequences > std::numeric_limits<std::uint32_t>::max())
      return fail(errc::invalid_argument, "paged_config.max_sequences must be < 2^32",
                  {{"max_sequences", static_cast<long long>(cfg.max_sequences)}});
    const std::size_t pool_tokens = static_cast<std::size_t>(pool->blocks()) * pool->block_tokens();
    if (cfg.expected_tokens > pool_tokens)
      return fail(errc::invalid_argument, "paged_config.expected_tokens exceeds the pool's tokens",
                  {{"expected_tokens", static_cast<long long>(cfg.expected_tokens)},
                   {"pool_tokens", static_cast<long long>(pool_tokens)}});
    return paged_cache(cfg, std::move(pool));
  }

  paged_cache(paged_cache&&) noexcept = default;             ///< views stay valid
  paged_cache& operator=(paged_cache&& other) noexcept {     ///< releases this cache's blocks first
    if (this != &other) {
      release_all();
      pool_ = std::move(other.pool_);
      cfg_ = std::move(other.cfg_);
      ids_ = std::move(other.ids_);
      seqs_ = std::move(other.seqs_);
      csr_indptr_ = std::move(other.csr_indptr_);
      csr_indices_ = std::move(other.csr_indices_);
      csr_last_ = std::move(other.csr_last_);
      tokens_ = other.tokens_;
      reserved_ = other.reserved_;
      query_tokens_ = other.query_tokens_;
      hit_tokens_ = other.hit_tokens_;
    }
    return *this;
  }
  paged_cache(const paged_cache&) = delete;
  paged_cache& operator=(const paged_cache&) = delete;
  /// Gives every block of every live sequence back to the pool (cached if indexed).
  ~paged_cache() { release_all(); }

  /// The geometry of every sequence (the pool's).
  [[nodiscard]] const geometry& shape() const noexcept { return pool_->shape(); }
  /// The configuration the cache was created with.
  [[nodiscard]] const paged_config<cpu>& config() const noexcept { return cfg_; }
  /// Storage format of K and V.
  [[nodiscard]] format storage() const noexcept { return pool_->storage(); }
  /// Tokens per block (B).
  [[nodiscard]] std::uint32_t block_tokens() const noexcept { return pool_->block_tokens(); }
  /// The block pool (shared with other caches or not).
  [[nodiscard]] const std::shared_ptr<pool_type>& pool() const noexcept { return pool_; }

  /// A new empty sequence (no blocks yet). errc::capacity_exceeded when max_sequences are live.
  [[nodiscard]] result<seq_id> create() {
    result<seq_id> id = ids_.acquire();
    KVCACHE_TRY(id);
    const std::uint32_t slot = ids_.slot(id.value(), "create").value();
    sequence& s = fresh_slot(slot);
    ensure_capacity(s, blocks_for(cfg_.expected_tokens));
    return id;
  }

  /// A new sequence for a prompt of `tokens`, adopting the longest chain of cached full blocks
  /// matching its start (token ids compared, not only hashes). Adopts at most
  /// (tokens.size() - 1) / B blocks so at least one token remains for the engine to compute (its
  /// logits are needed). The sequence's length is the returned cached_tokens; reserve the rest
  /// with their token ids (reserve(seq, n, ids)) to make its own blocks findable in turn.
  /// Errors: errc::capacity_exceeded when max_sequences are live.
  [[nodiscard]] result<prefix_match> create_with_prefix(std::span<const std::int32_t> tokens) {
    result<seq_id> id = ids_.acquire();
    KVCACHE_TRY(id);
    const std::uint32_t slot = ids_.slot(id.value(), "create_with_prefix").value();
    sequence& s = fresh_slot(slot);
    const std::size_t B = block_tokens();
    const std::size_t max_blocks = tokens.empty() ? 0 : (tokens.size() - 1) / B;
    ensure_capacity(s, std::max(max_blocks, blocks_for(cfg_.expected_tokens)));
    s.blocks.resize(max_blocks);
    const std::size_t k = pool_->ledger().adopt(tokens, max_blocks, s.blocks.data());
    s.blocks.resize(k);
    for (std::size_t i = 0; i < k; ++i) set_chunk(s, i, static_cast<std::uint32_t>(B));
    s.length = s.known = k * B;
    s.hashed = k;
    tokens_ += s.length;
    query_tokens_ += max_blocks * B;
    hit_tokens_ += k * B;
    return prefix_match{id.value(), s.length};
  }

  /// Opens a reservation of n new tokens (n may be 0), taking the blocks they need from the pool
  /// now, so that write() and commit() cannot fail. If the sequence's partial last block is
  /// shared (after fork / copy_prefix / adoption), it is copied first (copy-on-write).
  /// Errors: unknown_sequence; reservation_pending; pool_exhausted naming the blocks needed and
  /// the blocks free (or evictable). Nothing changes on failure.
  [[nodiscard]] result<void> reserve(seq_id id, std::size_t n) { return reserve_impl(id, n, {}); }

  /// reserve() with the n new tokens' ids ([n] int32), which makes the blocks they fill
  /// findable for prefix reuse once committed. Ids are kept only while every earlier token's id
  /// is known (a sequence reserved once without ids stays unhashed from there on).
  /// Additional error: bad_shape if token_ids.size() != n.
  [[nodiscard]] result<void> reserve(seq_id id, std::size_t n, std::span<const std::int32_t> token_ids) {
    if (token_ids.size() != n) {
      result<std::uint32_t> slot = ids_.slot(id, "reserve: unknown sequence");
      KVCACHE_TRY(slot);
      return fail(errc::bad_shape, "reserve: token id count differs from the token count",
                  {{"n", static_cast<long long>(n)}, {"token_ids", static_cast<long long>(token_ids.size())}});
    }
    return reserve_impl(id, n, token_ids);
  }

  /// Writes the reserved tokens of one layer. K and V: [n][kv_heads][head_dim] floats, n the
  /// reserved count, stored in the pool's format (f16: round-to-nearest-even through the active
  /// kernels). Writing a layer again overwrites it. Errors, in this order: unknown_sequence,
  /// layer_out_of_range, not_reserved, bad_shape (naming expected and got).
  [[nodiscard]] result<void> write(seq_id id, std::uint32_t layer, std::span<const float> k,
                                   std::span<const float> v) {
    return write_impl(id, layer, k, v);
  }

  /// The same with K and V in binary16 ([n][kv_heads][head_dim] halves).
  [[nodiscard]] result<void> write(seq_id id, std::uint32_t layer, std::span<const half> k,
                                   std::span<const half> v) {
    return write_impl(id, layer, k, v);
  }

  /// Makes the reserved tokens visible; full blocks whose token ids are known are indexed for
  /// prefix reuse (a block identical to an already indexed one is swapped for it and freed).
  /// Errors: unknown_sequence; not_reserved; incomplete_write naming the first unwritten layer.
  [[nodiscard]] result<void> commit(seq_id id) {
    result<std::uint32_t> slot = ids_.slot(id, "commit: unknown sequence");
    KVCACHE_TRY(slot);
    sequence& s = seqs_[slot.value()];
    KVCACHE_TRY(detail::check_commit(id, s.reserved, s.written, s.written_count, shape().layers));
    const std::size_t B = block_tokens();
    const std::size_t old = s.length;
    s.length += s.pending;
    tokens_ += s.pending;
    reserved_ -= s.pending;
    s.pending = 0;
    s.reserved = false;
    for (std::size_t i = old / B; i < s.blocks.size(); ++i) set_tokens(s, i);
    if (s.pending_ids) {
      s.pending_ids = false;
      s.known = s.length;
      const std::size_t full = s.length / B;
      if (full > s.hashed) {
        const std::uint32_t parent = s.hashed == 0 ? detail::block_ledger::no_block : s.blocks[s.hashed - 1];
        const std::span<std::uint32_t> fresh(s.blocks.data() + s.hashed, full - s.hashed);
        if (pool_->ledger().publish(fresh, parent) != 0)
          for (std::size_t i = s.hashed; i < full; ++i) set_chunk(s, i, static_cast<std::uint32_t>(B));
        s.hashed = full;
      }
    }
    return {};
  }

  /// Committed tokens of a sequence, or unknown_sequence.
  [[nodiscard]] result<std::size_t> length(seq_id id) const {
    result<std::uint32_t> slot = ids_.slot(id, "length: unknown sequence");
    KVCACHE_TRY(slot);
    return seqs_[slot.value()].length;
  }

  /// Keeps the first n tokens (rollback, to any length): whole blocks past n go back to the
  /// pool (cached if indexed, else free), a partial last block is kept. Errors:
  /// unknown_sequence; reservation_pending; out_of_range if n > length.
  [[nodiscard]] result<void> truncate(seq_id id, std::size_t n) {
    result<std::uint32_t> slot = ids_.slot(id, "truncate: unknown sequence");
    KVCACHE_TRY(slot);
    sequence& s = seqs_[slot.value()];
    KVCACHE_TRY(detail::check_truncate(id, s.reserved, s.pending, n, s.length));
    const std::size_t B = block_tokens();
    const std::size_t keep = blocks_for(n);
    if (keep < s.blocks.size()) {
      pool_->ledger().unref(std::span<const std::uint32_t>(s.blocks).subspan(keep));
      s.blocks.resize(keep);
    }
    tokens_ -= s.length - n;
    s.length = n;
    s.known = std::min(s.known, n);
    s.hashed = std::min(s.hashed, n / B);
    if (keep > 0) set_tokens(s, keep - 1);
    return {};
  }

  /// A new sequence sharing all of src's committed tokens (see copy_prefix).
  [[nodiscard]] result<seq_id> fork(seq_id src) {
    result<std::uint32_t> slot = ids_.slot(src, "fork: unknown sequence");
    KVCACHE_TRY(slot);
    return copy_prefix_impl(src, slot.value(), seqs_[slot.value()].length, "fork");
  }

  /// A new sequence holding src's first n tokens by sharing src's blocks (reference counts, no
  /// copy). The first write of either sequence into a shared partial block copies it; full
  /// blocks stay shared. Errors: unknown_sequence; reservation_pending if src has an open
  /// reservation; out_of_range if n > src's length; capacity_exceeded when max_sequences are live.
  [[nodiscard]] result<seq_id> copy_prefix(seq_id src, std::size_t n) {
    result<std::uint32_t> slot = ids_.slot(src, "copy_prefix: unknown sequence");
    KVCACHE_TRY(slot);
    return copy_prefix_impl(src, slot.value(), n, "copy_prefix");
  }

  /// Releases a sequence (an open reservation is dropped): its blocks go back to the pool, last
  /// block first (indexed ones stay cached, least recently used evicted first). The id is
  /// rejected with unknown_sequence ever after.
  [[nodiscard]] result<void> release(seq_id id) {
    result<std::uint32_t> slot = ids_.slot(id, "release: unknown sequence");
    KVCACHE_TRY(slot);
    sequence& s = seqs_[slot.value()];
    drop_blocks(s);
    ids_.release(slot.value());
    return {};
  }

  /// The committed tokens of one layer, one chunk per block (the last may be partial):
  /// // chunk k, v: [kv_head][token < B][head_dim], head stride B * head_dim elements.
  /// Valid until the next call that mutates this sequence. Errors: unknown_sequence,
  /// layer_out_of_range.
  [[nodiscard]] result<layer_view> view(seq_id id, std::uint32_t layer) const {
    result<std::uint32_t> slot = ids_.slot(id, "view: unknown sequence");
    KVCACHE_TRY(slot);
    if (layer >= shape().layers)
      return fail(errc::layer_out_of_range, "view: layer", {{"layer", layer}, {"layers", shape().layers}});
    const sequence& s = seqs_[slot.value()];
    const std::size_t count = blocks_for(s.length);
    const chunk* first = count == 0 ? nullptr : s.chunks.data() + static_cast<std::size_t>(layer) * s.chunk_cap;
    return layer_view{first, static_cast<std::uint32_t>(count), static_cast<std::uint32_t>(s.length)};
  }

  /// Every block a sequence holds, committed and reserved, in token order (tests, debugging).
  [[nodiscard]] result<std::span<const std::uint32_t>> blocks(seq_id id) const {
    result<std::uint32_t> slot = ids_.slot(id, "blocks: unknown sequence");
    KVCACHE_TRY(slot);
    return std::span<const std::uint32_t>(seqs_[slot.value()].blocks);
  }

  /// CSR block tables of `seqs` (committed tokens only) written into caller buffers: indptr
  /// [seqs.size() + 1], indices [total blocks], last_block_len [seqs.size()]. Errors:
  /// unknown_sequence (naming the id); bad_shape naming the buffer that is too small, its
  /// needed and given sizes. Nothing is written on failure.
  [[nodiscard]] result<block_table_csr> export_block_tables(std::span<const seq_id> seqs,
                                                            std::span<std::int32_t> indptr,
                                                            std::span<std::int32_t> indices,
                                                            std::span<std::int32_t> last_block_len) const {
    std::size_t total = 0;
    for (const seq_id id : seqs) {
      result<std::uint32_t> slot = ids_.slot(id, "export_block_tables: unknown sequence");
      KVCACHE_TRY(slot);
      total += blocks_for(seqs_[slot.value()].length);
    }
    if (seqs.size() >= std::numeric_limits<std::uint32_t>::max() ||
        total > static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()))
      return fail(errc::overflow, "export_block_tables: batch too large for int32 CSR",
                  {{"sequences", static_cast<long long>(seqs.size())}, {"blocks", static_cast<long long>(total)}});
    if (indptr.size() < seqs.size() + 1)
      return fail(errc::bad_shape, "export_block_tables: indptr buffer too small",
                  {{"needed", static_cast<long long>(seqs.size() + 1)}, {"got", static_cast<long long>(indptr.size())}});
    if (indices.size() < total)
      return fail(errc::bad_shape, "export_block_tables: indices buffer too small",
                  {{"needed", static_cast<long long>(total)}, {"got", static_cast<long long>(indices.size())}});
    if (last_block_len.size() < seqs.size())
      return fail(errc::bad_shape, "export_block_tables: last_block_len buffer too small",
                  {{"needed", static_cast<long long>(seqs.size())},
                   {"got", static_cast<long long>(last_block_len.size())}});
    const std::size_t B = block_tokens();
    std::size_t at = 0;
    indptr[0] = 0;
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      const sequence& s = seqs_[ids_.slot(seqs[i], "export_block_tables").value()];
      const std::size_t count = blocks_for(s.length);
      for (std::size_t b = 0; b < count; ++b) indices[at++] = static_cast<std::int32_t>(s.blocks[b]);
      indptr[i + 1] = static_cast<std::int32_t>(at);
      last_block_len[i] = static_cast<std::int32_t>(count == 0 ? 0 : s.length - (count - 1) * B);
    }
    return block_table_csr{indptr.data(), indices.data(), last_block_len.data(),
                           static_cast<std::uint32_t>(seqs.size()), block_tokens()};
  }

  /// The same into buffers owned by the cache (grown as needed, reused), valid until the next
  /// export_block_tables call or cache move.
  [[nodiscard]] result<block_table_csr> export_block_tables(std::span<const seq_id> seqs) {
    std::size_t total = 0;
    for (const seq_id id : seqs) {
      result<std::uint32_t> slot = ids_.slot(id, "export_block_tables: unknown sequence");
      KVCACHE_TRY(slot);
      total += blocks_for(seqs_[slot.value()].length);
    }
    if (csr_indptr_.size() < seqs.size() + 1) csr_indptr_.resize(seqs.size() + 1);
    if (csr_indices_.size() < total) csr_indices_.resize(total);
    if (csr_last_.size() < seqs.size()) csr_last_.resize(seqs.size());
    return export_block_tables(seqs, csr_indptr_, csr_indices_, csr_last_);
  }

  /// Counters: this cache's sequences and tokens, the pool's block states (one snapshot under
  /// the pool's lock), and internal waste. resident_bytes is the pool's K/V allocation (shared
  /// by every cache on the pool). O(sequence slots).
  [[nodiscard]] paged_stats stats() const {
    const block_pool_stats ps = pool_->stats();
    paged_stats st;
    st.sequences = ids_.live();
    st.tokens = tokens_;
    st.resident_bytes = ps.resident_bytes;
    st.reserved_tokens = reserved_;
    st.block_tokens = block_tokens();
    st.block_bytes = pool_->block_bytes();
    st.blocks_total = ps.blocks_total;
    st.blocks_free = ps.blocks_free;
    st.blocks_in_use = ps.blocks_in_use;
    st.blocks_shared = ps.blocks_shared;
    st.blocks_cached = ps.blocks_cached;
    st.evictions = ps.evictions;
    for (std::uint32_t slot = 0; slot < seqs_.size(); ++slot) {
      if (!ids_.is_live(slot)) continue;
      const sequence& s = seqs_[slot];
      st.table_blocks += s.blocks.size();
      st.internal_waste_tokens += s.blocks.size() * block_tokens() - s.length - s.pending;
    }
    st.internal_waste_bytes = st.internal_waste_tokens * (pool_->block_bytes() / block_tokens());
    st.prefix_query_tokens = query_tokens_;
    st.prefix_hit_tokens = hit_tokens_;
    st.prefix_hit_rate =
        query_tokens_ == 0 ? 0.0 : static_cast<double>(hit_tokens_) / static_cast<double>(query_tokens_);
    return st;
  }

 private:
  struct sequence {
    std::vector<std::uint32_t> blocks;  // [block index] pool block id, committed then reserved
    std::vector<chunk> chunks;          // [layer][chunk_cap] one chunk per block
    std::vector<std::uint8_t> written;  // [layer] written since the open reservation began
    std::size_t chunk_cap = 0;          // block slots per layer in `chunks`
    std::size_t length = 0;             // committed tokens
    std::size_t pending = 0;            // tokens of the open reservation
    std::size_t known = 0;              // leading tokens whose ids are known (<= length)
    std::size_t hashed = 0;             // leading blocks indexed in the pool (== known / B)
    std::uint32_t written_count = 0;    // layers with written[l] set
    bool reserved = false;              // a reservation is open
    bool pending_ids = false;           // the open reservation's token ids were recorded
  };

  paged_cache(const paged_config<cpu>& cfg, std::shared_ptr<pool_type> pool)
      : pool_(std::move(pool)), cfg_(cfg), ids_(cfg.max_sequences) {
    cfg_.pool = pool_;
    cfg_.shape = pool_->shape();
    cfg_.storage = pool_->storage();
    cfg_.block_tokens = pool_->block_tokens();
  }

  [[nodiscard]] std::size_t blocks_for(std::size_t tokens) const noexcept {
    const std::size_t B = block_tokens();
    return tokens / B + (tokens % B != 0 ? 1 : 0);
  }

  void release_all() noexcept {
    if (!pool_) return;
    for (std::uint32_t slot = 0; slot < seqs_.size(); ++slot)
      if (ids_.is_live(slot)) drop_blocks(seqs_[slot]);
  }

  // Returns every block of s to the pool and clears s (its arrays keep their capacity).
  void drop_blocks(sequence& s) noexcept {
    pool_->ledger().unref(s.blocks);
    s.blocks.clear();
    tokens_ -= s.length;
    reserved_ -= s.pending;
    s.length = s.pending = s.known = s.hashed = 0;
    s.reserved = s.pending_ids = false;
    s.written_count = 0;
  }

  sequence& fresh_slot(std::uint32_t slot) {
    if (slot >= seqs_.size()) seqs_.resize(static_cast<std::size_t>(slot) + 1);
    sequence& s = seqs_[slot];
    s.blocks.clear();
    s.written.assign(shape().layers, 0);
    s.length = s.pending = s.known = s.hashed = 0;
    s.written_count = 0;
    s.reserved = s.pending_ids = false;
    return s;
  }

  // Grows s's block table and chunk arrays to hold `blocks` blocks (geometric growth).
  void ensure_capacity(sequence& s, std::size_t blocks) {
    if (s.blocks.capacity() < blocks) s.blocks.reserve(std::max(blocks, 2 * s.blocks.capacity()));
    if (s.chunk_cap >= blocks) return;
    const std::size_t cap = std::max<std::size_t>({blocks, 2 * s.chunk_cap, 4});
    const std::uint32_t layers = shape().layers;
    std::vector<chunk> grown(cap * layers);
    for (std::uint32_t l = 0; l < layers; ++l)
      std::copy_n(s.chunks.begin() + static_cast<std::ptrdiff_t>(l * s.chunk_cap), s.blocks.size(),
                  grown.begin() + static_cast<std::ptrdiff_t>(l * cap));
    s.chunks = std::move(grown);
    s.chunk_cap = cap;
  }

  // Points block i's chunk of every layer at its pool block, with `tokens` valid tokens.
  void set_chunk(sequence& s, std::size_t i, std::uint32_t tokens) noexcept {
    const pool_type& p = *pool_;
    const std::uint32_t b = s.blocks[i];
    for (std::uint32_t l = 0; l < p.shape().layers; ++l) {
      chunk& c = s.chunks[l * s.chunk_cap + i];
      c.k = p.k_block(l, b);
      c.v = p.v_block(l, b);
      c.k_head_stride = c.v_head_stride = p.head_stride();
      c.tokens = tokens;
      c.k_format = c.v_format = p.storage();
    }
  }

  // Sets block i's visible token count in every layer from the committed length.
  void set_tokens(sequence& s, std::size_t i) noexcept {
    const std::size_t B = block_tokens();
    const std::size_t start = i * B;
    const auto t = static_cast<std::uint32_t>(s.length <= start ? 0 : std::min(B, s.length - start));
    for (std::uint32_t l = 0; l < shape().layers; ++l) s.chunks[l * s.chunk_cap + i].tokens = t;
  }

  [[nodiscard]] result<void> reserve_impl(seq_id id, std::size_t n, std::span<const std::int32_t> token_ids) {
    result<std::uint32_t> slot = ids_.slot(id, "reserve: unknown sequence");
    KVCACHE_TRY(slot);
    sequence& s = seqs_[slot.value()];
    if (s.reserved)
      return fail(errc::reservation_pending, "reserve: a reservation is already open",
                  {{"seq", static_cast<long long>(id.value)}, {"pending", static_cast<long long>(s.pending)}});
    const std::size_t B = block_tokens();
    const std::size_t have = s.blocks.size();
    std::size_t fresh = 0;
    if (n > 0) {
      // More tokens than the whole pool holds can never fit: answer before any arithmetic that
      // could overflow or any allocation sized by n.
      const std::size_t pool_tokens = static_cast<std::size_t>(pool_->blocks()) * B;
      if (n > pool_tokens)
        return fail(errc::pool_exhausted, "reserve: more tokens than the block pool holds",
                    {{"tokens", static_cast<long long>(n)}, {"pool_tokens", static_cast<long long>(pool_tokens)}});
      fresh = blocks_for(s.length + n) - have;
      ensure_capacity(s, have + fresh);
      const std::uint32_t tail = s.length % B != 0 ? s.blocks.back() : detail::block_ledger::no_block;
      s.blocks.resize(have + fresh);
      std::uint32_t copy = detail::block_ledger::no_block;
      const detail::block_ledger::grant g = pool_->ledger().acquire(tail, fresh, s.blocks.data() + have, &copy);
      if (!g.ok) {
        s.blocks.resize(have);
        return fail(errc::pool_exhausted, "reserve: block pool exhausted",
                    {{"needed", static_cast<long long>(g.needed)}, {"free", static_cast<long long>(g.available)},
                     {"tokens", static_cast<long long>(n)}});
      }
      if (g.copy) {
        copy_block(tail, copy);
        s.blocks[have - 1] = copy;
        pool_->ledger().unref(std::span<const std::uint32_t>(&tail, 1));
        set_chunk(s, have - 1, static_cast<std::uint32_t>(s.length - (have - 1) * B));
      }
      for (std::size_t i = have; i < have + fresh; ++i) set_chunk(s, i, 0);
      if (!token_ids.empty() && s.known == s.length) {
        for (std::size_t t = 0; t < n; ++t) {
          const std::size_t pos = s.length + t;
          pool_->ledger().tokens(s.blocks[pos / B])[pos % B] = token_ids[t];
        }
        s.pending_ids = true;
      }
    } else {
      s.pending_ids = !token_ids.empty() && s.known == s.length;
    }
    s.reserved = true;
    s.pending = n;
    reserved_ += n;
    s.written_count = 0;
    std::fill(s.written.begin(), s.written.end(), std::uint8_t{0});
    return {};
  }

  // Copies block `from` into block `to`: K/V of every layer and the token ids.
  void copy_block(std::uint32_t from, std::uint32_t to) noexcept {
    const pool_type& p = *pool_;
    for (std::uint32_t l = 0; l < p.shape().layers; ++l)
      std::memcpy(p.k_block(l, to), p.k_block(l, from), p.block_stride());
    std::memcpy(pool_->ledger().tokens(to), pool_->ledger().tokens(from), sizeof(std::int32_t) * block_tokens());
  }

  [[nodiscard]] result<seq_id> copy_prefix_impl(seq_id src_id, std::uint32_t src_slot, std::size_t n,
                                                const char* what) {
    {
      const sequence& src = seqs_[src_slot];
      if (src.reserved)
        return fail(errc::reservation_pending, what,
                    {{"seq", static_cast<long long>(src_id.value)}, {"pending", static_cast<long long>(src.pending)}});
      if (n > src.length)
        return fail(errc::out_of_range, what,
                    {{"n", static_cast<long long>(n)}, {"length", static_cast<long long>(src.length)}});
    }
    result<seq_id> id = ids_.acquire();
    KVCACHE_TRY(id);
    const std::uint32_t slot = ids_.slot(id.value(), what).value();
    sequence& dst = fresh_slot(slot);  // may grow seqs_: take src's reference after it
    const sequence& src = seqs_[src_slot];
    const std::size_t B = block_tokens();
    const std::size_t count = blocks_for(n);
    ensure_capacity(dst, std::max(count, blocks_for(cfg_.expected_tokens)));
    dst.blocks.assign(src.blocks.begin(), src.blocks.begin() + static_cast<std::ptrdiff_t>(count));
    pool_->ledger().add_refs(dst.blocks);
    for (std::uint32_t l = 0; l < shape().layers; ++l)
      std::copy_n(src.chunks.begin() + static_cast<std::ptrdiff_t>(l * src.chunk_cap), count,
                  dst.chunks.begin() + static_cast<std::ptrdiff_t>(l * dst.chunk_cap));
    dst.length = n;
    dst.known = std::min(src.known, n);
    dst.hashed = std::min(src.hashed, n / B);
    if (count > 0) set_tokens(dst, count - 1);
    tokens_ += n;
    return id;
  }

  // Copies n rows of head_dim elements from a token-major source (row stride src_stride) into
  // consecutive rows at dst, converting to the storage format.
  static void store_rows(const float* src, std::size_t src_stride, std::size_t rows, std::uint32_t head_dim,
                         format storage, std::byte* dst) noexcept {
    const std::size_t row_bytes = static_cast<std::size_t>(head_dim) * dense_element_bytes(storage);
    if (storage == format::f32) {
      for (std::size_t t = 0; t < rows; ++t) std::memcpy(dst + t * row_bytes, src + t * src_stride, row_bytes);
    } else {
      const kernels::table& kt = kernels::active();
      for (std::size_t t = 0; t < rows; ++t)
        kt.f32_to_f16(src + t * src_stride, reinterpret_cast<half*>(dst + t * row_bytes), head_dim);
    }
  }
  static void store_rows(const half* src, std::size_t src_stride, std::size_t rows, std::uint32_t head_dim,
                         format storage, std::byte* dst) noexcept {
    const std::size_t row_bytes = static_cast<std::size_t>(head_dim) * dense_element_bytes(storage);
    if (storage == format::f16) {
      for (std::size_t t = 0; t < rows; ++t) std::memcpy(dst + t * row_bytes, src + t * src_stride, row_bytes);
    } else {
      const kernels::table& kt = kernels::active();
      for (std::size_t t = 0; t < rows; ++t)
        kt.f16_to_f32(src + t * src_stride, reinterpret_cast<float*>(dst + t * row_bytes), head_dim);
    }
  }

  template <class T>
  [[nodiscard]] result<void> write_impl(seq_id id, std::uint32_t layer, std::span<const T> k, std::span<const T> v) {
    result<std::uint32_t> slot = ids_.slot(id, "write: unknown sequence");
    KVCACHE_TRY(slot);
    const geometry& g = shape();
    sequence& s = seqs_[slot.value()];
    KVCACHE_TRY(detail::check_write(g, id, layer, s.reserved, s.pending, k.size(), v.size()));
    const std::size_t tw = g.token_width();
    const pool_type& p = *pool_;
    const std::size_t B = block_tokens();
    const format fmt = p.storage();
    const std::size_t row_bytes = static_cast<std::size_t>(g.head_dim) * dense_element_bytes(fmt);
    const std::size_t end = s.length + s.pending;
    // Head-outer, block-inner: each head's source rows are read in one long constant-stride
    // sweep (as the contiguous cache does), which the hardware prefetchers follow far better
    // than short per-block sweeps; the destination is a run of up to B contiguous rows.
    for (std::uint32_t h = 0; h < g.kv_heads; ++h) {
      for (std::size_t pos = s.length; pos < end;) {
        const std::size_t off = pos % B;
        const std::size_t run = std::min(B - off, end - pos);
        const std::uint32_t b = s.blocks[pos / B];
        const std::size_t dst = h * p.head_stride() + off * row_bytes;  // block: [kv_head][token B][head_dim]
        const std::size_t src = (pos - s.length) * tw + static_cast<std::size_t>(h) * g.head_dim;  // [token][kv_head][head_dim]
        store_rows(k.data() + src, tw, run, g.head_dim, fmt, p.k_block(layer, b) + dst);
        store_rows(v.data() + src, tw, run, g.head_dim, fmt, p.v_block(layer, b) + dst);
        pos += run;
      }
    }
    if (!s.written[layer]) {
      s.written[layer] = 1;
      ++s.written_count;
    }
    return {};
  }

  std::shared_ptr<pool_type> pool_;
  paged_config<cpu> cfg_;
  detail::id_table ids_;
  std::vector<sequence> seqs_;          // [slot]
  std::vector<std::int32_t> csr_indptr_;   // cache-owned CSR export buffers
  std::vector<std::int32_t> csr_indices_;
  std::vector<std::int32_t> csr_last_;
  std::size_t tokens_ = 0;        // committed tokens over live sequences
  std::size_t reserved_ = 0;      // tokens of open reservations
  std::size_t query_tokens_ = 0;  // create_with_prefix: tokens of full blocks looked up
  std::size_t hit_tokens_ = 0;    // create_with_prefix: tokens adopted
};

static_assert(Cache<paged_cache<cpu>>);

}  // namespace kvcache
