// Generic SIMD kernels, written once against the small vector interface `V` that each ISA file
// (kernels_avx2.cpp, kernels_avx512.cpp, kernels_neon.cpp) defines just before including this
// file *inside its own anonymous namespace*: every function here therefore has internal linkage
// and is compiled with that file's -m flags only (no ODR sharing between ISA translation units).
// Nothing from the standard library or half.hpp is called here (their inline functions would be
// emitted with the ISA's flags); f16 conversions go through the ISA's instructions.
//
// The interface V provides (W = lanes per float vector):
//   vf, vi (W x int32), b16 (16 bytes); zero, set1, load/load_n/store/store_n for float and half
//   (_n: first n lanes, 0 <= n <= W, zero-filled); add sub mul div fma(a,b,c)=a*b+c min max;
//   hsum; reduce / reduce_min / reduce_max (v[W]) -> lane j = sum / min / max of v[j]; clamp15 (NaN -> 0); cvtt (truncate);
//   or_shl4(lo, hi) = lo | hi << 4; pack16(vi[16/W]) -> 16 bytes; load16 store16 zero16 zip_lo
//   zip_hi (interleave bytes, as punpcklbw/vzip1); decode32(b16, vf[32/W]) -> the 32 codes of a
//   q4 block (low nibbles = elements 0..15, high = 16..31) as floats; scale_up(step, half out[W])
//   -> smallest half >= step per lane (the Q4 scale); recip_or_zero(s) = s > 0 ? 1/s : 0;
//   scale_min(b, stride, n, s, m): scales and minimums of the n (<= W) blocks b[j * stride] as
//   floats (zero beyond n); f32_of(bits) converts one half; tuning constants score_queries, score_acc,
//   acc_queries, acc_regs, q4_queries.

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

// Value groups, W at a time: each group's min and max reduce horizontally (one transposing tree
// for all W groups), then the scale/min parameters of the W groups are computed in one vector.
// Group k of the batch is n[k] (1..32) contiguous halves at x[k].
void quantize_value_batch(const half* const* x, const unsigned* n, unsigned count, q4_block* const* out) {
  constexpr unsigned R = 32 / W;
  half pad[W][32];
  const half* src[W];
  vf mnv[W], mxv[W];
  for (unsigned k = 0; k < W; ++k) {
    if (k >= count) {
      mnv[k] = mxv[k] = V::zero();
      continue;
    }
    src[k] = x[k];
    if (n[k] < 32) {  // pad with the first value: min and max unchanged; codes cleared below
      for (unsigned j = 0; j < 32; ++j) pad[k][j] = j < n[k] ? x[k][j] : x[k][0];
      src[k] = pad[k];
    }
    vf mn = V::load(src[k]), mx = mn;
    for (unsigned r = 1; r < R; ++r) {
      const vf v = V::load(src[k] + r * W);
      mn = V::min(mn, v);
      mx = V::max(mx, v);
    }
    mnv[k] = mn;
    mxv[k] = mx;
  }
  // Lane k: group k. Same arithmetic as the scalar reference (and quantize_keys16).
  half scales[W], mins[W];
  alignas(64) float minf[W], inv[W];
  const vf mnk = V::add(V::reduce_min(mnv), V::zero());  // -0 -> +0
  V::store(mins, mnk);
  V::store(minf, mnk);
  const vf step = V::add(V::div(V::sub(V::reduce_max(mxv), mnk), V::set1(15.0f)), V::zero());
  V::store(inv, V::recip_or_zero(V::scale_up(step, scales)));
  for (unsigned k = 0; k < count; ++k) {
    const vf mf = V::set1(minf[k]), iv = V::set1(inv[k]);
    vi c[R / 2];
    for (unsigned r = 0; r < R / 2; ++r)
      c[r] = V::or_shl4(code_of(V::load(src[k] + r * W), mf, iv), code_of(V::load(src[k] + (r + R / 2) * W), mf, iv));
    q4_block& b = *out[k];
    b.scale = scales[k];
    b.min = mins[k];
    V::store16(b.codes, V::pack16(c));
    for (unsigned j = n[k]; j < 32; ++j) {
      if (j < 16) b.codes[j] = static_cast<std::uint8_t>(b.codes[j] & 0xf0u);
      else b.codes[j - 16] = static_cast<std::uint8_t>(b.codes[j - 16] & 0x0fu);
    }
  }
}

