// Decode attention over layer views: validation, the online softmax over chunks, and the worker
// pool. The inner products run through the active kernels table (kernels.hpp).
#include "attend_internal.hpp"

#include <kvcache/attend.hpp>
#include <kvcache/kernels.hpp>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cassert>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <pthread.h>
#include <type_traits>

namespace kvcache {

namespace detail::attend_generic {
#include "attend_softmax.inl"
}  // namespace detail::attend_generic

namespace {

constexpr float log2e = 1.4426950408889634f;

// Tokens per tile, at most: the row stride of a head's scores (group * tile floats, which stay in
// L1 between the score pass, the softmax step and the value pass). A multiple of the Q4 group
// (32). Each tile costs every head of it an online-softmax step (a pass over its accumulators when
// the maximum grows) and a load and store of its accumulators in the value pass, whatever its
// length, so long tiles pay it less often: on Zen 4, 128-token tiles rather than 32 made a decode
// step 1.06-1.09x faster at 32k tokens with 1 thread (1.00-1.03x with 2, bandwidth-bound). A tile
// length per query group (128 / group) measured within noise and was not kept. Two-tier Q4 groups
// are tiles of their own (attend_q4). A task that reads a view head by head takes head_tile, one
// that reads all heads together (paged blocks) all_heads_tile.
// (measurements: bench/PERFORMANCE.md, "Source notes: attend.cpp", max_tile)
constexpr std::uint32_t max_tile = 256;

// Tokens per tile of a task that reads a view head by head, at most: 256 up to head_dim 128, 128
// above. On the Zen 5 VM (contiguous f16) 256-token tiles measured 1.00-1.09x as fast as 128, but
// 0.98x at head_dim 256, which keeps 128. Over a view of several chunks (paged blocks of 128
// tokens or more, the two-tier tail) no tile spans two chunks (tiling::within_chunks).
// (measurements: bench/PERFORMANCE.md, "Source notes: attend.cpp", head_tile)
std::uint32_t head_tile(std::uint32_t hd) { return std::clamp<std::uint32_t>(32768 / hd / 32 * 32, 128, max_tile); }

// Average tokens per chunk from which a view is read head by head (see run_task).
constexpr std::uint32_t large_chunk_tokens = 128;

std::size_t round_up64(std::size_t floats) { return (floats + 15) / 16 * 16; }

// a / b rounded up (b > 0).
template <class T>
constexpr T ceil_div(T a, T b) {
  return a / b + (a % b != 0 ? 1 : 0);
}

// Floats of one worker's scratch: folded queries and accumulators [group][head_dim], scores
// [group][tile], and running max / sum [group].
std::size_t worker_floats(std::uint32_t group, std::uint32_t head_dim) {
  const std::size_t gd = round_up64(static_cast<std::size_t>(group) * head_dim);
  return 2 * gd + round_up64(static_cast<std::size_t>(group) * max_tile) + 2 * round_up64(group);
}

// Floats left unused after each worker's scratch (64 KiB), so that no two workers write within 64
// KiB of each other: the scratch is written all through a step (scores, accumulators), and workers
// side by side in memory slowed each other (a likely cause, not verified: one core's prefetchers
// pulling in lines the other writes). On the Zen 5 VM with 2 threads the 64 KiB gap made paged steps
// (16-token blocks, 4k tokens) 1.06-1.13x faster in six runs of seven; gaps of 4 to 256 KiB gained
// no more, and the value segments keep none. Cost: 64 KiB of memory a worker past the first.
// (measurements: bench/PERFORMANCE.md, "Source notes: attend.cpp", worker_gap_floats)
constexpr std::size_t worker_gap_floats = 16384;

// Floats from one worker's scratch to the next's, for tasks of `heads` kv heads.
std::size_t worker_stride(std::uint32_t group, std::uint32_t head_dim, std::uint32_t heads) {
  return worker_floats(group, head_dim) * heads + worker_gap_floats;
}

// Most workers (threads, or a pool's workers) and floats of a token's query row (q_heads x
// head_dim) validate_params accepts.
constexpr unsigned max_workers = 65536;
constexpr std::uint64_t max_row_floats = std::uint64_t{1} << 32;

// Workers a call runs on: the pool's when one is given, else its own threads.
unsigned workers_of(const attention_params& p) {
  return p.pool.run != nullptr ? p.pool.workers : p.threads;
}

result<void> validate_params(const attention_params& p) {
  if (p.q_heads == 0 || p.kv_heads == 0 || p.head_dim == 0)
    return fail(errc::invalid_argument, "attend: zero dimension",
                {{"q_heads", p.q_heads}, {"kv_heads", p.kv_heads}, {"head_dim", p.head_dim}});
  if (p.q_heads % p.kv_heads != 0)
    return fail(errc::invalid_argument, "attend: q_heads is not a multiple of kv_heads",
                {{"q_heads", p.q_heads}, {"kv_heads", p.kv_heads}});
  if (p.pool.run != nullptr) {
    if (p.pool.workers == 0)
      return fail(errc::invalid_argument, "attend: parallel_for with zero workers", {{"workers", 0}});
  } else if (p.threads == 0) {
    return fail(errc::invalid_argument, "attend: zero threads", {{"threads", 0}});
  }
  if (!(p.scale >= 0.0f) || std::isinf(p.scale))
    return fail(errc::invalid_argument, "attend: scale must be finite and >= 0 (0: 1/sqrt(head_dim))");
  // Bounds under which every workspace size (reserve) fits in 64 bits, scratch of 2^16 workers
  // and query rows of 2^32 floats included: far past any model or machine, short of a wrap.
  const unsigned workers = workers_of(p);
  if (workers > max_workers)
    return fail(errc::invalid_argument, "attend: more workers than attend supports",
                {{p.pool.run != nullptr ? "workers" : "threads", workers}, {"max", max_workers}});
  if (std::uint64_t{p.q_heads} * p.head_dim > max_row_floats)
    return fail(errc::invalid_argument, "attend: q_heads x head_dim above 2^32",
                {{"q_heads", p.q_heads}, {"head_dim", p.head_dim}});
  return {};
}

// Bytes one kv head of a chunk occupies, for the stride check.
std::size_t key_head_bytes(const chunk& c, std::uint32_t head_dim) {
  if (c.k_format == format::q4) return q4_key_group_bytes(head_dim);
  return dense_element_bytes(c.k_format) * c.tokens * head_dim;
}
std::size_t value_head_bytes(const chunk& c, std::uint32_t head_dim) {
  if (c.v_format == format::q4) return q4_value_group_bytes(head_dim);
  return dense_element_bytes(c.v_format) * c.tokens * head_dim;
}

bool known_format(format f) { return f == format::f32 || f == format::f16 || f == format::q4; }

result<void> validate_view(const layer_view& v, std::size_t s, const attention_params& p) {
  const auto seq = static_cast<long long>(s);
  if (v.count > 0 && v.chunks == nullptr)
    return fail(errc::bad_shape, "attend: view has chunks but a null chunk array", {{"sequence", seq}, {"count", v.count}});
  std::uint64_t total = 0;
  for (std::uint32_t i = 0; i < v.count; ++i) {
    const chunk& c = v.chunks[i];
    total += c.tokens;
    if (c.tokens == 0) continue;
    const auto ci = static_cast<long long>(i);
    if (!known_format(c.k_format) || !known_format(c.v_format))
      return fail(errc::bad_shape, "attend: chunk has an unknown format",
                  {{"sequence", seq}, {"chunk", ci}, {"k_format", static_cast<int>(c.k_format)},
                   {"v_format", static_cast<int>(c.v_format)}});
    if (c.k == nullptr || c.v == nullptr)
      return fail(errc::bad_shape, "attend: chunk with tokens has a null K or V pointer", {{"sequence", seq}, {"chunk", ci}});
    if ((c.k_format == format::q4 || c.v_format == format::q4) && c.tokens > q4_group)
      return fail(errc::bad_shape, "attend: Q4 chunk holds more than one 32-token group",
                  {{"sequence", seq}, {"chunk", ci}, {"tokens", c.tokens}});
    if (p.kv_heads > 1) {
      const std::size_t kb = key_head_bytes(c, p.head_dim), vb = value_head_bytes(c, p.head_dim);
      if (c.k_head_stride < kb || c.v_head_stride < vb)
        return fail(errc::bad_shape, "attend: chunk head stride smaller than one head of head_dim channels",
                    {{"sequence", seq}, {"chunk", ci}, {"head_dim", p.head_dim},
                     {"k_head_stride", static_cast<long long>(c.k_head_stride)}, {"k_head_bytes", static_cast<long long>(kb)},
                     {"v_head_stride", static_cast<long long>(c.v_head_stride)}, {"v_head_bytes", static_cast<long long>(vb)}});
    }
  }
  if (total != v.tokens)
    return fail(errc::bad_shape, "attend: view token count differs from the sum over its chunks",
                {{"sequence", seq}, {"view_tokens", v.tokens}, {"chunk_sum", static_cast<long long>(total)}});
  return {};
}

// A position in a view: token `off` of chunk `ci`. A task reads the tokens of a sequence from one
// cursor up to (not including) another.
struct cursor {
  std::uint32_t ci = 0, off = 0;
};

// One call's shared, read-only state.
struct uniform_tile;

struct call {
  const kernels::table* kt;
  detail::softmax_tile_fn softmax;
  const layer_view* views;
  const float* q;  // [sequence][q_head][head_dim]
  float* out;      // [sequence][q_head][head_dim]
  std::uint32_t kv_heads, head_dim, group, tile;
  std::uint32_t heads_per_task, tasks_per_seq;
  std::uint32_t parts;   // token ranges per sequence (tasks_per_seq = parts * head runs)
  std::uint32_t seqs;    // sequences
  const cursor* bounds;  // [sequence][parts + 1]: where each part starts and ends
  float* partial;        // [sequence][part][kv head][partial_floats], when parts > 1
  float scale_log2;  // scale * log2(e): scores are kept in the base-2 domain
  float* scratch;
  std::size_t worker_stride;  // floats per worker: worker_stride() of heads_per_task heads
  std::size_t head_floats;    // floats of one head's state (worker_floats)
  // accumulate_segments of the table's ISA (attend_avx512 or attend_avx2) where it has one and
  // handles this shape (else null).
  bool (*fused_values)(bool f16, const float* p, std::size_t p_stride, std::uint32_t group,
                       const detail::value_segment* segs, std::uint32_t count, std::uint32_t head_dim, float* acc,
                       kernels::prefetch_region pf);
  detail::value_segment* segments;  // [worker][tile] scratch for it
  uniform_tile* tiles;              // [worker]: run_heads' head-major tiles
  bool last_parts_first;            // a paged batch's parts (split_tasks' target): see run_task
  std::uint32_t run_target;         // a batch read head by head: tokens a task (heads_per_run), or 0
};

// Floats of one head's partial result (parts > 1): running max [group], running sum [group],
// unnormalised accumulators [group][head_dim].
std::size_t partial_floats(std::uint32_t group, std::uint32_t head_dim) {
  return round_up64(2 * static_cast<std::size_t>(group) + static_cast<std::size_t>(group) * head_dim);
}

// One head's state in a worker's scratch: folded queries qf and accumulators acc [group][head_dim],
// scores s [group][tile], running max and sum [group].
struct head_state {
  float *qf, *acc, *s, *run_max, *run_sum;
};

head_state state_of(float* base, std::uint32_t g, std::uint32_t hd, std::uint32_t tile) {
  const std::size_t gd = round_up64(static_cast<std::size_t>(g) * hd);
  head_state st{};
  st.qf = base;
  st.acc = st.qf + gd;
  st.s = st.acc + gd;
  st.run_max = st.s + round_up64(static_cast<std::size_t>(g) * tile);
  st.run_sum = st.run_max + round_up64(g);
  return st;
}

// Small chunks (paged blocks, two-tier store groups across slabs) can lie scattered, where the hardware
// prefetchers lose the stream at every chunk: the chunk some prefetch_tokens ahead is prefetched
// in software (to L2, to L1 on Zen 5: see row_prefetch.inl), at the rate the kernels read: each
// kernel call takes as many lines of the stream as it reads itself, and spreads them over its rows.
// Requests that run ahead of the reads queue the demand loads behind them; requests that fall behind
// leave misses uncovered (in a synthetic read on Zen 4, the exact read rate kept 16-token blocks at
// 0.93-0.98 of a contiguous stream's bandwidth, other rates at 0.6-0.84). Large chunks (a contiguous
// cache) need no such stream: their kernels prefetch the rows that follow their own (next_rows,
// ahead_rows), which the hardware alone does not stream on the Zen 5 VM.
// The distance goes with the tile: the stream runs chunk by chunk, keys then values, where a tile
// reads all its chunks' keys before their values, and too short a distance leaves the tile's later
// keys unfetched while the stream is still on earlier values (128-token tiles over 16-token blocks:
// 64 tokens ahead 1.06-1.08x, 32 ahead 0.76x, against 32-token tiles 32 ahead). Fused Q4 tiles (two
// groups) prefetch the next tile instead (run_heads).
// The stream takes chunks whose heads hold up to prefetch_limit bytes of keys (32 KB rather than 16
// made 64-token f32 blocks 1.14-1.30x faster on the Zen 5 VM). 64 tokens is the distance of tasks
// that read head by head (large paged blocks: one chunk ahead); a task that reads all heads together
// runs its stream half a tile ahead (all_heads_tile) with one kv head, and with two or more
// prefetches a piece ahead instead (piece_ahead, at run_heads).
// (measurements: bench/PERFORMANCE.md, "Source notes: attend.cpp", prefetch_tokens)
constexpr std::uint32_t prefetch_tokens = 64;
constexpr std::size_t prefetch_limit = 32768;  // bytes of one head's keys in a chunk

// Tokens per tile of a task that reads all kv heads of a view's small chunks together (paged blocks
// of 16 to 64 tokens, see head_by_head), a multiple of 32: with the prefetch a piece ahead (two kv
// heads or more: `pieced`), tile x head_dim = 32768 elements (256 tokens up to head_dim 128, 128
// at 256: head_tile's length); with the stream half a tile ahead (one kv head), 8192 (128 tokens
// at head_dim 64, 64 at 128, 32 at 256), as chosen in session 35, where shorter tiles brought
// paged steps nearer contiguous ones with the rows streamed from memory (as an engine streams
// every layer) though they cost more from cache. Pieced, 128-token tiles measured 1.04-1.08x as
// fast as 64 at 32k tokens from memory on the Zen 5 VM (16-token blocks, head_dim 128, session
// 56), where 256 measured 1.03x at 32k but 0.995x at 4k and was not taken; in session 63, with the
// keys of a tile's blocks scored in one call a head (score_head_parts), 256 over 128 measured
// 1.01-1.03x at 4k and 32k, 1 and 2 threads, and the two together 1.02-1.09x (64-token blocks
// 1.03x; head_dim 64 1.07x and 256 1.03-1.05x with 128 over 64).
// (measurements: bench/PERFORMANCE.md, "Source notes: attend.cpp", all_heads_tile, and sessions 63-64)
constexpr std::uint32_t max_stream_tile = 128;  // of a task with one kv head
std::uint32_t all_heads_tile(std::uint32_t hd, bool pieced) {
  return pieced ? std::clamp<std::uint32_t>(32768 / hd / 32 * 32, 32, max_tile)
                : std::clamp<std::uint32_t>(8192 / hd / 32 * 32, 32, max_stream_tile);
}

// Most tokens a chunk (on average over the view) for a task that prefetches a piece ahead to score
// its tiles head after head (head_major, run_heads): each head's keys over the tile's chunks, as
// the value pass reads its values, rather than every head of one chunk after the other. With
// 16-token blocks the score pass had been paged's whole deficit against a contiguous cache: from
// memory (TSC-timed phases, 1 thread, 32k tokens) 7.8-8.0 Mcyc a layer step against 6.7-6.8, its
// value pass and everything from the L3 at parity. Session 61, Zen 5 VM (f16, 8 kv heads x 128, 32
// queries; in-process alternation over the same cache, speed of head after head): 16-token blocks
// 1.06x at 32k with 1 thread, 1.12x with 2, 1.08x at 4k; 32-token blocks 1.02x; 64-token 0.98x,
// which keep the block after block order.
constexpr std::uint32_t head_major_tokens = 32;

// Whether the prefetch stream takes chunk a: it has tokens and its heads are small.
bool prefetchable(const chunk& a, std::uint32_t hd) { return a.tokens > 0 && key_head_bytes(a, hd) <= prefetch_limit; }

// The chunk to prefetch when chunk ci starts, `ahead` tokens on (at least the next chunk), or nullptr;
// none from chunk `end` on (where the task's range ends: what follows is another task's).
const chunk* chunk_ahead(const layer_view& view, std::uint32_t ci, std::uint32_t end, std::uint32_t hd,
                         std::uint32_t ahead) {
  const std::uint32_t d = std::max<std::uint32_t>(1, ahead / std::max<std::uint32_t>(view.chunks[ci].tokens, 1));
  if (ci + d >= end) return nullptr;
  const chunk& a = view.chunks[ci + d];
  return prefetchable(a, hd) ? &a : nullptr;
}

// Whether chunk c is a Q4 group with Q4 values, with tokens.
bool is_q4_group(const chunk& c) { return c.k_format == format::q4 && c.v_format == format::q4 && c.tokens > 0; }

// Whether Q4 group b lies right after group a in memory for kv head h (b's keys start where a's
// values end), as consecutive slots of a two-tier store slab do ({key group, value group} each).
bool follows(const chunk& a, const chunk& b, std::uint32_t h, std::uint32_t hd) {
  return b.k_head(h) == a.v_head(h) + value_head_bytes(a, hd);
}

// Whole Q4 groups handed to one call of table::attend_q4 (run_heads).
constexpr std::uint32_t q4_run = 16;

// Lines of `bytes` bytes.
constexpr std::size_t lines_of(std::size_t bytes) { return (bytes + 63) / 64; }

// The lines of queued chunks' heads [ha, hb) (keys, then values, chunk after chunk), handed out as
// each kernel call reads: take(n) gives the call the next n lines.
class prefetch_stream {
 public:
  // Queues chunk a's heads [ha, hb) after what is queued. Queued chunks are a few (prefetch_tokens
  // ahead of the reads); past `depth` the oldest one's rest is dropped.
  void queue(const chunk& a, std::uint32_t ha, std::uint32_t hb, std::uint32_t hd) {
    if (count_ == depth) pop();
    entry& e = ring_[(first_ + count_++) % depth];
    e = entry{&a, key_head_bytes(a, hd), value_head_bytes(a, hd), ha, hb};
    if (count_ == 1) restart();
  }
  // Whether lines are queued.
  [[nodiscard]] bool active() const { return count_ > 0; }
  // The next `lines` lines, for a kernel that reads as many, as one region it spreads over its rows:
  // contiguous bytes, across consecutive heads (and from keys to values, chunk to chunk) where they
  // are adjacent in memory. What does not fit in one region is owed: added to the next call's share.
  kernels::prefetch_region take(std::size_t lines) {
    if (count_ == 0) return {};
    const std::size_t want = (lines + owed_) * 64;
    const std::byte* begin = at();
    std::size_t got = 0;
    while (count_ > 0 && got < want) {
      if (at() != begin + got) break;  // not adjacent to what is taken
      const std::size_t n = std::min(want - got, bytes() - off_);
      got += n;
      off_ += n;
      if (off_ == bytes()) next_head();
    }
    owed_ = count_ > 0 ? (want - got) / 64 : 0;
    return {begin, got};
  }

