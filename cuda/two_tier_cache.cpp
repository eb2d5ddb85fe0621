// two_tier_cache<cuda>: host bookkeeping of the tail pages and store groups, driving the append,
// migration and attention kernels. See include/kvcache/cuda/two_tier_cache.hpp for the layout.
#include "protocol.hpp"
#include "detail.cuh"

#include <kvcache/cuda/two_tier_cache.hpp>
#include <kvcache/detail/id_table.hpp>

#include <algorithm>
#include <limits>
#include <numeric>
#include <vector>

namespace kvcache {

namespace {
constexpr std::uint32_t G = q4_group;  // tokens per store group and per tail page
std::size_t pages_for(std::size_t tokens) { return (tokens + G - 1) / G; }
}  // namespace

struct two_tier_cache<cuda>::impl {
  struct sequence {
    std::vector<std::uint32_t> store;    // store group pages, oldest first (all hold 32 tokens)
    std::vector<std::uint32_t> tail;     // tail pages, oldest first; tail position p in tail[p / 32]
    std::vector<std::uint32_t> p_store;  // store pages taken by reserve for the commit's migrations
    std::vector<chunk> chunks;           // [layer][chunk_cap]
    std::vector<std::uint8_t> written;   // [layer]
    std::size_t chunk_cap = 0;
    std::uint32_t chunk_count = 0;  // chunks of every layer's view
    std::size_t tail_len = 0;       // committed tail tokens
    std::size_t pending = 0;
    std::uint32_t written_count = 0;
    bool reserved = false;
    [[nodiscard]] std::size_t store_tokens() const noexcept { return store.size() * G; }
    [[nodiscard]] std::size_t length() const noexcept { return store_tokens() + tail_len; }
  };

  two_tier_config cfg;
  cuda where;
  std::size_t groups_per_seq = 0;  // ceil(max_tokens / 32)
  std::uint32_t store_pages = 0, tail_pages = 0;
  std::size_t k_group_head = 0, v_group_head = 0;  // store group bytes per kv head (K, V)
  std::size_t tail_head = 0;                       // 32 * head_dim halves
  std::size_t store_layer_bytes = 0, tail_layer_bytes = 0;
  device_arena arena;
  std::byte* store = nullptr;   // device [layer]{K [page][kv_head] group, V [page][kv_head] group}
  std::byte* tailmem = nullptr; // device [layer]{K [page][kv_head][32][D], V same} halves
  std::uint32_t* identity = nullptr;  // device [max(store_pages, tail_pages)]
  // Device tables of the prepared batch (fixed addresses).
  std::uint32_t *s_indptr = nullptr, *s_indices = nullptr, *s_last = nullptr;
  std::uint32_t *t_indptr = nullptr, *t_indices = nullptr, *t_last = nullptr, *t_src = nullptr;
  detail::pinned_uploader uploader;
  device_buffer staging;

  detail::id_table ids;
  std::vector<sequence> seqs;  // [slot]
  std::vector<std::uint32_t> store_free, tail_free;
  std::size_t tokens = 0, reserved_tokens = 0;

  std::vector<std::uint32_t> batch_slots, next_slots, hs_indptr, hs_indices, hs_last, ht_indptr, ht_indices, ht_last, h_src;
  std::vector<std::uint64_t> mark;
  std::uint64_t stamp = 0, epoch = 0, prepared_epoch = ~0ull;
  std::uint32_t prepared_rows = 0;
  std::size_t prepared_longest = 0;

  impl(const two_tier_config& c, const cuda& w) : cfg(c), where(w), ids(c.max_sequences), seqs(c.max_sequences) {}

  [[nodiscard]] const geometry& shape() const noexcept { return cfg.shape; }
  [[nodiscard]] bool fresh() const noexcept { return prepared_epoch == epoch; }

