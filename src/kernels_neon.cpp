// aarch64 Advanced SIMD kernels (baseline on aarch64, so no extra flags; the FP16 conversions
// FCVTL/FCVTN are baseline too). Same structure as the x86 files: everything in this file's
// anonymous namespace, only neon::get() exported.
#include "kernels_internal.hpp"

#include <arm_neon.h>
#include <sys/auxv.h>

#include <cstddef>
#include <cstdint>

namespace kvcache::kernels::neon {
namespace {

// The vector interface kernels_simd.inl is written against: 4 float lanes, 32 registers.
struct V {
  static constexpr isa which = isa::neon;
  static constexpr unsigned W = 4;
  static constexpr unsigned score_queries = 8;  // queries per pass over a K tile
  static constexpr unsigned score_acc = 16;
  static constexpr unsigned acc_queries = 8;  // queries per pass over a V tile
  static constexpr unsigned acc_regs = 16;
  static constexpr unsigned q4_queries = 2;  // queries per Q4 kernel call (see q4_acc)
  static constexpr unsigned q4_acc = 16;     // Q4 accumulators: 8 per query and set (+ 4 raw, 8 codes)
  using vf = float32x4_t;
  using vi = int32x4_t;
  using b16 = uint8x16_t;

  static vf zero() { return vdupq_n_f32(0.0f); }
  static vi zero_i() { return vdupq_n_s32(0); }
  static vf set1(float x) { return vdupq_n_f32(x); }
  static vf load(const float* p) { return vld1q_f32(p); }
  static vf h2f(uint16x4_t h) { return vcvt_f32_f16(vreinterpret_f16_u16(h)); }
  static uint16x4_t f2h(vf x) { return vreinterpret_u16_f16(vcvt_f16_f32(x)); }  // FPCR: nearest-even
  static vf load(const half* p) { return h2f(vld1_u16(reinterpret_cast<const std::uint16_t*>(p))); }
  static vf load_n(const float* p, unsigned n) {
    float buf[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (unsigned i = 0; i < n; ++i) buf[i] = p[i];
    return vld1q_f32(buf);
  }
  static vf load_n(const half* p, unsigned n) {
    std::uint16_t buf[4] = {0, 0, 0, 0};
    for (unsigned i = 0; i < n; ++i) buf[i] = p[i].bits;
    return h2f(vld1_u16(buf));
  }
  static void store(float* p, vf x) { vst1q_f32(p, x); }
  static void store_n(float* p, vf x, unsigned n) {
    float buf[4];
    vst1q_f32(buf, x);
    for (unsigned i = 0; i < n; ++i) p[i] = buf[i];
  }
  static void store(half* p, vf x) { vst1_u16(reinterpret_cast<std::uint16_t*>(p), f2h(x)); }
  static void store_n(half* p, vf x, unsigned n) {
    std::uint16_t buf[4];
    vst1_u16(buf, f2h(x));
    for (unsigned i = 0; i < n; ++i) p[i].bits = buf[i];
  }

  static vf add(vf a, vf b) { return vaddq_f32(a, b); }
  static vf sub(vf a, vf b) { return vsubq_f32(a, b); }
  static vf mul(vf a, vf b) { return vmulq_f32(a, b); }
  static vf div(vf a, vf b) { return vdivq_f32(a, b); }
  static vf fma(vf a, vf b, vf c) { return vfmaq_f32(c, a, b); }
  static vf min(vf a, vf b) { return vminq_f32(a, b); }
  static vf max(vf a, vf b) { return vmaxq_f32(a, b); }
  static float hsum(vf x) { return vaddvq_f32(x); }
  // Lane j of the result = sum / min / max over v[j] (pairwise ops).
  static vf reduce(const vf* v) { return vpaddq_f32(vpaddq_f32(v[0], v[1]), vpaddq_f32(v[2], v[3])); }
  static vf reduce_min(const vf* v) { return vpminq_f32(vpminq_f32(v[0], v[1]), vpminq_f32(v[2], v[3])); }
  static vf reduce_max(const vf* v) { return vpmaxq_f32(vpmaxq_f32(v[0], v[1]), vpmaxq_f32(v[2], v[3])); }

  // FMAXNM returns the number when c is NaN, so NaN clamps to 0 as in the scalar code.
  static vf clamp15(vf c) { return vminq_f32(vmaxnmq_f32(c, zero()), set1(15.0f)); }
  static vi cvtt(vf x) { return vcvtq_s32_f32(x); }  // rounds toward zero
  // lo | hi << S, per 32-bit lane.
  template <unsigned S>
  static vi or_shl(vi lo, vi hi) { return vorrq_s32(lo, vshlq_n_s32(hi, S)); }
  static vi and_i(vi a, vi b) { return vandq_s32(a, b); }
  // The 4 32-bit lanes at p, and back.
  static vi load_i(const std::uint8_t* p) { return vreinterpretq_s32_u8(vld1q_u8(p)); }
  static void store_i(std::uint8_t* p, vi x) { vst1q_u8(p, vreinterpretq_u8_s32(x)); }
  // 16 int32 (< 256) in four vectors -> 16 bytes in order.
  static b16 pack16(const vi* v) {
    const int16x8_t a = vcombine_s16(vmovn_s32(v[0]), vmovn_s32(v[1]));
    const int16x8_t b = vcombine_s16(vmovn_s32(v[2]), vmovn_s32(v[3]));
    return vreinterpretq_u8_s8(vcombine_s8(vmovn_s16(a), vmovn_s16(b)));
  }
  static b16 load16(const std::uint8_t* p) { return vld1q_u8(p); }
  static void store16(std::uint8_t* p, b16 x) { vst1q_u8(p, x); }
  static b16 zero16() { return vdupq_n_u8(0); }
  static b16 zip32_lo(b16 a, b16 b) {
    return vreinterpretq_u8_u32(vzip1q_u32(vreinterpretq_u32_u8(a), vreinterpretq_u32_u8(b)));
  }
  static b16 zip32_hi(b16 a, b16 b) {
    return vreinterpretq_u8_u32(vzip2q_u32(vreinterpretq_u32_u8(a), vreinterpretq_u32_u8(b)));
  }
  static b16 zip64_lo(b16 a, b16 b) {
    return vreinterpretq_u8_u64(vzip1q_u64(vreinterpretq_u64_u8(a), vreinterpretq_u64_u8(b)));
  }
  static b16 zip64_hi(b16 a, b16 b) {
    return vreinterpretq_u8_u64(vzip2q_u64(vreinterpretq_u64_u8(a), vreinterpretq_u64_u8(b)));
  }
  static void widen(uint8x8_t b, vf* out) {
    const uint16x8_t w = vmovl_u8(b);
    out[0] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(w)));
    out[1] = vcvtq_f32_u32(vmovl_u16(vget_high_u16(w)));
  }
  static void decode32(b16 b, vf* out) {
    const uint8x16_t lo = vandq_u8(b, vdupq_n_u8(0x0f));
    const uint8x16_t hi = vshrq_n_u8(b, 4);
    widen(vget_low_u8(lo), out);
    widen(vget_high_u8(lo), out + 2);
    widen(vget_low_u8(hi), out + 4);
    widen(vget_high_u8(hi), out + 6);
  }
  // Floats of the 4 bits at S of each lane.
  template <unsigned S>
  static vf nibble(vi x) {
    const uint32x4_t u = vreinterpretq_u32_s32(x);
    if constexpr (S == 0) return vcvtq_f32_u32(vandq_u32(u, vdupq_n_u32(0x0f)));
    else if constexpr (S == 28) return vcvtq_f32_u32(vshrq_n_u32(u, 28));
    else return vcvtq_f32_u32(vandq_u32(vshrq_n_u32(u, S), vdupq_n_u32(0x0f)));
  }
  // Lanes j in [lo, hi) = p[j], the others 0 (all 4 readable; the others may hold anything).
  static vf load_range(const half* p, unsigned lo, unsigned hi) {
    const uint32x4_t j = {0, 1, 2, 3};
    const uint32x4_t in = vandq_u32(vcgeq_u32(j, vdupq_n_u32(lo)), vcltq_u32(j, vdupq_n_u32(hi)));
    return vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(load(p)), in));
  }
  // Smallest half >= step (per lane): round to nearest, then one ulp up where that fell below.
  static vf scale_up(vf step, half* out) {
    uint16x4_t h = f2h(step);
    const uint16x4_t below = vmovn_u32(vcltq_f32(h2f(h), step));  // all ones where below
    h = vsub_u16(h, below);                                        // - (-1): one ulp up
    vst1_u16(reinterpret_cast<std::uint16_t*>(out), h);
    return h2f(h);
  }
  static vf recip_or_zero(vf s) {
    const uint32x4_t pos = vcgtq_f32(s, zero());
    return vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(vdivq_f32(set1(1.0f), s)), pos));
  }
  static float f32_of(std::uint16_t h) { return vgetq_lane_f32(h2f(vdup_n_u16(h)), 0); }
};

#include "kernels_simd.inl"

}  // namespace

const table& float_q4() noexcept { return simd_table; }

namespace {
// FEAT_DotProd (sdot, udot), as the kernel reports it: HWCAP_ASIMDDP, bit 20 of AT_HWCAP.
bool has_dotprod() noexcept { return (getauxval(AT_HWCAP) & (1ul << 20)) != 0; }
}  // namespace

const table& get() noexcept {
  static const table t = [] {
    table x = simd_table;
    if (has_dotprod()) {
      x.scores_q4 = neondot::scores_q4;
      x.accumulate_q4 = neondot::accumulate_q4;
      x.attend_q4 = neondot::attend_q4;
      x.q4 = x.q4_values = q4_arith::int8;
    }
    return x;
  }();
  return t;
}

}  // namespace kvcache::kernels::neon
