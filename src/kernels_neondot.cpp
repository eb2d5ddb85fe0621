// Q4 key scores and value sums of decode attention in integer arithmetic for aarch64 CPUs with the
// dot product instructions (FEAT_DotProd, Armv8.2 and later: Neoverse N1 and later, Graviton 2 and
// later, Apple M1 and later): sdot for the keys (codes 0..15 and the int8 query, both signed bytes),
// udot for the values (u8 weights and the codes 0..15; the centring -8 sum_t w_t is one integer per
// query and column, subtracted before the float epilogue, so the sums are those of the x86 int8
// kernels with centred codes). Compiled with -march=armv8.2-a+dotprod: everything stays in this
// file's anonymous namespace (see kernels_internal.hpp) except the entry points, which neon::get()
// installs only where the CPU reports the extension (HWCAP_ASIMDDP).
//
// The arithmetic is that of q4_int8_avx2.inl (see there and q4_int8_avx512.inl): the folded
// query as one int8 value per channel on a grid of max|q s| / 127 with the rounding error's share
// common to all tokens added back; per value column the weights p_t s_t as u8 on a grid of
// max_t p_t * max_t s_t / 255. A key channel quad (64 bytes) is four vectors here: dword j of
// vector r holds the four channels' codes of tokens 4 r + j (low nibbles) and 16 + 4 r + j (high);
// a value token quad of a column likewise holds channels 4 r + j and 16 + 4 r + j of the quad's
// four tokens. Two queries at a time take the codes: 16 accumulators of 32.
//
// The fused step (attend_q4) is q4_attend_step.inl's, as on AVX2: two groups a softmax tile, their value
// weights on one grid and their integer sums in the same accumulators. It is tested against its
// parts under qemu (AttendQ4StepMatchesItsParts) but has not been timed on Arm hardware: on x86
// the same step ran 1.09-1.17x faster than one group a call on cached groups.
#include "kernels_internal.hpp"

#include <arm_neon.h>

#include <cstddef>
#include <cstdint>

