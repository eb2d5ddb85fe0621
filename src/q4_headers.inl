// Reading the header words (scale | min << 16) of Q4 blocks into vectors, shared by the x86 ISA
// files: included inside each one's anonymous namespace, so every copy is compiled with that
// file's flags and stays internal to it (see kernels_internal.hpp). Scalar loads and inserts
// rather than vpgatherdd, which is microcoded and several times slower on AMD Zen 4/5 (and no
// faster on Intel for so few elements).

inline std::uint32_t q4_header(const q4_block* b) {
  std::uint32_t x;
  __builtin_memcpy(&x, b, sizeof x);
  return x;
}

// The header words of the n (any; 4 used) blocks b[j * stride], j < 4, 0 beyond n.
inline __m128i q4_headers4(const q4_block* b, std::size_t stride, unsigned n) {
  __m128i x = _mm_cvtsi32_si128(n > 0 ? static_cast<int>(q4_header(b)) : 0);
  x = _mm_insert_epi32(x, n > 1 ? static_cast<int>(q4_header(b + stride)) : 0, 1);
  x = _mm_insert_epi32(x, n > 2 ? static_cast<int>(q4_header(b + 2 * stride)) : 0, 2);
  return _mm_insert_epi32(x, n > 3 ? static_cast<int>(q4_header(b + 3 * stride)) : 0, 3);
}

#if defined(__AVX2__)
// Scales and minimums of the n (<= 8) blocks b[j * stride], as floats (0 beyond n).
inline void q4_scale_min8(const q4_block* b, std::size_t stride, unsigned n, __m256& s, __m256& m) {
  const __m128i lo = q4_headers4(b, stride, n);
  const __m128i hi = n > 4 ? q4_headers4(b + 4 * stride, stride, n - 4) : _mm_setzero_si128();
  const __m256i dw = _mm256_set_m128i(hi, lo);
  const __m256i sm = _mm256_permute4x64_epi64(
      _mm256_packus_epi32(_mm256_and_si256(dw, _mm256_set1_epi32(0xffff)), _mm256_srli_epi32(dw, 16)), 0xD8);
  s = _mm256_cvtph_ps(_mm256_castsi256_si128(sm));
  m = _mm256_cvtph_ps(_mm256_extracti128_si256(sm, 1));
}
#endif

#if defined(__AVX512F__)
// Scales and minimums of the n (<= 16) blocks b[j * stride], as floats (0 beyond n).
inline void q4_scale_min16(const q4_block* b, std::size_t stride, unsigned n, __m512& s, __m512& m) {
  __m512i dw = _mm512_castsi128_si512(q4_headers4(b, stride, n));
  if (n > 4) dw = _mm512_inserti32x4(dw, q4_headers4(b + 4 * stride, stride, n - 4), 1);
  if (n > 8) dw = _mm512_inserti32x4(dw, q4_headers4(b + 8 * stride, stride, n - 8), 2);
  if (n > 12) dw = _mm512_inserti32x4(dw, q4_headers4(b + 12 * stride, stride, n - 12), 3);
  s = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dw));                         // scale: low half
  m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dw, 16)));  // min: high half
}

// Scales and minimums of the `count` (0..16) consecutive blocks b[0..count), 0 beyond: block j's
// header is dword 5 j of the run (blocks are 20 bytes), so dword permutes gather them without a
// gather instruction. Masked loads read no byte past the last block.
inline void q4_consecutive_scale_min16(const q4_block* b, unsigned count, __m512& s, __m512& m) {
  const auto* d = reinterpret_cast<const int*>(b);
  const unsigned dwords = 5 * count;
  auto part = [&](unsigned r) {
    const unsigned n = dwords <= 16 * r ? 0u : (dwords - 16 * r >= 16 ? 16u : dwords - 16 * r);
    return _mm512_maskz_loadu_epi32(static_cast<__mmask16>((1u << n) - 1u), d + 16 * r);
  };
  const __m512i i01 = _mm512_setr_epi32(0, 5, 10, 15, 20, 25, 30, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i i23 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 3, 8, 13, 18, 23, 28, 0, 0, 0);
  const __m512i i4 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 6, 11);
  __m512i sm = _mm512_permutex2var_epi32(part(0), i01, part(1));                                        // blocks 0..6
  sm = _mm512_mask_mov_epi32(sm, __mmask16(0x1F80), _mm512_permutex2var_epi32(part(2), i23, part(3)));  // 7..12
  sm = _mm512_mask_mov_epi32(sm, __mmask16(0xE000), _mm512_permutexvar_epi32(i4, part(4)));             // 13..15
  s = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(sm));
  m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(sm, 16)));
}

// Over lanes that are blocks k = t * NB + g (NB a power of two <= 16): lane l, and so every lane
// of its class l % NB, becomes op over the lanes of that class (a butterfly).
template <unsigned NB, class Op>
inline __m512 q4_fold(__m512 x, Op op) {
  if constexpr (NB <= 8) x = op(x, _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(1, 0, 3, 2)));
  if constexpr (NB <= 4) x = op(x, _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(2, 3, 0, 1)));
  if constexpr (NB <= 2) x = op(x, _mm512_permute_ps(x, _MM_SHUFFLE(1, 0, 3, 2)));
  if constexpr (NB <= 1) x = op(x, _mm512_permute_ps(x, _MM_SHUFFLE(2, 3, 0, 1)));
  return x;
}
#endif
