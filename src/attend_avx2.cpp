// attend() pieces compiled with AVX2/FMA flags: the online-softmax step, 8 lanes at a time
// (attend_softmax_simd.inl; the loops of attend_softmax.inl do not vectorize: the sum is a
// reduction the compiler may not reorder).
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

// The vector interface of attend_softmax_simd.inl: 8 float lanes.
struct S {
  using vf = __m256;
  static constexpr std::uint32_t W = 8;
  static vf set1(float x) { return _mm256_set1_ps(x); }
  static vf zero() { return _mm256_setzero_ps(); }
  static vf load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, vf x) { _mm256_storeu_ps(p, x); }
  static vf add(vf a, vf b) { return _mm256_add_ps(a, b); }
  static vf sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
  static vf mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
  static vf max(vf a, vf b) { return _mm256_max_ps(a, b); }
  static vf fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
  static vf round(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // 2^i built in the exponent bits (i in [-125, 0]).
  static vf pow2(vf p, vf i) {
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(i), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  }
  static float hmax(vf v) { return hmax8(v); }
  static bool any_greater(vf a, vf b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GT_OQ)) != 0; }
  static float hsum(vf v) { return hsum8(v); }
};

}  // namespace

#include "attend_softmax_simd.inl"

}  // namespace kvcache::detail::attend_avx2
