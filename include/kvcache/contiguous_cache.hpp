#pragma once
/// @file contiguous_cache.hpp
/// The contiguous cache: every sequence owns one pre-allocated buffer of `capacity_tokens` token
/// slots per layer, allocated when the sequence is created. The simplest Cache, with one chunk
/// per layer view and no allocation at all after create().
///
/// Layout of one sequence (one allocation: 64-byte aligned, 2 MiB aligned and on huge pages from
/// 2 MiB up, see detail/storage.hpp):
///   for each layer l: K_l then V_l, each // [kv_head][capacity_tokens][head_dim] elements
///   of the storage format (f32 or f16), each buffer starting on a 64-byte boundary; buffers of
///   1 MiB and more are followed by 68 KiB of padding, so that K_l and V_l are not a power of two
///   of bytes apart.
/// Committed tokens are slots 0..length-1 of every head; a reservation of n tokens occupies
/// slots length..length+n-1 until commit makes them visible. fork / copy_prefix copy rows (a
/// contiguous cache shares nothing; use the paged cache to share prefixes).

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
#include <kvcache/detail/storage.hpp>
#include <kvcache/detail/protocol_checks.hpp>
#include <kvcache/detail/store_row.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <span>
#include <utility>
#include <vector>

namespace kvcache {

/// Configuration of a contiguous cache (shared by every placement).
struct contiguous_config {
  geometry shape;                   ///< layers, kv_heads, head_dim; none may be zero
  format storage = format::f16;     ///< element format of K and V: f32 or f16 (q4 is not supported)
  std::size_t max_sequences = 1;    ///< most live sequences at once (>= 1)
  std::size_t capacity_tokens = 0;  ///< token slots per sequence, fixed at creation (1 .. 2^32-1)
};

/// Statistics of a contiguous cache.
struct contiguous_stats : cache_stats {
  std::size_t reserved_tokens = 0;  ///< tokens of open (uncommitted) reservations
  std::size_t capacity_tokens = 0;  ///< token slots allocated: live sequences * capacity per sequence
  std::size_t max_sequences = 0;    ///< configured limit of live sequences
};

/// A contiguous KV cache with placement P. Only the specializations exist: contiguous_cache<cpu>
/// here, contiguous_cache<cuda> in the CUDA backend.
template <Placement P = cpu>
class contiguous_cache;

/// Contiguous cache in host memory. Move-only. Views point straight into the cache's buffers
/// (zero-copy) and stay valid, at the same addresses, until the sequence is released (a moved
/// cache keeps its buffers). One thread at a time.
template <>
class contiguous_cache<cpu> {
 public:
  /// The placement policy type (kvcache::Cache requirement).
  using placement_type = cpu;
  /// Alignment in bytes of every K and V layer buffer.
  static constexpr std::size_t alignment = 64;
  /// Layer buffers of this many bytes and more are followed by buffer_stagger bytes of padding.
  static constexpr std::size_t large_buffer = std::size_t{1} << 20;
  static constexpr std::size_t buffer_stagger = std::size_t{68} << 10;

