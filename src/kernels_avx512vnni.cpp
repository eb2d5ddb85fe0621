// Q4 key scores of decode attention in integer arithmetic, for CPUs with AVX-512 VNNI (vpdpbusd:
// 64 u8 x s8 products per instruction) and VBMI (vpermb, vpermt2b). Compiled with those flags:
// everything stays in this file's anonymous namespace (see kernels_internal.hpp) except the entry
// point, which avx512::get() installs only on CPUs that have both extensions.
//
// The folded query q_d * scale_d is split into two int8 parts with one scale per query,
// x = scale * (hi + lo / 254), |hi|, |lo| <= 127, which keeps 15 bits of it (error <= 1 / (2 * 127
// * 254) of the largest |x|). One int8 part alone would lose the small channels next to an
// outlier channel, whose large key scale dominates the folded query. The codes (0..15) are the
// unsigned operand, as they are stored.
//
// Values stay in float (kernels_simd.inl): their weights p_t * scale_t need a scale per query,
// block and tile, and that set-up costs as much as the float FMAs it would save (measured on
// Zen 5: 7.0 vs 7.7 ns per token and head with one int8 part; slower with two).
#include "kernels_internal.hpp"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

namespace kvcache::kernels::avx512vnni {
namespace {

#include "q4_int8.inl"

// vpermb index that turns four 16-byte rows (one per 128-bit lane) into 16 dwords, dword t holding
// byte t of each row: rows are channels (keys) or tokens (values).
struct byte_index {
  alignas(64) std::uint8_t b[64];
};
constexpr byte_index make_transpose() {
  byte_index x{};
  for (int t = 0; t < 16; ++t)
    for (int j = 0; j < 4; ++j) x.b[4 * t + j] = static_cast<std::uint8_t>(16 * j + t);
  return x;
}
constexpr byte_index transpose = make_transpose();
alignas(16) constexpr std::uint8_t zero_codes[16] = {};

inline __mmask16 first(unsigned n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1u); }

// Lanes of 16-lane vector r below n.
inline unsigned lanes(unsigned n, unsigned r) { return n <= 16 * r ? 0u : (n - 16 * r < 16 ? n - 16 * r : 16u); }

#include "q4_headers.inl"

// vpermt2b indices that bring the header words of 16 consecutive blocks (byte 20 j of a 320-byte
// run) to dword j, from bytes [0, 128), [128, 256) and [256, 320) of the run.
constexpr byte_index make_headers(int base) {
  byte_index x{};
  for (int j = 0; j < 16; ++j)
    for (int b = 0; b < 4; ++b) {
      const int at = 20 * j + b - base;
      x.b[4 * j + b] = static_cast<std::uint8_t>(at >= 0 && at < 128 ? at : 0);
    }
  return x;
}
constexpr byte_index headers_0 = make_headers(0), headers_128 = make_headers(128), headers_256 = make_headers(256);

// Scales and minimums of 16 consecutive blocks b[0..16) (all present), without a gather.
inline void consecutive_scale_min16(const q4_block* b, __m512& s, __m512& m) {
  const auto* p = reinterpret_cast<const std::uint8_t*>(b);
  const __m512i a = _mm512_permutex2var_epi8(_mm512_loadu_si512(p), _mm512_load_si512(headers_0.b), _mm512_loadu_si512(p + 64));
  const __m512i c = _mm512_permutex2var_epi8(_mm512_loadu_si512(p + 128), _mm512_load_si512(headers_128.b),
                                             _mm512_loadu_si512(p + 192));
  const __m512i d = _mm512_permutexvar_epi8(_mm512_load_si512(headers_256.b), _mm512_loadu_si512(p + 256));
  // dwords 0..6 from [0, 128) (block 6 ends at byte 124), 7..12 from [128, 256), 13..15 from [256, 320).
  __m512i sm = _mm512_mask_mov_epi32(a, __mmask16(0x1F80), c);
  sm = _mm512_mask_mov_epi32(sm, __mmask16(0xE000), d);
  s = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(sm));
  m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(sm, 16)));
}

