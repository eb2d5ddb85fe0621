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

#include "avx2_float_ops.inl"

// The vector interface of attend_softmax_simd.inl: 8 float lanes.
struct S : avx2_float_ops {
  static constexpr std::uint32_t W = 8;
  static vf zero() { return _mm256_setzero_ps(); }
  static vf load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, vf x) { _mm256_storeu_ps(p, x); }
  static vf add(vf a, vf b) { return _mm256_add_ps(a, b); }
  static float hmax(vf v) { return hmax8(v); }
  static bool any_greater(vf a, vf b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GT_OQ)) != 0; }
  static float hsum(vf v) { return hsum8(v); }
};

}  // namespace

#include "attend_softmax_simd.inl"

}  // namespace kvcache::detail::attend_avx2
