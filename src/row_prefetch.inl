// Software prefetch of a kernels::prefetch_region spread over a kernel's rows, shared by
// kernels_simd.inl and attend_avx512.cpp: included inside each file's anonymous namespace (see
// kernels_internal.hpp), where kvcache::kernels::prefetch_region is visible.

// The lines of a prefetch_region issued a few per row of the kernel's work: `rows` rows in all,
// ceil(lines / rows) lines at each of them. Measured on Zen 4: a contiguous cache's next tile
// prefetched this way during the current one nearly doubles decode attention at 32k tokens, while
// the same lines issued in one burst per call (or one line in 2..8) made it slower than none.
//
// The dense kernels' software prefetches are to L2 (locality 2: prefetcht1, prfm pldl2keep), not
// to L1: measured on Zen 4 at 32k tokens (interleaved runs), prefetcht0 made decode attention 1.6
// to 1.7 times slower for a contiguous f16 cache and 1.5 times for the two-tier Q4 one, on a day
// of the shared VM with high memory latency (on a faster day, L2 and L1 measured the same). The
// likely reason: prefetches into L1 hold its few miss buffers for the whole trip to memory, and the
// demand loads of the rows being worked on wait behind them; from L2, the hardware's L1 prefetcher
// and the out-of-order window cover the rest of the latency.
// On Zen 5 and later they are prefetcht0, into L1 (prefetch_to_l1, set in dispatch.cpp), as
// the int8 Q4 stream's are there (q4_int8.inl). From session 25 to 28 they were prefetcht2 on Zen 5:
// measured then at 32k tokens (f16, 8 kv heads x 128, 32 queries, in-process alternation of two
// caches of one kind, 80 rounds, 4 runs each), prefetcht2 against prefetcht1 made a paged cache
// (16-token blocks) 1.07-1.13x faster with 1 thread and 1.08-1.09x with 2, a contiguous one
// 1.04-1.08x and 1.01-1.03x; prefetcht0 1.07-1.16x paged but 0.98-1.03x contiguous. On the Zen 5
// VM of session 29 (whose memory read 62-67 GB/s with 2 threads, against about 38 before),
// prefetcht0 against prefetcht2 measured: in BM_attend_paired at 32k with 1 thread (process
// alternation, 5 rounds) paged 1.11x and contiguous 1.03x; in process, the caches flushed before
// each step, paged 1.38x and contiguous 1.19x with 1 thread, 1.05x and 1.10x with 2, 1.00x and
// 1.01x at 4k (from the caches); prefetchnta paged 1.05x, contiguous 1.03-1.04x; prefetcht1
// against prefetcht2 1.00x. Which level wins has moved with the machine under this VM: measure
// again where it matters.
class row_prefetch {
 public:
  row_prefetch(kernels::prefetch_region r, unsigned rows) noexcept : more_(r.more), left_(r.more_count) {
    start(r);
    std::size_t lines = lines_in(r);
    for (std::uint32_t i = 0; i < r.more_count; ++i) lines += lines_in(r.more[i]);
    const unsigned per = rows == 0 ? 1 : rows;
    per_row_ = (lines + per - 1) / per;
  }
  // The lines of `rows` rows of work, the cursor kept in the object from line to line. The score
  // kernels issue a tile's lines at once (4 rows' worth, 16 lines at head_dim 128 in f16) before
  // its arithmetic; measured on the Intel VM (session 48, in-process alternation at 32k tokens, 1
  // thread), the same loop with its cursor in registers (about half the instructions a line) made
  // the score kernels' bursts of prefetches faster and a decode step slower: contiguous f16
  // 0.82-0.83x, paged 0.93-0.95x. Likely (this VM has no hardware counters to show it): a
  // prefetch of a line from memory holds a fill buffer until its line comes, and a faster burst
  // of them queues the tile's own loads (which miss L1) behind them. (On Zen 5 and later, whose
  // prefetches go to L1, the score kernels take rows_held instead: 1.01-1.07x there, session 55;
  // see scores_dense_heads.) With the rows() before
  // session 48 (one region, its end in a register, a store a line) in the value kernel,
  // contiguous f16 steps ran 0.94-0.96x as fast as with this one there.
  void rows(unsigned rows) noexcept {
    for (std::size_t n = per_row_ * rows; n > 0; --n, at_ += 64) {
      if (at_ >= end_ && !next()) return;
      kernels::prefetch_line(at_, l1_);
    }
  }
  // rows() with the cursor in registers, for kernels that issue a row's few lines between rows of
  // arithmetic (the value kernels: 2 lines a row at head_dim 128 in f16). Measured as above: a
  // contiguous f16 cache 1.02-1.06x faster than with rows() there, paged blocks read a piece ahead
  // (run_heads) 1.01-1.05x. The loop's shape counts on that machine: the same loop that also set
  // the cursor to the end when the last piece ran out, without [[unlikely]] on the piece change,
  // made paged steps 0.95-0.96x as fast.
  void rows_held(unsigned rows) noexcept {
    std::uintptr_t a = at_, e = end_;
    for (std::size_t n = per_row_ * rows; n > 0; --n, a += 64) {
      if (a >= e) [[unlikely]] {
        if (!next()) break;
        a = at_;
        e = end_;
      }
      kernels::prefetch_line(a, l1_);
    }
    at_ = a;
    end_ = e;
  }

 private:
  // Lines of region r (whose `more` is not counted).
  static std::size_t lines_in(kernels::prefetch_region r) noexcept {
    if (r.bytes == 0) return 0;
    const auto begin = reinterpret_cast<std::uintptr_t>(r.p);
    return (begin + r.bytes + 63) / 64 - begin / 64;
  }
  void start(kernels::prefetch_region r) noexcept {
    const auto begin = reinterpret_cast<std::uintptr_t>(r.p);
    at_ = r.bytes == 0 ? 0 : begin & ~std::uintptr_t{63};  // the line of the first byte
    end_ = r.bytes == 0 ? 0 : begin + r.bytes;
  }
  // To the next piece with bytes; false where none is left.
  bool next() noexcept {
    while (left_ > 0) {
      --left_;
      const kernels::prefetch_region r = *more_++;
      if (r.bytes != 0) {
        start(r);
        return true;
      }
    }
    return false;
  }

  std::uintptr_t at_ = 0, end_ = 0;
  std::size_t per_row_ = 0;
  const kernels::prefetch_region* more_;
  std::uint32_t left_;
  bool l1_ = kernels::prefetch_to_l1;
};