 private:
  static constexpr std::uint32_t depth = 8;
  struct entry {
    const chunk* c;
    std::size_t k_bytes, v_bytes;
    std::uint32_t ha, hb;
  };
  const entry& front() const { return ring_[first_]; }
  const std::byte* at() const {
    const entry& e = front();
    return (values_ ? e.c->v_head(h_) : e.c->k_head(h_)) + off_;
  }
  std::size_t bytes() const { return values_ ? front().v_bytes : front().k_bytes; }
  void restart() {
    h_ = front().ha;
    values_ = false;
    off_ = 0;
  }
  void pop() {
    first_ = (first_ + 1) % depth;
    if (--count_ > 0) restart();
  }
  void next_head() {
    off_ = 0;
    if (++h_ < front().hb) return;
    h_ = front().ha;
    if (values_) {
      pop();
      return;
    }
    values_ = true;
  }

  entry ring_[depth]{};
  std::uint32_t first_ = 0, count_ = 0, h_ = 0;
  bool values_ = false;
  std::size_t off_ = 0, owed_ = 0;
};

// The rows of a dense head's stream (row bytes `row`, `tokens` rows at `base`) that follow rows
// [off, off + n): the next n of them, as far as the chunk has them. A kernel prefetches them while it
// works on [off, off + n), so the next call finds them in cache (head by head over a contiguous
// cache, where each call is one tile of a long stream; empty for a paged block read whole).
kernels::prefetch_region next_rows(const std::byte* base, std::size_t row, std::uint32_t tokens, std::uint32_t off,
                                   std::uint32_t n) {
  const std::uint32_t from = off + n;
  const std::uint32_t count = from < tokens ? std::min(n, tokens - from) : 0;
  return {base + static_cast<std::size_t>(from) * row, static_cast<std::size_t>(count) * row};
}

// No head: a task's last head has no successor to prefetch.
constexpr std::uint32_t no_head = ~0u;

// What a kernel reading rows of one chunk finds after them: the chunk's rows up to `until` (where
// the task's range ends in it), then the first rows of chunk `next` (null: none), head `head`, from
// token `from`.
struct onward {
  std::uint32_t until = 0;
  const chunk* next = nullptr;
  std::uint32_t head = 0, from = 0;
};

// The tokens one run_heads call reads of a view: from cursor b up to (not including) cursor e,
// chunks [b.ci, end). next_head: the kv head the task reads next over the same tokens (head by
// head), or no_head.
struct task_range {
  const layer_view* view;
  cursor b, e;
  std::uint32_t end;
  std::uint32_t next_head;

