// Software prefetch of a kernels::prefetch_region spread over a kernel's rows, shared by
// kernels_simd.inl and attend_avx512.cpp: included inside each file's anonymous namespace (see
// kernels_internal.hpp), where kvcache::kernels::prefetch_region is visible.

// The lines of a prefetch_region issued a few per row of the kernel's work: `rows` rows in all,
// ceil(lines / rows) lines at each of them. Measured on Zen 4: a contiguous cache's next tile
// prefetched this way during the current one nearly doubles decode attention at 32k tokens, while
// the same lines issued in one burst per call (or one line in 2..8) made it slower than none.
//
// The dense kernels' software prefetches are to L2 (locality 2: prefetcht1, prfm pldl2keep), not
// to L1: on Zen 4 at 32k tokens, on a day of high memory latency, prefetcht0 made decode attention
// 1.5 to 1.7 times slower (on a faster day, L2 and L1 measured the same). The likely reason:
// prefetches into L1 hold its few miss buffers for the whole trip to memory, and the demand loads
// of the rows being worked on wait behind them; from L2, the hardware's L1 prefetcher and the
// out-of-order window cover the rest of the latency.
// On Zen 5 and later they are prefetcht0, into L1 (prefetch_to_l1, set in dispatch.cpp), as
// the int8 Q4 stream's are there (q4_int8.inl): a paged cache at 32k with 1 thread ran 1.11x and
// a contiguous one 1.03x against prefetcht2. Which level wins has moved with the machine under
// this VM: measure again where it matters.
// (measurements: bench/PERFORMANCE.md, "Source notes: row_prefetch.inl", row_prefetch)
//
// Page walks: each time the prefetch cursor enters a new 4 KiB page of its region, one line of the
// page walk_ahead bytes further on is prefetched as well, so that the page's address translation
// is walked while the kernel works on the pages before it. A prefetch into a page the TLB does not
// map waits for the walk, and so do the lines queued behind it; where the host backs the guest
// with 4 KiB pages (shadow page tables, or a host without huge pages), the TLB maps the cache's
// memory 4 KiB at a time whatever the guest's pages, and the stream walks a page every 64 lines.
// On the Zen 5 VM (a PVM guest; session 62, contiguous f16 at 32k tokens, 1 thread), timed tile
// by tile: every fourth 4-token score tile (the one whose prefetches enter a new page) took 2 to
// 5 times as long as the others while the VM was in its slow state; with the walk ahead the tiles
// ran evenly, and decode attention 1.12-1.18x faster (library before and after, alternating
// processes; 2 threads 1.14x). In its fast state the stall was 20-30 cycles a page and the walk
// ahead measured 0.98-1.04x. A dense head's rows go on past each tile's region, so the line
// probed is one the stream reads soon. Only a page boundary inside a region walks (the cursor's
// stop, end_, is the nearer of the piece's end and the next boundary: see start and next): a region
// of one page (a 16-token paged block of one head) walks nothing, and probing paged blocks' pieces
// ahead measured no gain.
// (measurements: bench/PERFORMANCE.md, session 62)
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
  // its arithmetic; on an Intel VM, the same loop with its cursor in registers made their bursts of
  // prefetches faster and a decode step slower (contiguous f16 0.82-0.83x). Likely: a prefetch of
  // a line from memory holds a fill buffer until its line comes, and a faster burst of them queues
  // the tile's own loads (which miss L1) behind them. (On Zen 5 and later, whose prefetches go to
  // L1, the score kernels take rows_held instead; see scores_dense_heads.)
  // (measurements: bench/PERFORMANCE.md, "Source notes: row_prefetch.inl", row_prefetch::rows)
  void rows(unsigned rows) noexcept {
    for (std::size_t n = per_row_ * rows; n > 0; --n, at_ += 64) {
      if (at_ >= end_ && !next()) return;
      kernels::prefetch_line(at_, l1_);
    }
  }
  // rows() with the cursor in registers, for kernels that issue a row's few lines between rows of
  // arithmetic (the value kernels: 2 lines a row at head_dim 128 in f16; a contiguous f16 cache
  // 1.02-1.06x faster than with rows() there, on an Intel VM). Its shape counts: with the cursor
  // also set to the end when the last piece ran out and no [[unlikely]] on the piece change, paged
  // steps ran 0.95-0.96x as fast.
  // (measurements: bench/PERFORMANCE.md, "Source notes: row_prefetch.inl", row_prefetch::rows_held)
  void rows_held(unsigned rows) noexcept {
    std::uintptr_t a = at_, e = end_;
    for (std::size_t n = per_row_ * rows; n > 0; --n, a += 64) {
      if (a >= e) [[unlikely]] {
        at_ = a;
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
  static constexpr std::uintptr_t page_bytes = 4096;
  static constexpr std::uintptr_t walk_ahead = 16384;  // 4 pages: 8-32 KiB measured alike, 64 KiB no faster than none
  // Lines of region r (whose `more` is not counted).
  static std::size_t lines_in(kernels::prefetch_region r) noexcept {
    if (r.bytes == 0) return 0;
    const auto begin = reinterpret_cast<std::uintptr_t>(r.p);
    return (begin + r.bytes + 63) / 64 - begin / 64;
  }
  // The cursor stops at end_: the piece's end, or the first page boundary inside it if sooner.
  void start(kernels::prefetch_region r) noexcept {
    const auto begin = reinterpret_cast<std::uintptr_t>(r.p);
    at_ = r.bytes == 0 ? 0 : begin & ~std::uintptr_t{63};  // the line of the first byte
    piece_end_ = r.bytes == 0 ? 0 : begin + r.bytes;
    end_ = stop(at_);
  }
  std::uintptr_t stop(std::uintptr_t at) const noexcept {
    const std::uintptr_t page_end = (at & ~(page_bytes - 1)) + page_bytes;
    return page_end < piece_end_ ? page_end : piece_end_;
  }
  // The cursor (at_) has reached end_: at a page boundary inside the piece, walk the page
  // walk_ahead bytes further on and go on to the next boundary; at the piece's end, go to the next
  // piece with bytes. False where none is left. The page boundaries cost the loops no test of their
  // own: the loops' one test against end_ covers both.
  bool next() noexcept {
    if (at_ < piece_end_) {
      kernels::prefetch_page(at_ + walk_ahead, l1_);
      end_ = stop(at_);
      return true;
    }
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

  std::uintptr_t at_ = 0, end_ = 0, piece_end_ = 0;
  std::size_t per_row_ = 0;
  const kernels::prefetch_region* more_;
  std::uint32_t left_;
  bool l1_ = kernels::prefetch_to_l1;
};
