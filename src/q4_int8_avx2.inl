// The int8 Q4 kernels on 256-bit vectors (AVX2): key scores and value sums in integer arithmetic,
// shared by kernels_avx2vnni.cpp (vpdpbusd, AVX-VNNI) and kernels_avx2int8.cpp (vpmaddubsw, every
// AVX2 CPU). Included inside each file's ISA namespace, where it defines the entry points
// scores_q4, accumulate_q4 and attend_q4 and keeps the rest in the anonymous namespace (see
// kernels_internal.hpp), after the file defines there
//   void dot4(__m256i& part, __m256i u, __m256i s): adds to the partial sums `part` the four
//     products of the unsigned bytes of u with the signed bytes of s in each dword;
//   __m256i widen(__m256i part): the partial sums as one int32 per dword;
//   constexpr unsigned dot_run: how many dot4 calls a partial sum takes before it is widened;
//   constexpr bool codes_times_16: whether the operands may be as large as the VNNI kernels make
//     them (high nibbles left in place, key codes up to 240; value codes 16 (c - 8)).
// VNNI's partial sums are int32 already (vpdpbusd). vpmaddubsw sums pairs of products in int16
// with saturation, so without VNNI the key codes enter as 0..15 and the value codes as c - 8:
// a pair is at most 2 * 15 * 127 = 3810 for keys and 2 * 255 * 8 = 4080 for values, so eight
// calls' pairs add up in int16 (at most 32640) before vpmaddwd widens them (one shift more per
// high nibble, and one widening per eight quads). The integer sums are the same, and so are the
// results, bit for bit (tests/test_kernels.cpp checks it).
//
// The arithmetic is that of q4_int8_avx512.inl: the folded query q_d * scale_d is one int8
// value per channel on a grid of max|q s| / 127 per query, the rounding error's share common to
// all tokens added back, the codes (0..15) the unsigned operand. Values: per query and block
// column, the weights p_t * scale_t of the tokens summed are u8 on a grid of
// step = max_t p_t * max_t scale_t / 255 and multiply the centred codes c - 8; sum_t p_t (m_t + 8 s_t)
// is added in float.
//
// A key channel quad of the group (format.hpp) is one 64-byte row, two vectors here: dword j of the
// first holds the four channels' codes of tokens j (low nibbles) and 16 + j (high nibbles), of the
// second tokens 8 + j and 24 + j; masking (or shifting) the nibbles gives the four 8-token vectors
// the dot products take as they are. A value token quad of a block column is one 64-byte row too:
// dword j of the first vector holds channel j (low nibbles) and 16 + j (high) of the quad's four
// tokens, of the second channels 8 + j and 24 + j; against the four tokens' u8 weights broadcast as
// a dword. With 16 registers the queries take their turns over the codes two at a time.

namespace {

#include "avx2_horizontal.inl"
#include "q4_int8.inl"

// Lane masks for maskload/maskstore: tail_mask + 8 - n selects the first n of 8 lanes.
alignas(32) constexpr std::int32_t tail_mask[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
inline __m256i mask(unsigned n) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tail_mask + 8 - n)); }

// Y[0..4) (int32, |Y| <= 127, 32 lanes) written as 32 int8.
inline void pack32(const __m256i* y, std::int8_t* dst) {
  // The packs work within 128-bit lanes: dword order 0 4 1 5 2 6 3 7 restores the lanes' order.
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                      _mm256_permutevar8x32_epi32(
                          _mm256_packs_epi16(_mm256_packs_epi32(y[0], y[1]), _mm256_packs_epi32(y[2], y[3])), order));
}

