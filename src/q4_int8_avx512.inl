// Q4 key scores and value sums of decode attention in integer arithmetic, for CPUs with AVX-512
// VNNI (vpdpbusd: 64 u8 x s8 products per instruction). Included by kernels_avx512vnni.cpp (with
// VBMI: store_low_bytes on vpermt2b) and kernels_avx512vnni_novbmi.cpp (without: two vpmovdb),
// inside their namespaces after their store_low_bytes: everything stays in an anonymous namespace (see
// kernels_internal.hpp) except the entry points, which avx512::get() installs on CPUs with VNNI.
// The two builds sum the same integers, so their results are the same bit for bit.
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
// Values (accumulate_q4) are integer too, for every head_dim: per group, query i and block column
// g, the weights w_t = p_t * scale_t become u8 on a grid of step = max_t p_t * max_t scale_t / 255
// (over the group's tokens in range), and vpdpbusd sums them with the codes over token quads. The
// fused step (attend_q4) takes two groups as one softmax tile, their weights on one grid (the
// maxima over both groups' tokens) and so their integer sums in the same accumulators: the
// softmax step's reductions, the value columns' bases and the float epilogue once per 64 tokens.
// On cached groups that measured 1.12-1.15x faster, in attend at 32k 1.07-1.08x. The codes enter
// centred, v = s (c - 8) + (m + 8 s), so a weight's rounding error (at most step / 2)
// is multiplied by |c - 8| <= 8, not by c; sum_t p_t (m_t + 8 s_t) stays in float. (The layout
// has no power-of-two condition on the block count any more: one column's set-up is the same at
// any head_dim, and at head_dim <= 32 the int8 step is faster than the float one too.)
//
// The group layout (format.hpp) is made for these loops: a key channel quad is one 64-byte row
// whose dword j holds the four channels' codes of tokens j (low nibbles) and j + 16 (high), so
// vpdpbusd takes it as it is against four int8 query channels broadcast as a dword; a value token
// quad of a column is one 64-byte row whose dword j holds channel byte j of the four tokens,
// against the four tokens' u8 weights broadcast as a dword. Scales and minimums are contiguous
// halves: over channels for keys, over the group's tokens per column for values.
//
// The fused step is shaped by where its time goes. On Zen 4 and Zen 5, vpdpbusd shares its two pipes
// with float multiplies and FMAs (not with integer adds, logic or maxima); on Zen 4 the two
// dot-product loops were half of the step's time, the rest set-up whose horizontal reductions sit
// on the critical path. Hence: the sums of Y on integer adds, the weights as u * us without a pass
// over p, the scores handed over in registers, the value columns' scales prepared while the keys
// wait for their maxima, and the prefetch bookkeeping kept to one check per two or four rows. Both
// dot-product loops are functions of their own (key_dots, value_columns_of): inlined into the
// set-up, GCC 12 kept their accumulators in memory, a load and a store around every vpdpbusd (the
// fused step 1.4x slower). Over a cache streamed from memory the step's compute and the stream of
// its bytes take about as long as each other: the set-up's time adds to the stream's, the dot
// products' hides in it. Tiles of four groups, and tiles pipelined within one call, were not kept:
// their compute gain did not survive the stream.
//
// Prefetch: the fused step prefetches the next call's groups itself, line for line: with each line
// of a group it loads, the line at the same offset of the group's ahead group (q4_group_ref, struct
// mirror below), so that every line goes out one tile before it is read and in the order it is
// read (attend over a two-tier cache at 32k, 1 thread, Zen 5: 1.11x against the next tile's lines
// handed over as one region in address order); every one of these prefetches is needed, and none
// earlier or twice. Where they go to L2 (Intel, Zen 4: mirror), heads of 64 to 128 channels also
// pull lines from L2 into L1 (pull_part): before the value pass the next tile's scales and
// minimums, which its first pass reads first, and on Intel (pull_q4_codes) in the first pass the
// tile's key and value codes, a part with each chunk of 16 channels, so that the dot products'
// loads are L1 hits (median 1.08x at head_dim 128, 32k, 1 thread, on an Intel VM; at 32 and 256
// channels the pull was slower). On Zen 4 the codes' pull cost more than it gained: without it
// the step ran 1.09-1.12x (attend over a two-tier cache, 32k and 4k, 1 thread; session 73).
// Not used: the int8 kernels on 256-bit vectors (q4_int8_avx2.inl; attend 1.7x slower on Cascade
// Lake), nor the dot products on AMX-INT8 tiles (0.78-0.80x: tiles load from memory, so every
// group's codes went through vector stores and every result through a tile store).
// (measurements: bench/PERFORMANCE.md, "Source notes: q4_int8_avx512.inl", file header)
namespace {

#include "q4_int8.inl"

struct byte_index {
  alignas(64) std::uint8_t b[64];
};

// The first n (any) of 16 lanes.
inline __mmask16 lanes_mask(unsigned n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1u); }

// Lanes of 16-lane vector r below n.
inline unsigned lanes(unsigned n, unsigned r) { return n <= 16 * r ? 0u : (n - 16 * r < 16 ? n - 16 * r : 16u); }

// n (<= 16) halves from p as floats, 0 past n (no byte read there).
inline __m512 halves(const std::uint8_t* p, unsigned n) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes_mask(n), p));
}

// Rounding to integers by adding 1.5 * 2^23: a float of magnitude in [2^23, 2^24) has ulp 1, so
// fma(a, b, round_magic) rounds a * b (exactly, in one step) to the nearest integer, ties to even,
// and for |a * b| < 2^22 its low byte is that integer modulo 256: the int8 (or u8) value itself,
// with no conversion and no packing.
constexpr float round_magic = 12582912.0f;

// vpermt2b index taking byte 0 of each dword of two vectors: 32 bytes, in lane order (store_low_bytes).
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

// The fused step's prefetch (see this file's header): with each line of a group it loads, the line at
// the same offset of the group's ahead group (q4_group_ref), at distance d bytes; d = 0 where the
// group has none (the line just loaded: an L1 hit). Into L1 where prefetch_to_l1 (Zen 5 and later:
// into L2 measured 0.76x there, the value codes'), else into L2 (prefetcht1): on Intel cores every
// software prefetch holds a line fill buffer until its line arrives, as a load does, and one that
// fills only L2 holds it for less (attend over a two-tier cache at 32k, 1 thread: 1.24x against
// L1 on an Intel VM). The choice is one predictable branch a line (line_at<-1>), and the
// dot-product loops make it once a call.
// (measurements: bench/PERFORMANCE.md, "Source notes: q4_int8_avx512.inl", mirror)
struct mirror {
  std::uintptr_t d = 0;
  bool l1 = false;
  // The line mirroring p, at level PL: -1 l1's (a branch a line), 0 L2, 1 L1 (known at compile
  // time: the dot-product loops pick it once a call, see key_dots; the step for head_dim 128 once,
  // see attend_nq).
  template <int PL>
  __attribute__((always_inline)) void line_at(const void* p) const {
    prefetch_line(reinterpret_cast<std::uintptr_t>(p) + d, PL < 0 ? l1 : PL == 1);
  }
};
inline mirror mirror_of(const std::uint8_t* group, const std::uint8_t* ahead) {
  return {ahead == nullptr ? 0 : reinterpret_cast<std::uintptr_t>(ahead) - reinterpret_cast<std::uintptr_t>(group),
          prefetch_to_l1};
}

