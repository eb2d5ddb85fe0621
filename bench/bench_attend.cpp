// BM_attend/<cache>/<format>/<isa>/ctx:<tokens>/t:<threads>: one decode step of attention of one
// sequence (one layer of 8 KV heads x 128 head_dim, 32 query heads) over a real cache holding
// `tokens` tokens: contiguous f16, paged f16 (16-token blocks; paged_b64, paged_b256: 64- and
// 256-token blocks, at 32k tokens only) and two-tier Q4 (128-token f16 tail). Bytes processed = the
// K+V bytes the layer's view holds (what attend must read); items = tokens/s of decode (one query
// token per step). t: attend's own thread count (attention_params::threads).
// The cache holds as many layers as make its K+V at least bench::stream_bytes() (twice the L3, at
// least 128 MiB) and each step reads the next layer's view, as an engine's decode step does: a
// layer's K+V then comes from memory, not from the L3 where a single 4k layer (16 MB) stays
// between steps (until session 35 the 4k figures were of that case; until session 45 the caches
// held 128 MiB, which a VM with 480 MiB of L3 partly kept there). The filled caches are kept from
// one call of a benchmark to the next (held_caches), and shared by its t:1 and t:2 variants.
// BM_attend_cached/<cache>/<format>/<isa>/ctx:4096/t:<threads>: the same step over a cache of one
// 4k layer (f16 16 MiB of K+V, two-tier 5 MiB of Q4 and FP16 tail), which stays in the L3 between
// steps where the L3 holds it: attention's own speed, its K+V from cache rather than memory, an
// upper bound of the rows of BM_attend (scripts/perf_report.sh prints them side by side). Session
// 55, Zen 5 VM, 1 thread: contiguous f16 26-33 GB/s from the L3, against a BM_read of 24-37 GB/s,
// where the same core rereads 4-16 MiB at 33-58 GB/s in a plain loop: the f16 step is about as much
// arithmetic as memory there. With 2 threads a sequence's parts go to whichever worker claims them
// first (split_tasks), so a part's rows may lie in the other core's cache, and on that VM the two
// vCPUs have separate L3s (a buffer one vCPU has just read, the other read at 17-24 GB/s, below
// memory's 23-29): the t:2 rows are not a bound there.
#include "bench_common.hpp"

#include <kvcache/attend.hpp>
#include <kvcache/contiguous_cache.hpp>
#include <kvcache/isa.hpp>
#include <kvcache/kernels.hpp>
#include <kvcache/paged_cache.hpp>
#include <kvcache/two_tier_cache.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace kvcache;

constexpr std::uint32_t kv_heads = 8, head_dim = 128, q_heads = 32;
const geometry shape{1, kv_heads, head_dim};  // of one layer; the caches of BM_attend hold layers_for(tokens)

// A cache of BM_attend and BM_attend_paired holds bench::stream_bytes() of K+V at least (in its own
// format: f16, or the two-tier cache's Q4 groups). Until session 42 the two-tier cache held as
// many layers as the f16 ones (one at 32k: 41 MiB of Q4), which that session's Intel VM kept in
// its L3: BM_attend/two_tier at 32k with 1 thread ran at 386 tokens/s so, 212 from memory (the
// same code, one run each).
using bench::layers_for_bytes;
// Of an f16 cache of `tokens` tokens.
std::uint32_t layers_for(std::size_t tokens) {
  return layers_for_bytes(tokens * shape.token_width() * 2 * sizeof(std::uint16_t));
}
// Of a two-tier cache of `tokens` tokens: its Q4 groups' bytes (the FP16 tail, at most
// tail_tokens + 31 tokens, not counted).
std::uint32_t two_tier_layers_for(std::size_t tokens) {
  const std::size_t groups = std::max<std::size_t>(1, tokens / q4_group);
  return layers_for_bytes(groups * kv_heads * (q4_key_group_bytes(head_dim) + q4_value_group_bytes(head_dim)));
}
geometry shape_of(std::uint32_t layers) { return {layers, kv_heads, head_dim}; }

