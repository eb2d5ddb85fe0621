// 2^x for x <= 0 on a vector type, shared by attend()'s softmax step (attend_softmax_simd.inl) and
// the fused Q4 step of kernels_avx512vnni.cpp: included inside the includer's namespace after it
// defines the vector interface `S` (vf, set1, max, round, sub, mul, fmadd, pow2: see
// attend_softmax_simd.inl).

// 2^x for x <= 0, W lanes: the polynomial of attend_softmax.inl, x rounded to the nearest integer
// i, 2^i applied by S::pow2. Lanes below -125 (and NaN: max returns its second operand) give
// 2^-125.
inline S::vf exp2_nonpositive(S::vf x) {
  x = S::max(x, S::set1(-125.0f));
  const S::vf i = S::round(x);
  const S::vf f = S::mul(S::sub(x, i), S::set1(0.69314718f));
  S::vf p = S::set1(1.0f / 720.0f);
  p = S::fmadd(p, f, S::set1(1.0f / 120.0f));
  p = S::fmadd(p, f, S::set1(1.0f / 24.0f));
  p = S::fmadd(p, f, S::set1(1.0f / 6.0f));
  p = S::fmadd(p, f, S::set1(0.5f));
  p = S::fmadd(p, f, S::set1(1.0f));
  p = S::fmadd(p, f, S::set1(1.0f));
  return S::pow2(p, i);
}
