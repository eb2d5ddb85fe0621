#pragma once
/// @file attend.hpp
/// Decode attention over layer views of any cache: one query token per sequence, a batch of
/// sequences, grouped-query heads. Chunks of different formats (f32, f16, q4) are combined in one
/// pass with an online softmax; Q4 chunks are read in place (scales folded into the query), never
/// expanded to a float buffer.
///
/// Usage (one layer of one decode step):
///   kvcache::attention_workspace ws;                       // reuse across steps and layers
///   kvcache::attention_params p{.q_heads = 32, .kv_heads = 8, .head_dim = 128, .threads = 2};
///   auto r = kvcache::attend(p, views, q, out, ws);        // views[s] = cache.view(seq_s, layer)

#include <kvcache/error.hpp>
#include <kvcache/kernels.hpp>
#include <kvcache/view.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

namespace kvcache {

/// A caller-supplied parallel-for, to run attention on the engine's own thread pool.
/// `run(pool, count, task, ctx)` must call `task(ctx, i, worker)` exactly once for every i in
/// [0, count), possibly concurrently, and return when all calls have returned. `worker` is the
/// index of the calling thread, < `workers`; two calls that run at the same time must have
/// different worker indices (attend keeps one scratch area per worker index).
struct parallel_for {
  /// One unit of work: index i in [0, count) on worker `worker`.
  using task_fn = void (*)(void* ctx, std::size_t i, unsigned worker);
  /// The pool's entry point; nullptr: attend uses its own threads (attention_params::threads).
  void (*run)(void* pool, std::size_t count, task_fn task, void* ctx) = nullptr;
  void* pool = nullptr;  ///< passed to run unchanged
  unsigned workers = 0;  ///< bound on the worker indices run passes to task (>= 1 when run is set)
};

/// Shape and execution settings of one attend() call.
struct attention_params {
  std::uint32_t q_heads = 0;   ///< query heads per token; a multiple of kv_heads
  std::uint32_t kv_heads = 0;  ///< kv heads of the views; query head j reads kv head j / (q_heads / kv_heads)
  std::uint32_t head_dim = 0;  ///< channels per head, for queries, keys and values alike
  float scale = 0.0f;          ///< multiplies q.k before the softmax; 0 means 1 / sqrt(head_dim)
  unsigned threads = 1;        ///< threads of attend's own pool (the caller included); ignored when pool.run is set
  parallel_for pool{};         ///< the engine's thread pool, if any
  /// Arithmetic over Q4 chunks. int8: the fastest the CPU has (integer key scores and value sums
  /// on x86 with AVX2 or AVX-512 VNNI and on aarch64 with the dot product extension, see
  /// kernels::q4_arith; float elsewhere). float32: float on every CPU,
  /// within float rounding of attention over the dequantized values, at about 1.3x the Q4 cost.
  kernels::q4_arith q4 = kernels::q4_arith::int8;
};

/// Reusable scratch and worker threads of attend(). Grows on first use for a given shape and
/// thread count; later calls with the same or smaller settings allocate nothing. One workspace
/// serves one attend() call at a time. Move-only.
class attention_workspace {
 public:
  attention_workspace() noexcept;
  ~attention_workspace();
  attention_workspace(attention_workspace&&) noexcept;
  attention_workspace& operator=(attention_workspace&&) noexcept;
  attention_workspace(const attention_workspace&) = delete;
  attention_workspace& operator=(const attention_workspace&) = delete;

  /// Allocates scratch (and starts threads) for calls with these params, so that the first
  /// attend() allocates nothing. Errors as attend() for bad params; errc::out_of_memory when
  /// scratch cannot be allocated or a worker thread cannot start (threads started before it keep
  /// running; the workspace serves calls with as many threads as it has, and a later call tries
  /// again).
  [[nodiscard]] result<void> reserve(const attention_params& p);

  /// Bytes of scratch currently allocated: per worker, its heads' states (about 8 KiB a kv head
  /// at 4 queries a kv head and head_dim 128), with a 64 KiB gap between one worker's and the
  /// next's that keeps workers from writing near each other; plus each worker's list of value
  /// segments (4 KiB) and the split sequences' partial results and bounds.
  [[nodiscard]] std::size_t scratch_bytes() const noexcept;

  struct impl;  ///< internal (src/attend.cpp)

 private:
  friend result<void> attend(const attention_params&, std::span<const layer_view>,
                             std::span<const float>, std::span<float>, attention_workspace&);
  std::unique_ptr<impl> impl_;
};

/// Decode attention. For every sequence s (views[s] holds its tokens for one layer) and query
/// head j, with g = q_heads / kv_heads and kv head h = j / g:
///   out[s][j] = sum_t softmax_t(scale * q[s][j] . k_h[t]) * v_h[t]   over all tokens of views[s].
/// // q [sequence][q_head][head_dim] f32, out [sequence][q_head][head_dim] f32
/// A view with no tokens yields a zero output row. One task per sequence (all its kv heads, so
/// each chunk's K and V are read as one stream); with several workers a batch is cut finer, into
/// tasks of about a sequence's share of 4 tasks a worker each (the longest handed out first), so
/// that sequences of unequal lengths share the workers evenly: a long sequence among short ones
/// is cut, the short ones stay whole. Into runs of kv heads where its views keep each kv head
/// apart (contiguous and two-tier caches), else (paged blocks) into token parts of at least 512 tokens
/// merged as below, as many as the workspace holds and so few that the merge reads at most a
/// sixteenth of what a worker reads. With fewer
/// sequences than workers, each sequence's tokens are split into parts of at least 512 tokens
/// (Q4 key groups kept whole; long sequences in parts of decreasing size, the largest handed
/// out first, so that workers of unequal speed end together), each read by one task with all
/// the sequence's kv heads, and their partial softmax results merged on the calling thread;
/// sequences too short for enough parts are split into runs of kv heads as well. Results then
/// differ from a single thread's by float rounding (the sums are ordered differently); for a
/// given thread count (or pool.workers) they are reproducible. Runs of kv heads alone change
/// nothing: each head's sums are the same.
/// Errors (nothing is written to `out`): errc::invalid_argument for a zero dimension, q_heads not
/// a multiple of kv_heads, threads == 0 or a pool with workers == 0, more than 65536 threads (or
/// workers), or q_heads x head_dim above 2^32; errc::bad_shape for q or out
/// of the wrong size, a view whose chunk token counts do not add up, a null chunk pointer, a Q4
/// key chunk of more than 32 tokens, or head strides too small for head_dim (a view of another
/// head_dim); errc::out_of_memory if the workspace cannot grow (scratch, or a worker thread that
/// cannot start).
[[nodiscard]] result<void> attend(const attention_params& p, std::span<const layer_view> views,
                                  std::span<const float> q, std::span<float> out,
                                  attention_workspace& ws);

}  // namespace kvcache