// The fused step's pull into L1 (this file's header): part k of `parts` of the
// `lines` 64-byte lines from p (at head_dim 64 and 128 the groups' regions are whole lines; at
// other sizes a region's last bytes may lie in a line left out), into L1 (prefetch_line). Those
// lines are in L2 by then (prefetched a tile earlier), and reading them from L1 makes the dot
// products' loads L1 hits. The step pulls only where its prefetches go to L2 (!prefetch_to_l1):
// where they go to L1 (Zen 5) the lines are there already.
__attribute__((always_inline)) inline void pull_part(const std::uint8_t* p, unsigned lines, unsigned parts, unsigned k) {
  const unsigned per = (lines + parts - 1) / parts, end = (k + 1) * per < lines ? (k + 1) * per : lines;
#pragma GCC unroll 8
  for (unsigned r = k * per; r < end; ++r) prefetch_line(reinterpret_cast<std::uintptr_t>(p) + std::uintptr_t{64} * r, true);
}

inline std::int32_t dword_at(const void* p) {
  std::int32_t x;
  __builtin_memcpy(&x, p, sizeof x);
  return x;
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

// acc[i][r] += the integer dot products of query i's int8 channels ys[i * key_chunk ..] with the
// codes of tokens 16 r .. 16 r + 15 (those of 16 .. 31 times 16), over `quads` channel quads from
// `codes`. Two sets of accumulators (even and odd quads) halve the chains of dependent vpdpbusd.
// Out of line: inlined into the fused step, GCC 12 kept the accumulators in memory, a load and a
// store around every vpdpbusd. Quads: `quads` known at compile time (0: not), see attend_nq.
// Prefetched: the region pf (the separate scores kernel's) spread over the quads (where Rows: the
// fused step has none), and each quad's line at the ahead group (the fused step's).
template <unsigned NQ, unsigned Quads = 0, bool Rows = true>
__attribute__((noinline)) void key_dots(const std::uint8_t* codes, unsigned quads, const std::int8_t* ys,
                                        __m512i (&acc)[NQ][2], line_prefetch& pfr, mirror ahead) {
  if constexpr (Quads != 0) quads = Quads;
  line_prefetch pf = pfr;
  const __m512i nib_lo = _mm512_set1_epi8(0x0F), nib_hi = _mm512_set1_epi8(static_cast<char>(0xF0));
  __m512i a[2][NQ][2];
#pragma GCC unroll 8
  for (unsigned i = 0; i < NQ; ++i) {
    a[0][i][0] = acc[i][0];
    a[0][i][1] = acc[i][1];
    a[1][i][0] = a[1][i][1] = _mm512_setzero_si512();
  }
  // The loop once for each prefetch level, the level picked once a call rather than a line
  // (attend over a two-tier cache 1.015-1.026x at 32k, 1.012-1.023x at 4k from the L3; in-process
  // alternation, session 68).
  auto quads_at = [&]<int PL>() __attribute__((always_inline)) {
    auto quad = [&](unsigned j, unsigned u) __attribute__((always_inline)) {
      ahead.line_at<PL>(codes + 64 * j);
      const __m512i x = _mm512_loadu_si512(codes + 64 * j);
      const __m512i lo = _mm512_and_si512(x, nib_lo), hi16 = _mm512_and_si512(x, nib_hi);
#pragma GCC unroll 8
      for (unsigned i = 0; i < NQ; ++i) {
        const __m512i yb = _mm512_set1_epi32(dword_at(ys + i * key_chunk + 4 * j));
        dpbusd(a[u][i][0], lo, yb);
        dpbusd(a[u][i][1], hi16, yb);
      }
    };
    unsigned j = 0;
    for (; j + 2 <= quads; j += 2) {
      if (Rows && j % 4 == 0) pf.rows(quads - j >= 4 ? 4 : 2);
      quad(j, 0);
      quad(j + 1, 1);
    }
    if (j < quads) {
      if (Rows) pf.rows(1);
      quad(j, 0);
    }
  };
  if (ahead.l1) quads_at.template operator()<1>();
  else quads_at.template operator()<0>();
#pragma GCC unroll 8
  for (unsigned i = 0; i < NQ; ++i) {
    acc[i][0] = _mm512_add_epi32(a[0][i][0], a[1][i][0]);
    acc[i][1] = _mm512_add_epi32(a[0][i][1], a[1][i][1]);
  }
  pfr = pf;
}

// sc[gi][i][r]: the scores of query i over group gi (gr[gi].k), tokens 16 r .. 16 r + 15 (all 32
// of the group's lanes), for G (1, 2) groups at once: each pass runs over the channels of all G
// groups together, so that one group's chain of dependent steps (pass 1, the maxima's tree, the
// division, pass 2) runs beside the other's, and the query's channels are loaded once for both
// (two groups as one tile: 1.03x the fused step on cached groups against one group after the
// other).
// `between` runs after the first pass, where the horizontal maxima and the divisions that follow
// leave the vector pipes idle: the caller's work that does not depend on the scores.
// Each group's ahead group (gr[gi].ahead_k) is prefetched line for line as the group is read (see
// attend_nq_hd); pf, the separate kernel's region, is spread over the key dots; pull_codes: the
// groups' codes are pulled into L1 too (pull_part). HD: hd known at compile time (0: not), see
// attend_nq.
// (measurements: bench/PERFORMANCE.md, "Source notes: q4_int8_avx512.inl", scores_of)
struct nothing {
  void operator()() const {}
};
template <unsigned NQ, unsigned G, unsigned HD = 0, int PL = -1, bool Rows = true, class Between = nothing>
__attribute__((always_inline)) inline void scores_of(const float* q, const q4_group_ref* gr, unsigned hd,
                                                       __m512 (&sc)[G][NQ][2], line_prefetch& pfr,
                                                       Between between = {}, bool pull_codes = false) {
  if constexpr (HD != 0) hd = HD;
  line_prefetch pf = pfr;
  mirror ahead[G];
#pragma GCC unroll 2
  for (unsigned gi = 0; gi < G; ++gi) ahead[gi] = mirror_of(gr[gi].k, gr[gi].ahead_k);
  // Pass 1: the folded query x_d = q_d s_d (kept up to cached_channels), the largest |x_d| of
  // each query and sum_d q_d (m_d + 8 s_d) (the minimums, and the centring added back below).
  __m512 qmax[G][4], mterm[G][4];
#pragma GCC unroll 2
  for (unsigned gi = 0; gi < G; ++gi)
#pragma GCC unroll 4
    for (unsigned i = 0; i < 4; ++i) qmax[gi][i] = mterm[gi][i] = _mm512_setzero_ps();
  alignas(64) float folded[G][NQ][cached_channels];
  const bool cached = hd <= cached_channels;
  // Unrolled, in the general step (HD = 0) as well: the step on cached groups 1.02-1.03x (Zen 5);
  // pass 2's loop unrolled too ran slower (spills).
  // (measurements: bench/PERFORMANCE.md, "Source notes: q4_int8_avx512.inl", scores_of: pass 1 unrolled)
#pragma GCC unroll 8
  for (unsigned c = 0; c < hd; c += 16) {
    const unsigned n = hd - c < 16 ? hd - c : 16;
    __m512 qv[NQ];
#pragma GCC unroll 8
    for (unsigned i = 0; i < NQ; ++i) qv[i] = _mm512_maskz_loadu_ps(lanes_mask(n), q + i * hd + c);
#pragma GCC unroll 2
    for (unsigned gi = 0; gi < G; ++gi) {
      if (c % 32 == 0) {  // a line of scales and one of minimums per 32 channels
        ahead[gi].template line_at<PL>(gr[gi].k + key_scales_at(hd) + 2 * c);
        ahead[gi].template line_at<PL>(gr[gi].k + key_mins_at(hd) + 2 * c);
      }
      if (PL != 1 && pull_codes) {  // the group's key and value codes into L1, a part a chunk (pull_part)
        const unsigned parts = (hd + 15) / 16;
        pull_part(gr[gi].k, key_channels(hd) / 4, parts, c / 16);
        pull_part(gr[gi].v, 8 * value_blocks(hd), parts, c / 16);
      }
      const __m512 s = halves(gr[gi].k + key_scales_at(hd) + 2 * c, n), m = halves(gr[gi].k + key_mins_at(hd) + 2 * c, n);
      const __m512 m8 = _mm512_fmadd_ps(s, _mm512_set1_ps(8.0f), m);
#pragma GCC unroll 8
      for (unsigned i = 0; i < NQ; ++i) {
        const __m512 x = _mm512_mul_ps(qv[i], s);
        if (cached) _mm512_store_ps(folded[gi][i] + c, x);
        qmax[gi][i] = _mm512_range_ps(qmax[gi][i], x, 0x0B);  // max(|qmax|, |x|): imm 11 (larger |.|), 10 (sign cleared)
        mterm[gi][i] = _mm512_fmadd_ps(qv[i], m8, mterm[gi][i]);
      }
    }
  }
  between();
  // Lane 4 i: the scale of query i, max|x| / 127, and its inverse (0 where the folded query is all
  // zeros).
  // The inverses stay in registers, broadcast by a permute: through memory (a store, then a
  // broadcast load per query) they sat on the step's chain of maxima, division and pass 2
  // (store forwarding; 1.04x on cached groups this way). The scales, used off that chain, stay
  // in memory.
  // (measurements: bench/PERFORMANCE.md, "Source notes: q4_int8_avx512.inl", scores_of: the inverses)
  alignas(64) float scale[G][16];
  __m512 invv[G];
#pragma GCC unroll 2
  for (unsigned gi = 0; gi < G; ++gi) {
    const __m512 mx = reduce4(qmax[gi], max_of);
    _mm512_store_ps(scale[gi], _mm512_div_ps(mx, _mm512_set1_ps(127.0f)));
    invv[gi] = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(mx, _mm512_setzero_ps(), _CMP_GT_OQ), _mm512_set1_ps(127.0f), mx);
  }
  // Pass 2: Y of a chunk of channels, then the integer dot products over it (key_dots).
  __m512i acc[G][NQ][2], ysum[G][4];
#pragma GCC unroll 2
  for (unsigned gi = 0; gi < G; ++gi) {
#pragma GCC unroll 8
    for (unsigned i = 0; i < NQ; ++i) acc[gi][i][0] = acc[gi][i][1] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (unsigned i = 0; i < 4; ++i) ysum[gi][i] = _mm512_setzero_si512();
  }
  alignas(64) std::int8_t ys[G][NQ][key_chunk];
  alignas(64) float base[G][16];
  const __m512i order = _mm512_load_si512(low_bytes.b);
  std::uint32_t blocks = 0;  // of 32 channels: each adds round_magic's bits twice to every lane of ysum
  for (unsigned c0 = 0; c0 < hd; c0 += key_chunk) {
    const unsigned nd = hd - c0 < key_chunk ? hd - c0 : key_chunk;
    for (unsigned j = 0; j < nd; j += 32) {
#pragma GCC unroll 2
      for (unsigned gi = 0; gi < G; ++gi) {
        __m512 x[NQ][2];
#pragma GCC unroll 2
        for (unsigned r = 0; r < 2; ++r) {
          const unsigned n = lanes(nd - j, r), c = c0 + j + 16 * r;
          if (cached) {
#pragma GCC unroll 8
            for (unsigned i = 0; i < NQ; ++i) x[i][r] = _mm512_maskz_load_ps(lanes_mask(n), folded[gi][i] + c);
          } else {
            const __m512 s = n > 0 ? halves(gr[gi].k + key_scales_at(hd) + 2 * c, n) : _mm512_setzero_ps();
#pragma GCC unroll 8
            for (unsigned i = 0; i < NQ; ++i)
              x[i][r] = _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes_mask(n), q + i * hd + c), s);
          }
        }
#pragma GCC unroll 8
        for (unsigned i = 0; i < NQ; ++i) {
          const __m512 k1 = _mm512_permutexvar_ps(_mm512_set1_epi32(static_cast<int>(4 * i)), invv[gi]);
          const __m512 mg = _mm512_set1_ps(round_magic);
          const __m512i y0 = _mm512_castps_si512(_mm512_fmadd_ps(x[i][0], k1, mg));
          const __m512i y1 = _mm512_castps_si512(_mm512_fmadd_ps(x[i][1], k1, mg));
          store_low_bytes(ys[gi][i] + j, y0, order, y1);
          // sum_d Y_d on the integer pipes: the bits of magic + Y are those of magic plus Y.
          ysum[gi][i] = _mm512_add_epi32(ysum[gi][i], _mm512_add_epi32(y0, y1));
        }
      }
      ++blocks;
    }
    if (c0 + nd == hd) {
      // The last chunk's Y are in: the scores' base, ahead of the dot products (which do not need
      // it), score = scale (sum_d Y_d c_d + 8 sum_d (y_d - Y_d)) + sum_d q_d m_d, y_d = x_d / scale,
      //       = scale (sum_d Y_d c_d - 8 sum_d Y_d) + sum_d q_d (m_d + 8 s_d).
      // blocks * 2 * bits(round_magic), modulo 2^32 as the lanes' sums wrap (the sums of Y fit).
      const __m512i magic_bits = _mm512_set1_epi32(static_cast<int>(blocks * 2u * 0x4B400000u));
#pragma GCC unroll 2
      for (unsigned gi = 0; gi < G; ++gi) {
        __m512 b[4];
#pragma GCC unroll 4
        for (unsigned i = 0; i < 4; ++i)  // sum_d Y_d exact in float: |sum| < 2^24
          b[i] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(ysum[gi][i], magic_bits)),
                                  _mm512_set1_ps(8.0f * scale[gi][4 * i]), mterm[gi][i]);
        _mm512_store_ps(base[gi], reduce4(b, sum_of));
      }
    }
    // The chunk's channel quads, each one 64-byte row: dword j = its four channels' codes of
    // token j (low nibbles) and j + 16 (high nibbles, left in place: codes times 16). The last
    // quad of a head_dim that is not a multiple of 4 has codes 0 past it, and Y is 0 there.
