// block_pool<cpu> creation and the pool's bookkeeping (detail::block_ledger).
#include <kvcache/block_pool.hpp>
#include <kvcache/detail/storage.hpp>

#include <algorithm>
#include <bit>
#include <cassert>
#include <cstring>
#include <limits>
#include <new>

namespace kvcache {
namespace detail {

namespace {
std::size_t bucket_count_for(std::uint32_t blocks) {
  // At least two buckets per block keeps the intrusive chains short; a power of two to mask.
  return std::bit_ceil(std::max<std::size_t>(16, static_cast<std::size_t>(blocks) * 2));
}
}  // namespace

block_ledger::block_ledger(std::uint32_t blocks, std::uint32_t block_tokens, prefix_hash_fn hash)
    : blocks_(blocks),
      block_tokens_(block_tokens),
      hash_fn_(hash != nullptr ? hash : &prefix_hash),
      ref_(blocks, 0),
      lru_prev_(blocks, no_block),
      lru_next_(blocks, no_block),
      indexed_(blocks, 0),
      hash_(blocks, 0),
      parent_(blocks, no_block),
      parent_gen_(blocks, 0),
      gen_(blocks, 0),
      bucket_(bucket_count_for(blocks), no_block),
      bucket_next_(blocks, no_block),
      token_ids_(static_cast<std::size_t>(blocks) * block_tokens, 0) {
  free_.reserve(blocks);
  // Lowest ids on top of the stack: a fresh pool hands out blocks 0, 1, 2, ...
  for (std::uint32_t b = blocks; b-- > 0;) free_.push_back(b);
  n_free_ = blocks;
}

std::uint64_t block_ledger::chain_hash(std::uint32_t parent, const std::int32_t* toks) const noexcept {
  const std::uint64_t seed = parent == no_block ? prefix_hash_root : hash_[parent];
  return hash_fn_(seed, std::span<const std::int32_t>(toks, block_tokens_));
}

std::uint32_t block_ledger::find_locked(std::uint64_t h, std::uint32_t parent, const std::int32_t* toks,
                                        std::uint32_t exclude) const noexcept {
  const std::size_t mask = bucket_.size() - 1;
  for (std::uint32_t c = bucket_[h & mask]; c != no_block; c = bucket_next_[c]) {
    if (c == exclude || hash_[c] != h || parent_[c] != parent) continue;
    // The parent link is by block identity and generation: a parent that left the index (and so
    // may hold other data now) invalidates every child indexed under it.
    if (parent != no_block && parent_gen_[c] != gen_[parent]) continue;
    const std::int32_t* ct = token_ids_.data() + static_cast<std::size_t>(c) * block_tokens_;
    if (std::memcmp(ct, toks, sizeof(std::int32_t) * block_tokens_) != 0) continue;
    return c;
  }
  return no_block;
}

void block_ledger::index_locked(std::uint32_t b, std::uint64_t h, std::uint32_t parent) noexcept {
  assert(!indexed_[b]);
  const std::size_t mask = bucket_.size() - 1;
  indexed_[b] = 1;
  hash_[b] = h;
  parent_[b] = parent;
  parent_gen_[b] = parent == no_block ? 0 : gen_[parent];
  bucket_next_[b] = bucket_[h & mask];
  bucket_[h & mask] = b;
}

void block_ledger::unindex_locked(std::uint32_t b) noexcept {
  assert(indexed_[b]);
  const std::size_t mask = bucket_.size() - 1;
  std::uint32_t* link = &bucket_[hash_[b] & mask];
  while (*link != b) {
    assert(*link != no_block);
    link = &bucket_next_[*link];
  }
  *link = bucket_next_[b];
  bucket_next_[b] = no_block;
  indexed_[b] = 0;
  parent_[b] = no_block;
  ++gen_[b];
}

void block_ledger::lru_push_locked(std::uint32_t b) noexcept {
  lru_prev_[b] = lru_newest_;
  lru_next_[b] = no_block;
  if (lru_newest_ != no_block) lru_next_[lru_newest_] = b; else lru_oldest_ = b;
  lru_newest_ = b;
  ++n_cached_;
}

void block_ledger::lru_remove_locked(std::uint32_t b) noexcept {
  const std::uint32_t p = lru_prev_[b], n = lru_next_[b];
  if (p != no_block) lru_next_[p] = n; else lru_oldest_ = n;
  if (n != no_block) lru_prev_[n] = p; else lru_newest_ = p;
  lru_prev_[b] = lru_next_[b] = no_block;
  --n_cached_;
}

void block_ledger::ref_locked(std::uint32_t b) noexcept {
  if (ref_[b] == 0) {
    assert(indexed_[b]);  // only cached blocks are revived; free ones are taken with take_locked
    lru_remove_locked(b);
    ++n_in_use_;
  } else if (ref_[b] == 1) {
    ++n_shared_;
  }
  ++ref_[b];
}

void block_ledger::unref_locked(std::uint32_t b) noexcept {
  assert(ref_[b] > 0);
  if (ref_[b] == 2) --n_shared_;
  if (--ref_[b] == 0) {
    --n_in_use_;
    if (indexed_[b]) {
      lru_push_locked(b);
    } else {
      free_.push_back(b);  // capacity reserved for every block: never allocates
      ++n_free_;
    }
  }
}

std::uint32_t block_ledger::take_locked() noexcept {
  std::uint32_t b;
  if (!free_.empty()) {
    b = free_.back();
    free_.pop_back();
    --n_free_;
  } else {
    b = lru_oldest_;
    assert(b != no_block);
    lru_remove_locked(b);
    unindex_locked(b);
    ++evictions_;
  }
  ref_[b] = 1;
  ++n_in_use_;
  return b;
}

block_ledger::grant block_ledger::acquire(std::uint32_t tail, std::size_t fresh, std::uint32_t* out,
                                          std::uint32_t* copy_target) {
  const std::lock_guard lock(mu_);
  grant g;
  g.copy = tail != no_block && ref_[tail] > 1;
  g.needed = fresh + (g.copy ? 1 : 0);
  g.available = n_free_ + n_cached_;
  if (g.needed > g.available) return g;
  g.ok = true;
  if (tail != no_block && !g.copy && indexed_[tail]) unindex_locked(tail);
  if (g.copy) *copy_target = take_locked();
  for (std::size_t i = 0; i < fresh; ++i) out[i] = take_locked();
  return g;
}

void block_ledger::add_refs(std::span<const std::uint32_t> blocks) {
  const std::lock_guard lock(mu_);
  for (const std::uint32_t b : blocks) {
    assert(ref_[b] > 0);
    ref_locked(b);
  }
}

void block_ledger::unref(std::span<const std::uint32_t> blocks) {
  const std::lock_guard lock(mu_);
  for (std::size_t i = blocks.size(); i-- > 0;) unref_locked(blocks[i]);
}

std::size_t block_ledger::publish(std::span<std::uint32_t> blocks, std::uint32_t parent) {
  const std::lock_guard lock(mu_);
  std::size_t changed = 0;
  std::uint32_t p = parent;
  for (std::uint32_t& b : blocks) {
    assert(ref_[b] == 1 && !indexed_[b]);
    const std::int32_t* toks = token_ids_.data() + static_cast<std::size_t>(b) * block_tokens_;
    const std::uint64_t h = chain_hash(p, toks);
    const std::uint32_t c = find_locked(h, p, toks, b);
    if (c != no_block) {
      // Same prefix computed twice: keep the indexed copy so later chains stay findable.
      ref_locked(c);
      unref_locked(b);
      b = c;
      ++changed;
    } else {
      index_locked(b, h, p);
    }
    p = b;
  }
  return changed;
}

std::size_t block_ledger::adopt(std::span<const std::int32_t> tokens, std::size_t max_blocks,
                                std::uint32_t* out) {
  assert(tokens.size() >= max_blocks * block_tokens_);
  const std::lock_guard lock(mu_);
  std::size_t k = 0;
  std::uint32_t p = no_block;
  for (; k < max_blocks; ++k) {
    const std::int32_t* toks = tokens.data() + k * block_tokens_;
    const std::uint32_t c = find_locked(chain_hash(p, toks), p, toks, no_block);
    if (c == no_block) break;
    ref_locked(c);
    out[k] = c;
    p = c;
  }
  query_blocks_ += max_blocks;
  hit_blocks_ += k;
  return k;
}

std::uint32_t block_ledger::refcount(std::uint32_t b) const {
  const std::lock_guard lock(mu_);
  return ref_[b];
}

bool block_ledger::indexed(std::uint32_t b) const {
  const std::lock_guard lock(mu_);
  return indexed_[b] != 0;
}

block_pool_stats block_ledger::stats() const {
  const std::lock_guard lock(mu_);
  block_pool_stats s;
  s.blocks_total = blocks_;
  s.blocks_free = n_free_;
  s.blocks_in_use = n_in_use_;
  s.blocks_shared = n_shared_;
  s.blocks_cached = n_cached_;
  s.evictions = evictions_;
  s.prefix_query_blocks = query_blocks_;
  s.prefix_hit_blocks = hit_blocks_;
  // Seven uint32 arrays of one entry per block (ref, lru links, parent, parent_gen, gen, bucket_next).
  s.metadata_bytes = ref_.capacity() * sizeof(std::uint32_t) * 7 + free_.capacity() * sizeof(std::uint32_t) +
                     indexed_.capacity() + hash_.capacity() * sizeof(std::uint64_t) +
                     bucket_.capacity() * sizeof(std::uint32_t) + token_ids_.capacity() * sizeof(std::int32_t);
  return s;
}

bool block_ledger::check(std::uint32_t* bad) const {
  const std::lock_guard lock(mu_);
  auto fail_at = [&](std::uint32_t b) {
    if (bad != nullptr) *bad = b;
    return false;
  };
  // 0: not seen, 1: on the free list, 2: on the LRU list.
  std::vector<std::uint8_t> where(blocks_, 0);
  for (const std::uint32_t b : free_) {
    if (b >= blocks_ || where[b] != 0 || ref_[b] != 0 || indexed_[b]) return fail_at(b);
    where[b] = 1;
  }
  std::size_t cached = 0;
  std::uint32_t prev = no_block;
  for (std::uint32_t b = lru_oldest_; b != no_block; b = lru_next_[b]) {
    if (b >= blocks_ || where[b] != 0 || ref_[b] != 0 || !indexed_[b] || lru_prev_[b] != prev) return fail_at(b);
    where[b] = 2;
    prev = b;
    ++cached;
  }
  if (prev != lru_newest_) return fail_at(prev);
  std::size_t in_use = 0, shared = 0, indexed = 0;
  for (std::uint32_t b = 0; b < blocks_; ++b) {
    if (ref_[b] > 0) {
      if (where[b] != 0) return fail_at(b);
      ++in_use;
      if (ref_[b] > 1) ++shared;
    } else if (where[b] == 0) {
      return fail_at(b);  // refcount 0 but on neither list: leaked
    }
    if (indexed_[b]) ++indexed;
  }
  const std::size_t mask = bucket_.size() - 1;
  std::size_t chained = 0;
  for (std::size_t i = 0; i < bucket_.size(); ++i) {
    for (std::uint32_t b = bucket_[i]; b != no_block; b = bucket_next_[b]) {
      if (!indexed_[b] || (hash_[b] & mask) != i) return fail_at(b);
      ++chained;
    }
  }
  if (chained != indexed || free_.size() != n_free_ || cached != n_cached_ || in_use != n_in_use_ ||
      shared != n_shared_ || n_free_ + n_cached_ + n_in_use_ != blocks_)
    return fail_at(no_block);
  return true;
}

}  // namespace detail

// ---- block_pool<cpu> ---------------------------------------------------------------------------

block_pool<cpu>::block_pool(make_tag, const block_pool_config& cfg, std::byte* storage, std::size_t resident,
                            std::size_t layer_bytes, std::size_t block_stride, std::size_t head_stride,
                            std::uint32_t blocks)
    : cfg_(cfg),
      storage_(storage),
      resident_(resident),
      layer_bytes_(layer_bytes),
      block_stride_(block_stride),
      head_stride_(head_stride),
      ledger_(blocks, cfg.block_tokens, cfg.hash) {}

block_pool<cpu>::~block_pool() { ::operator delete(storage_, std::align_val_t{detail::storage_alignment(resident_)}); }

result<std::shared_ptr<block_pool<cpu>>> block_pool<cpu>::create(const block_pool_config& cfg) {
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
  auto block_stride = checked_mul(*head_stride, 2 * static_cast<std::size_t>(cfg.shape.kv_heads),
                                  "block_pool: block bytes per layer");
  KVCACHE_TRY(block_stride);
  auto block_bytes = checked_mul(*block_stride, cfg.shape.layers, "block_pool: block bytes");
  KVCACHE_TRY(block_bytes);
  if (cfg.budget_bytes < *block_bytes)
    return fail(errc::invalid_argument, "block_pool: budget below one block",
                {{"budget_bytes", static_cast<long long>(cfg.budget_bytes)},
                 {"block_bytes", static_cast<long long>(*block_bytes)}});
  // Block ids are int32 in the CSR export, and 0xffffffff is the ledger's sentinel.
  const std::size_t blocks = std::min<std::size_t>(cfg.budget_bytes / *block_bytes,
                                                   std::numeric_limits<std::int32_t>::max());
  const std::size_t layer_bytes = blocks * *block_stride;  // <= budget: cannot overflow
  const std::size_t bytes = layer_bytes * cfg.shape.layers;
  const std::size_t rounded = (bytes + 63) / 64 * 64;
  detail::storage mem = detail::allocate_storage(rounded);
  if (mem == nullptr)
    return fail(errc::out_of_memory, "block_pool: storage allocation failed",
                {{"bytes", static_cast<long long>(rounded)}});
  std::memset(mem.get(), 0, rounded);  // touch every page: resident bytes are the allocated bytes
  return detail::allocation_guard("block_pool: block tables", [&]() -> result<std::shared_ptr<block_pool>> {
    auto pool = std::make_shared<block_pool>(make_tag{}, cfg, mem.get(), rounded, layer_bytes, *block_stride,
                                             *head_stride, static_cast<std::uint32_t>(blocks));
    (void)mem.release();  // the pool's now: freed by ~block_pool
    return pool;
  });
}

block_pool_stats block_pool<cpu>::stats() const {
  block_pool_stats s = ledger_.stats();
  s.resident_bytes = resident_;
  return s;
}

}  // namespace kvcache
