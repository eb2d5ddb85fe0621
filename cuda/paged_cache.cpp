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

struct paged_cache<cuda>::impl {
  struct sequence {
    std::vector<std::uint32_t> blocks;  // [block index] pool block id, committed then reserved
    std::vector<chunk> chunks;          // [layer][chunk_cap] one chunk per block (device pointers)
    std::vector<std::uint8_t> written;  // [layer]
    std::size_t chunk_cap = 0;
    std::size_t length = 0;
    std::size_t pending = 0;
    std::size_t known = 0;   // leading tokens whose ids are known
    std::size_t hashed = 0;  // leading blocks indexed in the pool
    std::uint32_t written_count = 0;
    bool reserved = false;
    bool pending_ids = false;
  };

  std::shared_ptr<pool_type> pool;
  paged_config<cuda> cfg;
  cuda where;
  detail::id_table ids;
  std::vector<sequence> seqs;  // [slot]
  std::size_t tokens = 0, reserved_tokens = 0, query_tokens = 0, hit_tokens = 0;

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
  std::vector<std::int32_t> csr_indptr, csr_indices, csr_last;  // host CSR export buffers

  impl(const paged_config<cuda>& c, std::shared_ptr<pool_type> p, const cuda& w)
      : pool(std::move(p)), cfg(c), where(w), ids(c.max_sequences) {
    cfg.pool = pool;
    cfg.shape = pool->shape();
    cfg.storage = pool->storage();
    cfg.block_tokens = pool->block_tokens();
    seqs.reserve(c.max_sequences);
  }
  impl(const impl&) = delete;
  impl& operator=(const impl&) = delete;
  ~impl() { release_all(); }

  [[nodiscard]] const geometry& shape() const noexcept { return pool->shape(); }
  [[nodiscard]] std::size_t B() const noexcept { return pool->block_tokens(); }
  [[nodiscard]] std::size_t blocks_for(std::size_t t) const noexcept { return t / B() + (t % B() != 0 ? 1 : 0); }
  [[nodiscard]] bool fresh() const noexcept { return prepared_epoch == epoch; }

  void release_all() noexcept {
    if (!pool) return;
    for (std::uint32_t slot = 0; slot < seqs.size(); ++slot)
      if (ids.is_live(slot)) drop_blocks(seqs[slot]);
  }