  [[nodiscard]] device_pages store_pages_of(std::uint32_t layer) const noexcept {
    device_pages p;
    p.k = store + layer * store_layer_bytes;
    p.v = store + layer * store_layer_bytes + store_pages * k_group_head * shape().kv_heads;
    p.k_page_stride = k_group_head * shape().kv_heads;
    p.v_page_stride = v_group_head * shape().kv_heads;
    p.k_head_stride = k_group_head;
    p.v_head_stride = v_group_head;
    p.page_tokens = G;
    p.k_format = cfg.key_format;
    p.v_format = cfg.value_format;
    return p;
  }
  [[nodiscard]] device_pages tail_pages_of(std::uint32_t layer) const noexcept {
    device_pages p;
    p.k = tailmem + layer * tail_layer_bytes;
    p.v = tailmem + layer * tail_layer_bytes + tail_pages * tail_head * shape().kv_heads;
    p.k_page_stride = p.v_page_stride = tail_head * shape().kv_heads;
    p.k_head_stride = p.v_head_stride = tail_head;
    p.page_tokens = G;
    p.k_format = p.v_format = format::f16;
    return p;
  }

  // Rebuilds every layer's chunk list: store groups, then committed tail pages.
  void rebuild_chunks(sequence& s) noexcept {
    const std::size_t tail_chunks = pages_for(s.tail_len);
    s.chunk_count = static_cast<std::uint32_t>(s.store.size() + tail_chunks);
    for (std::uint32_t l = 0; l < shape().layers; ++l) {
      const device_pages sp = store_pages_of(l), tp = tail_pages_of(l);
      chunk* out = s.chunks.data() + l * s.chunk_cap;
      for (std::size_t i = 0; i < s.store.size(); ++i) {
        chunk& c = out[i];
        c.k = static_cast<const std::byte*>(sp.k) + s.store[i] * sp.k_page_stride;
        c.v = static_cast<const std::byte*>(sp.v) + s.store[i] * sp.v_page_stride;
        c.k_head_stride = sp.k_head_stride;
        c.v_head_stride = sp.v_head_stride;
        c.tokens = G;
        c.k_format = cfg.key_format;
        c.v_format = cfg.value_format;
      }
      for (std::size_t i = 0; i < tail_chunks; ++i) {
        chunk& c = out[s.store.size() + i];
        c.k = static_cast<const std::byte*>(tp.k) + s.tail[i] * tp.k_page_stride;
        c.v = static_cast<const std::byte*>(tp.v) + s.tail[i] * tp.v_page_stride;
        c.k_head_stride = c.v_head_stride = tail_head;
        c.tokens = static_cast<std::uint32_t>(std::min<std::size_t>(G, s.tail_len - i * G));
        c.k_format = c.v_format = format::f16;
      }
    }
  }

  void give_back(sequence& s) noexcept {
    store_free.insert(store_free.end(), s.store.begin(), s.store.end());
    store_free.insert(store_free.end(), s.p_store.begin(), s.p_store.end());
    tail_free.insert(tail_free.end(), s.tail.begin(), s.tail.end());
    s.store.clear();
    s.p_store.clear();
    s.tail.clear();
  }

  // Appends the reservation's device rows to the tail, page run by page run.
  [[nodiscard]] result<void> append_runs(std::uint32_t slot, std::uint32_t layer, const std::byte* k, const std::byte* v,
                                         format src) {
    sequence& s = seqs[slot];
    const std::size_t row_bytes = shape().token_width() * dense_element_bytes(src);
    const std::size_t end = s.tail_len + s.pending;
    for (std::size_t pos = s.tail_len; pos < end;) {
      const std::size_t run = std::min<std::size_t>(G - pos % G, end - pos);
      append_params p;
      p.dst = tail_pages_of(layer);
      p.k = k + (pos - s.tail_len) * row_bytes;
      p.v = v + (pos - s.tail_len) * row_bytes;
      p.src_format = src;
      p.kv_heads = shape().kv_heads;
      p.head_dim = shape().head_dim;
      p.single_pages = identity + s.tail[pos / G];
      p.single_first_page = static_cast<std::uint32_t>(pos / G);
      p.single_length = static_cast<std::uint32_t>(pos + run);
      p.max_rows = static_cast<std::uint32_t>(run);
      KVCACHE_TRY(cuda_append(where, p));
      pos += run;
    }
    detail::mark_written(s, layer);
    return {};
  }

