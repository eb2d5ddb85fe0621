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
#include <kvcache/detail/store_row.hpp>

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

namespace detail {

/// The host-side bookkeeping of a paged cache, shared by paged_cache<cpu> and paged_cache<cuda>
/// (Pool: block_pool<cpu> or block_pool<cuda>, which have the same interface): sequence ids,
/// per-sequence block tables and per-layer chunk arrays over the pool's blocks, reservations,
/// commits with prefix publishing, truncation, copy-on-write forks, views, CSR export and the
/// cache's counters. What differs by placement is passed in: how a block is copied (reserve) and
/// what must happen before blocks are published to other caches (commit). Every operation
/// checks its arguments before it changes anything, and a failed call leaves the sequences as
/// they were (where reserve's block copy fails, the blocks it took go back to the pool).
template <class Pool>
struct paged_book {
  struct sequence {
    std::vector<std::uint32_t> blocks;  // [block index] pool block id, committed then reserved
    std::vector<chunk> chunks;          // [layer][chunk_cap] one chunk per block (device pointers on cuda)
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

  std::shared_ptr<Pool> pool;
  id_table ids;
  std::vector<sequence> seqs;  // [slot]
  std::size_t expected_tokens = 0;  // tokens each new sequence's arrays are sized for
  std::size_t tokens = 0;           // committed tokens over live sequences
  std::size_t reserved_tokens = 0;  // tokens of open reservations
  std::size_t query_tokens = 0;     // create_with_prefix: tokens of full blocks looked up
  std::size_t hit_tokens = 0;       // create_with_prefix: tokens adopted
  std::vector<std::int32_t> csr_indptr, csr_indices, csr_last;  // book-owned CSR export buffers

  paged_book(std::shared_ptr<Pool> p, std::size_t max_sequences, std::size_t expected)
      : pool(std::move(p)), ids(max_sequences), expected_tokens(expected) {}
  paged_book(paged_book&&) noexcept = default;
  /// Releases this book's blocks first.
  paged_book& operator=(paged_book&& other) noexcept {
    if (this != &other) {
      release_all();
      pool = std::move(other.pool);
      ids = std::move(other.ids);
      seqs = std::move(other.seqs);
      expected_tokens = other.expected_tokens;
      tokens = other.tokens;
      reserved_tokens = other.reserved_tokens;
      query_tokens = other.query_tokens;
      hit_tokens = other.hit_tokens;
      csr_indptr = std::move(other.csr_indptr);
      csr_indices = std::move(other.csr_indices);
      csr_last = std::move(other.csr_last);
    }
    return *this;
  }
  paged_book(const paged_book&) = delete;
  paged_book& operator=(const paged_book&) = delete;
  /// Gives every block of every live sequence back to the pool (cached if indexed).
  ~paged_book() { release_all(); }

  [[nodiscard]] const geometry& shape() const noexcept { return pool->shape(); }
  [[nodiscard]] std::size_t B() const noexcept { return pool->block_tokens(); }
  [[nodiscard]] std::size_t blocks_for(std::size_t t) const noexcept { return t / B() + (t % B() != 0 ? 1 : 0); }

  // ---- the protocol (the caches' public calls; see paged_cache<cpu> for each one's contract) ----

  [[nodiscard]] result<seq_id> create() {
    result<seq_id> id = ids.acquire();
    KVCACHE_TRY(id);
    const std::uint32_t slot = ids.slot(id.value(), "create").value();
    if (!detail::try_allocate([&] { ensure_capacity(fresh_slot(slot), blocks_for(expected_tokens)); }))
      return refused(slot, "create: block table", blocks_for(expected_tokens));
    return id;
  }

  [[nodiscard]] result<prefix_match> create_with_prefix(std::span<const std::int32_t> prompt) {
    result<seq_id> id = ids.acquire();
    KVCACHE_TRY(id);
    const std::uint32_t slot = ids.slot(id.value(), "create_with_prefix").value();
    const std::size_t max_blocks = prompt.empty() ? 0 : (prompt.size() - 1) / B();
    const std::size_t table = std::max(max_blocks, blocks_for(expected_tokens));
    if (!detail::try_allocate([&] { ensure_capacity(fresh_slot(slot), table); }))
      return refused(slot, "create_with_prefix: block table", table);
    sequence& s = seqs[slot];
    s.blocks.resize(max_blocks);  // within its capacity
    const std::size_t k = pool->ledger().adopt(prompt, max_blocks, s.blocks.data());
    s.blocks.resize(k);
    for (std::size_t i = 0; i < k; ++i) set_chunk(s, i, static_cast<std::uint32_t>(B()));
    s.length = s.known = k * B();
    s.hashed = k;
    tokens += s.length;
    query_tokens += max_blocks * B();
    hit_tokens += k * B();
    return prefix_match{id.value(), s.length};
  }

