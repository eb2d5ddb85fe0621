// IEEE binary16 conversions (half.hpp) against an independent reference computed in double with
// explicit round-to-nearest-even: every half bit pattern, the rounding boundaries, and millions of
// random floats. The same inputs go through every supported ISA's bulk f32_to_f16 / f16_to_f32.
#include <kvcache/half.hpp>
#include <kvcache/isa.hpp>
#include <kvcache/kernels.hpp>

#include <gtest/gtest.h>

#include <bit>
#include <cfenv>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace {

using kvcache::f16_bits_to_f32;
using kvcache::f32_to_f16_bits;
using kvcache::half;

// ---- constexpr checks ------------------------------------------------------------------------
static_assert(f32_to_f16_bits(0.0f) == 0x0000);
static_assert(f32_to_f16_bits(-0.0f) == 0x8000);
static_assert(f32_to_f16_bits(1.0f) == 0x3c00);
static_assert(f32_to_f16_bits(-2.0f) == 0xc000);
static_assert(f32_to_f16_bits(65504.0f) == 0x7bff);              // largest finite half
static_assert(f32_to_f16_bits(65519.996f) == 0x7bff);            // just below the overflow tie
static_assert(f32_to_f16_bits(65520.0f) == 0x7c00);              // tie rounds to even: +inf
static_assert(f32_to_f16_bits(std::numeric_limits<float>::infinity()) == 0x7c00);
static_assert(f32_to_f16_bits(-std::numeric_limits<float>::infinity()) == 0xfc00);
static_assert(f32_to_f16_bits(0x1p-24f) == 0x0001);              // smallest subnormal
static_assert(f32_to_f16_bits(0x1p-25f) == 0x0000);              // tie between 0 and 2^-24: even (0)
static_assert(f32_to_f16_bits(0x1.000002p-25f) == 0x0001);       // just above the tie
static_assert(f32_to_f16_bits(0x1.8p-24f) == 0x0002);            // 1.5 * 2^-24: tie to even (2)
static_assert(f32_to_f16_bits(0x1.4p-24f) == 0x0001);            // 1.25 * 2^-24: down
static_assert(f32_to_f16_bits(0x1p-14f) == 0x0400);              // smallest normal
static_assert(f32_to_f16_bits(0x1.ff8p-15f) == 0x03ff);          // largest subnormal
static_assert(f32_to_f16_bits(0x1.ffcp-15f) == 0x0400);          // tie above it: to even (normal)
static_assert(f32_to_f16_bits(0x1.ffap-15f) == 0x03ff);          // below that tie
static_assert(f32_to_f16_bits(1.0f + 0x1p-11f) == 0x3c00);       // tie: to even (down)
static_assert(f32_to_f16_bits(1.0f + 0x3p-11f) == 0x3c02);       // tie: to even (up)
static_assert(f32_to_f16_bits(1e-30f) == 0x0000);
static_assert(f32_to_f16_bits(-3e38f) == 0xfc00);
static_assert(f16_bits_to_f32(0x0001) == 0x1p-24f);
static_assert(f16_bits_to_f32(0x03ff) == 0x1.ff8p-15f);
static_assert(f16_bits_to_f32(0x3555) == 0x1.554p-2f);
static_assert(f16_bits_to_f32(0x7bff) == 65504.0f);
static_assert(f16_bits_to_f32(0xfc00) == -std::numeric_limits<float>::infinity());
static_assert(std::bit_cast<std::uint32_t>(f16_bits_to_f32(0x8000)) == 0x80000000u);
static_assert(std::bit_cast<std::uint32_t>(f16_bits_to_f32(0x7c01)) == 0x7fc02000u);  // quietened, payload kept
static_assert(kvcache::to_float(kvcache::to_half(0.333251953125f)) == 0.333251953125f);
static_assert(kvcache::to_half(2.0f) == half{0x4000});

// ---- independent reference ---------------------------------------------------------------------

/// Value of a half bit pattern, computed in double from the definition.
double ref_half_value(std::uint16_t h) {
  const int sign = (h >> 15) & 1;
  const int e = (h >> 10) & 0x1f;
  const int m = h & 0x3ff;
  double v;
  if (e == 31) v = m == 0 ? std::numeric_limits<double>::infinity() : std::numeric_limits<double>::quiet_NaN();
  else if (e == 0) v = std::ldexp(static_cast<double>(m), -24);
  else v = std::ldexp(static_cast<double>(1024 + m), e - 25);
  return sign ? -v : v;
}

