// Generic SIMD kernels, written once against the small vector interface `V` that each ISA file
// (kernels_avx2.cpp, kernels_avx512.cpp, kernels_neon.cpp) defines just before including this
// file *inside its own anonymous namespace*: every function here therefore has internal linkage
// and is compiled with that file's -m flags only (no ODR sharing between ISA translation units).
// Nothing from the standard library or half.hpp is called here (their inline functions would be
// emitted with the ISA's flags); f16 conversions go through the ISA's instructions.
//
// The interface V provides (W = lanes per float vector, 4, 8 or 16):
//   vf, vi (W x int32), b16 (16 bytes); zero, zero_i, set1, load/load_n/store/store_n for float and
//   half (_n: first n lanes, 0 <= n <= W, zero-filled); add sub mul div fma(a,b,c)=a*b+c min max;
//   hsum; reduce / reduce_min / reduce_max (v[W]) -> lane j = sum / min / max of v[j]; clamp15
//   (NaN -> 0); cvtt (truncate); on 32-bit lanes or_shl<S>(lo, hi) = lo | hi << S, and_i,
//   load_i / store_i (W lanes at a byte address) and nibble<S>(x) -> floats of bits S..S+3 of each
//   lane; pack16(vi[16/W]) -> 16 bytes; load16 store16 zero16; zip32_lo/hi, zip64_lo/hi
//   (interleave 32- or 64-bit elements, as punpckldq/vzip1); decode32(b16, vf[32/W]) -> the codes of
//   16 bytes as floats (low nibbles = elements 0..15, high = 16..31); load_range(half*, lo, hi) ->
//   lanes [lo, hi) loaded, the others 0 (all W readable); scale_up(step, half out[W]) -> smallest
//   half >= step per lane (the Q4 scale); recip_or_zero(s) = s > 0 ? 1/s : 0; f32_of(bits)
//   converts one half; tuning constants score_queries, score_acc (for scores_dense.inl),
//   acc_queries, acc_regs, q4_queries (queries per Q4 kernel pass) and q4_acc (registers for Q4
//   accumulators); optionally
//   store4(p, x, g): lanes 4 g .. 4 g + 3 to p[0..3].

using vf = V::vf;
using vi = V::vi;
using b16 = V::b16;
constexpr unsigned W = V::W;

constexpr unsigned umin(unsigned a, unsigned b) { return a < b ? a : b; }
constexpr unsigned umax(unsigned a, unsigned b) { return a > b ? a : b; }
// Lanes of vector r (W lanes each) that lie below n.
constexpr unsigned lanes(unsigned n, unsigned r) { return n <= r * W ? 0u : umin(W, n - r * W); }

#include "row_prefetch.inl"

// ---- FP16 conversions --------------------------------------------------------------------------

void f32_to_f16(const float* src, half* dst, std::size_t n) {
  std::size_t i = 0;
  for (; i + 4 * W <= n; i += 4 * W) {
    const vf a = V::load(src + i), b = V::load(src + i + W);
    const vf c = V::load(src + i + 2 * W), d = V::load(src + i + 3 * W);
    V::store(dst + i, a);
    V::store(dst + i + W, b);
    V::store(dst + i + 2 * W, c);
    V::store(dst + i + 3 * W, d);
  }
  for (; i + W <= n; i += W) V::store(dst + i, V::load(src + i));
  if (i < n) {
    const auto r = static_cast<unsigned>(n - i);
    V::store_n(dst + i, V::load_n(src + i, r), r);
  }
}

void f16_to_f32(const half* src, float* dst, std::size_t n) {
  std::size_t i = 0;
  for (; i + 4 * W <= n; i += 4 * W) {
    const vf a = V::load(src + i), b = V::load(src + i + W);
    const vf c = V::load(src + i + 2 * W), d = V::load(src + i + 3 * W);
    V::store(dst + i, a);
    V::store(dst + i + W, b);
    V::store(dst + i + 2 * W, c);
    V::store(dst + i + 3 * W, d);
  }
  for (; i + W <= n; i += W) V::store(dst + i, V::load(src + i));
  if (i < n) {
    const auto r = static_cast<unsigned>(n - i);
    V::store_n(dst + i, V::load_n(src + i, r), r);
  }
}

// ---- Q4 quantization (bit-exact with the scalar reference: same min, same scale rounding, same
// multiply by the reciprocal, same clamp and +0.5 truncation) -------------------------------------

// Code vector of W values: trunc(clamp((x - minf) * inv, 0, 15) + 0.5).
vi code_of(vf x, vf minf, vf inv) {
  return V::cvtt(V::add(V::clamp15(V::mul(V::sub(x, minf), inv)), V::set1(0.5f)));
}

// 4x4 transpose of the 32-bit elements of r[0..4).
void transpose4(b16* r) {
  const b16 a0 = V::zip32_lo(r[0], r[1]), a1 = V::zip32_hi(r[0], r[1]);
  const b16 a2 = V::zip32_lo(r[2], r[3]), a3 = V::zip32_hi(r[2], r[3]);
  r[0] = V::zip64_lo(a0, a2);
  r[1] = V::zip64_hi(a0, a2);
  r[2] = V::zip64_lo(a1, a3);
  r[3] = V::zip64_hi(a1, a3);
}