  task_range(const layer_view& v, cursor from, cursor to, std::uint32_t next)
      : view(&v), b(from), e(to), end(to.off > 0 ? to.ci + 1 : to.ci), next_head(next) {}
  // Tokens of chunk ci in the range (from 0: where b.off lies is the caller's business).
  [[nodiscard]] std::uint32_t tokens_of(std::uint32_t ci) const { return ci == e.ci ? e.off : view->chunks[ci].tokens; }
  // What follows chunk ci for head h: the next chunk of the range with tokens (head h, from 0); at
  // the range's end, its first rows for next_head, which this task reads next (a part of a split
  // sequence ends inside a chunk: the rows after it are another task's, and the next head's first
  // tile would start cold).
  [[nodiscard]] onward after(std::uint32_t ci, std::uint32_t h) const {
    for (std::uint32_t j = ci + 1; j < end; ++j)
      if (tokens_of(j) > 0) return {tokens_of(ci), &view->chunks[j], h, 0};
    if (next_head == no_head) return {tokens_of(ci), nullptr, 0, 0};
    for (std::uint32_t j = b.ci, from = b.off; j < end; ++j, from = 0)
      if (tokens_of(j) > from) return {tokens_of(ci), &view->chunks[j], next_head, from};
    return {tokens_of(ci), nullptr, 0, 0};
  }
};

// The rows of head h (keys, or values) a kernel prefetches while it works on rows [off, off + n) of
// chunk ch: the chunk's next n rows as far as the range goes (o.until), or at its end the first n
// rows that follow (o.next) where those are dense. A large chunk's successor (a big paged block,
// the two-tier tail) starts where the hardware prefetchers have not been.
kernels::prefetch_region ahead_rows(const chunk& ch, const onward& o, bool values, std::uint32_t h, std::uint32_t hd,
                                    std::uint32_t off, std::uint32_t n) {
  const format f = values ? ch.v_format : ch.k_format;
  const std::size_t row = hd * dense_element_bytes(f);
  const kernels::prefetch_region r = next_rows(values ? ch.v_head(h) : ch.k_head(h), row, o.until, off, n);
  if (r.bytes != 0 || off + n < o.until || o.next == nullptr) return r;
  const chunk& fol = *o.next;
  const format ff = values ? fol.v_format : fol.k_format;
  if (ff == format::q4) return {};
  const std::size_t frow = hd * dense_element_bytes(ff);
  return {(values ? fol.v_head(o.head) : fol.k_head(o.head)) + o.from * frow, std::min(n, fol.tokens - o.from) * frow};
}

// Scores of tokens [off, off + n) of dense chunk ch, kv head h, into s (row stride tile), the
// kernel prefetching `next` while it runs.
void score_part(const call& c, const chunk& ch, std::uint32_t h, std::uint32_t off, std::uint32_t n, const float* qf,
                float* s, kernels::prefetch_region next) {
  const std::size_t first = static_cast<std::size_t>(off) * c.head_dim;
  if (ch.k_format == format::f16)
    c.kt->scores_f16(qf, c.group, reinterpret_cast<const half*>(ch.k_head(h)) + first, n, c.head_dim, s, c.tile, next);
  else
    c.kt->scores_f32(qf, c.group, reinterpret_cast<const float*>(ch.k_head(h)) + first, n, c.head_dim, s, c.tile, next);
}

// Scores of tokens [off, off + n) of chunk ci of the range, kv head h, into s (row stride tile). A
// dense kernel prefetches the share of the stream pf while it runs, or else the rows that follow
// in the range (ahead_rows, range.after).
void score_chunk(const call& c, const task_range& range, std::uint32_t ci, std::uint32_t h, std::uint32_t off,
                 std::uint32_t n, const float* qf, float* s, prefetch_stream& pf) {
  const chunk& ch = range.view->chunks[ci];
  const kernels::table& kt = *c.kt;
  const std::uint32_t g = c.group, hd = c.head_dim;
  const std::byte* kb = ch.k_head(h);
  if (ch.k_format == format::q4) {  // validated: the whole chunk is one group; off == 0
    kt.scores_q4(qf, g, reinterpret_cast<const std::uint8_t*>(kb), n, hd, s, c.tile,
                 pf.take(lines_of(key_head_bytes(ch, hd))));
    return;
  }
  // While the stream runs (small chunks) it has prefetched this chunk's rows already: the kernel
  // spreads the stream's share over its rows rather than taking the chunk's next rows.
  score_part(c, ch, h, off, n, qf, s,
             pf.active() ? pf.take(lines_of(n * hd * dense_element_bytes(ch.k_format)))
                         : ahead_rows(ch, range.after(ci, h), false, h, hd, off, n));
}

// Whether kv heads [ha, hb) of chunk ch are scored in one kernel call (score_heads): dense keys
// whose head stride is a whole number of elements, two heads or more, and the table has such a
// kernel.
bool heads_in_one_call(const call& c, const chunk& ch, std::uint32_t ha, std::uint32_t hb) {
  const kernels::table& kt = *c.kt;
  if (hb - ha < 2) return false;
  const bool f16 = ch.k_format == format::f16;
  if (!(f16 ? kt.scores_f16_heads != nullptr : ch.k_format == format::f32 && kt.scores_f32_heads != nullptr)) return false;
  return ch.k_head_stride % dense_element_bytes(ch.k_format) == 0;
}

// Lines of the keys of n tokens of kv heads [ha, hb) of dense chunk ch.
std::size_t key_lines(const call& c, const chunk& ch, std::uint32_t ha, std::uint32_t hb, std::uint32_t n) {
  return lines_of(static_cast<std::size_t>(hb - ha) * n * c.head_dim * dense_element_bytes(ch.k_format));
}

// score_chunk for kv heads [ha, hb) of a dense chunk in one kernel call (a paged block read all
// heads together, whose heads' states lie head_floats apart), where heads_in_one_call: one call per
// block rather than one per head, whose set-up cost as much as a fifth of a 16-token call (median
// about 1.03x faster on Zen 5, paged f16, 16-token blocks). The kernel prefetches region `next`
// while it runs.
// (measurements: bench/PERFORMANCE.md, "Source notes: attend.cpp", score_heads)
void score_heads(const call& c, const chunk& ch, std::uint32_t ha, std::uint32_t hb, std::uint32_t off, std::uint32_t n,
                 const float* qf, float* s, kernels::prefetch_region next) {
  const kernels::table& kt = *c.kt;
  const std::size_t elem = dense_element_bytes(ch.k_format);
  const std::uint32_t hd = c.head_dim;
  const std::size_t first = static_cast<std::size_t>(off) * hd, stride = ch.k_head_stride / elem;
  if (ch.k_format == format::f16)
    kt.scores_f16_heads(qf, c.head_floats, c.group, reinterpret_cast<const half*>(ch.k_head(ha)) + first, stride, hb - ha,
                        n, hd, s, c.head_floats, c.tile, next);
  else
    kt.scores_f32_heads(qf, c.head_floats, c.group, reinterpret_cast<const float*>(ch.k_head(ha)) + first, stride,
                        hb - ha, n, hd, s, c.head_floats, c.tile, next);
}

// The part [from, to) of `total` (to <= total, total >= 1) of region r, as even as bytes go.
kernels::prefetch_region piece(kernels::prefetch_region r, std::uint32_t from, std::uint32_t to, std::uint32_t total) {
  const std::size_t a = r.bytes * from / total, b = r.bytes * to / total;
  return {static_cast<const std::byte*>(r.p) + a, b - a};
}

// The key rows of kv heads [ha, hb) (hb > ha) of chunk ch as one region: from head ha's first row
// to the end of head hb - 1's (with the unused rows between the heads of a partly filled block).
kernels::prefetch_region key_rows(const chunk& ch, std::uint32_t ha, std::uint32_t hb, std::uint32_t hd) {
  return {ch.k_head(ha), (hb - ha - 1) * ch.k_head_stride + key_head_bytes(ch, hd)};
}

// The chunks of a tile read all heads together (run_heads), each with the tokens [off, off + n)
// the tile takes from it: where its prefetch pieces come from.
struct tile_part {
  std::uint32_t ci, off, n;
  // Dense keys scored after the tile is gathered, head after head (head_major). No default member
  // initializer: run_heads sets it with the rest ({ci, off, n, false}), and its array of max_tile
  // parts stays uninitialized (a default initializer cleared all 256 flags every call).
  bool later;
};

// pieces[0, m) (m >= 1) as one region: pieces[0] with the others as its `more`.
kernels::prefetch_region pieces_region(const kernels::prefetch_region* pieces, std::uint32_t m) {
  return {pieces[0].p, pieces[0].bytes, pieces + 1, m - 1};
}

// The value rows of kv heads [h0, h1) (h1 > h0) over a tile's parts[0, count) (count >= 1), head
// after head, one piece a part (an empty one for a Q4 part), into pieces[0, max_tile): as one
// region, pieces[0] with the others as its `more` (the first max_tile pieces).
kernels::prefetch_region head_values(const layer_view& view, const tile_part* parts, std::uint32_t count,
                                     std::uint32_t h0, std::uint32_t h1, std::uint32_t hd,
                                     kernels::prefetch_region* pieces) {
  std::uint32_t m = 0;
  for (std::uint32_t h = h0; h < h1; ++h)
    for (std::uint32_t j = 0; j < count && m < max_tile; ++j) {
      const chunk& ch = view.chunks[parts[j].ci];
      const std::size_t row = ch.v_format == format::q4 ? 0 : hd * dense_element_bytes(ch.v_format);
      pieces[m++] = {ch.v_head(h) + parts[j].off * row, parts[j].n * row};
    }
  return pieces_region(pieces, m);
}

// The heads whose values over a tile of `filled` tokens are about as many bytes as the keys of
// `heads` heads of n tokens of chunk ch (the tile's last score call reads those): 1 to heads.
std::uint32_t lead_heads(const chunk& ch, std::uint32_t n, std::uint32_t heads, std::uint32_t filled) {
  const std::size_t read = static_cast<std::size_t>(n) * heads * dense_element_bytes(ch.k_format),
                    head = static_cast<std::size_t>(filled) * (ch.v_format == format::q4 ? 1 : dense_element_bytes(ch.v_format));
  return std::clamp<std::uint32_t>(static_cast<std::uint32_t>((read + head / 2) / head), 1, heads);
}

// Piece j of region r (0: its first; j >= 1: more[j - 1]).
kernels::prefetch_region nth_piece(const kernels::prefetch_region& r, std::uint32_t j) {
  return j == 0 ? kernels::prefetch_region{r.p, r.bytes} : r.more[j - 1];
}

// The key rows of kv head h over a tile's parts[0, count), one piece a part (an empty one for a
// part not scored head after head), into pieces[0, max_tile): as one region, pieces[0] with the
// others as its `more`.
kernels::prefetch_region head_keys(const layer_view& view, const tile_part* parts, std::uint32_t count,
                                   std::uint32_t h, std::uint32_t hd, kernels::prefetch_region* pieces) {
  for (std::uint32_t j = 0; j < count; ++j) {
    const chunk& ch = view.chunks[parts[j].ci];
    const std::size_t row = parts[j].later ? hd * dense_element_bytes(ch.k_format) : 0;
    pieces[j] = {ch.k_head(h) + parts[j].off * row, parts[j].n * row};
  }
  return pieces_region(pieces, count);
}

// The scores of kv head h over a tile's parts[0, count) scored head after head (`later`; the others
// are left alone), into s (part j's tokens from its offset in the tile on), the kernel calls
// prefetching region `next` (a piece a part, head_keys or head_values): one call over all the
// parts (table::scores_f16_segments, scores_f32_segments) where every part is such and all hold
// one key format, else one call a part, each its piece. One call rather than one per 16-token
// block: with 256-token tiles 1.00-1.03x, and with them 1.02-1.09x with 1 thread (Zen 5 VM, f16,
// 32k and 4k tokens; 32-token blocks 1.11x).
// (measurements: bench/PERFORMANCE.md, sessions 63-64)
void score_head_parts(const call& c, const layer_view& view, const tile_part* parts, std::uint32_t count,
                      std::uint32_t h, const float* qf, float* s, const kernels::prefetch_region& next) {
  const format f = view.chunks[parts[0].ci].k_format;
  const auto segments = f == format::f16   ? c.kt->scores_f16_segments
                        : f == format::f32 ? c.kt->scores_f32_segments
                                           : nullptr;
  bool one = segments != nullptr;
  for (std::uint32_t j = 0; j < count && one; ++j) one = parts[j].later && view.chunks[parts[j].ci].k_format == f;
  if (one) {
    kernels::key_segment segs[max_tile];
    const std::size_t row = c.head_dim * dense_element_bytes(f);
    for (std::uint32_t j = 0, done = 0; j < count; done += parts[j].n, ++j)
      segs[j] = {view.chunks[parts[j].ci].k_head(h) + parts[j].off * row, parts[j].n, done};
    segments(qf, c.group, segs, count, c.head_dim, s, c.tile, next);
    return;
  }
  for (std::uint32_t j = 0, done = 0; j < count; done += parts[j].n, ++j)
    if (parts[j].later) score_part(c, view.chunks[parts[j].ci], h, parts[j].off, parts[j].n, qf, s + done, nth_piece(next, j));
}

// A head-major tile (run_heads) whose parts are all dense keys scored head after head, of one
// key format, one dense value format and one pair of head strides (a paged cache's blocks): its
// key and value rows of kv head ha, as score and value segments and as prefetch pieces, gathered
// once a tile. Every other head's lie at a fixed offset from them (rows_of), so that a head's
// calls take its arrays from a copy that adds the offset, where they used to be worked out from
// the chunks head after head: four times over the parts a head (score_head_parts, head_keys,
// head_values, accumulate_tile). In-process alternation on the Zen 5 VM (paged f16, 16-token
// blocks, 8 kv heads x 128, 32 queries): 1.01-1.05x at 4k and 32k tokens, 1 and 2 threads, against
// the arrays worked out head by head (8 queries 1.05-1.06x, 64 queries 1.01x).
// (measurements: bench/PERFORMANCE.md, session 70)
// One a worker, in the workspace (call::tiles; 28 KB, more than a thread's stack should hold).
// The arrays are left uninitialized (the anonymous unions; uniform_rows sets what a tile uses).
struct uniform_tile {
  format kf, vf;
  std::size_t k_stride, v_stride;  // bytes between heads
  union {
    kernels::key_segment keys[max_tile];
  };
  union {
    kernels::prefetch_region key_pieces[max_tile];
  };
  union {
    detail::value_segment values[max_tile];
  };
  union {
    kernels::prefetch_region value_pieces[max_tile];
  };
  union {
    kernels::key_segment shifted_keys[max_tile];  // another head's keys (rows_of)
  };
  uniform_tile() {}  // NOLINT: leaves the arrays uninitialized
};

// Whether the tile's parts[0, count) (count >= 1) are such a tile; if so, sets u up for head ha.
bool uniform_rows(const layer_view& view, const tile_part* parts, std::uint32_t count, std::uint32_t ha,
                  std::uint32_t hd, uniform_tile& u) {
  const chunk& c0 = view.chunks[parts[0].ci];
  if (c0.k_format == format::q4 || c0.v_format == format::q4) return false;
  u.kf = c0.k_format;
  u.vf = c0.v_format;
  u.k_stride = c0.k_head_stride;
  u.v_stride = c0.v_head_stride;
  const std::size_t krow = hd * dense_element_bytes(u.kf), vrow = hd * dense_element_bytes(u.vf);
  for (std::uint32_t j = 0, done = 0; j < count; done += parts[j].n, ++j) {
    const chunk& ch = view.chunks[parts[j].ci];
    if (!parts[j].later || ch.k_format != u.kf || ch.v_format != u.vf || ch.k_head_stride != u.k_stride ||
        ch.v_head_stride != u.v_stride)
      return false;
    const std::byte* k = ch.k_head(ha) + parts[j].off * krow;
    const std::byte* v = ch.v_head(ha) + parts[j].off * vrow;
    u.keys[j] = {k, parts[j].n, done};
    u.key_pieces[j] = {k, parts[j].n * krow};
    u.values[j] = {v, parts[j].n, done};
    u.value_pieces[j] = {v, parts[j].n * vrow};
  }
  return true;
}

// from[0, count) with every pointer `shift` bytes on, into to (or from itself where shift is 0).
template <class T>
const T* rows_of(const T* from, std::uint32_t count, std::size_t shift, T* to) {
  if (shift == 0) return from;
  for (std::uint32_t j = 0; j < count; ++j) {
    to[j] = from[j];
    if constexpr (std::is_same_v<T, kernels::prefetch_region>) to[j].p = static_cast<const std::byte*>(from[j].p) + shift;
    else if constexpr (std::is_same_v<T, kernels::key_segment>) to[j].k = static_cast<const std::byte*>(from[j].k) + shift;
    else to[j].v = static_cast<const std::byte*>(from[j].v) + shift;
  }
  return to;
}

// acc += weights s times the values of the tile's `filled` tokens, which start at token `off` of
// chunk ci, kv head h. With fused_values and one dense value format over the tile, the sum over
// all the tile's chunks is one call that keeps its accumulators in registers. Where `then` is set
// (a task that prefetches the piece ahead, run_heads), the kernel calls prefetch it: a region of
// pieces (more_count > 0), one for each chunk of the tile, each call its chunk's; or one region,
// each call the part its tokens are of the tile's. Else while the prefetch stream pf runs (small
// chunks, whose rows it has prefetched), each kernel call takes as many of its lines as the call
// reads; otherwise a dense kernel prefetches its next rows (ahead_rows).
void accumulate_tile(const call& c, const task_range& range, std::uint32_t h, std::uint32_t ci, std::uint32_t off,
                     std::uint32_t filled, const float* s, float* acc, unsigned worker, prefetch_stream& pf,
                     const kernels::prefetch_region* then) {
  const layer_view& view = *range.view;
  const std::uint32_t g = c.group, hd = c.head_dim, tile = c.tile;
  // Lines of the values of n tokens of chunk ch.
  auto lines_read = [hd](const chunk& ch, std::uint32_t n) {
    return ch.v_format == format::q4 ? lines_of(value_head_bytes(ch, hd) * n / ch.tokens)
                                     : lines_of(static_cast<std::size_t>(n) * hd * dense_element_bytes(ch.v_format));
  };
  if (c.fused_values != nullptr) {
    const format vf = view.chunks[ci].v_format;  // chunk ci has tokens: filled > 0
    bool fused = vf != format::q4;
    detail::value_segment* segs = c.segments + static_cast<std::size_t>(worker) * tile;
    const std::size_t elem = dense_element_bytes(vf);
    std::uint32_t count = 0, done = 0;
    std::size_t lines = 0;
    std::uint32_t last = ci, last_off = off, last_n = 0;  // the tile's last segment
    for (std::uint32_t cj = ci, o = off; fused && done < filled; ++cj, o = 0) {
      const chunk& ch = view.chunks[cj];
      if (ch.tokens == 0) continue;
      const std::uint32_t n = std::min(filled - done, ch.tokens - o);
      fused = ch.v_format == vf;
      segs[count++] = detail::value_segment{ch.v_head(h) + static_cast<std::size_t>(o) * hd * elem, n, done};
      last = cj;
      last_off = o;
      last_n = n;
      lines += lines_read(ch, n);
      done += n;
    }
    // What the next call reads, the stream's share, or the rows after the tile's last segment.
    if (fused && c.fused_values(vf == format::f16, s, tile, g, segs, count, hd, acc,
                                then != nullptr ? *then
                                : pf.active()    ? pf.take(lines)
                                                 : ahead_rows(view.chunks[last], range.after(last, h), true, h, hd,
                                                              last_off, last_n)))
      return;
  }
  const kernels::table& kt = *c.kt;
  std::uint32_t done = 0;
  for (std::uint32_t cj = ci, o = off, j = 0; done < filled; ++cj, o = 0) {
    const chunk& ch = view.chunks[cj];
    if (ch.tokens == 0) continue;
    const std::uint32_t n = std::min(filled - done, ch.tokens - o);
    const std::byte* vb = ch.v_head(h);
    const float* p = s + done;
    const kernels::prefetch_region ahead = then != nullptr ? (then->more_count > 0 ? nth_piece(*then, j++)
                                                                                  : piece(*then, done, done + n, filled))
                                           : pf.active()    ? pf.take(lines_read(ch, n))
                                           : ch.v_format == format::q4
                                               ? kernels::prefetch_region{}
                                               : ahead_rows(ch, range.after(cj, h), true, h, hd, o, n);
    switch (ch.v_format) {
      case format::f16:
        kt.accumulate_f16(p, tile, g, reinterpret_cast<const half*>(vb) + static_cast<std::size_t>(o) * hd, n, hd, acc,
                          ahead);
        break;
      case format::f32:
        kt.accumulate_f32(p, tile, g, reinterpret_cast<const float*>(vb) + static_cast<std::size_t>(o) * hd, n, hd, acc,
                          ahead);
        break;
      case format::q4:
        kt.accumulate_q4(p, tile, g, reinterpret_cast<const std::uint8_t*>(vb), o, n, hd, acc, ahead);
        break;
    }
    done += n;
  }
}

// out[i][d] = acc[i][d] / sum[i] for g rows of hd (0 where sum[i] is 0). The rows are the
// worker's scratch and the caller's output, which never overlap: __restrict lets the compiler
// vectorize the loop, which it kept scalar for fear of out aliasing acc or sum.
void normalise(const float* __restrict acc, const float* __restrict sum, std::uint32_t g, std::uint32_t hd,
               float* __restrict out) {
  for (std::uint32_t i = 0; i < g; ++i) {
    const float inv = sum[i] > 0.0f ? 1.0f / sum[i] : 0.0f;
    for (std::uint32_t d = 0; d < hd; ++d) out[i * hd + d] = acc[i * hd + d] * inv;
  }
}

// Heads [ha, hb) of one sequence in one pass over its view. A tile of up to `tile` tokens
// (gathered over as many chunks as it takes) is scored for every head of the range, each head's
// online-softmax step taken, and its values summed while the tile's keys and values are still in
// cache. One head at a time reads a contiguous cache's K and V as two sequential streams; all
// heads of a task together read a tile of paged blocks (every head side by side in a block: small
// blocks head after head over the tile, larger ones block after block, head_major_tokens), and a
// two-tier store slab by slab (a slab's rows of a layer, head after head: store_end).
// Where the kernel table has a fused Q4 step (table::attend_q4), a Q4 group with Q4 values is a
// tile of its own: one call per head does its scores, softmax step and values.
// The tokens read are those from cursor b up to cursor e; the result goes to the output rows, or
// where `partial` is set (a part of a split sequence), unnormalised to partial[h - ha] for merge().
// next_head: the head the task reads next over the same tokens (its first rows are prefetched at
// the end of this one's), or no_head. limit: tokens per tile; ahead: tokens the prefetch stream
// runs ahead of the reads (chunk_ahead), or piece_ahead (below).
// ends: whether the call sets the heads' states up (start) and writes their results (finish); a
// task that reads its range in several calls (run_task: a two-tier store, then its tail) keeps
// the states in the worker's scratch between them, head h at base + (h - ha) * head_floats.
struct pass_ends {
  bool start = true, finish = true;
};
// A task's tiles: at most `limit` tokens each; within_chunks: none spans two chunks, so a chunk's
// tiles start at its first token. A task that reads a view of several chunks head by head
// (run_task) tiles so where its chunks average min_chunk_tile tokens or more: each kernel call
// prefetches the rows that follow its own, as many (ahead_rows), which at a chunk's end are the
// next chunk's first rows, and those are then the whole next tile. Shorter chunks (a view an
// engine builds of its own short runs, heads apart) go in tiles of min_chunk_tile tokens across
// them, as before: a tile a chunk would pay a tile's fixed costs every few tokens. Before session
// 72, tiles of half a chunk (the average chunk's, at least 32 tokens) served the same end, at
// twice the tiles a chunk and half the prefetch distance; tiles that spanned chunks (a split
// sequence's part starting inside one) prefetched only part of the next tile. Zen 4 VM (f16, 8 kv
// heads x 128, 32 queries; in-process alternation against the old tiles): 256-token blocks
// 1.09-1.10x at 32k with 1 thread (1.02-1.05x with 2), 1.08x at 4k; 128-token blocks 1.03-1.04x
// at 32k, 1.04-1.07x at 4k; 512-token blocks, the two-tier cache (its tail now one tile a head)
// and 16- and 64-token blocks (read all heads together: untouched) 0.99-1.01x.
// (measurements: bench/PERFORMANCE.md, "Source notes: attend.cpp", tiling)
struct tiling {
  std::uint32_t limit;
  bool within_chunks = false;
};
constexpr std::uint32_t min_chunk_tile = 32;

// The tiles of a task that reads `view` head by head (see tiling).
tiling head_tiles(const layer_view& view, std::uint32_t hd) {
  if (view.count > 1 && view.tokens / view.count < min_chunk_tile) return {min_chunk_tile};
  return {head_tile(hd), view.count > 1};
}
// Prefetch a piece ahead (`ahead` == piece_ahead): run_task's tasks that read paged blocks all
// heads together. Each kernel call prefetches, spread over its rows, the rows the task reads next,
// in the order it reads them, as many bytes as the call reads (so every line goes out about one
// score call, a block's keys, before it is read): a block's score call (all heads) the next
// block's keys; the tile's last one the values of the first `lead` heads over all the tile's
// blocks (a region of pieces, kernels::prefetch_region::more; lead = that call's key bytes over
// one head's values in the tile: 2 of 8 heads with 64-token blocks and 256-token tiles, 4 with
// 128-token tiles); the value call of head h head h + lead's values; the last lead value calls
// the next tile's first block's keys, a part each. (With one block a tile this is session 47's
// prefetch by phase: a block's keys prefetch all its values, the value pass the next keys.)
// Blocks of up to head_major_tokens (16 and 32 tokens) are scored head after head instead, once
// the tile is gathered: the calls of head h (one a block) prefetch the same blocks' keys of head
// h + 1, the last head's calls the first head's values (lead 1), the value call of head h head
// h + 1's values, and the last value call the first head's keys over the next tile's blocks.
// Against prefetch by phase, a piece ahead measured 1.09-1.16x faster with 16-token blocks on the
// Intel VM (f16, 32k tokens, 1 thread); prefetching farther ahead was slower.
// (measurements: bench/PERFORMANCE.md, "Source notes: attend.cpp", piece_ahead)
constexpr std::uint32_t piece_ahead = 0;
void run_heads(const call& c, std::size_t seq, std::uint32_t ha, std::uint32_t hb, float* base, unsigned worker,
               cursor b, cursor e, float* partial, tiling tiles, std::uint32_t next_head, std::uint32_t ahead,
               pass_ends ends = {}) {
  const std::uint32_t g = c.group, hd = c.head_dim, tile = c.tile, limit = tiles.limit;
  const std::size_t gd = static_cast<std::size_t>(g) * hd;
  const layer_view& view = c.views[seq];
  const task_range range(view, b, e, next_head);
  const std::uint32_t end = range.end;  // chunks [b.ci, end) hold the range
  const bool pieced = ahead == piece_ahead;
  const bool head_major = pieced && view.tokens <= std::uint64_t{view.count} * head_major_tokens;
  auto st = [&](std::uint32_t h) { return state_of(base + (h - ha) * c.head_floats, g, hd, tile); };

  for (std::uint32_t h = ha; h < hb && ends.start; ++h) {
    const head_state hs = st(h);
    const float* qh = c.q + (seq * c.kv_heads + h) * gd;
    for (std::size_t i = 0; i < gd; ++i) {
      hs.qf[i] = qh[i] * c.scale_log2;
      hs.acc[i] = 0.0f;
    }
    for (std::uint32_t i = 0; i < g; ++i) {
      hs.run_max[i] = -std::numeric_limits<float>::infinity();
      hs.run_sum[i] = 0.0f;
    }
  }

  prefetch_stream pf;
  tile_part parts[max_tile];                 // the tile's chunks with tokens
  kernels::prefetch_region pieces[max_tile];  // a region of pieces (head_values, head_keys)
  kernels::prefetch_region next_pieces[max_tile];  // head_major: the next tile's first head's keys
  uniform_tile& ut = c.tiles[worker];              // head_major: a uniform tile's rows (uniform_rows)
  // Cursor: chunk ci, token offset off.
  std::uint32_t ci = b.ci, off = b.off;
  while (ci < end) {
    std::uint32_t filled = 0, parts_in = 0;  // tokens and parts[0, parts_in) of the tile
    std::uint32_t lead = 1;                  // heads whose values the tile's last score call prefetches
    bool uniform = false;                    // head_major over a uniform_tile (ut)
    for (; ci < end && filled < limit; ++ci, off = 0) {
      const chunk& ch = view.chunks[ci];
      const std::uint32_t ch_tokens = range.tokens_of(ci);  // Q4 key chunks are never split: ch.tokens
      if (off >= ch_tokens) continue;                  // empty (or an empty part)
      if (filled == 0 && c.kt->attend_q4 != nullptr && is_q4_group(ch)) {
        // A run of up to q4_run whole Q4 groups, keys and values, in one call per head (validated:
        // off == 0); the kernel takes them two at a time as one tile (a last odd one alone):
        // scores, softmax step and values of all the head's queries over both groups. The step
        // prefetches the group read two groups later as it reads its own, line for line
        // (q4_group_ref::ahead_k, ahead_v; why, and what it measured: q4_int8_avx512.inl).
        // Runs of 16 groups a call rather than one tile a call save the per-call overhead of
        // run_heads and the table entry: 1.02-1.09x faster on Zen 5 (two-tier, 32k tokens); runs
        // of 8 measured within noise of 16.
        // A run is q4_run groups, and with several heads (a two-tier store, run_task) as many
        // more as lie one after the other in memory (follows), head after head: every head's
        // groups of one slab in turn (slabs of q4_run groups or more), which reads the slab's rows
        // of this layer as one stream. The kernel gets them q4_run at a time and pairs them into
        // tiles; a run of several heads holds an even number of groups (but at the range's end),
        // so that the pairs, and with them every head's sums, are those of the head read alone.
        // (measurements: bench/PERFORMANCE.md, "Source notes: attend.cpp", run_heads)
        kernels::q4_group_ref gr[q4_run];
        std::uint32_t n = 1;
        while (ci + n < end && is_q4_group(view.chunks[ci + n]) &&
               range.tokens_of(ci + n) == view.chunks[ci + n].tokens &&
               (n < q4_run ||
                (hb - ha > 1 && (n % 2 == 1 || follows(view.chunks[ci + n - 1], view.chunks[ci + n], ha, hd)))))
          ++n;
        // Each group prefetches the one read two groups later (q4_group_ref::ahead_k, ahead_v): in
        // the run, the group two further on; past its end, the same head's next run (after the
        // last head; before it, the next head's first groups), and after the range's last run
        // the next head's first groups (where the range starts with a whole group).
        // The run's groups are all Q4 groups of one head_dim (is_q4_group, above): prefetchable
        // all or none, checked once. The two groups after the run, which its last two groups
        // prefetch for the task's last head, are found once per run as well.
        const chunk* run = view.chunks + ci;
        const bool ahead_ok = prefetchable(run[0], hd);
        const chunk* after[2] = {nullptr, nullptr};
        std::uint32_t after_head[2] = {ha, ha};
        for (std::uint32_t k = 0; k < 2; ++k) {
          const std::uint32_t ai = ci + n + std::min(k, n - 1);
          if (ai < end) {
            after[k] = &view.chunks[ai];
          } else if (next_head != no_head && b.off == 0 && b.ci + (ai - end) < end) {
            after[k] = &view.chunks[b.ci + (ai - end)];
            after_head[k] = next_head;
          }
          if (after[k] != nullptr && !(is_q4_group(*after[k]) && prefetchable(*after[k], hd))) after[k] = nullptr;
        }
        const auto bytes = [](const std::byte* p) { return reinterpret_cast<const std::uint8_t*>(p); };
        for (std::uint32_t h = ha; h < hb; ++h) {
          const head_state hs = st(h);
          for (std::uint32_t j0 = 0; j0 < n; j0 += q4_run) {
            const std::uint32_t count = std::min(q4_run, n - j0);
            for (std::uint32_t j = j0; j < j0 + count; ++j) {
              const chunk& cj = run[j];
              const chunk* aj = nullptr;
              std::uint32_t ah = h;
              if (j + 2 < n) {
                aj = ahead_ok ? &run[j + 2] : nullptr;
              } else if (h + 1 < hb) {  // the next head's first groups of this run
                aj = ahead_ok ? &run[std::min(j + 2 - n, n - 1)] : nullptr;
                ah = h + 1;
              } else {  // the next run's first groups (head ha), or the next head's
                aj = after[j + 2 - n];
                ah = after_head[j + 2 - n];
              }
              gr[j - j0] = {bytes(cj.k_head(h)), bytes(cj.v_head(h)), cj.tokens,
                            aj == nullptr ? nullptr : bytes(aj->k_head(ah)),
                            aj == nullptr ? nullptr : bytes(aj->v_head(ah))};
            }
            c.kt->attend_q4(hs.qf, g, gr, count, hd, hs.run_max, hs.run_sum, hs.acc);
          }
        }
        ci += n - 1;
        continue;
      }
      // A Q4 key group is scored whole (its tokens share the folded query); flush the tile first.
      if (ch.k_format == format::q4 && filled + ch.tokens > limit) break;
      const std::uint32_t n = std::min(limit - filled, ch_tokens - off);
      if (!pieced && off == 0) {
        const chunk* a = chunk_ahead(view, ci, end, hd, ahead);
        if (a != nullptr) pf.queue(*a, ha, hb, hd);
      }
      parts[parts_in++] = {ci, off, n, false};
      if (head_major && ch.k_format != format::q4) {
        parts[parts_in - 1].later = true;  // scored below, head after head
      } else if (heads_in_one_call(c, ch, ha, hb) && (pieced || pf.active())) {
        // A piece ahead: the next chunk's keys where the tile goes on after this chunk; else as
        // many bytes of the values its value pass reads first as this call reads (lead heads:
        // those of the first heads, over all the tile's chunks). Otherwise the stream's share.
        kernels::prefetch_region next{};
        if (pieced) {
          std::uint32_t j = ci + 1;
          bool more = off + n == ch_tokens && filled + n < limit;
          while (more && j < end && range.tokens_of(j) == 0) ++j;
          more = more && j < end &&
                 !(view.chunks[j].k_format == format::q4 && filled + n + view.chunks[j].tokens > limit);
          if (more) {
            next = key_rows(view.chunks[j], ha, hb, hd);
          } else {
            lead = lead_heads(ch, n, hb - ha, filled + n);
            next = head_values(view, parts, parts_in, ha, ha + lead, hd, pieces);
          }
        } else {
          next = pf.take(key_lines(c, ch, ha, hb, n));
        }
        score_heads(c, ch, ha, hb, off, n, st(ha).qf, st(ha).s + filled, next);
      } else {
        for (std::uint32_t h = ha; h < hb; ++h) {
          const head_state hs = st(h);
          score_chunk(c, range, ci, h, off, n, hs.qf, hs.s + filled, pf);
        }
      }
      filled += n;
      if (off + n < ch_tokens) {  // the tile is full inside this chunk
        off += n;
        break;
      }
      if (tiles.within_chunks) {  // the chunk's last tile
        ++ci;
        off = 0;
        break;
      }
    }
    if (filled == 0) break;  // only empty chunks were left
    if (head_major) {
      // Each head's keys over the tile's parts, head after head (one scores_*_segments call a
      // head over a uniform tile, uniform_rows; else score_head_parts); head h's calls prefetch
      // the next head's keys over the same parts, the last head's the first head's values.
      lead = 1;
      const format kf = view.chunks[parts[0].ci].k_format;
      const auto segments = kf == format::f16   ? c.kt->scores_f16_segments
                            : kf == format::f32 ? c.kt->scores_f32_segments
                                                : nullptr;
      uniform = segments != nullptr && uniform_rows(view, parts, parts_in, ha, hd, ut);
      for (std::uint32_t h = ha; h < hb && uniform; ++h) {
        const head_state hs = st(h);
        const std::size_t shift = (h - ha) * ut.k_stride;
        const kernels::prefetch_region next =
            h + 1 < hb ? pieces_region(rows_of(ut.key_pieces, parts_in, shift + ut.k_stride, pieces), parts_in)
                       : pieces_region(ut.value_pieces, parts_in);
        segments(hs.qf, g, rows_of(ut.keys, parts_in, shift, ut.shifted_keys), parts_in, hd, hs.s, tile, next);
      }
      for (std::uint32_t h = ha; h < hb && !uniform; ++h) {
        const head_state hs = st(h);
        const kernels::prefetch_region next = h + 1 < hb ? head_keys(view, parts, parts_in, h + 1, hd, pieces)
                                                         : head_values(view, parts, parts_in, ha, ha + 1, hd, pieces);
        score_head_parts(c, view, parts, parts_in, h, hs.qf, hs.s, next);
      }
    }
    const std::uint32_t first = parts[0].ci;  // the tile's first chunk with tokens
    // A piece ahead: the value call of head h prefetches head h + lead's values, and the last lead
    // calls the keys of the next tile's first chunk (from the cursor on), a part each.
    kernels::prefetch_region next_keys{};
    for (std::uint32_t j = ci; pieced && !head_major && j < end; ++j)
      if (range.tokens_of(j) > (j == ci ? off : 0)) {
        next_keys = key_rows(view.chunks[j], ha, hb, hd);
        break;
      }
    if (head_major) {  // the next tile's first head's keys, over as many tokens as a tile holds
      std::uint32_t m = 0;
      for (std::uint32_t j = ci, o = off, t = 0; j < end && t < limit && m < max_tile; ++j, o = 0) {
        const std::uint32_t tj = range.tokens_of(j);
        if (tj <= o) continue;
        const chunk& nc = view.chunks[j];
        if (nc.k_format == format::q4) break;
        const std::uint32_t nn = std::min(limit - t, tj - o);
        const std::size_t row = hd * dense_element_bytes(nc.k_format);
        next_pieces[m++] = {nc.k_head(ha) + o * row, nn * row};
        t += nn;
      }
      if (m > 0) next_keys = pieces_region(next_pieces, m);
    }
    if (uniform && c.fused_values != nullptr) {
      // The value call of head h prefetches head h + 1's values, the last the next tile's keys.
      detail::value_segment* vsegs = c.segments + static_cast<std::size_t>(worker) * tile;
      for (std::uint32_t h = ha; h < hb; ++h) {
        const head_state hs = st(h);
        c.softmax(hs.s, tile, filled, g, hd, hs.run_max, hs.run_sum, hs.acc);
        const std::size_t shift = (h - ha) * ut.v_stride;
        const kernels::prefetch_region next =
            h + 1 < hb ? pieces_region(rows_of(ut.value_pieces, parts_in, shift + ut.v_stride, pieces), parts_in)
                       : next_keys;
        if (!c.fused_values(ut.vf == format::f16, hs.s, tile, g, rows_of(ut.values, parts_in, shift, vsegs), parts_in,
                            hd, hs.acc, next))
          accumulate_tile(c, range, h, parts[0].ci, parts[0].off, filled, hs.s, hs.acc, worker, pf, &next);
      }
      continue;
    }
    for (std::uint32_t h = ha; h < hb; ++h) {
      const head_state hs = st(h);
      c.softmax(hs.s, tile, filled, g, hd, hs.run_max, hs.run_sum, hs.acc);
      const kernels::prefetch_region next =
          !pieced           ? kernels::prefetch_region{}
          : h + lead < hb   ? head_values(view, parts, parts_in, h + lead, h + lead + 1, hd, pieces)
                            : head_major       ? next_keys
                            : piece(next_keys, h + lead - hb, h + lead - hb + 1, lead);
      accumulate_tile(c, range, h, first, parts[0].off, filled, hs.s, hs.acc, worker, pf, pieced ? &next : nullptr);
    }
  }

  if (!ends.finish) return;
  if (partial != nullptr) {
    const std::size_t pfl = partial_floats(g, hd);
    for (std::uint32_t h = ha; h < hb; ++h) {
      const head_state hs = st(h);
      float* ph = partial + (h - ha) * pfl;
      std::memcpy(ph, hs.run_max, g * sizeof(float));
      std::memcpy(ph + g, hs.run_sum, g * sizeof(float));
      std::memcpy(ph + 2 * g, hs.acc, gd * sizeof(float));
    }
    return;
  }
  for (std::uint32_t h = ha; h < hb; ++h) {
    const head_state hs = st(h);
    float* oh = c.out + (seq * c.kv_heads + h) * gd;
    normalise(hs.acc, hs.run_sum, g, hd, oh);
  }
}

// Whether a task reads the view head by head: where its chunks are large (a contiguous cache; paged
// blocks of 128 tokens or more, tiled block by block (tiling), whose ends prefetch the following
// block's rows), where the prefetch stream cannot take them (prefetchable: 64-token blocks of f32
// heads wider than 128 or f16 heads wider than 256), or where a chunk's kv heads lie apart rather
// than side by side (the two-tier cache, whose Q4 store run_task then reads slab by slab, all heads
// together, and its tail head by head: store_end). Small chunks with their heads side by side
// (paged blocks of 16 to 64 tokens) are read all heads together, so that each chunk is one
// stream: for 64-token blocks (read head by head until session 33) this measured 1.20x faster with
// 1 thread and 1.14x with 2 on the Zen 5 VM (f16, 32k tokens).
// (measurements: bench/PERFORMANCE.md, "Source notes: attend.cpp", head_by_head)
bool head_by_head(const layer_view& view, std::uint32_t hd) {
  if (view.count <= 1) return true;
  const std::uint32_t average = view.tokens / view.count;
  const chunk& c = view.chunks[0];
  if (average >= large_chunk_tokens || (average >= large_chunk_tokens / 2 && !prefetchable(c, hd))) return true;
  return c.k_head_stride > key_head_bytes(c, hd) + value_head_bytes(c, hd);
}

// Kv heads a task reads of a batch's sequence of n tokens read head by head, when the batch is cut
// into runs of about `target` tokens of all heads (split_tasks): runs of ceil(kv_heads / r) heads
// for r = ceil(n / target) (at most kv_heads), all of them for n <= target.
std::uint32_t heads_per_run(std::uint32_t n, std::uint32_t target, std::uint32_t kv_heads) {
  return ceil_div(kv_heads, std::clamp(ceil_div(n, target), 1u, kv_heads));
}

// Whether part `part` of split sequence seq holds no tokens: a part of a batch's short sequence
// that needs fewer parts than the call's (split_tasks), or one left empty by split_view. Its task
// does nothing and merge() skips it (its partial results are not written).
bool empty_part(const call& c, std::size_t seq, std::uint32_t part) {
  const cursor& b = c.bounds[seq * (c.parts + 1) + part];
  const cursor& e = c.bounds[seq * (c.parts + 1) + part + 1];
  return b.ci == e.ci && b.off == e.off;
}

// Where the fused Q4 step (table::attend_q4) reads a range [b, e) of a view that starts with whole
// Q4 groups of a two-tier store (keys and values Q4, heads apart): the cursor after those groups
// (where the tail, or e, begins); b where the range does not start so.
//
// run_task reads those groups with all of a task's heads together rather than head by head: the
// groups of one slab, head after head (run_heads), so that a decode step reads each slab's rows of
// the layer (slab layout [layer][kv_head][slot], two_tier_cache.hpp) in address order, where head
// by head it jumped from slab to slab (about 110 KiB a run with the default 22-group slabs of 24
// layers of 8 x 128), at a cost that grew with the number of slabs. Slab by slab measured 1.09x
// faster than head by head on the Intel VM (32k tokens, 1 thread). The FP16 tail stays head by
// head: read all heads together in tiles as well, a 4k step with 2 threads ran 0.91x as fast.
// (measurements: bench/PERFORMANCE.md, "Source notes: attend.cpp", store_end)
cursor store_end(const call& c, const layer_view& view, cursor b, cursor e) {
  if (c.kt->attend_q4 == nullptr || b.off != 0) return b;
  std::uint32_t q = b.ci;
  while (q < e.ci && is_q4_group(view.chunks[q])) ++q;
  return {q, 0};
}

// A task is one sequence and a run of its kv heads, read head by head or all heads together
// (head_by_head). A split sequence's task is one part of its tokens (parts > 1) and a run of its
// kv heads.
void run_task(const call& c, std::size_t task, unsigned worker) {
  // Tasks run part by part (every sequence's first part, then every sequence's second, ...), so
  // that the large first parts of a guided split are handed out first. A paged batch's parts run
  // last part first, and a batch read head by head its runs of heads last run first: only its
  // longest sequences have their last parts (or runs), and those are its largest (first parts
  // first, the long sequence of 16k + 7 x 1k tokens on 2 workers had its second half run last,
  // after the short ones, by the worker that had done them).
  const std::uint32_t runs = c.tasks_per_seq / c.parts;
  std::size_t seq = 0;
  std::uint32_t part = 0, run = 0, hpt = c.heads_per_task;
  if (c.run_target != 0) {  // parts == 1
    run = runs - 1 - static_cast<std::uint32_t>(task / c.seqs);
    seq = task % c.seqs;
    hpt = heads_per_run(c.views[seq].tokens, c.run_target, c.kv_heads);
  } else {
    const std::size_t per_part = static_cast<std::size_t>(c.seqs) * runs;
    const auto order = static_cast<std::uint32_t>(task / per_part);
    part = c.last_parts_first ? c.parts - 1 - order : order;
    seq = task % per_part / runs;
    run = static_cast<std::uint32_t>(task % runs);
  }
  const std::uint32_t h0 = run * hpt;
  if (h0 >= c.kv_heads) return;  // a short sequence of a batch cut into runs: fewer runs than its tasks
  const std::uint32_t h1 = std::min(h0 + hpt, c.kv_heads);
  float* base = c.scratch + worker * c.worker_stride;
  assert(reinterpret_cast<std::uintptr_t>(base) % 64 == 0);  // whole lines: see aligned_array
  const layer_view& view = c.views[seq];
  cursor b{}, e{view.count, 0};
  float* partial = nullptr;
  const std::size_t pfl = partial_floats(c.group, c.head_dim);
  if (c.parts > 1) {
    if (empty_part(c, seq, part)) return;
    b = c.bounds[seq * (c.parts + 1) + part];
    e = c.bounds[seq * (c.parts + 1) + part + 1];
    partial = c.partial + ((seq * c.parts + part) * c.kv_heads + h0) * pfl;
  }
  if (head_by_head(view, c.head_dim)) {
    const tiling tiles = head_tiles(view, c.head_dim);
    // A two-tier store's Q4 groups with all the task's heads (run_heads: slab by slab), then the
    // rest (its FP16 tail) head by head, each head's state kept in the scratch in between; without
    // such groups every head in turn over the whole range, in one state's place.
    const cursor q = h1 - h0 > 1 ? store_end(c, view, b, e) : b;
    const bool store = q.ci > b.ci;
    if (store) run_heads(c, seq, h0, h1, base, worker, b, q, partial, tiles, no_head, prefetch_tokens, {true, false});
    for (std::uint32_t h = h0; h < h1; ++h)
      run_heads(c, seq, h, h + 1, store ? base + (h - h0) * c.head_floats : base, worker, q, e,
                partial == nullptr ? nullptr : partial + (h - h0) * pfl, tiles, h + 1 < h1 ? h + 1 : no_head,
                prefetch_tokens, {!store, true});
  } else {
    // A piece ahead where the task scores a block's heads in one call (two heads or more), else
    // the prefetch stream half a tile ahead.
    const bool pieced = h1 - h0 >= 2;
    const std::uint32_t tile = all_heads_tile(c.head_dim, pieced);
    run_heads(c, seq, h0, h1, base, worker, b, e, partial, {tile}, no_head, pieced ? piece_ahead : tile / 2);
  }
}

// Cumulative weight of parts [0, j) of a sequence's split for `w` workers a sequence: levels 0,
// parts of weight 1 (equal parts); levels >= 2, a guided split (split_tasks), w << levels in all:
// w parts of weight 2^(levels - 1), w of half that, and so on down to 2, then 2 w of weight 1.
std::uint64_t weight_before(std::uint32_t j, std::uint32_t w, std::uint32_t levels) {
  std::uint64_t sum = 0;
  for (std::uint32_t k = 0; k + 1 < levels && j > 0; ++k) {
    const std::uint32_t n = std::min(j, w);
    sum += std::uint64_t{n} << (levels - 1 - k);
    j -= n;
  }
  return sum + j;
}

// Where the `parts` parts of a view start and end (parts + 1 cursors): token counts in proportion
// to their weights (weight_before), a Q4 key chunk (scored whole) going whole to the part where
// most of it falls.
void split_view(const layer_view& view, std::uint32_t parts, std::uint32_t w, std::uint32_t levels, cursor* bounds) {
  const std::uint64_t total = weight_before(parts, w, levels);
  bounds[0] = {0, 0};
  std::uint32_t ci = 0, pos = 0;  // chunk ci starts at token pos
  for (std::uint32_t j = 1; j < parts; ++j) {
    const auto target = static_cast<std::uint32_t>(view.tokens * weight_before(j, w, levels) / total);
    while (ci < view.count && pos + view.chunks[ci].tokens <= target) pos += view.chunks[ci++].tokens;
    cursor at{ci, target - pos};
    if (ci < view.count && at.off > 0 && view.chunks[ci].k_format == format::q4)
      at = 2 * at.off < view.chunks[ci].tokens ? cursor{ci, 0} : cursor{ci + 1, 0};
    const cursor& prev = bounds[j - 1];
    if (at.ci < prev.ci || (at.ci == prev.ci && at.off < prev.off)) at = prev;  // never backwards
    bounds[j] = at;
  }
  bounds[parts] = {view.count, 0};
}

// The out rows of split sequences: the parts' partial results combined, per query, with weights
// 2^(max_p - max) (scores are in the base-2 domain).
void merge(const call& c, std::size_t seqs) {
  const std::uint32_t g = c.group, hd = c.head_dim, parts = c.parts;
  const std::size_t pfl = partial_floats(g, hd), part_stride = c.kv_heads * pfl;
  for (std::size_t s = 0; s < seqs; ++s)
    for (std::uint32_t h = 0; h < c.kv_heads; ++h) {
      const float* p0 = c.partial + (s * parts * c.kv_heads + h) * pfl;  // part 0 of head h
      for (std::uint32_t i = 0; i < g; ++i) {
        float* o = c.out + ((s * c.kv_heads + h) * g + i) * hd;
        float m = -std::numeric_limits<float>::infinity();
        for (std::uint32_t p = 0; p < parts; ++p)
          if (!empty_part(c, s, p)) m = std::max(m, p0[p * part_stride + i]);
        std::fill(o, o + hd, 0.0f);
        if (m == -std::numeric_limits<float>::infinity()) continue;  // no tokens
        float sum = 0.0f;
        for (std::uint32_t p = 0; p < parts; ++p) {
          const float* pp = p0 + p * part_stride;
          if (empty_part(c, s, p) || pp[g + i] == 0.0f) continue;  // no tokens, or none with weight
          const float w = std::exp2(pp[i] - m);
          sum += w * pp[g + i];
          const float* acc = pp + 2 * g + static_cast<std::size_t>(i) * hd;
          for (std::uint32_t d = 0; d < hd; ++d) o[d] += w * acc[d];
        }
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
        for (std::uint32_t d = 0; d < hd; ++d) o[d] *= inv;
      }
    }
}

// Fewest tokens of a part of a split sequence.
constexpr std::uint32_t min_part_tokens = 512;

// Most levels of a guided split (split_tasks), and the fewest tokens of its smallest parts.
constexpr std::uint32_t max_levels = 3;
constexpr std::uint32_t min_guided_tokens = 2048;

// Bound on parts * sequences for `workers` workers (parts <= ceil(workers / seqs) * (max_levels +
// 1), seqs < workers): below 2 workers; none for one worker.
std::size_t max_parts(unsigned workers) {
  return workers < 2 ? 0 : 2 * static_cast<std::size_t>(workers) * (max_levels + 1);
}

// Tasks a worker, at least, where a batch of sequences read head by head is cut into runs of kv
// heads.
constexpr std::size_t tasks_per_worker = 4;

// How a call's sequences are cut into tasks: one per sequence (all its kv heads, so that each
// chunk's K and V are read as one stream) when there are at least as many sequences as workers;
// else each sequence's tokens are split into parts (each read with all its kv heads, merged after)
// and, where the views are too short for enough parts, its kv heads into runs, so that every
// worker gets a task.
// A batch (at least as many sequences as workers) is cut finer too, tasks_per_worker tasks a
// worker at least: whole sequences left a batch of 3 on 2 workers, or of ragged lengths, waiting
// for the worker with the most tokens (cut finer, 1.05-1.24x faster on Zen 5 with 2 threads).
// Views read head by head (contiguous and two-tier caches: each head is a stream of its own, or a
// two-tier store's slab rows one after the other) into runs of kv heads, which changes no sum;
// paged blocks, read all heads together, into token parts (a split by heads would read half
// blocks: 0.56-0.69x for one sequence on 2 workers), as many as reserve()'s partial results hold.
// Each sequence of a batch is cut by its own length (runs of heads, or parts, of about a
// sequence's share of those tasks each; heads_per_run, parts_of), the longest first: with as
// many tasks for every sequence, a batch of 4 tasks a worker or more stayed whole sequences, and
// one long among short ones waited for the worker that had it (16k + 7 x 1k tokens on 2 workers).
// Long sequences are split guided: for w workers a sequence, w parts of a quarter of its tokens
// each, then w of an eighth, then 2 w of a sixteenth (levels 3; fewer where the smallest would
// fall under min_guided_tokens), handed out largest first. Workers that run at different speeds
// (the vCPUs of a shared machine, cores of two kinds) then end within one small part of each
// other, where equal parts made the step wait for the slowest worker's whole share.
// (measurements: bench/PERFORMANCE.md, "Source notes: attend.cpp", task_split)
struct task_split {
  std::uint32_t parts = 1, heads_per_task = 0, workers_per_seq = 1, levels = 0;
  // A paged batch's tokens a part (0: every sequence is cut into `parts` parts): a sequence of n
  // tokens is cut into parts_of() of them, about n / target tokens each, and its other parts are
  // empty.
  std::uint32_t target = 0;
  // A batch read head by head: tokens a task (0: runs of heads_per_task heads), and runs a
  // sequence, the most any of its sequences is cut into (heads_per_run; shorter ones have runs
  // without heads).
  std::uint32_t run_target = 0, runs = 1;
};

// Parts holding tokens of a sequence of view v under split sp: sp.parts, or for a paged batch
// ceil(n / sp.target), at most sp.parts and n / min_part_tokens, at least 1.
std::uint32_t parts_of(const layer_view& v, const task_split& sp) {
  if (sp.target == 0) return sp.parts;
  return std::max<std::uint32_t>(1, std::min({ceil_div(v.tokens, sp.target), sp.parts, v.tokens / min_part_tokens}));
}
task_split split_tasks(std::span<const layer_view> views, std::uint32_t kv_heads, std::uint32_t head_dim,
                       std::uint32_t group, unsigned workers) {
  const std::size_t seqs = views.size();
  if (seqs >= workers && workers < 2) return {1, kv_heads, 1, 0};
  bool by_head = true;
  std::uint32_t longest = 0;
  std::uint64_t total = 0;
  for (const layer_view& v : views) {
    by_head = by_head && head_by_head(v, head_dim);
    longest = std::max(longest, v.tokens);
    total += v.tokens;
  }
  if (seqs >= workers) {
    // A sequence's share of tasks_per_worker tasks a worker, in tokens: what a batch's tasks hold.
    const std::uint64_t share = ceil_div<std::uint64_t>(total, tasks_per_worker * workers);
    constexpr std::uint64_t most_tokens = std::numeric_limits<std::uint32_t>::max();
    if (by_head) {
      // Runs of kv heads of about the same number of tokens (of all heads) in every sequence,
      // target: a sequence's share of tasks_per_worker tasks a worker (heads_per_run), so that a
      // long sequence among short ones is cut into runs and the short ones stay whole.
      task_split sp{1, kv_heads, 1, 0};
      const auto target = static_cast<std::uint32_t>(std::clamp<std::uint64_t>(share, 1, most_tokens));
      for (const layer_view& v : views) sp.runs = std::max(sp.runs, ceil_div(kv_heads, heads_per_run(v.tokens, target, kv_heads)));
      if (sp.runs > 1) sp.run_target = target;
      return sp;
    }
    // Blocks read all heads together (paged): token parts instead, of about the same number of
    // tokens in every sequence (target: a sequence's share of tasks_per_worker tasks a worker, at
    // least min_part_tokens), so that a long sequence among short ones is cut finer than they are
    // (whole sequences left a batch of one long sequence and many short ones waiting for the
    // worker with the long one). At most as many parts a sequence as reserve() holds partial
    // results for, and so few that the caller's merge (one thread) reads at most 1/16 of what
    // one worker reads: per kv head, group * head_dim floats a part holding tokens, against
    // total * head_dim * 4 / workers bytes of f16 K and V (a batch on many workers would else
    // wait for a long serial merge).
    task_split sp{static_cast<std::uint32_t>(std::max<std::size_t>(1, max_parts(workers) / seqs)), kv_heads, 1, 0,
                  static_cast<std::uint32_t>(std::clamp<std::uint64_t>(share, min_part_tokens, most_tokens))};
    std::uint32_t most = 1;
    for (const layer_view& v : views) most = std::max(most, parts_of(v, sp));
    for (sp.parts = most; sp.parts > 1; --sp.parts) {
      std::uint64_t used = 0;  // parts holding tokens
      for (const layer_view& v : views) used += parts_of(v, sp);
      if (used * group * 16 * workers <= total) break;
    }
    if (sp.parts == 1) sp.target = 0;
    return sp;
  }
  const auto want = static_cast<std::uint32_t>((workers + seqs - 1) / seqs);
  std::uint32_t parts = std::clamp<std::uint32_t>(longest / min_part_tokens, 1, want), levels = 0;
  if (parts == want)
    for (std::uint32_t l = max_levels; l >= 2 && levels == 0; --l)
      if (longest / (std::uint64_t{want} << l) >= min_guided_tokens) levels = l;
  if (levels > 0) parts = want * (levels + 1);
  const std::uint32_t runs = std::min(kv_heads, (want + parts - 1) / parts);
  return {parts, (kv_heads + runs - 1) / runs, want, levels};
}

}  // namespace

// ---- workspace: scratch + a small persistent pool ---------------------------------------------

namespace {

// Workspace arrays start on a cache line (64 bytes), and so does every worker's scratch in them
// (worker_floats is a whole number of lines), so that the kernels' 64-byte loads and stores of a
// worker's accumulators, folded queries and scores never straddle two lines. Until session 51 they
// came from new[], aligned to 16 bytes only (a large block starts 16 bytes into a page; a small
// one wherever the heap had room), so the scratch's alignment changed from program to program;
// aligned, decode attention at 32k tokens with 2 threads measured 1.05-1.16x faster on the Zen 5 VM.
// (measurements: bench/PERFORMANCE.md, "Source notes: attend.cpp", aligned_delete)
struct aligned_delete {
  template <class T>
  void operator()(T* p) const noexcept {
    ::operator delete[](p, std::align_val_t{64});
  }
};
template <class T>
using aligned_array = std::unique_ptr<T[], aligned_delete>;

// Grows `array` (of `count` elements) to at least n elements; what it held is not kept.
template <class T>
result<void> grow(aligned_array<T>& array, std::size_t& count, std::size_t n, const char* what) {
  static_assert(std::is_trivially_destructible_v<T> && alignof(T) <= 64);  // aligned_delete runs no destructors
  if (n <= count) return {};
  assert(n <= std::numeric_limits<std::size_t>::max() / sizeof(T));  // validate_params' bounds
  void* p = ::operator new[](n * sizeof(T), std::align_val_t{64}, std::nothrow);
  if (p == nullptr) return fail(errc::out_of_memory, what, {{"bytes", static_cast<long long>(n * sizeof(T))}});
  T* a = static_cast<T*>(p);
  std::uninitialized_default_construct_n(a, n);
  array.reset(a);
  count = n;
  return {};
}

}  // namespace

struct attention_workspace::impl {
  aligned_array<float> scratch;
  std::size_t scratch_floats = 0;
  aligned_array<detail::value_segment> segments;  // [worker][tile]
  std::size_t segment_count = 0;
  aligned_array<uniform_tile> tiles;  // [worker]
  std::size_t tile_count = 0;
  aligned_array<float> partial;  // split sequences: [sequence][part][kv head][partial_floats]
  std::size_t partial_count = 0;
  aligned_array<cursor> bounds;  // split sequences: [sequence][parts + 1]
  std::size_t bound_count = 0;