#pragma GCC unroll 2
    for (unsigned gi = 0; gi < G; ++gi)
      key_dots<NQ, (HD != 0 && HD <= key_chunk) ? (HD + 3) / 4 : 0, Rows>(gr[gi].k + std::size_t{16} * c0, (nd + 3) / 4,
                                                                   &ys[gi][0][0], acc[gi], pf, ahead[gi]);
  }
#pragma GCC unroll 2
  for (unsigned gi = 0; gi < G; ++gi)
#pragma GCC unroll 8
    for (unsigned i = 0; i < NQ; ++i) {
      const __m512 bs = _mm512_set1_ps(base[gi][4 * i]);
      // Tokens 16..31 were summed with their codes times 16.
#pragma GCC unroll 2
      for (unsigned r = 0; r < 2; ++r)
        sc[gi][i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[gi][i][r]),
                                       _mm512_set1_ps(r == 0 ? scale[gi][4 * i] : scale[gi][4 * i] * 0.0625f), bs);
    }
  pfr = pf;
}

template <unsigned NQ>
void scores_nq(const float* q, const std::uint8_t* k, unsigned tokens, unsigned hd, float* out, std::size_t out_stride,
               line_prefetch& pf) {
  __m512 sc[1][NQ][2];
  const q4_group_ref gr{k, nullptr, tokens};
  scores_of<NQ, 1>(q, &gr, hd, sc, pf);
#pragma GCC unroll 8
  for (unsigned i = 0; i < NQ; ++i)
#pragma GCC unroll 2
    for (unsigned r = 0; r < 2; ++r) {
      if (tokens == 32) _mm512_storeu_ps(out + i * out_stride + 16 * r, sc[0][i][r]);
      else _mm512_mask_storeu_ps(out + i * out_stride + 16 * r, lanes_mask(lanes(tokens, r)), sc[0][i][r]);
    }
}

