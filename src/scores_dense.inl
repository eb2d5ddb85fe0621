// Dense decode-attention scores (out[i][t] = q_i . k_t over f16 or f32 keys), written against the
// vector interface `V` of kernels_simd.inl (it uses W, zero, load, load_n, fma, hsum, reduce and the
// tuning constants score_queries, score_acc; with V::store4 the sums of four tokens go out as one
// 4-lane store per query). kernels_simd.inl includes it for every ISA; kernels_avx512.cpp includes it
// a second time with 256-bit vectors (see there). Included inside the includer's anonymous
// namespace after `V`, `vf`, `W`, umin/umax and row_prefetch.

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

// X, as a type that depends on a template parameter: V::store4 is then looked up only where used.
template <class X, class>
struct dependent {
  using type = X;
};

// NQ queries x T tokens, all accumulators in registers; K rows are read once for all queries.
// HD: hd known at compile time (0: not; see scores_dense_heads). Inlined into scores_nq where
// Inl (scores_dense_heads), else called through scores_tile.
template <unsigned NQ, unsigned T, unsigned HD, class K>
[[gnu::always_inline]] inline
void scores_tile_body(const float* q, const K* k, unsigned hd, float* out, std::size_t out_stride) {
  using VK = typename dependent<V, K>::type;
  if constexpr (HD != 0) hd = HD;
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
  if constexpr (T == 4 && (NQ * T) % W == 0 && W % 4 == 0 && requires(float* p, vf x) { VK::store4(p, x, 0u); }) {
    // Lanes 4 g + t of the sums of acc[j0 ..] are token t of query (j0 / 4 + g): one store each.
#pragma GCC unroll 8
    for (unsigned j0 = 0; j0 < NQ * T; j0 += W) {
      const vf r = V::reduce(acc + j0);
#pragma GCC unroll 4
      for (unsigned g = 0; g < W / 4; ++g) VK::store4(out + (j0 / 4 + g) * out_stride, r, g);
    }
  } else {
    float r[NQ * T];
    sums_of<NQ * T>(acc, r);
    for (unsigned i = 0; i < NQ; ++i)
      for (unsigned t = 0; t < T; ++t) out[i * out_stride + t] = r[i * T + t];
  }
}

template <unsigned NQ, unsigned T, unsigned HD, class K>
void scores_tile(const float* q, const K* k, unsigned hd, float* out, std::size_t out_stride) {
  scores_tile_body<NQ, T, HD>(q, k, hd, out, out_stride);
}

// pf advances with the rows (rows_held where Held).
template <unsigned NQ, unsigned HD, bool Held, bool Inl, class K>
void scores_nq(const float* q, const K* k, unsigned tokens, unsigned hd, float* out, std::size_t out_stride,
               row_prefetch& pf) {
  if constexpr (HD != 0) hd = HD;
  constexpr unsigned T = umax(1u, V::score_acc / NQ);
  unsigned t = 0;
  for (; t + T <= tokens; t += T) {
    if constexpr (Held) pf.rows_held(T);
    else pf.rows(T);
    if constexpr (Inl) scores_tile_body<NQ, T, HD>(q, k + t * hd, hd, out + t, out_stride);
    else scores_tile<NQ, T, HD>(q, k + t * hd, hd, out + t, out_stride);
  }
  for (; t < tokens; ++t) {
    if constexpr (Held) pf.rows_held(1);
    else pf.rows(1);
    scores_tile<NQ, 1, HD>(q, k + t * hd, hd, out + t, out_stride);
  }
}

// Token tiles of one head small enough to stay in L1 while the query passes loop over them.
template <class K>
unsigned score_token_tile(std::uint32_t head_dim) {
  return umax(8u, 16384u / umax(1u, head_dim * unsigned(sizeof(K))));
}

// Row passes over the keys for nq queries (at most V::score_queries each).
inline unsigned score_passes(std::uint32_t nq) { return (nq + V::score_queries - 1) / V::score_queries; }

