#pragma once
/// @file two_tier_cache.hpp
/// A two-tier KV cache: each sequence keeps its most recent tokens in an FP16 tail and the older
/// ones in a packed store of 32-token groups (Q4 or FP16, keys and values chosen separately).
///
/// Tiers, per sequence (DESIGN.md §2.4):
/// - Tail: a ring of `tail_tokens + 64` FP16 token slots, `// [layer][K|V][kv_head][slot][head_dim]`.
///   After every commit it holds at most `tail_tokens + 31` tokens: when a commit would leave it
///   with `tail_tokens + 32` or more, its oldest 32 tokens migrate, as one group, into the store
///   (repeatedly, for a long reservation). Migration moves the ring's head; nothing else in the
///   tail is copied. Why 64 spare slots and not 32: the new tokens of a reservation of up to 33
///   tokens then always land in free slots, so every committed token stays readable (and
///   unchanged) until commit; longer reservations park the few tail tokens whose slot is still
///   occupied in a staging buffer (allocated by reserve, freed by commit).
/// - Store: 32-token groups, each quantized once and never re-quantized. Q4 keys are grouped per
///   (kv head, channel) over the group's 32 tokens, Q4 values per (kv head, token, 32 channels),
///   one packed key group and one value group per head (format.hpp); FP16 store groups are plain
///   copies, `// [32][head_dim]` per head. A slab of `slab_groups` group slots is
///   `// [layer][kv_head][slot]{key group, value group}`: a view chunk's heads lie a slab row
///   apart (head strides of slab_groups key and value groups), and one head's groups in
///   consecutive slots are one run. A growing sequence takes its slots in ascending order, so a
///   slab's rows of one layer (every head's run) are one region, which attention with the fused
///   Q4 step reads in address order: slab by slab, head after head (src/attend.cpp, store_end).
///
/// Allocation policy (stats() reports exactly what is allocated):
/// - a sequence's tail ring is allocated by its first reserve() and kept until release();
/// - store group slots are allocated in slabs of `slab_groups` groups (by default enough for a
///   huge page) as the sequence grows;
///   truncate() frees every slab left without a live group; slots of groups dropped by streaming
///   are reused by later groups (their slabs stay);
/// - metadata (group table, per-layer chunk arrays, free-slot list, slab table) is sized for the
///   slab table's capacity, which at least doubles when it grows; plus one 32-token migration
///   scratch per cache.
///
/// Step protocol (nothing visible changes before commit):
/// - reserve(s, n) checks everything and allocates what the n tokens will need (ring, slabs for
///   the groups that will migrate, metadata, staging); it fails with nothing changed.
/// - write(s, layer, K, V) fills the layer's share: the groups that leave the tail within this
///   reservation are quantized (committed tail tokens read from the ring, new ones from the
///   write) into store slots that stay invisible until commit, and the new tokens that stay in
///   the tail are converted to FP16 into free ring slots. write never allocates and, once its
///   arguments are valid, cannot fail.
/// - commit(s) publishes: it copies staged tail tokens (if any) into the ring, applies streaming
///   drops, and advances group count, ring head and tail length. It cannot fail on a complete
///   reservation and never allocates.
///
/// Capacity: at most `max_tokens` tokens held per sequence. capacity_policy::fail (default) fails
/// the reserve with errc::capacity_exceeded; capacity_policy::streaming drops, at the commit, the
/// oldest store groups that make room (decided and checked at reserve), never one that holds any
/// of the first `sink_tokens` tokens: attention sinks are kept at group granularity, stored like
/// any other group. length() counts the tokens held; dropped_tokens() those dropped before them.
///
/// Views: store groups first (one chunk each, in the store formats), then the tail (up to two
/// FP16 chunks, where the ring wraps). truncate() works across tiers: cutting into the store keeps
/// the surviving tokens of the cut group as a shorter chunk (not re-quantized; the key codes of
/// the cut-off tokens are cleared to 0, as format.hpp asks of partial groups), the tail becomes
/// empty, new tokens go to the tail again and later migrations start new groups.

#include <kvcache/cache.hpp>
#include <kvcache/detail/id_table.hpp>
#include <kvcache/detail/storage.hpp>
#include <kvcache/detail/protocol_checks.hpp>
#include <kvcache/error.hpp>
#include <kvcache/format.hpp>
#include <kvcache/geometry.hpp>
#include <kvcache/half.hpp>
#include <kvcache/kernels.hpp>
#include <kvcache/placement.hpp>
#include <kvcache/view.hpp>

#include <algorithm>
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

/// What a two-tier cache does when a reserve would take a sequence past `max_tokens`.
enum class capacity_policy : std::uint8_t {
  fail,       ///< the reserve fails with errc::capacity_exceeded, nothing changed
  streaming,  ///< the oldest store groups after the sink groups are dropped (at commit) to make room
};

/// Construction parameters of a two_tier_cache.
struct two_tier_config {
  geometry shape{};                  ///< layers, kv_heads, head_dim (no zero dimension)
  std::uint32_t tail_tokens = 128;   ///< FP16 tail length; a multiple of 32 (0 allowed), <= 2^24
  format key_format = format::q4;    ///< store format of keys: q4 or f16
  format value_format = format::q4;  ///< store format of values: q4 or f16
  /// Most tokens one sequence holds; 0: no limit but the 32-bit token count of views.
  std::size_t max_tokens = 0;
  capacity_policy on_full = capacity_policy::fail;  ///< what reserve does past max_tokens
  /// Streaming only: the groups holding the first sink_tokens tokens are never dropped.
  /// Streaming needs max_tokens >= sink_tokens + tail_tokens + 64 (a one-token step always has
  /// a group to drop).
  std::uint32_t sink_tokens = 0;
  std::size_t max_sequences = 0;   ///< most live sequences at once; 0: unbounded
  /// Store allocation unit, in 32-token groups (0 .. 2^20). 0: the cache picks the fewest groups,
  /// at least 16, whose slab spans a huge page (2 MiB; see detail/storage.hpp): 16 where a group
  /// slot (every layer's K and V of 32 tokens) is 128 KiB or more, as in most models, and more for
  /// a small one (one layer, few or narrow heads), whose 16-group slabs would sit on 4 KiB pages:
  /// at one layer of 8 kv heads x 128 those made a 32k decode step 1.1x slower (the store's TLB
  /// misses). Where more than 1/32 of such a slab lies past its last whole huge page (on 4 KiB
  /// pages), it takes the fewest groups, up to 4 times as many, that leave at most 1/32 there:
  /// 26 in place of 16 at 4 layers of 8 x 128, which made a 32k step on an Intel VM 1.04-1.10x
  /// faster (session 43). settings() gives the number chosen (detail::two_tier::default_slab_groups).
  std::uint32_t slab_groups = 0;
};

