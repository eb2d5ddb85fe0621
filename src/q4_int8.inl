// The parts of the int8 Q4 key scores (kernels_avx2vnni.cpp, kernels_avx512vnni.cpp) that do not
// depend on the vector width: included inside each file's anonymous namespace (see
// kernels_internal.hpp).
//
// The folded query x_d = q_d * scale_d of each query is carried as one int8 value per channel,
// Y_d = round(x_d / scale) with scale = max|x| / 127; the rounding error's share common to all
// tokens, 8 scale sum_d (x_d / scale - Y_d), is added back (see kernels_avx512vnni.cpp). The
// minimums enter once per query as sum_d q_d m_d.

constexpr unsigned key_chunk = 256;        // channels transposed, folded and split per pass
constexpr unsigned cached_channels = 256;  // key scales kept from pass 1 up to this head_dim

struct query_split {
  float scale;  // of the int8 values
  float inv;    // 1 / scale, 0 when the query folds to all zeros
  float mc;     // sum_d q_d m_d
};

inline query_split split_of(float max_abs, float min_term) {
  return {max_abs / 127.0f, max_abs > 0.0f ? 127.0f / max_abs : 0.0f, min_term};
}

// Scores of NQ (1..4) queries over one key group: defined by the including file.
template <unsigned NQ>
void scores_nq(const float* q, const q4_block* k, unsigned tokens, unsigned hd, float* out, std::size_t out_stride,
               row_prefetch* pf);

// The table entry (kernels::table::scores_q4): the queries four at a time.
// pf is spread over the channel quads of the first four queries.
inline void scores_q4_by_four(const float* q, std::uint32_t nq, const q4_block* k, std::uint32_t tokens,
                              std::uint32_t head_dim, float* out, std::size_t out_stride, prefetch_region pf) {
  if (tokens == 0) return;
  row_prefetch rp(pf, (head_dim + 3) / 4);
  for (std::uint32_t i0 = 0; i0 < nq; i0 += 4) {
    const float* qi = q + static_cast<std::size_t>(i0) * head_dim;
    float* o = out + i0 * out_stride;
    row_prefetch* f = i0 == 0 ? &rp : nullptr;
    switch (nq - i0 < 4 ? nq - i0 : 4) {
      case 1: scores_nq<1>(qi, k, tokens, head_dim, o, out_stride, f); break;
      case 2: scores_nq<2>(qi, k, tokens, head_dim, o, out_stride, f); break;
      case 3: scores_nq<3>(qi, k, tokens, head_dim, o, out_stride, f); break;
      default: scores_nq<4>(qi, k, tokens, head_dim, o, out_stride, f); break;
    }
  }
}