  /// bad_shape if token_ids.size() != n (after unknown_sequence), else reserve().
  template <class CopyBlock>
  [[nodiscard]] result<void> reserve_with_ids(seq_id id, std::size_t n, std::span<const std::int32_t> token_ids,
                                              CopyBlock&& copy_block) {
    if (token_ids.size() != n) {
      result<std::uint32_t> slot = ids.slot(id, "reserve: unknown sequence");
      KVCACHE_TRY(slot);
      return fail(errc::bad_shape, "reserve: token id count differs from the token count",
                  {{"n", clamped(n)}, {"token_ids", clamped(token_ids.size())}});
    }
    return reserve(id, n, token_ids, copy_block);
  }

  /// Opens a reservation of n tokens, taking its blocks now. copy_block(from, to) -> result<void>
  /// copies a shared partial last block (every layer's K/V and its token ids); where it fails,
  /// every block taken is given back and its error returned.
  template <class CopyBlock>
  [[nodiscard]] result<void> reserve(seq_id id, std::size_t n, std::span<const std::int32_t> token_ids,
                                     CopyBlock&& copy_block) {
    result<std::uint32_t> slot = ids.slot(id, "reserve: unknown sequence");
    KVCACHE_TRY(slot);
    sequence& s = seqs[slot.value()];
    if (s.reserved)
      return fail(errc::reservation_pending, "reserve: a reservation is already open",
                  {{"seq", static_cast<long long>(id.value)}, {"pending", clamped(s.pending)}});
    const std::size_t have = s.blocks.size();
    if (n > 0) {
      // More tokens than the whole pool holds can never fit: answer before any arithmetic that
      // could overflow or any allocation sized by n.
      const std::size_t pool_tokens = static_cast<std::size_t>(pool->blocks()) * B();
      if (n > pool_tokens)
        return fail(errc::pool_exhausted, "reserve: more tokens than the block pool holds",
                    {{"tokens", clamped(n)}, {"pool_tokens", clamped(pool_tokens)}});
      const std::size_t fresh = blocks_for(s.length + n) - have;
      if (!detail::try_allocate([&] { ensure_capacity(s, have + fresh); }))
        return fail(errc::out_of_memory, "reserve: block table", {{"blocks", clamped(have + fresh)}});
      const std::uint32_t tail = s.length % B() != 0 ? s.blocks.back() : block_ledger::no_block;
      s.blocks.resize(have + fresh);
      std::uint32_t copy = block_ledger::no_block;
      const block_ledger::grant g = pool->ledger().acquire(tail, fresh, s.blocks.data() + have, &copy);
      if (!g.ok) {
        s.blocks.resize(have);
        return fail(errc::pool_exhausted, "reserve: block pool exhausted",
                    {{"needed", clamped(g.needed)}, {"free", clamped(g.available)}, {"tokens", clamped(n)}});
      }
      if (g.copy) {
        const result<void> copied = copy_block(tail, copy);
        if (!copied.has_value()) {  // give the new blocks back
          pool->ledger().unref(std::span<const std::uint32_t>(&copy, 1));
          pool->ledger().unref(std::span<const std::uint32_t>(s.blocks).subspan(have));
          s.blocks.resize(have);
          return copied;
        }
        s.blocks[have - 1] = copy;
        pool->ledger().unref(std::span<const std::uint32_t>(&tail, 1));
        set_chunk(s, have - 1, static_cast<std::uint32_t>(s.length - (have - 1) * B()));
      }
      for (std::size_t i = have; i < have + fresh; ++i) set_chunk(s, i, 0);
      if (!token_ids.empty() && s.known == s.length) {
        for (std::size_t t = 0; t < n; ++t) {
          const std::size_t pos = s.length + t;
          pool->ledger().tokens(s.blocks[pos / B()])[pos % B()] = token_ids[t];
        }
        s.pending_ids = true;
      }
    } else {
      s.pending_ids = !token_ids.empty() && s.known == s.length;
    }
    s.reserved = true;
    s.pending = n;
    reserved_tokens += n;
    s.written_count = 0;
    std::fill(s.written.begin(), s.written.end(), std::uint8_t{0});
    return {};
  }