void quantize_values(const half* src, std::size_t src_stride, std::uint32_t tokens,
                     std::uint32_t head_dim, q4_block* dst) {
  const unsigned nb = (head_dim + 31u) / 32u;
  const half* x[W];
  unsigned n[W];
  q4_block* out[W];
  unsigned count = 0;
  for (std::uint32_t t = 0; t < tokens; ++t)
    for (unsigned g = 0; g < nb; ++g) {
      x[count] = src + t * src_stride + g * 32u;
      n[count] = umin(32u, head_dim - g * 32u);
      out[count] = dst + t * nb + g;
      if (++count == W) {
        quantize_value_batch(x, n, count, out);
        count = 0;
      }
    }
  if (count != 0) quantize_value_batch(x, n, count, out);
}

// In-register 16x16 byte transpose: four rounds of "interleave row i with row i + 8" rotate the
// 8-bit (row, column) index left by one bit each, so after four rounds row and column swap.
void transpose16(b16* m) {
  for (int round = 0; round < 4; ++round) {
    b16 t[16];
    for (unsigned i = 0; i < 8; ++i) {
      t[2 * i] = V::zip_lo(m[i], m[i + 8]);
      t[2 * i + 1] = V::zip_hi(m[i], m[i + 8]);
    }
    for (unsigned i = 0; i < 16; ++i) m[i] = t[i];
  }
}

// Key groups of 16 channels: src [tokens][stride], all 16 channels readable; dst q4_block[16].
void quantize_keys16(const half* src, std::size_t stride, unsigned tokens, q4_block* dst) {
  constexpr unsigned C = 16 / W;  // vectors per row of 16 channels
  vf mn[C], mx[C];
  for (unsigned c = 0; c < C; ++c) mn[c] = mx[c] = V::load(src + c * W);
  for (unsigned t = 1; t < tokens; ++t)
    for (unsigned c = 0; c < C; ++c) {
      const vf x = V::load(src + t * stride + c * W);
      mn[c] = V::min(mn[c], x);
      mx[c] = V::max(mx[c], x);
    }
  half scales[16], mins[16];
  vf minf[C], inv[C];
  for (unsigned c = 0; c < C; ++c) {
    minf[c] = V::add(mn[c], V::zero());  // -0 -> +0, as params_of
    V::store(mins + c * W, minf[c]);     // exact: minf is a half value
    const vf step = V::add(V::div(V::sub(mx[c], minf[c]), V::set1(15.0f)), V::zero());
    inv[c] = V::recip_or_zero(V::scale_up(step, scales + c * W));
  }
  // rows[t]: byte d = code(token t, channel d) | code(token t + 16, channel d) << 4.
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
      comb[c] = V::or_shl4(lo, hi);
    }
    rows[t] = V::pack16(comb);
  }
  transpose16(rows);
  for (unsigned d = 0; d < 16; ++d) {
    dst[d].scale = scales[d];
    dst[d].min = mins[d];
    V::store16(dst[d].codes, rows[d]);
  }
}

void quantize_keys(const half* src, std::size_t src_stride, std::uint32_t tokens,
                   std::uint32_t head_dim, q4_block* dst) {
  if (tokens == 0) return;
  unsigned d = 0;
  for (; d + 16 <= head_dim; d += 16) quantize_keys16(src + d, src_stride, tokens, dst + d);
  if (d < head_dim) {  // ragged channel tail through a zero-padded copy
    const unsigned n = head_dim - d;
    half buf[32 * 16];  // [token][16 channels]
    for (unsigned t = 0; t < tokens; ++t)
      for (unsigned c = 0; c < 16; ++c) buf[t * 16 + c] = c < n ? src[t * src_stride + d + c] : half{0};
    q4_block tmp[16];
    quantize_keys16(buf, 16, tokens, tmp);
    for (unsigned c = 0; c < n; ++c) dst[d + c] = tmp[c];
  }
}