  // Pool: `started` background workers (worker indices 1..started, each taken from next_index as
  // its thread starts); the caller is worker 0. Between jobs a worker spins for up to spin_ns on
  // `generation` before it sleeps on `wake`, and the caller spins as long on `finished` before it
  // sleeps on `done`: a decode loop calls attend back to back (once per layer), and a sleeping
  // worker took 35-140 us to wake on the 2-vCPU VM (a 32k-token decode step with 2 threads takes
  // 1.5-4 ms). Task fields are written before `generation` is released; a worker that sleeps reads
  // it under the mutex, as before.
  // Threads start through pthread_create, which reports a failure (EAGAIN: the process or the
  // system is out of threads, or of memory for a stack) as a code that reserve returns as an
  // error: std::thread throws std::system_error there, and aborts in -fno-exceptions programs.
  // A thread starts with the generation of the last job before it (born): a job posted after its
  // creation is new to it, the one before is not. Until session 52 a thread started from 0, so
  // that one started after a job had run took that finished job for a new one: it counted itself
  // in `finished` for it, and where that count landed after the next job had reset it, it was
  // counted twice in that job, which could then end while a worker still ran a task. And the
  // workers compared `finished` with the size of a std::vector of threads that a later reserve
  // could be growing (ThreadSanitizer found that race once a test grew the pool after jobs:
  // test_attend_threads, pool_grown_after_jobs_matches_single_thread).
  static constexpr std::int64_t spin_ns = 50'000;
  std::unique_ptr<pthread_t[]> handles;  // [capacity]: the first `started` are running
  unsigned handle_capacity = 0;
  // Written by grow_threads between jobs, read by the workers after a job (a worker may still
  // be reading it after the caller has seen the job end and gone on to grow the pool).
  std::atomic<unsigned> started{0};
  std::atomic<unsigned> next_index{1};
  std::atomic<std::uint64_t> born{0};
  std::mutex mu;
  std::condition_variable wake, done;
  std::atomic<std::uint64_t> generation{0};
  std::atomic<unsigned> finished{0};
  std::atomic<bool> stop{false};
  parallel_for::task_fn task = nullptr;
  void* task_ctx = nullptr;
  std::size_t task_count = 0;
  unsigned active_helpers = 0;  // background workers 1..active_helpers take part in this job
  std::atomic<std::size_t> next{0};

