// block_pool<cuda> and paged_cache<cuda>: the host bookkeeping of paged_cache<cpu> (same ledger,
// same sequence state machine) with device storage, device copies and the append/attend kernels.
#include "protocol.hpp"
#include "detail.cuh"

#include <kvcache/cuda/paged_cache.hpp>
#include <kvcache/detail/id_table.hpp>

#include <algorithm>
#include <bit>
#include <limits>
#include <numeric>
#include <vector>

namespace kvcache {

// ---- block_pool<cuda> ------------------------------------------------------------------------

block_pool<cuda>::block_pool(make_tag, const block_pool_config& cfg, const cuda& where, device_arena arena,
                             std::byte* storage, const std::uint32_t* identity, std::size_t layer_bytes,
                             std::size_t block_stride, std::size_t head_stride, std::uint32_t blocks)
    : cfg_(cfg),
      where_(where),
      arena_(std::move(arena)),
      storage_(storage),
      identity_(identity),
      layer_bytes_(layer_bytes),
      block_stride_(block_stride),
      head_stride_(head_stride),
      ledger_(blocks, cfg.block_tokens, cfg.hash) {}

block_pool<cuda>::~block_pool() = default;

result<std::shared_ptr<block_pool<cuda>>> block_pool<cuda>::create(const block_pool_config& cfg, const cuda& where) {
  KVCACHE_TRY(validate(cfg.shape));
  if (cfg.block_tokens == 0 || cfg.block_tokens > 65536 || !std::has_single_bit(cfg.block_tokens))
    return fail(errc::invalid_argument, "block_pool: block_tokens must be a power of two in [1, 65536]",
                {{"block_tokens", cfg.block_tokens}});
  if (cfg.storage != format::f32 && cfg.storage != format::f16)
    return fail(errc::invalid_argument, "block_pool: storage format must be f32 or f16",
                {{"format", static_cast<long long>(cfg.storage)}});
  const std::size_t elem = dense_element_bytes(cfg.storage);
  auto head_stride = checked_mul(static_cast<std::size_t>(cfg.block_tokens) * cfg.shape.head_dim, elem,
                                 "block_pool: block head bytes");
  KVCACHE_TRY(head_stride);
  auto block_stride = checked_mul(*head_stride, 2 * static_cast<std::size_t>(cfg.shape.kv_heads), "block_pool: block bytes per layer");
  KVCACHE_TRY(block_stride);
  auto block_bytes = checked_mul(*block_stride, cfg.shape.layers, "block_pool: block bytes");
  KVCACHE_TRY(block_bytes);
  if (cfg.budget_bytes < *block_bytes)
    return fail(errc::invalid_argument, "block_pool: budget below one block",
                {{"budget_bytes", static_cast<long long>(cfg.budget_bytes)}, {"block_bytes", static_cast<long long>(*block_bytes)}});
  // Host tables (the ledger's block metadata and hash index, the identity upload) are built under
  // allocation_guard: a refused allocation is out_of_memory, and the device arena goes with it.
  return detail::allocation_guard("block_pool<cuda>: block tables", [&]() -> result<std::shared_ptr<block_pool>> {
    const std::size_t blocks = std::min<std::size_t>(cfg.budget_bytes / *block_bytes, std::numeric_limits<std::int32_t>::max());
    const std::size_t layer_bytes = blocks * *block_stride;
    const std::size_t bytes = device_arena::padded(layer_bytes * cfg.shape.layers);
    const std::size_t id_bytes = device_arena::padded(blocks * sizeof(std::uint32_t));
    result<device_arena> arena = device_arena::make(where, bytes + id_bytes);
    KVCACHE_TRY(arena);
    auto* storage = static_cast<std::byte*>(arena->allocate(bytes).value());  // sized above
    auto* identity = static_cast<std::uint32_t*>(arena->allocate(id_bytes).value());
    std::vector<std::uint32_t> ids(blocks);
    std::iota(ids.begin(), ids.end(), 0u);
    KVCACHE_TRY(fill_on_device(where, storage, 0, bytes));  // deterministic contents, resident pages
    KVCACHE_TRY(copy_to_device(where, identity, ids.data(), blocks * sizeof(std::uint32_t)));
    KVCACHE_TRY(cuda_synchronize(where));
    return std::make_shared<block_pool>(make_tag{}, cfg, where, std::move(arena).value(), storage, identity, layer_bytes,
                                        *block_stride, *head_stride, static_cast<std::uint32_t>(blocks));
  });
}

device_pages block_pool<cuda>::pages(std::uint32_t layer) const noexcept {
  device_pages p;
  p.k = layer_base(layer);
  p.v = layer_base(layer) + v_offset();
  p.k_page_stride = p.v_page_stride = block_stride_;
  p.k_head_stride = p.v_head_stride = head_stride_;
  p.page_tokens = cfg_.block_tokens;
  p.k_format = p.v_format = cfg_.storage;
  return p;
}

block_pool_stats block_pool<cuda>::stats() const {
  block_pool_stats s = ledger_.stats();
  s.resident_bytes = arena_.capacity();
  return s;
}

// ---- paged_cache<cuda> -----------------------------------------------------------------------

// The bookkeeping is paged_cache<cpu>'s (detail::paged_book); impl adds the device side.
// `epoch` counts the changes to block tables: a prepared batch is fresh while it is unchanged.
struct paged_cache<cuda>::impl : detail::paged_book<block_pool<cuda>> {
  paged_config<cuda> cfg;
  cuda where;

