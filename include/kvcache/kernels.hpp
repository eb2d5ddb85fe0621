#pragma once
/// @file kernels.hpp
/// The compiled CPU kernels (kvcache::cpu) behind every cache and attend(): FP16 and Q4 codecs
/// and the inner products of decode attention. One implementation table per ISA; `active()`
/// returns the one in use. All pointers may be unaligned; counts may be any size (ragged tails).

#include <kvcache/format.hpp>
#include <kvcache/half.hpp>
#include <kvcache/isa.hpp>

#include <cstddef>
#include <cstdint>

namespace kvcache::kernels {

/// How a table computes its Q4 key scores (table::q4) and Q4 value sums (table::q4_values).
enum class q4_arith : std::uint8_t {
  /// Codes converted to floats, float FMAs with the scales folded in: error of float rounding.
  float32,
  /// Integer dot products of the codes with the folded query x_d = q_d * scale_d, carried per
  /// query as one int8 value per channel on a grid of scale = max_d |x_d| / 127, with the
  /// rounding error's share common to the group's tokens (8 scale sum_d e_d) added back: at most
  /// max_d |x_d| / 254 * |c_d - 8| of error per channel d of a token with code c_d (plus float
  /// rounding). That is well below the Q4 keys' own error (see q4_int8_avx512.inl).
  /// AVX-512 with VNNI (with or without VBMI: the same results), every AVX2 CPU (vpdpbusd with
  /// AVX-VNNI, vpmaddubsw without; the same results), and aarch64 with the dot product extension (FEAT_DotProd: sdot, udot),
  /// head_dim up to 16384 (float beyond).
  /// Values (the same CPUs, every head_dim): per group, query and block column g,
  /// the weights w_t = p_t * scale_t of the tokens summed are rounded to u8 on a grid of
  /// step = max_t p_t * max_t scale_t / 255 (both maxima over those tokens) and multiply the
  /// centred codes c - 8: at most step / 2 * |c_t - 8| of error per token and channel. The
  /// weights must be >= 0 (as softmax weights are): the int8 value sums do not take negative ones.
  int8,
};

/// Memory a dense kernel prefetches (read, into L1) while it works, a few lines per row it
/// processes: typically the rows its caller reads next from the same stream, so that their loads
/// are in flight during this call's arithmetic. Only a hint: never read otherwise, results do not
/// depend on it, and an empty region ({}) prefetches nothing. Bytes [p, p + bytes) must lie within
/// one allocation, and so must each further piece.
/// Further pieces (more[0, more_count), each a region of its own whose `more` is ignored) follow
/// the first in that order: the rows of one kv head in each of several paged blocks. The dense
/// kernels take them all; the Q4 kernels, which attend hands single regions, the first only.
struct prefetch_region {
  const void* p = nullptr;
  std::size_t bytes = 0;
  const prefetch_region* more = nullptr;
  std::uint32_t more_count = 0;
};

/// One Q4 group of table::attend_q4: key group k and value group v (format.hpp) of `tokens`
/// (0..32) tokens, and the key and value groups (ahead_k, ahead_v, of the same head_dim; null:
/// none) whose lines the step prefetches while it reads this group's: typically the group read
/// one tile (two groups) later, in the same call or the next. Only a hint, as prefetch_region is:
/// never read otherwise, and results do not depend on it.
struct q4_group_ref {
  const std::uint8_t* k = nullptr;
  const std::uint8_t* v = nullptr;
  std::uint32_t tokens = 0;
  const std::uint8_t* ahead_k = nullptr;
  const std::uint8_t* ahead_v = nullptr;
};

/// A run of dense key rows of one kv head for table::scores_f16_segments / scores_f32_segments:
/// `tokens` rows of head_dim elements (half or float, as the kernel's name says) at k, whose scores
/// go to columns [out_offset, out_offset + tokens) of the kernel's output rows.
struct key_segment {
  const void* k = nullptr;
  std::uint32_t tokens = 0;
  std::uint32_t out_offset = 0;
};

/// Function table of one ISA. Shapes are given as comments; "stride" counts elements, not bytes.
struct table {
  isa which;

  /// dst[i] = to_half(src[i]), i < n.
  void (*f32_to_f16)(const float* src, half* dst, std::size_t n);
  /// dst[i] = to_float(src[i]), i < n.
  void (*f16_to_f32)(const half* src, float* dst, std::size_t n);