/// Memory and token counters of a two_tier_cache, summed over live sequences. Byte counts are
/// the bytes actually allocated (allocator overhead aside).
struct two_tier_stats : cache_stats {
  // resident_bytes (inherited) = tail_bytes + store_bytes: K/V storage.
  std::size_t tail_bytes = 0;      ///< FP16 tail rings, plus staging of open reservations
  std::size_t store_bytes = 0;     ///< store slabs (Q4 / FP16 groups)
  std::size_t metadata_bytes = 0;  ///< group tables, chunk arrays, slot lists, slab tables, scratch
  std::size_t tail_tokens = 0;     ///< committed tokens in the tails
  std::size_t store_tokens = 0;    ///< tokens in live store groups
  std::size_t store_groups = 0;    ///< live store groups (including ones shortened by truncate)
  std::size_t dropped_tokens = 0;  ///< tokens dropped by streaming from live sequences
  std::size_t f16_bytes = 0;       ///< `tokens` as FP16 K and V: tokens * layers * 2 * kv_heads * head_dim * 2
  /// f16_bytes / (resident_bytes + metadata_bytes): compression against FP16, all-in; 0 when
  /// nothing is allocated.
  double compression_ratio = 0.0;
};

/// Tier occupancy of one sequence.
struct two_tier_sequence_info {
  std::size_t store_groups = 0;    ///< live store groups
  std::size_t store_tokens = 0;    ///< tokens in them
  std::size_t tail_tokens = 0;     ///< committed tokens in the FP16 tail
  std::size_t dropped_tokens = 0;  ///< tokens dropped by streaming before the held ones
  std::size_t pending_tokens = 0;  ///< tokens of an open reservation (0 if none)
  std::size_t store_slabs = 0;     ///< slabs allocated
};

/// Two-tier cache over placement P. The cpu specialization is defined here; other placements
/// are defined by their backends.
template <Placement P = cpu>
class two_tier_cache;

namespace detail::two_tier {

/// A byte buffer, 64-byte aligned (a huge page from one huge page up).
using buffer = detail::storage;

/// n bytes, or null if the allocator refuses.
[[nodiscard]] inline buffer allocate(std::size_t n) noexcept { return detail::allocate_storage(n); }

/// two_tier_config::slab_groups when it is 0, for group slots of `slot` bytes (slot > 0): the
/// fewest groups, at least 16, whose slab spans a huge page; then, where the slab's bytes past its
/// last whole huge page (on 4 KiB pages: the kernel backs only whole, aligned huge pages) are more
/// than 1/32 of it, the fewest groups up to 4 times that many whose share is not (every slot under a
/// huge page has one: test_two_tier checks them all). A slot of a huge page or more keeps the first
/// count (at least 16 slots: what lies past whole pages is under 1/16 of the slab).
[[nodiscard]] constexpr std::uint32_t default_slab_groups(std::size_t slot) noexcept {
  const std::size_t first = std::max<std::size_t>(16, (huge_page_bytes + slot - 1) / slot);  // <= 2^17
  if (slot < huge_page_bytes)
    for (std::size_t g = first; g <= 4 * first; ++g)  // g * slot < 2^21 * 2^19: no overflow
      if ((g * slot) % huge_page_bytes * 32 <= g * slot) return static_cast<std::uint32_t>(g);
  return static_cast<std::uint32_t>(first);
}

/// One store group of a sequence: its slot and how many of its 32 tokens are live.
struct group_ref {
  std::uint32_t slot = 0;
  std::uint32_t tokens = 0;
};

/// Rows to FP16: converted from f32, or copied from f16.
inline void to_f16(const kernels::table& kt, const float* src, half* dst, std::size_t n) noexcept {
  kt.f32_to_f16(src, dst, n);
}
inline void to_f16(const kernels::table&, const half* src, half* dst, std::size_t n) noexcept {
  std::memcpy(dst, src, n * sizeof(half));
}

/// Everything one sequence owns. Tail positions count from the oldest committed tail token:
/// position p lives in ring slot (head + p) % ring_slots.
struct sequence {
  buffer ring;                   // [layer][K|V][kv_head][ring_slots][head_dim] half
  std::uint32_t head = 0;        // ring slot of tail position 0
  std::uint32_t tail = 0;        // committed tail tokens
  std::size_t store_tokens = 0;  // tokens in live groups
  std::size_t dropped = 0;       // tokens dropped by streaming
  // The group table and the per-layer chunk arrays share one offset `first` (streaming drops
  // advance it rather than shift every entry): live groups are groups[first, first + ngroups),
  // pending ones follow them; layer l's view is chunks[l * stride + first, + chunk_count[l]).
  std::vector<group_ref> groups;           // [2 * slot capacity]
  std::vector<chunk> chunks;               // [layer][stride = 2 * slot capacity + 2]
  std::size_t stride = 0;
  std::size_t first = 0;
  std::size_t ngroups = 0;
  std::vector<std::uint32_t> chunk_count;  // [layer]
  std::vector<buffer> slabs;               // [slab] slab_groups group slots each; null once freed
  std::size_t cap_slabs = 0;               // slab entries the tables are sized for (>= slabs.size())
  std::vector<std::uint32_t> slab_used;    // [slab] live and pending groups in the slab
  std::vector<std::uint32_t> free_slots;   // [<= slot capacity] free slots of allocated slabs
  // The open reservation (reserved == true), planned by reserve.
  bool reserved = false;
  std::uint32_t p_tokens = 0;       // n
  std::uint32_t p_t0 = 0;           // committed tail tokens at reserve: positions [0, p_t0) are old
  std::uint32_t p_groups = 0;       // groups leaving the tail: positions [0, 32 * p_groups)
  std::uint32_t p_tail = 0;         // tail length after commit
  // New tail tokens go to ring offset (from head) o = p, or, when every committed tail token
  // leaves (fresh_tail), o = p_t0 + (p - 32 * p_groups): right after the committed ones. Offsets
  // o >= ring_slots would land on a committed token: they wait in staging row o - ring_slots,
  // and commit copies them to ring offset o - ring_slots (a migrated token's slot).
  bool p_fresh_tail = false;
  std::uint32_t p_stage_count = 0;
  std::size_t p_drop_at = 0;        // streaming: live groups [at, at + count) go at commit
  std::size_t p_drop_count = 0;
  std::size_t p_drop_tokens = 0;
  std::uint32_t p_written = 0;        // distinct layers written
  std::vector<std::uint8_t> written;  // [layer] 1 once written in this reservation
  buffer stage;                       // [layer][K|V][kv_head][p_stage_count][head_dim] half

  [[nodiscard]] std::size_t length() const noexcept { return store_tokens + tail; }
};

}  // namespace detail::two_tier

