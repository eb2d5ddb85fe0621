// Q4 key scores of decode attention in integer arithmetic, for CPUs with AVX-512 VNNI (vpdpbusd:
// 64 u8 x s8 products per instruction) and VBMI (vpermb, vpermt2b). Compiled with those flags:
// everything stays in this file's anonymous namespace (see kernels_internal.hpp) except the entry
// point, which avx512::get() installs only on CPUs that have both extensions.
//
// The folded query x_d = q_d * scale_d is one int8 value per channel with one scale per query:
// Y_d = round(x_d / scale), scale = max_d |x_d| / 127, so x_d = scale (Y_d + e_d), |e_d| <= 1/2.
// The codes (0..15) are the unsigned operand, as they are stored. Of the rounding error
// scale sum_d e_d c_d, the part scale * 8 sum_d e_d (the same for all tokens of the group) is
// added back exactly; what is left is scale sum_d e_d (c_d - 8), at most max|x| / 254 * |c_d - 8|
// per channel. It stays well below the error the Q4 keys already carry: that error has a standard
// deviation of at least max|x| / sqrt(12) (the channel of the largest |x_d| alone), against about
// 0.12 max|x| for this one with random rounding at 128 channels (0.17 at 256), which adds under
// 10 % to the variance of the score error. Two int8 parts (15 bits, as this kernel had before)
// measured 1.2 to 1.3 times slower here: vpdpbusd and its dword broadcasts share the vector pipes.
//
// Values (accumulate_q4) are integer too, where a token has 2, 4 or 8 blocks: per tile of 32
// tokens, query i and block column g, the weights w_t = p_t * scale_t become u8 on a grid of
// step = max_t p_t * max_t scale_t / 255, and vpdpbusd sums them with the codes over token quads.
// The codes enter centred, v = s (c - 8) + (m + 8 s), so a weight's rounding error (at most
// step / 2) is multiplied by |c - 8| <= 8, not by c; sum_t p_t (m_t + 8 s_t) stays in float. See
// the value section below for the layout.
#include "kernels_internal.hpp"
#if 0  // INTERIM: old Q4 layout, being ported

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

namespace kvcache::kernels::avx512vnni {
namespace {

#include "row_prefetch.inl"
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

// vpermt2b indices that bring the halves of the headers of 16 consecutive blocks (bytes 20 j and
// 20 j + 2 of a 320-byte run) to words j (the scales) and 16 + j (the minimums), from bytes
// [0, 128), [128, 256) and [256, 320) of the run.
constexpr byte_index make_headers(int base) {
  byte_index x{};
  for (int o = 0; o < 64; ++o) {
    const int j = (o / 2) % 16, at = 20 * j + (o >= 32 ? 2 : 0) + (o & 1) - base;
    x.b[o] = static_cast<std::uint8_t>(at >= 0 && at < 128 ? at : 0);
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
  // Blocks 0..6 from [0, 128) (block 6 ends at byte 124), 7..12 from [128, 256), 13..15 from
  // [256, 320): words j and 16 + j of each.
  __m512i sm = _mm512_mask_mov_epi16(a, __mmask32(0x1F801F80u), c);
  sm = _mm512_mask_mov_epi16(sm, __mmask32(0xE000E000u), d);
  s = _mm512_cvtph_ps(_mm512_castsi512_si256(sm));
  m = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(sm, 1));
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
inline void codes4_consecutive(const q4_block* b, __m512i& lo, __m512i& hi16) {
  const auto* p = b[0].codes;
  const __m512i x = _mm512_permutex2var_epi8(_mm512_loadu_si512(p), _mm512_load_si512(codes_consecutive.b),
                                             _mm512_maskz_loadu_epi8(__mmask64(0xFFF), p + 64));
  lo = _mm512_and_si512(x, _mm512_set1_epi8(0x0F));
  hi16 = _mm512_and_si512(x, _mm512_set1_epi8(static_cast<char>(0xF0)));
}

// The codes of four blocks (not consecutive: the last channels of a head), transposed: dword t of
// `lo` holds code t of the four blocks, of `hi16` code 16 + t times 16 (the high nibbles left in
// place: one instruction less, and the unsigned operand of vpdpbusd takes them to 240).
inline void codes4(const std::uint8_t* c0, const std::uint8_t* c1, const std::uint8_t* c2, const std::uint8_t* c3,
                   __m512i& lo, __m512i& hi16) {
  __m512i x = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c0)));
  x = _mm512_inserti32x4(x, _mm_loadu_si128(reinterpret_cast<const __m128i*>(c1)), 1);
  x = _mm512_inserti32x4(x, _mm_loadu_si128(reinterpret_cast<const __m128i*>(c2)), 2);
  x = _mm512_inserti32x4(x, _mm_loadu_si128(reinterpret_cast<const __m128i*>(c3)), 3);
  x = _mm512_permutexvar_epi8(_mm512_load_si512(transpose.b), x);
  lo = _mm512_and_si512(x, _mm512_set1_epi8(0x0F));
  hi16 = _mm512_and_si512(x, _mm512_set1_epi8(static_cast<char>(0xF0)));
}

