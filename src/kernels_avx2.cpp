// AVX2 + F16C + FMA kernels. Compiled with -mavx2 -mfma -mf16c: everything stays in this file's
// anonymous namespace (see kernels_internal.hpp); only avx2::get() is exported.
#include "kernels_internal.hpp"

// GCC 12 reports -W(maybe-)uninitialized inside its own intrinsic headers (the deliberately
// self-initialised `__Y = __Y` of _mm512_undefined_ps and friends) once they are inlined here.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#include <immintrin.h>

#include <cpuid.h>

#include <cstddef>
#include <cstdint>

namespace kvcache::kernels::avx2 {
namespace {

// Lane masks for maskload/maskstore: tail_mask + 8 - n selects the first n of 8 lanes.
alignas(64) const std::int32_t tail_mask[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};

#include "avx2_horizontal.inl"

// CPUID.(EAX=7,ECX=1):EAX[4], AVX-VNNI (the OS saving the YMM state is checked with AVX2 itself).
bool has_avx_vnni() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid_count(7, 1, &a, &b, &c, &d) != 0 && (a & (1u << 4)) != 0;
}

// The vector interface kernels_simd.inl is written against: 8 float lanes, 16 registers.
struct V {
  static constexpr isa which = isa::avx2;
  static constexpr unsigned W = 8;
  static constexpr unsigned score_queries = 4;  // queries per pass over a K tile
  static constexpr unsigned score_acc = 8;
  static constexpr unsigned acc_queries = 4;  // queries per pass over a V tile
  static constexpr unsigned acc_regs = 8;
  static constexpr unsigned q4_queries = 2;  // queries per Q4 kernel call (see q4_acc)
  static constexpr unsigned q4_acc = 8;      // Q4 accumulators: 4 per query and set (+ 2 raw, 4 codes)
  using vf = __m256;
  using vi = __m256i;
  using b16 = __m128i;