// ---- values: lanes = 16 channels of a block column, dot products over token quads --------------

constexpr unsigned value_columns = 4;  // block columns per set-up (one reduction tree)

// The value groups of one softmax tile, G (1, 2) of them: group gi's codes v[gi], its tokens in
// range (bit t: token t) tm[gi], covered by its token quads [q0[gi], q1[gi]), and its ahead
// group's mirror (none: distance 0).
template <unsigned G>
struct tile_groups {
  const std::uint8_t* v[G];
  __mmask32 tm[G];
  unsigned q0[G], q1[G];
  mirror ahead[G] = {};  // of the value groups
};

// What the set-up of a batch of columns hands the integer loop, per query i and column c.
template <unsigned NQ, unsigned G>
struct column_weights {
  alignas(64) std::uint8_t w[NQ][value_columns][32 * G];  // u8 weights: group gi's tokens at 32 gi, dword Q = tokens 4Q..4Q+3
  alignas(64) float step[16];                              // lane 4 i + c: the grid step of the weights, over 16
  alignas(64) float base[16];                              // lane 4 i + c: sum_t p_t (m_t + 8 s_t)
};

// acc[i][32 c .. 32 c + 32) (up to hd_left channels from the first column's) += column c's share
// of sum_t p_t v_t, for NC (1, 2) adjacent columns from column offset `at` (bytes) of each group,
// over the groups' token quads [q0, q1) of their codes (a 64-byte row each: dword j = channel
// byte j of the quad's four tokens), all G groups into the same integer sums (their weights are on
// one grid). The codes enter centred and times 16, 16 (c - 8) in -128..112: with y = x ^ 0x88,
// y & 0xF0 for the high nibbles (channels 16..31) and (y << 4) & 0xF0 for the low ones (channels
// 0..15): a xor, a shift and two ands, where a shift and two vpternlogd did it before. On Zen 4
// vpternlogd runs on FP0 and FP1, vpdpbusd's two pipes, and vpxord, vpandd and shifts on any of
// the four: in a loop of vpdpbusd one vpternlogd each took the loop twice as long, one vpxord or
// vpandd each no longer. Without the vpternlogd attend over a two-tier cache ran a median 1.006x
// at 32k (0.99-1.02) and 1.007x at 4k from the L3 (1.000-1.015; 1 thread, in-process
// alternation, session 74). Not measured on Intel, where both forms' logic can go to port 5.
// (measurements: bench/PERFORMANCE.md, "Source notes: q4_int8_avx512.inl", value_columns_of)
// Weights of query i, column c, group gi at w + i * w_stride + 32 G c + 32 gi; step, base of
// query i, column c at [i * sb_stride + c].
// Two columns a call: 4 NQ independent chains of vpdpbusd (latency 4) rather than 2 NQ, and half
// the calls. Out of line: inlined into the set-up's loops, GCC 12 keeps the accumulators in memory.
// Full: every group's token quads are 0..7 (all 32 tokens in range), a loop of fixed length.
// Prefetched: the region pf spread over the quads, and each row's line at its group's ahead group
// (tg.ahead).
template <unsigned NQ, unsigned NC, unsigned G, bool Full = false, bool Rows = true>
__attribute__((noinline)) void value_columns_of(const tile_groups<G>& tg, std::size_t at, const std::uint8_t* w,
                                                std::size_t w_stride, const float* step, const float* base,
                                                std::size_t sb_stride, unsigned hd_left, float* acc,
                                                std::size_t acc_stride, line_prefetch& pfr) {
  line_prefetch pf = pfr;
  const __m512i nib_hi = _mm512_set1_epi8(static_cast<char>(0xF0)), flip = _mm512_set1_epi8(static_cast<char>(0x88));
  __m512i a0[NC][NQ], a1[NC][NQ];
#pragma GCC unroll 2
  for (unsigned c = 0; c < NC; ++c)
#pragma GCC unroll 8
    for (unsigned i = 0; i < NQ; ++i) a0[c][i] = a1[c][i] = _mm512_setzero_si512();
  // The loop once for each prefetch level, picked once a call (as in key_dots: attend over a
  // two-tier cache 1.007-1.015x at 32k with 1 thread, 1.005-1.013x with 2; in-process
  // alternation, session 68).
  auto groups_at = [&]<int PL>() __attribute__((always_inline)) {
#pragma GCC unroll 2
    for (unsigned gi = 0; gi < G; ++gi) {
      const std::uint8_t* codes = tg.v[gi] + at;
      const std::uint8_t* wg = w + 32 * gi;
      auto quad = [&](unsigned j) __attribute__((always_inline)) {
#pragma GCC unroll 2
        for (unsigned c = 0; c < NC; ++c) {
          tg.ahead[gi].template line_at<PL>(codes + std::size_t{512} * c + 64 * j);
          const __m512i x = _mm512_loadu_si512(codes + std::size_t{512} * c + 64 * j);
          const __m512i y = _mm512_xor_si512(x, flip);
          const __m512i lo = _mm512_and_si512(_mm512_slli_epi32(y, 4), nib_hi), hi = _mm512_and_si512(y, nib_hi);
#pragma GCC unroll 8
          for (unsigned i = 0; i < NQ; ++i) {
            const __m512i wi = _mm512_set1_epi32(dword_at(wg + i * w_stride + 32 * G * c + 4 * j));
            dpbusd(a0[c][i], wi, lo);
            dpbusd(a1[c][i], wi, hi);
          }
        }
      };
      const unsigned q1 = Full ? 8 : tg.q1[gi];
      unsigned j = Full ? 0 : tg.q0[gi];
      for (; j + 2 <= q1; j += 2) {
        if (Rows) pf.rows(2 * NC);
        quad(j);
        quad(j + 1);
      }
      if (j < q1) {
        if (Rows) pf.rows(NC);
        quad(j);
      }
    }
  };
  if (tg.ahead[0].l1) groups_at.template operator()<1>();
  else groups_at.template operator()<0>();
#pragma GCC unroll 2
  for (unsigned c = 0; c < NC; ++c) {
    const unsigned ch = hd_left - 32 * c < 32 ? hd_left - 32 * c : 32;
    const __mmask16 m0 = lanes_mask(lanes(ch, 0)), m1 = lanes_mask(lanes(ch, 1));
#pragma GCC unroll 8
    for (unsigned i = 0; i < NQ; ++i) {
      const __m512 st = _mm512_set1_ps(step[i * sb_stride + c]), bs = _mm512_set1_ps(base[i * sb_stride + c]);
      float* o = acc + i * acc_stride + 32 * c;
      _mm512_mask_storeu_ps(o, m0,
                            _mm512_add_ps(_mm512_maskz_loadu_ps(m0, o), _mm512_fmadd_ps(_mm512_cvtepi32_ps(a0[c][i]), st, bs)));
      _mm512_mask_storeu_ps(
          o + 16, m1, _mm512_add_ps(_mm512_maskz_loadu_ps(m1, o + 16), _mm512_fmadd_ps(_mm512_cvtepi32_ps(a1[c][i]), st, bs)));
    }
  }
  pfr = pf;
}