/// Bits of the half nearest to f (ties to even), computed in double with std::nearbyint.
std::uint16_t ref_to_half(float f) {
  const std::uint32_t fb = std::bit_cast<std::uint32_t>(f);
  const std::uint16_t sign = static_cast<std::uint16_t>((fb >> 16) & 0x8000u);
  if (std::isnan(f)) return static_cast<std::uint16_t>(sign | 0x7e00u | ((fb >> 13) & 0x3ffu));
  const double a = std::fabs(static_cast<double>(f));
  if (std::isinf(f)) return static_cast<std::uint16_t>(sign | 0x7c00u);
  // Quantum of the target binade: 2^-24 below 2^-14 (subnormals), else 2^(floor(log2 a) - 10).
  int exp2 = -14;
  if (a >= 0x1p-14) {
    int e;
    (void)std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
    exp2 = e - 1;
  }
  const double quantum = std::ldexp(1.0, exp2 - 10);
  const double q = std::nearbyint(a / quantum);  // a / quantum is exact (power-of-two divisor)
  const double r = q * quantum;
  if (r >= 65536.0) return static_cast<std::uint16_t>(sign | 0x7c00u);
  // Encode r exactly.
  if (r < 0x1p-14) return static_cast<std::uint16_t>(sign | static_cast<std::uint16_t>(r / 0x1p-24));
  int e;
  (void)std::frexp(r, &e);
  const int unbiased = e - 1;
  const auto mant = static_cast<std::uint32_t>(std::ldexp(r, 10 - unbiased) - 1024.0);
  return static_cast<std::uint16_t>(sign | static_cast<std::uint32_t>(unbiased + 15) << 10 | mant);
}

bool is_nan_bits(std::uint16_t h) { return (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0; }

TEST(half_reference, rounding_mode_is_nearest) { ASSERT_EQ(std::fegetround(), FE_TONEAREST); }

TEST(half, every_half_round_trips) {
  for (std::uint32_t i = 0; i <= 0xffff; ++i) {
    const auto h = static_cast<std::uint16_t>(i);
    const float f = f16_bits_to_f32(h);
    const double ref = ref_half_value(h);
    if (is_nan_bits(h)) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << i;
      EXPECT_EQ(std::signbit(f), (h & 0x8000u) != 0) << std::hex << i;
      const std::uint16_t back = f32_to_f16_bits(f);
      ASSERT_TRUE(is_nan_bits(back)) << std::hex << i;
      EXPECT_EQ(back, h | 0x0200u) << std::hex << i;  // quietened, payload and sign kept
    } else {
      ASSERT_EQ(static_cast<double>(f), ref) << std::hex << i;
      EXPECT_EQ(std::signbit(f), (h & 0x8000u) != 0) << std::hex << i;
      ASSERT_EQ(f32_to_f16_bits(f), h) << std::hex << i;
      ASSERT_EQ(ref_to_half(f), h) << std::hex << i;  // the reference agrees on exact inputs
    }
  }
}

/// Inputs around every rounding boundary: for every finite half h, the value itself, the exact
/// halfway point to its successor and the floats one ulp either side; plus float neighbourhoods of
/// 0, 2^-25, 2^-24, 2^-14, 65504, 65520, and the specials.
std::vector<float> boundary_inputs() {
  std::vector<float> out;
  auto push_around = [&out](float x, int ulps) {
    float lo = x, hi = x;
    out.push_back(x);
    for (int i = 0; i < ulps; ++i) {
      lo = std::nextafter(lo, -std::numeric_limits<float>::infinity());
      hi = std::nextafter(hi, std::numeric_limits<float>::infinity());
      out.push_back(lo);
      out.push_back(hi);
    }
  };
  for (std::uint32_t i = 0; i < 0x7c00; ++i) {
    const double v = ref_half_value(static_cast<std::uint16_t>(i));
    const double next = ref_half_value(static_cast<std::uint16_t>(i + 1));  // 0x7c00 -> inf: 65536 stands in
    const double mid = (v + (std::isinf(next) ? 65536.0 : next)) / 2;       // exact in float
    for (float s : {1.0f, -1.0f}) {
      push_around(s * static_cast<float>(v), 1);
      push_around(s * static_cast<float>(mid), 1);
    }
  }
  for (float x : {0.0f, 0x1p-25f, 0x1p-24f, 0x1.8p-24f, 0x1p-14f, 65504.0f, 65520.0f, 65536.0f})
    for (float s : {1.0f, -1.0f}) push_around(s * x, 2000);
  for (float x : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(),
                  std::numeric_limits<float>::signaling_NaN(), std::numeric_limits<float>::max(),
                  std::numeric_limits<float>::min(), std::numeric_limits<float>::denorm_min()}) {
    out.push_back(x);
    out.push_back(-x);
  }
  out.push_back(std::bit_cast<float>(0x7f800001u));  // NaN with the smallest payload
  out.push_back(std::bit_cast<float>(0xffffe000u));  // NaN with payload in the kept bits
  return out;
}