  /// Validates `cfg` and builds an empty cache. Errors: errc::invalid_argument for a zero
  /// geometry dimension, zero max_sequences or capacity_tokens, capacity_tokens >= 2^32, or a
  /// storage format other than f32/f16 (each message names the value); errc::overflow when the
  /// bytes of one sequence or of max_sequences sequences do not fit in size_t. Allocates only the
  /// per-sequence bookkeeping (no K/V storage until create()).
  [[nodiscard]] static result<contiguous_cache> create(const contiguous_config& cfg) {
    KVCACHE_TRY(validate(cfg.shape));
    if (cfg.storage != format::f32 && cfg.storage != format::f16)
      return fail(errc::invalid_argument, "contiguous_config.storage must be f32 or f16",
                  {{"format", static_cast<long long>(cfg.storage)}});
    if (cfg.max_sequences == 0)
      return fail(errc::invalid_argument, "contiguous_config.max_sequences must be >= 1",
                  {{"max_sequences", 0}});
    if (cfg.capacity_tokens == 0)
      return fail(errc::invalid_argument, "contiguous_config.capacity_tokens must be >= 1",
                  {{"capacity_tokens", 0}});
    if (cfg.capacity_tokens > std::numeric_limits<std::uint32_t>::max())
      return fail(errc::invalid_argument, "contiguous_config.capacity_tokens must be < 2^32",
                  {{"capacity_tokens", static_cast<long long>(cfg.capacity_tokens)}});
    if (cfg.max_sequences > std::numeric_limits<std::uint32_t>::max())
      return fail(errc::invalid_argument, "contiguous_config.max_sequences must be < 2^32",
                  {{"max_sequences", static_cast<long long>(cfg.max_sequences)}});
    const std::size_t elem = dense_element_bytes(cfg.storage);
    const geometry& g = cfg.shape;
    // Bytes of one K (or V) layer buffer, rounded up to the alignment.
    result<std::size_t> head = checked_mul(cfg.capacity_tokens, g.head_dim, "contiguous: tokens * head_dim");
    KVCACHE_TRY(head);
    result<std::size_t> head_bytes = checked_mul(head.value(), elem, "contiguous: head bytes");
    KVCACHE_TRY(head_bytes);
    result<std::size_t> buf = checked_mul(head_bytes.value(), g.kv_heads, "contiguous: layer buffer bytes");
    KVCACHE_TRY(buf);
    result<std::size_t> buf_padded = checked_add(buf.value(), alignment - 1, "contiguous: layer buffer padding");
    KVCACHE_TRY(buf_padded);
    std::size_t buffer_bytes = buf_padded.value() / alignment * alignment;
    // Large buffers are staggered: a layer's V would otherwise lie a large power of two of bytes
    // after its K (capacity and head_dim are usually powers of two), and attention streams both
    // at the same offsets, so every K line and its V line would compete for the same cache sets
    // and DRAM banks (measured: 32k tokens, 8 x 128 f16, 14.8 GB/s without, 19.4 with).
    if (buffer_bytes >= large_buffer) {
      result<std::size_t> staggered = checked_add(buffer_bytes, buffer_stagger, "contiguous: layer buffer stagger");
      KVCACHE_TRY(staggered);
      buffer_bytes = staggered.value();
    }
    result<std::size_t> seq_bytes = checked_mul(buffer_bytes, 2 * static_cast<std::size_t>(g.layers),
                                                "contiguous: bytes per sequence");
    KVCACHE_TRY(seq_bytes);
    result<std::size_t> all_bytes = checked_mul(seq_bytes.value(), cfg.max_sequences,
                                                "contiguous: bytes of max_sequences sequences");
    KVCACHE_TRY(all_bytes);
    return detail::allocation_guard("contiguous: sequence tables", [&]() -> result<contiguous_cache> {
      return contiguous_cache(cfg, head_bytes.value(), buffer_bytes, seq_bytes.value());
    });
  }

  contiguous_cache(contiguous_cache&&) noexcept = default;             ///< moves buffers, views stay valid
  contiguous_cache& operator=(contiguous_cache&&) noexcept = default;  ///< moves buffers
  contiguous_cache(const contiguous_cache&) = delete;             ///< not copyable: owns its buffers
  contiguous_cache& operator=(const contiguous_cache&) = delete;  ///< not copyable: owns its buffers
  ~contiguous_cache() = default;  ///< frees every sequence's storage

  /// The geometry of every sequence.
  [[nodiscard]] const geometry& shape() const noexcept { return cfg_.shape; }
  /// The configuration the cache was created with.
  [[nodiscard]] const contiguous_config& config() const noexcept { return cfg_; }
  /// Element format of stored K and V.
  [[nodiscard]] format storage() const noexcept { return cfg_.storage; }
  /// Bytes of K/V storage allocated per live sequence (all layers, K and V, with padding).
  [[nodiscard]] std::size_t bytes_per_sequence() const noexcept { return seq_bytes_; }