// Value tokens [0, W) of one block column: token k (k < count, the rest zero) is the n (1..32)
// channels at src + k * stride. Each token's min and max reduce horizontally (one transposing
// tree for all W tokens), the scale and min parameters of the W tokens are computed in one vector
// and stored as W halves (the column's scales and minimums are contiguous over tokens), and the
// codes of every 4 tokens go to one 64-byte token quad at codes + 64 (k / 4): 32-bit lane j of
// the quad holds byte j (channel j | channel j + 16 << 4) of its tokens r at bits 8 r. keep:
// those lanes' bits of channels below n.
// Full: count == W and n == 32, compiled without the per-token tests.
template <bool Full>
void quantize_value_tokens(const half* src, std::size_t stride, unsigned count, unsigned n, const vi* keep,
                           std::uint8_t* codes, half* scales, half* mins) {
  constexpr unsigned R = 32 / W, H = 16 / W;
  if constexpr (Full) {
    count = W;
    n = 32;
  }
  half pad[W][32];
  const half* x[W];
  vf mnv[W], mxv[W];
  for (unsigned k = 0; k < W; ++k) {
    if (k >= count) {  // min 0, scale 0 and codes 0, as the format asks of missing tokens
      mnv[k] = mxv[k] = V::zero();
      continue;
    }
    x[k] = src + k * stride;
    if (n < 32) {  // pad with the first value: min and max unchanged; codes cleared below
      for (unsigned j = 0; j < 32; ++j) pad[k][j] = j < n ? x[k][j] : x[k][0];
      x[k] = pad[k];
    }
    vf mn = V::load(x[k]), mx = mn;
    for (unsigned r = 1; r < R; ++r) {
      const vf v = V::load(x[k] + r * W);
      mn = V::min(mn, v);
      mx = V::max(mx, v);
    }
    mnv[k] = mn;
    mxv[k] = mx;
  }
  // Lane k: token k. Same arithmetic as the scalar reference (and quantize_keys16).
  alignas(64) float minf[W], inv[W];
  const vf mnk = V::add(V::reduce_min(mnv), V::zero());  // -0 -> +0
  V::store(mins, mnk);
  V::store(minf, mnk);
  const vf step = V::add(V::div(V::sub(V::reduce_max(mxv), mnk), V::set1(15.0f)), V::zero());
  V::store(inv, V::recip_or_zero(V::scale_up(step, scales)));
  // byte[k][h]: lanes j = h W.. of token k's bytes.
  auto byte = [&](unsigned k, unsigned h) {
    if (k >= count) return V::zero_i();
    const vf mf = V::set1(minf[k]), iv = V::set1(inv[k]);
    return V::template or_shl<4>(code_of(V::load(x[k] + h * W), mf, iv), code_of(V::load(x[k] + 16 + h * W), mf, iv));
  };
  for (unsigned u = 0; u < W / 4; ++u)
    for (unsigned h = 0; h < H; ++h) {
      const unsigned k = 4 * u;
      vi q = V::template or_shl<8>(byte(k + 2, h), byte(k + 3, h));
      q = V::template or_shl<8>(byte(k + 1, h), q);
      q = V::template or_shl<8>(byte(k, h), q);
      if (n < 32) q = V::and_i(q, keep[h]);  // padding channels (j >= n): code 0
      V::store_i(codes + 64 * u + 4 * W * h, q);
    }
}

// Token-outer: W tokens' rows are read (every 32-channel group of them) before the next W tokens'.
void quantize_values(const half* src, std::size_t src_stride, std::uint32_t tokens,
                     std::uint32_t head_dim, std::uint8_t* dst) {
  constexpr unsigned H = 16 / W;
  const unsigned nb = (head_dim + 31u) / 32u;
  auto* scales = reinterpret_cast<half*>(dst + q4_value_scales_offset(head_dim));
  auto* mins = reinterpret_cast<half*>(dst + q4_value_mins_offset(head_dim));
  // The last group's channel mask (all its lanes, unless head_dim is not a multiple of 32).
  const unsigned n_last = head_dim - (nb - 1u) * 32u;
  alignas(64) std::uint32_t bits[16];  // per byte j: the nibbles of channels j, j + 16 below n_last
  for (unsigned j = 0; j < 16; ++j) bits[j] = ((j < n_last ? 0x0fu : 0u) | (j + 16 < n_last ? 0xf0u : 0u)) * 0x01010101u;
  vi keep[H];
  for (unsigned h = 0; h < H; ++h) keep[h] = V::load_i(reinterpret_cast<const std::uint8_t*>(bits + h * W));
  for (unsigned t0 = 0; t0 < 32; t0 += W) {
    for (unsigned g = 0; g < nb; ++g) {
      const unsigned n = umin(32u, head_dim - g * 32u);
      std::uint8_t* codes = dst + 512u * g + 16u * t0;  // token quad t0 / 4
      if (t0 >= tokens) {  // no token here: codes, scales and minimums 0
        __builtin_memset(codes, 0, 16u * W);
        __builtin_memset(scales + 32u * g + t0, 0, 2u * W);
        __builtin_memset(mins + 32u * g + t0, 0, 2u * W);
        continue;
      }
      const unsigned count = umin(W, tokens - t0);
      const auto q = count == W && n == 32 ? quantize_value_tokens<true> : quantize_value_tokens<false>;
      q(src + t0 * src_stride + g * 32u, src_stride, count, n, keep, codes, scales + 32u * g + t0, mins + 32u * g + t0);
    }
  }
}