/// K+V bytes a view holds: what attention over it reads.
std::size_t view_bytes(const layer_view& v) {
  std::size_t b = 0;
  for (const chunk& c : v) {
    for (int which = 0; which < 2; ++which) {
      const format f = which == 0 ? c.k_format : c.v_format;
      if (f == format::q4)
        b += which == 0 ? q4_key_group_bytes(head_dim) : q4_value_group_bytes(head_dim);
      else
        b += dense_element_bytes(f) * c.tokens * head_dim;
    }
  }
  return b * kv_heads;
}

/// Appends `tokens` random tokens to sequence s in every layer of the cache, 1024 at a time.
template <class C>
bool fill(C& cache, seq_id s, std::size_t tokens) {
  constexpr std::size_t step = 1024;
  std::vector<float> k(step * shape.token_width()), v(k.size());
  for (std::size_t t = 0; t < tokens; t += step) {
    const std::size_t n = std::min(step, tokens - t);
    if (!cache.reserve(s, n)) return false;
    for (std::uint32_t l = 0; l < cache.shape().layers; ++l) {
      bench::fill_normal_fast(k.data(), n * shape.token_width(), 2 * (t + 65537 * l) + 1);
      bench::fill_normal_fast(v.data(), n * shape.token_width(), 2 * (t + 65537 * l) + 2);
      const std::span<const float> ks(k.data(), n * shape.token_width()), vs(v.data(), n * shape.token_width());
      if (!cache.write(s, l, ks, vs)) return false;
    }
    if (!cache.commit(s)) return false;
  }
  return true;
}

/// A new sequence of `tokens` random tokens in cache, and its views of every layer; nullopt where
/// that fails.
template <class C>
std::optional<std::vector<layer_view>> filled_views(C& cache, std::size_t tokens) {
  const result<seq_id> s = cache.create();
  if (!s || !fill(cache, *s, tokens)) return std::nullopt;
  std::vector<layer_view> views;
  for (std::uint32_t l = 0; l < cache.shape().layers; ++l) views.push_back(cache.view(*s, l).value());
  return views;
}

/// The same, its view of layer 0.
template <class C>
std::optional<layer_view> filled_view(C& cache, std::size_t tokens) {
  const std::optional<std::vector<layer_view>> views = filled_views(cache, tokens);
  if (!views) return std::nullopt;
  return views->front();
}

// What a decode step of `seqs` sequences on `threads` workers needs: their query rows (random,
// the same seed everywhere), the output rows, the parameters and a workspace reserved for them
// (reserved: whether that succeeded).
struct step_inputs {
  std::vector<float> q, out;
  attention_params p;
  attention_workspace ws;
  bool reserved;
  step_inputs(std::size_t seqs, unsigned threads)
      : q(seqs * q_heads * head_dim), out(q.size()), p{q_heads, kv_heads, head_dim, 0.0f, threads, {}} {
    bench::fill_normal(q.data(), q.size(), 1.0f, 7);
    reserved = static_cast<bool>(ws.reserve(p));
  }
};

// Decode steps of attend over `views` (one query row each, threads workers) for as long as the
// state runs, step i over the views of layer i % layers (views: [layer][sequence]); false where
// the workspace or a step failed (the state then carries the error).
bool decode_steps(benchmark::State& state, std::span<const layer_view> views, unsigned threads,
                  std::size_t layers = 1) {
  const std::size_t seqs = views.size() / layers;
  step_inputs in(seqs, threads);
  if (!in.reserved) {
    state.SkipWithError("workspace");
    return false;
  }
  std::size_t layer = 0;
  for (auto _ : state) {
    const result<void> r = attend(in.p, views.subspan(layer * seqs, seqs), in.q, in.out, in.ws);
    layer = layer + 1 == layers ? 0 : layer + 1;
    if (!r) {
      state.SkipWithError(r.error().message.c_str());
      return false;
    }
    benchmark::DoNotOptimize(in.out.data());
    benchmark::ClobberMemory();
  }
  return true;
}

