// AVX-512 F/BW/VL (+F16C, FMA) kernels. Compiled with AVX-512 flags: everything stays in this
// file's anonymous namespace (see kernels_internal.hpp); only avx512::get() is exported.
#include "kernels_internal.hpp"

// GCC 12 reports -W(maybe-)uninitialized inside its own intrinsic headers (the deliberately
// self-initialised `__Y = __Y` of _mm512_undefined_ps and friends) once they are inlined here.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

namespace kvcache::kernels::avx512 {
namespace {

// The vector interface kernels_simd.inl is written against: 16 float lanes.
struct V {
  static constexpr isa which = isa::avx512;
  static constexpr unsigned W = 16;
  static constexpr unsigned score_queries = 4;  // queries per pass over a K tile
  static constexpr unsigned score_acc = 16;     // dot-product accumulators of a score tile
  static constexpr unsigned acc_queries = 8;  // queries per pass over a V tile
  static constexpr unsigned acc_regs = 16;   // accumulators of a dense accumulate tile
  static constexpr unsigned q4_queries = 8;  // queries per Q4 kernel call (see q4_acc)
  static constexpr unsigned q4_acc = 16;     // Q4 accumulators: 2 per query and set (+ 1 raw, 2 codes)
  using vf = __m512;
  using vi = __m512i;
  using b16 = __m128i;

  static __mmask16 mask(unsigned n) { return static_cast<__mmask16>((1u << n) - 1u); }
  static vf zero() { return _mm512_setzero_ps(); }
  static vi zero_i() { return _mm512_setzero_si512(); }
  static vf set1(float x) { return _mm512_set1_ps(x); }
  static vf load(const float* p) { return _mm512_loadu_ps(p); }
  static vf load(const half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static vf load_n(const float* p, unsigned n) { return _mm512_maskz_loadu_ps(mask(n), p); }
  static vf load_n(const half* p, unsigned n) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask(n), p)); }
  static void store(float* p, vf x) { _mm512_storeu_ps(p, x); }
  static void store_n(float* p, vf x, unsigned n) { _mm512_mask_storeu_ps(p, mask(n), x); }
  static __m256i to_ph(vf x) { return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static void store(half* p, vf x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_ph(x)); }
  static void store_n(half* p, vf x, unsigned n) { _mm256_mask_storeu_epi16(p, mask(n), to_ph(x)); }

  static vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
  static vf sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
  static vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
  static vf div(vf a, vf b) { return _mm512_div_ps(a, b); }
  static vf fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
  static vf min(vf a, vf b) { return _mm512_min_ps(a, b); }
  static vf max(vf a, vf b) { return _mm512_max_ps(a, b); }
  static float hsum(vf x) { return _mm512_reduce_add_ps(x); }
  // Lanes 4 g .. 4 g + 3 of x (g < 4) to p[0..3].
  static void store4(float* p, vf x, unsigned g) {
    switch (g) {
      case 0: _mm_storeu_ps(p, _mm512_extractf32x4_ps(x, 0)); break;
      case 1: _mm_storeu_ps(p, _mm512_extractf32x4_ps(x, 1)); break;
      case 2: _mm_storeu_ps(p, _mm512_extractf32x4_ps(x, 2)); break;
      default: _mm_storeu_ps(p, _mm512_extractf32x4_ps(x, 3)); break;
    }
  }