/// Two-tier cache in host memory; kernels from kernels::active(). See the file comment for the
/// tiers, the allocation policy and the step protocol. Move-only; one thread at a time.
template <>
class two_tier_cache<cpu> {
  using sequence = detail::two_tier::sequence;
  using group_ref = detail::two_tier::group_ref;

 public:
  using placement_type = cpu;         ///< where the memory lives
  using stats_type = two_tier_stats;  ///< what stats() returns

  /// Validates `cfg` and builds an empty cache. errc::invalid_argument naming the bad value
  /// (zero geometry, tail_tokens not a multiple of 32, a store format other than q4/f16,
  /// slab_groups out of range, max_tokens past 2^32 - 1, sink_tokens without streaming,
  /// streaming without room for sinks + tail + 64); errc::overflow for byte sizes past size_t;
  /// errc::out_of_memory.
  [[nodiscard]] static result<two_tier_cache> create(const two_tier_config& cfg) {
    KVCACHE_TRY(validate(cfg.shape));
    if (cfg.tail_tokens % q4_group != 0 || cfg.tail_tokens > (1u << 24))
      return fail(errc::invalid_argument, "two_tier_config.tail_tokens must be a multiple of 32, <= 2^24",
                  {{"tail_tokens", cfg.tail_tokens}});
    for (const format f : {cfg.key_format, cfg.value_format})
      if (f != format::q4 && f != format::f16)
        return fail(errc::invalid_argument, "two_tier_config: store formats must be q4 or f16",
                    {{"key_format", static_cast<long long>(cfg.key_format)},
                     {"value_format", static_cast<long long>(cfg.value_format)}});
    if (cfg.slab_groups > (1u << 20))
      return fail(errc::invalid_argument, "two_tier_config.slab_groups must be in [0, 2^20]",
                  {{"slab_groups", cfg.slab_groups}});
    if (cfg.max_tokens > std::numeric_limits<std::uint32_t>::max())
      return fail(errc::invalid_argument, "two_tier_config.max_tokens must be < 2^32",
                  {{"max_tokens", static_cast<long long>(cfg.max_tokens)}});
    if (cfg.on_full != capacity_policy::fail && cfg.on_full != capacity_policy::streaming)
      return fail(errc::invalid_argument, "two_tier_config.on_full: unknown policy",
                  {{"on_full", static_cast<long long>(cfg.on_full)}});
    if (cfg.on_full == capacity_policy::fail && cfg.sink_tokens != 0)
      return fail(errc::invalid_argument, "two_tier_config.sink_tokens needs capacity_policy::streaming",
                  {{"sink_tokens", cfg.sink_tokens}});
    if (cfg.on_full == capacity_policy::streaming &&
        cfg.max_tokens < std::size_t{cfg.sink_tokens} + cfg.tail_tokens + 2 * q4_group)
      return fail(errc::invalid_argument,
                  "two_tier_config: streaming needs max_tokens >= sink_tokens + tail_tokens + 64",
                  {{"max_tokens", static_cast<long long>(cfg.max_tokens)},
                   {"sink_tokens", cfg.sink_tokens},
                   {"tail_tokens", cfg.tail_tokens}});

    return detail::allocation_guard("two_tier: sequence tables", [&]() -> result<two_tier_cache> {
      two_tier_cache c(cfg);
      const geometry& g = cfg.shape;
      auto ring_head = checked_mul(std::size_t{c.ring_slots_} * sizeof(half), g.head_dim, "two_tier: ring bytes");
      KVCACHE_TRY(ring_head);
      auto ring_layer = checked_mul(*ring_head, g.kv_heads, "two_tier: ring bytes");
      KVCACHE_TRY(ring_layer);
      auto ring_all = checked_mul(*ring_layer, std::size_t{2} * g.layers, "two_tier: ring bytes");
      KVCACHE_TRY(ring_all);
      c.ring_head_bytes_ = *ring_head;
      c.ring_layer_bytes_ = *ring_layer;
      c.ring_bytes_ = *ring_all;
      // A Q4 group of one head: 20 bytes per key channel (rounded up to 4 channels) or 640 per
      // value column of 32 channels (format.hpp); f16: 32 dense rows. head_dim < 2^32: no overflow.
      const std::size_t dense_head = std::size_t{q4_group} * sizeof(half) * g.head_dim;
      c.k_group_head_ = cfg.key_format == format::q4 ? q4_key_group_bytes(g.head_dim) : dense_head;
      c.v_group_head_ = cfg.value_format == format::q4 ? q4_value_group_bytes(g.head_dim) : dense_head;
      auto layer_group = checked_mul(c.k_group_head_ + c.v_group_head_, g.kv_heads, "two_tier: group bytes");
      KVCACHE_TRY(layer_group);
      auto slot = checked_mul(*layer_group, g.layers, "two_tier: group bytes");
      KVCACHE_TRY(slot);
      if (cfg.slab_groups == 0) c.cfg_.slab_groups = detail::two_tier::default_slab_groups(*slot);  // slot > 0
      auto slab = checked_mul(*slot, c.cfg_.slab_groups, "two_tier: slab bytes");
      KVCACHE_TRY(slab);
      c.slot_bytes_ = *slot;
      c.slab_bytes_ = *slab;
      c.scratch_elems_ = std::size_t{2} * q4_group * g.head_dim;  // head_dim < 2^32: no overflow
      c.scratch_.reset(new (std::nothrow) half[c.scratch_elems_]);
      if (!c.scratch_)
        return fail(errc::out_of_memory, "two_tier: migration scratch",
                    {{"bytes", static_cast<long long>(c.scratch_elems_ * sizeof(half))}});
      return c;
    });
  }

  two_tier_cache(two_tier_cache&&) noexcept = default;             ///< moves every sequence (views stay valid)
  two_tier_cache& operator=(two_tier_cache&&) noexcept = default;  ///< moves every sequence
  two_tier_cache(const two_tier_cache&) = delete;
  two_tier_cache& operator=(const two_tier_cache&) = delete;
  ~two_tier_cache() = default;

  /// The geometry every sequence stores.
  [[nodiscard]] geometry shape() const noexcept { return cfg_.shape; }
  /// The configuration the cache was created with.
  [[nodiscard]] const two_tier_config& settings() const noexcept { return cfg_; }
  /// FP16 token slots of each tail ring: tail_tokens + 64.
  [[nodiscard]] std::uint32_t ring_slots() const noexcept { return ring_slots_; }
  /// Bytes of one store group slot (32 tokens, all layers, K and V).
  [[nodiscard]] std::size_t group_bytes() const noexcept { return slot_bytes_; }
  /// Bytes of one tail ring.
  [[nodiscard]] std::size_t ring_bytes() const noexcept { return ring_bytes_; }