// Vectors of channels whose minimum and maximum one sweep over a key group's rows tracks: two
// accumulators each: 8 vectors take 16 of the 32 registers of AVX-512 and NEON; AVX2 has 16, so 4.
constexpr unsigned key_range_vecs = W == 8 ? 4 : 8;

// Minimum and maximum over tokens [0, tokens) of the N vectors of channels at src (rows of stride
// halves): one front-to-back sweep of the rows, every accumulator its own dependency chain.
template <unsigned N>
void key_ranges(const half* src, std::size_t stride, unsigned tokens, vf* mn, vf* mx) {
  for (unsigned c = 0; c < N; ++c) mn[c] = mx[c] = V::load(src + c * W);
  for (unsigned t = 1; t < tokens; ++t)
    for (unsigned c = 0; c < N; ++c) {
      const vf x = V::load(src + t * stride + c * W);
      mn[c] = V::min(mn[c], x);
      mx[c] = V::max(mx[c], x);
    }
}

// Key channels [0, 16) of a group whose ranges are known: src [tokens][stride]; their 4 channel
// quads at codes (256 bytes), 16 scales and 16 minimums. Full: tokens == 32 (every migration),
// compiled without the per-token tests.
template <bool Full>
void quantize_keys16(const half* src, std::size_t stride, unsigned tokens, const vf* mn, const vf* mx,
                     std::uint8_t* codes, half* scales, half* mins) {
  if constexpr (Full) tokens = 32;
  constexpr unsigned C = 16 / W;  // vectors per row of 16 channels
  vf minf[C], inv[C];
  for (unsigned c = 0; c < C; ++c) {
    minf[c] = V::add(mn[c], V::zero());  // -0 -> +0, as the scalar fit
    V::store(mins + c * W, minf[c]);     // exact: minf is a half value
    const vf step = V::add(V::div(V::sub(mx[c], minf[c]), V::set1(15.0f)), V::zero());
    inv[c] = V::recip_or_zero(V::scale_up(step, scales + c * W));
  }
  // rows[j]: byte c = code(token j, channel c) | code(token j + 16, channel c) << 4.
  b16 rows[16];
  for (unsigned t = 0; t < 16; ++t) {
    if (t >= tokens) {
      rows[t] = V::zero16();
      continue;
    }
    vi comb[C];
    for (unsigned c = 0; c < C; ++c) {
      const vi lo = code_of(V::load(src + t * stride + c * W), minf[c], inv[c]);
      const vi hi = t + 16 < tokens ? code_of(V::load(src + (t + 16) * stride + c * W), minf[c], inv[c])
                                    : V::zero_i();
      comb[c] = V::template or_shl<4>(lo, hi);
    }
    rows[t] = V::pack16(comb);
  }
  // Quad q holds [j][c % 4]: its bytes 16 m..16 m + 15 are dword q of rows 4 m..4 m + 3.
  for (unsigned m = 0; m < 4; ++m) {
    transpose4(rows + 4 * m);
    for (unsigned q = 0; q < 4; ++q) V::store16(codes + 64 * q + 16 * m, rows[4 * m + q]);
  }
}

// The rows are read twice: once front to back for the channel ranges (key_range_vecs at a time,
// so a 128-channel head is one sweep on AVX-512), then per 16 channels for the codes, from L1.
// Before, one sweep per 16 channels took the ranges (32 bytes of each row at the row stride, one
// dependency chain per accumulator): on Cascade Lake 39 % of the time sat on that loop's load.
// (measurements: bench/PERFORMANCE.md, "Source notes: kernels_simd.inl", quantize_keys)
void quantize_keys(const half* src, std::size_t src_stride, std::uint32_t tokens,
                   std::uint32_t head_dim, std::uint8_t* dst) {
  if (tokens == 0) return;
  constexpr unsigned C = 16 / W, R = key_range_vecs;
  const unsigned ch = (head_dim + 3u) / 4u * 4u;  // q4_key_channels
  auto* scales = reinterpret_cast<half*>(dst + q4_key_scales_offset(head_dim));
  auto* mins = reinterpret_cast<half*>(dst + q4_key_mins_offset(head_dim));
  vf mn[R], mx[R];
  unsigned d = 0;
  const auto keys16 = tokens == 32 ? quantize_keys16<true> : quantize_keys16<false>;
  for (; d + R * W <= head_dim; d += R * W) {
    key_ranges<R>(src + d, src_stride, tokens, mn, mx);
    for (unsigned c = 0; c < R; c += C)
      keys16(src + d + c * W, src_stride, tokens, mn + c, mx + c, dst + 16 * (d + c * W), scales + d + c * W,
             mins + d + c * W);
  }
  for (; d + 16 <= head_dim; d += 16) {
    key_ranges<C>(src + d, src_stride, tokens, mn, mx);
    keys16(src + d, src_stride, tokens, mn, mx, dst + 16 * d, scales + d, mins + d);
  }
  if (d < head_dim) {  // ragged channel tail through a zero-padded copy (its padding: codes, scales, mins 0)
    const unsigned n = head_dim - d;
    half buf[32 * 16];  // [token][16 channels]
    for (unsigned t = 0; t < tokens; ++t)
      for (unsigned c = 0; c < 16; ++c) buf[t * 16 + c] = c < n ? src[t * src_stride + d + c] : half{0};
    alignas(16) std::uint8_t codes[256];
    half s[16], m[16];
    key_ranges<C>(buf, 16, tokens, mn, mx);
    quantize_keys16<false>(buf, 16, tokens, mn, mx, codes, s, m);
    __builtin_memcpy(dst + 16 * d, codes, 16 * (ch - d));  // the quads up to the padded width
    __builtin_memcpy(scales + d, s, 2 * (ch - d));
    __builtin_memcpy(mins + d, m, 2 * (ch - d));
  }
}