// The sums of all 16 lanes of each of 16 vectors x[4 e + j], to lane 4 j + e of one vector, by a
// transposing tree (45 instructions for the 16 sums) taken in two steps: sum4_of_column, the first
// two levels over the four vectors x[4 e ..] of one e, as soon as those are in (16 vectors live at
// once spilled to the stack), then sum16_last over the four results.
__attribute__((always_inline)) inline __m512 sum4_of_column(const __m512 (&x)[4]) {
  __m512 a[2];
#pragma GCC unroll 2
  for (unsigned k = 0; k < 2; ++k)
    a[k] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * k], x[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(x[2 * k], x[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(a[0], a[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(a[0], a[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
__attribute__((always_inline)) inline __m512 sum16_last(const __m512 (&b)[4]) {
  __m512 c[2];
#pragma GCC unroll 2
  for (unsigned k = 0; k < 2; ++k)
    c[k] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * k], b[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(b[2 * k], b[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// What a batch of columns' set-up takes from the scales and minimums alone (no weights): per
// column c and group gi (at 32 gi), the scales times 255 / max_t s and m + 8 s over the tokens in
// range (0 elsewhere, whatever is stored there), and max_t s over all G groups (lane 4 c).
template <unsigned G>
struct column_scales {
  alignas(64) float s[value_columns][32 * G];
  alignas(64) float m8[value_columns][32 * G];
  __m512 smax;
};

// Column g's scales (or minimums) of the tokens in tm, 0 elsewhere (whatever is stored there).
__attribute__((always_inline)) inline void column_halves(const std::uint8_t* h, unsigned g, __mmask32 tm, __m512& lo,
                                                         __m512& hi) {
  lo = _mm512_maskz_cvtph_ps(static_cast<__mmask16>(tm), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + 64 * g)));
  hi = _mm512_maskz_cvtph_ps(static_cast<__mmask16>(tm >> 16),
                             _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + 64 * g + 32)));
}

// The column_scales of columns g0 .. g0 + nc - 1 (nc <= value_columns) of the tile's groups.
template <unsigned G, int PL = -1>
__attribute__((always_inline)) inline void prepare_columns(const tile_groups<G>& tg, unsigned hd, unsigned g0,
                                                           unsigned nc, column_scales<G>& cs) {
  __m512 sl[4][G], sh[4][G], sm[4];
#pragma GCC unroll 4
  for (unsigned c = 0; c < 4; ++c) {
    sm[c] = _mm512_setzero_ps();
    if (c < nc) {
#pragma GCC unroll 2
      for (unsigned gi = 0; gi < G; ++gi) {
        tg.ahead[gi].template line_at<PL>(tg.v[gi] + value_scales_at(hd) + 64 * (g0 + c));
        tg.ahead[gi].template line_at<PL>(tg.v[gi] + value_mins_at(hd) + 64 * (g0 + c));
        column_halves(tg.v[gi] + value_scales_at(hd), g0 + c, tg.tm[gi], sl[c][gi], sh[c][gi]);
        sm[c] = _mm512_max_ps(sm[c], _mm512_max_ps(sl[c][gi], sh[c][gi]));
      }
    }
  }
  cs.smax = reduce4(sm, max_of);
  alignas(64) float sinv[16];
  _mm512_store_ps(sinv, _mm512_maskz_div_ps(_mm512_cmp_ps_mask(cs.smax, _mm512_setzero_ps(), _CMP_GT_OQ),
                                            _mm512_set1_ps(255.0f), cs.smax));
#pragma GCC unroll 4
  for (unsigned c = 0; c < 4; ++c) {
    if (c < nc) {
      const __m512 si = _mm512_set1_ps(sinv[4 * c]);
#pragma GCC unroll 2
      for (unsigned gi = 0; gi < G; ++gi) {
        __m512 ml, mh;
        column_halves(tg.v[gi] + value_mins_at(hd), g0 + c, tg.tm[gi], ml, mh);
        _mm512_store_ps(cs.m8[c] + 32 * gi, _mm512_fmadd_ps(sl[c][gi], _mm512_set1_ps(8.0f), ml));
        _mm512_store_ps(cs.m8[c] + 32 * gi + 16, _mm512_fmadd_ps(sh[c][gi], _mm512_set1_ps(8.0f), mh));
        _mm512_store_ps(cs.s[c] + 32 * gi, _mm512_mul_ps(sl[c][gi], si));  // s 255 / max_t s
        _mm512_store_ps(cs.s[c] + 32 * gi + 16, _mm512_mul_ps(sh[c][gi], si));
      }
    }
  }
}

// acc[i][..] += sum_t p_t v_t over the tokens of the tile's G value groups in range, with
// p_t = u_t us_i: u_t of query i, group gi in lane t of u[i][2 gi] (tokens 0..15) and
// u[i][2 gi + 1] (16..31), 0 outside the range and at most 1 (up to rounding: the largest is about
// 1); us: lanes 4 i .. 4 i + 3, the factor of query i. Per batch of columns: the scales' maxima
// over the tile's tokens in one tree, then per query and column the u8 weights
// round(u s 255 / max_t s) (every one <= 255: p s on one grid of step = us max_t s / 255 for all G
// groups, whose integer sums therefore add up before the float epilogue), and the bases
// us sum_t u_t (m_t + 8 s_t) (the batch's in one tree).
template <unsigned NQ, unsigned G, int PL = -1, bool Rows = true>
__attribute__((always_inline)) inline void values_nq(const __m512 (&u)[NQ][2 * G], __m512 us, const tile_groups<G>& tg,
                                                     unsigned hd, float* acc, line_prefetch& pf,
                                                     const column_scales<G>* first = nullptr) {
  const unsigned nb = value_blocks(hd);
  const __m512 pm = _mm512_mul_ps(us, _mm512_set1_ps(1.0f / (255.0f * 16.0f)));  // step / max_t s, over 16
  const __m512i order = _mm512_load_si512(low_bytes.b);
  const __m512i group_lane = _mm512_setr_epi32(0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12);
  const __m512 mg = _mm512_set1_ps(round_magic);
  column_weights<NQ, G> cw;
  column_scales<G> own;
  bool full = true;  // every group's 32 tokens in range: its token quads are 0..7
#pragma GCC unroll 2
  for (unsigned gi = 0; gi < G; ++gi) full = full && tg.tm[gi] == ~__mmask32{0};
  for (unsigned g0 = 0; g0 < nb; g0 += value_columns) {
    const unsigned nc = nb - g0 < value_columns ? nb - g0 : value_columns;
    const column_scales<G>* cs = g0 == 0 && first != nullptr ? first : &own;
    if (cs == &own) prepare_columns<G, PL>(tg, hd, g0, nc, own);
    // The bases' sums, column by column, each column's four reduced at once (sum4_of_column).
    __m512 bcol[4];
#pragma GCC unroll 4
    for (unsigned c = 0; c < 4; ++c) {
      bcol[c] = _mm512_setzero_ps();
      if (c < nc) {
        __m512 bsum[4];
#pragma GCC unroll 4
        for (unsigned i = 0; i < 4; ++i) bsum[i] = _mm512_setzero_ps();
#pragma GCC unroll 2
        for (unsigned gi = 0; gi < G; ++gi) {
          const __m512 sl = _mm512_load_ps(cs->s[c] + 32 * gi), sh = _mm512_load_ps(cs->s[c] + 32 * gi + 16);
          const __m512 m8l = _mm512_load_ps(cs->m8[c] + 32 * gi), m8h = _mm512_load_ps(cs->m8[c] + 32 * gi + 16);
#pragma GCC unroll 4
          for (unsigned i = 0; i < NQ; ++i) {
            const __m512i w0 = _mm512_castps_si512(_mm512_fmadd_ps(u[i][2 * gi], sl, mg));
            const __m512i w1 = _mm512_castps_si512(_mm512_fmadd_ps(u[i][2 * gi + 1], sh, mg));
            store_low_bytes(cw.w[i][c] + 32 * gi, w0, order, w1);
            bsum[i] = _mm512_fmadd_ps(u[i][2 * gi], m8l, _mm512_fmadd_ps(u[i][2 * gi + 1], m8h, bsum[i]));
          }
        }
        bcol[c] = sum4_of_column(bsum);
      }
    }
    // Lane 4 i + c: the base and step of query i, column g0 + c.
    _mm512_store_ps(cw.base, _mm512_mul_ps(sum16_last(bcol), us));
    _mm512_store_ps(cw.step, _mm512_mul_ps(pm, _mm512_permutexvar_ps(group_lane, cs->smax)));
    unsigned c = 0;
    for (; c + 2 <= nc; c += 2) {
      const std::size_t at = std::size_t{512} * (g0 + c);
      if (full)
        value_columns_of<NQ, 2, G, true, Rows>(tg, at, cw.w[0][c], sizeof cw.w[0], cw.step + c, cw.base + c, 4,
                                               hd - 32 * (g0 + c), acc + 32 * (g0 + c), hd, pf);
      else
        value_columns_of<NQ, 2, G, false, Rows>(tg, at, cw.w[0][c], sizeof cw.w[0], cw.step + c, cw.base + c, 4,
                                                hd - 32 * (g0 + c), acc + 32 * (g0 + c), hd, pf);
    }
    if (c < nc)
      value_columns_of<NQ, 1, G, false, Rows>(tg, std::size_t{512} * (g0 + c), cw.w[0][c], sizeof cw.w[0],
                                              cw.step + c, cw.base + c, 4, hd - 32 * (g0 + c), acc + 32 * (g0 + c),
                                              hd, pf);
  }
}

// Lane 4 i: the largest of plo[i], phi[i] (0 for i >= NQ).
template <unsigned NQ>
__attribute__((always_inline)) inline __m512 max_weights(const __m512 (&plo)[NQ], const __m512 (&phi)[NQ]) {
  __m512 m[4];
#pragma GCC unroll 4
  for (unsigned i = 0; i < 4; ++i) m[i] = i < NQ ? _mm512_max_ps(plo[i % NQ], phi[i % NQ]) : _mm512_setzero_ps();
  return reduce4(m, max_of);
}

// accumulate_q4 for NQ (1..4) queries: tokens [first, first + n) of the group, the weights moved
// to their tokens' lanes.
template <unsigned NQ>
void accumulate_nq(const float* p, std::size_t p_stride, const std::uint8_t* v, unsigned first, unsigned n, unsigned hd,
                   float* acc, line_prefetch& pf) {
  const unsigned end = first + n;
  const __mmask32 tm = static_cast<__mmask32>((end >= 32 ? ~0u : (1u << end) - 1u) & ~((1u << first) - 1u));
  const __m512i idx = _mm512_sub_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                       _mm512_set1_epi32(static_cast<int>(first)));
  const __m512i idx16 = _mm512_add_epi32(idx, _mm512_set1_epi32(16));
  __m512 plo[NQ], phi[NQ];
#pragma GCC unroll 4
  for (unsigned i = 0; i < NQ; ++i) {
    // p[r] of token first + r: loaded to lanes r (masked to n), then lane t takes lane t - first.
    const __m512 a = _mm512_maskz_loadu_ps(lanes_mask(n), p + i * p_stride);
    const __m512 b = _mm512_maskz_loadu_ps(lanes_mask(lanes(n, 1)), p + i * p_stride + 16);
    plo[i] = _mm512_maskz_permutex2var_ps(static_cast<__mmask16>(tm), a, idx, b);
    phi[i] = _mm512_maskz_permutex2var_ps(static_cast<__mmask16>(tm >> 16), a, idx16, b);
  }
  // u = p / max_t p. Below 2^-100, p is scaled by 2^100 first (exact), since 1 / max p overflows
  // below ~2^-126.
  const __m512 pmax = max_weights<NQ>(plo, phi);
  alignas(64) float big[16], kf[16];
  {
    const __m512 b = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(pmax, _mm512_set1_ps(0x1p-100f), _CMP_LT_OQ),
                                          _mm512_set1_ps(1.0f), _mm512_set1_ps(0x1p100f));
    _mm512_store_ps(big, b);
    _mm512_store_ps(kf, _mm512_maskz_div_ps(_mm512_cmp_ps_mask(pmax, _mm512_setzero_ps(), _CMP_GT_OQ),
                                            _mm512_set1_ps(1.0f), _mm512_mul_ps(pmax, b)));
  }
  __m512 u[NQ][2];
#pragma GCC unroll 4
  for (unsigned i = 0; i < NQ; ++i) {
    const __m512 b = _mm512_set1_ps(big[4 * i]), k = _mm512_set1_ps(kf[4 * i]);
    u[i][0] = _mm512_mul_ps(_mm512_mul_ps(plo[i], b), k);
    u[i][1] = _mm512_mul_ps(_mm512_mul_ps(phi[i], b), k);
  }
  const tile_groups<1> tg{{v}, {tm}, {first / 4}, {(end + 3) / 4}};
  values_nq<NQ, 1>(u, pmax, tg, hd, acc, pf);
}

// ---- the online-softmax step over one tile of G (1, 2) groups: scores, weights and values of
// four queries ----

#include "avx512_float_ops.inl"
using S = avx512_float_ops;

// 2^x for x <= 0, as attend()'s softmax step computes it.
#include "exp2_simd.inl"

// table::attend_q4 for NQ (1..4) queries over G groups as one tile: the scores in registers, the
// softmax step with the queries' maxima and sums each reduced in one tree over all G groups, and
// the values with the weights straight from registers, all G groups' integer sums on one grid
// and one float epilogue (two groups a tile halve the set-up that is per tile rather than per
// group). Keys wider than int8_key_channels go to the float kernel, as in scores_q4.
// HD: hd known at compile time (0: not), see attend_nq below.
template <unsigned NQ, unsigned G, unsigned HD, int PL = -1>
void attend_nq_hd(const float* q, const q4_group_ref* gr, unsigned hd, float* run_max, float* run_sum, float* acc,
                  line_prefetch& pf) {
  if constexpr (HD != 0) hd = HD;
  // The step prefetches its ahead groups itself (attend_q4 runs attend_q4_by_tiles without
  // `spread`): pf holds no region, and the dot-product loops skip its rows (Rows = false; 1.005-1.02x
  // in attend over a two-tier cache, session 68).
  assert(pf.step == 0);
  // Heads of 64 to 128 channels pull their lines into L1 where the step prefetches into L2
  // (pull_part; session 50: 32 and 256 channels ran slower so): the next tile's scales and
  // minimums, and the tile's codes where pull_q4_codes (not on AMD: see this file's header).
  const bool pull = PL != 1 && !prefetch_to_l1 && hd >= 64 && hd <= 128;
  __m512 s[G][NQ][2], mx[4];
  tile_groups<G> tg;
  __mmask16 m[G][2];
#pragma GCC unroll 2
  for (unsigned gi = 0; gi < G; ++gi) {
    const unsigned tokens = gr[gi].tokens;
    tg.v[gi] = gr[gi].v;
    tg.ahead[gi] = mirror_of(gr[gi].v, gr[gi].ahead_v);
    tg.tm[gi] = static_cast<__mmask32>(tokens >= 32 ? ~0u : (1u << tokens) - 1u);
    tg.q0[gi] = 0;
    tg.q1[gi] = (tokens + 3) / 4;
    m[gi][0] = lanes_mask(lanes(tokens, 0));
    m[gi][1] = lanes_mask(lanes(tokens, 1));
  }
  const unsigned nb = value_blocks(hd);
  column_scales<G> first;  // the first batch of value columns, prepared while the keys wait
  auto prepare = [&] { prepare_columns<G, PL>(tg, hd, 0, nb < value_columns ? nb : value_columns, first); };
  if (hd <= int8_key_channels) {
    scores_of<NQ, G, HD, PL, false>(q, gr, hd, s, pf, prepare, pull && pull_q4_codes);
  } else {  // see scores_q4
    prepare();
#pragma GCC unroll 2
    for (unsigned gi = 0; gi < G; ++gi) {
      alignas(64) float w[NQ][32];
      avx512::float_q4().scores_q4(q, NQ, gr[gi].k, gr[gi].tokens, hd, &w[0][0], 32, {});
#pragma GCC unroll 4
      for (unsigned i = 0; i < NQ; ++i) {
        s[gi][i][0] = _mm512_maskz_load_ps(m[gi][0], w[i]);  // lanes past tokens: masked below
        s[gi][i][1] = _mm512_maskz_load_ps(m[gi][1], w[i] + 16);
      }
    }
  }
  const __m512 ninf = _mm512_set1_ps(-__builtin_inff());
#pragma GCC unroll 4
  for (unsigned i = 0; i < 4; ++i) {
    mx[i] = ninf;
    if (i < NQ) {
#pragma GCC unroll 2
      for (unsigned gi = 0; gi < G; ++gi) {
        s[gi][i][0] = _mm512_mask_mov_ps(ninf, m[gi][0], s[gi][i][0]);
        s[gi][i][1] = _mm512_mask_mov_ps(ninf, m[gi][1], s[gi][i][1]);
        mx[i] = _mm512_max_ps(mx[i], _mm512_max_ps(s[gi][i][0], s[gi][i][1]));
      }
    }
  }
  alignas(64) float tile_max[16];
  const __m512 tmax = reduce4(mx, max_of);
  _mm512_store_ps(tile_max, tmax);
  // The weights w_t = 2^(s_t - m_new) as u_t us: u_t = 2^(s_t - tile max) (the top token's 1, to
  // 7.5e-5), us = 2^(tile max - m_new) (lanes 4 i ..).
  // u_t by the cubic exp2_weights (7.5e-5 relative), as they go to 8 bits next (at most
  // round(255 (1 + 7.5e-5)) = 255: no weight leaves u8): two FMAs fewer a vector than
  // exp2_nonpositive, attend over a two-tier cache 1.010-1.014x at 32k (1 thread; 1.014 with 2;
  // 1.006-1.015 at 4k from the L3; in-process alternation, session 68).
  const __m512 m_new_v = _mm512_max_ps(
      tmax, _mm512_permutexvar_ps(_mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 2),
                                  _mm512_maskz_loadu_ps(lanes_mask(NQ), run_max)));
  const __m512 us = exp2_nonpositive(_mm512_sub_ps(tmax, m_new_v));
  float m_new[NQ];
  __m512 u[NQ][2 * G], sum[4];
#pragma GCC unroll 4
  for (unsigned i = 0; i < 4; ++i) {
    sum[i] = _mm512_setzero_ps();
    if (i < NQ) {
      m_new[i] = tile_max[4 * i] > run_max[i] ? tile_max[4 * i] : run_max[i];
      const __m512 mi = _mm512_permutexvar_ps(_mm512_set1_epi32(static_cast<int>(4 * i)), tmax);
#pragma GCC unroll 2
      for (unsigned gi = 0; gi < G; ++gi) {
        u[i][2 * gi] = _mm512_maskz_mov_ps(m[gi][0], exp2_weights(_mm512_sub_ps(s[gi][i][0], mi)));
        u[i][2 * gi + 1] = _mm512_maskz_mov_ps(m[gi][1], exp2_weights(_mm512_sub_ps(s[gi][i][1], mi)));
        sum[i] = _mm512_add_ps(sum[i], _mm512_add_ps(u[i][2 * gi], u[i][2 * gi + 1]));
      }
    }
  }
  alignas(64) float total[16];
  _mm512_store_ps(total, _mm512_mul_ps(reduce4(sum, sum_of), us));
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
        const __mmask16 md = lanes_mask(hd - d);
        _mm512_mask_storeu_ps(a + d, md, _mm512_mul_ps(_mm512_maskz_loadu_ps(md, a + d), cv));
      }
      run_sum[i] *= corr;
      run_max[i] = m_new[i];
    }
    run_sum[i] += total[4 * i];
  }
  // The next tile's key and value scales and minimums into L1 (pull_part), which its first pass
  // reads first: prefetched into L2 during this tile's first pass, they are there by now.
#pragma GCC unroll 2
  for (unsigned gi = 0; gi < G; ++gi)
    if (pull && gr[gi].ahead_k != nullptr) {
      pull_part(gr[gi].ahead_k + key_scales_at(hd), (key_channels(hd) + 15) / 16, 1, 0);
      pull_part(gr[gi].ahead_v + value_scales_at(hd), 2 * value_blocks(hd), 1, 0);
    }
  values_nq<NQ, G, PL, false>(u, us, tg, hd, acc, pf, &first);
}