// Rounding to integers by adding 1.5 * 2^23: a float of magnitude in [2^23, 2^24) has ulp 1, so
// fma(a, b, round_magic) rounds a * b (exactly, in one step) to the nearest integer, ties to even,
// and for |a * b| < 2^22 its low byte is that integer modulo 256: the int8 (or u8) value itself,
// with no conversion and no packing.
constexpr float round_magic = 12582912.0f;

// Widest head the int8 key scores take (see scores_q4).
constexpr std::uint32_t int8_key_channels = 16384;

// vpermt2b index taking byte 0 of each dword of two vectors: 32 bytes, in lane order.
constexpr byte_index make_low_bytes() {
  byte_index x{};
  for (int o = 0; o < 64; ++o) x.b[o] = static_cast<std::uint8_t>(4 * (o & 31));
  return x;
}
constexpr byte_index low_bytes = make_low_bytes();

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

inline std::int32_t dword_at(const void* p) {
  std::int32_t x;
  __builtin_memcpy(&x, p, sizeof x);
  return x;
}

// dpbusd with the signed operand the dword at p broadcast, as the instruction's memory operand.
inline void dpbusd_b(__m512i& acc, __m512i u, const void* p) {
#if defined(__GNUC__) && !defined(__clang__)
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*static_cast<const std::int32_t*>(p)));
#else
  acc = _mm512_dpbusd_epi32(acc, u, _mm512_set1_epi32(dword_at(p)));
#endif
}

// Function objects (not functions: through a function pointer GCC 12 neither inlined reduce4 nor
// the operation).
struct max_op {
  __m512 operator()(__m512 a, __m512 b) const { return _mm512_max_ps(a, b); }
};
struct sum_op {
  __m512 operator()(__m512 a, __m512 b) const { return _mm512_add_ps(a, b); }
};
constexpr max_op max_of;
constexpr sum_op sum_of;

// Lanes 4 i .. 4 i + 3 of the result: op over all 16 lanes of x[i], i < 4 (a transposing tree:
// 13 instructions for the four, against 8 for each one alone).
template <class Op>
__attribute__((always_inline)) inline __m512 reduce4(const __m512 (&x)[4], Op op) {
  const __m512 ab = op(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 cd = op(_mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(3, 2, 3, 2)));
  __m512 r = op(_mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));
  r = op(r, _mm512_permute_ps(r, _MM_SHUFFLE(1, 0, 3, 2)));
  return op(r, _mm512_permute_ps(r, _MM_SHUFFLE(2, 3, 0, 1)));
}

// ---- keys: lanes = the 32 tokens of the group (two vectors), dot products over channel quads ----