  device_buffer staging;  // host writes: K then V rows
  // Device table of the prepared batch: indptr [bcap + 1], last [bcap], src [bcap + 1], indices [ecap].
  device_buffer table_buf;
  std::size_t bcap = 0, ecap = 0;
  std::uint32_t *t_indptr = nullptr, *t_last = nullptr, *t_src = nullptr, *t_indices = nullptr;
  detail::pinned_uploader uploader;
  std::vector<std::uint32_t> batch_slots, next_slots, h_indptr, h_indices, h_last, h_src;
  std::vector<std::uint64_t> mark;
  std::uint64_t stamp = 0, epoch = 0, prepared_epoch = ~0ull;
  std::uint32_t prepared_rows = 0;
  std::size_t prepared_longest = 0;

  impl(const paged_config<cuda>& c, std::shared_ptr<pool_type> p, const cuda& w)
      : paged_book(std::move(p), c.max_sequences, c.expected_tokens), cfg(c), where(w) {
    cfg.pool = pool;
    cfg.shape = pool->shape();
    cfg.storage = pool->storage();
    cfg.block_tokens = pool->block_tokens();
    seqs.reserve(c.max_sequences);
  }
  impl(const impl&) = delete;
  impl& operator=(const impl&) = delete;

  [[nodiscard]] bool fresh() const noexcept { return prepared_epoch == epoch; }

  // ++epoch where r holds a value (a change to the block tables).
  template <class R>
  R changed(R r) {
    if (r.has_value()) ++epoch;
    return r;
  }

  // Enqueues the device copy of block `from` into `to` (every layer) and copies its token ids.
  [[nodiscard]] result<void> copy_block(std::uint32_t from, std::uint32_t to) {
    const pool_type& p = *pool;
    for (std::uint32_t l = 0; l < p.shape().layers; ++l)
      KVCACHE_TRY(copy_on_device(where, p.k_block(l, to), p.k_block(l, from), p.block_stride()));
    std::copy_n(pool->ledger().tokens(from), B(), pool->ledger().tokens(to));
    return {};
  }

  // reserve's copy-on-write of a shared partial block (paged_book::reserve).
  [[nodiscard]] auto copier() {
    return [this](std::uint32_t from, std::uint32_t to) { return copy_block(from, to); };
  }

