// Software prefetch of a kernels::prefetch_region spread over a kernel's rows, shared by
// kernels_simd.inl and attend_avx512.cpp: included inside each file's anonymous namespace (see
// kernels_internal.hpp), where kvcache::kernels::prefetch_region is visible.

// The lines of a prefetch_region issued a few per row of the kernel's work: `rows` rows in all,
// ceil(lines / rows) lines at each of them. Measured on Zen 4: a contiguous cache's next tile
// prefetched this way during the current one nearly doubles decode attention at 32k tokens, while
// the same lines issued in one burst per call (or one line in 2..8) made it slower than none.
//
// Every software prefetch of this library's CPU kernels is to L2 (locality 2: prefetcht1,
// prfm pldl2keep), not to L1: measured on Zen 4 at 32k tokens (interleaved runs), prefetcht0 made
// decode attention 1.6 to 1.7 times slower for a contiguous f16 cache and 1.5 times for the
// two-tier Q4 one, on a day of the shared VM with high memory latency (on a faster day, L2 and
// L1 measured the same). The likely reason: prefetches into L1 hold its few miss buffers for the
// whole trip to memory, and the demand loads of the rows being worked on wait behind them; from
// L2, the hardware's L1 prefetcher and the out-of-order window cover the rest of the latency.
class row_prefetch {
 public:
  row_prefetch(kernels::prefetch_region r, unsigned rows) noexcept {
    const auto begin = reinterpret_cast<std::uintptr_t>(r.p);
    at_ = begin & ~std::uintptr_t{63};  // the line of the first byte
    end_ = begin + r.bytes;
    const std::size_t lines = (end_ - at_ + 63) / 64;
    per_row_ = r.bytes == 0 ? 0 : (lines + rows - 1) / (rows == 0 ? 1 : rows);
  }
  // The lines of `rows` rows of work.
  void rows(unsigned rows) noexcept {
    for (std::size_t n = per_row_ * rows; n > 0 && at_ < end_; --n, at_ += 64)
      __builtin_prefetch(reinterpret_cast<const void*>(at_), 0, 2);
  }

 private:
  std::uintptr_t at_ = 0, end_ = 0;
  std::size_t per_row_ = 0;
};