// The scores of one head, in tiles of `tile` tokens; pf advances with the rows.
template <unsigned HD, bool Held, bool Inl, class K>
void scores_head(const float* q, std::uint32_t nq, const K* k, std::uint32_t tokens, std::uint32_t head_dim,
                 float* out, std::size_t out_stride, unsigned tile, row_prefetch& pf) {
  for (unsigned t0 = 0; t0 < tokens; t0 += tile) {
    const unsigned nt = umin(tile, tokens - t0);
    // Queries in balanced passes of at most V::score_queries (6 = 3 + 3 rather than 4 + 2).
    for (unsigned i0 = 0; i0 < nq;) {
      const unsigned rest = nq - i0, passes = score_passes(rest);
      const unsigned n = passes == 1 ? rest : (rest + passes - 1) / passes;
      const float* qi = q + std::size_t(i0) * head_dim;
      const K* kt = k + std::size_t(t0) * head_dim;
      float* o = out + i0 * out_stride + t0;
      i0 += n;
      switch (n) {
        case 1: scores_nq<1, HD, Held, Inl>(qi, kt, nt, head_dim, o, out_stride, pf); break;
        case 2: scores_nq<2, HD, Held, Inl>(qi, kt, nt, head_dim, o, out_stride, pf); break;
        case 3: scores_nq<3, HD, Held, Inl>(qi, kt, nt, head_dim, o, out_stride, pf); break;
        case 4: scores_nq<4, HD, Held, Inl>(qi, kt, nt, head_dim, o, out_stride, pf); break;
        case 5: scores_nq<5, HD, Held, Inl>(qi, kt, nt, head_dim, o, out_stride, pf); break;
        case 6: scores_nq<6, HD, Held, Inl>(qi, kt, nt, head_dim, o, out_stride, pf); break;
        case 7: scores_nq<7, HD, Held, Inl>(qi, kt, nt, head_dim, o, out_stride, pf); break;
        default: scores_nq<8, HD, Held, Inl>(qi, kt, nt, head_dim, o, out_stride, pf); break;
      }
    }
  }
}

// The scores of heads [0, heads), pf spread over all of them (rows_held where Held).
template <bool Held, bool Inl, class K>
void scores_of_heads(const float* q, std::size_t q_head_stride, std::uint32_t nq, const K* k, std::size_t k_head_stride,
                     std::uint32_t heads, std::uint32_t tokens, std::uint32_t head_dim, float* out,
                     std::size_t out_head_stride, std::size_t out_stride, row_prefetch& pf) {
  const unsigned tile = score_token_tile<K>(head_dim);
  // head_dim 128 (most models') has its own code: the channel loops of fixed length, no tail. On
  // Zen 5 attend ran 1.03-1.04x at 4k; at 32k it streams at the read bandwidth (paged 1.02x,
  // contiguous within noise). The 512-bit file's text grew from 201 to 272 KB.
  // (measurements: bench/PERFORMANCE.md, "Source notes: scores_dense.inl", scores_of_heads)
  for (std::uint32_t h = 0; h < heads; ++h)
    if (head_dim == 128)
      scores_head<128, Held, Inl>(q + h * q_head_stride, nq, k + h * k_head_stride, tokens, head_dim,
                                  out + h * out_head_stride, out_stride, tile, pf);
    else
      scores_head<0, Held, Inl>(q + h * q_head_stride, nq, k + h * k_head_stride, tokens, head_dim,
                                out + h * out_head_stride, out_stride, tile, pf);
}

// The scores of `heads` heads (table::scores_f16_heads; one head: table::scores_f16).
template <class K>
void scores_dense_heads(const float* q, std::size_t q_head_stride, std::uint32_t nq, const K* k,
                        std::size_t k_head_stride, std::uint32_t heads, std::uint32_t tokens, std::uint32_t head_dim,
                        float* out, std::size_t out_head_stride, std::size_t out_stride, prefetch_region region) {
  // The region is spread over all the work, every row of every query pass, as a steady stream of
  // requests rather than a burst (see all_blocks in attend_avx512.cpp).
  row_prefetch pf(region, heads * tokens * score_passes(nq));
  // Each tile's lines go out with the cursor in registers (rows_held) where prefetches go to L1
  // (Zen 5 and later: f16 at 32k tokens, contiguous 1.02-1.07x with 1 thread, paged 1.04-1.05x),
  // through rows() elsewhere (on an Intel VM rows_held here ran 0.82-0.95x: see row_prefetch::rows).
  // A call over several heads (a paged block read all heads together, 16 tokens a head) has the
  // score tile inlined into its loop over tokens: the tile is otherwise a call every 4 tokens (at 4
  // queries a kv head), whose set-up and return the short blocks pay 4 times a head (on Zen 5,
  // 16-token blocks of f16 at 32k: 1.06-1.07x with 1 thread). Contiguous calls over one head keep
  // the call: inlined, they ran 1.02-1.05x with 1 thread but 0.98-0.99x with 2. GCC only: Clang 14
  // took 140-190 s rather than 19 to compile kernels_avx512.cpp with this third call site of
  // scores_of_heads.
  // (measurements: bench/PERFORMANCE.md, "Source notes: scores_dense.inl", scores_dense_heads)
#if defined(__GNUC__) && !defined(__clang__)
  if (heads > 1) {
    if (kernels::prefetch_to_l1)
      scores_of_heads<true, true>(q, q_head_stride, nq, k, k_head_stride, heads, tokens, head_dim, out, out_head_stride,
                                  out_stride, pf);
    else
      scores_of_heads<false, true>(q, q_head_stride, nq, k, k_head_stride, heads, tokens, head_dim, out,
                                   out_head_stride, out_stride, pf);
    return;
  }
#endif
  if (kernels::prefetch_to_l1)
    scores_of_heads<true, false>(q, q_head_stride, nq, k, k_head_stride, heads, tokens, head_dim, out,
                                 out_head_stride, out_stride, pf);
  else
    scores_of_heads<false, false>(q, q_head_stride, nq, k, k_head_stride, heads, tokens, head_dim, out,
                                  out_head_stride, out_stride, pf);
}

