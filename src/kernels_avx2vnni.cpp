// Q4 key scores of decode attention in integer arithmetic for AVX2 CPUs with AVX-VNNI (the VEX
// vpdpbusd on 256-bit vectors: Intel Alder Lake and later client cores, AMD Zen 5), which have no
// AVX-512. Compiled with -mavx2 -mfma -mf16c -mavxvnni: everything stays in this file's anonymous
// namespace (see kernels_internal.hpp) except the entry point, which avx2::get() installs only on
// CPUs that have AVX-VNNI.
//
// The arithmetic is that of kernels_avx512vnni.cpp: the folded query q_d * scale_d is one int8
// value per channel on a grid of max|q s| / 127 per query, the rounding error's share common to
// all tokens is added back, and the codes (0..15) are the unsigned operand. A key channel quad of
// the group (format.hpp) is one 64-byte row, two vectors here: dword j of the first holds the four
// channels' codes of tokens j (low nibbles) and 16 + j (high nibbles), of the second tokens 8 + j
// and 24 + j; masking the nibbles (the high ones left in place: codes times 16) gives the four
// 8-token vectors vpdpbusd takes as they are. With 16 registers the queries take their turns over
// the codes two at a time.
#include "kernels_internal.hpp"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

namespace kvcache::kernels::avx2vnni {
namespace {

#include "avx2_horizontal.inl"
#include "q4_int8.inl"

// Lane masks for maskload/maskstore: tail_mask + 8 - n selects the first n of 8 lanes.
alignas(32) constexpr std::int32_t tail_mask[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
inline __m256i mask(unsigned n) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tail_mask + 8 - n)); }

// acc += dot products of the unsigned bytes of u with the signed bytes of s, four per dword.
inline void dpbusd(__m256i& acc, __m256i u, __m256i s) {
#if defined(__GNUC__) && !defined(__clang__)
  __asm__("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(u), "x"(s));
#else
  acc = _mm256_dpbusd_avx_epi32(acc, u, s);
#endif
}

// Y[0..4) (int32, |Y| <= 127, 32 lanes) written as 32 int8.
inline void pack32(const __m256i* y, std::int8_t* dst) {
  // The packs work within 128-bit lanes: dword order 0 4 1 5 2 6 3 7 restores the lanes' order.
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                      _mm256_permutevar8x32_epi32(
                          _mm256_packs_epi16(_mm256_packs_epi32(y[0], y[1]), _mm256_packs_epi32(y[2], y[3])), order));
}

inline __m256 load_n(const float* p, unsigned n) {
  return n >= 8 ? _mm256_loadu_ps(p) : n == 0 ? _mm256_setzero_ps() : _mm256_maskload_ps(p, mask(n));
}

// The n (<= 8) halves from p as floats. Past n, up to the next even count, a half of the group's
// padding channels (0) may be read; nothing further.
inline __m256 halves(const std::uint8_t* p, unsigned n) {
  const __m128i h = n >= 8 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))
                           : _mm_maskload_epi32(reinterpret_cast<const int*>(p),
                                                _mm256_castsi256_si128(mask((n + 1) / 2)));
  return _mm256_cvtph_ps(h);
}

inline __m256i dword_of(const std::int8_t* p) {
  std::int32_t x;
  __builtin_memcpy(&x, p, sizeof x);
  return _mm256_set1_epi32(x);
}

// acc[i][r] (tokens 8 r .. 8 r + 7; r >= 2: codes times 16) += the dot products of P (1, 2)
// queries' int8 values y[i] with the codes of `quads` channel quads from `codes`.
template <unsigned P>
__attribute__((always_inline)) inline void dot_quads(const std::uint8_t* codes, unsigned quads, const std::int8_t (*y)[key_chunk],
                                                     __m256i (*acc)[4], line_prefetch& pf) {
  line_prefetch f = pf;  // in registers
  const __m256i nib_lo = _mm256_set1_epi8(0x0F), nib_hi = _mm256_set1_epi8(static_cast<char>(0xF0));
  __m256i h[P][4];
  #pragma GCC unroll 4
  for (unsigned i = 0; i < P; ++i)
    #pragma GCC unroll 4
    for (unsigned r = 0; r < 4; ++r) h[i][r] = acc[i][r];
  for (unsigned j = 0; j < quads; ++j) {
    f.rows(1);
    const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64 * j));
    const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64 * j + 32));
    const __m256i c[4] = {_mm256_and_si256(x0, nib_lo), _mm256_and_si256(x1, nib_lo), _mm256_and_si256(x0, nib_hi),
                          _mm256_and_si256(x1, nib_hi)};
    #pragma GCC unroll 2
    for (unsigned i = 0; i < P; ++i) {
      const __m256i w = dword_of(y[i] + 4 * j);
      #pragma GCC unroll 4
      for (unsigned r = 0; r < 4; ++r) dpbusd(h[i][r], c[r], w);
    }
  }
  #pragma GCC unroll 4
  for (unsigned i = 0; i < P; ++i)
    #pragma GCC unroll 4
    for (unsigned r = 0; r < 4; ++r) acc[i][r] = h[i][r];
  pf = f;
}