namespace kvcache::kernels::neondot {
namespace {

#include "q4_int8.inl"

inline float32x4_t h2f(uint16x4_t h) { return vcvt_f32_f16(vreinterpret_f16_u16(h)); }

// The n (<= 4) halves from p as floats, 0 past n (nothing read there).
inline float32x4_t halves(const std::uint8_t* p, unsigned n) {
  if (n >= 4) return h2f(vld1_u16(reinterpret_cast<const std::uint16_t*>(p)));
  std::uint16_t buf[4] = {0, 0, 0, 0};
  __builtin_memcpy(buf, p, 2 * n);
  return h2f(vld1_u16(buf));
}

inline float32x4_t load_n(const float* p, unsigned n) {
  if (n >= 4) return vld1q_f32(p);
  float buf[4] = {0, 0, 0, 0};
  for (unsigned i = 0; i < n; ++i) buf[i] = p[i];
  return vld1q_f32(buf);
}

inline void store_n(float* p, float32x4_t x, unsigned n) {
  if (n >= 4) {
    vst1q_f32(p, x);
    return;
  }
  float buf[4];
  vst1q_f32(buf, x);
  for (unsigned i = 0; i < n; ++i) p[i] = buf[i];
}

inline int8x16_t dword_s8(const void* p) {
  std::int32_t x;
  __builtin_memcpy(&x, p, sizeof x);
  return vreinterpretq_s8_s32(vdupq_n_s32(x));
}
inline uint8x16_t dword_u8(const void* p) {
  std::uint32_t x;
  __builtin_memcpy(&x, p, sizeof x);
  return vreinterpretq_u8_u32(vdupq_n_u32(x));
}

// ---- keys -------------------------------------------------------------------------------------

// acc[i][r] (tokens 4 r .. 4 r + 3 for r < 4, 16 + 4 (r - 4) .. for r >= 4) += the dot products
// of P (1, 2) queries' int8 values y[i] with the codes of `quads` channel quads from `codes`.
template <unsigned P>
__attribute__((always_inline)) inline void dot_quads(const std::uint8_t* codes, unsigned quads, const std::int8_t (*y)[key_chunk],
                                                     int32x4_t (*acc)[8], line_prefetch& pf) {
  line_prefetch f = pf;
  const uint8x16_t nib = vdupq_n_u8(0x0F);
  int32x4_t h[P][8];
  for (unsigned i = 0; i < P; ++i)
    for (unsigned r = 0; r < 8; ++r) h[i][r] = acc[i][r];
  for (unsigned j = 0; j < quads; ++j) {
    f.rows(1);
    int8x16_t c[8];
    for (unsigned r = 0; r < 4; ++r) {
      const uint8x16_t x = vld1q_u8(codes + 64 * j + 16 * r);
      c[r] = vreinterpretq_s8_u8(vandq_u8(x, nib));
      c[r + 4] = vreinterpretq_s8_u8(vshrq_n_u8(x, 4));
    }
    for (unsigned i = 0; i < P; ++i) {
      const int8x16_t w = dword_s8(y[i] + 4 * j);
      for (unsigned r = 0; r < 8; ++r) h[i][r] = vdotq_s32(h[i][r], c[r], w);
    }
  }
  for (unsigned i = 0; i < P; ++i)
    for (unsigned r = 0; r < 8; ++r) acc[i][r] = h[i][r];
  pf = f;
}

template <unsigned NQ>
void scores_nq(const float* q, const std::uint8_t* k, unsigned tokens, unsigned hd, float* out, std::size_t out_stride,
               line_prefetch& pf) {
  const std::uint8_t* ks = k + key_scales_at(hd);
  const std::uint8_t* km = k + key_mins_at(hd);
  // Pass 1: the largest |q_d s_d| of each query, and sum_d q_d m_d.
  float32x4_t qmax[NQ], mterm[NQ];
  for (unsigned i = 0; i < NQ; ++i) qmax[i] = mterm[i] = vdupq_n_f32(0.0f);
  alignas(16) float scales[cached_channels];
  const bool cached = hd <= cached_channels;
  for (unsigned c = 0; c < hd; c += 4) {
    const unsigned n = hd - c < 4 ? hd - c : 4;
    const float32x4_t s = halves(ks + 2 * c, n), m = halves(km + 2 * c, n);
    if (cached) vst1q_f32(scales + c, s);
    for (unsigned i = 0; i < NQ; ++i) {
      const float32x4_t qv = load_n(q + i * hd + c, n);
      qmax[i] = vmaxq_f32(qmax[i], vabsq_f32(vmulq_f32(qv, s)));
      mterm[i] = vfmaq_f32(mterm[i], qv, m);
    }
  }
  query_split qs[NQ];
  for (unsigned i = 0; i < NQ; ++i) qs[i] = split_of(vmaxvq_f32(qmax[i]), vaddvq_f32(mterm[i]));

  // Pass 2, per chunk of channels: the queries over it as int8 (with the sums of y_d = x_d / scale
  // and of Y_d = round(y_d)), then the integer dot products over its channel quads.
  int32x4_t acc[NQ][8], yisum[NQ];
  float32x4_t ysum[NQ];
  for (unsigned i = 0; i < NQ; ++i) {
    for (unsigned r = 0; r < 8; ++r) acc[i][r] = vdupq_n_s32(0);
    ysum[i] = vdupq_n_f32(0.0f);
    yisum[i] = vdupq_n_s32(0);
  }
  alignas(16) std::int8_t qy[NQ][key_chunk];
  for (unsigned c0 = 0; c0 < hd; c0 += key_chunk) {
    const unsigned nd = hd - c0 < key_chunk ? hd - c0 : key_chunk;
    const unsigned quads = (nd + 3) / 4;
    for (unsigned j = 0; j < 4 * quads; j += 4) {  // channels past nd get Y = 0
      const unsigned n = nd - j < 4 ? nd - j : 4;
      const float32x4_t s = cached ? load_n(scales + c0 + j, n) : halves(ks + 2 * (c0 + j), n);
      for (unsigned i = 0; i < NQ; ++i) {
        const float32x4_t yf = vmulq_f32(vmulq_f32(load_n(q + i * hd + c0 + j, n), s), vdupq_n_f32(qs[i].inv));
        const int32x4_t y = vcvtnq_s32_f32(yf);  // to nearest, ties to even
        ysum[i] = vaddq_f32(ysum[i], yf);
        yisum[i] = vaddq_s32(yisum[i], y);
        const int8x8_t b = vmovn_s16(vcombine_s16(vmovn_s32(y), vdup_n_s16(0)));
        vst1_lane_s32(reinterpret_cast<std::int32_t*>(qy[i] + j), vreinterpret_s32_s8(b), 0);
      }
    }
    const std::uint8_t* codes = k + std::size_t{16} * c0;
    unsigned i = 0;
    line_prefetch none;
    for (; i + 2 <= NQ; i += 2) dot_quads<2>(codes, quads, qy + i, acc + i, i == 0 ? pf : none);
    if (i < NQ) dot_quads<1>(codes, quads, qy + i, acc + i, i == 0 ? pf : none);
  }

  // score = scale (sum_d Y_d c_d + 8 sum_d (y_d - Y_d)) + sum_d q_d m_d.
  for (unsigned i = 0; i < NQ; ++i) {
    const float e = vaddvq_f32(ysum[i]) - static_cast<float>(vaddvq_s32(yisum[i]));
    const float32x4_t base = vdupq_n_f32(qs[i].scale * 8.0f * e + qs[i].mc), scale = vdupq_n_f32(qs[i].scale);
    float* dst = out + i * out_stride;
    for (unsigned r = 0; r < 8; ++r) {
      const unsigned t = r < 4 ? 4 * r : 16 + 4 * (r - 4);
      if (t >= tokens) continue;
      store_n(dst + t, vfmaq_f32(base, vcvtq_f32_s32(acc[i][r]), scale), tokens - t);
    }
  }
}

// ---- values -----------------------------------------------------------------------------------

// The weights of P (1, 2) queries over one block column of G (1, 2) groups: w[i] (u8, token t of
// group j at byte 32 j + t; 0 outside the tokens summed), their integer sum, and the float step
// and base (acc += step * sum + base).
template <unsigned P, unsigned G>
struct column_weights {
  alignas(16) std::uint8_t w[P][32 * G];
  std::int32_t wsum[P];
  float step[P], base[P];
};

// acc[i][0 .. n) (n <= 32 channels of one block column) += step[i] * (the integer sums of the
// codes minus 8 of token quads [q0[j], q1[j]) of the column at codes[j], group j < G, weighted by
// w[i]) + base[i]. The G groups' sums share the accumulators (at most 64 * 255 * 15 each).
template <unsigned P, unsigned G>
__attribute__((always_inline)) inline void column_sums(const std::uint8_t* const* codes, const unsigned* q0,
                                                       const unsigned* q1, const column_weights<P, G>& cw, float* acc,
                                                       std::size_t acc_stride, unsigned n, line_prefetch* pf) {
  const uint8x16_t nib = vdupq_n_u8(0x0F);
  uint32x4_t h[P][8];
  for (unsigned i = 0; i < P; ++i)
    for (unsigned r = 0; r < 8; ++r) h[i][r] = vdupq_n_u32(0);
  for (unsigned gj = 0; gj < G; ++gj) {
    const std::uint8_t* cg = codes[gj];
    for (unsigned j = q0[gj]; j < q1[gj]; ++j) {
      if (pf != nullptr) pf->rows(1);
      uint8x16_t c[8];  // c[r]: channels 4 r .. 4 r + 3 (r < 4), 16 + 4 (r - 4) .. (r >= 4)
      for (unsigned r = 0; r < 4; ++r) {
        const uint8x16_t x = vld1q_u8(cg + 64 * j + 16 * r);
        c[r] = vandq_u8(x, nib);
        c[r + 4] = vshrq_n_u8(x, 4);
      }
      for (unsigned i = 0; i < P; ++i) {
        const uint8x16_t w = dword_u8(cw.w[i] + 32 * gj + 4 * j);
        for (unsigned r = 0; r < 8; ++r) h[i][r] = vdotq_u32(h[i][r], c[r], w);
      }
    }
  }
  for (unsigned i = 0; i < P; ++i) {
    // sum_t w_t (c_t - 8) = sum_t w_t c_t - 8 sum_t w_t, exact in int32 (at most 64 * 255 * 15).
    const int32x4_t centre = vdupq_n_s32(8 * cw.wsum[i]);
    const float32x4_t st = vdupq_n_f32(cw.step[i]), bs = vdupq_n_f32(cw.base[i]);
    float* o = acc + i * acc_stride;
    for (unsigned r = 0; r < 8; ++r) {
      const unsigned at = r < 4 ? 4 * r : 16 + 4 * (r - 4);
      if (at >= n) continue;
      const int32x4_t sum = vsubq_s32(vreinterpretq_s32_u32(h[i][r]), centre);
      const unsigned m = n - at < 4 ? n - at : 4;
      store_n(o + at, vaddq_f32(load_n(o + at, m), vfmaq_f32(bs, vcvtq_f32_s32(sum), st)), m);
    }
  }
}

// Tokens [first[j], end[j]) of value groups v[j], j < G (1, 2), for NQ (1..4) queries whose weights
// by token are u[i] (token t of group j at 32 j + t: p_t / max_t p_t, 0 outside the ranges) and
// max_t p_t pmax[i] (> 0), block column by block column: each column's scales prepared once (the G
// groups' weights on one grid), then its integer sums two queries at a time.
template <unsigned NQ, unsigned G>
void values_nq(const float (*u)[32 * G], const float* pmax, const std::uint8_t* const* v, const unsigned* first,
               const unsigned* end, unsigned hd, float* acc, line_prefetch* pf) {
  const unsigned nb = value_blocks(hd);
  unsigned q0[G], q1[G];
  uint32x4_t range[8 * G];  // lanes of tokens in [first, end)
  for (unsigned j = 0; j < G; ++j) {
    q0[j] = first[j] / 4;
    q1[j] = (end[j] + 3) / 4;
    for (unsigned r = 0; r < 8; ++r) {
      const uint32x4_t t = vaddq_u32(vdupq_n_u32(4 * r), uint32x4_t{0, 1, 2, 3});
      range[8 * j + r] = vandq_u32(vcgeq_u32(t, vdupq_n_u32(first[j])), vcltq_u32(t, vdupq_n_u32(end[j])));
    }
  }
  for (unsigned g = 0; g < nb; ++g) {
    // The column's scales times 255 / max s and m + 8 s of the tokens in range (0 elsewhere,
    // whatever is stored).
    alignas(16) float s[32 * G], m8[32 * G];
    float32x4_t smax = vdupq_n_f32(0.0f);
    for (unsigned r = 0; r < 8 * G; ++r) {
      const std::uint8_t* vj = v[r / 8];
      const std::uint8_t* sp = vj + value_scales_at(hd) + 64 * g + 8 * (r % 8);
      const std::uint8_t* mp = vj + value_mins_at(hd) + 64 * g + 8 * (r % 8);
      const float32x4_t sr = h2f(vld1_u16(reinterpret_cast<const std::uint16_t*>(sp)));
      const float32x4_t mr = h2f(vld1_u16(reinterpret_cast<const std::uint16_t*>(mp)));
      const float32x4_t sv = vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(sr), range[r]));
      vst1q_f32(s + 4 * r, sv);
      vst1q_f32(m8 + 4 * r, vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(vfmaq_n_f32(mr, sv, 8.0f)), range[r])));
      smax = vmaxq_f32(smax, sv);
    }
    const float sm = vmaxvq_f32(smax);
    const float sinv = sm > 0.0f ? 255.0f / sm : 0.0f;
    for (unsigned r = 0; r < 8 * G; ++r) vst1q_f32(s + 4 * r, vmulq_n_f32(vld1q_f32(s + 4 * r), sinv));
    const std::uint8_t* codes[G];
    for (unsigned j = 0; j < G; ++j) codes[j] = v[j] + std::size_t{512} * g;
    const unsigned n = hd - 32 * g < 32 ? hd - 32 * g : 32;
    auto queries = [&]<unsigned P>(unsigned i0) __attribute__((always_inline)) {
      column_weights<P, G> cw;
      for (unsigned i = 0; i < P; ++i) {
        float32x4_t b = vdupq_n_f32(0.0f);
        uint32x4_t ws = vdupq_n_u32(0);
        for (unsigned r = 0; r < 8 * G; r += 2) {
          uint16x4_t w16[2];
          for (unsigned e = 0; e < 2; ++e) {
            const float32x4_t ur = vld1q_f32(u[i0 + i] + 4 * (r + e));
            const int32x4_t w = vcvtnq_s32_f32(vmulq_f32(ur, vld1q_f32(s + 4 * (r + e))));  // <= 255: u <= 1
            w16[e] = vqmovun_s32(w);
            ws = vaddq_u32(ws, vreinterpretq_u32_s32(w));
            b = vfmaq_f32(b, ur, vld1q_f32(m8 + 4 * (r + e)));
          }
          vst1_u8(cw.w[i] + 4 * r, vqmovn_u16(vcombine_u16(w16[0], w16[1])));
        }
        cw.wsum[i] = static_cast<std::int32_t>(vaddvq_u32(ws));
        cw.step[i] = pmax[i0 + i] * sm / 255.0f;
        cw.base[i] = pmax[i0 + i] * vaddvq_f32(b);
      }
      column_sums<P, G>(codes, q0, q1, cw, acc + std::size_t{i0} * hd + 32 * g, hd, n, i0 == 0 ? pf : nullptr);
    };
    unsigned i0 = 0;
    for (; i0 + 2 <= NQ; i0 += 2) queries.template operator()<2>(i0);
    if (i0 < NQ) queries.template operator()<1>(i0);
  }
}