  // Transposing reduction tree: four levels of (shuffle, shuffle, op). Lane 4c + l of the result
  // combines input 4l + c, so the inputs are fed in that order to get lane j = op over v[j].
  // Always inlined, as the reductions below: GCC 12 called it out of line from the score kernels (scores_nq), which then
  // stored their 16 accumulators to memory for it to load, and spent 14-19% of a paged or
  // contiguous f16 step in it; inlined, 1.04-1.08x paged and 1.06x contiguous (4k tokens in the
  // L3, 1 thread; from memory paged 1.04-1.05x, contiguous 0.99x with 1 thread and 1.06x with 2).
  // (measurements: bench/PERFORMANCE.md, session 70)
  template <class Op>
  [[gnu::always_inline]] static vf tree(const vf* v, Op op) {
    vf u[16];
    for (unsigned m = 0; m < 16; ++m) u[m] = v[(m % 4) * 4 + m / 4];
    vf a[8], b[4], c[2];
    for (unsigned k = 0; k < 8; ++k)
      a[k] = op(_mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                _mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (unsigned k = 0; k < 4; ++k)
      b[k] = op(_mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                _mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (unsigned k = 0; k < 2; ++k)
      c[k] = op(_mm512_shuffle_ps(b[2 * k], b[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                _mm512_shuffle_ps(b[2 * k], b[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return op(_mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
              _mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  [[gnu::always_inline]] static vf reduce(const vf* v) {
    return tree(v, [](vf a, vf b) { return _mm512_add_ps(a, b); });
  }
  [[gnu::always_inline]] static vf reduce_min(const vf* v) {
    return tree(v, [](vf a, vf b) { return _mm512_min_ps(a, b); });
  }
  [[gnu::always_inline]] static vf reduce_max(const vf* v) {
    return tree(v, [](vf a, vf b) { return _mm512_max_ps(a, b); });
  }

  // max(c, 0) returns its second operand 0 when c is NaN (x86 semantics), as the scalar clamp.
  static vf clamp15(vf c) { return _mm512_min_ps(_mm512_max_ps(c, zero()), set1(15.0f)); }
  static vi cvtt(vf x) { return _mm512_cvttps_epi32(x); }
  // lo | hi << S, per 32-bit lane.
  template <unsigned S>
  static vi or_shl(vi lo, vi hi) { return _mm512_or_si512(lo, _mm512_slli_epi32(hi, S)); }
  static vi and_i(vi a, vi b) { return _mm512_and_si512(a, b); }
  static void store_i(std::uint8_t* p, vi x) { _mm512_storeu_si512(p, x); }
  static b16 pack16(const vi* v) { return _mm512_cvtepi32_epi8(v[0]); }
  static b16 load16(const std::uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
  static void store16(std::uint8_t* p, b16 x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), x); }
  static b16 zero16() { return _mm_setzero_si128(); }
  static b16 zip32_lo(b16 a, b16 b) { return _mm_unpacklo_epi32(a, b); }
  static b16 zip32_hi(b16 a, b16 b) { return _mm_unpackhi_epi32(a, b); }
  static b16 zip64_lo(b16 a, b16 b) { return _mm_unpacklo_epi64(a, b); }
  static b16 zip64_hi(b16 a, b16 b) { return _mm_unpackhi_epi64(a, b); }
  // Codes to floats by table lookup: vpermps indexes with the low 4 bits of each lane, which are
  // the low nibble; shifting by 4 brings the high nibble there.
  static void decode32(b16 b, vf* out) {
    const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i dw = _mm512_cvtepu8_epi32(b);
    out[0] = _mm512_permutexvar_ps(dw, table);
    out[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(dw, 4), table);
  }
  // The 16 32-bit lanes at p.
  static vi load_i(const std::uint8_t* p) { return _mm512_loadu_si512(p); }
  // Floats of the 4 bits at S of each lane: vpermps indexes with the low 4 bits of its lanes.
  template <unsigned S>
  static vf nibble(vi x) {
    const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    if constexpr (S == 0) return _mm512_permutexvar_ps(x, table);
    else return _mm512_permutexvar_ps(_mm512_srli_epi32(x, S), table);
  }
  // Lanes j in [lo, hi) = p[j], the others 0 (and never read: they may hold anything).
  static vf load_range(const half* p, unsigned lo, unsigned hi) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(static_cast<__mmask16>(mask(hi) & ~mask(lo)), p));
  }
  // Smallest half >= step (per lane): round to nearest, then one ulp up where that fell below.
  static vf scale_up(vf step, half* out) {
    __m256i h = to_ph(step);
    const __mmask16 below = _mm512_cmp_ps_mask(_mm512_cvtph_ps(h), step, _CMP_LT_OQ);
    h = _mm256_mask_add_epi16(h, below, h, _mm256_set1_epi16(1));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), h);
    return _mm512_cvtph_ps(h);
  }
  static vf recip_or_zero(vf s) {
    return _mm512_maskz_div_ps(_mm512_cmp_ps_mask(s, zero(), _CMP_GT_OQ), set1(1.0f), s);
  }
  static float f32_of(std::uint16_t h) { return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h))); }
};

// Dense scores with 256-bit vectors, for cores that split 512-bit operations in two (Zen 4; see
// splits_512bit_operations): a dot product of 512-bit accumulators needs a four-level horizontal
// tree per 16 sums, 256-bit ones a three-level tree of single-width operations
// (avx2_horizontal.inl), for the same FMA throughput there. AVX-512VL gives the 32 registers for
// 16 accumulators (4 tokens x 4 queries) and masked tails. Measured on Zen 4: 35-36 cycles per
// token and 4 queries at head_dim 128 against 42-44 for the 512-bit kernel (32 of FMAs).
namespace ymm {

constexpr unsigned umin(unsigned a, unsigned b) { return a < b ? a : b; }
constexpr unsigned umax(unsigned a, unsigned b) { return a > b ? a : b; }

#include "avx2_horizontal.inl"
#include "row_prefetch.inl"

struct V {
  static constexpr unsigned W = 8;
  static constexpr unsigned score_queries = 4;  // queries per pass over a K tile
  static constexpr unsigned score_acc = 16;     // dot-product accumulators of a score tile
  using vf = __m256;