// One decode step over each of `views` (a sequence's view of a layer each; 1 thread): what an
// engine's first step after prefill does. A cache just filled reads slower the first time than ever
// after, and every set is built with it (add_filled), so that the benchmarks time the steps of a
// decode loop, which reads each layer once a step for as long as the sequence lives. Measured on
// the Zen 5 VM (session 59; a throwaway program: passes of one step over every layer of a cache
// just filled as here): a two-tier cache of 26 layers at 32k tokens (1 GiB of Q4) 627 tokens/s in
// the first pass against 934-956 in the 19 after it with 2 threads, 355 against 478-530 with 1 (3 s
// of sleep between the fill and the first pass: 673 against 842-886); contiguous f16 (8 layers, 1
// GiB) 285 against 321-335 with 2 threads. The first pass took no page fault (getrusage) and the
// store lay on huge pages before and after it; a read of one word in every 4 KiB page of the store
// (26-38 ms) made the first pass as fast as the later ones, one word in every 2 MiB page (8.5 us
// each) did not: a state of each 4 KiB page that the first read after the writes sets, below the
// guest. Without this step the report's random interleaving, which rebuilds BM_attend_paired's set
// for every repetition, timed mostly such first reads (about 35 rounds a repetition against 26
// two-tier layers): two-tier / f16 at 32k with 2 threads in its repetitions 1.62-2.19 rebuilt
// without the step, 1.77-2.94 with it (alternating processes; session 58 saw 1.83-1.97 in the
// report against 2.21-2.46 with only BM_attend_paired run).
bool first_step(std::span<const layer_view> views) {
  step_inputs in(1, 1);
  if (!in.reserved) return false;
  for (const layer_view& v : views)
    if (!attend(in.p, std::span(&v, 1), in.q, in.out, in.ws)) return false;
  return true;
}

// The caches filled for the benchmark that runs now and their views ([cache][layer]), kept until
// a benchmark needs others: Google Benchmark calls a benchmark's function once for each trial of
// its iteration count and for each repetition, and filling caches of stream_bytes() each (about
// a gigabyte where the L3 is 480 MiB) takes seconds. One set at a time, so that memory holds at
// most BM_attend_paired's three caches; BM_attend's t:1 and t:2 variants of a cache share it (key).
struct filled_set {
  std::string key;
  std::vector<std::shared_ptr<void>> caches;  // own the caches the views point into
  std::vector<std::vector<layer_view>> views;
  std::string error;  // why building the set failed (views and caches then empty)
};

// Adds a cache (made, then filled with `tokens` tokens of one sequence) to set; false (set.error
// says why) where that fails.
template <class C>
bool add_filled(filled_set& set, result<C> made, std::size_t tokens) {
  if (!made) {
    set.error = made.error().message;
    return false;
  }
  auto cache = std::make_shared<C>(std::move(*made));  // filled where it stays: views point into it
  std::optional<std::vector<layer_view>> views = filled_views(*cache, tokens);
  if (!views) {
    set.error = "cache fill failed";
    return false;
  }
  if (!first_step(*views)) {
    set.error = "first decode step failed";
    return false;
  }
  set.views.push_back(std::move(*views));
  set.caches.push_back(std::move(cache));
  return true;
}

// The set named key of the caches made by the functions `makes` (each returning a result<cache>),
// each filled with `tokens` tokens: the one held if it has that name, else built in its place (the
// old set freed first; a set that failed is built again on the next call). One slot for every
// kind of set, hence a function-local static outside this template.
filled_set& held_slot() {
  static filled_set held;
  return held;
}
template <class... Make>
const filled_set& held_caches(const std::string& key, std::size_t tokens, Make... makes) {
  filled_set& held = held_slot();
  if (held.key == key && held.error.empty()) return held;
  held = filled_set{};
  held.key = key;
  if (!(add_filled(held, makes(), tokens) && ...)) {
    held.views.clear();
    held.caches.clear();
  }
  return held;
}

void run(benchmark::State& state, const filled_set& held, std::size_t tokens, unsigned threads) {
  if (!held.error.empty()) return state.SkipWithError(held.error.c_str());
  const std::vector<layer_view>& views = held.views.front();
  if (!decode_steps(state, views, threads, views.size())) return;
  // Every layer's view holds the same bytes.
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * view_bytes(views.front())));
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()));  // decode steps
  state.counters["tokens_per_s"] = benchmark::Counter(static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
  state.counters["context"] = static_cast<double>(tokens);
  state.counters["layers"] = static_cast<double>(views.size());
}