// The step for head_dim 128 (most models' head size) is compiled for it: its loops over channels
// and channel quads of fixed length, unrolled where GCC sees fit, with no lane masks computed at
// run time; other sizes take the general one. With full groups the value columns' loops over
// token quads are fixed too (value_columns_of, Full). On Zen 5: the step on cached groups
// 1.09-1.10x, attend over a two-tier cache at 32k 1.06x, for about 14 KB of code a (NQ, G) pair.
// head_dim 64 (small models': Llama 3.2 1B) too: attend 1.08x at 32k with 1 thread. Not 256: at
// 32k the stream of the store, not the step, sets the pace (0.93x).
// Where the step prefetches into L1 (Zen 5 and later), the step for head_dim 128 is compiled for
// that too (PL = 1): its ahead lines with no branch on the level, and no pull (pull_part) code. On
// Zen 5 (in-process alternation, session 68): attend over a two-tier cache 1.04-1.08x at 32k with
// 1 thread, 1.00-1.02x with 2, 1.04-1.07x at 4k from the L3 (1.09 with 2); about 65 KB of code.
// Not at head_dim 64: built so, its step ran 0.97-0.98x with 1 thread and 0.96x with 2.
// (measurements: bench/PERFORMANCE.md, "Source notes: q4_int8_avx512.inl", attend_nq)
template <unsigned NQ, unsigned G>
void attend_nq(const float* q, const q4_group_ref* gr, unsigned hd, float* run_max, float* run_sum, float* acc,
               line_prefetch& pf) {
  if (hd == 128) {
    if (prefetch_to_l1) attend_nq_hd<NQ, G, 128, 1>(q, gr, hd, run_max, run_sum, acc, pf);
    else attend_nq_hd<NQ, G, 128>(q, gr, hd, run_max, run_sum, acc, pf);
  }
  else if (hd == 64) attend_nq_hd<NQ, G, 64>(q, gr, hd, run_max, run_sum, acc, pf);
  else attend_nq_hd<NQ, G, 0>(q, gr, hd, run_max, run_sum, acc, pf);
}

}  // namespace

