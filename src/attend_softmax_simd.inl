// The online-softmax step of attend() written once against a small vector interface `S` that
// attend_avx2.cpp and attend_avx512.cpp define just before including this file inside their own
// namespace (after attend_softmax.inl in namespace `generic`, whose scalar exp2 serves the tails).
// S: vf, W (lanes), set1 zero load store add sub mul max fmadd, round (to nearest integer),
// pow2(p, i) = p * 2^i for integral i, hmax, hsum, any_greater(a, b) (some lane a > b).

namespace {

#include "exp2_simd.inl"

}  // namespace

void softmax_tile(float* s, std::uint32_t tile, std::uint32_t n, std::uint32_t group, std::uint32_t head_dim,
                  float* run_max, float* run_sum, float* acc) {
  const std::uint32_t nv = n / S::W * S::W;  // lanes in whole vectors; the rest is scalar
  for (std::uint32_t i = 0; i < group; ++i) {
    float* row = s + static_cast<std::size_t>(i) * tile;
    S::vf mx = S::set1(-__builtin_inff());
    for (std::uint32_t t = 0; t < nv; t += S::W) mx = S::max(mx, S::load(row + t));
    float tail_max = -__builtin_inff();
    for (std::uint32_t t = nv; t < n; ++t) tail_max = row[t] > tail_max ? row[t] : tail_max;
    // max(tile max, running max); the horizontal max only where some score passes the running
    // max, which after the first tiles is rare.
    float m_new = run_max[i];
    if (S::any_greater(mx, S::set1(m_new)) || tail_max > m_new) {
      const float hm = S::hmax(mx);
      const float tile_max = hm > tail_max ? hm : tail_max;
      m_new = tile_max > m_new ? tile_max : m_new;
    }
    const S::vf m = S::set1(m_new);
    S::vf sum = S::zero();
    for (std::uint32_t t = 0; t < nv; t += S::W) {
      const S::vf w = exp2_nonpositive(S::sub(S::load(row + t), m));
      S::store(row + t, w);
      sum = S::add(sum, w);
    }
    float total = S::hsum(sum);
    for (std::uint32_t t = nv; t < n; ++t) {
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