// The scores of passes x NQ queries over segs[0, count): each segment's passes in turn, as
// scores_head takes them (a segment longer than its token tile through scores_head itself), the
// score tile inlined into the loop over tokens. Against scores_head for every segment (its query
// passes and token tiles worked out, and a switch taken, every 16-token block; the tile a call
// every 4 tokens), the split worked out once a call measured 1.024-1.031x at 4k tokens from the
// L3 with 1 thread, 1.035-1.068x at 32k from memory (1.042x with 2 threads; 1.01-1.05x with 8,
// 48 and 64 queries), and the tile inlined on top of it 1.018-1.022x at 4k, 0.991-1.032x at 32k
// (1.013-1.041x with 2 threads): Zen 5 VM, paged f16 16-token blocks, 8 kv heads x 128, 32
// queries, in-process alternation. (scores_dense_segments' note of session 64 had found the
// inlined tile no faster with the per-segment split.)
// (measurements: bench/PERFORMANCE.md, session 69)
template <unsigned NQ, unsigned HD, bool Held, class K>
void segments_nq(const float* q, unsigned passes, const key_segment* segs, std::uint32_t count,
                 std::uint32_t head_dim, float* out, std::size_t out_stride, unsigned tile, row_prefetch& pf) {
  for (std::uint32_t j = 0; j < count; ++j) {
    const K* k = static_cast<const K*>(segs[j].k);
    float* o = out + segs[j].out_offset;
    if (passes > 1 && segs[j].tokens > tile) {
      scores_head<HD, Held, false>(q, passes * NQ, k, segs[j].tokens, head_dim, o, out_stride, tile, pf);
      continue;
    }
    for (unsigned i = 0; i < passes; ++i)
      scores_nq<NQ, HD, Held, true>(q + std::size_t(i) * NQ * head_dim, k, segs[j].tokens, head_dim,
                                    o + i * NQ * out_stride, out_stride, pf);
  }
}

// segments_nq for head_dim HD (0: any) where the queries split into equal passes of at most
// V::score_queries; false where they do not (5 queries: 3 + 2).
template <unsigned HD, bool Held, class K>
bool segments_equal_passes(const float* q, std::uint32_t nq, const key_segment* segs, std::uint32_t count,
                           std::uint32_t head_dim, float* out, std::size_t out_stride, unsigned tile,
                           row_prefetch& pf) {
  const unsigned passes = score_passes(nq), n = nq / passes;
  if (n * passes != nq) return false;
  switch (n) {
    case 1: segments_nq<1, HD, Held, K>(q, passes, segs, count, head_dim, out, out_stride, tile, pf); return true;
    case 2: segments_nq<2, HD, Held, K>(q, passes, segs, count, head_dim, out, out_stride, tile, pf); return true;
    case 3: segments_nq<3, HD, Held, K>(q, passes, segs, count, head_dim, out, out_stride, tile, pf); return true;
    case 4: segments_nq<4, HD, Held, K>(q, passes, segs, count, head_dim, out, out_stride, tile, pf); return true;
    default: break;
  }
  // Passes of 5 to 8 queries only where V takes them (NEON): no code for them elsewhere.
  if constexpr (V::score_queries >= 8) {
    switch (n) {
      case 5: segments_nq<5, HD, Held, K>(q, passes, segs, count, head_dim, out, out_stride, tile, pf); return true;
      case 6: segments_nq<6, HD, Held, K>(q, passes, segs, count, head_dim, out, out_stride, tile, pf); return true;
      case 7: segments_nq<7, HD, Held, K>(q, passes, segs, count, head_dim, out, out_stride, tile, pf); return true;
      case 8: segments_nq<8, HD, Held, K>(q, passes, segs, count, head_dim, out, out_stride, tile, pf); return true;
      default: break;
    }
  }
  return false;
}

