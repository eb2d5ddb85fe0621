// The float-lane operations that exp2_simd.inl needs, on AVX-512 (16 lanes): the base of
// attend_avx512.cpp's vector interface for the softmax step, and the whole of
// q4_int8_avx512.inl's for its fused Q4 step. Included inside each file's anonymous namespace.
struct avx512_float_ops {
  using vf = __m512;
  static vf set1(float x) { return _mm512_set1_ps(x); }
  static vf sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
  static vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
  static vf max(vf a, vf b) { return _mm512_max_ps(a, b); }
  static vf fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
  static vf round(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static vf pow2(vf p, vf i) { return _mm512_scalef_ps(p, i); }
};