  // Appends the reservation's rows (device, `src` format, token-major) block run by block run.
  [[nodiscard]] result<void> append_runs(std::uint32_t slot, std::uint32_t layer, const std::byte* k, const std::byte* v,
                                         format src) {
    sequence& s = seqs[slot];
    const geometry& g = shape();
    const std::size_t row_bytes = g.token_width() * dense_element_bytes(src);
    const std::size_t end = s.length + s.pending;
    for (std::size_t pos = s.length; pos < end;) {
      const std::size_t run = std::min(B() - pos % B(), end - pos);
      const std::uint32_t b = s.blocks[pos / B()];
      append_params p;
      p.dst = pool->pages(layer);
      p.k = k + (pos - s.length) * row_bytes;
      p.v = v + (pos - s.length) * row_bytes;
      p.src_format = src;
      p.kv_heads = g.kv_heads;
      p.head_dim = g.head_dim;
      p.single_pages = pool->identity() + b;
      p.single_first_page = static_cast<std::uint32_t>(pos / B());
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

  // Grows the device table (and pinned staging) to hold `batch` sequences and `entries` entries.
  [[nodiscard]] result<void> grow_table(std::size_t batch, std::size_t entries) {
    if (batch <= bcap && entries <= ecap) return {};
    const std::size_t nb = std::max(batch, bcap), ne = std::max<std::size_t>(std::max(entries, ecap), 1);
    const std::size_t bytes = device_arena::padded((nb + 1) * 4) * 2 + device_arena::padded(nb * 4) +
                              device_arena::padded(ne * 4);
    result<device_buffer> buf = device_buffer::make(where, bytes);
    KVCACHE_TRY(buf);
    detail::pinned_uploader up;
    KVCACHE_TRY(up.init(detail::pinned_uploader::staged_bytes((nb + 1) * 4) * 2 +
                        detail::pinned_uploader::staged_bytes(nb * 4) + detail::pinned_uploader::staged_bytes(ne * 4)));
    auto* base = static_cast<std::byte*>(buf->data());
    t_indptr = reinterpret_cast<std::uint32_t*>(base);
    base += device_arena::padded((nb + 1) * 4);
    t_src = reinterpret_cast<std::uint32_t*>(base);
    base += device_arena::padded((nb + 1) * 4);
    t_last = reinterpret_cast<std::uint32_t*>(base);
    base += device_arena::padded(nb * 4);
    t_indices = reinterpret_cast<std::uint32_t*>(base);
    table_buf = std::move(buf).value();
    uploader = std::move(up);
    bcap = nb;
    ecap = ne;
    prepared_epoch = ~0ull;  // the old table is gone
    return {};
  }
};

result<paged_cache<cuda>> paged_cache<cuda>::create(const paged_config<cuda>& cfg, const cuda& where) {
  std::shared_ptr<pool_type> pool = cfg.pool;
  if (pool) {
    KVCACHE_TRY(impl::check_shared_pool(cfg.shape, *pool));
    if (pool->placement().device != where.device)
      return fail(errc::invalid_argument, "paged_cache: the shared pool lives on another device",
                  {{"device", where.device}, {"pool_device", pool->placement().device}});
  } else {
    block_pool_config pc;
    pc.shape = cfg.shape;
    pc.block_tokens = cfg.block_tokens;
    pc.storage = cfg.storage;
    pc.budget_bytes = cfg.budget_bytes;
    auto made = pool_type::create(pc, where);
    KVCACHE_TRY(made);
    pool = std::move(made).value();
  }
  KVCACHE_TRY(impl::check_limits(cfg.max_sequences, cfg.expected_tokens, *pool));
  return detail::allocation_guard("paged_cache<cuda>: sequence tables", [&]() -> result<paged_cache> {
    return paged_cache(std::make_unique<impl>(cfg, std::move(pool), where));
  });
}

paged_cache<cuda>::paged_cache(std::unique_ptr<impl> p) noexcept : impl_(std::move(p)) {}
paged_cache<cuda>::paged_cache(paged_cache&&) noexcept = default;
paged_cache<cuda>& paged_cache<cuda>::operator=(paged_cache&& o) noexcept {
  if (this != &o) impl_ = std::move(o.impl_);  // the old impl's destructor releases its blocks
  return *this;
}
paged_cache<cuda>::~paged_cache() = default;

const geometry& paged_cache<cuda>::shape() const noexcept { return impl_->shape(); }
const paged_config<cuda>& paged_cache<cuda>::config() const noexcept { return impl_->cfg; }
format paged_cache<cuda>::storage() const noexcept { return impl_->pool->storage(); }
std::uint32_t paged_cache<cuda>::block_tokens() const noexcept { return impl_->pool->block_tokens(); }
const std::shared_ptr<block_pool<cuda>>& paged_cache<cuda>::pool() const noexcept { return impl_->pool; }
const cuda& paged_cache<cuda>::placement() const noexcept { return impl_->where; }

result<seq_id> paged_cache<cuda>::create() { return impl_->changed(impl_->create()); }

result<prefix_match> paged_cache<cuda>::create_with_prefix(std::span<const std::int32_t> tokens) {
  return impl_->changed(impl_->create_with_prefix(tokens));
}

result<void> paged_cache<cuda>::reserve(seq_id id, std::size_t n) {
  return impl_->changed(impl_->reserve(id, n, {}, impl_->copier()));
}

result<void> paged_cache<cuda>::reserve(seq_id id, std::size_t n, std::span<const std::int32_t> token_ids) {
  return impl_->changed(impl_->reserve_with_ids(id, n, token_ids, impl_->copier()));
}

result<void> paged_cache<cuda>::write(seq_id id, std::uint32_t layer, std::span<const float> k, std::span<const float> v) {
  return impl_->write_host(id, layer, k, v);
}

result<void> paged_cache<cuda>::write(seq_id id, std::uint32_t layer, std::span<const half> k, std::span<const half> v) {
  return impl_->write_host(id, layer, k, v);
}

result<void> paged_cache<cuda>::write_device(seq_id id, std::uint32_t layer, const void* k, const void* v, format src) {
  impl& m = *impl_;
  return detail::write_device_rows(m, id, layer, k, v, src,
                                   [&m](std::uint32_t slot, std::uint32_t l, const std::byte* dk, const std::byte* dv,
                                        format f) { return m.append_runs(slot, l, dk, dv, f); });
}

result<void> paged_cache<cuda>::commit(seq_id id) {
  impl& m = *impl_;
  // Publishing makes blocks adoptable by other caches of the pool, whose kernels may run on
  // other streams: first wait until this cache's writes into them are complete.
  return m.changed(m.commit(id, [&m] { return cuda_synchronize(m.where); }));
}

result<std::size_t> paged_cache<cuda>::length(seq_id id) const { return impl_->length(id); }

result<void> paged_cache<cuda>::truncate(seq_id id, std::size_t n) { return impl_->changed(impl_->truncate(id, n)); }

result<seq_id> paged_cache<cuda>::fork(seq_id src) { return impl_->changed(impl_->copy_prefix(src, 0, true)); }

result<seq_id> paged_cache<cuda>::copy_prefix(seq_id src, std::size_t n) {
  return impl_->changed(impl_->copy_prefix(src, n, false));
}

result<void> paged_cache<cuda>::release(seq_id id) { return impl_->changed(impl_->release(id)); }

result<layer_view> paged_cache<cuda>::view(seq_id id, std::uint32_t layer) const { return impl_->view(id, layer); }

result<std::span<const std::uint32_t>> paged_cache<cuda>::blocks(seq_id id) const { return impl_->blocks(id); }

result<block_table_csr> paged_cache<cuda>::export_block_tables(std::span<const seq_id> seqs, std::span<std::int32_t> indptr,
                                                               std::span<std::int32_t> indices,
                                                               std::span<std::int32_t> last_block_len) const {
  return impl_->export_block_tables(seqs, indptr, indices, last_block_len);
}

result<block_table_csr> paged_cache<cuda>::export_block_tables(std::span<const seq_id> seqs) {
  return impl_->export_block_tables(seqs);
}

paged_stats paged_cache<cuda>::stats() const {
  const impl& m = *impl_;
  paged_stats st = m.stats();  // resident: the pool's arena, plus this cache's staging and tables
  st.resident_bytes += m.staging.size() + m.table_buf.size() + m.uploader.capacity();
  return st;
}

result<void> paged_cache<cuda>::reserve_table(std::size_t batch, std::size_t entries) {
  if (batch == 0 || batch >= std::numeric_limits<std::uint32_t>::max() || entries >= std::numeric_limits<std::uint32_t>::max())
    return fail(errc::invalid_argument, "reserve_table: batch must be >= 1 and sizes < 2^32",
                {{"batch", static_cast<long long>(batch)}, {"entries", static_cast<long long>(entries)}});
  return impl_->grow_table(batch, entries);
}

result<void> paged_cache<cuda>::prepare(std::span<const seq_id> batch) {
  impl& m = *impl_;
  if (batch.empty() || batch.size() >= std::numeric_limits<std::uint32_t>::max())
    return fail(errc::invalid_argument, "prepare: batch must hold 1 .. 2^32-2 sequences", {{"batch", static_cast<long long>(batch.size())}});
  KVCACHE_TRY(detail::select_batch(m, batch));  // m.next_slots; the prepared batch is untouched
  std::size_t entries = 0;
  for (const std::uint32_t slot : m.next_slots) {
    const impl::sequence& s = m.seqs[slot];
    entries += m.blocks_for(s.length + s.pending);
  }
  if (entries >= std::numeric_limits<std::uint32_t>::max())
    return fail(errc::overflow, "prepare: block-table entries exceed 2^32", {{"entries", static_cast<long long>(entries)}});
  if (!detail::try_allocate([&] {
        for (auto* v : {&m.h_indptr, &m.h_src}) v->reserve(batch.size() + 1);
        m.h_last.reserve(batch.size());
        m.h_indices.reserve(entries);
      }))
    return fail(errc::out_of_memory, "prepare: host block tables",
                {{"batch", static_cast<long long>(batch.size())}, {"entries", static_cast<long long>(entries)}});
  KVCACHE_TRY(m.grow_table(batch.size(), entries));  // may invalidate the previous table (new addresses)
  m.h_indptr.assign(1, 0u);
  m.h_indices.clear();
  m.h_last.clear();
  m.h_src.assign(1, 0u);
  std::size_t longest = 0;
  for (const std::uint32_t slot : m.next_slots) {
    const impl::sequence& s = m.seqs[slot];
    const std::size_t len = s.length + s.pending;
    const std::size_t count = m.blocks_for(len);
    longest = std::max(longest, len);
    m.h_indices.insert(m.h_indices.end(), s.blocks.begin(), s.blocks.begin() + static_cast<std::ptrdiff_t>(count));
    m.h_indptr.push_back(static_cast<std::uint32_t>(m.h_indices.size()));
    m.h_last.push_back(static_cast<std::uint32_t>(count == 0 ? 0 : len - (count - 1) * m.B()));
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

result<void> paged_cache<cuda>::write_batch(std::uint32_t layer, const void* k, const void* v, format src) {
  impl& m = *impl_;
  return detail::write_batch_rows(m, layer, [&m](std::uint32_t l) { return m.pool->pages(l); }, k, v, src);
}

result<void> paged_cache<cuda>::mark_batch_written() { return detail::mark_batch_written(*impl_); }

result<void> paged_cache<cuda>::attend(std::uint32_t layer, const attention_params& ap, const float* q, float* out,
                                       device_buffer& workspace, const cuda_attend_options& opt) {
  impl& m = *impl_;
  const result<detail::split_plan> splits =
      detail::attend_splits(m, layer, ap, opt, std::max<std::size_t>(1, opt.max_tokens != 0 ? opt.max_tokens : m.prepared_longest));
  KVCACHE_TRY(splits);
  attend_params p;
  p.pages[0] = m.pool->pages(layer);
  p.tables[0] = detail::batch_table(m);
  p.segments = 1;
  p.split_tokens = splits->tokens;
  p.prefetch_steps = splits->prefetch;
  p.bypass_l1 = splits->bypass_l1;
  p.max_splits[0] = splits->count;
  return detail::launch_attend(m, p, ap, q, out, workspace);
}

result<device_pages> paged_cache<cuda>::pages(std::uint32_t layer) const {
  if (layer >= impl_->shape().layers)
    return fail(errc::layer_out_of_range, "pages: layer", {{"layer", layer}, {"layers", impl_->shape().layers}});
  return impl_->pool->pages(layer);
}

result<device_table> paged_cache<cuda>::table() const {
  const impl& m = *impl_;
  KVCACHE_TRY(detail::check_fresh(m, "table"));
  return detail::batch_table(m);
}

}  // namespace kvcache