  static __mmask8 mask(unsigned n) { return static_cast<__mmask8>((1u << n) - 1u); }
  static vf zero() { return _mm256_setzero_ps(); }
  static vf load(const float* p) { return _mm256_loadu_ps(p); }
  static vf load(const half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static vf load_n(const float* p, unsigned n) { return _mm256_maskz_loadu_ps(mask(n), p); }
  static vf load_n(const half* p, unsigned n) { return _mm256_cvtph_ps(_mm_maskz_loadu_epi16(mask(n), p)); }
  static void store(float* p, vf x) { _mm256_storeu_ps(p, x); }
  static void store4(float* p, vf x, unsigned g) { store_quad8(p, x, g); }
  static vf fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
  static float hsum(vf x) { return hsum8(x); }
  [[gnu::always_inline]] static vf reduce(const vf* v) {
    return tree8(v, [](vf a, vf b) { return _mm256_add_ps(a, b); });
  }
};
using vf = V::vf;
constexpr unsigned W = V::W;

#include "scores_dense.inl"

}  // namespace ymm

// The 512-bit dense scores are kernels_simd.inl's (scores_dense.inl with the 16-lane V above):
// the choice on cores that do not split 512-bit operations (Zen 5, Intel). Measured on Zen 5
// (this project's VM, CPU family 26), attend at 32k tokens, 1 thread, steps of each kernel
// alternated in one process with the other caches' in between: a contiguous f16 cache
// 1.12-1.13x faster than with the 256-bit scores above, a paged one (16-token blocks) 1.12x.
#include "kernels_simd.inl"

}  // namespace

const table& float_q4() noexcept { return simd_table; }

namespace {

// simd_table with this CPU's dense score kernels (256-bit ones where it splits 512-bit operations).
table with_score_width() noexcept {
  table x = simd_table;
  if (splits_512bit_operations()) {
    x.scores_f16 = ymm::scores_f16;
    x.scores_f32 = ymm::scores_f32;
    x.scores_f16_heads = ymm::scores_f16_heads;
    x.scores_f32_heads = ymm::scores_f32_heads;
    x.scores_f16_segments = ymm::scores_f16_segments;
    x.scores_f32_segments = ymm::scores_f32_segments;
  }
  return x;
}

// with_score_width() with int8 Q4 kernels.
table with_int8_q4(scores_q4_fn* scores, accumulate_q4_fn* accumulate, attend_q4_fn* attend) noexcept {
  table x = with_score_width();
  x.scores_q4 = scores;
  x.accumulate_q4 = accumulate;
  x.attend_q4 = attend;
  x.q4 = x.q4_values = q4_arith::int8;
  return x;
}

bool has_vnni() noexcept {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vnni");
}

bool has_vbmi() noexcept {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vbmi");
}

}  // namespace

// The int8 kernels without VBMI where the CPU has AVX-512 VNNI. On a Cascade Lake VM (Intel family
// 6 model 85, 2 vCPUs at 2.5 GHz), where they are get()'s, attend over a two-tier cache at 32k with
// 1 thread ran at 1.43x an f16 cache's speed with the float Q4 kernels and 2.2-2.3x with these
// (scripts/perf_report.sh, session 40; paired steps 2.10x).
const table* int8_without_vbmi() noexcept {
  static const table t = with_int8_q4(avx512vnni_novbmi::scores_q4, avx512vnni_novbmi::accumulate_q4,
                                      avx512vnni_novbmi::attend_q4);
  static const bool vnni = has_vnni();
  return vnni ? &t : nullptr;
}

// With VNNI and VBMI the kernels on vpermt2b; with VNNI alone the very table int8_without_vbmi()
// gives (find_without_vbmi's contract); else the float Q4 kernels.
const table& get() noexcept {
  static const table vbmi = with_int8_q4(avx512vnni::scores_q4, avx512vnni::accumulate_q4, avx512vnni::attend_q4);
  static const table plain = with_score_width();
  static const bool vnni = has_vnni(), both = vnni && has_vbmi();
  if (both) return vbmi;
  if (vnni) return *int8_without_vbmi();
  return plain;
}

const table& other_score_width() noexcept {
  static const table t = [] {
    table x = get();
    const bool narrow = x.scores_f16 == ymm::scores_f16;
    x.scores_f16 = narrow ? simd_table.scores_f16 : ymm::scores_f16;
    x.scores_f32 = narrow ? simd_table.scores_f32 : ymm::scores_f32;
    x.scores_f16_heads = narrow ? simd_table.scores_f16_heads : ymm::scores_f16_heads;
    x.scores_f32_heads = narrow ? simd_table.scores_f32_heads : ymm::scores_f32_heads;
    x.scores_f16_segments = narrow ? simd_table.scores_f16_segments : ymm::scores_f16_segments;
    x.scores_f32_segments = narrow ? simd_table.scores_f32_segments : ymm::scores_f32_segments;
    return x;
  }();
  return t;
}

}  // namespace kvcache::kernels::avx512