// ---- Q4 dequantization (exact: scale * code is exact in float, so fma equals mul + add) ---------

void dequantize_keys(const std::uint8_t* src, std::uint32_t tokens, std::uint32_t head_dim, float* dst,
                     std::size_t dst_stride) {
  constexpr unsigned C = 16 / W;
  const auto* scales = reinterpret_cast<const half*>(src + q4_key_scales_offset(head_dim));
  const auto* mins = reinterpret_cast<const half*>(src + q4_key_mins_offset(head_dim));
  const unsigned low = umin(16u, tokens);  // tokens in the low nibbles
  for (unsigned d0 = 0; d0 < head_dim; d0 += 16) {
    const unsigned n = umin(16u, head_dim - d0), quads = (n + 3) / 4;
    vf s[C], m[C];
    for (unsigned c = 0; c < C; ++c) {
      s[c] = V::load_n(scales + d0 + c * W, lanes(n, c));
      m[c] = V::load_n(mins + d0 + c * W, lanes(n, c));
    }
    for (unsigned j0 = 0; j0 < low; j0 += 4) {
      // Bytes 16 (j0 / 4).. of the (up to) 4 quads, transposed: rows[j] = tokens j0 + j and
      // j0 + j + 16 over the 16 channels.
      b16 rows[4];
      for (unsigned q = 0; q < 4; ++q) rows[q] = q < quads ? V::load16(src + 16 * d0 + 64 * q + 4 * j0) : V::zero16();
      transpose4(rows);
      for (unsigned j = 0; j < 4 && j0 + j < low; ++j) {
        const unsigned t = j0 + j;
        vf code[2 * C];
        V::decode32(rows[j], code);
        for (unsigned c = 0; c < C; ++c)
          V::store_n(dst + t * dst_stride + d0 + c * W, V::fma(s[c], code[c], m[c]), lanes(n, c));
        if (t + 16 < tokens)
          for (unsigned c = 0; c < C; ++c)
            V::store_n(dst + (t + 16) * dst_stride + d0 + c * W, V::fma(s[c], code[C + c], m[c]), lanes(n, c));
      }
    }
  }
}

// Row r (token t = 4 u + r) of the value quad whose 32-bit lanes are raw[0..16 / W), lanes =
// channels (see q4_row below): its n (1..32) floats min + scale * code to out + (t - first) *
// stride, where t lies in [first, end).
template <unsigned r>
[[gnu::always_inline]] inline void dequantize_row(const vi* raw, const half* s, const half* m, unsigned n,
                                                  unsigned u, unsigned first, unsigned end, float* out,
                                                  std::size_t stride) {
  constexpr unsigned H = 16 / W;
  const unsigned t = 4 * u + r;
  if (t < first || t >= end) return;  // another call's token, or none
  out += (t - first) * stride;
  const vf sv = V::set1(V::f32_of(s[t].bits)), mv = V::set1(V::f32_of(m[t].bits));
#pragma GCC unroll 4
  for (unsigned h = 0; h < 2 * H; ++h) {
    const vf code = h < H ? V::template nibble<8 * r>(raw[h]) : V::template nibble<8 * r + 4>(raw[h - H]);
    const unsigned k = lanes(n, h);
    if (k == W) V::store(out + h * W, V::fma(sv, code, mv));
    else if (k != 0) V::store_n(out + h * W, V::fma(sv, code, mv), k);
  }
}

void dequantize_values(const std::uint8_t* src, std::uint32_t first, std::uint32_t tokens, std::uint32_t head_dim,
                       float* dst, std::size_t dst_stride) {
  constexpr unsigned H = 16 / W;
  const unsigned nb = (head_dim + 31u) / 32u, end = first + tokens;
  const auto* scales = reinterpret_cast<const half*>(src + q4_value_scales_offset(head_dim));
  const auto* mins = reinterpret_cast<const half*>(src + q4_value_mins_offset(head_dim));
  for (unsigned g = 0; g < nb; ++g) {
    const unsigned n = umin(32u, head_dim - g * 32u);
    float* out = dst + g * 32u;
    for (unsigned u = first / 4; u * 4 < end; ++u) {  // token quads
      vi raw[H];
      for (unsigned h = 0; h < H; ++h) raw[h] = V::load_i(src + 512 * g + 64 * u + 4 * W * h);
      const half *s = scales + 32 * g, *m = mins + 32 * g;
      dequantize_row<0>(raw, s, m, n, u, first, end, out, dst_stride);
      dequantize_row<1>(raw, s, m, n, u, first, end, out, dst_stride);
      dequantize_row<2>(raw, s, m, n, u, first, end, out, dst_stride);
      dequantize_row<3>(raw, s, m, n, u, first, end, out, dst_stride);
    }
  }
}

// scores_f16 and scores_f32.
#include "scores_dense.inl"