  /// A new empty sequence; allocates nothing for its tokens until its first reserve.
  /// errc::capacity_exceeded when max_sequences are live; errc::out_of_memory where the sequence
  /// table cannot grow.
  [[nodiscard]] result<seq_id> create() {
    auto id = ids_.acquire();
    KVCACHE_TRY(id);
    const auto slot = static_cast<std::uint32_t>(id->value & 0xffffffffu);
    if (slot >= seqs_.size() && !detail::try_allocate([&] { seqs_.resize(std::size_t{slot} + 1); })) {
      ids_.release(slot);  // the sequence never existed
      return fail(errc::out_of_memory, "create: sequence table", {{"sequences", static_cast<long long>(slot) + 1}});
    }
    seqs_[slot] = sequence{};
    return id;
  }

  /// Opens a reservation of n new tokens of s (n may be 0) and allocates what they need; see
  /// the file comment. Errors, with nothing changed: unknown_sequence, reservation_pending,
  /// capacity_exceeded (past max_tokens under capacity_policy::fail, or more than streaming can
  /// drop; naming max_tokens, length and n), out_of_memory.
  [[nodiscard]] result<void> reserve(seq_id s, std::size_t n) {
    auto slot = ids_.slot(s, "reserve: unknown sequence");
    KVCACHE_TRY(slot);
    sequence& q = seqs_[*slot];
    if (q.reserved)
      return fail(errc::reservation_pending, "reserve: a reservation is already open",
                  {{"seq", static_cast<long long>(s.value)}, {"pending", q.p_tokens}});
    const std::size_t len = q.length();
    const std::size_t limit = cfg_.max_tokens == 0 ? std::numeric_limits<std::uint32_t>::max() : cfg_.max_tokens;
    const bool streaming = cfg_.on_full == capacity_policy::streaming;
    if (n > limit || (!streaming && len > limit - n))
      return fail(errc::capacity_exceeded, "reserve: past max_tokens",
                  {{"max_tokens", static_cast<long long>(limit)},
                   {"length", static_cast<long long>(len)},
                   {"n", static_cast<long long>(n)}});

    // Plan. Tail positions [0, t0) are committed, [t0, t0 + n) new. While the tail would hold
    // tail + 32 tokens its oldest 32 leave: m groups, positions [0, 32 m).
    const std::uint32_t t0 = q.tail;
    const std::size_t total = std::size_t{t0} + n;
    const std::size_t tail_max = std::size_t{cfg_.tail_tokens} + q4_group;
    const std::size_t m = total >= tail_max ? (total - tail_max) / q4_group + 1 : 0;
    const std::size_t new_tail = total - m * q4_group;
    // Where the new tail tokens go (see sequence::p_fresh_tail): offsets [.., end) of the ring,
    // those past ring_slots staged. Both cases keep end - ring_slots < t0 + tail + 32.
    const bool fresh_tail = m != 0 && m * q4_group >= t0;
    const std::size_t end = fresh_tail ? t0 + new_tail : total;
    const std::size_t stage_count = end > ring_slots_ ? end - ring_slots_ : 0;

    // Streaming: the oldest committed groups after the sinks that bring len + n under the limit.
    std::size_t drop_at = 0, drop_count = 0, drop_tokens = 0;
    if (streaming && len + n > limit) {
      const std::size_t need = len + n - limit;
      drop_at = sink_groups(q);
      std::size_t i = drop_at;
      while (drop_tokens < need && i < q.ngroups) drop_tokens += q.groups[q.first + i++].tokens;
      if (drop_tokens < need)
        return fail(errc::capacity_exceeded, "reserve: streaming cannot drop enough store tokens",
                    {{"max_tokens", static_cast<long long>(limit)},
                     {"length", static_cast<long long>(len)},
                     {"n", static_cast<long long>(n)},
                     {"droppable", static_cast<long long>(drop_tokens)}});
      drop_count = i - drop_at;
    }

    // Allocations: ring, slabs for the m groups beyond the free slots, staging.
    detail::two_tier::buffer ring;
    if (!q.ring && n != 0) {
      ring = detail::two_tier::allocate(ring_bytes_);
      if (!ring) return fail(errc::out_of_memory, "reserve: tail ring", {{"bytes", static_cast<long long>(ring_bytes_)}});
    }
    const std::size_t missing = m > q.free_slots.size() ? m - q.free_slots.size() : 0;
    const std::size_t new_slabs = (missing + cfg_.slab_groups - 1) / cfg_.slab_groups;
    std::size_t null_slabs = 0;
    for (const auto& b : q.slabs) null_slabs += b ? 0 : 1;
    const std::size_t table_slabs = q.slabs.size() + (new_slabs > null_slabs ? new_slabs - null_slabs : 0);
    // Tables grow geometrically, so that re-laying them out costs O(1) per group over a sequence.
    const std::size_t cap_slabs = table_slabs > q.cap_slabs ? std::max(table_slabs, 2 * q.cap_slabs) : q.cap_slabs;
    if (cap_slabs * cfg_.slab_groups > std::numeric_limits<std::uint32_t>::max())
      return fail(errc::capacity_exceeded, "reserve: group slots past 2^32",
                  {{"slabs", static_cast<long long>(cap_slabs)}});
    std::vector<detail::two_tier::buffer> fresh;
    if (new_slabs != 0) {
      if (!detail::try_allocate([&] { fresh.reserve(new_slabs); }))
        return fail(errc::out_of_memory, "reserve: slab list", {{"slabs", static_cast<long long>(new_slabs)}});
      for (std::size_t i = 0; i < new_slabs; ++i) {
        fresh.push_back(detail::two_tier::allocate(slab_bytes_));
        if (!fresh.back())
          return fail(errc::out_of_memory, "reserve: store slab",
                      {{"bytes", static_cast<long long>(slab_bytes_)}, {"slabs", static_cast<long long>(new_slabs)}});
      }
    }
    detail::two_tier::buffer stage;
    if (stage_count != 0) {
      stage = detail::two_tier::allocate(stage_bytes(stage_count));
      if (!stage)
        return fail(errc::out_of_memory, "reserve: tail staging",
                    {{"bytes", static_cast<long long>(stage_bytes(stage_count))}});
    }

    // The tables, allocated before anything changes (add_slab and take_slot stay within their
    // capacity).
    const bool first_reserve = q.written.size() != cfg_.shape.layers;
    std::vector<std::uint8_t> written;
    std::vector<std::uint32_t> chunk_count;
    tables grown;
    const bool grow = q.stride == 0 || cap_slabs != q.cap_slabs;
    if (!detail::try_allocate([&] {
          if (first_reserve) {
            written.assign(cfg_.shape.layers, 0);
            chunk_count.assign(cfg_.shape.layers, 0);
          }
          if (grow) grown = grown_tables(q, cap_slabs);
        }))
      return fail(errc::out_of_memory, "reserve: group tables", {{"slabs", static_cast<long long>(cap_slabs)}});

    // From here on nothing fails.
    if (ring) q.ring = std::move(ring);
    if (first_reserve) {
      q.written = std::move(written);
      q.chunk_count = std::move(chunk_count);
    }
    if (grow) install_tables(q, std::move(grown), cap_slabs);
    for (auto& b : fresh) add_slab(q, std::move(b));
    // Room after the live groups for the pending ones and two tail chunks (drops at commit
    // advance `first` and shrink ngroups alike, so this stays true).
    if (q.first + q.ngroups + m + 2 > q.stride) compact(q);
    for (std::size_t i = 0; i < m; ++i) q.groups[q.first + q.ngroups + i] = group_ref{take_slot(q), q4_group};

    q.reserved = true;
    q.p_tokens = static_cast<std::uint32_t>(n);
    q.p_t0 = t0;
    q.p_groups = static_cast<std::uint32_t>(m);
    q.p_tail = static_cast<std::uint32_t>(new_tail);
    q.p_fresh_tail = fresh_tail;
    q.p_stage_count = static_cast<std::uint32_t>(stage_count);
    q.p_drop_at = drop_at;
    q.p_drop_count = drop_count;
    q.p_drop_tokens = drop_tokens;
    q.p_written = 0;
    q.stage = std::move(stage);
    std::fill(q.written.begin(), q.written.end(), std::uint8_t{0});
    return {};
  }