template <unsigned NQ>
void scores_nq(const float* q, const q4_block* k, unsigned tokens, unsigned hd, float* out, std::size_t out_stride,
               row_prefetch* pf) {
  // Pass 1: the folded query x_d = q_d s_d (kept up to cached_channels), the largest |x_d| of
  // each query and sum_d q_d (m_d + 8 s_d) (the minimums, and the centring added back below).
  __m512 qmax[4], mterm[4];
#pragma GCC unroll 4
  for (unsigned i = 0; i < 4; ++i) qmax[i] = mterm[i] = _mm512_setzero_ps();
  alignas(64) float folded[NQ][cached_channels];
  const bool cached = hd <= cached_channels;
  for (unsigned c = 0; c < hd; c += 16) {
    const unsigned n = hd - c < 16 ? hd - c : 16;
    __m512 s, m;
    if (n == 16) consecutive_scale_min16(k + c, s, m);
    else q4_scale_min16(k + c, 1, n, s, m);
    const __m512 m8 = _mm512_fmadd_ps(s, _mm512_set1_ps(8.0f), m);
#pragma GCC unroll 8
    for (unsigned i = 0; i < NQ; ++i) {
      const __m512 qv = _mm512_maskz_loadu_ps(first(n), q + i * hd + c);
      const __m512 x = _mm512_mul_ps(qv, s);
      if (cached) _mm512_store_ps(folded[i] + c, x);
      qmax[i] = _mm512_range_ps(qmax[i], x, 0x0B);  // max(|qmax|, |x|): imm 11 (larger |.|), 10 (sign cleared)
      mterm[i] = _mm512_fmadd_ps(qv, m8, mterm[i]);
    }
  }
  // Lane 4 i: the scale of query i, max|x| / 127, and its inverse (0 where the folded query is all
  // zeros).
  alignas(64) float scale[16], inv[16];
  {
    const __m512 mx = reduce4(qmax, max_of);
    _mm512_store_ps(scale, _mm512_div_ps(mx, _mm512_set1_ps(127.0f)));
    _mm512_store_ps(inv, _mm512_maskz_div_ps(_mm512_cmp_ps_mask(mx, _mm512_setzero_ps(), _CMP_GT_OQ),
                                             _mm512_set1_ps(127.0f), mx));
  }

  // Pass 2: Y of a chunk of channels, then the integer dot products over it.
  __m512i acc[NQ][2], ysum[4];
#pragma GCC unroll 8
  for (unsigned i = 0; i < NQ; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_si512();
#pragma GCC unroll 4
  for (unsigned i = 0; i < 4; ++i) ysum[i] = _mm512_setzero_si512();
  alignas(64) std::int8_t ys[NQ][key_chunk];
  const __m512i order = _mm512_load_si512(low_bytes.b);
  for (unsigned c0 = 0; c0 < hd; c0 += key_chunk) {
    const unsigned nd = hd - c0 < key_chunk ? hd - c0 : key_chunk;
    for (unsigned j = 0; j < nd; j += 32) {
      __m512 x[NQ][2];
#pragma GCC unroll 2
      for (unsigned r = 0; r < 2; ++r) {
        const unsigned n = lanes(nd - j, r), c = c0 + j + 16 * r;
        if (cached) {
#pragma GCC unroll 8
          for (unsigned i = 0; i < NQ; ++i) x[i][r] = _mm512_maskz_load_ps(first(n), folded[i] + c);
        } else {
          __m512 s = _mm512_setzero_ps(), m;
          if (n > 0) q4_scale_min16(k + c, 1, n, s, m);
#pragma GCC unroll 8
          for (unsigned i = 0; i < NQ; ++i) x[i][r] = _mm512_mul_ps(_mm512_maskz_loadu_ps(first(n), q + i * hd + c), s);
        }
      }
#pragma GCC unroll 8
      for (unsigned i = 0; i < NQ; ++i) {
        const __m512 k1 = _mm512_set1_ps(inv[4 * i]), mg = _mm512_set1_ps(round_magic);
        const __m512i y0 = _mm512_castps_si512(_mm512_fmadd_ps(x[i][0], k1, mg));
        const __m512i y1 = _mm512_castps_si512(_mm512_fmadd_ps(x[i][1], k1, mg));
        _mm256_store_si256(reinterpret_cast<__m256i*>(ys[i] + j),
                           _mm512_castsi512_si256(_mm512_permutex2var_epi8(y0, order, y1)));
      }
    }
    // sum_d Y_d, 64 channels at a time (Y is 0 past nd up to the next multiple of 32).
    const unsigned nd32 = (nd + 31) / 32 * 32;
    for (unsigned j = 0; j < nd32; j += 64) {
      const __mmask64 mk = nd32 - j >= 64 ? ~__mmask64(0) : __mmask64(0xFFFFFFFFu);
#pragma GCC unroll 8
      for (unsigned i = 0; i < NQ; ++i) dpbusd(ysum[i], _mm512_set1_epi8(1), _mm512_maskz_loadu_epi8(mk, ys[i] + j));
    }
    for (unsigned c = 0; c < nd; c += 4) {
      if (pf != nullptr) pf->rows(1);
      const q4_block* b = k + c0 + c;
      __m512i lo, hi16;
      if (c + 4 <= nd) {
        codes4_consecutive(b, lo, hi16);
      } else {
        codes4(b[0].codes, c + 1 < nd ? b[1].codes : zero_codes, c + 2 < nd ? b[2].codes : zero_codes,
               c + 3 < nd ? b[3].codes : zero_codes, lo, hi16);
      }
#pragma GCC unroll 8
      for (unsigned i = 0; i < NQ; ++i) {
        dpbusd_b(acc[i][0], lo, ys[i] + c);
        dpbusd_b(acc[i][1], hi16, ys[i] + c);
      }
    }
  }
  // score = scale (sum_d Y_d c_d + 8 sum_d (y_d - Y_d)) + sum_d q_d m_d, y_d = x_d / scale,
  //       = scale (sum_d Y_d c_d - 8 sum_d Y_d) + sum_d q_d (m_d + 8 s_d).
  alignas(64) float ms[16], ym[16];
  {
    __m512 yf[4];
#pragma GCC unroll 4
    for (unsigned i = 0; i < 4; ++i) yf[i] = _mm512_cvtepi32_ps(ysum[i]);  // exact: |sum| < 2^24
    _mm512_store_ps(ms, reduce4(mterm, sum_of));
    _mm512_store_ps(ym, reduce4(yf, sum_of));
  }
#pragma GCC unroll 8
  for (unsigned i = 0; i < NQ; ++i) {
    const float sc = scale[4 * i];
    const __m512 base = _mm512_set1_ps(ms[4 * i] - 8.0f * sc * ym[4 * i]);
    // Tokens 16..31 were summed with their codes times 16.
#pragma GCC unroll 2
    for (unsigned r = 0; r < 2; ++r)
      _mm512_mask_storeu_ps(out + i * out_stride + 16 * r, first(lanes(tokens, r)),
                            _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][r]), _mm512_set1_ps(r == 0 ? sc : sc * 0.0625f), base));
  }
}