// vpermt2b index for the codes of four consecutive blocks, from 128 bytes starting at the first
// block's codes: dword t = byte t of each block's codes (codes of block j start 20 j bytes in).
constexpr byte_index make_codes4() {
  byte_index x{};
  for (int t = 0; t < 16; ++t)
    for (int j = 0; j < 4; ++j) x.b[4 * t + j] = static_cast<std::uint8_t>(20 * j + t);
  return x;
}
constexpr byte_index codes_consecutive = make_codes4();

// codes4 for four consecutive blocks b[0..4): the bytes [b[0].codes, +76) hold all their codes.
inline void codes4_consecutive(const q4_block* b, __m512i& lo, __m512i& hi) {
  const auto* p = b[0].codes;
  const __m512i x = _mm512_permutex2var_epi8(_mm512_loadu_si512(p), _mm512_load_si512(codes_consecutive.b),
                                             _mm512_maskz_loadu_epi8(__mmask64(0xFFF), p + 64));
  const __m512i nib = _mm512_set1_epi8(0x0F);
  lo = _mm512_and_si512(x, nib);
  hi = _mm512_and_si512(_mm512_srli_epi16(x, 4), nib);
}

// The codes of four blocks (not consecutive: the last channels of a head), low nibbles and high
// nibbles apart, each transposed: dword t of `lo` holds code t of the four blocks, of `hi` 16 + t.
inline void codes4(const std::uint8_t* c0, const std::uint8_t* c1, const std::uint8_t* c2, const std::uint8_t* c3,
                   __m512i& lo, __m512i& hi) {
  __m512i x = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c0)));
  x = _mm512_inserti32x4(x, _mm_loadu_si128(reinterpret_cast<const __m128i*>(c1)), 1);
  x = _mm512_inserti32x4(x, _mm_loadu_si128(reinterpret_cast<const __m128i*>(c2)), 2);
  x = _mm512_inserti32x4(x, _mm_loadu_si128(reinterpret_cast<const __m128i*>(c3)), 3);
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const __m512i idx = _mm512_load_si512(transpose.b);
  lo = _mm512_permutexvar_epi8(idx, _mm512_and_si512(x, nib));
  hi = _mm512_permutexvar_epi8(idx, _mm512_and_si512(_mm512_srli_epi16(x, 4), nib));
}

// y (|y| <= 127) as hi + lo / 254, 16 lanes each written as int8.
inline void split(__m512 y, std::int8_t* hi, std::int8_t* lo) {
  const __m512 h = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 l = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(y, h), _mm512_set1_ps(lo_scale)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(hi), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(h)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(lo), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(l)));
}

// acc += dot products of the unsigned bytes of u with the signed bytes of s, four per dword
// (vpdpbusd). Inline assembly: GCC 12 models the intrinsic as non-destructive and surrounds every
// one with register copies, which triples the instructions of the inner loops.
inline void dpbusd(__m512i& acc, __m512i u, __m512i s) {
#if defined(__GNUC__) && !defined(__clang__)
  __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
#else
  acc = _mm512_dpbusd_epi32(acc, u, s);
#endif
}

inline __m512i dword_of(const std::int8_t* p) {
  std::int32_t x;
  __builtin_memcpy(&x, p, sizeof x);
  return _mm512_set1_epi32(x);
}

// hi + lo / 254 of two int32 accumulators, as floats.
inline __m512 combine(__m512i hi, __m512i lo) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_set1_ps(1.0f / lo_scale), _mm512_cvtepi32_ps(hi));
}

// ---- keys: lanes = the 32 tokens of the group (two vectors), dot products over channel quads ----