  /// Quantizes one key group of one head (format.hpp): `tokens` (1..32) rows, row t at
  /// src + t * src_stride, each of head_dim values, into dst[q4_key_group_bytes(head_dim)] (every
  /// byte written: codes of missing tokens and channels 0). // src [token][head_dim] -> dst group
  void (*quantize_keys)(const half* src, std::size_t src_stride, std::uint32_t tokens,
                        std::uint32_t head_dim, std::uint8_t* dst);
  /// Inverse of quantize_keys: dst row t at dst + t * dst_stride, t < tokens.
  void (*dequantize_keys)(const std::uint8_t* src, std::uint32_t tokens, std::uint32_t head_dim,
                          float* dst, std::size_t dst_stride);
  /// Quantizes `tokens` (1..32) value rows of one head, each token in columns of 32 channels, into
  /// one value group dst[q4_value_group_bytes(head_dim)] (format.hpp; every byte written: tokens
  /// past `tokens` get codes, scales and minimums 0). // src [token][head_dim] -> dst group
  void (*quantize_values)(const half* src, std::size_t src_stride, std::uint32_t tokens,
                          std::uint32_t head_dim, std::uint8_t* dst);
  /// Inverse of quantize_values: tokens [first, first + tokens) of the group (first + tokens <= 32)
  /// to rows dst + (t - first) * dst_stride.
  void (*dequantize_values)(const std::uint8_t* src, std::uint32_t first, std::uint32_t tokens,
                            std::uint32_t head_dim, float* dst, std::size_t dst_stride);

  /// Attention scores of nq queries against `tokens` dense keys of one head:
  /// out[i * out_stride + t] = dot(q[i * head_dim ..], k[t * head_dim ..]); pf: see prefetch_region.
  /// // q [nq][head_dim] f32, k [tokens][head_dim], out [nq][out_stride]
  void (*scores_f16)(const float* q, std::uint32_t nq, const half* k, std::uint32_t tokens,
                     std::uint32_t head_dim, float* out, std::size_t out_stride, prefetch_region pf);
  void (*scores_f32)(const float* q, std::uint32_t nq, const float* k, std::uint32_t tokens,
                     std::uint32_t head_dim, float* out, std::size_t out_stride, prefetch_region pf);
  /// Scores against tokens 0..tokens-1 (tokens <= 32) of one Q4 key group (format.hpp), reading
  /// codes in place with the scales folded into the query: q.k_t = sum_d (q_d s_d) code_dt +
  /// sum_d q_d m_d; pf: see prefetch_region (spread over the channels).
  void (*scores_q4)(const float* q, std::uint32_t nq, const std::uint8_t* k, std::uint32_t tokens,
                    std::uint32_t head_dim, float* out, std::size_t out_stride, prefetch_region pf);

  /// Weighted accumulation: acc[i * head_dim + d] += sum_t p[i * p_stride + t] * v[t][d]; pf: see
  /// prefetch_region. // p [nq][p_stride], v [tokens][head_dim], acc [nq][head_dim]
  void (*accumulate_f16)(const float* p, std::size_t p_stride, std::uint32_t nq, const half* v,
                         std::uint32_t tokens, std::uint32_t head_dim, float* acc, prefetch_region pf);
  void (*accumulate_f32)(const float* p, std::size_t p_stride, std::uint32_t nq, const float* v,
                         std::uint32_t tokens, std::uint32_t head_dim, float* acc, prefetch_region pf);
  /// Same over tokens [first, first + tokens) of one Q4 value group v (format.hpp; first + tokens
  /// <= 32), weight p[i * p_stride + t - first] for token t, read in place: per token and block
  /// column, acc += (p * scale) * code + p * min; pf: see prefetch_region.
  void (*accumulate_q4)(const float* p, std::size_t p_stride, std::uint32_t nq, const std::uint8_t* v,
                        std::uint32_t first, std::uint32_t tokens, std::uint32_t head_dim, float* acc,
                        prefetch_region pf);

  /// The arithmetic of scores_q4.
  q4_arith q4 = q4_arith::float32;
  /// The arithmetic of accumulate_q4 (int8 only for some head_dims: see q4_arith::int8).
  q4_arith q4_values = q4_arith::float32;

