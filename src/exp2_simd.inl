// 2^x for x <= 0 on a vector type, shared by attend()'s softmax step (attend_softmax_simd.inl) and
// the fused Q4 step of kernels_avx512vnni.cpp: included inside the includer's namespace after it
// defines the vector interface `S` (vf, set1, max, round, sub, mul, fmadd, pow2: see
// attend_softmax_simd.inl).

// 2^x for x <= 0, W lanes: the polynomial of attend_softmax.inl (the same coefficients, written
// out here: this file may be included where that one is not), x rounded to the nearest integer
// i, 2^i applied by S::pow2. Lanes below -125 (and NaN: max returns its second operand) give
// 2^-125.
inline S::vf exp2_nonpositive(S::vf x) {
  x = S::max(x, S::set1(-125.0f));
  const S::vf i = S::round(x);
  const S::vf f = S::sub(x, i);
  S::vf p = S::set1(0.00132764725f);
  p = S::fmadd(p, f, S::set1(0.00967554096f));
  p = S::fmadd(p, f, S::set1(0.0555071309f));
  p = S::fmadd(p, f, S::set1(0.240221202f));
  p = S::fmadd(p, f, S::set1(0.693146944f));
  p = S::fmadd(p, f, S::set1(1.00000012f));
  return S::pow2(p, i);
}