  template <class T>
  [[nodiscard]] result<void> write_host(seq_id id, std::uint32_t layer, std::span<const T> k, std::span<const T> v) {
    return detail::write_host_rows(*this, id, layer, k, v, [this](std::uint32_t slot, std::uint32_t l, const std::byte* dk, const std::byte* dv,
                                                                  format src) { return append_runs(slot, l, dk, dv, src); });
  }
};

result<two_tier_cache<cuda>> two_tier_cache<cuda>::create(const two_tier_config& cfg, const cuda& where) {
  KVCACHE_TRY(validate(cfg.shape));
  if (cfg.tail_tokens % G != 0 || cfg.tail_tokens > (1u << 24))
    return fail(errc::invalid_argument, "two_tier_config.tail_tokens must be a multiple of 32, <= 2^24", {{"tail_tokens", cfg.tail_tokens}});
  for (const format f : {cfg.key_format, cfg.value_format})
    if (f != format::q4 && f != format::f16)
      return fail(errc::invalid_argument, "two_tier_config: store formats must be q4 or f16",
                  {{"key_format", static_cast<long long>(cfg.key_format)}, {"value_format", static_cast<long long>(cfg.value_format)}});
  if (cfg.slab_groups > (1u << 20))
    return fail(errc::invalid_argument, "two_tier_config.slab_groups must be in [0, 2^20]", {{"slab_groups", cfg.slab_groups}});
  if (cfg.max_tokens == 0 || cfg.max_tokens > std::numeric_limits<std::uint32_t>::max())
    return fail(errc::invalid_argument, "two_tier_cache<cuda>: max_tokens must be in [1, 2^32) (device memory is sized from it)",
                {{"max_tokens", static_cast<long long>(cfg.max_tokens)}});
  if (cfg.max_sequences == 0 || cfg.max_sequences > (1u << 20))
    return fail(errc::invalid_argument, "two_tier_cache<cuda>: max_sequences must be in [1, 2^20] (device memory is sized from it)",
                {{"max_sequences", static_cast<long long>(cfg.max_sequences)}});
  if (cfg.on_full == capacity_policy::streaming || cfg.sink_tokens != 0)
    return fail(errc::unsupported, "two_tier_cache<cuda>: capacity_policy::streaming and sink_tokens are not implemented",
                {{"on_full", static_cast<long long>(cfg.on_full)}, {"sink_tokens", cfg.sink_tokens}});
  if (cfg.on_full != capacity_policy::fail)
    return fail(errc::invalid_argument, "two_tier_config.on_full: unknown policy", {{"on_full", static_cast<long long>(cfg.on_full)}});

  const geometry& g = cfg.shape;
  // Host tables (sequences' chunk arrays, free lists, batch vectors) are built under
  // allocation_guard: a refused allocation is out_of_memory, and the device arena goes with it.
  return detail::allocation_guard("two_tier_cache<cuda>: sequence tables", [&]() -> result<two_tier_cache> {
    auto p = std::make_unique<impl>(cfg, where);
    p->groups_per_seq = pages_for(cfg.max_tokens);
    const std::size_t store_pages = cfg.max_sequences * p->groups_per_seq;
    const std::size_t tail_pages = cfg.max_sequences * (cfg.tail_tokens / G + 2) + p->groups_per_seq;
    if (store_pages >= std::numeric_limits<std::uint32_t>::max() || tail_pages >= std::numeric_limits<std::uint32_t>::max())
      return fail(errc::overflow, "two_tier_cache<cuda>: page count", {{"store_pages", static_cast<long long>(store_pages)}});
    p->store_pages = static_cast<std::uint32_t>(store_pages);
    p->tail_pages = static_cast<std::uint32_t>(tail_pages);
    // A Q4 group of one head (format.hpp): 20 bytes per key channel (rounded up to 4 channels), 640
    // per value column of 32 channels, multiples of 16 bytes (the kernels need 4-byte alignment);
    // f16: 32 dense rows.
    const std::size_t D = g.head_dim;
    p->k_group_head = cfg.key_format == format::q4 ? q4_key_group_bytes(g.head_dim) : G * D * sizeof(half);
    p->v_group_head = cfg.value_format == format::q4 ? q4_value_group_bytes(g.head_dim) : G * D * sizeof(half);
    p->tail_head = G * D * sizeof(half);
    auto store_layer = checked_mul(store_pages * g.kv_heads, p->k_group_head + p->v_group_head, "two_tier<cuda>: store bytes");
    KVCACHE_TRY(store_layer);
    auto tail_layer = checked_mul(tail_pages * g.kv_heads, 2 * p->tail_head, "two_tier<cuda>: tail bytes");
    KVCACHE_TRY(tail_layer);
    p->store_layer_bytes = *store_layer;
    p->tail_layer_bytes = *tail_layer;
    auto store_all = checked_mul(*store_layer, g.layers, "two_tier<cuda>: store bytes");
    KVCACHE_TRY(store_all);
    auto tail_all = checked_mul(*tail_layer, g.layers, "two_tier<cuda>: tail bytes");
    KVCACHE_TRY(tail_all);
    const std::size_t n = cfg.max_sequences;
    const std::size_t id_count = std::max(store_pages, tail_pages);
    const std::size_t pad_n1 = device_arena::padded((n + 1) * 4), pad_n = device_arena::padded(n * 4);
    const std::size_t tables = 3 * pad_n1 + 2 * pad_n + device_arena::padded(store_pages * 4) + device_arena::padded(tail_pages * 4);
    const std::size_t total = device_arena::padded(*store_all) + device_arena::padded(*tail_all) +
                              device_arena::padded(id_count * 4) + tables;
    result<device_arena> arena = device_arena::make(where, total);
    KVCACHE_TRY(arena);
    p->arena = std::move(arena).value();
    auto take = [&](std::size_t bytes) { return p->arena.allocate(bytes).value(); };  // sized above
    p->store = static_cast<std::byte*>(take(*store_all));
    p->tailmem = static_cast<std::byte*>(take(*tail_all));
    p->identity = static_cast<std::uint32_t*>(take(id_count * 4));
    p->s_indptr = static_cast<std::uint32_t*>(take((n + 1) * 4));
    p->t_indptr = static_cast<std::uint32_t*>(take((n + 1) * 4));
    p->t_src = static_cast<std::uint32_t*>(take((n + 1) * 4));
    p->s_last = static_cast<std::uint32_t*>(take(n * 4));
    p->t_last = static_cast<std::uint32_t*>(take(n * 4));
    p->s_indices = static_cast<std::uint32_t*>(take(store_pages * 4));
    p->t_indices = static_cast<std::uint32_t*>(take(tail_pages * 4));
    using up = detail::pinned_uploader;
    KVCACHE_TRY(p->uploader.init(3 * up::staged_bytes((n + 1) * 4) + 2 * up::staged_bytes(n * 4) +
                                 up::staged_bytes(store_pages * 4) + up::staged_bytes(tail_pages * 4)));
    std::vector<std::uint32_t> iota(id_count);
    std::iota(iota.begin(), iota.end(), 0u);
    KVCACHE_TRY(copy_to_device(where, p->identity, iota.data(), id_count * 4));
    KVCACHE_TRY(cuda_synchronize(where));
    p->store_free.resize(store_pages);
    p->tail_free.resize(tail_pages);
    for (std::size_t i = 0; i < store_pages; ++i) p->store_free[i] = static_cast<std::uint32_t>(store_pages - 1 - i);
    for (std::size_t i = 0; i < tail_pages; ++i) p->tail_free[i] = static_cast<std::uint32_t>(tail_pages - 1 - i);
    const std::size_t cap = 2 * p->groups_per_seq + cfg.tail_tokens / G + 2;  // store + longest tail
    for (impl::sequence& s : p->seqs) {
      s.store.reserve(p->groups_per_seq);
      s.p_store.reserve(p->groups_per_seq);
      s.tail.reserve(cap - p->groups_per_seq);
      s.chunks.resize(cap * g.layers);
      s.chunk_cap = cap;
      s.written.assign(g.layers, 0);
    }
    for (auto* v : {&p->batch_slots, &p->next_slots, &p->hs_last, &p->ht_last}) v->reserve(n);
    for (auto* v : {&p->hs_indptr, &p->ht_indptr, &p->h_src}) v->reserve(n + 1);
    p->hs_indices.reserve(store_pages);
    p->ht_indices.reserve(tail_pages);
    p->mark.assign(n, 0);
    return two_tier_cache(std::move(p));
  });
}

two_tier_cache<cuda>::two_tier_cache(std::unique_ptr<impl> p) noexcept : impl_(std::move(p)) {}
two_tier_cache<cuda>::two_tier_cache(two_tier_cache&&) noexcept = default;
two_tier_cache<cuda>& two_tier_cache<cuda>::operator=(two_tier_cache&&) noexcept = default;
two_tier_cache<cuda>::~two_tier_cache() = default;

geometry two_tier_cache<cuda>::shape() const noexcept { return impl_->cfg.shape; }
const two_tier_config& two_tier_cache<cuda>::settings() const noexcept { return impl_->cfg; }
const cuda& two_tier_cache<cuda>::placement() const noexcept { return impl_->where; }

result<seq_id> two_tier_cache<cuda>::create() {
  impl& m = *impl_;
  result<seq_id> id = m.ids.acquire();
  KVCACHE_TRY(id);
  impl::sequence& s = m.seqs[m.ids.slot(id.value(), "create").value()];
  s.tail_len = s.pending = 0;
  s.reserved = false;
  s.written_count = 0;
  std::fill(s.written.begin(), s.written.end(), std::uint8_t{0});
  m.rebuild_chunks(s);
  ++m.epoch;
  return id;
}

result<void> two_tier_cache<cuda>::reserve(seq_id id, std::size_t n) {
  impl& m = *impl_;
  result<std::uint32_t> slot = m.ids.slot(id, "reserve: unknown sequence");
  KVCACHE_TRY(slot);
  impl::sequence& s = m.seqs[slot.value()];
  if (s.reserved)
    return fail(errc::reservation_pending, "reserve: a reservation is already open",
                {{"seq", static_cast<long long>(id.value)}, {"pending", static_cast<long long>(s.pending)}});
  const std::size_t available = m.cfg.max_tokens - s.length();
  if (n > available)
    return fail(errc::capacity_exceeded, "reserve: max_tokens exceeded",
                {{"requested", detail::clamped(n)},
                 {"available", static_cast<long long>(available)}, {"max_tokens", static_cast<long long>(m.cfg.max_tokens)}});
  const std::size_t T = s.tail_len + n;
  const std::size_t migrate = T > m.cfg.tail_tokens ? (T - m.cfg.tail_tokens) / G : 0;
  const std::size_t need_tail = pages_for(T) - s.tail.size();
  if (need_tail > m.tail_free.size())
    return fail(errc::pool_exhausted, "reserve: the shared overflow tail pages are in use by other reservations",
                {{"needed_pages", static_cast<long long>(need_tail)}, {"free_pages", static_cast<long long>(m.tail_free.size())}});
  // Store pages cannot run out: every sequence has ceil(max_tokens / 32) of them.
  for (std::size_t i = 0; i < need_tail; ++i) {
    s.tail.push_back(m.tail_free.back());
    m.tail_free.pop_back();
  }
  for (std::size_t i = 0; i < migrate; ++i) {
    s.p_store.push_back(m.store_free.back());
    m.store_free.pop_back();
  }
  s.reserved = true;
  s.pending = n;
  s.written_count = 0;
  std::fill(s.written.begin(), s.written.end(), std::uint8_t{0});
  m.reserved_tokens += n;
  ++m.epoch;
  return {};
}

result<void> two_tier_cache<cuda>::write(seq_id id, std::uint32_t layer, std::span<const float> k, std::span<const float> v) {
  return impl_->write_host(id, layer, k, v);
}

result<void> two_tier_cache<cuda>::write(seq_id id, std::uint32_t layer, std::span<const half> k, std::span<const half> v) {
  return impl_->write_host(id, layer, k, v);
}

result<void> two_tier_cache<cuda>::write_device(seq_id id, std::uint32_t layer, const void* k, const void* v, format src) {
  impl& m = *impl_;
  return detail::write_device_rows(m, id, layer, k, v, src,
                                   [&m](std::uint32_t slot, std::uint32_t l, const std::byte* dk, const std::byte* dv,
                                        format f) { return m.append_runs(slot, l, dk, dv, f); });
}

result<void> two_tier_cache<cuda>::commit(seq_id id) {
  impl& m = *impl_;
  result<std::uint32_t> slot = m.ids.slot(id, "commit: unknown sequence");
  KVCACHE_TRY(slot);
  impl::sequence& s = m.seqs[slot.value()];
  KVCACHE_TRY(detail::check_commit(id, s.reserved, s.written, s.written_count, m.shape().layers));
  const std::size_t migrate = s.p_store.size();
  for (std::size_t at = 0; at < migrate; at += cuda_max_migrations) {
    migrate_params p;
    p.src = m.tail_pages_of(0);
    p.dst = m.store_pages_of(0);
    p.src_layer_stride_k = p.src_layer_stride_v = m.tail_layer_bytes;
    p.dst_layer_stride_k = p.dst_layer_stride_v = m.store_layer_bytes;
    p.layers = m.shape().layers;
    p.kv_heads = m.shape().kv_heads;
    p.head_dim = m.shape().head_dim;
    p.tokens = G;
    p.count = static_cast<std::uint32_t>(std::min<std::size_t>(cuda_max_migrations, migrate - at));
    for (std::uint32_t i = 0; i < p.count; ++i) {
      p.src_page[i] = s.tail[at + i];
      p.dst_page[i] = s.p_store[at + i];
    }
    KVCACHE_TRY(cuda_migrate(m.where, p));
  }
  // The freed tail pages are rewritten only by later work on this stream, after the migration.
  m.tail_free.insert(m.tail_free.end(), s.tail.begin(), s.tail.begin() + static_cast<std::ptrdiff_t>(migrate));
  s.tail.erase(s.tail.begin(), s.tail.begin() + static_cast<std::ptrdiff_t>(migrate));
  s.store.insert(s.store.end(), s.p_store.begin(), s.p_store.end());
  s.p_store.clear();
  s.tail_len = s.tail_len + s.pending - migrate * G;
  m.tokens += s.pending;
  m.reserved_tokens -= s.pending;
  s.pending = 0;
  s.reserved = false;
  m.rebuild_chunks(s);
  ++m.epoch;
  return {};
}

result<std::size_t> two_tier_cache<cuda>::length(seq_id id) const {
  result<std::uint32_t> slot = impl_->ids.slot(id, "length: unknown sequence");
  KVCACHE_TRY(slot);
  return impl_->seqs[slot.value()].length();
}

result<std::size_t> two_tier_cache<cuda>::dropped_tokens(seq_id id) const {
  result<std::uint32_t> slot = impl_->ids.slot(id, "dropped_tokens: unknown sequence");
  KVCACHE_TRY(slot);
  return std::size_t{0};
}

result<two_tier_sequence_info> two_tier_cache<cuda>::info(seq_id id) const {
  result<std::uint32_t> slot = impl_->ids.slot(id, "info: unknown sequence");
  KVCACHE_TRY(slot);
  const impl::sequence& s = impl_->seqs[slot.value()];
  two_tier_sequence_info i;
  i.store_groups = s.store.size();
  i.store_tokens = s.store_tokens();
  i.tail_tokens = s.tail_len;
  i.pending_tokens = s.pending;
  i.store_slabs = s.store.size();
  return i;
}

result<void> two_tier_cache<cuda>::truncate(seq_id id, std::size_t n) {
  impl& m = *impl_;
  result<std::uint32_t> slot = m.ids.slot(id, "truncate: unknown sequence");
  KVCACHE_TRY(slot);
  impl::sequence& s = m.seqs[slot.value()];
  KVCACHE_TRY(detail::check_truncate(id, s.reserved, s.pending, n, s.length()));
  if (n < s.store_tokens() && n % G != 0)
    return fail(errc::unsupported, "truncate: two_tier_cache<cuda> cuts into the store only at a 32-token group boundary",
                {{"n", static_cast<long long>(n)}, {"store_tokens", static_cast<long long>(s.store_tokens())}});
  m.tokens -= s.length() - n;
  if (n >= s.store_tokens()) {
    s.tail_len = n - s.store_tokens();
  } else {
    const std::size_t keep = n / G;
    m.store_free.insert(m.store_free.end(), s.store.begin() + static_cast<std::ptrdiff_t>(keep), s.store.end());
    s.store.resize(keep);
    s.tail_len = 0;
  }
  const std::size_t keep_tail = pages_for(s.tail_len);
  m.tail_free.insert(m.tail_free.end(), s.tail.begin() + static_cast<std::ptrdiff_t>(keep_tail), s.tail.end());
  s.tail.resize(keep_tail);
  m.rebuild_chunks(s);
  ++m.epoch;
  return {};
}

result<void> two_tier_cache<cuda>::release(seq_id id) {
  impl& m = *impl_;
  result<std::uint32_t> slot = m.ids.slot(id, "release: unknown sequence");
  KVCACHE_TRY(slot);
  impl::sequence& s = m.seqs[slot.value()];
  m.tokens -= s.length();
  m.reserved_tokens -= s.pending;
  m.give_back(s);
  s.tail_len = s.pending = 0;
  s.reserved = false;
  s.written_count = 0;
  m.rebuild_chunks(s);
  m.ids.release(slot.value());
  ++m.epoch;
  return {};
}

result<layer_view> two_tier_cache<cuda>::view(seq_id id, std::uint32_t layer) const {
  const impl& m = *impl_;
  result<std::uint32_t> slot = m.ids.slot(id, "view: unknown sequence");
  KVCACHE_TRY(slot);
  if (layer >= m.shape().layers)
    return fail(errc::layer_out_of_range, "view: layer", {{"layer", layer}, {"layers", m.shape().layers}});
  const impl::sequence& s = m.seqs[slot.value()];
  return layer_view{s.chunk_count == 0 ? nullptr : s.chunks.data() + layer * s.chunk_cap, s.chunk_count,
                    static_cast<std::uint32_t>(s.length())};
}

two_tier_stats two_tier_cache<cuda>::stats() const {
  const impl& m = *impl_;
  const geometry& g = m.shape();
  two_tier_stats st;
  st.sequences = m.ids.live();
  st.tokens = m.tokens;
  st.tail_bytes = m.tail_layer_bytes * g.layers;
  st.store_bytes = m.store_layer_bytes * g.layers;
  st.resident_bytes = m.arena.capacity() + m.staging.size();  // every device byte held
  st.metadata_bytes = m.uploader.capacity() + (m.store_free.capacity() + m.tail_free.capacity()) * 4;
  for (std::uint32_t slot = 0; slot < m.seqs.size(); ++slot) {
    const impl::sequence& s = m.seqs[slot];
    st.metadata_bytes += (s.store.capacity() + s.tail.capacity() + s.p_store.capacity()) * 4 + s.chunks.capacity() * sizeof(chunk);
    if (!m.ids.is_live(slot)) continue;
    st.tail_tokens += s.tail_len;
    st.store_tokens += s.store_tokens();
    st.store_groups += s.store.size();
  }
  st.f16_bytes = st.tokens * g.layers * 2 * g.token_width() * sizeof(half);
  const std::size_t all = st.resident_bytes + st.metadata_bytes;
  st.compression_ratio = all == 0 ? 0.0 : static_cast<double>(st.f16_bytes) / static_cast<double>(all);
  return st;
}

result<void> two_tier_cache<cuda>::prepare(std::span<const seq_id> batch) {
  impl& m = *impl_;
  if (batch.empty() || batch.size() > m.cfg.max_sequences)
    return fail(errc::invalid_argument, "prepare: batch size must be 1..max_sequences",
                {{"batch", static_cast<long long>(batch.size())}, {"max_sequences", static_cast<long long>(m.cfg.max_sequences)}});
  KVCACHE_TRY(detail::select_batch(m, batch));  // m.next_slots; the prepared batch is untouched
  m.hs_indptr.assign(1, 0u);
  m.ht_indptr.assign(1, 0u);
  m.h_src.assign(1, 0u);
  m.hs_indices.clear();
  m.ht_indices.clear();
  m.hs_last.clear();
  m.ht_last.clear();
  std::size_t longest = 0;
  for (const std::uint32_t slot : m.next_slots) {
    const impl::sequence& s = m.seqs[slot];
    m.hs_indices.insert(m.hs_indices.end(), s.store.begin(), s.store.end());
    m.hs_indptr.push_back(static_cast<std::uint32_t>(m.hs_indices.size()));
    m.hs_last.push_back(s.store.empty() ? 0u : G);
    const std::size_t tail = s.tail_len + s.pending;
    m.ht_indices.insert(m.ht_indices.end(), s.tail.begin(), s.tail.begin() + static_cast<std::ptrdiff_t>(pages_for(tail)));
    m.ht_indptr.push_back(static_cast<std::uint32_t>(m.ht_indices.size()));
    m.ht_last.push_back(static_cast<std::uint32_t>(tail == 0 ? 0 : tail - (pages_for(tail) - 1) * G));
    m.h_src.push_back(m.h_src.back() + static_cast<std::uint32_t>(s.pending));
    longest = std::max({longest, s.store_tokens(), tail});
  }
  const detail::pinned_uploader::part parts[] = {
      {m.s_indptr, m.hs_indptr.data(), m.hs_indptr.size() * 4}, {m.s_indices, m.hs_indices.data(), m.hs_indices.size() * 4},
      {m.s_last, m.hs_last.data(), m.hs_last.size() * 4},       {m.t_indptr, m.ht_indptr.data(), m.ht_indptr.size() * 4},
      {m.t_indices, m.ht_indices.data(), m.ht_indices.size() * 4}, {m.t_last, m.ht_last.data(), m.ht_last.size() * 4},
      {m.t_src, m.h_src.data(), m.h_src.size() * 4},
  };
  return detail::publish_batch(m, parts, 7, m.h_src.back(), longest);
}

result<void> two_tier_cache<cuda>::write_batch(std::uint32_t layer, const void* k, const void* v, format src) {
  impl& m = *impl_;
  return detail::write_batch_rows(m, layer, [&m](std::uint32_t l) { return m.tail_pages_of(l); }, k, v, src);
}

result<void> two_tier_cache<cuda>::mark_batch_written() { return detail::mark_batch_written(*impl_); }

result<void> two_tier_cache<cuda>::attend(std::uint32_t layer, const attention_params& ap, const float* q, float* out,
                                          device_buffer& workspace, const cuda_attend_options& opt) {
  impl& m = *impl_;
  const result<detail::split_plan> splits =
      detail::attend_splits(m, layer, ap, opt, opt.max_tokens != 0 ? opt.max_tokens : m.cfg.max_tokens);
  KVCACHE_TRY(splits);
  // Two segments merged in one pass: the store's groups, then the tail's pages (the batch table).
  const auto batch = static_cast<std::uint32_t>(m.batch_slots.size());
  attend_params p;
  p.pages[0] = m.store_pages_of(layer);
  p.tables[0] = {m.s_indptr, m.s_indices, m.s_last, batch};
  p.pages[1] = m.tail_pages_of(layer);
  p.tables[1] = detail::batch_table(m);
  p.segments = 2;
  p.split_tokens = splits->tokens;
  p.prefetch_steps = splits->prefetch;
  p.bypass_l1 = splits->bypass_l1;
  p.max_splits[0] = p.max_splits[1] = splits->count;
  return detail::launch_attend(m, p, ap, q, out, workspace);
}

}  // namespace kvcache