// w[0..4) (int32, 0..255, 32 lanes) written as 32 u8.
inline void pack32u(const __m256i* w, std::uint8_t* dst) {
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_store_si256(reinterpret_cast<__m256i*>(dst),
                     _mm256_permutevar8x32_epi32(
                         _mm256_packus_epi16(_mm256_packus_epi32(w[0], w[1]), _mm256_packus_epi32(w[2], w[3])), order));
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

inline __m256i dword_of(const void* p) {
  std::int32_t x;
  __builtin_memcpy(&x, p, sizeof x);
  return _mm256_set1_epi32(x);
}

// ---- keys -------------------------------------------------------------------------------------

// acc[i][r] (tokens 8 r .. 8 r + 7; r >= 2 with codes_times_16: codes times 16) += the dot
// products of P (1, 2) queries' int8 values y[i] with the codes of `quads` channel quads from
// `codes`.
template <unsigned P>
__attribute__((always_inline)) inline void dot_quads(const std::uint8_t* codes, unsigned quads, const std::int8_t (*y)[key_chunk],
                                                     __m256i (*acc)[4], line_prefetch& pf) {
  line_prefetch f = pf;  // in registers
  const __m256i nib_lo = _mm256_set1_epi8(0x0F), nib_hi = _mm256_set1_epi8(static_cast<char>(0xF0));
  __m256i h[P][4];
  for (unsigned j = 0; j < quads; ++j) {
    if (j % dot_run == 0) {
#pragma GCC unroll 4
      for (unsigned i = 0; i < P; ++i)
#pragma GCC unroll 4
        for (unsigned r = 0; r < 4; ++r) h[i][r] = _mm256_setzero_si256();
    }
    f.rows(1);
    const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64 * j));
    const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64 * j + 32));
    __m256i c[4];
    c[0] = _mm256_and_si256(x0, nib_lo);
    c[1] = _mm256_and_si256(x1, nib_lo);
    if constexpr (codes_times_16) {
      c[2] = _mm256_and_si256(x0, nib_hi);
      c[3] = _mm256_and_si256(x1, nib_hi);
    } else {
      c[2] = _mm256_and_si256(_mm256_srli_epi16(x0, 4), nib_lo);
      c[3] = _mm256_and_si256(_mm256_srli_epi16(x1, 4), nib_lo);
    }
#pragma GCC unroll 2
    for (unsigned i = 0; i < P; ++i) {
      const __m256i w = dword_of(y[i] + 4 * j);
#pragma GCC unroll 4
      for (unsigned r = 0; r < 4; ++r) dot4(h[i][r], c[r], w);
    }
    if (j % dot_run == dot_run - 1 || j + 1 == quads) {
#pragma GCC unroll 4
      for (unsigned i = 0; i < P; ++i)
#pragma GCC unroll 4
        for (unsigned r = 0; r < 4; ++r) acc[i][r] = _mm256_add_epi32(acc[i][r], widen(h[i][r]));
    }
  }
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

  // Back to floats: score = scale (sum_d Y_d c_d + 8 sum_d (y_d - Y_d)) + sum_d q_d m_d (tokens
  // 16..31 summed with their codes times 16 where codes_times_16).
  for (unsigned i = 0; i < NQ; ++i) {
    alignas(32) std::int32_t yi[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(yi), yisum[i]);
    std::int64_t ytotal = 0;  // 64 bits: a NaN key scale turns a lane into INT_MIN (its result is NaN anyway)
    for (const std::int32_t x : yi) ytotal += x;
    const float e = hsum8(ysum[i]) - static_cast<float>(ytotal);
    const __m256 base = _mm256_set1_ps(qs[i].scale * 8.0f * e + qs[i].mc);
    float* dst = out + i * out_stride;
    for (unsigned r = 0; r < 4 && 8 * r < tokens; ++r) {
      const __m256 scale = _mm256_set1_ps(r < 2 || !codes_times_16 ? qs[i].scale : qs[i].scale * 0.0625f);
      const __m256 o = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i][r]), scale, base);
      const unsigned n = tokens - 8 * r < 8 ? tokens - 8 * r : 8;
      if (n == 8) _mm256_storeu_ps(dst + 8 * r, o);
      else _mm256_maskstore_ps(dst + 8 * r, mask(n), o);
    }
  }
}

// ---- values -----------------------------------------------------------------------------------

// The weights of P (1, 2) queries over one block column of G (1, 2) groups: w[i] (u8, token t of
// group j at byte 32 j + t; 0 outside the tokens summed), and the float step and base of each
// (acc += step * sum + base).
template <unsigned P, unsigned G>
struct column_weights {
  alignas(32) std::uint8_t w[P][32 * G];
  float step[P], base[P];
};

