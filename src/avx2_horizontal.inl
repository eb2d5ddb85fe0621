// Horizontal max and sum of 8 float lanes, shared by the AVX2 files: included inside each one's
// anonymous namespace, so every copy is compiled with that file's flags (see kernels_internal.hpp).

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Lanes 4 g .. 4 g + 3 of x (g = 0 or 1) to p[0..3].
inline void store_quad8(float* p, __m256 x, unsigned g) {
  _mm_storeu_ps(p, g == 0 ? _mm256_castps256_ps128(x) : _mm256_extractf128_ps(x, 1));
}

// Transposing reduction of 8 vectors: lane j of the result = op over the lanes of v[j]. Each of
// its three levels pairs vectors x, y with one shuffle and one blend, where a classic tree takes
// two shuffles: shuffle(x, y) + blend(x, y) holds x's lanes folded in half on one side and y's
// on the other. Blends run on every vector port, shuffles on fewer: measured on Zen 4 inside the
// dense score kernel (16 accumulators), 35-36 cycles per token and query quad against 37 for the
// two-shuffle tree (and 42-44 with 512-bit accumulators and their four-level tree).
// Always inlined, as the reductions built on it (V::reduce of kernels_avx2.cpp and of
// kernels_avx512.cpp's ymm): GCC 12 called it out of line from the score kernels, which then
// stored their accumulators to memory for it to load.
// (measurements: bench/PERFORMANCE.md, session 70)
template <class Op>
[[gnu::always_inline]] inline __m256 tree8(const __m256* v, Op op) {
  // Output lane j of the folds below comes from input order[j]: the order is its own inverse.
  constexpr unsigned order[8] = {0, 4, 2, 6, 1, 5, 3, 7};
  __m256 a[4], b[2];
  for (unsigned k = 0; k < 4; ++k) {  // 128-bit halves: [x.lo op x.hi, y.lo op y.hi]
    const __m256 x = v[order[2 * k]], y = v[order[2 * k + 1]];
    a[k] = op(_mm256_permute2f128_ps(x, y, 0x21), _mm256_blend_ps(x, y, 0xF0));
  }
  for (unsigned k = 0; k < 2; ++k) {  // 64-bit pairs within each half
    const __m256 x = a[2 * k], y = a[2 * k + 1];
    const __m256 swapped = _mm256_castpd_ps(_mm256_shuffle_pd(_mm256_castps_pd(x), _mm256_castps_pd(y), 0x5));
    b[k] = op(swapped, _mm256_blend_ps(x, y, 0xCC));
  }
  // Single lanes: [x1, y0, x3, y2] op [x0, y1, x2, y3] per half.
  const __m256 swapped = _mm256_blend_ps(_mm256_movehdup_ps(b[0]), _mm256_moveldup_ps(b[1]), 0xAA);
  return op(swapped, _mm256_blend_ps(b[0], b[1], 0xAA));
}