template <unsigned NQ>
void scores_nq(const float* q, const q4_block* k, unsigned tokens, unsigned hd, float* out, std::size_t out_stride) {
  // Pass 1: the largest |q_d s_d| of each query, and sum_d q_d m_d.
  __m512 qmax[NQ], mterm[NQ];
  for (unsigned i = 0; i < NQ; ++i) qmax[i] = mterm[i] = _mm512_setzero_ps();
  alignas(64) float scales[cached_channels];
  const bool cached = hd <= cached_channels;
  for (unsigned c = 0; c < hd; c += 16) {
    const unsigned n = hd - c < 16 ? hd - c : 16;
    __m512 s, m;
    if (n == 16) consecutive_scale_min16(k + c, s, m);
    else q4_scale_min16(k + c, 1, n, s, m);
    if (cached) _mm512_store_ps(scales + c, s);
    for (unsigned i = 0; i < NQ; ++i) {
      const __m512 qv = _mm512_maskz_loadu_ps(first(n), q + i * hd + c);
      qmax[i] = _mm512_max_ps(qmax[i], _mm512_abs_ps(_mm512_mul_ps(qv, s)));
      mterm[i] = _mm512_fmadd_ps(qv, m, mterm[i]);
    }
  }
  query_split qs[NQ];
  for (unsigned i = 0; i < NQ; ++i) qs[i] = split_of(_mm512_reduce_max_ps(qmax[i]), _mm512_reduce_add_ps(mterm[i]));

  // Pass 2: fold and split a chunk of channels, then the integer dot products over it.
  __m512i ah[NQ][2], al[NQ][2];
#pragma GCC unroll 8
  for (unsigned i = 0; i < NQ; ++i) ah[i][0] = ah[i][1] = al[i][0] = al[i][1] = _mm512_setzero_si512();
  alignas(64) std::int8_t qh[NQ][key_chunk], ql[NQ][key_chunk];
  for (unsigned c0 = 0; c0 < hd; c0 += key_chunk) {
    const unsigned nd = hd - c0 < key_chunk ? hd - c0 : key_chunk;
    for (unsigned j = 0; j < nd; j += 16) {
      const unsigned n = nd - j < 16 ? nd - j : 16;
      __m512 s, m;
      if (cached) s = _mm512_load_ps(scales + c0 + j);
      else q4_scale_min16(k + c0 + j, 1, n, s, m);
      for (unsigned i = 0; i < NQ; ++i) {
        const __m512 qv = _mm512_maskz_loadu_ps(first(n), q + i * hd + c0 + j);
        split(_mm512_mul_ps(_mm512_mul_ps(qv, s), _mm512_set1_ps(qs[i].inv)), qh[i] + j, ql[i] + j);
      }
    }
    for (unsigned c = 0; c < nd; c += 4) {
      const q4_block* b = k + c0 + c;
      __m512i lo, hi;
      if (c + 4 <= nd) {
        codes4_consecutive(b, lo, hi);
      } else {
        codes4(b[0].codes, c + 1 < nd ? b[1].codes : zero_codes, c + 2 < nd ? b[2].codes : zero_codes,
               c + 3 < nd ? b[3].codes : zero_codes, lo, hi);
      }
#pragma GCC unroll 8
      for (unsigned i = 0; i < NQ; ++i) {
        const __m512i wh = dword_of(qh[i] + c), wl = dword_of(ql[i] + c);
        dpbusd(ah[i][0], lo, wh);
        dpbusd(ah[i][1], hi, wh);
        dpbusd(al[i][0], lo, wl);
        dpbusd(al[i][1], hi, wl);
      }
    }
  }
#pragma GCC unroll 8
  for (unsigned i = 0; i < NQ; ++i)
#pragma GCC unroll 2
    for (unsigned r = 0; r < 2; ++r) {
      const __m512 v = _mm512_fmadd_ps(combine(ah[i][r], al[i][r]), _mm512_set1_ps(qs[i].scale), _mm512_set1_ps(qs[i].mc));
      _mm512_mask_storeu_ps(out + i * out_stride + 16 * r, first(lanes(tokens, r)), v);
    }
}

}  // namespace

void scores_q4(const float* q, std::uint32_t nq, const q4_block* k, std::uint32_t tokens, std::uint32_t head_dim,
               float* out, std::size_t out_stride) {
  scores_q4_by_four(q, nq, k, tokens, head_dim, out, out_stride);
}

}  // namespace kvcache::kernels::avx512vnni