  void drop_blocks(sequence& s) noexcept {
    pool->ledger().unref(s.blocks);
    s.blocks.clear();
    tokens -= s.length;
    reserved_tokens -= s.pending;
    s.length = s.pending = s.known = s.hashed = 0;
    s.reserved = s.pending_ids = false;
    s.written_count = 0;
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

  void set_chunk(sequence& s, std::size_t i, std::uint32_t t) noexcept {
    const pool_type& p = *pool;
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

  void set_tokens(sequence& s, std::size_t i) noexcept {
    const std::size_t start = i * B();
    const auto t = static_cast<std::uint32_t>(s.length <= start ? 0 : std::min(B(), s.length - start));
    for (std::uint32_t l = 0; l < shape().layers; ++l) s.chunks[l * s.chunk_cap + i].tokens = t;
  }

  // Enqueues the device copy of block `from` into `to` (every layer) and copies its token ids.
  [[nodiscard]] result<void> copy_block(std::uint32_t from, std::uint32_t to) {
    const pool_type& p = *pool;
    for (std::uint32_t l = 0; l < p.shape().layers; ++l)
      KVCACHE_TRY(copy_on_device(where, p.k_block(l, to), p.k_block(l, from), p.block_stride()));
    std::copy_n(pool->ledger().tokens(from), B(), pool->ledger().tokens(to));
    return {};
  }

  [[nodiscard]] result<void> reserve_impl(seq_id id, std::size_t n, std::span<const std::int32_t> token_ids) {
    result<std::uint32_t> slot = ids.slot(id, "reserve: unknown sequence");
    KVCACHE_TRY(slot);
    sequence& s = seqs[slot.value()];
    if (s.reserved)
      return fail(errc::reservation_pending, "reserve: a reservation is already open",
                  {{"seq", static_cast<long long>(id.value)}, {"pending", static_cast<long long>(s.pending)}});
    const std::size_t have = s.blocks.size();
    if (n > 0) {
      const std::size_t pool_tokens = static_cast<std::size_t>(pool->blocks()) * B();
      if (n > pool_tokens)
        return fail(errc::pool_exhausted, "reserve: more tokens than the block pool holds",
                    {{"tokens", static_cast<long long>(std::min<std::size_t>(n, std::numeric_limits<long long>::max()))},
                     {"pool_tokens", static_cast<long long>(pool_tokens)}});
      const std::size_t fresh_blocks = blocks_for(s.length + n) - have;
      ensure_capacity(s, have + fresh_blocks);
      const std::uint32_t tail = s.length % B() != 0 ? s.blocks.back() : detail::block_ledger::no_block;
      s.blocks.resize(have + fresh_blocks);
      std::uint32_t copy = detail::block_ledger::no_block;
      const detail::block_ledger::grant g = pool->ledger().acquire(tail, fresh_blocks, s.blocks.data() + have, &copy);
      if (!g.ok) {
        s.blocks.resize(have);
        return fail(errc::pool_exhausted, "reserve: block pool exhausted",
                    {{"needed", static_cast<long long>(g.needed)}, {"free", static_cast<long long>(g.available)},
                     {"tokens", static_cast<long long>(n)}});
      }
      if (g.copy) {
        const result<void> copied = copy_block(tail, copy);
        if (!copied.has_value()) {  // device failure: give the new blocks back
          pool->ledger().unref(std::span<const std::uint32_t>(&copy, 1));
          pool->ledger().unref(std::span<const std::uint32_t>(s.blocks).subspan(have));
          s.blocks.resize(have);
          return copied;
        }
        s.blocks[have - 1] = copy;
        pool->ledger().unref(std::span<const std::uint32_t>(&tail, 1));
        set_chunk(s, have - 1, static_cast<std::uint32_t>(s.length - (have - 1) * B()));
      }
      for (std::size_t i = have; i < have + fresh_blocks; ++i) set_chunk(s, i, 0);
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
    ++epoch;
    return {};
  }

  [[nodiscard]] result<seq_id> copy_prefix_impl(seq_id src_id, std::uint32_t src_slot, std::size_t n, const char* what) {
    {
      const sequence& src = seqs[src_slot];
      if (src.reserved)
        return fail(errc::reservation_pending, what,
                    {{"seq", static_cast<long long>(src_id.value)}, {"pending", static_cast<long long>(src.pending)}});
      if (n > src.length)
        return fail(errc::out_of_range, what,
                    {{"n", static_cast<long long>(std::min<std::size_t>(n, std::numeric_limits<long long>::max()))},
                     {"length", static_cast<long long>(src.length)}});
    }
    result<seq_id> id = ids.acquire();
    KVCACHE_TRY(id);
    const std::uint32_t slot = ids.slot(id.value(), what).value();
    sequence& dst = fresh_slot(slot);
    const sequence& src = seqs[src_slot];
    const std::size_t count = blocks_for(n);
    ensure_capacity(dst, std::max(count, blocks_for(cfg.expected_tokens)));
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
    ++epoch;
    return id;
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
    const geometry& ps = pool->shape();
    if (cfg.shape != geometry{} && cfg.shape != ps)
      return fail(errc::invalid_argument, "paged_config.shape differs from the shared pool's",
                  {{"layers", cfg.shape.layers}, {"pool_layers", ps.layers}, {"kv_heads", cfg.shape.kv_heads},
                   {"pool_kv_heads", ps.kv_heads}, {"head_dim", cfg.shape.head_dim}, {"pool_head_dim", ps.head_dim}});
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
  if (cfg.max_sequences > std::numeric_limits<std::uint32_t>::max())
    return fail(errc::invalid_argument, "paged_config.max_sequences must be < 2^32",
                {{"max_sequences", static_cast<long long>(cfg.max_sequences)}});
  return paged_cache(std::make_unique<impl>(cfg, std::move(pool), where));
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

result<seq_id> paged_cache<cuda>::create() {
  impl& m = *impl_;
  result<seq_id> id = m.ids.acquire();
  KVCACHE_TRY(id);
  impl::sequence& s = m.fresh_slot(m.ids.slot(id.value(), "create").value());
  m.ensure_capacity(s, m.blocks_for(m.cfg.expected_tokens));
  ++m.epoch;
  return id;
}

result<prefix_match> paged_cache<cuda>::create_with_prefix(std::span<const std::int32_t> tokens) {
  impl& m = *impl_;
  result<seq_id> id = m.ids.acquire();
  KVCACHE_TRY(id);
  impl::sequence& s = m.fresh_slot(m.ids.slot(id.value(), "create_with_prefix").value());
  const std::size_t B = m.B();
  const std::size_t max_blocks = tokens.empty() ? 0 : (tokens.size() - 1) / B;
  m.ensure_capacity(s, std::max(max_blocks, m.blocks_for(m.cfg.expected_tokens)));
  s.blocks.resize(max_blocks);
  const std::size_t k = m.pool->ledger().adopt(tokens, max_blocks, s.blocks.data());
  s.blocks.resize(k);
  for (std::size_t i = 0; i < k; ++i) m.set_chunk(s, i, static_cast<std::uint32_t>(B));
  s.length = s.known = k * B;
  s.hashed = k;
  m.tokens += s.length;
  m.query_tokens += max_blocks * B;
  m.hit_tokens += k * B;
  ++m.epoch;
  return prefix_match{id.value(), s.length};
}

result<void> paged_cache<cuda>::reserve(seq_id id, std::size_t n) { return impl_->reserve_impl(id, n, {}); }

result<void> paged_cache<cuda>::reserve(seq_id id, std::size_t n, std::span<const std::int32_t> token_ids) {
  if (token_ids.size() != n) {
    result<std::uint32_t> slot = impl_->ids.slot(id, "reserve: unknown sequence");
    KVCACHE_TRY(slot);
    return fail(errc::bad_shape, "reserve: token id count differs from the token count",
                {{"n", static_cast<long long>(std::min<std::size_t>(n, std::numeric_limits<long long>::max()))},
                 {"token_ids", static_cast<long long>(token_ids.size())}});
  }
  return impl_->reserve_impl(id, n, token_ids);
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
  result<std::uint32_t> slot = m.ids.slot(id, "commit: unknown sequence");
  KVCACHE_TRY(slot);
  impl::sequence& s = m.seqs[slot.value()];
  KVCACHE_TRY(detail::check_commit(id, s.reserved, s.written, s.written_count, m.shape().layers));
  const std::size_t B = m.B();
  if (s.pending_ids && (s.length + s.pending) / B > s.hashed) {
    // Publishing makes blocks adoptable by other caches of the pool, whose kernels may run on
    // other streams: wait until this cache's writes into them are complete.
    KVCACHE_TRY(cuda_synchronize(m.where));
  }
  const std::size_t old = s.length;
  s.length += s.pending;
  m.tokens += s.pending;
  m.reserved_tokens -= s.pending;
  s.pending = 0;
  s.reserved = false;
  for (std::size_t i = old / B; i < s.blocks.size(); ++i) m.set_tokens(s, i);
  if (s.pending_ids) {
    s.pending_ids = false;
    s.known = s.length;
    const std::size_t full = s.length / B;
    if (full > s.hashed) {
      const std::uint32_t parent = s.hashed == 0 ? detail::block_ledger::no_block : s.blocks[s.hashed - 1];
      const std::span<std::uint32_t> fresh(s.blocks.data() + s.hashed, full - s.hashed);
      if (m.pool->ledger().publish(fresh, parent) != 0)
        for (std::size_t i = s.hashed; i < full; ++i) m.set_chunk(s, i, static_cast<std::uint32_t>(B));
      s.hashed = full;
    }
  }
  ++m.epoch;
  return {};
}

result<std::size_t> paged_cache<cuda>::length(seq_id id) const {
  result<std::uint32_t> slot = impl_->ids.slot(id, "length: unknown sequence");
  KVCACHE_TRY(slot);
  return impl_->seqs[slot.value()].length;
}

result<void> paged_cache<cuda>::truncate(seq_id id, std::size_t n) {
  impl& m = *impl_;
  result<std::uint32_t> slot = m.ids.slot(id, "truncate: unknown sequence");
  KVCACHE_TRY(slot);
  impl::sequence& s = m.seqs[slot.value()];
  KVCACHE_TRY(detail::check_truncate(id, s.reserved, s.pending, n, s.length));
  const std::size_t keep = m.blocks_for(n);
  if (keep < s.blocks.size()) {
    m.pool->ledger().unref(std::span<const std::uint32_t>(s.blocks).subspan(keep));
    s.blocks.resize(keep);
  }
  m.tokens -= s.length - n;
  s.length = n;
  s.known = std::min(s.known, n);
  s.hashed = std::min(s.hashed, n / m.B());
  if (keep > 0) m.set_tokens(s, keep - 1);
  ++m.epoch;
  return {};
}

result<seq_id> paged_cache<cuda>::fork(seq_id src) {
  result<std::uint32_t> slot = impl_->ids.slot(src, "fork: unknown sequence");
  KVCACHE_TRY(slot);
  return impl_->copy_prefix_impl(src, slot.value(), impl_->seqs[slot.value()].length, "fork");
}

result<seq_id> paged_cache<cuda>::copy_prefix(seq_id src, std::size_t n) {
  result<std::uint32_t> slot = impl_->ids.slot(src, "copy_prefix: unknown sequence");
  KVCACHE_TRY(slot);
  return impl_->copy_prefix_impl(src, slot.value(), n, "copy_prefix");
}

result<void> paged_cache<cuda>::release(seq_id id) {
  impl& m = *impl_;
  result<std::uint32_t> slot = m.ids.slot(id, "release: unknown sequence");
  KVCACHE_TRY(slot);
  m.drop_blocks(m.seqs[slot.value()]);
  m.ids.release(slot.value());
  ++m.epoch;
  return {};
}

result<layer_view> paged_cache<cuda>::view(seq_id id, std::uint32_t layer) const {
  const impl& m = *impl_;
  result<std::uint32_t> slot = m.ids.slot(id, "view: unknown sequence");
  KVCACHE_TRY(slot);
  if (layer >= m.shape().layers)
    return fail(errc::layer_out_of_range, "view: layer", {{"layer", layer}, {"layers", m.shape().layers}});
  const impl::sequence& s = m.seqs[slot.value()];
  const std::size_t count = m.blocks_for(s.length);
  const chunk* first = count == 0 ? nullptr : s.chunks.data() + static_cast<std::size_t>(layer) * s.chunk_cap;
  return layer_view{first, static_cast<std::uint32_t>(count), static_cast<std::uint32_t>(s.length)};
}

result<std::span<const std::uint32_t>> paged_cache<cuda>::blocks(seq_id id) const {
  result<std::uint32_t> slot = impl_->ids.slot(id, "blocks: unknown sequence");
  KVCACHE_TRY(slot);
  return std::span<const std::uint32_t>(impl_->seqs[slot.value()].blocks);
}

result<block_table_csr> paged_cache<cuda>::export_block_tables(std::span<const seq_id> seqs, std::span<std::int32_t> indptr,
                                                               std::span<std::int32_t> indices,
                                                               std::span<std::int32_t> last_block_len) const {
  const impl& m = *impl_;
  std::size_t total = 0;
  for (const seq_id id : seqs) {
    result<std::uint32_t> slot = m.ids.slot(id, "export_block_tables: unknown sequence");
    KVCACHE_TRY(slot);
    total += m.blocks_for(m.seqs[slot.value()].length);
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
                {{"needed", static_cast<long long>(seqs.size())}, {"got", static_cast<long long>(last_block_len.size())}});
  std::size_t at = 0;
  indptr[0] = 0;
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    const impl::sequence& s = m.seqs[m.ids.slot(seqs[i], "export_block_tables").value()];
    const std::size_t count = m.blocks_for(s.length);
    for (std::size_t b = 0; b < count; ++b) indices[at++] = static_cast<std::int32_t>(s.blocks[b]);
    indptr[i + 1] = static_cast<std::int32_t>(at);
    last_block_len[i] = static_cast<std::int32_t>(count == 0 ? 0 : s.length - (count - 1) * m.B());
  }
  return block_table_csr{indptr.data(), indices.data(), last_block_len.data(), static_cast<std::uint32_t>(seqs.size()),
                         block_tokens()};
}

result<block_table_csr> paged_cache<cuda>::export_block_tables(std::span<const seq_id> seqs) {
  impl& m = *impl_;
  std::size_t total = 0;
  for (const seq_id id : seqs) {
    result<std::uint32_t> slot = m.ids.slot(id, "export_block_tables: unknown sequence");
    KVCACHE_TRY(slot);
    total += m.blocks_for(m.seqs[slot.value()].length);
  }
  if (m.csr_indptr.size() < seqs.size() + 1) m.csr_indptr.resize(seqs.size() + 1);
  if (m.csr_indices.size() < total) m.csr_indices.resize(total);
  if (m.csr_last.size() < seqs.size()) m.csr_last.resize(seqs.size());
  return export_block_tables(seqs, m.csr_indptr, m.csr_indices, m.csr_last);
}

paged_stats paged_cache<cuda>::stats() const {
  const impl& m = *impl_;
  const block_pool_stats ps = m.pool->stats();
  paged_stats st;
  st.sequences = m.ids.live();
  st.tokens = m.tokens;
  st.resident_bytes = ps.resident_bytes + m.staging.size() + m.table_buf.size();
  st.reserved_tokens = m.reserved_tokens;
  st.block_tokens = m.B();
  st.block_bytes = m.pool->block_bytes();
  st.blocks_total = ps.blocks_total;
  st.blocks_free = ps.blocks_free;
  st.blocks_in_use = ps.blocks_in_use;
  st.blocks_shared = ps.blocks_shared;
  st.blocks_cached = ps.blocks_cached;
  st.evictions = ps.evictions;
  for (std::uint32_t slot = 0; slot < m.seqs.size(); ++slot) {
    if (!m.ids.is_live(slot)) continue;
    const impl::sequence& s = m.seqs[slot];
    st.table_blocks += s.blocks.size();
    st.internal_waste_tokens += s.blocks.size() * m.B() - s.length - s.pending;
  }
  st.internal_waste_bytes = st.internal_waste_tokens * (m.pool->block_bytes() / m.B());
  st.prefix_query_tokens = m.query_tokens;
  st.prefix_hit_tokens = m.hit_tokens;
  st.prefix_hit_rate = m.query_tokens == 0 ? 0.0 : static_cast<double>(m.hit_tokens) / static_cast<double>(m.query_tokens);
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