// ---- values: lanes = 16 channels of a block column, dot products over token quads --------------

constexpr unsigned value_tile = 32;  // tokens per set-up

// vpermt2b indices that order the u8 weights of 64 consecutive blocks (block k = t * nb + g) by
// dword (Q * nb + g) = tokens 4Q..4Q+3 of column g, from the low bytes of the dwords of four
// 16-lane vectors (block k in lane k % 16 of vector k / 16): `lo` takes the bytes from vectors 0
// and 1, `hi` from vectors 2 and 3, and `from_hi` marks the output bytes that come from `hi`.
struct weight_permute {
  byte_index lo, hi;
  std::uint64_t from_hi;
};
constexpr weight_permute make_weight_permute(int nb) {
  weight_permute x{};
  for (int o = 0; o < 64; ++o) {
    const int i = o & 3, g = (o >> 2) % nb, quad = (o >> 2) / nb;
    const int k = (4 * quad + i) * nb + g, v = k >> 4;
    const auto at = static_cast<std::uint8_t>(4 * (k & 15) + 64 * (v & 1));
    if (v < 2) {
      x.lo.b[o] = at;
    } else {
      x.hi.b[o] = at;
      x.from_hi |= std::uint64_t{1} << o;
    }
  }
  return x;
}
constexpr weight_permute weight_order[4] = {make_weight_permute(1), make_weight_permute(2), make_weight_permute(4),
                                            make_weight_permute(8)};

// What the set-up of a tile hands the integer loop, per query i (lanes / entries g = block column).
template <unsigned NQ>
struct value_tile_weights {
  alignas(64) std::int32_t w[NQ][value_tile * 8 / 4];  // u8 weights: dword Q * nb + g, tokens 4Q..4Q+3
  alignas(64) float step[NQ][16];                       // lane g: the grid step of column g's weights
  alignas(64) float base[NQ][16];                       // lane g: sum_t p_t (m_t + 8 s_t) - 8 step sum_t w8_t
};

// Set-up of one tile of nt (1..32) tokens, NB (2, 4, 8) blocks each: lanes of vector r are the
// blocks k = 16 r + l = t * NB + g. Weights w = p s are quantized as round(p' s') with
// p' = p * 255 / max p and s' = s / max_t s of the column, so every u8 weight is <= 255. The four
// queries go side by side where they reduce (their maxima in one tree), and the weights are
// rounded by fma with round_magic, their low bytes gathered by two vpermt2b.
template <unsigned NQ, unsigned NB>
void value_setup(const float* p, std::size_t p_stride, const q4_block* tile, unsigned nt, value_tile_weights<NQ>& out) {
  constexpr unsigned R = 2 * NB;  // vectors of 16 blocks in a full tile
  constexpr unsigned shift = NB == 1 ? 0 : NB == 2 ? 1 : NB == 4 ? 2 : 3;
  const unsigned nk = nt * NB;
  __m512 sn[R], m8[R], smax = _mm512_setzero_ps();
#pragma GCC unroll 16
  for (unsigned r = 0; r < R; ++r) {
    __m512 s, m;
    if (16 * r + 16 <= nk) consecutive_scale_min16(tile + 16 * r, s, m);
    else q4_consecutive_scale_min16(tile + 16 * r, nk > 16 * r ? nk - 16 * r : 0, s, m);
    m8[r] = _mm512_fmadd_ps(s, _mm512_set1_ps(8.0f), m);
    sn[r] = s;
    smax = _mm512_max_ps(smax, s);
  }
  const __m512 smax_g = q4_fold<NB>(smax, max_of);
  const __m512 inv = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(smax_g, _mm512_setzero_ps(), _CMP_GT_OQ),
                                         _mm512_set1_ps(1.0f), smax_g);