  ~impl() {
    {
      std::lock_guard<std::mutex> lock(mu);
      stop.store(true, std::memory_order_release);
    }
    wake.notify_all();
    for (unsigned i = 0, n = started.load(std::memory_order_relaxed); i < n; ++i) pthread_join(handles[i], nullptr);
  }

  static void pause() noexcept {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
  }

  // Spins until ready() or spin_ns have passed; whether ready() held.
  template <class Ready>
  static bool spin_until(Ready ready) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(spin_ns);
    for (unsigned i = 1;; ++i) {
      if (ready()) return true;
      pause();
      if (i % 64 == 0 && std::chrono::steady_clock::now() >= until) return ready();
    }
  }

  void work(unsigned worker) {
    for (std::size_t i = next.fetch_add(1, std::memory_order_relaxed); i < task_count;
         i = next.fetch_add(1, std::memory_order_relaxed))
      task(task_ctx, i, worker);
  }

  void worker_loop(unsigned worker) {
    std::uint64_t seen = born.load(std::memory_order_acquire);
    for (;;) {
      const auto ready = [&] {
        return stop.load(std::memory_order_acquire) || generation.load(std::memory_order_acquire) != seen;
      };
      if (!spin_until(ready)) {
        std::unique_lock<std::mutex> lock(mu);
        wake.wait(lock, ready);
      }
      if (stop.load(std::memory_order_acquire)) return;
      seen = generation.load(std::memory_order_acquire);
      if (worker <= active_helpers) work(worker);
      if (finished.fetch_add(1, std::memory_order_acq_rel) + 1 == started.load(std::memory_order_relaxed)) {
        // The caller may be asleep on `done`: it tests `finished` under the mutex.
        std::lock_guard<std::mutex> lock(mu);
        done.notify_one();
      }
    }
  }