// ---- Q4 dequantization (exact: scale * code is exact in float, so fma equals mul + add) ---------

void dequantize_keys(const q4_block* src, std::uint32_t tokens, std::uint32_t head_dim, float* dst,
                     std::size_t dst_stride) {
  constexpr unsigned C = 16 / W;
  for (unsigned d0 = 0; d0 < head_dim; d0 += 16) {
    const unsigned n = umin(16u, head_dim - d0);
    b16 rows[16];
    half scales[16], mins[16];
    for (unsigned d = 0; d < 16; ++d) {
      rows[d] = d < n ? V::load16(src[d0 + d].codes) : V::zero16();
      scales[d] = d < n ? src[d0 + d].scale : half{0};
      mins[d] = d < n ? src[d0 + d].min : half{0};
    }
    transpose16(rows);
    vf s[C], m[C];
    for (unsigned c = 0; c < C; ++c) {
      s[c] = V::load(scales + c * W);
      m[c] = V::load(mins + c * W);
    }
    for (unsigned t = 0; t < 16 && t < tokens; ++t) {
      vf code[2 * C];
      V::decode32(rows[t], code);
      for (unsigned c = 0; c < C; ++c)
        V::store_n(dst + t * dst_stride + d0 + c * W, V::fma(s[c], code[c], m[c]), lanes(n, c));
      if (t + 16 < tokens)
        for (unsigned c = 0; c < C; ++c)
          V::store_n(dst + (t + 16) * dst_stride + d0 + c * W, V::fma(s[c], code[C + c], m[c]), lanes(n, c));
    }
  }
}

void dequantize_values(const q4_block* src, std::uint32_t tokens, std::uint32_t head_dim, float* dst,
                       std::size_t dst_stride) {
  constexpr unsigned R = 32 / W;
  const unsigned nb = (head_dim + 31u) / 32u;
  for (std::uint32_t t = 0; t < tokens; ++t)
    for (unsigned g = 0; g < nb; ++g) {
      const q4_block& b = src[t * nb + g];
      const unsigned n = umin(32u, head_dim - g * 32u);
      const vf s = V::set1(V::f32_of(b.scale.bits)), m = V::set1(V::f32_of(b.min.bits));
      vf code[R];
      V::decode32(V::load16(b.codes), code);
      float* out = dst + t * dst_stride + g * 32u;
      for (unsigned r = 0; r < R; ++r) {
        const unsigned k = lanes(n, r);
        if (k == W) V::store(out + r * W, V::fma(s, code[r], m));
        else V::store_n(out + r * W, V::fma(s, code[r], m), k);
      }
    }
}

// ---- dense scores: out[i][t] = q_i . k_t ----------------------------------------------------------

// Horizontal sums of J accumulators into r[J], W at a time through V::reduce.
template <unsigned J>
[[gnu::always_inline]] inline
void sums_of(const vf* acc, float* r) {
  if constexpr (J <= 2) {
    for (unsigned j = 0; j < J; ++j) r[j] = V::hsum(acc[j]);
  } else {
    for (unsigned j0 = 0; j0 < J; j0 += W) {
      vf part[W];
      for (unsigned j = 0; j < W; ++j) part[j] = j0 + j < J ? acc[j0 + j] : V::zero();
      float buf[W];
      V::store(buf, V::reduce(part));
      for (unsigned j = 0; j < W && j0 + j < J; ++j) r[j0 + j] = buf[j];
    }
  }
}