  /// Makes the reserved tokens visible and publishes full blocks with known ids.
  /// before_publish() -> result<void> runs, once every check has passed, where blocks are about
  /// to become adoptable by other caches of the pool; where it fails, nothing changes.
  template <class BeforePublish>
  [[nodiscard]] result<void> commit(seq_id id, BeforePublish&& before_publish) {
    result<std::uint32_t> slot = ids.slot(id, "commit: unknown sequence");
    KVCACHE_TRY(slot);
    sequence& s = seqs[slot.value()];
    KVCACHE_TRY(check_commit(id, s.reserved, s.written, s.written_count, shape().layers));
    if (s.pending_ids && (s.length + s.pending) / B() > s.hashed) KVCACHE_TRY(before_publish());
    const std::size_t old = s.length;
    s.length += s.pending;
    tokens += s.pending;
    reserved_tokens -= s.pending;
    s.pending = 0;
    s.reserved = false;
    for (std::size_t i = old / B(); i < s.blocks.size(); ++i) set_tokens(s, i);
    if (s.pending_ids) {
      s.pending_ids = false;
      s.known = s.length;
      const std::size_t full = s.length / B();
      if (full > s.hashed) {
        const std::uint32_t parent = s.hashed == 0 ? block_ledger::no_block : s.blocks[s.hashed - 1];
        const std::span<std::uint32_t> fresh(s.blocks.data() + s.hashed, full - s.hashed);
        if (pool->ledger().publish(fresh, parent) != 0)
          for (std::size_t i = s.hashed; i < full; ++i) set_chunk(s, i, static_cast<std::uint32_t>(B()));
        s.hashed = full;
      }
    }
    return {};
  }

  [[nodiscard]] result<std::size_t> length(seq_id id) const {
    result<std::uint32_t> slot = ids.slot(id, "length: unknown sequence");
    KVCACHE_TRY(slot);
    return seqs[slot.value()].length;
  }

  [[nodiscard]] result<void> truncate(seq_id id, std::size_t n) {
    result<std::uint32_t> slot = ids.slot(id, "truncate: unknown sequence");
    KVCACHE_TRY(slot);
    sequence& s = seqs[slot.value()];
    KVCACHE_TRY(check_truncate(id, s.reserved, s.pending, n, s.length));
    const std::size_t keep = blocks_for(n);
    if (keep < s.blocks.size()) {
      pool->ledger().unref(std::span<const std::uint32_t>(s.blocks).subspan(keep));
      s.blocks.resize(keep);
    }
    tokens -= s.length - n;
    s.length = n;
    s.known = std::min(s.known, n);
    s.hashed = std::min(s.hashed, n / B());
    if (keep > 0) set_tokens(s, keep - 1);
    return {};
  }

  /// copy_prefix(src, n), or fork(src) where `whole` (n is then src's length).
  [[nodiscard]] result<seq_id> copy_prefix(seq_id src_id, std::size_t n, bool whole) {
    const char* what = whole ? "fork" : "copy_prefix";
    result<std::uint32_t> src_slot = ids.slot(src_id, whole ? "fork: unknown sequence" : "copy_prefix: unknown sequence");
    KVCACHE_TRY(src_slot);
    {
      const sequence& src = seqs[src_slot.value()];
      if (whole) n = src.length;
      if (src.reserved)
        return fail(errc::reservation_pending, what,
                    {{"seq", static_cast<long long>(src_id.value)}, {"pending", clamped(src.pending)}});
      if (n > src.length) return fail(errc::out_of_range, what, {{"n", clamped(n)}, {"length", clamped(src.length)}});
    }
    result<seq_id> id = ids.acquire();
    KVCACHE_TRY(id);
    const std::uint32_t slot = ids.slot(id.value(), what).value();
    const std::size_t count = blocks_for(n);
    const std::size_t table = std::max(count, blocks_for(expected_tokens));
    if (!detail::try_allocate([&] { ensure_capacity(fresh_slot(slot), table); }))  // may grow seqs
      return refused(slot, whole ? "fork: block table" : "copy_prefix: block table", table);
    sequence& dst = seqs[slot];
    const sequence& src = seqs[src_slot.value()];  // after seqs grew
    dst.blocks.assign(src.blocks.begin(), src.blocks.begin() + static_cast<std::ptrdiff_t>(count));
    pool->ledger().add_refs(dst.blocks);
    for (std::uint32_t l = 0; l < shape().layers; ++l)
      std::copy_n(src.chunks.begin() + static_cast<std::ptrdiff_t>(l * src.chunk_cap), count,
                  dst.chunks.begin() + static_cast<std::ptrdiff_t>(l * dst.chunk_cap));
    dst.length = n;
    dst.known = std::min(src.known, n);
    dst.hashed = std::min(src.hashed, n / B());
    if (count > 0) set_tokens(dst, count - 1);
    tokens += n;
    return id;
  }

