// The parts of the int8 Q4 kernels (q4_int8_avx2.inl, q4_int8_avx512.inl, kernels_neondot.cpp)
// that do not depend on the vector width: included inside each file's anonymous namespace (see
// kernels_internal.hpp).
//
// The folded query x_d = q_d * scale_d of each query is carried as one int8 value per channel,
// Y_d = round(x_d / scale) with scale = max|x| / 127; the rounding error's share common to all
// tokens, 8 scale sum_d (x_d / scale - Y_d), is added back (see q4_int8_avx512.inl). The
// minimums enter once per query as sum_d q_d m_d.

constexpr unsigned key_chunk = 256;        // channels folded and split to int8 per pass
constexpr unsigned cached_channels = 256;  // folded queries kept from pass 1 up to this head_dim

// Widest head the int8 key scores take: the int32 sums of the high nibbles (codes times 16) take
// up to 4 * 240 * 128 per channel quad, and past 2^14 channels they would near 2^31. Heads that
// wide get the float kernel.
constexpr std::uint32_t int8_key_channels = 16384;

// The Q4 group layout of format.hpp (see there), computed here: this file is compiled with its
// ISA's flags and must not instantiate the header's inline functions (kernels_internal.hpp).
constexpr unsigned key_channels(unsigned hd) { return (hd + 3) / 4 * 4; }  // channels of whole quads
constexpr unsigned value_blocks(unsigned hd) { return (hd + 31) / 32; }   // block columns
// Key group: codes [C / 4][16][4] bytes (channel quad c / 4 at byte 16 c), scales [C], mins [C].
constexpr std::size_t key_scales_at(unsigned hd) { return std::size_t{16} * key_channels(hd); }
constexpr std::size_t key_mins_at(unsigned hd) { return std::size_t{18} * key_channels(hd); }
// Value group: codes [B][8][16][4] bytes (column g at byte 512 g, token quad Q 64 Q further in),
// scales [B][32], mins [B][32] (column g's 32 halves at byte 64 g of each).
constexpr std::size_t value_scales_at(unsigned hd) { return std::size_t{512} * value_blocks(hd); }
constexpr std::size_t value_mins_at(unsigned hd) { return std::size_t{576} * value_blocks(hd); }
constexpr std::size_t key_group_bytes(unsigned hd) { return std::size_t{20} * key_channels(hd); }
constexpr std::size_t value_group_bytes(unsigned hd) { return std::size_t{640} * value_blocks(hd); }
static_assert(key_group_bytes(100) == q4_key_group_bytes(100) && value_group_bytes(80) == q4_value_group_bytes(80));
static_assert(key_scales_at(100) == q4_key_scales_offset(100) && key_mins_at(99) == q4_key_mins_offset(99) &&
              value_scales_at(80) == q4_value_scales_offset(80) && value_mins_at(8) == q4_value_mins_offset(8));
static_assert(q4_key_code_byte(6, 17) == 64 * 1 + 4 * 1 + 2 && q4_value_code_byte(6, 37) == 512 + 64 * 1 + 4 * 5 + 2,
              "the int8 kernels read channel quads of keys and token quads of values as 64-byte rows");

// The lines of a kernels::prefetch_region spread evenly over a kernel's rows of work (as
// row_prefetch.inl does for the dense kernels): `rows` rows in all, lines / rows of them per row
// (in fractions of a line, so that they run out with the last row). A value: the loops take a
// copy that stays in registers and hand back what is left.
struct line_prefetch {
  std::uintptr_t at = 0, end = 0;  // the next line; the region's end
  std::uintptr_t first = 0;        // the region's first line
  std::uintptr_t step = 0;         // bytes of lines per row, times 256 (0: none)
  std::uintptr_t due = 0;          // bytes from `first` due so far, times 256
  bool l1 = false;                 // requested into L1, not L2 (prefetch_to_l1)

  line_prefetch() = default;
  line_prefetch(prefetch_region r, unsigned rows) {
    const auto begin = reinterpret_cast<std::uintptr_t>(r.p);
    at = first = begin & ~std::uintptr_t{63};  // the line of the first byte
    end = begin + r.bytes;
    const std::size_t lines = (end - at + 63) / 64;
    step = r.bytes == 0 ? 0 : lines * 64 * 256 / (rows == 0 ? 1 : rows) + 1;
    l1 = prefetch_to_l1;
  }
  // The lines of n rows.
  void rows(unsigned n) {
    due += step * n;
    const std::uintptr_t d = first + (due >> 8);
    for (const std::uintptr_t e = d < end ? d : end; at < e; at += 64) {
      prefetch_line(at, l1);
    }
  }
};

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
void scores_nq(const float* q, const std::uint8_t* k, unsigned tokens, unsigned hd, float* out, std::size_t out_stride,
               line_prefetch& pf);

// The table entry (kernels::table::scores_q4) for head_dim <= int8_key_channels: the queries four
// at a time. pf is spread over the channel quads of the first four queries.
inline void scores_q4_by_four(const float* q, std::uint32_t nq, const std::uint8_t* k, std::uint32_t tokens,
                              std::uint32_t head_dim, float* out, std::size_t out_stride, prefetch_region pf) {
  if (tokens == 0) return;
  line_prefetch rp(pf, key_channels(head_dim) / 4), none;
  for (std::uint32_t i0 = 0; i0 < nq; i0 += 4) {
    const float* qi = q + static_cast<std::size_t>(i0) * head_dim;
    float* o = out + i0 * out_stride;
    line_prefetch& f = i0 == 0 ? rp : none;
    switch (nq - i0 < 4 ? nq - i0 : 4) {
      case 1: scores_nq<1>(qi, k, tokens, head_dim, o, out_stride, f); break;
      case 2: scores_nq<2>(qi, k, tokens, head_dim, o, out_stride, f); break;
      case 3: scores_nq<3>(qi, k, tokens, head_dim, o, out_stride, f); break;
      default: scores_nq<4>(qi, k, tokens, head_dim, o, out_stride, f); break;
    }
  }
}