  /// Writes layer `layer` of the reserved tokens: K and V are `// [n][kv_heads][head_dim]` f32
  /// (token-major, as a projection produces them). Writing a layer again overwrites it. Errors,
  /// checked in this order, with nothing changed: unknown_sequence, layer_out_of_range,
  /// not_reserved, bad_shape (naming expected and got).
  [[nodiscard]] result<void> write(seq_id s, std::uint32_t layer, std::span<const float> k,
                                   std::span<const float> v) {
    return write_impl(s, layer, k, v);
  }

  /// The same with K and V already in binary16 (`// [n][kv_heads][head_dim]` halves).
  [[nodiscard]] result<void> write(seq_id s, std::uint32_t layer, std::span<const half> k,
                                   std::span<const half> v) {
    return write_impl(s, layer, k, v);
  }

  /// Publishes the reserved tokens (and applies streaming drops). Errors, with nothing changed:
  /// unknown_sequence, not_reserved, incomplete_write (naming the first layer not written).
  [[nodiscard]] result<void> commit(seq_id s) {
    auto slot = ids_.slot(s, "commit: unknown sequence");
    KVCACHE_TRY(slot);
    sequence& q = seqs_[*slot];
    KVCACHE_TRY(detail::check_commit(s, q.reserved, q.written, q.p_written, cfg_.shape.layers));
    if (q.p_stage_count != 0) unstage(q);
    q.stage.reset();
    if (q.p_drop_count != 0) drop(q, q.p_drop_at, q.p_drop_count, q.p_drop_tokens);
    const std::size_t from = q.ngroups;
    q.ngroups += q.p_groups;
    q.store_tokens += std::size_t{q.p_groups} * q4_group;
    q.head = static_cast<std::uint32_t>((q.head + (q.p_fresh_tail ? q.p_t0 : std::size_t{q.p_groups} * q4_group)) %
                                        ring_slots_);
    q.tail = q.p_tail;
    q.reserved = false;
    q.p_tokens = q.p_groups = q.p_stage_count = 0;
    q.p_drop_count = 0;
    refresh_chunks(q, from);
    return {};
  }

  /// Tokens held by s (committed; in streaming mode, after drops).
  [[nodiscard]] result<std::size_t> length(seq_id s) const {
    auto slot = ids_.slot(s, "length: unknown sequence");
    KVCACHE_TRY(slot);
    return seqs_[*slot].length();
  }

  /// Tokens dropped from s by streaming: the held tokens are positions dropped.. of the stream
  /// (the first sink groups excepted, which hold positions 0..).
  [[nodiscard]] result<std::size_t> dropped_tokens(seq_id s) const {
    auto slot = ids_.slot(s, "dropped_tokens: unknown sequence");
    KVCACHE_TRY(slot);
    return seqs_[*slot].dropped;
  }

  /// Tier occupancy of s.
  [[nodiscard]] result<two_tier_sequence_info> info(seq_id s) const {
    auto slot = ids_.slot(s, "info: unknown sequence");
    KVCACHE_TRY(slot);
    const sequence& q = seqs_[*slot];
    std::size_t slabs = 0;
    for (const auto& b : q.slabs) slabs += b ? 1 : 0;
    return two_tier_sequence_info{q.ngroups, q.store_tokens, q.tail, q.dropped, q.reserved ? q.p_tokens : 0u, slabs};
  }

  /// Keeps the first n held tokens of s (rollback). Cutting into the store keeps the cut group's
  /// first tokens as a shorter chunk and frees the slabs left empty; the tail ring stays
  /// allocated. Errors, with nothing changed: unknown_sequence, reservation_pending,
  /// out_of_range (n > length).
  [[nodiscard]] result<void> truncate(seq_id s, std::size_t n) {
    auto slot = ids_.slot(s, "truncate: unknown sequence");
    KVCACHE_TRY(slot);
    sequence& q = seqs_[*slot];
    KVCACHE_TRY(detail::check_truncate(s, q.reserved, q.p_tokens, n, q.length()));
    if (n == q.length()) return {};
    if (n >= q.store_tokens) {
      q.tail = static_cast<std::uint32_t>(n - q.store_tokens);
      refresh_chunks(q, q.ngroups);
      return {};
    }
    // Cut into the store: keep groups [0, g), shorten group g to `keep` tokens, free the rest.
    std::size_t start = 0, g = 0;
    while (start + q.groups[q.first + g].tokens <= n) start += q.groups[q.first + g++].tokens;
    const auto keep = static_cast<std::uint32_t>(n - start);
    const std::size_t kept_groups = keep != 0 ? g + 1 : g;
    for (std::size_t i = kept_groups; i < q.ngroups; ++i) release_slot(q, q.groups[q.first + i].slot);
    if (keep != 0) {
      group_ref& cut = q.groups[q.first + g];
      if (cfg_.key_format == format::q4) clear_key_codes(q, cut.slot, keep);
      cut.tokens = keep;
    }
    q.ngroups = kept_groups;
    q.store_tokens = n;
    q.tail = 0;
    q.head = 0;
    free_empty_slabs(q);
    refresh_chunks(q, kept_groups != 0 ? kept_groups - 1 : 0);
    return {};
  }

  /// Frees s and everything it holds (an open reservation included); the id is rejected with
  /// unknown_sequence ever after.
  [[nodiscard]] result<void> release(seq_id s) {
    auto slot = ids_.slot(s, "release: unknown sequence");
    KVCACHE_TRY(slot);
    seqs_[*slot] = sequence{};
    ids_.release(*slot);
    return {};
  }

