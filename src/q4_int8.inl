// The parts of the int8 Q4 key scores (kernels_avx2vnni.cpp, kernels_avx512vnni.cpp) that do not
// depend on the vector width: included inside each file's anonymous namespace (see
// kernels_internal.hpp).
//
// The folded query x_d = q_d * scale_d of each query is carried as scale * (hi + lo / 254) with
// scale = max|x| / 127 and |hi|, |lo| <= 127: 15 bits, an error of at most max|x| / (127 * 508)
// per channel. The minimums enter once per query as sum_d q_d m_d.

constexpr float lo_scale = 254.0f;  // lo carries (x / scale - hi) * 254

struct query_split {
  float scale;  // of the int8 parts
  float inv;    // 1 / scale, 0 when the query folds to all zeros
  float mc;     // sum_d q_d m_d
};

inline query_split split_of(float max_abs, float min_term) {
  return {max_abs / 127.0f, max_abs > 0.0f ? 127.0f / max_abs : 0.0f, min_term};
}

// f.template operator()<NQ>(i0) for the queries [i0, i0 + NQ) of nq, four at a time.
template <class F>
void by_four_queries(std::uint32_t nq, F&& f) {
  for (std::uint32_t i0 = 0; i0 < nq; i0 += 4) {
    switch (nq - i0 < 4 ? nq - i0 : 4) {
      case 1: f.template operator()<1>(i0); break;
      case 2: f.template operator()<2>(i0); break;
      case 3: f.template operator()<3>(i0); break;
      default: f.template operator()<4>(i0); break;
    }
  }
}