#pragma GCC unroll 16
  for (unsigned r = 0; r < R; ++r) sn[r] = _mm512_mul_ps(sn[r], inv);

  // Lane 4 i, per query: max_t p_t, the pre-scale `big` and the factor k, p' = p * big * k. Below
  // 2^-100, p is scaled by 2^100 first (exact), since 255 / max p overflows below ~2^-120.
  __m512 plo[NQ], phi[NQ], pm[4];
#pragma GCC unroll 4
  for (unsigned i = 0; i < 4; ++i) {
    if (i < NQ) {
      plo[i] = _mm512_maskz_loadu_ps(first(nt), p + i * p_stride);
      phi[i] = _mm512_maskz_loadu_ps(first(nt > 16 ? nt - 16 : 0), p + i * p_stride + 16);
      pm[i] = _mm512_max_ps(plo[i], phi[i]);
    } else {
      pm[i] = _mm512_setzero_ps();
    }
  }
  alignas(64) float pmax[16], big[16], kf[16];
  {
    const __m512 mx = reduce4(pm, max_of);
    const __m512 b = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(mx, _mm512_set1_ps(0x1p-100f), _CMP_LT_OQ),
                                          _mm512_set1_ps(1.0f), _mm512_set1_ps(0x1p100f));
    _mm512_store_ps(pmax, mx);
    _mm512_store_ps(big, b);
    _mm512_store_ps(kf, _mm512_maskz_div_ps(_mm512_cmp_ps_mask(mx, _mm512_setzero_ps(), _CMP_GT_OQ),
                                            _mm512_set1_ps(255.0f), _mm512_mul_ps(mx, b)));
  }
  const __m512i token_of_lane = _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), shift);
  const __m512i perm_lo = _mm512_load_si512(weight_order[shift].lo.b), perm_hi = _mm512_load_si512(weight_order[shift].hi.b);
  const __mmask64 from_hi = weight_order[shift].from_hi;
  const __m512 mg = _mm512_set1_ps(round_magic);
  for (unsigned i = 0; i < NQ; ++i) {
    const __m512 kb = _mm512_set1_ps(big[4 * i]), k = _mm512_set1_ps(kf[4 * i]);
    const __m512 pl = _mm512_mul_ps(_mm512_mul_ps(plo[i], kb), k), ph = _mm512_mul_ps(_mm512_mul_ps(phi[i], kb), k);
    __m512 bsum = _mm512_setzero_ps();
    __m512i wsum = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (unsigned c = 0; c < (R + 3) / 4; ++c) {
      __m512i w8[4];
#pragma GCC unroll 4
      for (unsigned u = 0; u < 4; ++u) {
        const unsigned r = 4 * c + u;
        if (r < R) {
          const __m512i idx = _mm512_add_epi32(token_of_lane, _mm512_set1_epi32(static_cast<int>((16 * r) >> shift)));
          const __m512 pv = _mm512_permutex2var_ps(pl, idx, ph);  // p' of each block's token
          w8[u] = _mm512_castps_si512(_mm512_fmadd_ps(pv, sn[r], mg));
          bsum = _mm512_fmadd_ps(pv, m8[r], bsum);
        } else {
          w8[u] = _mm512_setzero_si512();
        }
      }
      const __m512i wv = _mm512_mask_mov_epi8(_mm512_permutex2var_epi8(w8[0], perm_lo, w8[1]), from_hi,
                                              _mm512_permutex2var_epi8(w8[2], perm_hi, w8[3]));
      _mm512_store_si512(out.w[i] + 16 * c, wv);
      dpbusd(wsum, wv, _mm512_set1_epi8(1));
    }
    const float step = pmax[4 * i] / 255.0f;
    const __m512 st = _mm512_mul_ps(smax_g, _mm512_set1_ps(step));
    _mm512_store_ps(out.step[i], st);
    // base = step * sum p' (m + 8 s) - 8 * step_g * sum w8: the 8 s of the centred codes back.
    const __m512 wsf = q4_fold<NB>(_mm512_cvtepi32_ps(wsum), sum_of);
    _mm512_store_ps(out.base[i], _mm512_fmsub_ps(q4_fold<NB>(bsum, sum_of), _mm512_set1_ps(step),
                                                 _mm512_mul_ps(_mm512_mul_ps(wsf, st), _mm512_set1_ps(8.0f))));
  }
}

