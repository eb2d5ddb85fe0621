// contiguous_cache<cuda>: host bookkeeping (compiled by the host compiler with the full warning
// set) driving the device kernels of append.cu and attend.cu.
#include "protocol.hpp"
#include "detail.cuh"

#include <kvcache/cuda/contiguous_cache.hpp>
#include <kvcache/detail/id_table.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

namespace kvcache {

struct contiguous_cache<cuda>::impl {
  contiguous_config cfg;
  cuda where;
  std::size_t head_bytes = 0;    // one head's slots: capacity * head_dim * element
  std::size_t buffer_bytes = 0;  // one K or V layer buffer, padded to 256
  std::size_t seq_bytes = 0;     // 2 * layers * buffer_bytes: one slot = one page
  device_arena arena;
  std::byte* storage = nullptr;         // device [slot][layer][K|V][kv_head][capacity][head_dim]
  std::uint32_t* slot_ids = nullptr;    // device [max_sequences]: slot_ids[s] == s
  std::uint32_t* t_indptr = nullptr;    // device [max_sequences + 1] prepared batch
  std::uint32_t* t_indices = nullptr;   // device [max_sequences]
  std::uint32_t* t_last = nullptr;      // device [max_sequences]
  std::uint32_t* t_src = nullptr;       // device [max_sequences + 1] rows of the batch's reservations
  detail::pinned_uploader uploader;
  device_buffer staging;  // host writes: K then V rows, grown on demand

  struct sequence {
    std::unique_ptr<chunk[]> chunks;  // [layer]
    std::unique_ptr<bool[]> written;  // [layer]
    std::size_t length = 0;
    std::size_t pending = 0;
    std::uint32_t written_count = 0;
    bool reserved = false;
  };
  detail::id_table ids;
  std::vector<sequence> seqs;  // [slot]
  std::size_t tokens = 0;
  std::size_t reserved_tokens = 0;

  // Prepared batch (host mirror); vectors reserved at creation: prepare() does not allocate.
  std::vector<std::uint32_t> batch_slots, next_slots, h_indptr, h_indices, h_last, h_src;
  std::vector<std::uint64_t> mark;  // [slot] stamp of the last prepare that listed it
  std::uint64_t stamp = 0;
  std::uint64_t epoch = 0;                 // bumped by every successful state change
  std::uint64_t prepared_epoch = ~0ull;    // epoch of the last prepare
  std::uint32_t prepared_rows = 0;
  std::size_t prepared_longest = 0;  // longest table length of the prepared batch

  explicit impl(const contiguous_config& c, const cuda& w) : cfg(c), where(w), ids(c.max_sequences), seqs(c.max_sequences) {}

  [[nodiscard]] std::byte* k_base(std::uint32_t slot, std::uint32_t layer) const {
    return storage + slot * seq_bytes + 2 * static_cast<std::size_t>(layer) * buffer_bytes;
  }
  [[nodiscard]] const geometry& shape() const noexcept { return cfg.shape; }
  [[nodiscard]] bool fresh() const noexcept { return prepared_epoch == epoch; }

  void set_chunk_tokens(sequence& s) const noexcept {
    for (std::uint32_t l = 0; l < cfg.shape.layers; ++l) s.chunks[l].tokens = static_cast<std::uint32_t>(s.length);
  }

  [[nodiscard]] device_pages pages_of(std::uint32_t layer) const noexcept {
    device_pages p;
    p.k = storage + 2 * static_cast<std::size_t>(layer) * buffer_bytes;
    p.v = storage + (2 * static_cast<std::size_t>(layer) + 1) * buffer_bytes;
    p.k_page_stride = p.v_page_stride = seq_bytes;
    p.k_head_stride = p.v_head_stride = head_bytes;
    p.page_tokens = static_cast<std::uint32_t>(cfg.capacity_tokens);
    p.k_format = p.v_format = cfg.storage;
    return p;
  }