// The caches of the table, empty, sized for `tokens` tokens of one sequence in `layers` layers.
result<contiguous_cache<>> make_contiguous(std::size_t tokens, std::uint32_t layers = 1) {
  return contiguous_cache<>::create({shape_of(layers), format::f16, 1, tokens});
}
result<paged_cache<>> make_paged(std::size_t tokens, std::uint32_t block, std::uint32_t layers = 1) {
  paged_config<> pc;
  pc.shape = shape_of(layers);
  pc.storage = format::f16;
  pc.block_tokens = block;
  pc.budget_bytes = (tokens + block) * shape.token_width() * 2 * 2 * layers;
  pc.expected_tokens = tokens;
  return paged_cache<>::create(pc);
}
result<two_tier_cache<>> make_two_tier(std::uint32_t layers = 1) {
  two_tier_config tc;
  tc.shape = shape_of(layers);
  return two_tier_cache<>::create(tc);
}

// BM_attend's caches, filled under the benchmark's ISA (its conversions), as a decode loop's are.
// held_caches keys: the cache and its context; f16 conversion rounds the same on every ISA, so
// the f16 caches serve every ISA's benchmarks, while the two-tier cache's key names its ISA.
// cached: one layer, whose K+V stays in the L3 between steps (BM_attend_cached), instead of the
// layers that make bench::stream_bytes().
void contiguous_f16(benchmark::State& state, isa which, std::size_t tokens, unsigned threads, bool cached) {
  const bench::isa_scope scope(which);
  if (!scope.ok) return state.SkipWithError("ISA not supported");
  const std::uint32_t layers = cached ? 1 : layers_for(tokens);
  run(state,
      held_caches("contiguous/" + std::to_string(tokens) + "/" + std::to_string(layers), tokens,
                  [tokens, layers] { return make_contiguous(tokens, layers); }),
      tokens, threads);
}

template <std::uint32_t Block>
void paged_f16(benchmark::State& state, isa which, std::size_t tokens, unsigned threads, bool cached) {
  const bench::isa_scope scope(which);
  if (!scope.ok) return state.SkipWithError("ISA not supported");
  const std::uint32_t layers = cached ? 1 : layers_for(tokens);
  run(state,
      held_caches("paged" + std::to_string(Block) + "/" + std::to_string(tokens) + "/" + std::to_string(layers), tokens,
                  [tokens, layers] { return make_paged(tokens, Block, layers); }),
      tokens, threads);
}

void two_tier_q4(benchmark::State& state, isa which, std::size_t tokens, unsigned threads, bool cached) {
  const bench::isa_scope scope(which);
  if (!scope.ok) return state.SkipWithError("ISA not supported");
  const std::uint32_t layers = cached ? 1 : two_tier_layers_for(tokens);
  run(state,
      held_caches("two_tier/" + std::string(to_string(which)) + "/" + std::to_string(tokens) + "/" +
                      std::to_string(layers),
                  tokens, [layers] { return make_two_tier(layers); }),
      tokens, threads);
}