  static void* thread_main(void* self) {
    impl& w = *static_cast<impl*>(self);
    w.worker_loop(w.next_index.fetch_add(1, std::memory_order_relaxed));
    return nullptr;
  }

  // Starts background threads until there are `n` (called between jobs: none is running). Those
  // it started stay where a later one fails.
  result<void> grow_threads(unsigned n) {
    unsigned running = started.load(std::memory_order_relaxed);
    if (n <= running) return {};
    if (n > handle_capacity) {
      const unsigned capacity = std::max(n, std::min(2 * handle_capacity, max_workers));
      std::unique_ptr<pthread_t[]> h(new (std::nothrow) pthread_t[capacity]);
      if (!h) return fail(errc::out_of_memory, "attend: worker thread handles", {{"threads", n + 1}});
      std::copy_n(handles.get(), running, h.get());
      handles = std::move(h);
      handle_capacity = capacity;
    }
    born.store(generation.load(std::memory_order_relaxed), std::memory_order_release);
    for (; running < n; started.store(++running, std::memory_order_relaxed)) {
      const int rc = pthread_create(&handles[running], nullptr, &thread_main, this);
      if (rc != 0)
        return fail(errc::out_of_memory, "attend: could not start a worker thread",
                    {{"threads", n + 1}, {"running", running + 1}, {"errno", rc}});
    }
    return {};
  }