  // Single-sequence append of the reservation from device rows; marks the layer written.
  [[nodiscard]] result<void> append_one(std::uint32_t slot, std::uint32_t layer, const void* k, const void* v, format src) {
    sequence& s = seqs[slot];
    if (s.pending > 0) {
      append_params p;
      p.dst = pages_of(layer);
      p.k = k;
      p.v = v;
      p.src_format = src;
      p.kv_heads = cfg.shape.kv_heads;
      p.head_dim = cfg.shape.head_dim;
      p.single_pages = slot_ids + slot;
      p.single_length = static_cast<std::uint32_t>(s.length + s.pending);
      p.max_rows = static_cast<std::uint32_t>(s.pending);
      KVCACHE_TRY(cuda_append(where, p));
    }
    detail::mark_written(s, layer);
    return {};
  }

  template <class T>
  [[nodiscard]] result<void> write_host(seq_id id, std::uint32_t layer, std::span<const T> k, std::span<const T> v) {
    return detail::write_host_rows(*this, id, layer, k, v, [this](std::uint32_t slot, std::uint32_t l, const std::byte* dk, const std::byte* dv,
                                                                  format src) { return append_one(slot, l, dk, dv, src); });
  }
};

namespace {
constexpr std::size_t arena_align = 256;
std::size_t pad(std::size_t b) { return (b + arena_align - 1) / arena_align * arena_align; }
}  // namespace

result<contiguous_cache<cuda>> contiguous_cache<cuda>::create(const contiguous_config& cfg, const cuda& where) {
  KVCACHE_TRY(validate(cfg.shape));
  if (cfg.storage != format::f32 && cfg.storage != format::f16)
    return fail(errc::invalid_argument, "contiguous_config.storage must be f32 or f16",
                {{"format", static_cast<long long>(cfg.storage)}});
  if (cfg.max_sequences == 0)
    return fail(errc::invalid_argument, "contiguous_config.max_sequences must be >= 1", {{"max_sequences", 0}});
  if (cfg.capacity_tokens == 0)
    return fail(errc::invalid_argument, "contiguous_config.capacity_tokens must be >= 1", {{"capacity_tokens", 0}});
  if (cfg.capacity_tokens > std::numeric_limits<std::uint32_t>::max())
    return fail(errc::invalid_argument, "contiguous_config.capacity_tokens must be < 2^32",
                {{"capacity_tokens", static_cast<long long>(cfg.capacity_tokens)}});
  if (cfg.max_sequences > std::numeric_limits<std::uint32_t>::max() - 1)
    return fail(errc::invalid_argument, "contiguous_config.max_sequences must be < 2^32 - 1",
                {{"max_sequences", static_cast<long long>(cfg.max_sequences)}});
  const geometry& g = cfg.shape;
  const std::size_t elem = dense_element_bytes(cfg.storage);
  result<std::size_t> head = checked_mul(cfg.capacity_tokens, g.head_dim, "contiguous: tokens * head_dim");
  KVCACHE_TRY(head);
  result<std::size_t> head_bytes = checked_mul(head.value(), elem, "contiguous: head bytes");
  KVCACHE_TRY(head_bytes);
  result<std::size_t> buf = checked_mul(head_bytes.value(), g.kv_heads, "contiguous: layer buffer bytes");
  KVCACHE_TRY(buf);
  result<std::size_t> buf_padded = checked_add(buf.value(), arena_align - 1, "contiguous: layer buffer padding");
  KVCACHE_TRY(buf_padded);
  const std::size_t buffer_bytes = buf_padded.value() / arena_align * arena_align;
  result<std::size_t> seq_bytes = checked_mul(buffer_bytes, 2 * static_cast<std::size_t>(g.layers), "contiguous: bytes per sequence");
  KVCACHE_TRY(seq_bytes);
  result<std::size_t> all = checked_mul(seq_bytes.value(), cfg.max_sequences, "contiguous: bytes of max_sequences sequences");
  KVCACHE_TRY(all);
  const std::size_t n = cfg.max_sequences;
  const std::size_t table_bytes = pad(n * 4) * 3 + pad((n + 1) * 4) * 2;
  result<std::size_t> total = checked_add(all.value(), table_bytes, "contiguous: device bytes");
  KVCACHE_TRY(total);

  // Host tables (sequences' chunk arrays, free lists, batch vectors) are built under
  // allocation_guard: a refused allocation is out_of_memory, and the device arena goes with it.
  return detail::allocation_guard("contiguous_cache<cuda>: sequence tables", [&]() -> result<contiguous_cache> {
    auto p = std::make_unique<impl>(cfg, where);
    p->head_bytes = head_bytes.value();
    p->buffer_bytes = buffer_bytes;
    p->seq_bytes = seq_bytes.value();
    result<device_arena> arena = device_arena::make(where, total.value());
    KVCACHE_TRY(arena);
    p->arena = std::move(arena).value();
    auto take = [&](std::size_t bytes) { return p->arena.allocate(bytes, arena_align).value(); };  // sized above
    p->storage = static_cast<std::byte*>(take(all.value()));
    p->slot_ids = static_cast<std::uint32_t*>(take(n * 4));
    p->t_indptr = static_cast<std::uint32_t*>(take((n + 1) * 4));
    p->t_indices = static_cast<std::uint32_t*>(take(n * 4));
    p->t_last = static_cast<std::uint32_t*>(take(n * 4));
    p->t_src = static_cast<std::uint32_t*>(take((n + 1) * 4));
    KVCACHE_TRY(p->uploader.init(detail::pinned_uploader::staged_bytes((n + 1) * 4) * 2 +
                                 detail::pinned_uploader::staged_bytes(n * 4) * 2));
    std::vector<std::uint32_t> iota(n);
    std::iota(iota.begin(), iota.end(), 0u);
    KVCACHE_TRY(copy_to_device(where, p->slot_ids, iota.data(), n * 4));
    KVCACHE_TRY(cuda_synchronize(where));

    for (std::uint32_t slot = 0; slot < n; ++slot) {
      impl::sequence& s = p->seqs[slot];
      s.chunks = std::make_unique<chunk[]>(g.layers);
      s.written = std::make_unique<bool[]>(g.layers);
      for (std::uint32_t l = 0; l < g.layers; ++l) {
        chunk& c = s.chunks[l];
        c.k = p->k_base(slot, l);
        c.v = p->k_base(slot, l) + buffer_bytes;
        c.k_head_stride = c.v_head_stride = p->head_bytes;
        c.tokens = 0;
        c.k_format = c.v_format = cfg.storage;
      }
    }
    p->batch_slots.reserve(n);
    p->next_slots.reserve(n);
    p->h_indptr.reserve(n + 1);
    p->h_indices.reserve(n);
    p->h_last.reserve(n);
    p->h_src.reserve(n + 1);
    p->mark.assign(n, 0);
    return contiguous_cache(std::move(p));
  });
}

contiguous_cache<cuda>::contiguous_cache(std::unique_ptr<impl> p) noexcept : impl_(std::move(p)) {}
contiguous_cache<cuda>::contiguous_cache(contiguous_cache&&) noexcept = default;
contiguous_cache<cuda>& contiguous_cache<cuda>::operator=(contiguous_cache&&) noexcept = default;
contiguous_cache<cuda>::~contiguous_cache() = default;

const geometry& contiguous_cache<cuda>::shape() const noexcept { return impl_->cfg.shape; }
const contiguous_config& contiguous_cache<cuda>::config() const noexcept { return impl_->cfg; }
format contiguous_cache<cuda>::storage() const noexcept { return impl_->cfg.storage; }
const cuda& contiguous_cache<cuda>::placement() const noexcept { return impl_->where; }
std::size_t contiguous_cache<cuda>::bytes_per_sequence() const noexcept { return impl_->seq_bytes; }

result<seq_id> contiguous_cache<cuda>::create() {
  impl& m = *impl_;
  result<seq_id> id = m.ids.acquire();  // capacity_exceeded when max_sequences are live
  KVCACHE_TRY(id);
  impl::sequence& s = m.seqs[m.ids.slot(id.value(), "create").value()];
  s.length = 0;
  s.pending = 0;
  s.reserved = false;
  s.written_count = 0;
  for (std::uint32_t l = 0; l < m.cfg.shape.layers; ++l) s.written[l] = false;
  m.set_chunk_tokens(s);
  return id;
}

result<void> contiguous_cache<cuda>::reserve(seq_id id, std::size_t n) {
  impl& m = *impl_;
  result<std::uint32_t> slot = m.ids.slot(id, "reserve: unknown sequence");
  KVCACHE_TRY(slot);
  impl::sequence& s = m.seqs[slot.value()];
  if (s.reserved)
    return fail(errc::reservation_pending, "reserve: a reservation is already open",
                {{"seq", static_cast<long long>(id.value)}, {"pending", static_cast<long long>(s.pending)}});
  const std::size_t available = m.cfg.capacity_tokens - s.length;
  if (n > available)
    return fail(errc::capacity_exceeded, "reserve: sequence capacity exceeded",
                {{"requested", detail::clamped(n)},
                 {"available", static_cast<long long>(available)},
                 {"capacity_tokens", static_cast<long long>(m.cfg.capacity_tokens)}});
  s.reserved = true;
  s.pending = n;
  s.written_count = 0;
  for (std::uint32_t l = 0; l < m.cfg.shape.layers; ++l) s.written[l] = false;
  m.reserved_tokens += n;
  ++m.epoch;
  return {};
}

result<void> contiguous_cache<cuda>::write(seq_id id, std::uint32_t layer, std::span<const float> k,
                                           std::span<const float> v) {
  return impl_->write_host(id, layer, k, v);
}

result<void> contiguous_cache<cuda>::write(seq_id id, std::uint32_t layer, std::span<const half> k,
                                           std::span<const half> v) {
  return impl_->write_host(id, layer, k, v);
}

result<void> contiguous_cache<cuda>::write_device(seq_id id, std::uint32_t layer, const void* k, const void* v,
                                                  format src) {
  impl& m = *impl_;
  return detail::write_device_rows(m, id, layer, k, v, src,
                                   [&m](std::uint32_t slot, std::uint32_t l, const std::byte* dk, const std::byte* dv,
                                        format f) { return m.append_one(slot, l, dk, dv, f); });
}

result<void> contiguous_cache<cuda>::commit(seq_id id) {
  impl& m = *impl_;
  result<std::uint32_t> slot = m.ids.slot(id, "commit: unknown sequence");
  KVCACHE_TRY(slot);
  impl::sequence& s = m.seqs[slot.value()];
  KVCACHE_TRY(detail::check_commit(id, s.reserved, s.written, s.written_count, m.cfg.shape.layers));
  s.length += s.pending;
  m.tokens += s.pending;
  m.reserved_tokens -= s.pending;
  s.pending = 0;
  s.reserved = false;
  m.set_chunk_tokens(s);
  ++m.epoch;
  return {};
}

result<std::size_t> contiguous_cache<cuda>::length(seq_id id) const {
  result<std::uint32_t> slot = impl_->ids.slot(id, "length: unknown sequence");
  KVCACHE_TRY(slot);
  return impl_->seqs[slot.value()].length;
}

result<void> contiguous_cache<cuda>::truncate(seq_id id, std::size_t n) {
  impl& m = *impl_;
  result<std::uint32_t> slot = m.ids.slot(id, "truncate: unknown sequence");
  KVCACHE_TRY(slot);
  impl::sequence& s = m.seqs[slot.value()];
  KVCACHE_TRY(detail::check_truncate(id, s.reserved, s.pending, n, s.length));
  m.tokens -= s.length - n;
  s.length = n;
  m.set_chunk_tokens(s);
  ++m.epoch;
  return {};
}

result<seq_id> contiguous_cache<cuda>::copy_prefix(seq_id src_id, std::size_t n) {
  impl& m = *impl_;
  result<std::uint32_t> src_slot = m.ids.slot(src_id, "copy_prefix: unknown sequence");
  KVCACHE_TRY(src_slot);
  const impl::sequence& src = m.seqs[src_slot.value()];
  if (src.reserved)
    return fail(errc::reservation_pending, "copy_prefix: the source has an open reservation",
                {{"seq", static_cast<long long>(src_id.value)}, {"pending", static_cast<long long>(src.pending)}});
  if (n > src.length)
    return fail(errc::out_of_range, "copy_prefix: count past the source's length",
                {{"n", detail::clamped(n)},
                 {"length", static_cast<long long>(src.length)}});
  if (m.ids.live() >= m.cfg.max_sequences)
    return fail(errc::capacity_exceeded, "copy_prefix: every sequence slot is in use",
                {{"max_sequences", static_cast<long long>(m.cfg.max_sequences)}});
  // The new slot is the one acquire() will hand out; copy first, so a failed copy changes nothing.
  result<seq_id> id = m.ids.acquire();
  KVCACHE_TRY(id);
  const std::uint32_t dst_slot = m.ids.slot(id.value(), "copy_prefix").value();
  const std::size_t row = static_cast<std::size_t>(m.cfg.shape.head_dim) * dense_element_bytes(m.cfg.storage);
  for (std::uint32_t l = 0; l < m.cfg.shape.layers && n > 0; ++l)
    for (std::uint32_t kv = 0; kv < 2; ++kv)
      for (std::uint32_t h = 0; h < m.cfg.shape.kv_heads; ++h) {
        const std::size_t off = kv * m.buffer_bytes + h * m.head_bytes;  // [K|V][kv_head][capacity][head_dim]
        const result<void> copied =
            copy_on_device(m.where, m.k_base(dst_slot, l) + off, m.k_base(src_slot.value(), l) + off, n * row);
        if (!copied.has_value()) {
          m.ids.release(dst_slot);
          return unexpected(copied.error());
        }
      }
  impl::sequence& dst = m.seqs[dst_slot];
  dst.length = n;
  dst.pending = 0;
  dst.reserved = false;
  dst.written_count = 0;
  for (std::uint32_t l = 0; l < m.cfg.shape.layers; ++l) dst.written[l] = false;
  m.set_chunk_tokens(dst);
  m.tokens += n;
  ++m.epoch;
  return id;
}

result<seq_id> contiguous_cache<cuda>::fork(seq_id src) {
  result<std::uint32_t> slot = impl_->ids.slot(src, "fork: unknown sequence");
  KVCACHE_TRY(slot);
  return copy_prefix(src, impl_->seqs[slot.value()].length);
}

result<void> contiguous_cache<cuda>::release(seq_id id) {
  impl& m = *impl_;
  result<std::uint32_t> slot = m.ids.slot(id, "release: unknown sequence");
  KVCACHE_TRY(slot);
  impl::sequence& s = m.seqs[slot.value()];
  m.tokens -= s.length;
  m.reserved_tokens -= s.pending;
  s.length = 0;
  s.pending = 0;
  s.reserved = false;
  s.written_count = 0;
  m.set_chunk_tokens(s);
  m.ids.release(slot.value());
  ++m.epoch;
  return {};
}

result<layer_view> contiguous_cache<cuda>::view(seq_id id, std::uint32_t layer) const {
  const impl& m = *impl_;
  result<std::uint32_t> slot = m.ids.slot(id, "view: unknown sequence");
  KVCACHE_TRY(slot);
  if (layer >= m.cfg.shape.layers)
    return fail(errc::layer_out_of_range, "view: layer", {{"layer", layer}, {"layers", m.cfg.shape.layers}});
  const impl::sequence& s = m.seqs[slot.value()];
  return layer_view{&s.chunks[layer], s.length > 0 ? 1u : 0u, static_cast<std::uint32_t>(s.length)};
}

contiguous_stats contiguous_cache<cuda>::stats() const noexcept {
  const impl& m = *impl_;
  contiguous_stats st;
  st.sequences = m.ids.live();
  st.tokens = m.tokens;
  st.resident_bytes = m.arena.capacity() + m.staging.size() + m.uploader.capacity();  // every byte held
  st.reserved_tokens = m.reserved_tokens;
  st.capacity_tokens = m.cfg.max_sequences * m.cfg.capacity_tokens;  // every slot is allocated
  st.max_sequences = m.cfg.max_sequences;
  return st;
}

result<void> contiguous_cache<cuda>::prepare(std::span<const seq_id> batch) {
  impl& m = *impl_;
  if (batch.empty() || batch.size() > m.cfg.max_sequences)
    return fail(errc::invalid_argument, "prepare: batch size must be 1..max_sequences",
                {{"batch", static_cast<long long>(batch.size())}, {"max_sequences", static_cast<long long>(m.cfg.max_sequences)}});
  KVCACHE_TRY(detail::select_batch(m, batch));  // m.next_slots; the prepared batch is untouched
  m.h_indptr.assign(1, 0u);
  m.h_indices.clear();
  m.h_last.clear();
  m.h_src.assign(1, 0u);
  std::size_t longest = 0;
  for (const std::uint32_t slot : m.next_slots) {
    const impl::sequence& s = m.seqs[slot];
    const auto len = static_cast<std::uint32_t>(s.length + s.pending);
    longest = std::max<std::size_t>(longest, len);
    if (len > 0) m.h_indices.push_back(slot);
    m.h_indptr.push_back(static_cast<std::uint32_t>(m.h_indices.size()));
    m.h_last.push_back(len);
    m.h_src.push_back(m.h_src.back() + static_cast<std::uint32_t>(s.pending));
  }
  const detail::pinned_uploader::part parts[] = {
      {m.t_indptr, m.h_indptr.data(), m.h_indptr.size() * 4},
      {m.t_indices, m.h_indices.data(), m.h_indices.size() * 4},
      {m.t_last, m.h_last.data(), m.h_last.size() * 4},
      {m.t_src, m.h_src.data(), m.h_src.size() * 4},
  };
  return detail::publish_batch(m, parts, 4, m.h_src.back(), longest);
}

result<void> contiguous_cache<cuda>::write_batch(std::uint32_t layer, const void* k, const void* v, format src) {
  impl& m = *impl_;
  return detail::write_batch_rows(m, layer, [&m](std::uint32_t l) { return m.pages_of(l); }, k, v, src);
}

result<void> contiguous_cache<cuda>::mark_batch_written() { return detail::mark_batch_written(*impl_); }

result<void> contiguous_cache<cuda>::attend(std::uint32_t layer, const attention_params& ap, const float* q, float* out,
                                            device_buffer& workspace, const cuda_attend_options& opt) {
  impl& m = *impl_;
  const result<detail::split_plan> splits =
      detail::attend_splits(m, layer, ap, opt, opt.max_tokens != 0 ? opt.max_tokens : m.cfg.capacity_tokens);
  KVCACHE_TRY(splits);
  attend_params p;
  p.pages[0] = m.pages_of(layer);
  p.tables[0] = detail::batch_table(m);
  p.segments = 1;
  p.split_tokens = splits->tokens;
  p.prefetch_steps = splits->prefetch;
  p.bypass_l1 = splits->bypass_l1;
  p.max_splits[0] = splits->count;
  return detail::launch_attend(m, p, ap, q, out, workspace);
}

result<device_pages> contiguous_cache<cuda>::pages(std::uint32_t layer) const {
  if (layer >= impl_->cfg.shape.layers)
    return fail(errc::layer_out_of_range, "pages: layer", {{"layer", layer}, {"layers", impl_->cfg.shape.layers}});
  return impl_->pages_of(layer);
}

result<device_table> contiguous_cache<cuda>::table() const {
  const impl& m = *impl_;
  KVCACHE_TRY(detail::check_fresh(m, "table"));
  return detail::batch_table(m);
}

}  // namespace kvcache
