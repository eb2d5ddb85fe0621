// The protocol code shared by the three cuda caches (host code). Writes: the checks, staging of
// host rows on the device, the layer marked written. The batch: prepare() validates the listed
// sequences and uploads the batch's page tables, write_batch() appends the reserved rows of every
// sequence of the batch for one layer, mark_batch_written() records a write done by the engine's
// own kernel, attend() launches decode attention over the tables. The caches differ in how their
// tables are built, which pages a layer has and how rows are appended; the rest is written here
// once. Checks common to the cpu caches too are in kvcache/detail/protocol_checks.hpp.
//
// These are templates over the cache's impl, which provides: `where` (cuda), `ids`
// (detail::id_table), `seqs[slot]` with `reserved`, `pending`, `written[layer]` and
// `written_count`, `shape()`, `fresh()`, the batch state `batch_slots`, `next_slots`, `mark`,
// `stamp`, `uploader`, `epoch`, `prepared_epoch`, `prepared_rows`, `prepared_longest`, and the
// device arrays `t_indptr`, `t_indices`, `t_last` (the batch's table of the written pages) and
// `t_src` (row offsets of each sequence's reservation in write_batch's K and V); for host writes,
// `staging` (device_buffer).
#pragma once

#include "detail.cuh"

#include <kvcache/attend.hpp>
#include <kvcache/cuda/contiguous_cache.hpp>  // cuda_attend_options
#include <kvcache/cuda/kernels.hpp>
#include <kvcache/detail/id_table.hpp>
#include <kvcache/detail/protocol_checks.hpp>
#include <kvcache/view.hpp>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>