  void run(std::size_t count, parallel_for::task_fn fn, void* ctx, unsigned nthreads) {
    const unsigned helpers = static_cast<unsigned>(std::min<std::size_t>(nthreads - 1, count - 1));
    const unsigned running = started.load(std::memory_order_relaxed);
    if (helpers == 0 || running == 0) {
      for (std::size_t i = 0; i < count; ++i) fn(ctx, i, 0);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu);
      task = fn;
      task_ctx = ctx;
      task_count = count;
      active_helpers = helpers;
      next.store(0, std::memory_order_relaxed);
      finished.store(0, std::memory_order_relaxed);
      generation.fetch_add(1, std::memory_order_release);
    }
    wake.notify_all();
    work(0);
    const auto all_done = [&] { return finished.load(std::memory_order_acquire) == running; };
    if (!spin_until(all_done)) {
      std::unique_lock<std::mutex> lock(mu);
      done.wait(lock, all_done);
    }
  }
};

attention_workspace::attention_workspace() noexcept = default;
attention_workspace::~attention_workspace() = default;
attention_workspace::attention_workspace(attention_workspace&&) noexcept = default;
attention_workspace& attention_workspace::operator=(attention_workspace&&) noexcept = default;

std::size_t attention_workspace::scratch_bytes() const noexcept {
  if (!impl_) return 0;
  return impl_->scratch_floats * sizeof(float) + impl_->segment_count * sizeof(detail::value_segment) +
         impl_->tile_count * sizeof(uniform_tile) + impl_->partial_count * sizeof(float) + impl_->bound_count * sizeof(cursor);
}

