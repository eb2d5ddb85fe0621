// Q4 key scores of decode attention in integer arithmetic for AVX2 CPUs with AVX-VNNI (the VEX
// vpdpbusd on 256-bit vectors: Intel Alder Lake and later client cores, AMD Zen 5), which have no
// AVX-512. Compiled with -mavx2 -mfma -mf16c -mavxvnni: everything stays in this file's anonymous
// namespace (see kernels_internal.hpp) except the entry point, which avx2::get() installs only on
// CPUs that have AVX-VNNI.
//
// The arithmetic is that of kernels_avx512vnni.cpp: the folded query q_d * scale_d is one int8
// value per channel on a grid of max|q s| / 127 per query, the rounding error's share common to
// all tokens is added back, and the codes (0..15) are the unsigned operand. What differs is the
// transpose: AVX2 has no byte permute across
// lanes, so the codes of a channel quad are transposed in-lane with unpacks, once per group into
// a small scratch, the low nibbles (tokens 0..15) in the low 128-bit lane and the high nibbles
// (tokens 16..31) in the high one; and with 16 registers the queries take their turns over it.
#include "kernels_internal.hpp"
#if 0  // INTERIM: old Q4 layout, being ported

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
#include "q4_headers.inl"
#include "row_prefetch.inl"
#include "q4_int8.inl"

alignas(16) constexpr std::uint8_t zero_codes[16] = {};

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

// The codes of one channel quad (rows = the 16 code bytes of blocks c0..c3), transposed: t[k]
// holds in its low lane tokens 4k..4k+3 and in its high lane tokens 16+4k..19+4k, each dword the
// four channels' codes of one token.
inline void transpose_quad(const std::uint8_t* c0, const std::uint8_t* c1, const std::uint8_t* c2,
                           const std::uint8_t* c3, __m256i* t) {
  const __m256i nib = _mm256_set1_epi8(0x0F);
  const __m256i shift = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);  // high lane: the high nibbles
  auto row = [&](const std::uint8_t* c) {
    const __m256i x = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
    return _mm256_and_si256(_mm256_srlv_epi32(x, shift), nib);
  };
  const __m256i r0 = row(c0), r1 = row(c1), r2 = row(c2), r3 = row(c3);
  const __m256i a = _mm256_unpacklo_epi8(r0, r1), b = _mm256_unpackhi_epi8(r0, r1);
  const __m256i c = _mm256_unpacklo_epi8(r2, r3), d = _mm256_unpackhi_epi8(r2, r3);
  t[0] = _mm256_unpacklo_epi16(a, c);
  t[1] = _mm256_unpackhi_epi16(a, c);
  t[2] = _mm256_unpacklo_epi16(b, d);
  t[3] = _mm256_unpackhi_epi16(b, d);
}

inline __m256i dword_of(const std::int8_t* p) {
  std::int32_t x;
  __builtin_memcpy(&x, p, sizeof x);
  return _mm256_set1_epi32(x);
}