  /// A new empty sequence with its capacity_tokens slots allocated (all layers).
  /// errc::capacity_exceeded when max_sequences are live; errc::out_of_memory if the allocation
  /// fails. The cache is unchanged on failure.
  [[nodiscard]] result<seq_id> create() {
    if (ids_.live() >= cfg_.max_sequences)
      return fail(errc::capacity_exceeded, "create: every sequence slot is in use",
                  {{"max_sequences", static_cast<long long>(cfg_.max_sequences)}});
    detail::storage mem = detail::allocate_storage(seq_bytes_);
    if (!mem)
      return fail(errc::out_of_memory, "create: sequence storage", {{"bytes", static_cast<long long>(seq_bytes_)}});
    result<seq_id> id = ids_.acquire();  // capacity checked above; bookkeeping pre-reserved
    if (!id.has_value()) return id;
    sequence& s = seqs_[ids_.slot(id.value(), "create").value()];
    s.storage = std::move(mem);
    s.length = 0;
    s.pending = 0;
    s.reserved = false;
    s.written_count = 0;
    for (std::uint32_t l = 0; l < cfg_.shape.layers; ++l) {
      chunk& c = s.chunks[l];
      c.k = s.storage.get() + (2 * static_cast<std::size_t>(l)) * buffer_bytes_;
      c.v = s.storage.get() + (2 * static_cast<std::size_t>(l) + 1) * buffer_bytes_;
      c.k_head_stride = head_bytes_;
      c.v_head_stride = head_bytes_;
      c.tokens = 0;
      c.k_format = cfg_.storage;
      c.v_format = cfg_.storage;
      s.written[l] = false;
    }
    resident_ += seq_bytes_;
    return id;
  }

  /// Opens a reservation of n new tokens (n may be 0). Errors: unknown_sequence;
  /// reservation_pending if one is open; capacity_exceeded naming requested and available slots.
  [[nodiscard]] result<void> reserve(seq_id id, std::size_t n) {
    result<std::uint32_t> slot = ids_.slot(id, "reserve: unknown sequence");
    KVCACHE_TRY(slot);
    sequence& s = seqs_[slot.value()];
    if (s.reserved)
      return fail(errc::reservation_pending, "reserve: a reservation is already open",
                  {{"seq", static_cast<long long>(id.value)}, {"pending", static_cast<long long>(s.pending)}});
    const std::size_t available = cfg_.capacity_tokens - s.length;
    if (n > available)
      return fail(errc::capacity_exceeded, "reserve: sequence capacity exceeded",
                  {{"requested", static_cast<long long>(n)}, {"available", static_cast<long long>(available)},
                   {"capacity_tokens", static_cast<long long>(cfg_.capacity_tokens)}});
    s.reserved = true;
    s.pending = n;
    s.written_count = 0;
    for (std::uint32_t l = 0; l < cfg_.shape.layers; ++l) s.written[l] = false;
    reserved_ += n;
    return {};
  }

  /// Writes the reserved tokens of one layer. K and V: [n][kv_heads][head_dim] floats, n the
  /// reserved count; stored converted to the storage format (f16: round-to-nearest-even through
  /// the active kernels). Writing a layer again overwrites it. Errors, checked in this order:
  /// unknown_sequence, layer_out_of_range, not_reserved, bad_shape (naming expected and got).
  [[nodiscard]] result<void> write(seq_id id, std::uint32_t layer, std::span<const float> k,
                                   std::span<const float> v) {
    return write_impl(id, layer, k, v);
  }

  /// The same with K and V already in binary16 ([n][kv_heads][head_dim] halves): copied as is
  /// into f16 storage, widened exactly into f32 storage.
  [[nodiscard]] result<void> write(seq_id id, std::uint32_t layer, std::span<const half> k,
                                   std::span<const half> v) {
    return write_impl(id, layer, k, v);
  }

  /// Makes the reserved tokens visible. Errors: unknown_sequence; not_reserved when no
  /// reservation is open; incomplete_write (naming the first unwritten layer) if any layer was
  /// not written since reserve.
  [[nodiscard]] result<void> commit(seq_id id) {
    result<std::uint32_t> slot = ids_.slot(id, "commit: unknown sequence");
    KVCACHE_TRY(slot);
    sequence& s = seqs_[slot.value()];
    KVCACHE_TRY(detail::check_commit(id, s.reserved, s.written, s.written_count, cfg_.shape.layers));
    s.length += s.pending;
    tokens_ += s.pending;
    reserved_ -= s.pending;
    s.pending = 0;
    s.reserved = false;
    set_chunk_tokens(s);
    return {};
  }

  /// Committed tokens of a sequence, or unknown_sequence.
  [[nodiscard]] result<std::size_t> length(seq_id id) const {
    result<std::uint32_t> slot = ids_.slot(id, "length: unknown sequence");
    KVCACHE_TRY(slot);
    return seqs_[slot.value()].length;
  }