// NQ queries x T tokens, all accumulators in registers; K rows are read once for all queries.
template <unsigned NQ, unsigned T, class K>
void scores_tile(const float* q, const K* k, unsigned hd, float* out, std::size_t out_stride) {
  vf acc[NQ * T];
#pragma GCC unroll 32
  for (unsigned j = 0; j < NQ * T; ++j) acc[j] = V::zero();
  unsigned d = 0;
  for (; d + W <= hd; d += W) {
#pragma GCC unroll 16
    for (unsigned t = 0; t < T; ++t) {
      const vf kv = V::load(k + t * hd + d);
#pragma GCC unroll 8
      for (unsigned i = 0; i < NQ; ++i) acc[i * T + t] = V::fma(V::load(q + i * hd + d), kv, acc[i * T + t]);
    }
  }
  if (d < hd) {
    const unsigned n = hd - d;
#pragma GCC unroll 16
    for (unsigned t = 0; t < T; ++t) {
      const vf kv = V::load_n(k + t * hd + d, n);
#pragma GCC unroll 8
      for (unsigned i = 0; i < NQ; ++i) acc[i * T + t] = V::fma(V::load_n(q + i * hd + d, n), kv, acc[i * T + t]);
    }
  }
  float r[NQ * T];
  sums_of<NQ * T>(acc, r);
  for (unsigned i = 0; i < NQ; ++i)
    for (unsigned t = 0; t < T; ++t) out[i * out_stride + t] = r[i * T + t];
}

// pf (null after the first pass of queries) advances with the rows.
template <unsigned NQ, class K>
void scores_nq(const float* q, const K* k, unsigned tokens, unsigned hd, float* out, std::size_t out_stride,
               row_prefetch* pf) {
  constexpr unsigned T = umax(1u, V::score_acc / NQ);
  unsigned t = 0;
  for (; t + T <= tokens; t += T) {
    if (pf != nullptr) pf->rows(T);
    scores_tile<NQ, T>(q, k + t * hd, hd, out + t, out_stride);
  }
  for (; t < tokens; ++t) {
    if (pf != nullptr) pf->rows(1);
    scores_tile<NQ, 1>(q, k + t * hd, hd, out + t, out_stride);
  }
}

template <class K>
void scores_dense(const float* q, std::uint32_t nq, const K* k, std::uint32_t tokens,
                  std::uint32_t head_dim, float* out, std::size_t out_stride, prefetch_region region) {
  row_prefetch pf(region, tokens);
  // Token tiles small enough to stay in L1 while the query passes loop over them.
  const unsigned tile = umax(8u, 16384u / umax(1u, head_dim * unsigned(sizeof(K))));
  for (unsigned t0 = 0; t0 < tokens; t0 += tile) {
    const unsigned nt = umin(tile, tokens - t0);
    // Queries in balanced passes of at most V::score_queries (6 = 3 + 3 rather than 4 + 2).
    for (unsigned i0 = 0; i0 < nq;) {
      const unsigned rest = nq - i0, passes = (rest + V::score_queries - 1) / V::score_queries;
      const unsigned n = (rest + passes - 1) / passes;
      const float* qi = q + std::size_t(i0) * head_dim;
      const K* kt = k + std::size_t(t0) * head_dim;
      float* o = out + i0 * out_stride + t0;
      row_prefetch* p = i0 == 0 ? &pf : nullptr;
      i0 += n;
      switch (n) {
        case 1: scores_nq<1>(qi, kt, nt, head_dim, o, out_stride, p); break;
        case 2: scores_nq<2>(qi, kt, nt, head_dim, o, out_stride, p); break;
        case 3: scores_nq<3>(qi, kt, nt, head_dim, o, out_stride, p); break;
        case 4: scores_nq<4>(qi, kt, nt, head_dim, o, out_stride, p); break;
        case 5: scores_nq<5>(qi, kt, nt, head_dim, o, out_stride, p); break;
        case 6: scores_nq<6>(qi, kt, nt, head_dim, o, out_stride, p); break;
        case 7: scores_nq<7>(qi, kt, nt, head_dim, o, out_stride, p); break;
        default: scores_nq<8>(qi, kt, nt, head_dim, o, out_stride, p); break;
      }
    }
  }
}