// ---- dense accumulate: acc[i][d] += sum_t p[i][t] v[t][d] -----------------------------------------

// NQ queries x ND vectors of channels [d0, d0 + ND W) in registers over `tokens` rows; the last
// vector holds `last` lanes (< W only when Partial).
template <unsigned NQ, unsigned ND, bool Partial, class Vt>
void acc_tile(const float* p, std::size_t p_stride, const Vt* v, unsigned tokens, unsigned hd,
              unsigned d0, unsigned last, float* acc, row_prefetch& pf) {
  vf a[NQ * ND];
#pragma GCC unroll 8
  for (unsigned i = 0; i < NQ; ++i)
#pragma GCC unroll 8
    for (unsigned c = 0; c < ND; ++c) {
      const float* src = acc + i * hd + d0 + c * W;
      a[i * ND + c] = (Partial && c == ND - 1) ? V::load_n(src, last) : V::load(src);
    }
  for (unsigned t = 0; t < tokens; ++t) {
    pf.rows_held(1);
    vf w[NQ];
#pragma GCC unroll 8
    for (unsigned i = 0; i < NQ; ++i) w[i] = V::set1(p[i * p_stride + t]);
#pragma GCC unroll 8
    for (unsigned c = 0; c < ND; ++c) {
      const Vt* row = v + std::size_t(t) * hd + d0 + c * W;
      const vf x = (Partial && c == ND - 1) ? V::load_n(row, last) : V::load(row);
#pragma GCC unroll 8
      for (unsigned i = 0; i < NQ; ++i) a[i * ND + c] = V::fma(w[i], x, a[i * ND + c]);
    }
  }
#pragma GCC unroll 8
  for (unsigned i = 0; i < NQ; ++i)
#pragma GCC unroll 8
    for (unsigned c = 0; c < ND; ++c) {
      float* dst = acc + i * hd + d0 + c * W;
      if (Partial && c == ND - 1) V::store_n(dst, a[i * ND + c], last);
      else V::store(dst, a[i * ND + c]);
    }
}

template <unsigned NQ, unsigned ND, class Vt>
void acc_tile_any(const float* p, std::size_t p_stride, const Vt* v, unsigned tokens, unsigned hd,
                  unsigned d0, unsigned last, float* acc, row_prefetch& pf) {
  if (last == W) acc_tile<NQ, ND, false>(p, p_stride, v, tokens, hd, d0, last, acc, pf);
  else acc_tile<NQ, ND, true>(p, p_stride, v, tokens, hd, d0, last, acc, pf);
}

// Vectors of channels per accumulate tile for nq queries, and the channel groups of head_dim.
constexpr unsigned acc_vectors(unsigned nq) { return umax(1u, umin(4u, V::acc_regs / nq)); }
constexpr unsigned acc_groups(unsigned nq, unsigned hd) { return (hd + acc_vectors(nq) * W - 1) / (acc_vectors(nq) * W); }

// pf advances with the rows of every channel group.
template <unsigned NQ, class Vt>
void acc_nq(const float* p, std::size_t p_stride, const Vt* v, unsigned tokens, unsigned hd, float* acc,
            row_prefetch& pf) {
  constexpr unsigned ND = acc_vectors(NQ);
  for (unsigned d0 = 0; d0 < hd; d0 += ND * W) {
    const unsigned rest = hd - d0;
    const unsigned nv = umin(ND, (rest + W - 1) / W);  // vectors in this channel group
    const unsigned last = rest - (nv - 1) * W < W ? rest - (nv - 1) * W : W;
    switch (nv) {
      case 1: acc_tile_any<NQ, 1>(p, p_stride, v, tokens, hd, d0, last, acc, pf); break;
      case 2: acc_tile_any<NQ, umin(2u, ND)>(p, p_stride, v, tokens, hd, d0, last, acc, pf); break;
      case 3: acc_tile_any<NQ, umin(3u, ND)>(p, p_stride, v, tokens, hd, d0, last, acc, pf); break;
      default: acc_tile_any<NQ, ND>(p, p_stride, v, tokens, hd, d0, last, acc, pf); break;
    }
  }
}

template <class Vt>
void accumulate_dense(const float* p, std::size_t p_stride, std::uint32_t nq, const Vt* v,
                      std::uint32_t tokens, std::uint32_t head_dim, float* acc, prefetch_region region) {
  // The region is spread over all the work, every row of every pass over queries and channels
  // (measured against a burst during the first pass: see all_blocks in attend_avx512.cpp).
  unsigned steps = 0;
  for (unsigned i0 = 0; i0 < nq;) {
    const unsigned rest = nq - i0, passes = (rest + V::acc_queries - 1) / V::acc_queries;
    const unsigned n = (rest + passes - 1) / passes;
    steps += acc_groups(n, head_dim);
    i0 += n;
  }
  row_prefetch pf(region, tokens * steps);
  const unsigned tile = umax(8u, 16384u / umax(1u, head_dim * unsigned(sizeof(Vt))));
  for (unsigned t0 = 0; t0 < tokens; t0 += tile) {
    const unsigned nt = umin(tile, tokens - t0);
    const Vt* vt = v + std::size_t(t0) * head_dim;
    // Queries in balanced passes of at most V::acc_queries.
    for (unsigned i0 = 0; i0 < nq;) {
      const unsigned rest = nq - i0, passes = (rest + V::acc_queries - 1) / V::acc_queries;
      const unsigned n = (rest + passes - 1) / passes;
      const float* pi = p + i0 * p_stride + t0;
      float* a = acc + std::size_t(i0) * head_dim;
      i0 += n;
      switch (n) {
        case 1: acc_nq<1>(pi, p_stride, vt, nt, head_dim, a, pf); break;
        case 2: acc_nq<2>(pi, p_stride, vt, nt, head_dim, a, pf); break;
        case 3: acc_nq<3>(pi, p_stride, vt, nt, head_dim, a, pf); break;
        case 4: acc_nq<4>(pi, p_stride, vt, nt, head_dim, a, pf); break;
        case 5: acc_nq<5>(pi, p_stride, vt, nt, head_dim, a, pf); break;
        case 6: acc_nq<6>(pi, p_stride, vt, nt, head_dim, a, pf); break;
        case 7: acc_nq<7>(pi, p_stride, vt, nt, head_dim, a, pf); break;
        default: acc_nq<8>(pi, p_stride, vt, nt, head_dim, a, pf); break;
      }
    }
  }
}