void scores_q4(const float* q, std::uint32_t nq, const std::uint8_t* k, std::uint32_t tokens, std::uint32_t head_dim,
               float* out, std::size_t out_stride, prefetch_region pf) {
  if (head_dim > int8_key_channels) {  // see int8_key_channels
    avx512::float_q4().scores_q4(q, nq, k, tokens, head_dim, out, out_stride, pf);
    return;
  }
  scores_q4_by_four(q, nq, k, tokens, head_dim, out, out_stride, pf);
}

void accumulate_q4(const float* p, std::size_t p_stride, std::uint32_t nq, const std::uint8_t* v, std::uint32_t first,
                   std::uint32_t tokens, std::uint32_t head_dim, float* acc, prefetch_region pf) {
  if (tokens == 0) return;
  const std::uint32_t q0 = first / 4, q1 = (first + tokens + 3) / 4;
  line_prefetch rp(pf, value_blocks(head_dim) * (q1 - q0)), none;  // per token quad of a column, in the first queries' pass
  for (std::uint32_t i0 = 0; i0 < nq; i0 += 4) {
    const float* pi = p + i0 * p_stride;
    float* a = acc + static_cast<std::size_t>(i0) * head_dim;
    line_prefetch& f = i0 == 0 ? rp : none;
    switch (nq - i0 < 4 ? nq - i0 : 4) {
      case 1: accumulate_nq<1>(pi, p_stride, v, first, tokens, head_dim, a, f); break;
      case 2: accumulate_nq<2>(pi, p_stride, v, first, tokens, head_dim, a, f); break;
      case 3: accumulate_nq<3>(pi, p_stride, v, first, tokens, head_dim, a, f); break;
      default: accumulate_nq<4>(pi, p_stride, v, first, tokens, head_dim, a, f); break;
    }
  }
}

void attend_q4(const float* q, std::uint32_t nq, const q4_group_ref* groups, std::uint32_t count,
               std::uint32_t head_dim, float* run_max, float* run_sum, float* acc) {
  attend_q4_by_tiles(q, nq, groups, count, head_dim, run_max, run_sum, acc, false);
}