  [[nodiscard]] result<void> release(seq_id id) {
    result<std::uint32_t> slot = ids.slot(id, "release: unknown sequence");
    KVCACHE_TRY(slot);
    drop_blocks(seqs[slot.value()]);
    ids.release(slot.value());
    return {};
  }

  [[nodiscard]] result<layer_view> view(seq_id id, std::uint32_t layer) const {
    result<std::uint32_t> slot = ids.slot(id, "view: unknown sequence");
    KVCACHE_TRY(slot);
    if (layer >= shape().layers)
      return fail(errc::layer_out_of_range, "view: layer", {{"layer", layer}, {"layers", shape().layers}});
    const sequence& s = seqs[slot.value()];
    const std::size_t count = blocks_for(s.length);
    const chunk* first = count == 0 ? nullptr : s.chunks.data() + static_cast<std::size_t>(layer) * s.chunk_cap;
    return layer_view{first, static_cast<std::uint32_t>(count), static_cast<std::uint32_t>(s.length)};
  }

  [[nodiscard]] result<std::span<const std::uint32_t>> blocks(seq_id id) const {
    result<std::uint32_t> slot = ids.slot(id, "blocks: unknown sequence");
    KVCACHE_TRY(slot);
    return std::span<const std::uint32_t>(seqs[slot.value()].blocks);
  }

  [[nodiscard]] result<block_table_csr> export_block_tables(std::span<const seq_id> batch, std::span<std::int32_t> indptr,
                                                            std::span<std::int32_t> indices,
                                                            std::span<std::int32_t> last_block_len) const {
    result<std::size_t> counted = csr_entries(batch);
    KVCACHE_TRY(counted);
    return write_csr(batch, counted.value(), indptr, indices, last_block_len);
  }

  [[nodiscard]] result<block_table_csr> export_block_tables(std::span<const seq_id> batch) {
    result<std::size_t> counted = csr_entries(batch);  // before the buffers grow for it
    KVCACHE_TRY(counted);
    if (!detail::try_allocate([&] {
          if (csr_indptr.size() < batch.size() + 1) csr_indptr.resize(batch.size() + 1);
          if (csr_indices.size() < counted.value()) csr_indices.resize(counted.value());
          if (csr_last.size() < batch.size()) csr_last.resize(batch.size());
        }))
      return fail(errc::out_of_memory, "export_block_tables: CSR arrays",
                  {{"sequences", clamped(batch.size())}, {"blocks", clamped(counted.value())}});
    return write_csr(batch, counted.value(), csr_indptr, csr_indices, csr_last);
  }

  /// The counters; resident_bytes is the pool's K/V allocation (a cache adds its own buffers).
  [[nodiscard]] paged_stats stats() const {
    const block_pool_stats ps = pool->stats();
    paged_stats st;
    st.sequences = ids.live();
    st.tokens = tokens;
    st.resident_bytes = ps.resident_bytes;
    st.reserved_tokens = reserved_tokens;
    st.block_tokens = B();
    st.block_bytes = pool->block_bytes();
    st.blocks_total = ps.blocks_total;
    st.blocks_free = ps.blocks_free;
    st.blocks_in_use = ps.blocks_in_use;
    st.blocks_shared = ps.blocks_shared;
    st.blocks_cached = ps.blocks_cached;
    st.evictions = ps.evictions;
    for (std::uint32_t slot = 0; slot < seqs.size(); ++slot) {
      if (!ids.is_live(slot)) continue;
      const sequence& s = seqs[slot];
      st.table_blocks += s.blocks.size();
      st.internal_waste_tokens += s.blocks.size() * B() - s.length - s.pending;
    }
    st.internal_waste_bytes = st.internal_waste_tokens * (pool->block_bytes() / B());
    st.prefix_query_tokens = query_tokens;
    st.prefix_hit_tokens = hit_tokens;
    st.prefix_hit_rate = query_tokens == 0 ? 0.0 : static_cast<double>(hit_tokens) / static_cast<double>(query_tokens);
    return st;
  }

  // ---- helpers ----------------------------------------------------------------------------