namespace kvcache::detail {

/// Layer `layer` of a sequence's reservation marked written.
template <class Sequence>
void mark_written(Sequence& s, std::uint32_t layer) noexcept {
  if (!s.written[layer]) {
    s.written[layer] = 1;
    ++s.written_count;
  }
}

/// write() and write_device(): the sequence's slot, if the layer exists and it has an open
/// reservation.
template <class Impl>
result<std::uint32_t> write_slot(const Impl& m, seq_id id, std::uint32_t layer) {
  result<std::uint32_t> slot = m.ids.slot(id, "write: unknown sequence");
  KVCACHE_TRY(slot);
  KVCACHE_TRY(check_write_target(m.shape(), id, layer, m.seqs[slot.value()].reserved));
  return slot;
}

/// write() from host rows: checked against the reservation, staged on the device (m.staging,
/// grown as needed), then appended from there by append(slot, layer, k, v, format).
template <class Impl, class T, class Append>
result<void> write_host_rows(Impl& m, seq_id id, std::uint32_t layer, std::span<const T> k, std::span<const T> v,
                             Append append) {
  result<std::uint32_t> slot = m.ids.slot(id, "write: unknown sequence");
  KVCACHE_TRY(slot);
  const auto& s = m.seqs[slot.value()];
  KVCACHE_TRY(check_write(m.shape(), id, layer, s.reserved, s.pending, k.size(), v.size()));
  const std::size_t bytes = k.size() * sizeof(T);
  if (bytes > 0 && m.staging.size() < 2 * bytes) {
    result<device_buffer> grown = device_buffer::make(m.where, 2 * bytes);  // frees the old one after
    KVCACHE_TRY(grown);
    m.staging = std::move(grown).value();
  }
  std::byte* dk = static_cast<std::byte*>(m.staging.data());
  std::byte* dv = dk + bytes;
  KVCACHE_TRY(copy_to_device(m.where, dk, k.data(), bytes));
  KVCACHE_TRY(copy_to_device(m.where, dv, v.data(), bytes));
  return append(slot.value(), layer, dk, dv, sizeof(T) == 4 ? format::f32 : format::f16);
}

/// write_device(): rows already on the device, appended by append(slot, layer, k, v, format)
/// after the checks (a source format the append kernel reads; K and V present when rows are).
template <class Impl, class Append>
result<void> write_device_rows(Impl& m, seq_id id, std::uint32_t layer, const void* k, const void* v, format src,
                               Append append) {
  result<std::uint32_t> slot = write_slot(m, id, layer);
  KVCACHE_TRY(slot);
  if (src != format::f32 && src != format::f16)
    return fail(errc::invalid_argument, "write_device: source format must be f32 or f16", {{"format", static_cast<long long>(src)}});
  if (m.seqs[slot.value()].pending > 0 && (k == nullptr || v == nullptr))
    return fail(errc::invalid_argument, "write_device: null K or V", {{"k_null", k == nullptr}, {"v_null", v == nullptr}});
  return append(slot.value(), layer, static_cast<const std::byte*>(k), static_cast<const std::byte*>(v), src);
}

inline constexpr const char* stale_batch = "no prepared batch since the last change of this cache (call prepare after reserve)";

/// Fails unless a batch was prepared since the cache last changed; `what` names the call.
template <class Impl>
result<void> check_fresh(const Impl& m, const char* what) {
  if (!m.fresh()) return fail_joined(errc::invalid_argument, {what, ": ", stale_batch});
  return {};
}

/// prepare(), first step: the slots of the listed sequences, in order, each listed once, into
/// m.next_slots. The prepared batch is untouched.
template <class Impl>
result<void> select_batch(Impl& m, std::span<const seq_id> batch) {
  if (!try_allocate([&] {
        if (m.mark.size() < m.ids.slots()) m.mark.resize(m.ids.slots(), 0);
        m.next_slots.reserve(batch.size());
      }))
    return fail(errc::out_of_memory, "prepare: batch tables", {{"batch", clamped(batch.size())}});
  ++m.stamp;
  m.next_slots.clear();
  for (const seq_id id : batch) {
    result<std::uint32_t> slot = m.ids.slot(id, "prepare: unknown sequence");
    KVCACHE_TRY(slot);
    if (m.mark[slot.value()] == m.stamp)
      return fail(errc::invalid_argument, "prepare: sequence listed twice", {{"seq", static_cast<long long>(id.value)}});
    m.mark[slot.value()] = m.stamp;
    m.next_slots.push_back(slot.value());
  }
  return {};
}

/// prepare(), last step: uploads the host tables and makes m.next_slots the prepared batch.
/// After a failed upload no batch is prepared (the device tables' contents are unknown).
template <class Impl>
result<void> publish_batch(Impl& m, const pinned_uploader::part* parts, std::size_t n, std::uint32_t rows,
                           std::size_t longest) {
  {
    KVCACHE_CUDA_DEVICE(m.where, "prepare: cudaSetDevice");
    const result<void> up = m.uploader.upload(stream_of(m.where), parts, n);
    if (!up.has_value()) {
      m.prepared_epoch = ~0ull;
      return up;
    }
  }
  std::swap(m.batch_slots, m.next_slots);
  m.prepared_rows = rows;
  m.prepared_longest = longest;
  m.prepared_epoch = m.epoch;
  return {};
}

/// The table of the written pages of the prepared batch, on the device.
template <class Impl>
device_table batch_table(const Impl& m) noexcept {
  return device_table{m.t_indptr, m.t_indices, m.t_last, static_cast<std::uint32_t>(m.batch_slots.size())};
}

/// write_batch(): the reserved rows of every sequence of the batch, for one layer, whose pages
/// are pages_of(layer), then the layer marked written for the sequences with a reservation.
template <class Impl, class PagesOf>
result<void> write_batch_rows(Impl& m, std::uint32_t layer, PagesOf pages_of, const void* k, const void* v, format src) {
  const geometry& g = m.shape();
  if (layer >= g.layers) return fail(errc::layer_out_of_range, "write_batch: layer", {{"layer", layer}, {"layers", g.layers}});
  KVCACHE_TRY(check_fresh(m, "write_batch"));
  if (src != format::f32 && src != format::f16)
    return fail(errc::invalid_argument, "write_batch: source format must be f32 or f16", {{"format", static_cast<long long>(src)}});
  if (m.prepared_rows > 0) {
    if (k == nullptr || v == nullptr)
      return fail(errc::invalid_argument, "write_batch: null K or V", {{"k_null", k == nullptr}, {"v_null", v == nullptr}});
    append_params p;
    p.dst = pages_of(layer);
    p.table = batch_table(m);
    p.k = k;
    p.v = v;
    p.src_format = src;
    p.src_indptr = m.t_src;
    p.max_rows = m.prepared_rows;
    p.kv_heads = g.kv_heads;
    p.head_dim = g.head_dim;
    KVCACHE_TRY(cuda_append(m.where, p));
  }
  for (const std::uint32_t slot : m.batch_slots) {
    auto& s = m.seqs[slot];
    if (s.reserved) mark_written(s, layer);
  }
  return {};
}

/// mark_batch_written(): every layer of every reservation of the batch marked written.
template <class Impl>
result<void> mark_batch_written(Impl& m) {
  KVCACHE_TRY(check_fresh(m, "mark_batch_written"));
  const std::uint32_t layers = m.shape().layers;
  for (const std::uint32_t slot : m.batch_slots) {
    auto& s = m.seqs[slot];
    if (!s.reserved) continue;
    for (std::uint32_t l = 0; l < layers; ++l) s.written[l] = 1;
    s.written_count = layers;
  }
  return {};
}

/// Tokens per split and splits per sequence of an attend() launch.
struct split_plan {
  std::uint32_t tokens;    // split_tokens
  std::uint32_t count;     // max_splits (per segment)
  std::uint32_t prefetch;  // prefetch_steps
  bool bypass_l1;
};

/// Multiprocessors of `device`: asked of the runtime once per device and process (attend()
/// needs it on every call, per layer and step).
inline result<int> multiprocessors(int device) {
  constexpr int kKnown = 64;
  static std::array<std::atomic<int>, kKnown> known{};  // 0: not asked yet
  const bool cached = device >= 0 && device < kKnown;
  if (cached)
    if (const int n = known[static_cast<std::size_t>(device)].load(std::memory_order_relaxed); n > 0) return n;
  int n = 0;
  KVCACHE_CUDA_TRY(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device),
                   "attend: cudaDeviceGetAttribute(multiProcessorCount)");
  if (cached) known[static_cast<std::size_t>(device)].store(n, std::memory_order_relaxed);
  return n;
}