result<void> attention_workspace::reserve(const attention_params& p) {
  KVCACHE_TRY(validate_params(p));
  if (!impl_) {
    impl_.reset(new (std::nothrow) impl);
    if (!impl_) return fail(errc::out_of_memory, "attend: workspace");
  }
  const unsigned workers = workers_of(p);
  // Room for every kv head of a sequence per worker (a task holds at most that many), and the gap
  // between one worker's and the next's (none after the last: one worker has none).
  const std::size_t per = worker_stride(p.q_heads / p.kv_heads, p.head_dim, p.kv_heads);
  impl& w = *impl_;
  KVCACHE_TRY(grow(w.scratch, w.scratch_floats, per * workers - worker_gap_floats, "attend: workspace scratch"));
  KVCACHE_TRY(grow(w.segments, w.segment_count, static_cast<std::size_t>(max_tile) * workers,
                   "attend: workspace segments"));
  KVCACHE_TRY(grow(w.tiles, w.tile_count, workers, "attend: workspace tiles"));
  // Split sequences: parts * sequences partial results, at most max_parts.
  const std::size_t parts = max_parts(workers);
  KVCACHE_TRY(grow(w.partial, w.partial_count, parts * p.kv_heads * partial_floats(p.q_heads / p.kv_heads, p.head_dim),
                   "attend: workspace partial results"));
  // sequences * (parts + 1): a batch cut into parts has at most max_parts / 2 sequences (2 parts
  // each at least), a guided split fewer sequences than workers.
  KVCACHE_TRY(grow(w.bounds, w.bound_count, parts + parts / 2, "attend: workspace part bounds"));
  if (p.pool.run == nullptr) KVCACHE_TRY(impl_->grow_threads(p.threads - 1));
  return {};
}

result<void> attend(const attention_params& p, std::span<const layer_view> views, std::span<const float> q,
                    std::span<float> out, attention_workspace& ws) {
  KVCACHE_TRY(validate_params(p));
  const std::size_t row = static_cast<std::size_t>(p.q_heads) * p.head_dim;
  const std::size_t expected = views.size() * row;
  if (q.size() != expected)
    return fail(errc::bad_shape, "attend: q size (sequences * q_heads * head_dim)",
                {{"expected", static_cast<long long>(expected)}, {"got", static_cast<long long>(q.size())}});
  if (out.size() != expected)
    return fail(errc::bad_shape, "attend: out size (sequences * q_heads * head_dim)",
                {{"expected", static_cast<long long>(expected)}, {"got", static_cast<long long>(out.size())}});
  for (std::size_t s = 0; s < views.size(); ++s) KVCACHE_TRY(validate_view(views[s], s, p));
  if (views.empty()) return {};
  KVCACHE_TRY(ws.reserve(p));

  const std::uint32_t group = p.q_heads / p.kv_heads;
  const float scale = p.scale > 0.0f ? p.scale : 1.0f / std::sqrt(static_cast<float>(p.head_dim));
  const kernels::table* float_q4 =
      p.q4 == kernels::q4_arith::float32 ? kernels::find(kernels::active().which, kernels::q4_arith::float32) : nullptr;
  const kernels::table& kt = float_q4 != nullptr ? *float_q4 : kernels::active();
  detail::softmax_tile_fn softmax = detail::attend_generic::softmax_tile;
#if defined(KVCACHE_HAVE_AVX2)
  if (kt.which == isa::avx2) softmax = detail::attend_avx2::softmax_tile;
#endif
#if defined(KVCACHE_HAVE_AVX512)
  if (kt.which == isa::avx512) softmax = detail::attend_avx512::softmax_tile;
#endif
  const unsigned workers = workers_of(p);
  const task_split split = split_tasks(views, p.kv_heads, p.head_dim, p.q_heads / p.kv_heads, workers);
  // What reserve() provided.
  assert(split.parts == 1 || (views.size() * split.parts <= max_parts(workers) &&
                              views.size() * (split.parts + 1) <= ws.impl_->bound_count));
  const std::uint32_t hpt = split.heads_per_task;
  const std::uint32_t tasks_per_seq = split.parts * (split.run_target != 0 ? split.runs : ceil_div(p.kv_heads, hpt));
  cursor* bounds = ws.impl_->bounds.get();
  if (split.parts > 1)
    for (std::size_t s = 0; s < views.size(); ++s) {
      // A paged batch's short sequence holds tokens in its first parts_of() parts only.
      cursor* sb = bounds + s * (split.parts + 1);
      const std::uint32_t used = parts_of(views[s], split);
      split_view(views[s], used, split.workers_per_seq, split.levels, sb);
      for (std::uint32_t j = used + 1; j <= split.parts; ++j) sb[j] = sb[used];
    }
  decltype(call::fused_values) fused_values = nullptr;
  [[maybe_unused]] const bool fused_group = group == 1 || group == 2 || group == 4 || group == 8;
#if defined(KVCACHE_HAVE_AVX2)
  if (kt.which == isa::avx2 && p.head_dim % 8 == 0 && fused_group && group != 1)
    fused_values = detail::attend_avx2::accumulate_segments;
#endif
#if defined(KVCACHE_HAVE_AVX512)
  if (kt.which == isa::avx512 && p.head_dim % 16 == 0 && fused_group)
    fused_values = detail::attend_avx512::accumulate_segments;
#endif
  const call c{&kt, softmax, views.data(), q.data(), out.data(), p.kv_heads, p.head_dim, group, max_tile,
               hpt, tasks_per_seq, split.parts, static_cast<std::uint32_t>(views.size()), bounds, ws.impl_->partial.get(), scale * log2e,
               ws.impl_->scratch.get(), worker_stride(group, p.head_dim, hpt), worker_floats(group, p.head_dim),
               fused_values, ws.impl_->segments.get(), ws.impl_->tiles.get(), split.target != 0, split.run_target};
  const parallel_for::task_fn fn = [](void* ctx, std::size_t i, unsigned worker) {
    run_task(*static_cast<const call*>(ctx), i, worker);
  };
  const std::size_t tasks = views.size() * tasks_per_seq;
  void* ctx = const_cast<call*>(&c);
  if (p.pool.run != nullptr) p.pool.run(p.pool.pool, tasks, fn, ctx);
  else ws.impl_->run(tasks, fn, ctx, p.threads);
  if (split.parts > 1) merge(c, views.size());
  return {};
}

}  // namespace kvcache