  /// paged_cache<P>::create's check of a shared pool: the configured shape, where non-zero, is
  /// the pool's (invalid_argument naming both).
  [[nodiscard]] static result<void> check_shared_pool(const geometry& configured, const Pool& p) {
    const geometry& ps = p.shape();
    if (configured != geometry{} && configured != ps)
      return fail(errc::invalid_argument, "paged_config.shape differs from the shared pool's",
                  {{"layers", configured.layers}, {"pool_layers", ps.layers}, {"kv_heads", configured.kv_heads},
                   {"pool_kv_heads", ps.kv_heads}, {"head_dim", configured.head_dim}, {"pool_head_dim", ps.head_dim}});
    return {};
  }

  /// paged_cache<P>::create's checks of the limits against the cache's pool: max_sequences < 2^32,
  /// expected_tokens (which sizes each new sequence's arrays) within the tokens the pool holds.
  [[nodiscard]] static result<void> check_limits(std::size_t max_sequences, std::size_t expected_tokens, const Pool& p) {
    if (max_sequences > std::numeric_limits<std::uint32_t>::max())
      return fail(errc::invalid_argument, "paged_config.max_sequences must be < 2^32",
                  {{"max_sequences", clamped(max_sequences)}});
    const std::size_t pool_tokens = static_cast<std::size_t>(p.blocks()) * p.block_tokens();
    if (expected_tokens > pool_tokens)
      return fail(errc::invalid_argument, "paged_config.expected_tokens exceeds the pool's tokens",
                  {{"expected_tokens", clamped(expected_tokens)}, {"pool_tokens", clamped(pool_tokens)}});
    return {};
  }

  // Block-table entries of the committed tokens of `batch`, or unknown_sequence naming the first
  // unknown id.
  [[nodiscard]] result<std::size_t> table_entries(std::span<const seq_id> batch) const {
    std::size_t total = 0;
    for (const seq_id id : batch) {
      result<std::uint32_t> slot = ids.slot(id, "export_block_tables: unknown sequence");
      KVCACHE_TRY(slot);
      total += blocks_for(seqs[slot.value()].length);
    }
    return total;
  }

  // Block-table entries of `batch` (table_entries) where its CSR export fits int32 indices (and a
  // uint32 batch count), else overflow naming both.
  [[nodiscard]] result<std::size_t> csr_entries(std::span<const seq_id> batch) const {
    result<std::size_t> counted = table_entries(batch);
    KVCACHE_TRY(counted);
    if (batch.size() >= std::numeric_limits<std::uint32_t>::max() ||
        counted.value() > static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()))
      return fail(errc::overflow, "export_block_tables: batch too large for int32 CSR",
                  {{"sequences", clamped(batch.size())}, {"blocks", clamped(counted.value())}});
    return counted;
  }

  // The CSR export of `batch` (known sequences, `total` entries: csr_entries) into the buffers, or
  // bad_shape naming the buffer too small (nothing written then).
  [[nodiscard]] result<block_table_csr> write_csr(std::span<const seq_id> batch, std::size_t total,
                                                  std::span<std::int32_t> indptr, std::span<std::int32_t> indices,
                                                  std::span<std::int32_t> last_block_len) const {
    if (indptr.size() < batch.size() + 1)
      return fail(errc::bad_shape, "export_block_tables: indptr buffer too small",
                  {{"needed", clamped(batch.size() + 1)}, {"got", clamped(indptr.size())}});
    if (indices.size() < total)
      return fail(errc::bad_shape, "export_block_tables: indices buffer too small",
                  {{"needed", clamped(total)}, {"got", clamped(indices.size())}});
    if (last_block_len.size() < batch.size())
      return fail(errc::bad_shape, "export_block_tables: last_block_len buffer too small",
                  {{"needed", clamped(batch.size())}, {"got", clamped(last_block_len.size())}});
    std::size_t at = 0;
    indptr[0] = 0;
    for (std::size_t i = 0; i < batch.size(); ++i) {
      const sequence& s = seqs[ids.slot(batch[i], "export_block_tables").value()];
      const std::size_t count = blocks_for(s.length);
      for (std::size_t b = 0; b < count; ++b) indices[at++] = static_cast<std::int32_t>(s.blocks[b]);
      indptr[i + 1] = static_cast<std::int32_t>(at);
      last_block_len[i] = static_cast<std::int32_t>(count == 0 ? 0 : s.length - (count - 1) * B());
    }
    return block_table_csr{indptr.data(), indices.data(), last_block_len.data(), static_cast<std::uint32_t>(batch.size()),
                           static_cast<std::uint32_t>(B())};
  }

  void release_all() noexcept {
    if (!pool) return;
    for (std::uint32_t slot = 0; slot < seqs.size(); ++slot)
      if (ids.is_live(slot)) drop_blocks(seqs[slot]);
  }