// acc[i][0 .. n) (n <= 32 channels of one block column) += step[i] * (the integer sums of the
// centred codes of token quads [q0[j], q1[j]) of the column at codes[j], group j < G, weighted by
// w[i]) + base[i]: the groups' sums in the same partial sums where they hold them (VNNI), else
// widened group by group (a group's at most eight token quads are one run).
template <unsigned P, unsigned G>
__attribute__((always_inline)) inline void column_sums(const std::uint8_t* const* codes, const unsigned* q0,
                                                       const unsigned* q1, const column_weights<P, G>& cw, float* acc,
                                                       std::size_t acc_stride, unsigned n, line_prefetch* pf) {
  static_assert(dot_run >= 8, "a column's eight token quads are one run of partial sums");
  constexpr bool one_run = G == 1 || dot_run >= 8 * G;
  const __m256i nib_lo = _mm256_set1_epi8(0x0F);
  __m256i h[P][4], wide[P][4];
#pragma GCC unroll 2
  for (unsigned i = 0; i < P; ++i)
#pragma GCC unroll 4
    for (unsigned r = 0; r < 4; ++r) h[i][r] = wide[i][r] = _mm256_setzero_si256();
#pragma GCC unroll 2
  for (unsigned gj = 0; gj < G; ++gj) {
    const std::uint8_t* cg = codes[gj];
    for (unsigned j = q0[gj]; j < q1[gj]; ++j) {
      if (pf != nullptr) pf->rows(1);
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cg + 64 * j));
      const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cg + 64 * j + 32));
      // c[0]: channels 0..7, c[1]: 8..15 (low nibbles), c[2]: 16..23, c[3]: 24..31 (high nibbles).
      __m256i c[4];
      if constexpr (codes_times_16) {  // 16 (c - 8) = (16 c) ^ 0x80 as a signed byte
        const __m256i nib_hi = _mm256_set1_epi8(static_cast<char>(0xF0)), sign = _mm256_set1_epi8(static_cast<char>(0x80));
        c[0] = _mm256_xor_si256(_mm256_and_si256(_mm256_slli_epi16(x0, 4), nib_hi), sign);
        c[1] = _mm256_xor_si256(_mm256_and_si256(_mm256_slli_epi16(x1, 4), nib_hi), sign);
        c[2] = _mm256_xor_si256(_mm256_and_si256(x0, nib_hi), sign);
        c[3] = _mm256_xor_si256(_mm256_and_si256(x1, nib_hi), sign);
      } else {  // c - 8
        const __m256i eight = _mm256_set1_epi8(8);
        c[0] = _mm256_sub_epi8(_mm256_and_si256(x0, nib_lo), eight);
        c[1] = _mm256_sub_epi8(_mm256_and_si256(x1, nib_lo), eight);
        c[2] = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(x0, 4), nib_lo), eight);
        c[3] = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(x1, 4), nib_lo), eight);
      }
#pragma GCC unroll 2
      for (unsigned i = 0; i < P; ++i) {
        const __m256i w = dword_of(cw.w[i] + 32 * gj + 4 * j);
#pragma GCC unroll 4
        for (unsigned r = 0; r < 4; ++r) dot4(h[i][r], w, c[r]);
      }
    }
    if constexpr (!one_run) {
#pragma GCC unroll 2
      for (unsigned i = 0; i < P; ++i)
#pragma GCC unroll 4
        for (unsigned r = 0; r < 4; ++r) {
          wide[i][r] = _mm256_add_epi32(wide[i][r], widen(h[i][r]));
          h[i][r] = _mm256_setzero_si256();
        }
    }
  }
  constexpr unsigned at[4] = {0, 8, 16, 24};  // the first channel of h[i][r]
#pragma GCC unroll 2
  for (unsigned i = 0; i < P; ++i) {
    const __m256 st = _mm256_set1_ps(cw.step[i]), bs = _mm256_set1_ps(cw.base[i]);
    float* o = acc + i * acc_stride;
#pragma GCC unroll 4
    for (unsigned r = 0; r < 4; ++r) {
      if (at[r] >= n) continue;
      const __m256i sum = one_run ? widen(h[i][r]) : wide[i][r];
      const __m256 x = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), st, bs);
      if (n - at[r] >= 8) _mm256_storeu_ps(o + at[r], _mm256_add_ps(_mm256_loadu_ps(o + at[r]), x));
      else {
        const __m256i m = mask(n - at[r]);
        _mm256_maskstore_ps(o + at[r], m, _mm256_add_ps(_mm256_maskload_ps(o + at[r], m), x));
      }
    }
  }
}