template <unsigned NQ>
void scores_nq(const float* q, const q4_block* k, unsigned tokens, unsigned hd, float* out, std::size_t out_stride,
               row_prefetch* pf) {
  // Pass 1: the largest |q_d s_d| of each query, and sum_d q_d m_d.
  __m256 qmax[NQ], mterm[NQ];
  for (unsigned i = 0; i < NQ; ++i) qmax[i] = mterm[i] = _mm256_setzero_ps();
  alignas(32) float scales[cached_channels];
  const bool cached = hd <= cached_channels;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (unsigned c = 0; c < hd; c += 8) {
    const unsigned n = hd - c < 8 ? hd - c : 8;
    __m256 s, m;
    q4_scale_min8(k + c, 1, n, s, m);
    if (cached) _mm256_store_ps(scales + c, s);
    for (unsigned i = 0; i < NQ; ++i) {
      const __m256 qv = load_n(q + i * hd + c, n);
      qmax[i] = _mm256_max_ps(qmax[i], _mm256_andnot_ps(sign, _mm256_mul_ps(qv, s)));
      mterm[i] = _mm256_fmadd_ps(qv, m, mterm[i]);
    }
  }
  query_split qs[NQ];
  for (unsigned i = 0; i < NQ; ++i) qs[i] = split_of(hmax8(qmax[i]), hsum8(mterm[i]));

  // Pass 2, per chunk of channels: transpose its codes, fold the queries over it to int8 (with
  // the sums of y_d = x_d / scale and of Y_d = round(y_d)), then each query's integer dot products
  // (four 8-token vectors).
  alignas(32) __m256i acc[NQ][4];
  __m256 ysum[NQ];
  __m256i yisum[NQ];
  for (unsigned i = 0; i < NQ; ++i) {
    for (unsigned r = 0; r < 4; ++r) acc[i][r] = _mm256_setzero_si256();
    ysum[i] = _mm256_setzero_ps();
    yisum[i] = _mm256_setzero_si256();
  }
  alignas(32) __m256i codes[key_chunk / 4][4];
  alignas(32) std::int8_t qy[NQ][key_chunk];
  for (unsigned c0 = 0; c0 < hd; c0 += key_chunk) {
    const unsigned nd = hd - c0 < key_chunk ? hd - c0 : key_chunk;
    const unsigned quads = (nd + 3) / 4;
    for (unsigned j = 0; j < quads; ++j) {
      const unsigned c = c0 + 4 * j;
      const q4_block* b = k + c;
      transpose_quad(b[0].codes, c + 1 < hd ? b[1].codes : zero_codes, c + 2 < hd ? b[2].codes : zero_codes,
                     c + 3 < hd ? b[3].codes : zero_codes, codes[j]);
    }
    for (unsigned j = 0; j < 4 * quads; j += 32) {  // channels past nd get weight 0
      __m256 s[4];
      for (unsigned r = 0; r < 4; ++r) {
        const unsigned at = j + 8 * r, n = nd > at ? (nd - at < 8 ? nd - at : 8) : 0;
        __m256 m;
        s[r] = _mm256_setzero_ps();
        if (n == 0) continue;
        if (cached) s[r] = load_n(scales + c0 + at, n);
        else q4_scale_min8(k + c0 + at, 1, n, s[r], m);
      }
      for (unsigned i = 0; i < NQ; ++i) {
        __m256i y[4];
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
    for (unsigned i = 0; i < NQ; ++i) {
      __m256i h0 = acc[i][0], h1 = acc[i][1], h2 = acc[i][2], h3 = acc[i][3];
      row_prefetch* f = i == 0 ? pf : nullptr;  // spread over the first query's quads
      for (unsigned j = 0; j < quads; ++j) {
        if (f != nullptr) f->rows(1);
        const __m256i w = dword_of(qy[i] + 4 * j);
        dpbusd(h0, _mm256_load_si256(&codes[j][0]), w);
        dpbusd(h1, _mm256_load_si256(&codes[j][1]), w);
        dpbusd(h2, _mm256_load_si256(&codes[j][2]), w);
        dpbusd(h3, _mm256_load_si256(&codes[j][3]), w);
      }
      acc[i][0] = h0, acc[i][1] = h1, acc[i][2] = h2, acc[i][3] = h3;
    }
  }

  // Back to floats, and from the vectors' token order (low lanes 0..15, high lanes 16..31) to
  // the tokens' order.
  // score = scale (sum_d Y_d c_d + 8 sum_d (y_d - Y_d)) + sum_d q_d m_d.
  for (unsigned i = 0; i < NQ; ++i) {
    alignas(32) std::int32_t yi[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(yi), yisum[i]);
    std::int32_t ytotal = 0;
    for (const std::int32_t x : yi) ytotal += x;
    const float e = hsum8(ysum[i]) - static_cast<float>(ytotal);
    const __m256 scale = _mm256_set1_ps(qs[i].scale), base = _mm256_set1_ps(qs[i].scale * 8.0f * e + qs[i].mc);
    __m256 v[4];
    for (unsigned r = 0; r < 4; ++r) v[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i][r]), scale, base);
    const __m256 o[4] = {_mm256_permute2f128_ps(v[0], v[1], 0x20), _mm256_permute2f128_ps(v[2], v[3], 0x20),
                         _mm256_permute2f128_ps(v[0], v[1], 0x31), _mm256_permute2f128_ps(v[2], v[3], 0x31)};
    float* dst = out + i * out_stride;
    for (unsigned r = 0; r < 4 && 8 * r < tokens; ++r) {
      const unsigned n = tokens - 8 * r < 8 ? tokens - 8 * r : 8;
      if (n == 8) _mm256_storeu_ps(dst + 8 * r, o[r]);
      else _mm256_maskstore_ps(dst + 8 * r, mask(n), o[r]);
    }
  }
}

}  // namespace

void scores_q4(const float* q, std::uint32_t nq, const q4_block* k, std::uint32_t tokens, std::uint32_t head_dim,
               float* out, std::size_t out_stride, prefetch_region pf) {
  scores_q4_by_four(q, nq, k, tokens, head_dim, out, out_stride, pf);
}

}  // namespace kvcache::kernels::avx2vnni
#endif  // INTERIM