  // Returns every block of s to the pool and clears s (its arrays keep their capacity).
  void drop_blocks(sequence& s) noexcept {
    pool->ledger().unref(s.blocks);
    s.blocks.clear();
    tokens -= s.length;
    reserved_tokens -= s.pending;
    s.length = s.pending = s.known = s.hashed = 0;
    s.reserved = s.pending_ids = false;
    s.written_count = 0;
  }

  // The slot just acquired goes back (its sequence never existed): out_of_memory for a table of
  // `blocks` blocks that could not be allocated.
  [[nodiscard]] unexpected refused(std::uint32_t slot, const char* what, std::size_t blocks) {
    ids.release(slot);
    return fail(errc::out_of_memory, what, {{"blocks", clamped(blocks)}});
  }

  sequence& fresh_slot(std::uint32_t slot) {
    if (slot >= seqs.size()) seqs.resize(static_cast<std::size_t>(slot) + 1);
    sequence& s = seqs[slot];
    s.blocks.clear();
    s.written.assign(shape().layers, 0);
    s.length = s.pending = s.known = s.hashed = 0;
    s.written_count = 0;
    s.reserved = s.pending_ids = false;
    return s;
  }

  // Grows s's block table and chunk arrays to hold `blocks` blocks (geometric growth).
  void ensure_capacity(sequence& s, std::size_t count) {
    if (s.blocks.capacity() < count) s.blocks.reserve(std::max(count, 2 * s.blocks.capacity()));
    if (s.chunk_cap >= count) return;
    const std::size_t cap = std::max<std::size_t>({count, 2 * s.chunk_cap, 4});
    const std::uint32_t layers = shape().layers;
    std::vector<chunk> grown(cap * layers);
    for (std::uint32_t l = 0; l < layers; ++l)
      std::copy_n(s.chunks.begin() + static_cast<std::ptrdiff_t>(l * s.chunk_cap), s.blocks.size(),
                  grown.begin() + static_cast<std::ptrdiff_t>(l * cap));
    s.chunks = std::move(grown);
    s.chunk_cap = cap;
  }

  // Points block i's chunk of every layer at its pool block, with `t` valid tokens.
  void set_chunk(sequence& s, std::size_t i, std::uint32_t t) noexcept {
    const Pool& p = *pool;
    const std::uint32_t b = s.blocks[i];
    for (std::uint32_t l = 0; l < p.shape().layers; ++l) {
      chunk& c = s.chunks[l * s.chunk_cap + i];
      c.k = p.k_block(l, b);
      c.v = p.v_block(l, b);
      c.k_head_stride = c.v_head_stride = p.head_stride();
      c.tokens = t;
      c.k_format = c.v_format = p.storage();
    }
  }