// The scores of one head over segs[0, count), each segment as one scores_f16 / scores_f32 call
// of its own takes it (the same results), pf spread over all of their rows (rows_held where Held).
template <bool Held, class K>
void scores_of_segments(const float* q, std::uint32_t nq, const key_segment* segs, std::uint32_t count,
                        std::uint32_t head_dim, float* out, std::size_t out_stride, row_prefetch& pf) {
  const unsigned tile = score_token_tile<K>(head_dim);
  if (head_dim == 128 ? segments_equal_passes<128, Held, K>(q, nq, segs, count, head_dim, out, out_stride, tile, pf)
                      : segments_equal_passes<0, Held, K>(q, nq, segs, count, head_dim, out, out_stride, tile, pf))
    return;
  for (std::uint32_t j = 0; j < count; ++j) {
    const K* k = static_cast<const K*>(segs[j].k);
    if (head_dim == 128)
      scores_head<128, Held, false>(q, nq, k, segs[j].tokens, head_dim, out + segs[j].out_offset, out_stride, tile, pf);
    else
      scores_head<0, Held, false>(q, nq, k, segs[j].tokens, head_dim, out + segs[j].out_offset, out_stride, tile, pf);
  }
}

// The scores of one head over several runs of keys (table::scores_f16_segments: a tile's paged
// blocks, scored head after head), in one call rather than one a block: the call's set-up, its
// prefetch cursor and the table's indirect call once per tile instead of once per 16-token block.
// One call measured 1.00-1.03x against one a block (Zen 5 VM, paged f16 blocks of 16 tokens,
// 256-token tiles, in-process alternation); its segments take segments_nq where the queries split
// evenly, with the score tile inlined.
// (measurements: bench/PERFORMANCE.md, sessions 63-64)
template <class K>
void scores_dense_segments(const float* q, std::uint32_t nq, const key_segment* segs, std::uint32_t count,
                           std::uint32_t head_dim, float* out, std::size_t out_stride, prefetch_region region) {
  std::size_t rows = 0;
  for (std::uint32_t j = 0; j < count; ++j) rows += segs[j].tokens;
  row_prefetch pf(region, static_cast<unsigned>(rows * score_passes(nq)));
  if (kernels::prefetch_to_l1) scores_of_segments<true, K>(q, nq, segs, count, head_dim, out, out_stride, pf);
  else scores_of_segments<false, K>(q, nq, segs, count, head_dim, out, out_stride, pf);
}

void scores_f16_segments(const float* q, std::uint32_t nq, const key_segment* segs, std::uint32_t count,
                         std::uint32_t head_dim, float* out, std::size_t out_stride, prefetch_region pf) {
  scores_dense_segments<half>(q, nq, segs, count, head_dim, out, out_stride, pf);
}

void scores_f32_segments(const float* q, std::uint32_t nq, const key_segment* segs, std::uint32_t count,
                         std::uint32_t head_dim, float* out, std::size_t out_stride, prefetch_region pf) {
  scores_dense_segments<float>(q, nq, segs, count, head_dim, out, out_stride, pf);
}

void scores_f16_heads(const float* q, std::size_t q_head_stride, std::uint32_t nq, const half* k,
                      std::size_t k_head_stride, std::uint32_t heads, std::uint32_t tokens, std::uint32_t head_dim,
                      float* out, std::size_t out_head_stride, std::size_t out_stride, prefetch_region pf) {
  scores_dense_heads(q, q_head_stride, nq, k, k_head_stride, heads, tokens, head_dim, out, out_head_stride, out_stride, pf);
}

void scores_f32_heads(const float* q, std::size_t q_head_stride, std::uint32_t nq, const float* k,
                      std::size_t k_head_stride, std::uint32_t heads, std::uint32_t tokens, std::uint32_t head_dim,
                      float* out, std::size_t out_head_stride, std::size_t out_stride, prefetch_region pf) {
  scores_dense_heads(q, q_head_stride, nq, k, k_head_stride, heads, tokens, head_dim, out, out_head_stride, out_stride, pf);
}

void scores_f16(const float* q, std::uint32_t nq, const half* k, std::uint32_t tokens,
                std::uint32_t head_dim, float* out, std::size_t out_stride, prefetch_region pf) {
  scores_dense_heads(q, 0, nq, k, 0, 1, tokens, head_dim, out, 0, out_stride, pf);
}

void scores_f32(const float* q, std::uint32_t nq, const float* k, std::uint32_t tokens,
                std::uint32_t head_dim, float* out, std::size_t out_stride, prefetch_region pf) {
  scores_dense_heads(q, 0, nq, k, 0, 1, tokens, head_dim, out, 0, out_stride, pf);
}