  /// The held tokens of (s, layer): store groups first (key and value formats as configured),
  /// then up to two FP16 tail chunks. Valid until the next reserve / commit / truncate / release
  /// of s. Errors: unknown_sequence, layer_out_of_range.
  [[nodiscard]] result<layer_view> view(seq_id s, std::uint32_t layer) const {
    auto slot = ids_.slot(s, "view: unknown sequence");
    KVCACHE_TRY(slot);
    if (layer >= cfg_.shape.layers)
      return fail(errc::layer_out_of_range, "view: layer", {{"layer", layer}, {"layers", cfg_.shape.layers}});
    const sequence& q = seqs_[*slot];
    if (q.chunk_count.empty()) return layer_view{};
    return layer_view{q.chunks.data() + layer * q.stride + q.first, q.chunk_count[layer],
                      static_cast<std::uint32_t>(q.length())};
  }

  /// Memory and token counters summed over live sequences, O(sequences + slabs).
  [[nodiscard]] two_tier_stats stats() const {
    two_tier_stats st;
    st.metadata_bytes = scratch_elems_ * sizeof(half);
    for (std::uint32_t i = 0; i < seqs_.size(); ++i) {
      if (!ids_.is_live(i)) continue;
      const sequence& q = seqs_[i];
      ++st.sequences;
      st.tokens += q.length();
      st.tail_tokens += q.tail;
      st.store_tokens += q.store_tokens;
      st.store_groups += q.ngroups;
      st.dropped_tokens += q.dropped;
      if (q.ring) st.tail_bytes += ring_bytes_;
      if (q.stage) st.tail_bytes += stage_bytes(q.p_stage_count);
      for (const auto& b : q.slabs) st.store_bytes += b ? slab_bytes_ : 0;
      st.metadata_bytes += q.groups.capacity() * sizeof(group_ref) + q.chunks.capacity() * sizeof(chunk) +
                           q.chunk_count.capacity() * sizeof(std::uint32_t) +
                           q.slabs.capacity() * sizeof(detail::two_tier::buffer) +
                           q.slab_used.capacity() * sizeof(std::uint32_t) +
                           q.free_slots.capacity() * sizeof(std::uint32_t) + q.written.capacity();
    }
    st.resident_bytes = st.tail_bytes + st.store_bytes;
    st.f16_bytes = st.tokens * cfg_.shape.layers * 2 * cfg_.shape.token_width() * sizeof(half);
    const std::size_t all_in = st.resident_bytes + st.metadata_bytes;
    st.compression_ratio = all_in != 0 ? static_cast<double>(st.f16_bytes) / static_cast<double>(all_in) : 0.0;
    return st;
  }

 private:
  explicit two_tier_cache(const two_tier_config& cfg)
      : cfg_(cfg), ring_slots_(cfg.tail_tokens + 2 * q4_group), ids_(cfg.max_sequences) {}

  [[nodiscard]] std::size_t stage_bytes(std::size_t tokens) const noexcept {
    return tokens * std::size_t{2} * cfg_.shape.layers * cfg_.shape.token_width() * sizeof(half);
  }

  // Staging row of (layer, K or V, head, staged index i).
  [[nodiscard]] half* stage_row(const sequence& q, std::uint32_t layer, bool value, std::uint32_t h,
                                std::uint32_t i) const noexcept {
    const std::size_t rows = (std::size_t{layer} * 2 + (value ? 1 : 0)) * cfg_.shape.kv_heads + h;
    return reinterpret_cast<half*>(q.stage.get()) + (rows * q.p_stage_count + i) * cfg_.shape.head_dim;
  }

  // Ring row of (layer, K or V, head, ring slot): head_dim halves.
  [[nodiscard]] half* ring_row(const sequence& q, std::uint32_t layer, bool value, std::uint32_t h,
                               std::uint32_t rs) const noexcept {
    std::byte* p = q.ring.get() + (std::size_t{layer} * 2 + (value ? 1 : 0)) * ring_layer_bytes_ +
                   std::size_t{h} * ring_head_bytes_ + std::size_t{rs} * cfg_.shape.head_dim * sizeof(half);
    return reinterpret_cast<half*>(p);
  }

  // Key group (value: value group) of one (slot, layer, kv head). A slab is
  // [layer][kv_head][slab_groups]{key group, value group}: one head's groups in consecutive slots
  // are one contiguous run, which attention reads front to back.
  [[nodiscard]] std::byte* group_head(const sequence& q, std::uint32_t slot, std::uint32_t layer, std::uint32_t h,
                                      bool value) const noexcept {
    const std::size_t row = std::size_t{layer} * cfg_.shape.kv_heads + h;
    return q.slabs[slot / cfg_.slab_groups].get() +
           (row * cfg_.slab_groups + slot % cfg_.slab_groups) * (k_group_head_ + v_group_head_) +
           (value ? k_group_head_ : 0);
  }
  // Bytes between one kv head's groups and the next head's, in a slab.
  [[nodiscard]] std::size_t store_head_stride() const noexcept {
    return std::size_t{cfg_.slab_groups} * (k_group_head_ + v_group_head_);
  }

  // Groups at the front of the table holding any of the first sink_tokens tokens.
  [[nodiscard]] std::size_t sink_groups(const sequence& q) const noexcept {
    std::size_t i = 0, start = 0;
    while (i < q.ngroups && start < cfg_.sink_tokens) start += q.groups[q.first + i++].tokens;
    return i;
  }