  /// Optional, nullptr where a table has none (attend() then calls scores_q4, its own softmax step
  /// and accumulate_q4): online-softmax steps of decode attention over `count` Q4 groups in order
  /// (groups[j]: tokens 0..tokens-1 of key group k and value group v; groups of 0 tokens are
  /// skipped), for queries q [nq][head_dim] that give base-2 logits. The groups are taken in
  /// tiles, two groups a tile (a last odd one alone): for each query i, s_t = its scores over the
  /// tile's tokens as scores_q4 computes them, m = max(run_max[i], max_t s_t); where m exceeds
  /// run_max[i], acc[i][..] and run_sum[i] are scaled by 2^(run_max[i] - m) (by 0 while
  /// run_max[i] is -inf); then with w_t = 2^(s_t - m) (to 7.5e-5 relative: the step's weights
  /// go to 8 bits, and a cubic exp2 serves them): run_sum[i] += sum_t w_t,
  /// acc[i][..] += sum_t w_t v_t as accumulate_q4 sums it (in int8 arithmetic with the weights on
  /// one grid over the tile), run_max[i] = m.
  /// One call instead of three per group, with the scores and weights of four queries kept side
  /// by side. Prefetches each group's ahead_k and ahead_v (see q4_group_ref).
  /// // q [nq][head_dim], groups [count], run_max, run_sum [nq], acc [nq][head_dim]
  void (*attend_q4)(const float* q, std::uint32_t nq, const q4_group_ref* groups, std::uint32_t count,
                    std::uint32_t head_dim, float* run_max, float* run_sum, float* acc) = nullptr;

  /// scores_f16 / scores_f32 of `heads` kv heads in one call, as a paged block holds them side by
  /// side: head j's queries at q + j * q_head_stride floats, its keys at k + j * k_head_stride
  /// elements, its scores at out + j * out_head_stride floats; pf spread over all of them. The
  /// same results as one call per head.
  void (*scores_f16_heads)(const float* q, std::size_t q_head_stride, std::uint32_t nq, const half* k,
                           std::size_t k_head_stride, std::uint32_t heads, std::uint32_t tokens,
                           std::uint32_t head_dim, float* out, std::size_t out_head_stride, std::size_t out_stride,
                           prefetch_region pf) = nullptr;
  void (*scores_f32_heads)(const float* q, std::size_t q_head_stride, std::uint32_t nq, const float* k,
                           std::size_t k_head_stride, std::uint32_t heads, std::uint32_t tokens,
                           std::uint32_t head_dim, float* out, std::size_t out_head_stride, std::size_t out_stride,
                           prefetch_region pf) = nullptr;
  /// scores_f16 / scores_f32 of one kv head over `count` runs of keys in one call (the head's rows
  /// in each of a tile's paged blocks): out[i * out_stride + segs[j].out_offset + t] = dot(q[i *
  /// head_dim ..], row t of segs[j]); pf spread over all of them. The same results as one call
  /// per segment. // q [nq][head_dim], segs [count], out [nq][out_stride]
  void (*scores_f16_segments)(const float* q, std::uint32_t nq, const key_segment* segs, std::uint32_t count,
                              std::uint32_t head_dim, float* out, std::size_t out_stride, prefetch_region pf) = nullptr;
  void (*scores_f32_segments)(const float* q, std::uint32_t nq, const key_segment* segs, std::uint32_t count,
                              std::uint32_t head_dim, float* out, std::size_t out_stride, prefetch_region pf) = nullptr;
};

/// The table of the active ISA (see isa.hpp).
[[nodiscard]] const table& active() noexcept;

/// The table of a specific ISA, or nullptr if not compiled in or not supported by this CPU. Its
/// Q4 arithmetic is the fastest this CPU has (int8 where available).
[[nodiscard]] const table* find(isa i) noexcept;

/// The table of ISA i with the given Q4 arithmetic, or nullptr where this build or CPU lacks the
/// pair (for tests and benchmarks that compare the two).
[[nodiscard]] const table* find(isa i, q4_arith a) noexcept;

/// The table of ISA i whose int8 Q4 kernels use no VNNI instruction, or nullptr where there is
/// none. AVX2: vpmaddubsw, which every AVX2 CPU has; find(isa::avx2) is this table on CPUs
/// without AVX-VNNI, and its AVX-VNNI kernels give the same results bit for bit. For tests and
/// benchmarks.
[[nodiscard]] const table* find_without_vnni(isa i) noexcept;

/// The table of ISA i whose int8 Q4 kernels use no VBMI instruction, or nullptr where there is
/// none. AVX-512: the VNNI kernels with two vpmovdb in place of one vpermt2b, on CPUs with AVX-512
/// VNNI (Intel Cascade Lake has VNNI but not VBMI); find(isa::avx512) is this table on CPUs
/// without VBMI, and its VBMI kernels give the same results bit for bit. For tests and benchmarks.
[[nodiscard]] const table* find_without_vbmi(isa i) noexcept;

/// find(i) with the other width of dense score kernels (scores_f16, scores_f32), or nullptr where
/// an ISA has only one. AVX-512: find() has 512-bit ones, or 256-bit ones on cores that split
/// 512-bit operations in two (AMD Zen 4), where those measured faster; this table the other.
/// For tests and benchmarks.
[[nodiscard]] const table* find_other_score_width(isa i) noexcept;

}  // namespace kvcache::kernels