  static __m256i mask(unsigned n) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tail_mask + 8 - n)); }
  static vf zero() { return _mm256_setzero_ps(); }
  static vi zero_i() { return _mm256_setzero_si256(); }
  static vf set1(float x) { return _mm256_set1_ps(x); }
  static vf load(const float* p) { return _mm256_loadu_ps(p); }
  static vf load(const half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static vf load_n(const float* p, unsigned n) { return _mm256_maskload_ps(p, mask(n)); }
  static vf load_n(const half* p, unsigned n) {
    alignas(16) std::uint16_t buf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (unsigned i = 0; i < n; ++i) buf[i] = p[i].bits;
    return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(buf)));
  }
  static void store(float* p, vf x) { _mm256_storeu_ps(p, x); }
  static void store_n(float* p, vf x, unsigned n) { _mm256_maskstore_ps(p, mask(n), x); }
  // Lanes 4 g .. 4 g + 3 of x to p[0..3].
  static void store4(float* p, vf x, unsigned g) { store_quad8(p, x, g); }
  static __m128i to_ph(vf x) { return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static void store(half* p, vf x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_ph(x)); }
  static void store_n(half* p, vf x, unsigned n) {
    alignas(16) std::uint16_t buf[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(buf), to_ph(x));
    for (unsigned i = 0; i < n; ++i) p[i].bits = buf[i];
  }

  static vf add(vf a, vf b) { return _mm256_add_ps(a, b); }
  static vf sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
  static vf mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
  static vf div(vf a, vf b) { return _mm256_div_ps(a, b); }
  static vf fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
  static vf min(vf a, vf b) { return _mm256_min_ps(a, b); }
  static vf max(vf a, vf b) { return _mm256_max_ps(a, b); }
  static float hsum(vf x) { return hsum8(x); }
  // Transposing reduction trees (avx2_horizontal.inl): lane j = op over v[j].
  [[gnu::always_inline]] static vf reduce(const vf* v) {
    return tree8(v, [](vf a, vf b) { return _mm256_add_ps(a, b); });
  }
  [[gnu::always_inline]] static vf reduce_min(const vf* v) {
    return tree8(v, [](vf a, vf b) { return _mm256_min_ps(a, b); });
  }
  [[gnu::always_inline]] static vf reduce_max(const vf* v) {
    return tree8(v, [](vf a, vf b) { return _mm256_max_ps(a, b); });
  }

  // max(c, 0) returns its second operand 0 when c is NaN (x86 semantics), as the scalar clamp.
  static vf clamp15(vf c) { return _mm256_min_ps(_mm256_max_ps(c, zero()), set1(15.0f)); }
  static vi cvtt(vf x) { return _mm256_cvttps_epi32(x); }
  // lo | hi << S, per 32-bit lane.
  template <unsigned S>
  static vi or_shl(vi lo, vi hi) { return _mm256_or_si256(lo, _mm256_slli_epi32(hi, S)); }
  static vi and_i(vi a, vi b) { return _mm256_and_si256(a, b); }
  static void store_i(std::uint8_t* p, vi x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), x); }
  // 16 int32 (< 256) in two vectors -> 16 bytes in order.
  static b16 pack16(const vi* v) {
    const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(v[0], v[1]), 0xD8);
    return _mm_packus_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
  }
  static b16 load16(const std::uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
  static void store16(std::uint8_t* p, b16 x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), x); }
  static b16 zero16() { return _mm_setzero_si128(); }
  static b16 zip32_lo(b16 a, b16 b) { return _mm_unpacklo_epi32(a, b); }
  static b16 zip32_hi(b16 a, b16 b) { return _mm_unpackhi_epi32(a, b); }
  static b16 zip64_lo(b16 a, b16 b) { return _mm_unpacklo_epi64(a, b); }
  static b16 zip64_hi(b16 a, b16 b) { return _mm_unpackhi_epi64(a, b); }
  static void decode32(b16 b, vf* out) {
    const __m128i nib = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(b, nib);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), nib);
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    out[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    out[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
  }
  // The 8 32-bit lanes at p.
  static vi load_i(const std::uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  // Floats of the 4 bits at S of each lane.
  template <unsigned S>
  static vf nibble(vi x) {
    if constexpr (S == 28) return _mm256_cvtepi32_ps(_mm256_srli_epi32(x, 28));
    else if constexpr (S == 0) return _mm256_cvtepi32_ps(_mm256_and_si256(x, _mm256_set1_epi32(0x0f)));
    else return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(x, S), _mm256_set1_epi32(0x0f)));
  }
  // Lanes j in [lo, hi) = p[j], the others 0 (all 8 readable; the others may hold anything).
  static vf load_range(const half* p, unsigned lo, unsigned hi) {
    return _mm256_and_ps(load(p), _mm256_castsi256_ps(_mm256_andnot_si256(mask(lo), mask(hi))));
  }
  // Smallest half >= step (per lane): round to nearest, then one ulp up where that fell below.
  static vf scale_up(vf step, half* out) {
    __m128i h = to_ph(step);
    const __m256i below = _mm256_castps_si256(_mm256_cmp_ps(_mm256_cvtph_ps(h), step, _CMP_LT_OQ));
    const __m128i below16 = _mm_packs_epi32(_mm256_castsi256_si128(below), _mm256_extracti128_si256(below, 1));
    h = _mm_sub_epi16(h, below16);  // -1 where below: one ulp up
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), h);
    return _mm256_cvtph_ps(h);
  }
  static vf recip_or_zero(vf s) {
    return _mm256_and_ps(_mm256_div_ps(set1(1.0f), s), _mm256_cmp_ps(s, zero(), _CMP_GT_OQ));
  }
  static float f32_of(std::uint16_t h) { return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h))); }
};

#include "kernels_simd.inl"

}  // namespace

const table& float_q4() noexcept { return simd_table; }

const table& int8_without_vnni() noexcept {
  static const table t = [] {
    table x = simd_table;
    x.scores_q4 = avx2int8::scores_q4;
    x.accumulate_q4 = avx2int8::accumulate_q4;
    x.attend_q4 = avx2int8::attend_q4;
    x.q4 = x.q4_values = q4_arith::int8;
    return x;
  }();
  return t;
}

// Without AVX-VNNI, the very table int8_without_vnni() gives (find_without_vnni's contract).
const table& get() noexcept {
  static const table vnni = [] {
    table x = int8_without_vnni();
    x.scores_q4 = avx2vnni::scores_q4;
    x.accumulate_q4 = avx2vnni::accumulate_q4;
    x.attend_q4 = avx2vnni::attend_q4;
    return x;
  }();
  static const bool has = has_avx_vnni();
  return has ? vnni : int8_without_vnni();
}

}  // namespace kvcache::kernels::avx2