  template <class T>
  [[nodiscard]] result<void> write_impl(seq_id s, std::uint32_t layer, std::span<const T> k, std::span<const T> v) {
    auto slot = ids_.slot(s, "write: unknown sequence");
    KVCACHE_TRY(slot);
    const geometry& g = cfg_.shape;
    sequence& q = seqs_[*slot];
    KVCACHE_TRY(detail::check_write(g, s, layer, q.reserved, q.p_tokens, k.size(), v.size()));
    const std::size_t width = g.token_width();

    // Groups leaving the tail: group i is positions [32 i, 32 i + 32), old ones from the ring.
    for (std::uint32_t i = 0; i < q.p_groups; ++i) {
      const std::uint32_t p0 = i * q4_group;  // i < 2^27: t0 + n < 2^32 + 2^25
      const std::uint32_t n_ring = q.p_t0 > p0 ? std::min(q.p_t0 - p0, q4_group) : 0;
      // Write row of position p0 + n_ring (unused when the whole group is old).
      const std::size_t input = std::size_t{p0} + n_ring >= q.p_t0 ? std::size_t{p0} + n_ring - q.p_t0 : 0;
      migrate(q, layer, q.groups[q.first + q.ngroups + i].slot, (q.head + p0) % ring_slots_, n_ring, k.data(),
              v.data(), input);
    }
    // New positions that stay in the tail: to their ring slot, or to staging while that slot
    // still holds a committed token.
    const kernels::table& kt = kernels::active();
    const std::uint32_t hd = g.head_dim;
    const std::size_t total = std::size_t{q.p_t0} + q.p_tokens;
    for (std::size_t p = std::max<std::size_t>(q.p_t0, std::size_t{q.p_groups} * q4_group); p < total; ++p) {
      const std::size_t row = (p - q.p_t0) * width;
      const std::size_t o = q.p_fresh_tail ? q.p_t0 + (p - std::size_t{q.p_groups} * q4_group) : p;
      const bool staged = o >= ring_slots_;
      const auto si = static_cast<std::uint32_t>(staged ? o - ring_slots_ : 0);
      const auto rs = static_cast<std::uint32_t>((q.head + o) % ring_slots_);
      for (std::uint32_t h = 0; h < g.kv_heads; ++h) {
        half* kd = staged ? stage_row(q, layer, false, h, si) : ring_row(q, layer, false, h, rs);
        half* vd = staged ? stage_row(q, layer, true, h, si) : ring_row(q, layer, true, h, rs);
        detail::two_tier::to_f16(kt, k.data() + row + std::size_t{h} * hd, kd, hd);
        detail::two_tier::to_f16(kt, v.data() + row + std::size_t{h} * hd, vd, hd);
      }
    }
    if (q.written[layer] == 0) {
      q.written[layer] = 1;
      ++q.p_written;
    }
    return {};
  }

  // Fills store slot `gslot` for one layer with one 32-token group: tokens [0, n_ring) from ring
  // slots ring_start.. (wrapping), tokens [n_ring, 32) from rows input.. of a write's K and V.
  template <class T>
  void migrate(sequence& q, std::uint32_t layer, std::uint32_t gslot, std::uint32_t ring_start, std::uint32_t n_ring,
               const T* k_in, const T* v_in, std::size_t input) const noexcept {
    const kernels::table& kt = kernels::active();
    const geometry& g = cfg_.shape;
    const std::uint32_t hd = g.head_dim;
    const std::size_t width = g.token_width();
    const bool ring_run = n_ring == q4_group && ring_start + q4_group <= ring_slots_;
    for (int side = 0; side < 2; ++side) {
      const bool value = side == 1;
      const format f = value ? cfg_.value_format : cfg_.key_format;
      const T* in = value ? v_in : k_in;
      for (std::uint32_t h = 0; h < g.kv_heads; ++h) {
        std::byte* dh = group_head(q, gslot, layer, h, value);
        const half* src = nullptr;
        if (f == format::q4 && ring_run) {
          src = ring_row(q, layer, value, h, ring_start);  // 32 consecutive ring rows: quantize in place
        } else {
          // Gather the 32 rows: straight into the store (f16) or into the scratch (q4).
          half* rows = f == format::f16 ? reinterpret_cast<half*>(dh)
                                        : scratch_.get() + (value ? std::size_t{q4_group} * hd : 0);
          for (std::uint32_t t = 0; t < q4_group; ++t) {
            if (t < n_ring)
              std::memcpy(rows + std::size_t{t} * hd, ring_row(q, layer, value, h, (ring_start + t) % ring_slots_),
                          hd * sizeof(half));
            else
              detail::two_tier::to_f16(kt, in + (input + t - n_ring) * width + std::size_t{h} * hd,
                                       rows + std::size_t{t} * hd, hd);
          }
          src = rows;
        }
        if (f == format::q4) {
          auto* group = reinterpret_cast<std::uint8_t*>(dh);
          if (value) kt.quantize_values(src, hd, q4_group, hd, group);
          else kt.quantize_keys(src, hd, q4_group, hd, group);
        }
      }
    }
  }

  // Commit: staged tail tokens to their ring slots (the committed tokens there have migrated).
  void unstage(sequence& q) const noexcept {
    const std::size_t row_bytes = std::size_t{cfg_.shape.head_dim} * sizeof(half);
    for (std::uint32_t l = 0; l < cfg_.shape.layers; ++l)
      for (int side = 0; side < 2; ++side)
        for (std::uint32_t h = 0; h < cfg_.shape.kv_heads; ++h)
          for (std::uint32_t i = 0; i < q.p_stage_count; ++i) {
            const auto rs = static_cast<std::uint32_t>((std::size_t{q.head} + i) % ring_slots_);
            std::memcpy(ring_row(q, l, side == 1, h, rs), stage_row(q, l, side == 1, h, i), row_bytes);
          }
  }

  // Resizes the group table, chunk arrays and slot lists for `slabs` slab entries, keeping the
  // live entries (moved to offset 0). Allocates: reserve() only.
  // A sequence's tables re-laid out for `slabs` slabs (grown_tables: allocates, changes nothing;
  // install_tables: moves them in, the slabs' buffers with them, allocating nothing).
  struct tables {
    std::vector<group_ref> groups;
    std::vector<chunk> chunks;
    std::vector<std::uint32_t> free_slots;
    std::vector<detail::two_tier::buffer> slabs;  // capacity only: install_tables moves q's in
    std::vector<std::uint32_t> slab_used;
  };
  [[nodiscard]] tables grown_tables(const sequence& q, std::size_t slabs) const {
    const std::size_t cap = slabs * cfg_.slab_groups;
    const std::size_t stride = 2 * cap + 2;
    tables t;
    t.groups.resize(2 * cap);
    std::copy_n(q.groups.begin() + static_cast<std::ptrdiff_t>(q.first), q.ngroups, t.groups.begin());
    t.chunks.resize(cfg_.shape.layers * stride);
    if (q.stride != 0)
      for (std::uint32_t l = 0; l < cfg_.shape.layers; ++l)
        std::copy_n(q.chunks.begin() + static_cast<std::ptrdiff_t>(l * q.stride + q.first), q.chunk_count[l],
                    t.chunks.begin() + static_cast<std::ptrdiff_t>(l * stride));
    t.free_slots.reserve(cap);
    t.free_slots.assign(q.free_slots.begin(), q.free_slots.end());
    t.slabs.reserve(slabs);
    t.slab_used.reserve(slabs);
    t.slab_used.assign(q.slab_used.begin(), q.slab_used.end());
    return t;
  }
  void install_tables(sequence& q, tables t, std::size_t slabs) const noexcept {
    for (auto& b : q.slabs) t.slabs.push_back(std::move(b));  // within the capacity reserved
    q.groups = std::move(t.groups);
    q.chunks = std::move(t.chunks);
    q.free_slots = std::move(t.free_slots);
    q.slabs = std::move(t.slabs);
    q.slab_used = std::move(t.slab_used);
    q.stride = 2 * slabs * cfg_.slab_groups + 2;
    q.first = 0;
    q.cap_slabs = slabs;
  }