// acc[i][0..ch) of column g += the tile's sum_t p_t v_t: nt tokens from block b (stride nb blocks).
// Out of line: inlined into the set-up's loops, GCC 12 keeps the accumulators in memory.
template <unsigned NQ>
__attribute__((noinline)) void value_column(const q4_block* b, std::size_t nb, unsigned nt, const std::int32_t* w,
                                            std::size_t w_stride, unsigned ch, const float* step, const float* base,
                                            std::size_t sb_stride, float* acc, std::size_t acc_stride, row_prefetch* pf) {
  const __m512i tp = _mm512_load_si512(transpose.b);
  const __m512i nib = _mm512_set1_epi8(0x0F);
  __m512i a0[NQ], a1[NQ];
#pragma GCC unroll 8
  for (unsigned i = 0; i < NQ; ++i) a0[i] = a1[i] = _mm512_setzero_si512();
  auto quad = [&](__m512i x, unsigned q) __attribute__((always_inline)) {
    if (pf != nullptr) pf->rows(1);
    x = _mm512_permutexvar_epi8(tp, x);  // dword c: code byte c of the four tokens
    const __m512i lo = _mm512_and_si512(x, nib), hi = _mm512_and_si512(_mm512_srli_epi16(x, 4), nib);
#pragma GCC unroll 8
    for (unsigned i = 0; i < NQ; ++i) {
      const __m512i wi = _mm512_set1_epi32(w[i * w_stride + q * nb]);
      dpbusd(a0[i], wi, lo);
      dpbusd(a1[i], wi, hi);
    }
  };
  // The code rows of the n (1..4) tokens from x, zeros past n: one row per 128-bit lane.
  auto rows = [nb](const q4_block* x, unsigned n) __attribute__((always_inline)) {
    auto row = [&](unsigned t) {
      const std::uint8_t* c = t < n ? x[t * nb].codes : zero_codes;
      return _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
    };
    __m512i r = _mm512_castsi128_si512(row(0));
    r = _mm512_inserti32x4(r, row(1), 1);
    r = _mm512_inserti32x4(r, row(2), 2);
    return _mm512_inserti32x4(r, row(3), 3);
  };
  unsigned j = 0;
  for (; j + 4 <= nt; j += 4, b += 4 * nb) quad(rows(b, 4), j / 4);
  if (j < nt) quad(rows(b, nt - j), j / 4);
#pragma GCC unroll 8
  for (unsigned i = 0; i < NQ; ++i) {
    const __m512 st = _mm512_set1_ps(step[i * sb_stride]), bs = _mm512_set1_ps(base[i * sb_stride]);
    float* o = acc + i * acc_stride;
    const __mmask16 m0 = first(lanes(ch, 0)), m1 = first(lanes(ch, 1));
    _mm512_mask_storeu_ps(o, m0, _mm512_add_ps(_mm512_maskz_loadu_ps(m0, o), _mm512_fmadd_ps(_mm512_cvtepi32_ps(a0[i]), st, bs)));
    _mm512_mask_storeu_ps(o + 16, m1,
                          _mm512_add_ps(_mm512_maskz_loadu_ps(m1, o + 16), _mm512_fmadd_ps(_mm512_cvtepi32_ps(a1[i]), st, bs)));
  }
}

template <unsigned NQ, unsigned NB>
void values_nq(const float* p, std::size_t p_stride, const q4_block* v, unsigned tokens, unsigned hd, float* acc,
               row_prefetch* pf) {
  value_tile_weights<NQ> tw;
  for (unsigned t0 = 0; t0 < tokens; t0 += value_tile) {
    const unsigned nt = tokens - t0 < value_tile ? tokens - t0 : value_tile;
    const q4_block* tile = v + static_cast<std::size_t>(t0) * NB;
    value_setup<NQ, NB>(p + t0, p_stride, tile, nt, tw);
    for (unsigned g = 0; g < NB; ++g) {
      const unsigned ch = hd - 32 * g < 32 ? hd - 32 * g : 32;
      value_column<NQ>(tile + g, NB, nt, &tw.w[0][g], sizeof tw.w[0] / sizeof(std::int32_t), ch, &tw.step[0][g],
                       &tw.base[0][g], 16, acc + 32 * g, hd, pf);
    }
  }
}