// One block column's scales of the tokens in range of G (1, 2) groups as the weights take them:
// s_t 255 / max_t s and m_t + 8 s_t (token t of group j at 32 j + t), 0 outside the range (whatever
// is stored there); and max_t s over all G groups.
template <unsigned G>
struct column_scales {
  alignas(32) float s[32 * G];
  alignas(32) float m8[32 * G];
  float smax;
};

// Tokens [first[j], end[j]) of value groups v[j], j < G (1, 2), for NQ (1..4) queries whose weights
// by token are u[i] (token t of group j at 32 j + t: p_t / max_t p_t, 0 outside the ranges) and
// max_t p_t pmax[i] (> 0), block column by block column: each column's scales prepared once (the
// G groups' weights on one grid), then its integer sums two queries at a time (column_sums'
// registers). Prefetched (pf): one row per token quad of a column, in the first two queries' sums.
template <unsigned NQ, unsigned G>
void values_nq(const float (*u)[32 * G], const float* pmax, const std::uint8_t* const* v, const unsigned* first,
               const unsigned* end, unsigned hd, float* acc, line_prefetch* pf) {
  const unsigned nb = value_blocks(hd);
  unsigned q0[G], q1[G];
  __m256 range[4 * G];
  bool any[4 * G];
  const std::uint8_t* scales[G];
  const std::uint8_t* mins[G];
#pragma GCC unroll 2
  for (unsigned j = 0; j < G; ++j) {
    q0[j] = first[j] / 4;
    q1[j] = (end[j] + 3) / 4;
    scales[j] = v[j] + value_scales_at(hd);
    mins[j] = v[j] + value_mins_at(hd);
#pragma GCC unroll 4
    for (unsigned r = 0; r < 4; ++r) {
      const unsigned t = 8 * r;
      const unsigned lo = first[j] > t ? (first[j] - t < 8 ? first[j] - t : 8) : 0,
                     hi = end[j] > t ? (end[j] - t < 8 ? end[j] - t : 8) : 0;
      range[4 * j + r] = _mm256_castsi256_ps(_mm256_andnot_si256(mask(lo), mask(hi)));
      any[4 * j + r] = hi > lo;  // the 8-token vector holds some of the range
    }
  }
  const __m256 eight = _mm256_set1_ps(8.0f);
  for (unsigned g = 0; g < nb; ++g) {
    column_scales<G> cs;
    {
      __m256 s[4 * G], smax = _mm256_setzero_ps();
#pragma GCC unroll 8
      for (unsigned r = 0; r < 4 * G; ++r) {
        s[r] = _mm256_setzero_ps();
        __m256 m8 = _mm256_setzero_ps();
        if (any[r]) {
          const unsigned j = r / 4, rr = r % 4;
          const __m128i* sp = reinterpret_cast<const __m128i*>(scales[j] + 64 * g + 16 * rr);
          const __m128i* mp = reinterpret_cast<const __m128i*>(mins[j] + 64 * g + 16 * rr);
          s[r] = _mm256_and_ps(_mm256_cvtph_ps(_mm_loadu_si128(sp)), range[r]);
          m8 = _mm256_and_ps(_mm256_fmadd_ps(s[r], eight, _mm256_cvtph_ps(_mm_loadu_si128(mp))), range[r]);
          smax = _mm256_max_ps(smax, s[r]);
        }
        _mm256_store_ps(cs.m8 + 8 * r, m8);
      }
      cs.smax = hmax8(smax);
      const __m256 sinv = _mm256_set1_ps(cs.smax > 0.0f ? 255.0f / cs.smax : 0.0f);
#pragma GCC unroll 8
      for (unsigned r = 0; r < 4 * G; ++r) _mm256_store_ps(cs.s + 8 * r, _mm256_mul_ps(s[r], sinv));
    }
    const unsigned n = hd - 32 * g < 32 ? hd - 32 * g : 32;
    const std::uint8_t* codes[G];
#pragma GCC unroll 2
    for (unsigned j = 0; j < G; ++j) codes[j] = v[j] + std::size_t{512} * g;
    auto queries = [&]<unsigned P>(unsigned i0) __attribute__((always_inline)) {
      column_weights<P, G> cw;
#pragma GCC unroll 2
      for (unsigned i = 0; i < P; ++i) {
        __m256 b = _mm256_setzero_ps();
#pragma GCC unroll 2
        for (unsigned j = 0; j < G; ++j) {
          __m256i w[4];
#pragma GCC unroll 4
          for (unsigned r = 0; r < 4; ++r) {
            const __m256 ur = _mm256_load_ps(u[i0 + i] + 32 * j + 8 * r);
            w[r] = _mm256_cvtps_epi32(_mm256_mul_ps(ur, _mm256_load_ps(cs.s + 32 * j + 8 * r)));  // <= 255: u <= 1
            b = _mm256_fmadd_ps(ur, _mm256_load_ps(cs.m8 + 32 * j + 8 * r), b);
          }
          pack32u(w, cw.w[i] + 32 * j);
        }
        cw.step[i] = pmax[i0 + i] * cs.smax / (codes_times_16 ? 255.0f * 16.0f : 255.0f);
        cw.base[i] = pmax[i0 + i] * hsum8(b);
      }
      column_sums<P, G>(codes, q0, q1, cw, acc + std::size_t{i0} * hd + 32 * g, hd, n, i0 == 0 ? pf : nullptr);
    };
    unsigned i0 = 0;
    for (; i0 + 2 <= NQ; i0 += 2) queries.template operator()<2>(i0);
    if (i0 < NQ) queries.template operator()<1>(i0);
  }
}