  // Sets block i's visible token count in every layer from the committed length.
  void set_tokens(sequence& s, std::size_t i) noexcept {
    const std::size_t start = i * B();
    const auto t = static_cast<std::uint32_t>(s.length <= start ? 0 : std::min(B(), s.length - start));
    for (std::uint32_t l = 0; l < shape().layers; ++l) s.chunks[l * s.chunk_cap + i].tokens = t;
  }
};

}  // namespace detail

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
      KVCACHE_TRY(book_type::check_shared_pool(cfg.shape, *pool));
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
    KVCACHE_TRY(book_type::check_limits(cfg.max_sequences, cfg.expected_tokens, *pool));
    return detail::allocation_guard("paged: sequence tables",
                                    [&]() -> result<paged_cache> { return paged_cache(cfg, std::move(pool)); });
  }

  paged_cache(paged_cache&&) noexcept = default;             ///< views stay valid
  paged_cache& operator=(paged_cache&&) noexcept = default;  ///< releases this cache's blocks first
  paged_cache(const paged_cache&) = delete;
  paged_cache& operator=(const paged_cache&) = delete;
  /// Gives every block of every live sequence back to the pool (cached if indexed).
  ~paged_cache() = default;

  /// The geometry of every sequence (the pool's).
  [[nodiscard]] const geometry& shape() const noexcept { return book_.shape(); }
  /// The configuration the cache was created with.
  [[nodiscard]] const paged_config<cpu>& config() const noexcept { return cfg_; }
  /// Storage format of K and V.
  [[nodiscard]] format storage() const noexcept { return book_.pool->storage(); }
  /// Tokens per block (B).
  [[nodiscard]] std::uint32_t block_tokens() const noexcept { return book_.pool->block_tokens(); }
  /// The block pool (shared with other caches or not).
  [[nodiscard]] const std::shared_ptr<pool_type>& pool() const noexcept { return book_.pool; }

  /// A new empty sequence (no blocks yet). errc::capacity_exceeded when max_sequences are live;
  /// errc::out_of_memory where its tables cannot be allocated.
  [[nodiscard]] result<seq_id> create() { return book_.create(); }

  /// A new sequence for a prompt of `tokens`, adopting the longest chain of cached full blocks
  /// matching its start (token ids compared, not only hashes). Adopts at most
  /// (tokens.size() - 1) / B blocks so at least one token remains for the engine to compute (its
  /// logits are needed). The sequence's length is the returned cached_tokens; reserve the rest
  /// with their token ids (reserve(seq, n, ids)) to make its own blocks findable in turn.
  /// Errors: errc::capacity_exceeded when max_sequences are live; errc::out_of_memory.
  [[nodiscard]] result<prefix_match> create_with_prefix(std::span<const std::int32_t> tokens) {
    return book_.create_with_prefix(tokens);
  }

  /// Opens a reservation of n new tokens (n may be 0), taking the blocks they need from the pool
  /// now, so that write() and commit() cannot fail. If the sequence's partial last block is
  /// shared (after fork / copy_prefix / adoption), it is copied first (copy-on-write).
  /// Errors: unknown_sequence; reservation_pending; pool_exhausted naming the blocks needed and
  /// the blocks free (or evictable); out_of_memory where the block table cannot grow. Nothing
  /// changes on failure.
  [[nodiscard]] result<void> reserve(seq_id id, std::size_t n) { return book_.reserve(id, n, {}, copier()); }

  /// reserve() with the n new tokens' ids ([n] int32), which makes the blocks they fill
  /// findable for prefix reuse once committed. Ids are kept only while every earlier token's id
  /// is known (a sequence reserved once without ids stays unhashed from there on).
  /// Additional error: bad_shape if token_ids.size() != n.
  [[nodiscard]] result<void> reserve(seq_id id, std::size_t n, std::span<const std::int32_t> token_ids) {
    return book_.reserve_with_ids(id, n, token_ids, copier());
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
    return book_.commit(id, [] { return result<void>{}; });
  }

  /// Committed tokens of a sequence, or unknown_sequence.
  [[nodiscard]] result<std::size_t> length(seq_id id) const { return book_.length(id); }

  /// Keeps the first n tokens (rollback, to any length): whole blocks past n go back to the
  /// pool (cached if indexed, else free), a partial last block is kept. Errors:
  /// unknown_sequence; reservation_pending; out_of_range if n > length.
  [[nodiscard]] result<void> truncate(seq_id id, std::size_t n) { return book_.truncate(id, n); }

  /// A new sequence sharing all of src's committed tokens (see copy_prefix).
  [[nodiscard]] result<seq_id> fork(seq_id src) { return book_.copy_prefix(src, 0, true); }

  /// A new sequence holding src's first n tokens by sharing src's blocks (reference counts, no
  /// copy). The first write of either sequence into a shared partial block copies it; full
  /// blocks stay shared. Errors: unknown_sequence; reservation_pending if src has an open
  /// reservation; out_of_range if n > src's length; capacity_exceeded when max_sequences are live;
  /// out_of_memory.
  [[nodiscard]] result<seq_id> copy_prefix(seq_id src, std::size_t n) {
    return book_.copy_prefix(src, n, false);
  }

  /// Releases a sequence (an open reservation is dropped): its blocks go back to the pool, last
  /// block first (indexed ones stay cached, least recently used evicted first). The id is
  /// rejected with unknown_sequence ever after.
  [[nodiscard]] result<void> release(seq_id id) { return book_.release(id); }

  /// The committed tokens of one layer, one chunk per block (the last may be partial):
  /// // chunk k, v: [kv_head][token < B][head_dim], head stride B * head_dim elements.
  /// Valid until the next call that mutates this sequence. Errors: unknown_sequence,
  /// layer_out_of_range.
  [[nodiscard]] result<layer_view> view(seq_id id, std::uint32_t layer) const { return book_.view(id, layer); }

  /// Every block a sequence holds, committed and reserved, in token order (tests, debugging).
  [[nodiscard]] result<std::span<const std::uint32_t>> blocks(seq_id id) const { return book_.blocks(id); }

  /// CSR block tables of `seqs` (committed tokens only) written into caller buffers: indptr
  /// [seqs.size() + 1], indices [total blocks], last_block_len [seqs.size()]. Errors:
  /// unknown_sequence (naming the id); bad_shape naming the buffer that is too small, its
  /// needed and given sizes. Nothing is written on failure.
  [[nodiscard]] result<block_table_csr> export_block_tables(std::span<const seq_id> seqs,
                                                            std::span<std::int32_t> indptr,
                                                            std::span<std::int32_t> indices,
                                                            std::span<std::int32_t> last_block_len) const {
    return book_.export_block_tables(seqs, indptr, indices, last_block_len);
  }

  /// The same into buffers owned by the cache (grown as needed, reused), valid until the next
  /// export_block_tables call or cache move; out_of_memory where they cannot grow.
  [[nodiscard]] result<block_table_csr> export_block_tables(std::span<const seq_id> seqs) {
    return book_.export_block_tables(seqs);
  }

  /// Counters: this cache's sequences and tokens, the pool's block states (one snapshot under
  /// the pool's lock), and internal waste. resident_bytes is the pool's K/V allocation (shared
  /// by every cache on the pool). O(sequence slots).
  [[nodiscard]] paged_stats stats() const { return book_.stats(); }

 private:
  using book_type = detail::paged_book<pool_type>;
  using sequence = book_type::sequence;

  paged_cache(const paged_config<cpu>& cfg, std::shared_ptr<pool_type> pool)
      : book_(std::move(pool), cfg.max_sequences, cfg.expected_tokens), cfg_(cfg) {
    cfg_.pool = book_.pool;
    cfg_.shape = book_.pool->shape();
    cfg_.storage = book_.pool->storage();
    cfg_.block_tokens = book_.pool->block_tokens();
  }

  // reserve's copy-on-write: block `from` into block `to`, K/V of every layer and the token ids.
  struct block_copier {
    pool_type* p;
    result<void> operator()(std::uint32_t from, std::uint32_t to) const noexcept {
      for (std::uint32_t l = 0; l < p->shape().layers; ++l)
        std::memcpy(p->k_block(l, to), p->k_block(l, from), p->block_stride());
      std::memcpy(p->ledger().tokens(to), p->ledger().tokens(from), sizeof(std::int32_t) * p->block_tokens());
      return {};
    }
  };
  [[nodiscard]] block_copier copier() const noexcept { return {book_.pool.get()}; }

  template <class T>
  [[nodiscard]] result<void> write_impl(seq_id id, std::uint32_t layer, std::span<const T> k, std::span<const T> v) {
    result<std::uint32_t> slot = book_.ids.slot(id, "write: unknown sequence");
    KVCACHE_TRY(slot);
    const geometry& g = shape();
    sequence& s = book_.seqs[slot.value()];
    KVCACHE_TRY(detail::check_write(g, id, layer, s.reserved, s.pending, k.size(), v.size()));
    const std::size_t tw = g.token_width();
    const pool_type& p = *book_.pool;
    const std::size_t B = block_tokens();
    const format fmt = p.storage();
    const std::size_t row_bytes = static_cast<std::size_t>(g.head_dim) * dense_element_bytes(fmt);
    const std::size_t end = s.length + s.pending;
    const kernels::table& kt = kernels::active();
    // Token-outer, head-inner (as the contiguous cache): the source ([token][kv_head][head_dim])
    // is read front to back, each head's rows of a block are written front to back. Head-outer
    // ran at 0.6 of memcpy on Cascade Lake (a 4 KiB source stride: Intel's L2 streamer does not
    // follow a stream across 4 KiB), block-outer head-inner at 0.75, this at 0.9.
    for (std::size_t pos = s.length; pos < end;) {
      const std::size_t off = pos % B;
      const std::size_t run = std::min(B - off, end - pos);
      const std::uint32_t b = s.blocks[pos / B];
      std::byte* kb = p.k_block(layer, b) + off * row_bytes;  // block: [kv_head][token B][head_dim]
      std::byte* vb = p.v_block(layer, b) + off * row_bytes;
      for (std::size_t t = 0; t < run; ++t) {
        const std::size_t src = (pos - s.length + t) * tw;
        detail::store_token(kt, k.data() + src, g.kv_heads, g.head_dim, fmt, kb + t * row_bytes, p.head_stride());
        detail::store_token(kt, v.data() + src, g.kv_heads, g.head_dim, fmt, vb + t * row_bytes, p.head_stride());
      }
      pos += run;
    }
    if (!s.written[layer]) {
      s.written[layer] = 1;
      ++s.written_count;
    }
    return {};
  }

  book_type book_;  // sequences, block tables, counters (shared with paged_cache<cuda>)
  paged_config<cpu> cfg_;
};

static_assert(Cache<paged_cache<cpu>>);

}  // namespace kvcache