void scores_f16(const float* q, std::uint32_t nq, const half* k, std::uint32_t tokens,
                std::uint32_t head_dim, float* out, std::size_t out_stride, prefetch_region pf) {
  scores_dense(q, nq, k, tokens, head_dim, out, out_stride, pf);
}

void scores_f32(const float* q, std::uint32_t nq, const float* k, std::uint32_t tokens,
                std::uint32_t head_dim, float* out, std::size_t out_stride, prefetch_region pf) {
  scores_dense(q, nq, k, tokens, head_dim, out, out_stride, pf);
}

// ---- dense accumulate: acc[i][d] += sum_t p[i][t] v[t][d] -----------------------------------------

// NQ queries x ND vectors of channels [d0, d0 + ND W) in registers over `tokens` rows; the last
// vector holds `last` lanes (< W only when Partial).
template <unsigned NQ, unsigned ND, bool Partial, class Vt>
void acc_tile(const float* p, std::size_t p_stride, const Vt* v, unsigned tokens, unsigned hd,
              unsigned d0, unsigned last, float* acc, row_prefetch* pf) {
  vf a[NQ * ND];
#pragma GCC unroll 8
  for (unsigned i = 0; i < NQ; ++i)
#pragma GCC unroll 8
    for (unsigned c = 0; c < ND; ++c) {
      const float* src = acc + i * hd + d0 + c * W;
      a[i * ND + c] = (Partial && c == ND - 1) ? V::load_n(src, last) : V::load(src);
    }
  for (unsigned t = 0; t < tokens; ++t) {
    if (pf != nullptr) pf->rows(1);
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
                  unsigned d0, unsigned last, float* acc, row_prefetch* pf) {
  if (last == W) acc_tile<NQ, ND, false>(p, p_stride, v, tokens, hd, d0, last, acc, pf);
  else acc_tile<NQ, ND, true>(p, p_stride, v, tokens, hd, d0, last, acc, pf);
}

// pf (null after the first pass of queries) advances with the rows of the first channel group.
template <unsigned NQ, class Vt>
void acc_nq(const float* p, std::size_t p_stride, const Vt* v, unsigned tokens, unsigned hd, float* acc,
            row_prefetch* pf) {
  constexpr unsigned ND = umax(1u, umin(4u, V::acc_regs / NQ));
  for (unsigned d0 = 0; d0 < hd; d0 += ND * W) {
    const unsigned rest = hd - d0;
    const unsigned nv = umin(ND, (rest + W - 1) / W);  // vectors in this channel group
    const unsigned last = rest - (nv - 1) * W < W ? rest - (nv - 1) * W : W;
    row_prefetch* f = d0 == 0 ? pf : nullptr;
    switch (nv) {
      case 1: acc_tile_any<NQ, 1>(p, p_stride, v, tokens, hd, d0, last, acc, f); break;
      case 2: acc_tile_any<NQ, umin(2u, ND)>(p, p_stride, v, tokens, hd, d0, last, acc, f); break;
      case 3: acc_tile_any<NQ, umin(3u, ND)>(p, p_stride, v, tokens, hd, d0, last, acc, f); break;
      default: acc_tile_any<NQ, ND>(p, p_stride, v, tokens, hd, d0, last, acc, f); break;
    }
  }
}

template <class Vt>
void accumulate_dense(const float* p, std::size_t p_stride, std::uint32_t nq, const Vt* v,
                      std::uint32_t tokens, std::uint32_t head_dim, float* acc, prefetch_region region) {
  row_prefetch pf(region, tokens);
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
      row_prefetch* f = i0 == 0 ? &pf : nullptr;
      i0 += n;
      switch (n) {
        case 1: acc_nq<1>(pi, p_stride, vt, nt, head_dim, a, f); break;
        case 2: acc_nq<2>(pi, p_stride, vt, nt, head_dim, a, f); break;
        case 3: acc_nq<3>(pi, p_stride, vt, nt, head_dim, a, f); break;
        case 4: acc_nq<4>(pi, p_stride, vt, nt, head_dim, a, f); break;
        case 5: acc_nq<5>(pi, p_stride, vt, nt, head_dim, a, f); break;
        case 6: acc_nq<6>(pi, p_stride, vt, nt, head_dim, a, f); break;
        case 7: acc_nq<7>(pi, p_stride, vt, nt, head_dim, a, f); break;
        default: acc_nq<8>(pi, p_stride, vt, nt, head_dim, a, f); break;
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

// ---- Q4 scores: lanes = the 32 tokens of the key group; scales folded into the query ------------

template <unsigned NQ>
void scores_q4_nq(const float* q, const q4_block* k, unsigned tokens, unsigned hd, float* out,
                  std::size_t out_stride, row_prefetch* pf) {
  constexpr unsigned R = 32 / W;
  constexpr unsigned DC = 64;  // channels folded per pass
  vf acc[NQ * R], mc[NQ];
#pragma GCC unroll 16
  for (unsigned j = 0; j < NQ * R; ++j) acc[j] = V::zero();
  for (unsigned i = 0; i < NQ; ++i) mc[i] = V::zero();
  alignas(64) float qs[NQ][DC];  // folded query q_d * scale_d
  for (unsigned d0 = 0; d0 < hd; d0 += DC) {
    const unsigned nd = umin(DC, hd - d0);
    for (unsigned j = 0; j < nd; j += W) {
      const unsigned n = umin(W, nd - j);
      vf s, m;
      V::scale_min(k + d0 + j, 1, n, s, m);
      for (unsigned i = 0; i < NQ; ++i) {
        const vf qv = V::load_n(q + i * hd + d0 + j, n);
        V::store(qs[i] + j, V::mul(qv, s));
        mc[i] = V::fma(qv, m, mc[i]);
      }
    }
    for (unsigned j = 0; j < nd; ++j) {
      if (pf != nullptr) pf->rows(1);
      vf code[R];
      V::decode32(V::load16(k[d0 + j].codes), code);
#pragma GCC unroll 8
      for (unsigned i = 0; i < NQ; ++i) {
        const vf b = V::set1(qs[i][j]);
#pragma GCC unroll 8
        for (unsigned r = 0; r < R; ++r) acc[i * R + r] = V::fma(b, code[r], acc[i * R + r]);
      }
    }
  }
  for (unsigned i = 0; i < NQ; ++i) {
    const vf m = V::set1(V::hsum(mc[i]));
    for (unsigned r = 0; r < R; ++r) {
      const unsigned n = lanes(tokens, r);
      if (n == W) V::store(out + i * out_stride + r * W, V::add(acc[i * R + r], m));
      else if (n != 0) V::store_n(out + i * out_stride + r * W, V::add(acc[i * R + r], m), n);
    }
  }
}

void scores_q4(const float* q, std::uint32_t nq, const q4_block* k, std::uint32_t tokens,
               std::uint32_t head_dim, float* out, std::size_t out_stride, prefetch_region region) {
  if (tokens == 0) return;
  constexpr unsigned QM = V::q4_queries;
  row_prefetch rp(region, head_dim);  // a channel's codes per row, spread over the first queries' pass
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

// ---- Q4 accumulate: lanes = the 32 channels of a value block; p * scale precomputed per token
// tile, p * min summed per (query, block) and added once --------------------------------------------

// The same where V reads the headers of consecutive blocks (AVX-512) and the blocks per token, nb,
// is a power of two <= 8: the set-up of a tile (weights p * scale, sums of p * min) runs over all
// its blocks at once, lanes = blocks t * nb + g of W / nb tokens, rather than block by block with
// strided header loads and a horizontal sum per query and block. The set-up was 40% of the Q4
// value time at head_dim 128 (2.8 of 6.9 ns per token); the FMA loop is unchanged.
template <unsigned NQ, class VV = V>
void acc_q4_consecutive(const float* p, std::size_t p_stride, const q4_block* v, unsigned tokens, unsigned hd,
                        unsigned nb, float* acc, row_prefetch* pf) {
  constexpr unsigned R = 32 / W;
  const unsigned shift = nb == 1 ? 0u : nb == 2 ? 1u : nb == 4 ? 2u : 3u;
  const unsigned per = W >> shift;  // tokens per vector of blocks
  alignas(64) float ws[NQ][32 * 8];  // p * scale per block of the tile, [t * nb + g]
  alignas(64) float pm[NQ][W];       // sum over the tile of p * min, [g]
  for (unsigned t0 = 0; t0 < tokens; t0 += 32) {
    const unsigned nt = umin(32u, tokens - t0);
    const q4_block* tile = v + std::size_t(t0) * nb;
    vf pmv[NQ];
    for (unsigned i = 0; i < NQ; ++i) pmv[i] = V::zero();
    for (unsigned k0 = 0; k0 < nt * nb; k0 += W) {
      const unsigned tk = k0 >> shift;  // first token of these blocks
      vf s, m;
      VV::consecutive_scale_min(tile + k0, umin(W, nt * nb - k0), s, m);
#pragma GCC unroll 8
      for (unsigned i = 0; i < NQ; ++i) {
        const vf pv = VV::spread(V::load_n(p + i * p_stride + t0 + tk, umin(per, nt - tk)), shift);
        V::store(ws[i] + k0, V::mul(pv, s));
        pmv[i] = V::fma(pv, m, pmv[i]);
      }
    }
    for (unsigned i = 0; i < NQ; ++i) V::store(pm[i], VV::fold(pmv[i], nb));
    for (unsigned g = 0; g < nb; ++g) {
      const unsigned ch = umin(32u, hd - g * 32u);
      vf a[NQ * R];
#pragma GCC unroll 8
      for (unsigned i = 0; i < NQ; ++i)
#pragma GCC unroll 8
        for (unsigned r = 0; r < R; ++r) a[i * R + r] = V::load_n(acc + i * hd + g * 32u + r * W, lanes(ch, r));
      for (unsigned j = 0; j < nt; ++j) {
        if (pf != nullptr) pf->rows(1);
        vf code[R];
        V::decode32(V::load16(tile[j * nb + g].codes), code);
#pragma GCC unroll 8
        for (unsigned i = 0; i < NQ; ++i) {
          const vf b = V::set1(ws[i][j * nb + g]);
#pragma GCC unroll 8
          for (unsigned r = 0; r < R; ++r) a[i * R + r] = V::fma(b, code[r], a[i * R + r]);
        }
      }
      for (unsigned i = 0; i < NQ; ++i) {
        const vf m = V::set1(pm[i][g]);
        for (unsigned r = 0; r < R; ++r)
          V::store_n(acc + i * hd + g * 32u + r * W, V::add(a[i * R + r], m), lanes(ch, r));
      }
    }
  }
}

template <unsigned NQ>
void acc_q4_nq(const float* p, std::size_t p_stride, const q4_block* v, unsigned tokens, unsigned hd,
               float* acc, row_prefetch* pf) {
  constexpr unsigned R = 32 / W;
  const unsigned nb = (hd + 31u) / 32u;
  if constexpr (V::consecutive_headers) {
    if (nb <= 8 && (nb & (nb - 1)) == 0) {
      acc_q4_consecutive<NQ>(p, p_stride, v, tokens, hd, nb, acc, pf);
      return;
    }
  }
  alignas(64) float ws[NQ][32];  // p * scale per token of the tile
  for (unsigned t0 = 0; t0 < tokens; t0 += 32) {
    const unsigned nt = umin(32u, tokens - t0);
    for (unsigned g = 0; g < nb; ++g) {
      vf pm[NQ];
      for (unsigned i = 0; i < NQ; ++i) pm[i] = V::zero();
      for (unsigned j = 0; j < nt; j += W) {
        const unsigned n = umin(W, nt - j);
        vf s, m;
        V::scale_min(v + std::size_t(t0 + j) * nb + g, nb, n, s, m);
        for (unsigned i = 0; i < NQ; ++i) {
          const vf pv = V::load_n(p + i * p_stride + t0 + j, n);
          V::store(ws[i] + j, V::mul(pv, s));
          pm[i] = V::fma(pv, m, pm[i]);
        }
      }
      const unsigned ch = umin(32u, hd - g * 32u);
      vf a[NQ * R];
#pragma GCC unroll 8
      for (unsigned i = 0; i < NQ; ++i)
#pragma GCC unroll 8
        for (unsigned r = 0; r < R; ++r) a[i * R + r] = V::load_n(acc + i * hd + g * 32u + r * W, lanes(ch, r));
      for (unsigned j = 0; j < nt; ++j) {
        if (pf != nullptr) pf->rows(1);
        vf code[R];
        V::decode32(V::load16(v[(t0 + j) * nb + g].codes), code);
#pragma GCC unroll 8
        for (unsigned i = 0; i < NQ; ++i) {
          const vf b = V::set1(ws[i][j]);
#pragma GCC unroll 8
          for (unsigned r = 0; r < R; ++r) a[i * R + r] = V::fma(b, code[r], a[i * R + r]);
        }
      }
      for (unsigned i = 0; i < NQ; ++i) {
        const vf m = V::set1(V::hsum(pm[i]));
        for (unsigned r = 0; r < R; ++r)
          V::store_n(acc + i * hd + g * 32u + r * W, V::add(a[i * R + r], m), lanes(ch, r));
      }
    }
  }
}

void accumulate_q4(const float* p, std::size_t p_stride, std::uint32_t nq, const q4_block* v,
                   std::uint32_t tokens, std::uint32_t head_dim, float* acc, prefetch_region region) {
  if (tokens == 0) return;
  constexpr unsigned QM = V::q4_queries;
  row_prefetch rp(region, tokens * ((head_dim + 31) / 32));  // a block per row
  for (unsigned i0 = 0; i0 < nq; i0 += QM) {
    const float* pi = p + i0 * p_stride;
    float* a = acc + std::size_t(i0) * head_dim;
    const unsigned n = umin(QM, nq - i0);
    row_prefetch* pf = i0 == 0 ? &rp : nullptr;
    if constexpr (QM >= 8) {
      switch (n) {
        case 1: acc_q4_nq<1>(pi, p_stride, v, tokens, head_dim, a, pf); break;
        case 2: acc_q4_nq<2>(pi, p_stride, v, tokens, head_dim, a, pf); break;
        case 3: acc_q4_nq<3>(pi, p_stride, v, tokens, head_dim, a, pf); break;
        case 4: acc_q4_nq<4>(pi, p_stride, v, tokens, head_dim, a, pf); break;
        case 5: acc_q4_nq<5>(pi, p_stride, v, tokens, head_dim, a, pf); break;
        case 6: acc_q4_nq<6>(pi, p_stride, v, tokens, head_dim, a, pf); break;
        case 7: acc_q4_nq<7>(pi, p_stride, v, tokens, head_dim, a, pf); break;
        default: acc_q4_nq<8>(pi, p_stride, v, tokens, head_dim, a, pf); break;
      }
    } else {
      if (n == 1) acc_q4_nq<1>(pi, p_stride, v, tokens, head_dim, a, pf);
      else acc_q4_nq<2>(pi, p_stride, v, tokens, head_dim, a, pf);
    }
  }
}

// The table of this ISA.
constexpr table simd_table{V::which,       f32_to_f16,      f16_to_f32,        scalar::quantize_keys,
                           scalar::dequantize_keys, scalar::quantize_values, scalar::dequantize_values, scores_f16,
                           scores_f32,      scalar::scores_q4,       accumulate_f16,    accumulate_f32,
                           scalar::accumulate_q4};  // INTERIM: scalar Q4