void accumulate_f16(const float* p, std::size_t p_stride, std::uint32_t nq, const half* v,
                    std::uint32_t tokens, std::uint32_t head_dim, float* acc, prefetch_region pf) {
  accumulate_dense(p, p_stride, nq, v, tokens, head_dim, acc, pf);
}

void accumulate_f32(const float* p, std::size_t p_stride, std::uint32_t nq, const float* v,
                    std::uint32_t tokens, std::uint32_t head_dim, float* acc, prefetch_region pf) {
  accumulate_dense(p, p_stride, nq, v, tokens, head_dim, acc, pf);
}

// ---- Q4 scores and accumulate: float FMAs with lanes = the 32 elements j of a code quad ---------
//
// A key quad (4 channels) holds [token byte j][channel c % 4], a value quad (4 tokens of a block
// column) [channel byte j][token t % 4]: both [j][r], element j in the low nibble and j + 16 in
// the high one. Read as 32-bit lanes, lane j of the quad is byte j's 4 rows r, so shifting by
// 8 r (+ 4 for the high nibble) and keeping 4 bits gives row r's codes with lanes = j: tokens of
// key channel 4 u + r, or channels of value token 4 u + r. Each row then meets one broadcast
// multiplier per query (folded query q_d * scale_d, or weight p_t * scale_t) in R = 32 / W FMAs,
// straight into accumulators of the 32 results (token scores, or channel sums): no transposition
// and no horizontal sums. Rows alternate over SETS sets of accumulators so that few queries still
// have enough independent FMA chains.

// Accumulator sets for NQ queries: as many (1, 2 or 4) as V::q4_acc accumulators hold.
template <unsigned NQ>
constexpr unsigned q4_sets = NQ * 4 * (32 / W) <= V::q4_acc ? 4 : NQ * 2 * (32 / W) <= V::q4_acc ? 2 : 1;

// Row r of the quad whose 32-bit lanes are raw[0..16 / W): a[set r % SETS][i][c] +=
// mul[i * MS + r] * code(row r, element c W + lane).
template <unsigned NQ, unsigned MS, unsigned SETS, unsigned r>
[[gnu::always_inline]] inline void q4_row(const vi* raw, const float* mul, vf* a) {
  constexpr unsigned H = 16 / W, R = 32 / W;
  vf code[R];
#pragma GCC unroll 4
  for (unsigned h = 0; h < H; ++h) {
    code[h] = V::template nibble<8 * r>(raw[h]);
    code[H + h] = V::template nibble<8 * r + 4>(raw[h]);
  }
#pragma GCC unroll 8
  for (unsigned i = 0; i < NQ; ++i) {
    const vf b = V::set1(mul[i * MS + r]);
#pragma GCC unroll 8
    for (unsigned c = 0; c < R; ++c) a[((r % SETS) * NQ + i) * R + c] = V::fma(b, code[c], a[((r % SETS) * NQ + i) * R + c]);
  }
}

// acc[i * R + c] (+)= the sum over `quads` quads u (64 bytes each, from codes) and their rows r
// of mul[i * MS + 4 u + r] * code(u, r, element c W + lane): "=" where fresh. pf, if any,
// advances a row per quad.
template <unsigned NQ, unsigned MS>
void q4_quads(const std::uint8_t* codes, unsigned quads, const float* mul, bool fresh, vf* acc, row_prefetch* pf) {
  constexpr unsigned H = 16 / W, R = 32 / W, SETS = q4_sets<NQ>;
  vf a[SETS * NQ * R];
#pragma GCC unroll 32
  for (unsigned j = 0; j < NQ * R; ++j) a[j] = fresh ? V::zero() : acc[j];
#pragma GCC unroll 32
  for (unsigned j = NQ * R; j < SETS * NQ * R; ++j) a[j] = V::zero();
  for (unsigned u = 0; u < quads; ++u) {
    if (pf != nullptr) pf->rows(1);
    vi raw[H];
#pragma GCC unroll 4
    for (unsigned h = 0; h < H; ++h) raw[h] = V::load_i(codes + 64 * u + 4 * W * h);
    const float* m = mul + 4 * u;
    q4_row<NQ, MS, SETS, 0>(raw, m, a);
    q4_row<NQ, MS, SETS, 1>(raw, m, a);
    q4_row<NQ, MS, SETS, 2>(raw, m, a);
    q4_row<NQ, MS, SETS, 3>(raw, m, a);
  }
#pragma GCC unroll 32
  for (unsigned j = 0; j < NQ * R; ++j) {
    vf x = a[j];
#pragma GCC unroll 4
    for (unsigned s = 1; s < SETS; ++s) x = V::add(x, a[s * NQ * R + j]);
    acc[j] = x;
  }
}

