// attend() pieces compiled with AVX2/FMA flags: the online-softmax step, 8 lanes at a time
// (attend_softmax_simd.inl; the loops of attend_softmax.inl do not vectorize: the sum is a
// reduction the compiler may not reorder), and the weighted sum of dense values over the several
// chunks of a tile (as attend_avx512.cpp's, with 8 lanes and 16 registers).
#include "attend_internal.hpp"

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

namespace kvcache::detail::attend_avx2 {
namespace generic {
#include "attend_softmax.inl"
}  // namespace generic

namespace {

#include "avx2_horizontal.inl"

#include "avx2_float_ops.inl"

// The vector interface of attend_softmax_simd.inl: 8 float lanes.
struct S : avx2_float_ops {
  static vf load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, vf x) { _mm256_storeu_ps(p, x); }
  static bool any_greater(vf a, vf b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GT_OQ)) != 0; }
};

}  // namespace

#include "attend_softmax_simd.inl"

namespace {

#include "row_prefetch.inl"

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const std::uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Channels [c0, c0 + 8 NV) of G queries, over every segment. pf advances with the rows. Inlined:
// as a function of its own (called from two places) GCC 12 kept the accumulators on the stack
// across segments, 0.75x the speed.
template <class T, int G, int NV>
[[gnu::always_inline]] inline void block(const float* p, std::size_t p_stride, const value_segment* segs,
                                         std::uint32_t count, std::uint32_t hd, std::uint32_t c0, float* acc,
                                         row_prefetch& pf) {
  __m256 a[G][NV];
  for (int i = 0; i < G; ++i)
    for (int u = 0; u < NV; ++u) a[i][u] = _mm256_loadu_ps(acc + i * hd + c0 + 8 * u);
  for (std::uint32_t sgi = 0; sgi < count; ++sgi) {
    const T* v = static_cast<const T*>(segs[sgi].v) + c0;
    const float* pp = p + segs[sgi].p_offset;
    const std::uint32_t n = segs[sgi].tokens;
    for (std::uint32_t t = 0; t < n; ++t) {
      pf.rows_held(1);
      __m256 x[NV];
      for (int u = 0; u < NV; ++u) x[u] = load8(v + static_cast<std::size_t>(t) * hd + 8 * u);
      for (int i = 0; i < G; ++i) {
        const __m256 w = _mm256_broadcast_ss(pp + i * p_stride + t);
        for (int u = 0; u < NV; ++u) a[i][u] = _mm256_fmadd_ps(w, x[u], a[i][u]);
      }
    }
  }
  for (int i = 0; i < G; ++i)
    for (int u = 0; u < NV; ++u) _mm256_storeu_ps(acc + i * hd + c0 + 8 * u, a[i][u]);
}

// Rows of a window: the passes over channels re-read a window's rows, which stay in L1 when it
// holds at most 16 KB of them (as accumulate_dense's tiles in kernels_simd.inl); a tile's segments
// are taken in windows of that many rows, cut inside a segment where needed.
constexpr std::uint32_t max_window = 128;  // attend's largest tile

// G queries in passes of at most 4 (Q a pass): Q * NV <= 8 accumulators, NV loads and a broadcast
// of each query's weight per row (8 queries of one vector each took 0.78x the time).
template <class T, int G>
void all_blocks(const float* p, std::size_t p_stride, const value_segment* segs, std::uint32_t count,
                std::uint32_t hd, float* acc, kernels::prefetch_region region) {
  constexpr int Q = G < 4 ? G : 4;
  constexpr int NV = Q == 4 ? 2 : 4;
  std::uint32_t rows = 0;
  for (std::uint32_t i = 0; i < count; ++i) rows += segs[i].tokens;
  const std::uint32_t passes = (hd / (8 * NV) + hd % (8 * NV) / 8) * (G / Q);
  row_prefetch pf(region, rows * passes);
  std::uint32_t window = 16384 / (hd * static_cast<std::uint32_t>(sizeof(T)));
  window = window < 8 ? 8 : window > max_window ? max_window : window;
  value_segment win[max_window];
  std::uint32_t j = 0, done = 0;  // segment j, its first `done` rows taken
  while (j < count) {
    std::uint32_t n = 0, filled = 0;
    for (; j < count && filled < window; done = 0, ++j) {
      const value_segment& sg = segs[j];
      const std::uint32_t take = sg.tokens - done < window - filled ? sg.tokens - done : window - filled;
      if (take == 0) continue;
      win[n++] = {static_cast<const T*>(sg.v) + static_cast<std::size_t>(done) * hd, take, sg.p_offset + done};
      filled += take;
      if (done + take < sg.tokens) {  // the window is full inside segment j
        done += take;
        break;
      }
    }
    std::uint32_t c0 = 0;
    for (; c0 + 8 * NV <= hd; c0 += 8 * NV) block<T, Q, NV>(p, p_stride, win, n, hd, c0, acc, pf);
    for (; c0 < hd; c0 += 8) block<T, Q, 1>(p, p_stride, win, n, hd, c0, acc, pf);
    if constexpr (G > Q) {  // the other four queries
      const float* p4 = p + 4 * p_stride;
      float* a4 = acc + 4 * static_cast<std::size_t>(hd);
      for (c0 = 0; c0 + 8 * NV <= hd; c0 += 8 * NV) block<T, Q, NV>(p4, p_stride, win, n, hd, c0, a4, pf);
      for (; c0 < hd; c0 += 8) block<T, Q, 1>(p4, p_stride, win, n, hd, c0, a4, pf);
    }
  }
}

template <class T>
bool dispatch(const float* p, std::size_t p_stride, std::uint32_t g, const value_segment* segs,
              std::uint32_t count, std::uint32_t hd, float* acc, kernels::prefetch_region pf) {
  switch (g) {
    case 2: all_blocks<T, 2>(p, p_stride, segs, count, hd, acc, pf); return true;
    case 4: all_blocks<T, 4>(p, p_stride, segs, count, hd, acc, pf); return true;
    case 8: all_blocks<T, 8>(p, p_stride, segs, count, hd, acc, pf); return true;
    default: return false;
  }
}

}  // namespace

bool accumulate_segments(bool f16, const float* p, std::size_t p_stride, std::uint32_t group,
                         const value_segment* segs, std::uint32_t count, std::uint32_t head_dim, float* acc,
                         kernels::prefetch_region pf) {
  if (head_dim % 8 != 0) return false;
  return f16 ? dispatch<std::uint16_t>(p, p_stride, group, segs, count, head_dim, acc, pf)
             : dispatch<float>(p, p_stride, group, segs, count, head_dim, acc, pf);
}

}  // namespace kvcache::detail::attend_avx2