template <unsigned NQ>
void scores_nq(const float* q, const std::uint8_t* k, unsigned tokens, unsigned hd, float* out, std::size_t out_stride,
               line_prefetch& pf) {
  const std::uint8_t* ks = k + key_scales_at(hd);
  const std::uint8_t* km = k + key_mins_at(hd);
  // Pass 1: the largest |q_d s_d| of each query, and sum_d q_d m_d.
  __m256 qmax[NQ], mterm[NQ];
  #pragma GCC unroll 4
  for (unsigned i = 0; i < NQ; ++i) qmax[i] = mterm[i] = _mm256_setzero_ps();
  alignas(32) float scales[cached_channels];
  const bool cached = hd <= cached_channels;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (unsigned c = 0; c < hd; c += 8) {
    const unsigned n = hd - c < 8 ? hd - c : 8;
    const __m256 s = halves(ks + 2 * c, n), m = halves(km + 2 * c, n);
    if (cached) _mm256_store_ps(scales + c, s);
    #pragma GCC unroll 4
    for (unsigned i = 0; i < NQ; ++i) {
      const __m256 qv = load_n(q + i * hd + c, n);
      qmax[i] = _mm256_max_ps(qmax[i], _mm256_andnot_ps(sign, _mm256_mul_ps(qv, s)));
      mterm[i] = _mm256_fmadd_ps(qv, m, mterm[i]);
    }
  }
  query_split qs[NQ];
  for (unsigned i = 0; i < NQ; ++i) qs[i] = split_of(hmax8(qmax[i]), hsum8(mterm[i]));

  // Pass 2, per chunk of channels: fold the queries over it to int8 (with the sums of
  // y_d = x_d / scale and of Y_d = round(y_d)), then the integer dot products over its channel
  // quads (four 8-token vectors a query).
  __m256i acc[NQ][4];
  __m256 ysum[NQ];
  __m256i yisum[NQ];
  #pragma GCC unroll 4
  for (unsigned i = 0; i < NQ; ++i) {
    #pragma GCC unroll 4
    for (unsigned r = 0; r < 4; ++r) acc[i][r] = _mm256_setzero_si256();
    ysum[i] = _mm256_setzero_ps();
    yisum[i] = _mm256_setzero_si256();
  }
  alignas(32) std::int8_t qy[NQ][key_chunk];
  for (unsigned c0 = 0; c0 < hd; c0 += key_chunk) {
    const unsigned nd = hd - c0 < key_chunk ? hd - c0 : key_chunk;
    const unsigned quads = (nd + 3) / 4;
    for (unsigned j = 0; j < 4 * quads; j += 32) {  // channels past nd get Y = 0
      __m256 s[4];
      #pragma GCC unroll 4
      for (unsigned r = 0; r < 4; ++r) {
        const unsigned at = j + 8 * r, n = nd > at ? (nd - at < 8 ? nd - at : 8) : 0;
        s[r] = _mm256_setzero_ps();
        if (n == 0) continue;
        if (cached) s[r] = load_n(scales + c0 + at, n);
        else s[r] = halves(ks + 2 * (c0 + at), n);
      }
      #pragma GCC unroll 4
      for (unsigned i = 0; i < NQ; ++i) {
        __m256i y[4];
        #pragma GCC unroll 4
        for (unsigned r = 0; r < 4; ++r) {
          const unsigned at = j + 8 * r, n = nd > at ? (nd - at < 8 ? nd - at : 8) : 0;
          const __m256 yf = _mm256_mul_ps(_mm256_mul_ps(load_n(q + i * hd + c0 + at, n), s[r]), _mm256_set1_ps(qs[i].inv));
          y[r] = _mm256_cvtps_epi32(yf);
          ysum[i] = _mm256_add_ps(ysum[i], yf);
          yisum[i] = _mm256_add_epi32(yisum[i], y[r]);
        }
        pack32(y, qy[i] + j);
      }
    }
    // The last quad of a head_dim that is not a multiple of 4 has codes 0 past it, and Y is 0
    // there. The prefetch is spread over the first pass's quads.
    const std::uint8_t* codes = k + std::size_t{16} * c0;
    unsigned i = 0;
    line_prefetch none;
    for (; i + 2 <= NQ; i += 2) dot_quads<2>(codes, quads, qy + i, acc + i, i == 0 ? pf : none);
    if (i < NQ) dot_quads<1>(codes, quads, qy + i, acc + i, i == 0 ? pf : none);
  }

  // Back to floats: score = scale (sum_d Y_d c_d + 8 sum_d (y_d - Y_d)) + sum_d q_d m_d, the
  // vectors of tokens 16..31 summed with their codes times 16.
  for (unsigned i = 0; i < NQ; ++i) {
    alignas(32) std::int32_t yi[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(yi), yisum[i]);
    std::int32_t ytotal = 0;
    for (const std::int32_t x : yi) ytotal += x;
    const float e = hsum8(ysum[i]) - static_cast<float>(ytotal);
    const __m256 base = _mm256_set1_ps(qs[i].scale * 8.0f * e + qs[i].mc);
    float* dst = out + i * out_stride;
    for (unsigned r = 0; r < 4 && 8 * r < tokens; ++r) {
      const __m256 scale = _mm256_set1_ps(r < 2 ? qs[i].scale : qs[i].scale * 0.0625f);
      const __m256 o = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i][r]), scale, base);
      const unsigned n = tokens - 8 * r < 8 ? tokens - 8 * r : 8;
      if (n == 8) _mm256_storeu_ps(dst + 8 * r, o);
      else _mm256_maskstore_ps(dst + 8 * r, mask(n), o);
    }
  }
}

}  // namespace

void scores_q4(const float* q, std::uint32_t nq, const std::uint8_t* k, std::uint32_t tokens, std::uint32_t head_dim,
               float* out, std::size_t out_stride, prefetch_region pf) {
  if (head_dim > int8_key_channels) {  // see int8_key_channels
    avx2::float_q4().scores_q4(q, nq, k, tokens, head_dim, out, out_stride, pf);
    return;
  }
  scores_q4_by_four(q, nq, k, tokens, head_dim, out, out_stride, pf);
}

}  // namespace kvcache::kernels::avx2vnni