// A streaming read of a range of words by `threads` threads, for BM_attend_paired's read step:
// the caller and threads - 1 helpers sum (bench::sum_words, BM_read's loop) chunks of 256 KiB
// claimed in turn from a counter. The helpers sleep between reads (spinning 50 us first, as
// attend's own workers do). A read wakes them and waits until all are running before its clock
// starts, so that its time is the memory's and not a thread's wake-up, as BM_read's is (whose
// threads start together): the baseline is the read bandwidth of `threads` threads, while
// attention's steps pay their own pool's wake-up. Chunks, not BM_read's fixed halves: attend's
// tasks are claimed the same way, and on a VM that takes a vCPU away for a while fixed halves
// wait for the descheduled thread's whole half. (Session 54 tried halves: in two disturbed
// report runs, where BM_read's repetitions ranged 11-29 GB/s, contiguous f16 at 4k with 2
// threads measured 0.35-2.3 times this read over the repetitions; with chunks, 0.58-0.99 in six
// runs.) With 1 thread it is BM_read's loop over the range.
class team_read {
 public:
  explicit team_read(unsigned threads) {
    for (unsigned i = 1; i < threads; ++i) helpers_.emplace_back([this] { help(); });
  }
  team_read(const team_read&) = delete;
  team_read& operator=(const team_read&) = delete;
  ~team_read() {
    {
      const std::lock_guard lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (std::thread& t : helpers_) t.join();
  }

  /// Seconds the team takes to read words [0, n) (their sum goes to `sum`), from the moment every
  /// thread runs.
  double operator()(const std::uint64_t* words, std::size_t n, std::uint64_t& sum) {
    words_ = words;
    n_ = n;
    next_.store(0, std::memory_order_relaxed);
    sum_.store(0, std::memory_order_relaxed);
    arrived_.store(0, std::memory_order_relaxed);
    finished_.store(0, std::memory_order_relaxed);
    go_.store(false, std::memory_order_relaxed);
    {
      const std::lock_guard lock(mutex_);
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    while (arrived_.load(std::memory_order_acquire) != helpers_.size()) {
    }
    const auto t0 = std::chrono::steady_clock::now();
    go_.store(true, std::memory_order_release);
    sum_.fetch_add(read_chunks(), std::memory_order_relaxed);
    while (finished_.load(std::memory_order_acquire) != helpers_.size()) {
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    sum = sum_.load(std::memory_order_relaxed);
    return seconds;
  }

 private:
  static constexpr std::size_t chunk_words = (256 << 10) / 8;

  std::uint64_t read_chunks() {
    std::uint64_t sum = 0;
    for (;;) {
      const std::size_t first = next_.fetch_add(1, std::memory_order_relaxed) * chunk_words;
      if (first >= n_) return sum;
      sum += bench::sum_words(words_ + first, std::min(chunk_words, n_ - first));
    }
  }

  void help() {
    std::uint64_t seen = 0;
    for (;;) {
      const auto published = [&] { return generation_.load(std::memory_order_acquire) != seen; };
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(50);
      while (!published() && std::chrono::steady_clock::now() < until) {
      }
      if (!published()) {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return stop_ || published(); });
        if (stop_) return;
      }
      seen = generation_.load(std::memory_order_acquire);
      arrived_.fetch_add(1, std::memory_order_acq_rel);
      while (!go_.load(std::memory_order_acquire)) {
      }
      sum_.fetch_add(read_chunks(), std::memory_order_relaxed);
      finished_.fetch_add(1, std::memory_order_acq_rel);
    }
  }

  std::vector<std::thread> helpers_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;  // under mutex_
  std::atomic<std::uint64_t> generation_{0};
  std::atomic<std::size_t> next_{0}, arrived_{0}, finished_{0};
  std::atomic<bool> go_{false};
  std::atomic<std::uint64_t> sum_{0};
  const std::uint64_t* words_ = nullptr;  // published by generation_
  std::size_t n_ = 0;
};

// BM_attend_paired/<isa>/ctx:<tokens>/t:<threads>: the three caches of the table (contiguous f16,
// paged f16 with 16-token blocks, two-tier Q4) side by side, and a streaming read of as many bytes
// as a layer of the f16 cache holds (BM_read's buffer and loop, `threads` threads: team_read),
// each iteration one decode step on each cache and one read, in rotating order, each timed on its
// own. The counters are the caches' tokens/s, the read's bytes/s, and the ratios paged/contiguous
// and two-tier/f16 of their summed times and contiguous f16's K+V bytes/s over the read's: on a
// shared machine whose speed drifts within seconds, steps taken next to each other compare fairer
// than separate benchmarks' best repetitions (scripts/perf_report.sh prints both). Each cache
// holds the layers of BM_attend (layers_for, two_tier_layers_for) and each round reads the next
// layer of all three and the next slice of the read buffer, so that each streams from memory as
// it does alone.
void attend_paired(benchmark::State& state, isa which, std::size_t tokens, unsigned threads) {
  const bench::isa_scope scope(which);
  if (!scope.ok) return state.SkipWithError("ISA not supported");
  const std::uint32_t layers = layers_for(tokens);
  const filled_set& held =
      held_caches("paired/" + std::string(to_string(which)) + "/" + std::to_string(tokens), tokens,
                  [&] { return make_contiguous(tokens, layers); }, [&] { return make_paged(tokens, 16, layers); },
                  [&] { return make_two_tier(two_tier_layers_for(tokens)); });
  if (!held.error.empty()) return state.SkipWithError(held.error.c_str());
  const std::vector<layer_view>* views = held.views.data();
  step_inputs in(1, threads);
  if (!in.reserved) return state.SkipWithError("workspace");
  const bench::buffer& read = bench::read_buffer();
  if (!read) return state.SkipWithError("allocation failed");
  const std::size_t f16_bytes = view_bytes(views[0].front());
  const std::size_t slice_words = f16_bytes / 8, slices = std::max<std::size_t>(1, read.size() / 8 / slice_words);
  team_read reader(threads);
  double seconds[4] = {0, 0, 0, 0};  // contiguous, paged, two-tier, read
  std::size_t round = 0;
  bool failed = false;
  for (auto _ : state) {
    for (std::size_t j = 0; j < 4 && !failed; ++j) {
      const std::size_t c = (round + j) % 4;
      if (c == 3) {
        std::uint64_t sum = 0;
        seconds[c] += reader(read.as<std::uint64_t>() + round % slices * slice_words, slice_words, sum);
        benchmark::DoNotOptimize(sum);
        continue;
      }
      const auto t0 = std::chrono::steady_clock::now();
      const result<void> r = attend(in.p, std::span(&views[c][round % views[c].size()], 1), in.q, in.out, in.ws);
      benchmark::DoNotOptimize(in.out.data());
      benchmark::ClobberMemory();
      seconds[c] += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (!r) {
        state.SkipWithError(r.error().message.c_str());
        failed = true;
      }
    }
    if (failed) break;
    ++round;
  }
  if (failed) return;
  const auto n = static_cast<double>(state.iterations());
  state.counters["contiguous_tokens_per_s"] = n / seconds[0];
  state.counters["paged_tokens_per_s"] = n / seconds[1];
  state.counters["two_tier_tokens_per_s"] = n / seconds[2];
  state.counters["read_bytes_per_s"] = n * static_cast<double>(slice_words * 8) / seconds[3];
  state.counters["paged_over_contiguous"] = seconds[0] / seconds[1];
  state.counters["two_tier_over_f16"] = seconds[0] / seconds[2];
  state.counters["f16_over_read"] =
      (static_cast<double>(f16_bytes) / seconds[0]) / (static_cast<double>(slice_words * 8) / seconds[3]);
}

// BM_attend_batch/<cache>/<isa>/<batch>/t:<threads>: one decode step of a batch of sequences
// (3x8k: three of 8192 tokens; ragged: 12288, 2048, 3072 and 1024; 16k+7x1k: one of 16384 tokens
// and seven of 1024, as many sequences as 4 tasks for each of 2 workers), contiguous f16, paged f16
// (16-token blocks) or two-tier Q4, each sequence its own query row. A batch not a multiple of the
// thread count, or of unequal lengths, is where whole-sequence tasks leave a worker idle (attend
// cuts a batch into runs of kv heads, or paged views into token parts): compare t:2 with t:1. Bytes
// processed: the K+V bytes of all views. The caches are filled, read once (first_step), then timed.
template <class C>
void attend_batch(benchmark::State& state, C& cache, isa which, const std::vector<std::size_t>& lengths, unsigned threads) {
  const bench::isa_scope scope(which);
  if (!scope.ok) return state.SkipWithError("ISA not supported");
  std::vector<layer_view> views;
  std::size_t bytes = 0;
  for (std::size_t n : lengths) {
    const std::optional<layer_view> v = filled_view(cache, n);
    if (!v) return state.SkipWithError("cache fill failed");
    views.push_back(*v);
    bytes += view_bytes(*v);
  }
  if (!first_step(views)) return state.SkipWithError("first decode step failed");
  if (!decode_steps(state, views, threads)) return;
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * bytes));
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()));  // decode steps of the batch
}