// Scores of NQ queries against the key group k: channels in chunks of DC folded (q_d * scale_d)
// into qs, then their quads; the minimums' share sum_d q_d min_d is common to the tokens and
// added at the end.
template <unsigned NQ>
void scores_q4_nq(const float* q, const std::uint8_t* k, unsigned tokens, unsigned hd, float* out,
                  std::size_t out_stride, row_prefetch* pf) {
  constexpr unsigned R = 32 / W;
  constexpr unsigned DC = 256;  // channels folded per chunk (a multiple of W and of 4)
  const unsigned ch = (hd + 3u) / 4u * 4u;  // q4_key_channels
  const auto* scales = reinterpret_cast<const half*>(k + q4_key_scales_offset(hd));
  const auto* mins = reinterpret_cast<const half*>(k + q4_key_mins_offset(hd));
  vf acc[NQ * R], mc[NQ];
#pragma GCC unroll 8
  for (unsigned i = 0; i < NQ; ++i) mc[i] = V::zero();
  alignas(64) float qs[NQ][DC];
  for (unsigned d0 = 0; d0 < ch; d0 += DC) {
    const unsigned nd = umin(DC, ch - d0);
    for (unsigned j = 0; j < nd; j += W) {
      const unsigned n = hd > d0 + j ? umin(W, hd - d0 - j) : 0u;  // 0 past head_dim (padding channels)
      const vf s = n == W ? V::load(scales + d0 + j) : V::load_n(scales + d0 + j, n);
      const vf m = n == W ? V::load(mins + d0 + j) : V::load_n(mins + d0 + j, n);
#pragma GCC unroll 8
      for (unsigned i = 0; i < NQ; ++i) {
        const float* qi = q + i * hd + d0 + j;
        const vf qv = n == W ? V::load(qi) : V::load_n(qi, n);
        V::store(qs[i] + j, V::mul(qv, s));
        mc[i] = V::fma(qv, m, mc[i]);
      }
    }
    q4_quads<NQ, DC>(k + 16 * d0, nd / 4, qs[0], d0 == 0, acc, pf);
  }
#pragma GCC unroll 8
  for (unsigned i = 0; i < NQ; ++i) {
    const vf m = V::set1(V::hsum(mc[i]));
    for (unsigned c = 0; c < R; ++c) {
      const unsigned n = lanes(tokens, c);
      if (n == 0) break;
      const vf x = V::add(acc[i * R + c], m);
      if (n == W) V::store(out + i * out_stride + c * W, x);
      else V::store_n(out + i * out_stride + c * W, x, n);
    }
  }
}

void scores_q4(const float* q, std::uint32_t nq, const std::uint8_t* k, std::uint32_t tokens,
               std::uint32_t head_dim, float* out, std::size_t out_stride, prefetch_region region) {
  if (tokens == 0) return;
  constexpr unsigned QM = V::q4_queries;
  row_prefetch rp(region, (head_dim + 3) / 4);  // a channel quad per row, over the first queries' pass
  for (unsigned i0 = 0; i0 < nq; i0 += QM) {
    const float* qi = q + std::size_t(i0) * head_dim;
    float* o = out + i0 * out_stride;
    const unsigned n = umin(QM, nq - i0);
    row_prefetch* pf = i0 == 0 ? &rp : nullptr;
    if constexpr (QM >= 8) {
      switch (n) {
        case 1: scores_q4_nq<1>(qi, k, tokens, head_dim, o, out_stride, pf); break;
        case 2: scores_q4_nq<2>(qi, k, tokens, head_dim, o, out_stride, pf); break;
        case 3: scores_q4_nq<3>(qi, k, tokens, head_dim, o, out_stride, pf); break;
        case 4: scores_q4_nq<4>(qi, k, tokens, head_dim, o, out_stride, pf); break;
        case 5: scores_q4_nq<5>(qi, k, tokens, head_dim, o, out_stride, pf); break;
        case 6: scores_q4_nq<6>(qi, k, tokens, head_dim, o, out_stride, pf); break;
        case 7: scores_q4_nq<7>(qi, k, tokens, head_dim, o, out_stride, pf); break;
        default: scores_q4_nq<8>(qi, k, tokens, head_dim, o, out_stride, pf); break;
      }
    } else {
      if (n == 1) scores_q4_nq<1>(qi, k, tokens, head_dim, o, out_stride, pf);
      else scores_q4_nq<2>(qi, k, tokens, head_dim, o, out_stride, pf);
    }
  }
}