template <unsigned NQ>
void values_nb(const float* p, std::size_t p_stride, const q4_block* v, unsigned tokens, unsigned hd, float* acc,
               row_prefetch* pf) {
  switch (q4_value_blocks(hd)) {
    case 2: values_nq<NQ, 2>(p, p_stride, v, tokens, hd, acc, pf); break;
    case 4: values_nq<NQ, 4>(p, p_stride, v, tokens, hd, acc, pf); break;
    default: values_nq<NQ, 8>(p, p_stride, v, tokens, hd, acc, pf); break;
  }
}

// ---- the online-softmax step over one group: scores, weights and values of four queries -------

#include "avx512_float_ops.inl"
using S = avx512_float_ops;

// 2^x for x <= 0, as attend()'s softmax step computes it.
#include "exp2_simd.inl"

// table::attend_q4 for NQ (1..4) queries: the scores into a local tile, the softmax step with the
// queries' maxima and sums each reduced in one tree, the weights back into the tile (where the
// value set-up reads them from L1), and the values. Keys wider than int8_key_channels and values
// of other than 2, 4 or 8 blocks a token go to the float kernels, as in scores_q4 and
// accumulate_q4.
template <unsigned NQ>
void attend_nq(const float* q, const q4_block* k, const q4_block* v, unsigned tokens, unsigned hd, float* run_max,
               float* run_sum, float* acc, row_prefetch* pf) {
  alignas(64) float w[NQ][value_tile];
  if (hd <= int8_key_channels) scores_nq<NQ>(q, k, tokens, hd, &w[0][0], value_tile, pf);
  else avx512::float_q4().scores_q4(q, NQ, k, tokens, hd, &w[0][0], value_tile, {});  // see scores_q4
  const __mmask16 m0 = first(lanes(tokens, 0)), m1 = first(lanes(tokens, 1));
  const __m512 ninf = _mm512_set1_ps(-__builtin_inff());
  __m512 s[NQ][2], mx[4];
#pragma GCC unroll 4
  for (unsigned i = 0; i < 4; ++i) {
    if (i < NQ) {
      s[i][0] = _mm512_mask_load_ps(ninf, m0, w[i]);
      s[i][1] = _mm512_mask_load_ps(ninf, m1, w[i] + 16);
      mx[i] = _mm512_max_ps(s[i][0], s[i][1]);
    } else {
      mx[i] = ninf;
    }
  }
  alignas(64) float tile_max[16];
  _mm512_store_ps(tile_max, reduce4(mx, max_of));
  float m_new[NQ];
  __m512 sum[4];
#pragma GCC unroll 4
  for (unsigned i = 0; i < 4; ++i) {
    if (i < NQ) {
      m_new[i] = tile_max[4 * i] > run_max[i] ? tile_max[4 * i] : run_max[i];
      const __m512 m = _mm512_set1_ps(m_new[i]);
      const __m512 p0 = _mm512_maskz_mov_ps(m0, exp2_nonpositive(_mm512_sub_ps(s[i][0], m)));
      const __m512 p1 = _mm512_maskz_mov_ps(m1, exp2_nonpositive(_mm512_sub_ps(s[i][1], m)));
      _mm512_store_ps(w[i], p0);
      _mm512_store_ps(w[i] + 16, p1);
      sum[i] = _mm512_add_ps(p0, p1);
    } else {
      sum[i] = _mm512_setzero_ps();
    }
  }
  alignas(64) float total[16];
  _mm512_store_ps(total, reduce4(sum, sum_of));
#pragma GCC unroll 4
  for (unsigned i = 0; i < NQ; ++i) {
    if (m_new[i] != run_max[i]) {
      // First group: run_max is -inf and acc, run_sum are 0: the correction factor is 0.
      const float corr = run_max[i] < -3.0e38f
                             ? 0.0f
                             : _mm512_cvtss_f32(exp2_nonpositive(_mm512_set1_ps(run_max[i] - m_new[i])));
      float* a = acc + static_cast<std::size_t>(i) * hd;
      const __m512 cv = _mm512_set1_ps(corr);
      for (unsigned d = 0; d < hd; d += 16) {
        const __mmask16 md = first(hd - d);
        _mm512_mask_storeu_ps(a + d, md, _mm512_mul_ps(_mm512_maskz_loadu_ps(md, a + d), cv));
      }
      run_sum[i] *= corr;
      run_max[i] = m_new[i];
    }
    run_sum[i] += total[4 * i];
  }
  const unsigned nb = q4_value_blocks(hd);
  if (nb == 2 || nb == 4 || nb == 8) values_nb<NQ>(&w[0][0], value_tile, v, tokens, hd, acc, pf);
  else avx512::float_q4().accumulate_q4(&w[0][0], value_tile, NQ, v, tokens, hd, acc, {});  // see accumulate_q4
}

}  // namespace