  /// Keeps the first n tokens (rollback). Storage stays allocated. Errors: unknown_sequence;
  /// reservation_pending; out_of_range if n > length (naming both).
  [[nodiscard]] result<void> truncate(seq_id id, std::size_t n) {
    result<std::uint32_t> slot = ids_.slot(id, "truncate: unknown sequence");
    KVCACHE_TRY(slot);
    sequence& s = seqs_[slot.value()];
    KVCACHE_TRY(detail::check_truncate(id, s.reserved, s.pending, n, s.length));
    tokens_ -= s.length - n;
    s.length = n;
    set_chunk_tokens(s);
    return {};
  }

  /// A new sequence holding a copy of src's first n committed tokens. A contiguous cache shares
  /// nothing: the rows of every layer, head, K and V are copied into the new sequence's own
  /// storage (allocated as by create()). Errors: unknown_sequence; reservation_pending if src has
  /// an open reservation; out_of_range if n > src's length (naming both); capacity_exceeded when
  /// max_sequences are live; out_of_memory. The cache is unchanged on failure.
  [[nodiscard]] result<seq_id> copy_prefix(seq_id src, std::size_t n) {
    return copy_prefix_impl(src, n, false, "copy_prefix");
  }

  /// A new sequence holding a copy of all of src's committed tokens (see copy_prefix).
  [[nodiscard]] result<seq_id> fork(seq_id src) { return copy_prefix_impl(src, 0, true, "fork"); }

  /// Releases a sequence (an open reservation is dropped) and frees its storage; the id is
  /// rejected with unknown_sequence ever after.
  [[nodiscard]] result<void> release(seq_id id) {
    result<std::uint32_t> slot = ids_.slot(id, "release: unknown sequence");
    KVCACHE_TRY(slot);
    sequence& s = seqs_[slot.value()];
    tokens_ -= s.length;
    reserved_ -= s.pending;
    resident_ -= seq_bytes_;
    s.storage.reset();
    s.length = 0;
    s.pending = 0;
    s.reserved = false;
    s.written_count = 0;
    ids_.release(slot.value());
    return {};
  }

  /// The committed tokens of one layer: zero chunks when empty, else one chunk pointing into the
  /// cache's storage, // k, v: [kv_head][capacity_tokens][head_dim], head stride
  /// capacity_tokens * head_dim elements. Errors: unknown_sequence, layer_out_of_range.
  [[nodiscard]] result<layer_view> view(seq_id id, std::uint32_t layer) const {
    result<std::uint32_t> slot = ids_.slot(id, "view: unknown sequence");
    KVCACHE_TRY(slot);
    if (layer >= cfg_.shape.layers)
      return fail(errc::layer_out_of_range, "view: layer", {{"layer", layer}, {"layers", cfg_.shape.layers}});
    const sequence& s = seqs_[slot.value()];
    return layer_view{&s.chunks[layer], s.length > 0 ? 1u : 0u, static_cast<std::uint32_t>(s.length)};
  }

  /// Counters, O(1).
  [[nodiscard]] contiguous_stats stats() const noexcept {
    contiguous_stats st;
    st.sequences = ids_.live();
    st.tokens = tokens_;
    st.resident_bytes = resident_;
    st.reserved_tokens = reserved_;
    st.capacity_tokens = ids_.live() * cfg_.capacity_tokens;
    st.max_sequences = cfg_.max_sequences;
    return st;
  }

 private:
  /// Per-sequence state; every array is allocated once, when the cache is created.
  struct sequence {
    detail::storage storage;              // [layer][K|V][kv_head][capacity][head_dim], null when free
    std::unique_ptr<chunk[]> chunks;  // [layer] the one chunk of each layer view
    std::unique_ptr<bool[]> written;  // [layer] written since the open reservation began
    std::size_t length = 0;           // committed tokens
    std::size_t pending = 0;          // tokens of the open reservation
    std::uint32_t written_count = 0;  // layers with written[l] set
    bool reserved = false;            // a reservation is open
  };

  contiguous_cache(const contiguous_config& cfg, std::size_t head_bytes, std::size_t buffer_bytes,
                   std::size_t seq_bytes)
      : cfg_(cfg), head_bytes_(head_bytes), buffer_bytes_(buffer_bytes), seq_bytes_(seq_bytes),
        ids_(cfg.max_sequences), seqs_(cfg.max_sequences) {
    for (sequence& s : seqs_) {
      s.chunks = std::make_unique<chunk[]>(cfg.shape.layers);
      s.written = std::make_unique<bool[]>(cfg.shape.layers);
    }
  }

