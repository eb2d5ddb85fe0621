// attend() pieces compiled with AVX-512 flags: the online-softmax step (attend_softmax.inl) and
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

// 2^x for x <= 0, 16 lanes: the polynomial of attend_softmax.inl, with x rounded to the nearest
// integer i and 2^i applied by scalef. Lanes below -125 (and NaN) give 2^-125.
inline __m512 exp2_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-125.0f));
  const __m512 i = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(x, i), _mm512_set1_ps(0.69314718f));
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, i);
}

inline __mmask16 first(std::uint32_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1u); }

}  // namespace

void softmax_tile(float* s, std::uint32_t tile, std::uint32_t n, std::uint32_t group, std::uint32_t head_dim,
                  float* run_max, float* run_sum, float* acc) {
  const __m512 neg_inf = _mm512_set1_ps(-__builtin_inff());
  for (std::uint32_t i = 0; i < group; ++i) {
    float* row = s + static_cast<std::size_t>(i) * tile;
    __m512 mx = neg_inf;
    for (std::uint32_t t = 0; t < n; t += 16) mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(neg_inf, first(n - t), row + t));
    const float tile_max = _mm512_reduce_max_ps(mx);
    const float m_new = tile_max > run_max[i] ? tile_max : run_max[i];
    const __m512 m = _mm512_set1_ps(m_new);
    __m512 sum = _mm512_setzero_ps();
    for (std::uint32_t t = 0; t < n; t += 16) {
      const __mmask16 k = first(n - t);
      const __m512 w = exp2_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, row + t), m));
      _mm512_mask_storeu_ps(row + t, k, w);
      sum = _mm512_mask_add_ps(sum, k, sum, w);
    }
    if (m_new != run_max[i]) {
      // First tile: run_max is -inf and acc, run_sum are 0: the correction factor is 0.
      const float corr = run_max[i] < -3.0e38f ? 0.0f : generic::exp2_nonpositive(run_max[i] - m_new);
      float* a = acc + static_cast<std::size_t>(i) * head_dim;
      for (std::uint32_t d = 0; d < head_dim; ++d) a[d] *= corr;
      run_sum[i] *= corr;
      run_max[i] = m_new;
    }
    run_sum[i] += _mm512_reduce_add_ps(sum);
  }
}

namespace {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const std::uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Channels [c0, c0 + 16 NV) of G queries, over every segment.
template <class T, int G, int NV>
void block(const float* p, std::size_t p_stride, const value_segment* segs, std::uint32_t count,
           std::uint32_t hd, std::uint32_t c0, float* acc) {
  __m512 a[G][NV];
  for (int i = 0; i < G; ++i)
    for (int u = 0; u < NV; ++u) a[i][u] = _mm512_loadu_ps(acc + i * hd + c0 + 16 * u);
  for (std::uint32_t sgi = 0; sgi < count; ++sgi) {
    const T* v = static_cast<const T*>(segs[sgi].v) + c0;
    const float* pp = p + segs[sgi].p_offset;
    const std::uint32_t n = segs[sgi].tokens;
    for (std::uint32_t t = 0; t < n; ++t) {
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

template <class T, int G>
void all_blocks(const float* p, std::size_t p_stride, const value_segment* segs, std::uint32_t count,
                std::uint32_t hd, float* acc) {
  constexpr int NV = G >= 8 ? 2 : 4;  // G * NV <= 16 accumulators
  std::uint32_t c0 = 0;
  for (; c0 + 16 * NV <= hd; c0 += 16 * NV) block<T, G, NV>(p, p_stride, segs, count, hd, c0, acc);
  for (; c0 < hd; c0 += 16) block<T, G, 1>(p, p_stride, segs, count, hd, c0, acc);
}

template <class T>
bool dispatch(const float* p, std::size_t p_stride, std::uint32_t g, const value_segment* segs,
              std::uint32_t count, std::uint32_t hd, float* acc) {
  switch (g) {
    case 1: all_blocks<T, 1>(p, p_stride, segs, count, hd, acc); return true;
    case 2: all_blocks<T, 2>(p, p_stride, segs, count, hd, acc); return true;
    case 4: all_blocks<T, 4>(p, p_stride, segs, count, hd, acc); return true;
    case 8: all_blocks<T, 8>(p, p_stride, segs, count, hd, acc); return true;
    default: return false;
  }
}

}  // namespace

bool accumulate_segments(bool f16, const float* p, std::size_t p_stride, std::uint32_t group,
                         const value_segment* segs, std::uint32_t count, std::uint32_t head_dim, float* acc) {
  if (head_dim % 16 != 0) return false;
  return f16 ? dispatch<std::uint16_t>(p, p_stride, group, segs, count, head_dim, acc)
             : dispatch<float>(p, p_stride, group, segs, count, head_dim, acc);
}

}  // namespace kvcache::detail::attend_avx512