void scores_q4(const float* q, std::uint32_t nq, const q4_block* k, std::uint32_t tokens, std::uint32_t head_dim,
               float* out, std::size_t out_stride, prefetch_region pf) {
  // The int32 sums of the high nibbles (codes times 16) take up to 4 * 240 * 128 per channel
  // quad: past 2^14 channels they would near 2^31. Heads that wide get the float kernel.
  if (head_dim > int8_key_channels) {
    avx512::float_q4().scores_q4(q, nq, k, tokens, head_dim, out, out_stride, pf);
    return;
  }
  scores_q4_by_four(q, nq, k, tokens, head_dim, out, out_stride, pf);
}


void accumulate_q4(const float* p, std::size_t p_stride, std::uint32_t nq, const q4_block* v, std::uint32_t tokens,
                   std::uint32_t head_dim, float* acc, prefetch_region pf) {
  if (tokens == 0) return;
  const std::uint32_t nb = q4_value_blocks(head_dim);
  if (nb != 2 && nb != 4 && nb != 8) {  // float: head_dim <= 32 (slower in int8: 2.2 vs 1.9 ns per token), 80, 96, 160, ..., > 256
    avx512::float_q4().accumulate_q4(p, p_stride, nq, v, tokens, head_dim, acc, pf);
    return;
  }
  row_prefetch rp(pf, nb * ((tokens + 3) / 4));  // per token quad of a column, in the first queries' pass
  for (std::uint32_t i0 = 0; i0 < nq; i0 += 4) {
    const float* pi = p + i0 * p_stride;
    float* a = acc + static_cast<std::size_t>(i0) * head_dim;
    switch (nq - i0 < 4 ? nq - i0 : 4) {
      case 1: values_nb<1>(pi, p_stride, v, tokens, head_dim, a, i0 == 0 ? &rp : nullptr); break;
      case 2: values_nb<2>(pi, p_stride, v, tokens, head_dim, a, i0 == 0 ? &rp : nullptr); break;
      case 3: values_nb<3>(pi, p_stride, v, tokens, head_dim, a, i0 == 0 ? &rp : nullptr); break;
      default: values_nb<4>(pi, p_stride, v, tokens, head_dim, a, i0 == 0 ? &rp : nullptr); break;
    }
  }
}

}  // namespace kvcache::kernels::avx512vnni

namespace kvcache::kernels::avx512vnni {

void attend_q4(const float* q, std::uint32_t nq, const q4_block* k, const q4_block* v, std::uint32_t tokens,
               std::uint32_t head_dim, float* run_max, float* run_sum, float* acc, prefetch_region pf) {
  if (tokens == 0) return;
  const std::uint32_t nb = q4_value_blocks(head_dim);
  // Spread over the channel quads of the first queries' scores and the token quads of their value
  // columns: all of it in the scores alone (three lines a quad) stalled them.
  row_prefetch rp(pf, (head_dim + 3) / 4 + nb * ((tokens + 3) / 4));
  for (std::uint32_t i0 = 0; i0 < nq; i0 += 4) {
    const float* qi = q + static_cast<std::size_t>(i0) * head_dim;
    float* a = acc + static_cast<std::size_t>(i0) * head_dim;
    row_prefetch* f = i0 == 0 ? &rp : nullptr;
    switch (nq - i0 < 4 ? nq - i0 : 4) {
      case 1: attend_nq<1>(qi, k, v, tokens, head_dim, run_max + i0, run_sum + i0, a, f); break;
      case 2: attend_nq<2>(qi, k, v, tokens, head_dim, run_max + i0, run_sum + i0, a, f); break;
      case 3: attend_nq<3>(qi, k, v, tokens, head_dim, run_max + i0, run_sum + i0, a, f); break;
      default: attend_nq<4>(qi, k, v, tokens, head_dim, run_max + i0, run_sum + i0, a, f); break;
    }
  }
}

}  // namespace kvcache::kernels::avx512vnni
#endif  // INTERIM
