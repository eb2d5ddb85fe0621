// attend() pieces compiled with AVX-512 flags: the online-softmax step (attend_softmax_simd.inl) and
// the weighted sum of dense values over the several chunks of a tile with the accumulators held
// in registers (paged blocks are small: per-chunk calls would reload them every 16 tokens).
#include "attend_internal.hpp"

// GCC 12 reports -W(maybe-)uninitialized inside its own intrinsic headers once inlined here.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

namespace kvcache::detail::attend_avx512 {
namespace generic {
#include "attend_softmax.inl"
}  // namespace generic

namespace {

#include "row_prefetch.inl"

#include "avx512_float_ops.inl"

// The vector interface of attend_softmax_simd.inl: 16 float lanes.
struct S : avx512_float_ops {
  static constexpr std::uint32_t W = 16;
  static vf zero() { return _mm512_setzero_ps(); }
  static vf load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, vf x) { _mm512_storeu_ps(p, x); }
  static vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
  static float hmax(vf x) { return _mm512_reduce_max_ps(x); }
  static bool any_greater(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ) != 0; }
  static float hsum(vf x) { return _mm512_reduce_add_ps(x); }
};

}  // namespace

#include "attend_softmax_simd.inl"

namespace {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const std::uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Channels [c0, c0 + 16 NV) of G queries, over every segment.
// pf advances with the rows.
template <class T, int G, int NV>
void block(const float* p, std::size_t p_stride, const value_segment* segs, std::uint32_t count,
           std::uint32_t hd, std::uint32_t c0, float* acc, row_prefetch& pf) {
  __m512 a[G][NV];
  for (int i = 0; i < G; ++i)
    for (int u = 0; u < NV; ++u) a[i][u] = _mm512_loadu_ps(acc + i * hd + c0 + 16 * u);
  for (std::uint32_t sgi = 0; sgi < count; ++sgi) {
    const T* v = static_cast<const T*>(segs[sgi].v) + c0;
    const float* pp = p + segs[sgi].p_offset;
    const std::uint32_t n = segs[sgi].tokens;
    for (std::uint32_t t = 0; t < n; ++t) {
      pf.rows_held(1);
      __m512 x[NV];
      for (int u = 0; u < NV; ++u) x[u] = load16(v + static_cast<std::size_t>(t) * hd + 16 * u);
      for (int i = 0; i < G; ++i) {
        const __m512 w = _mm512_set1_ps(pp[i * p_stride + t]);
        for (int u = 0; u < NV; ++u) a[i][u] = _mm512_fmadd_ps(w, x[u], a[i][u]);
      }
    }
  }
  for (int i = 0; i < G; ++i)
    for (int u = 0; u < NV; ++u) _mm512_storeu_ps(acc + i * hd + c0 + 16 * u, a[i][u]);
}

// The region's prefetches are spread over all the passes of channels: measured on Zen 4 at 32k
// tokens (interleaved runs), a contiguous f16 cache 1.12x (1 thread) and 1.2x (2 threads) faster
// than with them all in the first pass, whose burst of requests (a whole tile's rows in half the
// time) queues the loads of the rows being worked on behind them.
template <class T, int G>
void all_blocks(const float* p, std::size_t p_stride, const value_segment* segs, std::uint32_t count,
                std::uint32_t hd, float* acc, kernels::prefetch_region region) {
  constexpr int NV = G >= 8 ? 2 : 4;  // G * NV <= 16 accumulators
  std::uint32_t rows = 0;
  for (std::uint32_t i = 0; i < count; ++i) rows += segs[i].tokens;
  const std::uint32_t passes = hd / (16 * NV) + hd % (16 * NV) / 16;
  row_prefetch pf(region, rows * passes);
  std::uint32_t c0 = 0;
  for (; c0 + 16 * NV <= hd; c0 += 16 * NV) block<T, G, NV>(p, p_stride, segs, count, hd, c0, acc, pf);
  for (; c0 < hd; c0 += 16) block<T, G, 1>(p, p_stride, segs, count, hd, c0, acc, pf);
}

template <class T>
bool dispatch(const float* p, std::size_t p_stride, std::uint32_t g, const value_segment* segs,
              std::uint32_t count, std::uint32_t hd, float* acc, kernels::prefetch_region pf) {
  switch (g) {
    case 1: all_blocks<T, 1>(p, p_stride, segs, count, hd, acc, pf); return true;
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
  if (head_dim % 16 != 0) return false;
  return f16 ? dispatch<std::uint16_t>(p, p_stride, group, segs, count, head_dim, acc, pf)
             : dispatch<float>(p, p_stride, group, segs, count, head_dim, acc, pf);
}

}  // namespace kvcache::detail::attend_avx512
