// The online-softmax step of attend(), written as plain loops that the compiler vectorizes with
// the including file's ISA flags. Included inside a per-ISA namespace (attend_<isa>.cpp) or the
// generic one (attend.cpp); no std:: inline functions here (ODR, see kernels_internal.hpp).

namespace {

// 2^x for x <= 0 (below -125: 2^-125, negligible next to the running max's weight 1). Round to
// the nearest integer i, then the polynomial of exp2_poly.inl for 2^f, |f| <= 0.5, times 2^i
// built in the exponent bits.
#include "exp2_poly.inl"
inline float exp2_nonpositive(float x) {
  x = x < -125.0f ? -125.0f : x;
  const int i = -static_cast<int>(0.5f - x);  // round(x) for x <= 0
  const float f = x - static_cast<float>(i);
  float p = exp2_c5;
  p = p * f + exp2_c4;
  p = p * f + exp2_c3;
  p = p * f + exp2_c2;
  p = p * f + exp2_c1;
  p = p * f + exp2_c0;
  const std::uint32_t e = static_cast<std::uint32_t>(i + 127) << 23;
  float scale;
  __builtin_memcpy(&scale, &e, sizeof scale);
  return p * scale;
}

inline float row_max(const float* row, std::uint32_t n) {
  constexpr std::uint32_t L = 16;
  float m[L];
  for (std::uint32_t j = 0; j < L; ++j) m[j] = row[0];
  std::uint32_t t = 0;
  for (; t + L <= n; t += L)
    for (std::uint32_t j = 0; j < L; ++j) m[j] = row[t + j] > m[j] ? row[t + j] : m[j];
  for (; t < n; ++t) m[0] = row[t] > m[0] ? row[t] : m[0];
  float r = m[0];
  for (std::uint32_t j = 1; j < L; ++j) r = m[j] > r ? m[j] : r;
  return r;
}

// Weights 2^(row[t] - m) in place, and their sum. Sixteen partial sums, so that the loop
// vectorizes without reassociating a single sum.
inline float exp_row(float* row, std::uint32_t n, float m) {
  constexpr std::uint32_t L = 16;
  float part[L] = {};
  std::uint32_t t = 0;
  for (; t + L <= n; t += L)
    for (std::uint32_t j = 0; j < L; ++j) {
      const float w = exp2_nonpositive(row[t + j] - m);
      row[t + j] = w;
      part[j] += w;
    }
  for (; t < n; ++t) {
    const float w = exp2_nonpositive(row[t] - m);
    row[t] = w;
    part[0] += w;
  }
  float sum = 0.0f;
  for (std::uint32_t j = 0; j < L; ++j) sum += part[j];
  return sum;
}

}  // namespace

void softmax_tile(float* s, std::uint32_t tile, std::uint32_t n, std::uint32_t group, std::uint32_t head_dim,
                  float* run_max, float* run_sum, float* acc) {
  for (std::uint32_t i = 0; i < group; ++i) {
    float* row = s + static_cast<std::size_t>(i) * tile;
    const float mx = row_max(row, n);
    const float m_new = mx > run_max[i] ? mx : run_max[i];
    const float sum = exp_row(row, n, m_new);
    if (m_new != run_max[i]) {
      // First tile: run_max is -inf and acc, run_sum are 0: the correction factor is 0.
      const float corr = run_max[i] < -3.0e38f ? 0.0f : exp2_nonpositive(run_max[i] - m_new);
      float* a = acc + static_cast<std::size_t>(i) * head_dim;
      for (std::uint32_t d = 0; d < head_dim; ++d) a[d] *= corr;
      run_sum[i] *= corr;
      run_max[i] = m_new;
    }
    run_sum[i] += sum;
  }
}