// Tokens [first, first + tokens) of the value group v for NQ queries, block column by column:
// weights p_t * scale_t per token (0 for the other tokens of the quads read: their scales and
// minimums are never loaded, their codes meet a zero weight), the token quads, then acc += the
// channel sums plus sum_t p_t min_t.
template <unsigned NQ>
void acc_q4_nq(const float* p, std::size_t p_stride, const std::uint8_t* v, unsigned first, unsigned tokens,
               unsigned hd, float* acc, row_prefetch* pf) {
  constexpr unsigned R = 32 / W;
  const unsigned nb = (hd + 31u) / 32u, end = first + tokens;
  const auto* scales = reinterpret_cast<const half*>(v + q4_value_scales_offset(hd));
  const auto* mins = reinterpret_cast<const half*>(v + q4_value_mins_offset(hd));
  const unsigned u0 = first / 4, quads = (end + 3) / 4 - u0;  // the token quads read
  const unsigned t0 = first / W * W;                          // the first vector of tokens
  // Weights by token, p * scale: pw[i][t] = p[i][t - first] for t in [first, end), 0 for the
  // other tokens of the vectors [t0, end) of tokens read.
  alignas(64) float pw[NQ][32 + W], ws[NQ][32];
  for (unsigned i = 0; i < NQ; ++i) {
    V::store(pw[i] + t0, V::zero());
    V::store(pw[i] + end, V::zero());
    for (unsigned r = 0; r < tokens; r += W) {
      const unsigned n = umin(W, tokens - r);
      V::store_n(pw[i] + first + r, V::load_n(p + i * p_stride + r, n), n);
    }
  }
  for (unsigned g = 0; g < nb; ++g) {
    vf pm[NQ];
#pragma GCC unroll 8
    for (unsigned i = 0; i < NQ; ++i) pm[i] = V::zero();
    for (unsigned t = t0; t < end; t += W) {
      const unsigned lo = first > t ? first - t : 0u, hi = umin(W, end - t);
      const vf s = V::load_range(scales + 32 * g + t, lo, hi), m = V::load_range(mins + 32 * g + t, lo, hi);
#pragma GCC unroll 8
      for (unsigned i = 0; i < NQ; ++i) {
        const vf w = V::load(pw[i] + t);
        V::store(ws[i] + t, V::mul(w, s));
        pm[i] = V::fma(w, m, pm[i]);
      }
    }
    vf sums[NQ * R];
    q4_quads<NQ, 32>(v + 512 * g + 64 * u0, quads, ws[0] + 4 * u0, true, sums, pf);
    const unsigned n = umin(32u, hd - g * 32u);  // channels of this column
#pragma GCC unroll 8
    for (unsigned i = 0; i < NQ; ++i) {
      const vf m = V::set1(V::hsum(pm[i]));
      float* a = acc + i * hd + g * 32u;
      for (unsigned c = 0; c < R; ++c) {
        const unsigned k = lanes(n, c);
        if (k == 0) break;
        const vf x = V::add(sums[i * R + c], m);
        if (k == W) V::store(a + c * W, V::add(V::load(a + c * W), x));
        else V::store_n(a + c * W, V::add(V::load_n(a + c * W, k), x), k);
      }
    }
  }
}

void accumulate_q4(const float* p, std::size_t p_stride, std::uint32_t nq, const std::uint8_t* v, std::uint32_t first,
                   std::uint32_t tokens, std::uint32_t head_dim, float* acc, prefetch_region region) {
  if (tokens == 0) return;
  constexpr unsigned QM = V::q4_queries;
  row_prefetch rp(region, ((first + tokens + 3) / 4 - first / 4) * ((head_dim + 31) / 32));  // a token quad per row
  for (unsigned i0 = 0; i0 < nq; i0 += QM) {
    const float* pi = p + i0 * p_stride;
    float* a = acc + std::size_t(i0) * head_dim;
    const unsigned n = umin(QM, nq - i0);
    row_prefetch* pf = i0 == 0 ? &rp : nullptr;
    if constexpr (QM >= 8) {
      switch (n) {
        case 1: acc_q4_nq<1>(pi, p_stride, v, first, tokens, head_dim, a, pf); break;
        case 2: acc_q4_nq<2>(pi, p_stride, v, first, tokens, head_dim, a, pf); break;
        case 3: acc_q4_nq<3>(pi, p_stride, v, first, tokens, head_dim, a, pf); break;
        case 4: acc_q4_nq<4>(pi, p_stride, v, first, tokens, head_dim, a, pf); break;
        case 5: acc_q4_nq<5>(pi, p_stride, v, first, tokens, head_dim, a, pf); break;
        case 6: acc_q4_nq<6>(pi, p_stride, v, first, tokens, head_dim, a, pf); break;
        case 7: acc_q4_nq<7>(pi, p_stride, v, first, tokens, head_dim, a, pf); break;
        default: acc_q4_nq<8>(pi, p_stride, v, first, tokens, head_dim, a, pf); break;
      }
    } else {
      if (n == 1) acc_q4_nq<1>(pi, p_stride, v, first, tokens, head_dim, a, pf);
      else acc_q4_nq<2>(pi, p_stride, v, first, tokens, head_dim, a, pf);
    }
  }
}

// The table of this ISA.
constexpr table simd_table = [] {
  table x{V::which,       f32_to_f16,      f16_to_f32,        quantize_keys,
          dequantize_keys, quantize_values, dequantize_values, scores_f16,
          scores_f32,      scores_q4,       accumulate_f16,    accumulate_f32,
          accumulate_q4};
  x.scores_f16_heads = scores_f16_heads;
  x.scores_f32_heads = scores_f32_heads;
  x.scores_f16_segments = scores_f16_segments;
  x.scores_f32_segments = scores_f32_segments;
  return x;
}();