/// attend(), first step: the checks of the call, and the split for `cover` tokens (the longest
/// a sequence of the batch may have).
template <class Impl>
result<split_plan> attend_splits(const Impl& m, std::uint32_t layer, const attention_params& ap,
                                 const cuda_attend_options& opt, std::size_t cover) {
  const geometry& g = m.shape();
  if (layer >= g.layers) return fail(errc::layer_out_of_range, "attend: layer", {{"layer", layer}, {"layers", g.layers}});
  KVCACHE_TRY(check_fresh(m, "attend"));
  if (ap.kv_heads != g.kv_heads || ap.head_dim != g.head_dim)
    return fail(errc::bad_shape, "attend: attention_params do not match the cache geometry",
                {{"kv_heads", ap.kv_heads}, {"cache_kv_heads", g.kv_heads}, {"head_dim", ap.head_dim}, {"cache_head_dim", g.head_dim}});
  if (opt.split_tokens % 32 != 0)
    return fail(errc::invalid_argument, "attend: split_tokens must be 0 (automatic) or a multiple of 32",
                {{"split_tokens", opt.split_tokens}});
  if (opt.prefetch_steps.has_value() && *opt.prefetch_steps > 4)
    return fail(errc::invalid_argument, "attend: prefetch_steps above 4", {{"prefetch_steps", *opt.prefetch_steps}});
  if (cover < m.prepared_longest)
    return fail(errc::invalid_argument, "attend: options.max_tokens below a prepared sequence's length",
                {{"max_tokens", static_cast<long long>(cover)}, {"longest", static_cast<long long>(m.prepared_longest)}});
  const result<int> sms_or = multiprocessors(m.where.device);  // bypass_l1 is always automatic
  KVCACHE_TRY(sms_or);
  const int sms = sms_or.value();
  const std::size_t batch = m.batch_slots.size();
  const std::uint32_t tokens =
      opt.split_tokens != 0 ? opt.split_tokens : cuda_auto_split_tokens(cover, batch, g.kv_heads, ap.q_heads, sms);
  const std::size_t splits = (cover + tokens - 1) / tokens;
  if (splits > 65535)
    return fail(errc::invalid_argument, "attend: too many splits (raise split_tokens)",
                {{"splits", static_cast<long long>(splits)}, {"split_tokens", tokens}});
  const std::size_t blocks = cuda_attend_blocks(batch, g.kv_heads, ap.q_heads, splits);
  const std::uint32_t prefetch =
      opt.prefetch_steps.has_value() ? *opt.prefetch_steps : cuda_auto_prefetch_steps(tokens, blocks, sms);
  return split_plan{tokens, static_cast<std::uint32_t>(splits), prefetch, cuda_auto_bypass_l1(blocks, sms)};
}

/// attend(), last step: p (pages, tables, segments, split_tokens and max_splits set by the cache) completed
/// with the batch, the call's arguments and a workspace grown as needed, then launched.
template <class Impl>
result<void> launch_attend(const Impl& m, attend_params& p, const attention_params& ap, const float* q, float* out,
                           device_buffer& workspace) {
  p.batch = static_cast<std::uint32_t>(m.batch_slots.size());
  p.q_heads = ap.q_heads;
  p.kv_heads = m.shape().kv_heads;
  p.head_dim = m.shape().head_dim;
  p.q = q;
  p.out = out;
  p.scale = ap.scale;
  const std::size_t need = cuda_attend_workspace_bytes(p);
  if (need > 0 && workspace.size() < need) {
    result<device_buffer> grown = device_buffer::make(m.where, need);
    KVCACHE_TRY(grown);
    workspace = std::move(grown).value();
  }
  p.workspace = static_cast<float*>(workspace.data());
  return cuda_attend(m.where, p);
}

}  // namespace kvcache::detail
