// The float-lane operations that exp2_simd.inl needs, on AVX2 (8 lanes): the base of
// attend_avx2.cpp's vector interface for the softmax step, and of q4_int8_avx2.inl's for its fused
// Q4 step (q4_attend_step.inl). Included inside each file's anonymous namespace, after
// avx2_horizontal.inl.
struct avx2_float_ops {
  using vf = __m256;
  static constexpr unsigned W = 8;
  static vf zero() { return _mm256_setzero_ps(); }
  static vf add(vf a, vf b) { return _mm256_add_ps(a, b); }
  static float hmax(vf x) { return hmax8(x); }
  static float hsum(vf x) { return hsum8(x); }
  static vf set1(float x) { return _mm256_set1_ps(x); }
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
};