/// Random floats: a quarter uniform bit patterns, the rest concentrated where halves live.
std::vector<float> random_inputs(std::mt19937& gen, std::size_t n) {
  std::vector<float> out(n);
  std::uniform_int_distribution<std::uint32_t> bits;
  std::uniform_int_distribution<int> exps(-30, 17);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  for (std::size_t i = 0; i < n; ++i) {
    if (i % 4 == 0) {
      out[i] = std::bit_cast<float>(bits(gen));
    } else {
      const float x = std::ldexp(mant(gen), exps(gen));
      out[i] = (bits(gen) & 1u) ? -x : x;
    }
  }
  return out;
}

void check_against_reference(const std::vector<float>& in, const std::string& what) {
  std::size_t bad = 0;
  for (float f : in) {
    const std::uint16_t got = f32_to_f16_bits(f);
    const std::uint16_t want = ref_to_half(f);
    if (got != want && ++bad <= 10)
      ADD_FAILURE() << what << ": " << std::hexfloat << f << " -> 0x" << std::hex << got << ", reference 0x" << want;
    // Round trip of the result is exact (half -> float -> half).
    if (!is_nan_bits(got) && f32_to_f16_bits(f16_bits_to_f32(got)) != got && ++bad <= 10)
      ADD_FAILURE() << what << ": round trip of 0x" << std::hex << got;
  }
  EXPECT_EQ(bad, 0u) << what;
}

TEST(half, rounding_boundaries_match_reference) {
  const std::vector<float> in = boundary_inputs();
  ASSERT_GT(in.size(), 120000u);
  check_against_reference(in, "boundaries");
}

TEST(half, random_floats_match_reference) {
  const std::uint32_t seed = std::random_device{}();
  SCOPED_TRACE("random seed " + std::to_string(seed));
  std::mt19937 gen(seed);
  const std::vector<float> in = random_inputs(gen, std::size_t{4} << 20);
  check_against_reference(in, "random");
}

TEST(half, reference_catches_a_wrong_rounding) {
  // The reference is not a copy of the implementation: it distinguishes ties-to-even from
  // ties-away and from truncation on exactly the inputs the implementation must get right.
  const float tie_down = 1.0f + 0x1p-11f;  // halfway between 0x3c00 and 0x3c01
  EXPECT_EQ(ref_to_half(tie_down), 0x3c00);
  EXPECT_EQ(ref_to_half(std::nextafter(tie_down, 2.0f)), 0x3c01);
  EXPECT_EQ(ref_to_half(1.0f + 0x3p-11f), 0x3c02);
  EXPECT_EQ(ref_to_half(0x1p-25f), 0x0000);
  EXPECT_EQ(ref_to_half(0x1.8p-24f), 0x0002);
  EXPECT_EQ(ref_to_half(65520.0f), 0x7c00);
  EXPECT_EQ(ref_to_half(std::nextafter(65520.0f, 0.0f)), 0x7bff);
}

TEST(half, bulk_kernels_of_every_isa_match) {
  const std::uint32_t seed = std::random_device{}();
  SCOPED_TRACE("random seed " + std::to_string(seed));
  std::mt19937 gen(seed);
  std::vector<float> in = boundary_inputs();
  const std::vector<float> extra = random_inputs(gen, 1u << 20);
  in.insert(in.end(), extra.begin(), extra.end());
  std::vector<half> all(0x10000);
  for (std::uint32_t i = 0; i <= 0xffff; ++i) all[i].bits = static_cast<std::uint16_t>(i);
  for (kvcache::isa which : {kvcache::isa::scalar, kvcache::isa::avx2, kvcache::isa::avx512, kvcache::isa::neon}) {
    const kvcache::kernels::table* t = kvcache::kernels::find(which);
    if (t == nullptr) continue;
    SCOPED_TRACE(std::string(kvcache::to_string(which)));
    // Odd offsets and lengths exercise unaligned heads and ragged tails.
    for (std::size_t off : {std::size_t{0}, std::size_t{3}}) {
      const std::size_t n = in.size() - off - 5;
      std::vector<half> out(n);
      t->f32_to_f16(in.data() + off, out.data(), n);
      std::size_t bad = 0;
      for (std::size_t i = 0; i < n; ++i)
        if (out[i].bits != f32_to_f16_bits(in[off + i]) && ++bad <= 5)
          ADD_FAILURE() << std::hexfloat << in[off + i] << " -> 0x" << std::hex << out[i].bits;
      EXPECT_EQ(bad, 0u);
    }
    std::vector<float> back(all.size() - 1);
    t->f16_to_f32(all.data() + 1, back.data(), back.size());
    for (std::size_t i = 0; i < back.size(); ++i)
      ASSERT_EQ(std::bit_cast<std::uint32_t>(back[i]), std::bit_cast<std::uint32_t>(f16_bits_to_f32(all[i + 1].bits)))
          << std::hex << all[i + 1].bits;
  }
}

}  // namespace