void batch_contiguous(benchmark::State& state, isa which, const std::vector<std::size_t>& lengths, unsigned threads) {
  std::size_t longest = 0;
  for (std::size_t n : lengths) longest = std::max(longest, n);
  auto c = contiguous_cache<>::create({shape, format::f16, lengths.size(), longest});
  if (!c) return state.SkipWithError(c.error().message.c_str());
  attend_batch(state, *c, which, lengths, threads);
}
void batch_paged(benchmark::State& state, isa which, const std::vector<std::size_t>& lengths, unsigned threads) {
  std::size_t tokens = 0;
  for (std::size_t n : lengths) tokens += n + 16;  // each sequence's last block may be partly used
  auto c = make_paged(tokens, 16);
  if (!c) return state.SkipWithError(c.error().message.c_str());
  attend_batch(state, *c, which, lengths, threads);
}
void batch_two_tier(benchmark::State& state, isa which, const std::vector<std::size_t>& lengths, unsigned threads) {
  auto c = make_two_tier();
  if (!c) return state.SkipWithError(c.error().message.c_str());
  attend_batch(state, *c, which, lengths, threads);
}

const bool registered = [] {
  using fn = void (*)(benchmark::State&, isa, std::size_t, unsigned, bool);
  const struct {
    const char* name;
    fn f;
    bool long_only;  // 32k tokens only
  } caches[] = {{"contiguous/f16", contiguous_f16, false},
                {"paged/f16", paged_f16<16>, false},
                {"two_tier/q4", two_tier_q4, false},
                {"paged_b64/f16", paged_f16<64>, true},
                {"paged_b256/f16", paged_f16<256>, true}};
  for (isa i : {isa::scalar, isa::avx2, isa::avx512, isa::neon}) {
    if (kernels::find(i) == nullptr) continue;
    // t:1 and t:2 of a cache one after the other: they share its filled cache (held_caches).
    for (std::size_t tokens : {std::size_t{4096}, std::size_t{32768}})
      for (const auto& c : caches)
        for (unsigned threads : {1u, 2u}) {
          if (c.long_only && tokens < 32768) continue;
          const std::string name = std::string("BM_attend/") + c.name + "/" + std::string(to_string(i)) +
                                   "/ctx:" + std::to_string(tokens) + "/t:" + std::to_string(threads);
          benchmark::RegisterBenchmark(name.c_str(), [f = c.f, i, tokens, threads](benchmark::State& st) {
            f(st, i, tokens, threads, false);
          })->UseRealTime()->Unit(benchmark::kMicrosecond);
        }
    // BM_attend_cached: one 4k layer read step after step, from the L3 where it fits.
    for (const auto& c : caches)
      for (unsigned threads : {1u, 2u}) {
        if (c.long_only) continue;
        const std::string name = std::string("BM_attend_cached/") + c.name + "/" + std::string(to_string(i)) +
                                 "/ctx:4096/t:" + std::to_string(threads);
        benchmark::RegisterBenchmark(name.c_str(), [f = c.f, i, threads](benchmark::State& st) {
          f(st, i, 4096, threads, true);
        })->UseRealTime()->Unit(benchmark::kMicrosecond);
      }
    using batch_fn = void (*)(benchmark::State&, isa, const std::vector<std::size_t>&, unsigned);
    // (Plain pairs, not structured bindings: clang 14 cannot capture those.)
    for (const auto& cache : {std::pair<const char*, batch_fn>{"contiguous/f16", batch_contiguous},
                              std::pair<const char*, batch_fn>{"paged/f16", batch_paged},
                              std::pair<const char*, batch_fn>{"two_tier/q4", batch_two_tier}})
      for (const auto& batch : {std::pair<const char*, std::vector<std::size_t>>{"3x8k", {8192, 8192, 8192}},
                                std::pair<const char*, std::vector<std::size_t>>{"ragged", {12288, 2048, 3072, 1024}},
                                std::pair<const char*, std::vector<std::size_t>>{
                                    "16k+7x1k", {16384, 1024, 1024, 1024, 1024, 1024, 1024, 1024}}})
        for (unsigned threads : {1u, 2u}) {
          const batch_fn bf = cache.second;
          const std::vector<std::size_t>& lengths = batch.second;
          const std::string name = std::string("BM_attend_batch/") + cache.first + "/" + std::string(to_string(i)) + "/" +
                                   batch.first + "/t:" + std::to_string(threads);
          benchmark::RegisterBenchmark(name.c_str(), [bf, i, lengths, threads](benchmark::State& st) {
            bf(st, i, lengths, threads);
          })->UseRealTime()->Unit(benchmark::kMicrosecond);
        }
    for (std::size_t tokens : {std::size_t{4096}, std::size_t{32768}})
      for (unsigned threads : {1u, 2u}) {
        const std::string name = "BM_attend_paired/" + std::string(to_string(i)) + "/ctx:" + std::to_string(tokens) +
                                 "/t:" + std::to_string(threads);
        benchmark::RegisterBenchmark(name.c_str(), [i, tokens, threads](benchmark::State& st) {
          attend_paired(st, i, tokens, threads);
        })->UseRealTime()->Unit(benchmark::kMicrosecond);
      }
  }
  return true;
}();

}  // namespace