  // Puts a fresh slab into a free table entry (or a new one, capacity reserved) and frees its slots.
  void add_slab(sequence& q, detail::two_tier::buffer b) const {
    std::size_t i = 0;
    while (i < q.slabs.size() && q.slabs[i]) ++i;
    if (i == q.slabs.size()) {
      q.slabs.emplace_back();
      q.slab_used.push_back(0);
    }
    q.slabs[i] = std::move(b);
    q.slab_used[i] = 0;
    // Under the free slots already there (taken first), in descending order: a growing sequence
    // takes its slots in ascending order, so that its groups follow one another in the slabs.
    const auto first = static_cast<std::uint32_t>(i * cfg_.slab_groups);
    q.free_slots.insert(q.free_slots.begin(), cfg_.slab_groups, 0);
    for (std::uint32_t k = 0; k < cfg_.slab_groups; ++k) q.free_slots[k] = first + cfg_.slab_groups - 1 - k;
  }

  [[nodiscard]] std::uint32_t take_slot(sequence& q) const noexcept {
    const std::uint32_t s = q.free_slots.back();
    q.free_slots.pop_back();
    ++q.slab_used[s / cfg_.slab_groups];
    return s;
  }

  void release_slot(sequence& q, std::uint32_t s) const noexcept {
    q.free_slots.push_back(s);  // never past capacity: free + used slots <= slot capacity
    --q.slab_used[s / cfg_.slab_groups];
  }

  // Frees every slab without a live group and forgets its free slots.
  void free_empty_slabs(sequence& q) const noexcept {
    bool any = false;
    for (std::size_t i = 0; i < q.slabs.size(); ++i)
      if (q.slabs[i] && q.slab_used[i] == 0) {
        q.slabs[i].reset();
        any = true;
      }
    if (any) std::erase_if(q.free_slots, [&](std::uint32_t s) { return !q.slabs[s / cfg_.slab_groups]; });
  }

  // Streaming: removes live groups [at, at + count) (after the `at` sink groups) by moving the
  // sink entries forward: O(sinks), not O(groups).
  void drop(sequence& q, std::size_t at, std::size_t count, std::size_t tokens) const noexcept {
    for (std::size_t i = at; i < at + count; ++i) release_slot(q, q.groups[q.first + i].slot);
    const auto gb = q.groups.begin() + static_cast<std::ptrdiff_t>(q.first);
    std::copy_backward(gb, gb + static_cast<std::ptrdiff_t>(at), gb + static_cast<std::ptrdiff_t>(at + count));
    for (std::uint32_t l = 0; l < cfg_.shape.layers; ++l) {
      const auto cb = q.chunks.begin() + static_cast<std::ptrdiff_t>(l * q.stride + q.first);
      std::copy_backward(cb, cb + static_cast<std::ptrdiff_t>(at), cb + static_cast<std::ptrdiff_t>(at + count));
      q.chunk_count[l] -= static_cast<std::uint32_t>(count);
    }
    q.first += count;
    q.ngroups -= count;
    q.store_tokens -= tokens;
    q.dropped += tokens;
  }

  // Moves the live groups and their chunks to offset 0.
  void compact(sequence& q) const noexcept {
    std::copy_n(q.groups.begin() + static_cast<std::ptrdiff_t>(q.first), q.ngroups, q.groups.begin());
    for (std::uint32_t l = 0; l < cfg_.shape.layers; ++l)
      std::copy_n(q.chunks.begin() + static_cast<std::ptrdiff_t>(l * q.stride + q.first), q.chunk_count[l],
                  q.chunks.begin() + static_cast<std::ptrdiff_t>(l * q.stride));
    q.first = 0;
  }

  // Rewrites every layer's chunks from live group `from` on, then the tail chunks.
  void refresh_chunks(sequence& q, std::size_t from) const noexcept {
    if (q.stride == 0) return;  // never reserved: empty views
    for (std::uint32_t l = 0; l < cfg_.shape.layers; ++l) {
      chunk* c = q.chunks.data() + l * q.stride + q.first;
      for (std::size_t i = from; i < q.ngroups; ++i) {
        const group_ref g = q.groups[q.first + i];
        c[i] = chunk{group_head(q, g.slot, l, 0, false), group_head(q, g.slot, l, 0, true), store_head_stride(),
                     store_head_stride(), g.tokens, cfg_.key_format, cfg_.value_format};
      }
      std::size_t count = q.ngroups;
      std::uint32_t left = q.tail, rs = q.head;
      while (left != 0) {
        const std::uint32_t run = std::min(left, ring_slots_ - rs);
        c[count++] = chunk{ring_row(q, l, false, 0, rs), ring_row(q, l, true, 0, rs), ring_head_bytes_,
                           ring_head_bytes_, run, format::f16, format::f16};
        left -= run;
        rs = (rs + run) % ring_slots_;
      }
      q.chunk_count[l] = static_cast<std::uint32_t>(count);
    }
  }

  // Zeroes the key codes of tokens >= keep of a group (format.hpp: key codes of tokens past a
  // group's count are 0). Kept codes, scales and minimums are untouched.
  void clear_key_codes(sequence& q, std::uint32_t gslot, std::uint32_t keep) const noexcept {
    for (std::uint32_t l = 0; l < cfg_.shape.layers; ++l) {
      for (std::uint32_t h = 0; h < cfg_.shape.kv_heads; ++h) {
        auto* group = reinterpret_cast<std::uint8_t*>(group_head(q, gslot, l, h, false));
        for (std::uint32_t d = 0; d < cfg_.shape.head_dim; ++d)
          for (std::uint32_t t = keep; t < q4_group; ++t) {
            std::uint8_t& byte = group[q4_key_code_byte(d, t)];
            byte = static_cast<std::uint8_t>(t < 16 ? (byte & 0xf0u) : (byte & 0x0fu));
          }
      }
    }
  }

  two_tier_config cfg_;
  std::uint32_t ring_slots_ = 0;       // tail_tokens + 64
  std::size_t ring_head_bytes_ = 0;    // one head of one side (K or V) of one layer of a ring
  std::size_t ring_layer_bytes_ = 0;   // one side of one layer of a ring
  std::size_t ring_bytes_ = 0;         // a whole ring
  std::size_t k_group_head_ = 0;       // one head's key group
  std::size_t v_group_head_ = 0;       // one head's value group
  std::size_t slot_bytes_ = 0;         // a group slot (all layers)
  std::size_t slab_bytes_ = 0;         // slab_groups slots
  std::unique_ptr<half[]> scratch_;    // [K|V][32][head_dim]: gather for Q4 migration
  std::size_t scratch_elems_ = 0;
  detail::id_table ids_;
  std::vector<sequence> seqs_;  // [slot]
};

static_assert(Cache<two_tier_cache<cpu>>);

}  // namespace kvcache
