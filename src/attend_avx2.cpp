// attend() pieces compiled with AVX2/FMA flags: the online-softmax step, 8 lanes at a time (the
// loops of attend_softmax.inl do not vectorize: the sum is a reduction the compiler may not
// reorder).
#include "attend_internal.hpp"

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

namespace kvcache::detail::attend_avx2 {
namespace generic {
#include "attend_softmax.inl"
}  // namespace generic

namespace {

// 2^x for x <= 0, 8 lanes: the polynomial of attend_softmax.inl, x rounded to the nearest integer
// i, 2^i built in the exponent bits. Lanes below -125 (and NaN) give 2^-125.
inline __m256 exp2_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-125.0f));
  const __m256 i = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_mul_ps(_mm256_sub_ps(x, i), _mm256_set1_ps(0.69314718f));
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(i), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline float hsum(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  m = _mm_add_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

}  // namespace

void softmax_tile(float* s, std::uint32_t tile, std::uint32_t n, std::uint32_t group, std::uint32_t head_dim,
                  float* run_max, float* run_sum, float* acc) {
  for (std::uint32_t i = 0; i < group; ++i) {
    float* row = s + static_cast<std::size_t>(i) * tile;
    const std::uint32_t n8 = n / 8 * 8;
    __m256 mx = _mm256_set1_ps(-__builtin_inff());
    for (std::uint32_t t = 0; t < n8; t += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(row + t));
    float tile_max = hmax(mx);
    for (std::uint32_t t = n8; t < n; ++t) tile_max = row[t] > tile_max ? row[t] : tile_max;
    const float m_new = tile_max > run_max[i] ? tile_max : run_max[i];
    const __m256 m = _mm256_set1_ps(m_new);
    __m256 sum = _mm256_setzero_ps();
    for (std::uint32_t t = 0; t < n8; t += 8) {
      const __m256 w = exp2_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(row + t), m));
      _mm256_storeu_ps(row + t, w);
      sum = _mm256_add_ps(sum, w);
    }
    float total = hsum(sum);
    for (std::uint32_t t = n8; t < n; ++t) {
      row[t] = generic::exp2_nonpositive(row[t] - m_new);
      total += row[t];
    }
    if (m_new != run_max[i]) {
      // First tile: run_max is -inf and acc, run_sum are 0: the correction factor is 0.
      const float corr = run_max[i] < -3.0e38f ? 0.0f : generic::exp2_nonpositive(run_max[i] - m_new);
      float* a = acc + static_cast<std::size_t>(i) * head_dim;
      for (std::uint32_t d = 0; d < head_dim; ++d) a[d] *= corr;
      run_sum[i] *= corr;
      run_max[i] = m_new;
    }
    run_sum[i] += total;
  }
}

}  // namespace kvcache::detail::attend_avx2