// The online-softmax step of NQ (1..4) queries over one tile of G (1, 2) Q4 groups with tokens
// (table::attend_q4): defined by the including file where it has a fused step
// (q4_int8_avx512.inl; q4_attend_step.inl for q4_int8_avx2.inl and kernels_neondot.cpp).
template <unsigned NQ, unsigned G>
void attend_nq(const float* q, const q4_group_ref* g, unsigned hd, float* run_max, float* run_sum, float* acc,
               line_prefetch& pf);

// One tile of G (1, 2) groups with tokens, the queries four at a time.
template <unsigned G>
void attend_tile(const float* q, std::uint32_t nq, const q4_group_ref* g, std::uint32_t head_dim, float* run_max,
                 float* run_sum, float* acc, line_prefetch& pf) {
  line_prefetch none;
  for (std::uint32_t i0 = 0; i0 < nq; i0 += 4) {
    const float* qi = q + static_cast<std::size_t>(i0) * head_dim;
    float* a = acc + static_cast<std::size_t>(i0) * head_dim;
    line_prefetch& f = i0 == 0 ? pf : none;
    switch (nq - i0 < 4 ? nq - i0 : 4) {
      case 1: attend_nq<1, G>(qi, g, head_dim, run_max + i0, run_sum + i0, a, f); break;
      case 2: attend_nq<2, G>(qi, g, head_dim, run_max + i0, run_sum + i0, a, f); break;
      case 3: attend_nq<3, G>(qi, g, head_dim, run_max + i0, run_sum + i0, a, f); break;
      default: attend_nq<4, G>(qi, g, head_dim, run_max + i0, run_sum + i0, a, f); break;
    }
  }
}

// The lines of the groups' ahead_k and ahead_v (q4_group_ref) as one region: from the first
// group's ahead_k on, keys then values, group after group, as far as they follow one another in
// memory (as one head's groups do in the two-tier store, up to a slab's end). A hint: where the
// run breaks off, the region ends.
inline prefetch_region ahead_region(const q4_group_ref* groups, std::uint32_t count, unsigned hd) {
  const std::uint8_t* begin = nullptr;
  const std::uint8_t* end = nullptr;
  for (std::uint32_t j = 0; j < count; ++j) {
    const q4_group_ref& g = groups[j];
    if (g.tokens == 0) continue;
    if (g.ahead_k == nullptr || (begin != nullptr && g.ahead_k != end)) break;
    if (begin == nullptr) begin = g.ahead_k;
    end = g.ahead_k + key_group_bytes(hd);
    if (g.ahead_v != end) break;
    end += value_group_bytes(hd);
  }
  return {begin, static_cast<std::size_t>(end - begin)};
}

// The table entry (kernels::table::attend_q4) where the including file defines attend_nq: two
// groups a tile (a last odd one alone), groups without tokens skipped. Where `spread` is set, each
// tile's ahead lines (ahead_region of its groups) are spread over the channel quads of the first
// queries' scores and the token quads of their value columns (all of it in the scores alone,
// three lines a quad, stalled them; rows of the set-up too measured 0.97-0.98x on AVX2); where it
// is not, the includer's step prefetches them itself (q4_int8_avx512.inl). Tile by tile: one
// region over a run of 16 groups, spread over all their rows, ran attend over a two-tier cache at
// 0.78x on AVX2 (Zen 5, 32k tokens, 1 thread).
inline void attend_q4_by_tiles(const float* q, std::uint32_t nq, const q4_group_ref* groups, std::uint32_t count,
                               std::uint32_t head_dim, float* run_max, float* run_sum, float* acc, bool spread) {
  // Keys wider than int8_key_channels are scored by the float kernel, which takes no rows.
  const unsigned key_rows = head_dim <= int8_key_channels ? key_channels(head_dim) / 4 : 0;
  auto tile = [&](const q4_group_ref* tg, unsigned n) {
    line_prefetch rp;  // none where the step prefetches itself
    if (spread) {
      unsigned rows = 0;
      for (unsigned j = 0; j < n; ++j) rows += key_rows + value_blocks(head_dim) * ((tg[j].tokens + 3) / 4);
      rp = line_prefetch(ahead_region(tg, n, head_dim), rows);
    }
    if (n == 2) attend_tile<2>(q, nq, tg, head_dim, run_max, run_sum, acc, rp);
    else attend_tile<1>(q, nq, tg, head_dim, run_max, run_sum, acc, rp);
    // Every row counted above was taken: the whole region went out.
    assert(rp.step == 0 || rp.at >= rp.end);
  };
  q4_group_ref pair[2];
  unsigned n = 0;
  for (std::uint32_t j = 0; j < count; ++j) {
    if (groups[j].tokens == 0) continue;
    pair[n++] = groups[j];
    if (n == 2) {
      tile(pair, 2);
      n = 0;
    }
  }
  if (n == 1) tile(pair, 1);
}