// ---- the value sums and the fused online-softmax step (q4_attend_step.inl) ---------------------

#include "avx2_float_ops.inl"

// The vector interface of q4_attend_step.inl (and exp2_simd.inl): 8 float lanes.
struct S : avx2_float_ops {
  using vm = __m256;
  static float first(vf x) { return _mm256_cvtss_f32(x); }
  static vm live(unsigned m) { return _mm256_castsi256_ps(mask(m)); }
  static vf select(vm m, vf a, vf b) { return _mm256_blendv_ps(b, a, m); }
  static vf keep(vf x, vm m) { return _mm256_and_ps(x, m); }
  static void store(float* p, vf x) { _mm256_store_ps(p, x); }
  static vf load_count(const float* p, unsigned m) { return load_n(p, m); }
  static void store_count(float* p, vf x, unsigned m) {
    if (m >= 8) _mm256_storeu_ps(p, x);
    else _mm256_maskstore_ps(p, mask(m), x);
  }
};
#include "exp2_simd.inl"

inline const table& float_kernels() { return avx2::float_q4(); }
#include "q4_attend_step.inl"

}  // namespace

void scores_q4(const float* q, std::uint32_t nq, const std::uint8_t* k, std::uint32_t tokens, std::uint32_t head_dim,
               float* out, std::size_t out_stride, prefetch_region pf) {
  if (head_dim > int8_key_channels) {  // see int8_key_channels
    avx2::float_q4().scores_q4(q, nq, k, tokens, head_dim, out, out_stride, pf);
    return;
  }
  scores_q4_by_four(q, nq, k, tokens, head_dim, out, out_stride, pf);
}

void accumulate_q4(const float* p, std::size_t p_stride, std::uint32_t nq, const std::uint8_t* v, std::uint32_t first,
                   std::uint32_t tokens, std::uint32_t head_dim, float* acc, prefetch_region pf) {
  accumulate_int8(p, p_stride, nq, v, first, tokens, head_dim, acc, pf);
}

void attend_q4(const float* q, std::uint32_t nq, const q4_group_ref* groups, std::uint32_t count,
               std::uint32_t head_dim, float* run_max, float* run_sum, float* acc) {
  attend_q4_by_tiles(q, nq, groups, count, head_dim, run_max, run_sum, acc, true);
}