// ---- the value sums and the fused online-softmax step (q4_attend_step.inl) ---------------------

// The vector interface of exp2_simd.inl and q4_attend_step.inl: 4 float lanes.
struct S {
  using vf = float32x4_t;
  using vm = uint32x4_t;
  static constexpr unsigned W = 4;
  static vf set1(float x) { return vdupq_n_f32(x); }
  static vf sub(vf a, vf b) { return vsubq_f32(a, b); }
  static vf mul(vf a, vf b) { return vmulq_f32(a, b); }
  // The number where one operand is NaN, as exp2_nonpositive expects of max (x86 maxps returns the
  // second operand there).
  static vf max(vf a, vf b) { return vmaxnmq_f32(a, b); }
  static vf fmadd(vf a, vf b, vf c) { return vfmaq_f32(c, a, b); }
  static vf round(vf x) { return vrndnq_f32(x); }  // to nearest, ties to even
  // 2^i built in the exponent bits (i in [-125, 0]).
  static vf pow2(vf p, vf i) {
    const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(i), vdupq_n_s32(127)), 23);
    return vmulq_f32(p, vreinterpretq_f32_s32(e));
  }
  static vf zero() { return vdupq_n_f32(0.0f); }
  static vf add(vf a, vf b) { return vaddq_f32(a, b); }
  static float hmax(vf x) { return vmaxvq_f32(x); }
  static float hsum(vf x) { return vaddvq_f32(x); }
  static float first(vf x) { return vgetq_lane_f32(x, 0); }
  static vm live(unsigned m) { return vcltq_u32(uint32x4_t{0, 1, 2, 3}, vdupq_n_u32(m)); }
  static vf select(vm m, vf a, vf b) { return vbslq_f32(m, a, b); }
  static vf keep(vf x, vm m) { return vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(x), m)); }
  static void store(float* p, vf x) { vst1q_f32(p, x); }
  static vf load_count(const float* p, unsigned m) { return load_n(p, m); }
  static void store_count(float* p, vf x, unsigned m) { store_n(p, x, m); }
};
#include "exp2_simd.inl"

inline const table& float_kernels() { return neon::float_q4(); }
#include "q4_attend_step.inl"

}  // namespace

void scores_q4(const float* q, std::uint32_t nq, const std::uint8_t* k, std::uint32_t tokens, std::uint32_t head_dim,
               float* out, std::size_t out_stride, prefetch_region pf) {
  if (head_dim > int8_key_channels) {  // see int8_key_channels
    neon::float_q4().scores_q4(q, nq, k, tokens, head_dim, out, out_stride, pf);
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

}  // namespace kvcache::kernels::neondot