  void set_chunk_tokens(sequence& s) noexcept {
    for (std::uint32_t l = 0; l < cfg_.shape.layers; ++l) s.chunks[l].tokens = static_cast<std::uint32_t>(s.length);
  }

  [[nodiscard]] result<seq_id> copy_prefix_impl(seq_id src_id, std::size_t n, bool all, const char* what) {
    result<std::uint32_t> src_slot = ids_.slot(src_id, what);
    KVCACHE_TRY(src_slot);
    const sequence& src = seqs_[src_slot.value()];  // seqs_ never reallocates: stays valid
    if (all) n = src.length;
    if (src.reserved)
      return fail(errc::reservation_pending, what,
                  {{"seq", static_cast<long long>(src_id.value)}, {"pending", static_cast<long long>(src.pending)}});
    if (n > src.length)
      return fail(errc::out_of_range, what, {{"n", static_cast<long long>(n)}, {"length", static_cast<long long>(src.length)}});
    result<seq_id> id = create();
    KVCACHE_TRY(id);
    sequence& dst = seqs_[ids_.slot(id.value(), what).value()];
    const std::size_t bytes = n * cfg_.shape.head_dim * dense_element_bytes(cfg_.storage);
    for (std::size_t b = 0; b < 2 * static_cast<std::size_t>(cfg_.shape.layers); ++b)
      for (std::uint32_t h = 0; h < cfg_.shape.kv_heads; ++h) {
        const std::size_t off = b * buffer_bytes_ + h * head_bytes_;
        std::memcpy(dst.storage.get() + off, src.storage.get() + off, bytes);
      }
    dst.length = n;
    tokens_ += n;
    set_chunk_tokens(dst);
    return id;
  }

  template <class T>
  [[nodiscard]] result<void> write_impl(seq_id id, std::uint32_t layer, std::span<const T> k, std::span<const T> v) {
    result<std::uint32_t> slot = ids_.slot(id, "write: unknown sequence");
    KVCACHE_TRY(slot);
    const geometry& g = cfg_.shape;
    sequence& s = seqs_[slot.value()];
    KVCACHE_TRY(detail::check_write(g, id, layer, s.reserved, s.pending, k.size(), v.size()));
    const std::size_t tw = g.token_width();
    const chunk& c = s.chunks[layer];
    const std::size_t first = s.length * g.head_dim * dense_element_bytes(cfg_.storage);  // slot offset in a head
    std::byte* kd = s.storage.get() + (2 * static_cast<std::size_t>(layer)) * buffer_bytes_ + first;
    std::byte* vd = s.storage.get() + (2 * static_cast<std::size_t>(layer) + 1) * buffer_bytes_ + first;
    const std::size_t row_bytes = std::size_t{g.head_dim} * dense_element_bytes(cfg_.storage);
    const kernels::table& kt = kernels::active();
    // Token-outer, head-inner: the source ([token][kv_head][head_dim]) is read front to back and
    // each head's slots are written front to back. Head-outer (one strided sweep of the source
    // per head) ran at 0.6 of memcpy on Cascade Lake against 0.9: with 8 heads x 128 f32 the
    // source stride is 4 KiB, and Intel's L2 streamer does not follow a stream across 4 KiB.
    const format f = cfg_.storage;
    for (std::size_t t = 0; t < s.pending; ++t) {
      detail::store_token(kt, k.data() + t * tw, g.kv_heads, g.head_dim, f, kd + t * row_bytes, c.k_head_stride);
      detail::store_token(kt, v.data() + t * tw, g.kv_heads, g.head_dim, f, vd + t * row_bytes, c.v_head_stride);
    }
    if (!s.written[layer]) {
      s.written[layer] = true;
      ++s.written_count;
    }
    return {};
  }

  contiguous_config cfg_;
  std::size_t head_bytes_ = 0;    // bytes of one head's slots: capacity * head_dim * element
  std::size_t buffer_bytes_ = 0;  // bytes of one K or V layer buffer, padded to `alignment` (+ stagger)
  std::size_t seq_bytes_ = 0;     // 2 * layers * buffer_bytes_
  std::size_t tokens_ = 0;        // committed tokens over live sequences
  std::size_t reserved_ = 0;      // tokens of open reservations
  std::size_t resident_ = 0;      // bytes of K/V storage allocated
  detail::id_table ids_;
  std::vector<sequence> seqs_;  // [slot]
};

static_assert(Cache<contiguous_cache<cpu>>);

}  // namespace kvcache
