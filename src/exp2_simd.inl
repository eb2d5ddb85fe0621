// 2^x for x <= 0 on a vector type, shared by attend()'s softmax step (attend_softmax_simd.inl) and
// the fused Q4 steps of q4_int8_avx512.inl and q4_attend_step.inl: included inside the
// includer's namespace after it defines the vector interface `S` (vf, set1, max, round, sub, mul,
// fmadd, pow2: see avx512_float_ops.inl, avx2_float_ops.inl).

// 2^x for x <= 0, W lanes: x rounded to the nearest integer i, a polynomial for 2^(x - i)
// (coefficients c[0..N), lowest first, evaluated by Horner), 2^i applied by S::pow2. Lanes below
// -125 (and NaN: max returns its second operand) give 2^-125.
#include "exp2_poly.inl"
template <unsigned N>
inline S::vf exp2_by(S::vf x, const float (&c)[N]) {
  x = S::max(x, S::set1(-125.0f));
  const S::vf i = S::round(x);
  const S::vf f = S::sub(x, i);
  S::vf p = S::set1(c[N - 1]);
  for (unsigned k = N - 1; k-- > 0;) p = S::fmadd(p, f, S::set1(c[k]));
  return S::pow2(p, i);
}

// With the degree-5 polynomial of exp2_poly.inl (relative error 2.4e-7).
inline S::vf exp2_nonpositive(S::vf x) {
  static constexpr float c[] = {exp2_c0, exp2_c1, exp2_c2, exp2_c3, exp2_c4, exp2_c5};
  return exp2_by(x, c);
}

// 2^x for x <= 0 to 7.5e-5 relative: the degree-3 polynomial of exp2_poly.inl (two FMAs fewer).
// For the weights 2^(s_t - tile max) of the fused Q4 steps, which go to 8 bits next (a grid step
// of 1/255 of the largest weight): their sum (the softmax's denominator) then carries at most
// 7.5e-5 of relative error, against 3.9e-3 for the Q4 output.
inline S::vf exp2_weights(S::vf x) {
  static constexpr float c[] = {exp2_d3_c0, exp2_d3_c1, exp2_d3_c2, exp2_d3_c3};
  return exp2_by(x, c);
}
