// Every CPU kernel of every supported ISA against the scalar reference (codecs bit-exact) and
// against float64 references (dot products within a summation-order bound), on fresh random
// inputs at ragged sizes and unaligned pointers. Set KVCACHE_TEST_SEED to replay a failure.
#include <kvcache/format.hpp>
#include <kvcache/half.hpp>
#include <kvcache/isa.hpp>
#include <kvcache/kernels.hpp>

#include <gtest/gtest.h>

#if defined(__x86_64__)
#include <cpuid.h>
#endif
#if defined(__aarch64__)
#include <sys/auxv.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace {

using kvcache::half;
using kvcache::isa;
namespace kernels = kvcache::kernels;

std::uint64_t test_seed() {
  static const std::uint64_t seed = [] {
    if (const char* s = std::getenv("KVCACHE_TEST_SEED")) return static_cast<std::uint64_t>(std::strtoull(s, nullptr, 10));
    return static_cast<std::uint64_t>(std::random_device{}()) << 32 | std::uint64_t{std::random_device{}()};
  }();
  return seed;
}

// Concatenates its arguments with operator<< (for SCOPED_TRACE messages).
template <class... A>
std::string cat(const A&... a) {
  std::ostringstream s;
  (s << ... << a);
  return s.str();
}

#define KVCACHE_SEED_TRACE() SCOPED_TRACE(cat("KVCACHE_TEST_SEED=", test_seed()))

const std::vector<std::size_t> ragged_sizes = {0,  1,  2,  3,   7,   8,   15,  16,  17,  31,  32,
                                               33, 63, 64, 65, 127, 128, 129, 255, 1000, 1031, 4099};
const std::vector<std::uint32_t> head_dims = {8, 16, 32, 64, 80, 96, 128, 256, 3, 24, 40, 100};

std::uint32_t f2u(float f) { std::uint32_t u; std::memcpy(&u, &f, 4); return u; }
float u2f(std::uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

class Kernels : public ::testing::TestWithParam<isa> {
 protected:
  void SetUp() override {
    t_ = kernels::find(GetParam());
    if (t_ == nullptr) GTEST_SKIP() << "ISA " << kvcache::to_string(GetParam()) << " not supported here";
    ref_ = kernels::find(isa::scalar);
    ASSERT_NE(ref_, nullptr);
    ASSERT_EQ(t_->which, GetParam());
  }
  const kernels::table* t_ = nullptr;
  const kernels::table* ref_ = nullptr;
  std::mt19937_64 rng_{test_seed() ^ (static_cast<std::uint64_t>(GetParam()) * 0x9e3779b97f4a7c15ull)};

  float normal(float sd = 1.0f) { return std::normal_distribution<float>(0.0f, sd)(rng_); }
  half rand_half(float sd = 1.0f) { return kvcache::to_half(normal(sd)); }
  // Asserts that other's Q4 kernels give t_'s results bit for bit (see its definition).
  void expect_same_q4_bits(const kernels::table& other);
};

// ---- FP16 conversions ---------------------------------------------------------------------------

TEST_P(Kernels, F16ToF32AllBitPatternsExact) {
  std::vector<half> src(65536 + 1);
  for (std::uint32_t i = 0; i < 65536; ++i) src[i + 1].bits = static_cast<std::uint16_t>(i);
  std::vector<float> got(65536 + 2, 0.0f), want(65536 + 2, 0.0f);
  t_->f16_to_f32(src.data() + 1, got.data() + 1, 65536);  // unaligned source and destination
  ref_->f16_to_f32(src.data() + 1, want.data() + 1, 65536);
  for (std::uint32_t i = 0; i < 65536; ++i) {
    ASSERT_EQ(f2u(got[i + 1]), f2u(want[i + 1])) << "half bits 0x" << std::hex << i;
    ASSERT_EQ(f2u(want[i + 1]), f2u(kvcache::to_float(half{static_cast<std::uint16_t>(i)})));
  }
}

TEST_P(Kernels, F32ToF16SpecialValuesAndTiesExact) {
  std::vector<float> src = {0.0f, -0.0f, std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(),
                            -std::numeric_limits<float>::quiet_NaN(), u2f(0x7f800001u), u2f(0xff800001u),
                            u2f(0x7fa00000u), u2f(0x7fbfffffu), u2f(0x7fc02000u), u2f(0x7fffe000u),
                            u2f(0x00000001u), u2f(0x807fffffu), 65504.0f, 65519.99f, 65520.0f, -65520.0f,
                            1e10f, 5.96e-8f, 2.98e-8f, 2.9802322e-8f, 3.0e-8f, 6.1e-5f};
  // Every finite half, the exact midpoints to its neighbour (ties) and one float ulp around them.
  for (std::uint32_t h = 0; h < 0x7c00u; ++h) {
    const float a = kvcache::to_float(half{static_cast<std::uint16_t>(h)});
    const float b = kvcache::to_float(half{static_cast<std::uint16_t>(h + 1)});
    const float mid = a + (b - a) / 2;  // exact: halves have 11 significant bits
    for (float x : {a, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f)}) {
      src.push_back(x);
      src.push_back(-x);
    }
  }
  std::vector<half> got(src.size() + 1), want(src.size() + 1);
  t_->f32_to_f16(src.data(), got.data() + 1, src.size());
  ref_->f32_to_f16(src.data(), want.data() + 1, src.size());
  for (std::size_t i = 0; i < src.size(); ++i)
    ASSERT_EQ(got[i + 1].bits, want[i + 1].bits) << "float bits 0x" << std::hex << f2u(src[i]);
}

TEST_P(Kernels, F16ConversionsRaggedUnalignedRandomBits) {
  KVCACHE_SEED_TRACE();
  for (std::size_t n : ragged_sizes)
    for (std::size_t off : {0u, 1u}) {
      SCOPED_TRACE(cat("n=", n, " offset=", off));
      std::vector<float> src(n + off + 1);
      for (float& f : src) f = u2f(static_cast<std::uint32_t>(rng_()));
      for (std::size_t i = 0; i < n; i += 3) src[i + off] = normal(100.0f);  // mostly finite
      const half guard{0x5a5a};
      std::vector<half> got(n + off + 2, guard), want(n + off + 2, guard);
      t_->f32_to_f16(src.data() + off, got.data() + off, n);
      ref_->f32_to_f16(src.data() + off, want.data() + off, n);
      for (std::size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i].bits, want[i].bits) << "i=" << i;
      const float fguard = 1234.5f;
      std::vector<float> back(n + off + 2, fguard), back_ref(n + off + 2, fguard);
      t_->f16_to_f32(got.data() + off, back.data() + off, n);
      ref_->f16_to_f32(got.data() + off, back_ref.data() + off, n);
      for (std::size_t i = 0; i < back.size(); ++i) ASSERT_EQ(f2u(back[i]), f2u(back_ref[i])) << "i=" << i;
    }
}

// ---- Q4 codecs -----------------------------------------------------------------------------------

// A Q4 group buffer (format.hpp) placed 2 bytes past a vector's start: 2-byte aligned, as groups
// must be, and misaligned for every vector width; `fill` everywhere, so unwritten bytes show.
struct group_buf {
  std::vector<std::uint8_t> buf;
  explicit group_buf(std::size_t bytes, std::uint8_t fill = 0) : buf(bytes + 2, fill) {}
  std::uint8_t* data() { return buf.data() + 2; }
  [[nodiscard]] const std::uint8_t* data() const { return buf.data() + 2; }
  [[nodiscard]] std::size_t size() const { return buf.size() - 2; }
};
group_buf key_buf(std::uint32_t hd, std::uint8_t fill = 0) { return group_buf(kvcache::q4_key_group_bytes(hd), fill); }
group_buf value_buf(std::uint32_t hd, std::uint8_t fill = 0) { return group_buf(kvcache::q4_value_group_bytes(hd), fill); }

double key_scale(const std::uint8_t* g, std::uint32_t hd, std::uint32_t d) {
  return kvcache::to_float(kvcache::q4_key_scales(g, hd)[d]);
}
double value_scale(const std::uint8_t* g, std::uint32_t hd, std::uint32_t t, std::uint32_t d) {
  return kvcache::to_float(kvcache::q4_value_scales(g, hd)[d / 32 * 32 + t]);
}
// The stored key of channel d, token t (min + scale * code), and |scale * code| + |min| in *mag.
double key_value(const std::uint8_t* g, std::uint32_t hd, std::uint32_t d, std::uint32_t t, double* mag) {
  const double s = key_scale(g, hd, d), m = kvcache::to_float(kvcache::q4_key_mins(g, hd)[d]);
  const double c = kvcache::q4_key_code(g, d, t);
  *mag = std::abs(s * c) + std::abs(m);
  return m + s * c;
}
double value_value(const std::uint8_t* g, std::uint32_t hd, std::uint32_t t, std::uint32_t d, double* mag) {
  const double s = value_scale(g, hd, t, d), m = kvcache::to_float(kvcache::q4_value_mins(g, hd)[d / 32 * 32 + t]);
  const double c = kvcache::q4_value_code(g, t, d);
  *mag = std::abs(s * c) + std::abs(m);
  return m + s * c;
}

// Where two key or value groups differ first: the byte, and which part of the group holds it.
std::string group_diff(const group_buf& a, const group_buf& b, std::uint32_t hd, bool values) {
  const std::size_t scales = values ? kvcache::q4_value_scales_offset(hd) : kvcache::q4_key_scales_offset(hd);
  const std::size_t mins = values ? kvcache::q4_value_mins_offset(hd) : kvcache::q4_key_mins_offset(hd);
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a.data()[i] != b.data()[i]) {
      const char* part = i < scales ? "codes" : i < mins ? "scales" : "mins";
      return cat("byte ", i, " (", part, "): ", int(a.data()[i]), " vs ", int(b.data()[i]));
    }
  return "none";
}
bool same_group(const group_buf& a, const group_buf& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size()) == 0;
}

// Head rows [tokens][stride] of halves, with channel-dependent spread, outlier channels, a
// constant channel and signed zeros, so groups of every shape occur.
std::vector<half> make_rows(std::mt19937_64& rng, std::uint32_t tokens, std::uint32_t hd, std::size_t stride) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<half> rows(tokens * stride + 2, half{0x7e00});  // NaN in the padding: must not be read
  for (std::uint32_t t = 0; t < tokens; ++t)
    for (std::uint32_t d = 0; d < hd; ++d) {
      float x = nd(rng) * (1.0f + static_cast<float>(d % 7));
      if (d % 13 == 5) x = x * 40.0f + 100.0f;  // outlier channel
      if (d % 17 == 3) x = 2.5f;                // constant channel
      if (d % 19 == 4) x = (t % 2) ? 0.0f : -0.0f;
      rows[t * stride + d + 1] = kvcache::to_half(x);  // offset by one element: unaligned
    }
  return rows;
}

// The layout helpers of format.hpp against a direct reading of its layout description.
TEST(Q4Layout, OffsetsAndSizes) {
  EXPECT_EQ(kvcache::q4_key_channels(1), 4u);
  EXPECT_EQ(kvcache::q4_key_channels(128), 128u);
  EXPECT_EQ(kvcache::q4_key_group_bytes(128), 2560u);  // 5 bits per value, all-in
  EXPECT_EQ(kvcache::q4_value_group_bytes(128), 2560u);
  EXPECT_EQ(kvcache::q4_key_group_bytes(3), 80u);
  EXPECT_EQ(kvcache::q4_value_group_bytes(33), 1280u);
  EXPECT_EQ(kvcache::q4_key_scales_offset(100), 1600u);
  EXPECT_EQ(kvcache::q4_key_mins_offset(100), 1800u);
  EXPECT_EQ(kvcache::q4_value_scales_offset(100), 2048u);
  EXPECT_EQ(kvcache::q4_value_mins_offset(100), 2304u);
  // Keys: channel quad c / 4 of 64 bytes, byte j = token j % 16, channel c % 4 inside it.
  EXPECT_EQ(kvcache::q4_key_code_byte(0, 0), 0u);
  EXPECT_EQ(kvcache::q4_key_code_byte(3, 0), 3u);
  EXPECT_EQ(kvcache::q4_key_code_byte(1, 5), 21u);
  EXPECT_EQ(kvcache::q4_key_code_byte(1, 21), 21u);
  EXPECT_EQ(kvcache::q4_key_code_byte(6, 15), 64u + 62u);
  // Values: column c / 32 of 512 bytes, token quad t / 4 of 64, byte j = channel c % 16 of token t % 4.
  EXPECT_EQ(kvcache::q4_value_code_byte(0, 0), 0u);
  EXPECT_EQ(kvcache::q4_value_code_byte(3, 0), 3u);
  EXPECT_EQ(kvcache::q4_value_code_byte(5, 2), 64u + 8u + 1u);
  EXPECT_EQ(kvcache::q4_value_code_byte(5, 18), 64u + 8u + 1u);
  EXPECT_EQ(kvcache::q4_value_code_byte(31, 33), 512u + 7u * 64u + 4u + 3u);
  std::uint8_t g[64] = {};
  g[21] = 0x9a;
  EXPECT_EQ(kvcache::q4_key_code(g, 1, 5), 0xa);
  EXPECT_EQ(kvcache::q4_key_code(g, 1, 21), 0x9);
  g[9] = 0x5c;  // token 1: channel 2 in the low nibble, channel 18 in the high one
  EXPECT_EQ(kvcache::q4_value_code_byte(1, 2), 9u);
  EXPECT_EQ(kvcache::q4_value_code(g, 1, 2), 0xc);
  EXPECT_EQ(kvcache::q4_value_code(g, 1, 18), 0x5);
}

TEST_P(Kernels, QuantizeKeysBitExactWithScalar) {
  KVCACHE_SEED_TRACE();
  for (std::uint32_t hd : head_dims)
    for (std::uint32_t tokens = 1; tokens <= 32; ++tokens) {
      SCOPED_TRACE(cat("head_dim=", hd, " tokens=", tokens));
      const std::size_t stride = hd + (tokens % 3) * 5;
      const std::vector<half> rows = make_rows(rng_, tokens, hd, stride);
      group_buf got = key_buf(hd, 0xab), want = key_buf(hd, 0xcd);  // every byte written: see below
      t_->quantize_keys(rows.data() + 1, stride, tokens, hd, got.data());
      ref_->quantize_keys(rows.data() + 1, stride, tokens, hd, want.data());
      ASSERT_TRUE(same_group(got, want)) << group_diff(got, want, hd, false);
      ASSERT_EQ(got.buf[0], 0xab);
      ASSERT_EQ(got.buf[1], 0xab);
      // Codes of missing tokens and channels, scales and mins of padding channels: 0.
      for (std::uint32_t d = 0; d < kvcache::q4_key_channels(hd); ++d)
        for (std::uint32_t t = d < hd ? tokens : 0; t < 32; ++t) ASSERT_EQ(kvcache::q4_key_code(want.data(), d, t), 0) << d << " " << t;
      for (std::uint32_t d = hd; d < kvcache::q4_key_channels(hd); ++d) {
        ASSERT_EQ(kvcache::q4_key_scales(want.data(), hd)[d].bits, 0);
        ASSERT_EQ(kvcache::q4_key_mins(want.data(), hd)[d].bits, 0);
      }
      // Dequantize, bit-exact too (scale * code is exact), into a strided, unaligned buffer.
      const std::size_t ds = hd + 3;
      std::vector<float> out(tokens * ds + 2, -7.0f), out_ref(tokens * ds + 2, -7.0f);
      t_->dequantize_keys(want.data(), tokens, hd, out.data() + 1, ds);
      ref_->dequantize_keys(want.data(), tokens, hd, out_ref.data() + 1, ds);
      for (std::size_t i = 0; i < out.size(); ++i) ASSERT_EQ(f2u(out[i]), f2u(out_ref[i])) << "i=" << i;
    }
}

TEST_P(Kernels, QuantizeValuesBitExactWithScalar) {
  KVCACHE_SEED_TRACE();
  for (std::uint32_t hd : head_dims)
    for (std::uint32_t tokens : {1u, 2u, 3u, 4u, 5u, 7u, 16u, 17u, 31u, 32u}) {
      SCOPED_TRACE(cat("head_dim=", hd, " tokens=", tokens));
      const std::size_t stride = hd + (tokens % 2) * 9;
      const std::vector<half> rows = make_rows(rng_, tokens, hd, stride);
      group_buf got = value_buf(hd, 0xab), want = value_buf(hd, 0xcd);
      t_->quantize_values(rows.data() + 1, stride, tokens, hd, got.data());
      ref_->quantize_values(rows.data() + 1, stride, tokens, hd, want.data());
      ASSERT_TRUE(same_group(got, want)) << group_diff(got, want, hd, true);
      // Tokens past `tokens` and channels past head_dim: codes, scales and mins 0.
      for (std::uint32_t t = 0; t < 32; ++t)
        for (std::uint32_t d = t < tokens ? hd : 0; d < 32 * kvcache::q4_value_blocks(hd); ++d)
          ASSERT_EQ(kvcache::q4_value_code(want.data(), t, d), 0) << t << " " << d;
      for (std::uint32_t t = tokens; t < 32; ++t)
        for (std::uint32_t g = 0; g < kvcache::q4_value_blocks(hd); ++g) {
          ASSERT_EQ(kvcache::q4_value_scales(want.data(), hd)[g * 32 + t].bits, 0);
          ASSERT_EQ(kvcache::q4_value_mins(want.data(), hd)[g * 32 + t].bits, 0);
        }
      // Dequantize any token range [first, first + n) of the group.
      const std::size_t ds = hd + 1;
      for (std::uint32_t first : {0u, 1u, tokens / 2, tokens - 1}) {
        const std::uint32_t n = tokens - first;
        std::vector<float> out(n * ds + 2, -7.0f), out_ref(n * ds + 2, -7.0f);
        t_->dequantize_values(want.data(), first, n, hd, out.data() + 1, ds);
        ref_->dequantize_values(want.data(), first, n, hd, out_ref.data() + 1, ds);
        for (std::size_t i = 0; i < out.size(); ++i) ASSERT_EQ(f2u(out[i]), f2u(out_ref[i])) << "first=" << first << " i=" << i;
      }
    }
}

// Error against float64: every value within half a step of its reconstruction; RMS reported.
TEST_P(Kernels, Q4ErrorWithinHalfStepAndRms) {
  KVCACHE_SEED_TRACE();
  const std::uint32_t hd = 128, tokens = 32;
  double sq_k = 0, sq_v = 0, sq_x = 0;
  std::size_t n = 0;
  for (int rep = 0; rep < 8; ++rep) {
    const std::vector<half> rows = make_rows(rng_, tokens, hd, hd);
    const half* src = rows.data() + 1;
    group_buf kb = key_buf(hd), vb = value_buf(hd);
    t_->quantize_keys(src, hd, tokens, hd, kb.data());
    t_->quantize_values(src, hd, tokens, hd, vb.data());
    std::vector<float> kd(tokens * hd), vd(tokens * hd);
    t_->dequantize_keys(kb.data(), tokens, hd, kd.data(), hd);
    t_->dequantize_values(vb.data(), 0, tokens, hd, vd.data(), hd);
    for (std::uint32_t t = 0; t < tokens; ++t)
      for (std::uint32_t d = 0; d < hd; ++d) {
        const double x = kvcache::to_float(src[t * hd + d]);
        const double ks = key_scale(kb.data(), hd, d);
        const double vs = value_scale(vb.data(), hd, t, d);
        const double ek = kd[t * hd + d] - x, ev = vd[t * hd + d] - x;
        ASSERT_LE(std::abs(ek), ks / 2 * (1 + 1e-6) + 1e-30) << "key t=" << t << " d=" << d << " x=" << x;
        ASSERT_LE(std::abs(ev), vs / 2 * (1 + 1e-6) + 1e-30) << "value t=" << t << " d=" << d << " x=" << x;
        sq_k += ek * ek;
        sq_v += ev * ev;
        sq_x += x * x;
        ++n;
      }
  }
  const double rms_k = std::sqrt(sq_k / double(n)), rms_v = std::sqrt(sq_v / double(n));
  const double rms_x = std::sqrt(sq_x / double(n));
  std::cout << "[ q4 rms ] " << kvcache::to_string(GetParam()) << ": keys (per channel) rms error " << rms_k
            << ", values (per token) rms error " << rms_v << ", signal rms " << rms_x << "\n";
  RecordProperty("q4_rms_error_keys", std::to_string(rms_k));
  RecordProperty("q4_rms_error_values", std::to_string(rms_v));
  // Outlier channels hurt per-token grouping far more than per-channel grouping.
  EXPECT_LT(rms_k, rms_v);
}

TEST_P(Kernels, Q4ConstantGroupRoundTripsExactly) {
  for (float c : {0.0f, -0.0f, 2.5f, -3.75f, 65504.0f, -65504.0f, 6.0e-8f}) {
    SCOPED_TRACE(cat("value=", c));
    const std::uint32_t hd = 40, tokens = 32;
    std::vector<half> rows(tokens * hd, kvcache::to_half(c));
    group_buf kb = key_buf(hd), vb = value_buf(hd);
    t_->quantize_keys(rows.data(), hd, tokens, hd, kb.data());
    t_->quantize_values(rows.data(), hd, tokens, hd, vb.data());
    for (std::uint32_t d = 0; d < hd; ++d) EXPECT_EQ(key_scale(kb.data(), hd, d), 0.0);
    std::vector<float> kd(tokens * hd), vd(tokens * hd);
    t_->dequantize_keys(kb.data(), tokens, hd, kd.data(), hd);
    t_->dequantize_values(vb.data(), 0, tokens, hd, vd.data(), hd);
    const float want = kvcache::to_float(kvcache::to_half(c));
    for (std::size_t i = 0; i < kd.size(); ++i) {
      ASSERT_EQ(kd[i], want) << "key i=" << i;
      ASSERT_EQ(vd[i], want) << "value i=" << i;
      ASSERT_FALSE(std::isnan(kd[i]) || std::isnan(vd[i]));
    }
  }
}

TEST_P(Kernels, Q4InfinitiesMatchScalarAndNaNIsHarmless) {
  const std::uint32_t hd = 64, tokens = 32;
  std::vector<half> rows = make_rows(rng_, tokens, hd, hd);
  rows[1 + 5 * hd + 3] = half{0x7c00};   // +inf in key channel 3 / value group 0
  rows[1 + 9 * hd + 40] = half{0xfc00};  // -inf in key channel 40 / value group 1
  group_buf kb = key_buf(hd), kr = key_buf(hd), vb = value_buf(hd), vr = value_buf(hd);
  t_->quantize_keys(rows.data() + 1, hd, tokens, hd, kb.data());
  ref_->quantize_keys(rows.data() + 1, hd, tokens, hd, kr.data());
  t_->quantize_values(rows.data() + 1, hd, tokens, hd, vb.data());
  ref_->quantize_values(rows.data() + 1, hd, tokens, hd, vr.data());
  EXPECT_TRUE(same_group(kb, kr)) << group_diff(kb, kr, hd, false);
  EXPECT_TRUE(same_group(vb, vr)) << group_diff(vb, vr, hd, true);
  // NaN inputs: codes are unspecified, but nothing else may change and the channels without NaN
  // must still match the scalar reference.
  rows[1 + 2 * hd + 7] = half{0x7e00};
  t_->quantize_keys(rows.data() + 1, hd, tokens, hd, kb.data());
  ref_->quantize_keys(rows.data() + 1, hd, tokens, hd, kr.data());
  for (std::uint32_t d = 0; d < hd; ++d) {
    if (d == 7) continue;
    for (std::uint32_t t = 0; t < 32; ++t)
      ASSERT_EQ(kvcache::q4_key_code(kb.data(), d, t), kvcache::q4_key_code(kr.data(), d, t)) << "channel " << d;
    ASSERT_EQ(kvcache::q4_key_scales(kb.data(), hd)[d].bits, kvcache::q4_key_scales(kr.data(), hd)[d].bits);
    ASSERT_EQ(kvcache::q4_key_mins(kb.data(), hd)[d].bits, kvcache::q4_key_mins(kr.data(), hd)[d].bits);
  }
}

// ---- attention primitives ------------------------------------------------------------------------

constexpr double eps32 = 1.0 / (1 << 23);

template <class K>
double to_d(K x) {
  if constexpr (std::is_same_v<K, half>) return kvcache::to_float(x);
  else return x;
}

template <class K>
void check_scores_dense(const kernels::table& t, std::mt19937_64& rng, bool f16) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (std::uint32_t hd : head_dims)
    for (std::uint32_t nq : {1u, 2u, 3u, 4u, 5u, 6u, 7u, 8u, 9u, 13u})
      for (std::uint32_t tokens : {0u, 1u, 2u, 3u, 7u, 15u, 16u, 17u, 31u, 33u, 64u, 65u, 129u}) {
        if (hd > 128 && nq > 4 && tokens > 33) continue;  // keep the run time modest
        SCOPED_TRACE(cat("head_dim=", hd, " nq=", nq, " tokens=", tokens));
        std::vector<float> q(nq * hd + 1);
        for (float& x : q) x = nd(rng);
        std::vector<K> k(tokens * hd + 1);
        for (K& x : k) {
          if constexpr (std::is_same_v<K, half>) x = kvcache::to_half(nd(rng) * 3.0f);
          else x = nd(rng) * 3.0f;
        }
        const std::size_t os = tokens + 5;
        const float guard = -12345.0f;
        std::vector<float> out(nq * os + 2, guard);
        // With a prefetch region (the rows a caller reads next: here another buffer, unaligned) the
        // results are bit-identical to those without.
        const std::vector<K> next(tokens * hd + 3);
        const kvcache::kernels::prefetch_region region{next.data() + 1, (next.size() - 1) * sizeof(K)};
        std::vector<float> out_pf(out.size(), guard);
        for (auto [o, pf] : {std::pair{&out, kvcache::kernels::prefetch_region{}}, std::pair{&out_pf, region}}) {
          if (f16) t.scores_f16(q.data() + 1, nq, reinterpret_cast<const half*>(k.data() + 1), tokens, hd, o->data() + 1, os, pf);
          else t.scores_f32(q.data() + 1, nq, reinterpret_cast<const float*>(k.data() + 1), tokens, hd, o->data() + 1, os, pf);
        }
        ASSERT_EQ(0, std::memcmp(out.data(), out_pf.data(), out.size() * sizeof(float))) << "prefetch changed the scores";
        for (std::uint32_t i = 0; i < nq; ++i)
          for (std::size_t tt = 0; tt < os; ++tt) {
            const float got = out[1 + i * os + tt];
            if (tt >= tokens) {
              ASSERT_EQ(got, guard) << "wrote past tokens at i=" << i << " t=" << tt;
              continue;
            }
            double ref = 0, mag = 0;
            for (std::uint32_t d = 0; d < hd; ++d) {
              const double pr = double(q[1 + i * hd + d]) * to_d(k[1 + tt * hd + d]);
              ref += pr;
              mag += std::abs(pr);
            }
            ASSERT_NEAR(got, ref, 2.0 * (hd + 2) * eps32 * mag + 1e-30) << "i=" << i << " t=" << tt;
          }
        ASSERT_EQ(out[0], guard);
        ASSERT_EQ(out.back(), guard);
      }
}

// scores_f16_heads / scores_f32_heads: several heads in one call, with gaps between the heads'
// queries, keys and scores, give exactly what one scores_f16 / scores_f32 call per head gives
// (which check_scores_dense holds to the float64 reference), and write nothing else.
template <class K>
void check_scores_dense_heads(const kernels::table& t, std::mt19937_64& rng, bool f16) {
  ASSERT_TRUE(f16 ? t.scores_f16_heads != nullptr : t.scores_f32_heads != nullptr);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (std::uint32_t hd : head_dims)
    for (std::uint32_t nq : {1u, 3u, 4u, 5u, 8u})
      for (std::uint32_t heads : {1u, 2u, 3u, 8u})
        for (std::uint32_t tokens : {0u, 1u, 3u, 15u, 16u, 17u, 33u}) {
          SCOPED_TRACE(cat("head_dim=", hd, " nq=", nq, " heads=", heads, " tokens=", tokens));
          const std::size_t qs = std::size_t{nq} * hd + 7, ks = std::size_t{tokens} * hd + 5, os = tokens + 3,
                            ohs = nq * os + 11;
          std::vector<float> q(heads * qs + 1);
          for (float& x : q) x = nd(rng);
          std::vector<K> k(heads * ks + 1);
          for (K& x : k) {
            if constexpr (std::is_same_v<K, half>) x = kvcache::to_half(nd(rng) * 3.0f);
            else x = nd(rng) * 3.0f;
          }
          const float guard = -12345.0f;
          std::vector<float> got(heads * ohs + 2, guard), want(got.size(), guard);
          const std::vector<K> next(heads * ks + 3);
          const kvcache::kernels::prefetch_region region{next.data() + 1, (next.size() - 1) * sizeof(K)};
          if (f16)
            t.scores_f16_heads(q.data() + 1, qs, nq, reinterpret_cast<const half*>(k.data() + 1), ks, heads, tokens, hd,
                               got.data() + 1, ohs, os, region);
          else
            t.scores_f32_heads(q.data() + 1, qs, nq, reinterpret_cast<const float*>(k.data() + 1), ks, heads, tokens, hd,
                               got.data() + 1, ohs, os, region);
          for (std::uint32_t h = 0; h < heads; ++h) {
            if (f16)
              t.scores_f16(q.data() + 1 + h * qs, nq, reinterpret_cast<const half*>(k.data() + 1 + h * ks), tokens, hd,
                           want.data() + 1 + h * ohs, os, {});
            else
              t.scores_f32(q.data() + 1 + h * qs, nq, reinterpret_cast<const float*>(k.data() + 1 + h * ks), tokens, hd,
                           want.data() + 1 + h * ohs, os, {});
          }
          ASSERT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float)))
              << "not the scores of one call per head (or a write outside them)";
          for (std::uint32_t h = 0; h < heads; ++h)
            for (std::uint32_t i = 0; i < nq; ++i)
              for (std::size_t tt = tokens; tt < os; ++tt) ASSERT_EQ(got[1 + h * ohs + i * os + tt], guard);
          ASSERT_EQ(got[0], guard);
          ASSERT_EQ(got.back(), guard);
        }
}

// scores_f16_segments / scores_f32_segments: one head's keys in several runs (the head's rows in
// each of a tile's paged blocks: ragged lengths, empty runs, runs apart in memory and in any order
// there) with their scores at offsets of the output rows (with gaps between them) give exactly what
// one scores_f16 / scores_f32 call per run gives (which check_scores_dense holds to the float64
// reference), and write nothing else; the prefetch region is one of several pieces.
template <class K>
void check_scores_dense_segments(const kernels::table& t, std::mt19937_64& rng, bool f16) {
  ASSERT_TRUE(f16 ? t.scores_f16_segments != nullptr : t.scores_f32_segments != nullptr);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (std::uint32_t hd : head_dims)
    for (std::uint32_t nq : {1u, 2u, 3u, 4u, 5u, 6u, 8u, 16u})
      for (std::uint32_t count : {0u, 1u, 2u, 3u, 8u, 16u}) {
        // Runs of 0..33 tokens (16 most often, as paged blocks), and now and then one of 64..79,
        // longer than the kernels' token tile (16 KiB of keys: 64 f16 tokens at head_dim 128),
        // each at a random place in k.
        std::vector<std::uint32_t> len(count), at(count), offset(count);
        std::size_t k_size = 1, width = 0;
        for (std::uint32_t j = 0; j < count; ++j) {
          const std::uint32_t r = static_cast<std::uint32_t>(rng() % 6);
          len[j] = r == 0   ? 0u
                   : r <= 2 ? 16u
                   : r == 5 && rng() % 3 == 0 ? static_cast<std::uint32_t>(64 + rng() % 16)
                                               : static_cast<std::uint32_t>(rng() % 34);
          width += rng() % 3;  // a gap of unused columns before the run's
          offset[j] = static_cast<std::uint32_t>(width);
          width += len[j];
        }
        std::vector<std::uint32_t> order(count);
        for (std::uint32_t j = 0; j < count; ++j) order[j] = j;
        std::shuffle(order.begin(), order.end(), rng);
        for (std::uint32_t j : order) {  // runs in memory in a shuffled order, gaps between them
          k_size += rng() % 5;
          at[j] = static_cast<std::uint32_t>(k_size);
          k_size += static_cast<std::size_t>(len[j]) * hd;
        }
        SCOPED_TRACE(cat("head_dim=", hd, " nq=", nq, " count=", count, " columns=", width));
        std::vector<K> k(k_size + 1);
        for (K& x : k) {
          if constexpr (std::is_same_v<K, half>) x = kvcache::to_half(nd(rng) * 3.0f);
          else x = nd(rng) * 3.0f;
        }
        std::vector<float> q(std::size_t{nq} * hd + 1);
        for (float& x : q) x = nd(rng);
        std::vector<kvcache::kernels::key_segment> segs(count);
        for (std::uint32_t j = 0; j < count; ++j) segs[j] = {k.data() + at[j], len[j], offset[j]};
        const std::size_t os = width + 2;
        const float guard = -12345.0f;
        std::vector<float> got(nq * os + 2, guard), want(got.size(), guard);
        // The prefetch region: three pieces of another buffer, the middle one empty.
        const std::vector<K> next(k_size + 64);
        const kvcache::kernels::prefetch_region more[2] = {{}, {next.data() + k_size / 2, (k_size / 2) * sizeof(K)}};
        const kvcache::kernels::prefetch_region region{next.data() + 1, (k_size / 3) * sizeof(K), more, 2};
        if (f16)
          t.scores_f16_segments(q.data() + 1, nq, segs.data(), count, hd, got.data() + 1, os, region);
        else
          t.scores_f32_segments(q.data() + 1, nq, segs.data(), count, hd, got.data() + 1, os, region);
        for (std::uint32_t j = 0; j < count; ++j) {
          if (f16)
            t.scores_f16(q.data() + 1, nq, reinterpret_cast<const half*>(k.data() + at[j]), len[j], hd,
                         want.data() + 1 + offset[j], os, {});
          else
            t.scores_f32(q.data() + 1, nq, reinterpret_cast<const float*>(k.data() + at[j]), len[j], hd,
                         want.data() + 1 + offset[j], os, {});
        }
        ASSERT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float)))
            << "not the scores of one call per run (or a write outside them)";
        std::size_t written = 0;  // columns outside every run keep the guard
        for (std::uint32_t i = 0; i < nq; ++i)
          for (std::size_t col = 0; col < os; ++col) written += got[1 + i * os + col] != guard;
        std::size_t scored = 0;
        for (std::uint32_t j = 0; j < count; ++j) scored += len[j];
        ASSERT_EQ(written, scored * nq);
      }
}

TEST_P(Kernels, ScoresSegmentsF16) {
  KVCACHE_SEED_TRACE();
  check_scores_dense_segments<half>(*t_, rng_, true);
}
TEST_P(Kernels, ScoresSegmentsF32) {
  KVCACHE_SEED_TRACE();
  check_scores_dense_segments<float>(*t_, rng_, false);
}

TEST_P(Kernels, ScoresHeadsF16) {
  KVCACHE_SEED_TRACE();
  check_scores_dense_heads<half>(*t_, rng_, true);
}
TEST_P(Kernels, ScoresHeadsF32) {
  KVCACHE_SEED_TRACE();
  check_scores_dense_heads<float>(*t_, rng_, false);
}

TEST_P(Kernels, ScoresF16) {
  KVCACHE_SEED_TRACE();
  check_scores_dense<half>(*t_, rng_, true);
}
TEST_P(Kernels, ScoresF32) {
  KVCACHE_SEED_TRACE();
  check_scores_dense<float>(*t_, rng_, false);
}
// AVX-512: the dense score kernels of the other vector width than this CPU's table has (512-bit,
// or 256-bit on AMD Zen 4), so that both are tested on any AVX-512 machine.
TEST_P(Kernels, ScoresOtherWidth) {
  KVCACHE_SEED_TRACE();
  const kernels::table* other = kernels::find_other_score_width(GetParam());
  if (GetParam() != isa::avx512) {
    EXPECT_EQ(other, nullptr);
    GTEST_SKIP() << "this ISA has one width of dense score kernels";
  }
  ASSERT_NE(other, nullptr);
  EXPECT_NE(other->scores_f16, t_->scores_f16);
  EXPECT_NE(other->scores_f32, t_->scores_f32);
  EXPECT_NE(other->scores_f16_heads, t_->scores_f16_heads);
  EXPECT_NE(other->scores_f32_heads, t_->scores_f32_heads);
  EXPECT_NE(other->scores_f16_segments, t_->scores_f16_segments);
  EXPECT_NE(other->scores_f32_segments, t_->scores_f32_segments);
  EXPECT_EQ(other->accumulate_f16, t_->accumulate_f16);
  check_scores_dense<half>(*other, rng_, true);
  check_scores_dense<float>(*other, rng_, false);
  check_scores_dense_heads<half>(*other, rng_, true);
  check_scores_dense_heads<float>(*other, rng_, false);
  check_scores_dense_segments<half>(*other, rng_, true);
  check_scores_dense_segments<float>(*other, rng_, false);
}

template <class V>
void check_accumulate_dense(const kernels::table& t, std::mt19937_64& rng, bool f16) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (std::uint32_t hd : head_dims)
    for (std::uint32_t nq : {1u, 2u, 3u, 4u, 5u, 6u, 7u, 8u, 9u, 13u})
      for (std::uint32_t tokens : {0u, 1u, 2u, 3u, 7u, 16u, 17u, 33u, 65u, 300u}) {
        if (hd > 128 && nq > 4 && tokens > 33) continue;
        SCOPED_TRACE(cat("head_dim=", hd, " nq=", nq, " tokens=", tokens));
        const std::size_t ps = tokens + 3;
        std::vector<float> p(nq * ps + 1);
        for (float& x : p) x = std::abs(nd(rng));
        std::vector<V> v(tokens * hd + 1);
        for (V& x : v) {
          if constexpr (std::is_same_v<V, half>) x = kvcache::to_half(nd(rng));
          else x = nd(rng);
        }
        std::vector<float> acc(nq * hd + 2);
        for (float& x : acc) x = nd(rng);
        const std::vector<float> acc0 = acc;
        const std::vector<V> next(tokens * hd + 3);  // the prefetch region: see check_scores_dense
        const kvcache::kernels::prefetch_region region{next.data() + 1, (next.size() - 1) * sizeof(V)};
        std::vector<float> acc_pf = acc;
        for (auto [a, pf] : {std::pair{&acc, kvcache::kernels::prefetch_region{}}, std::pair{&acc_pf, region}}) {
          if (f16) t.accumulate_f16(p.data() + 1, ps, nq, reinterpret_cast<const half*>(v.data() + 1), tokens, hd, a->data() + 1, pf);
          else t.accumulate_f32(p.data() + 1, ps, nq, reinterpret_cast<const float*>(v.data() + 1), tokens, hd, a->data() + 1, pf);
        }
        ASSERT_EQ(0, std::memcmp(acc.data(), acc_pf.data(), acc.size() * sizeof(float))) << "prefetch changed the sums";
        ASSERT_EQ(acc[0], acc0[0]);
        ASSERT_EQ(acc.back(), acc0.back());
        for (std::uint32_t i = 0; i < nq; ++i)
          for (std::uint32_t d = 0; d < hd; ++d) {
            double ref = acc0[1 + i * hd + d], mag = std::abs(ref);
            for (std::uint32_t tt = 0; tt < tokens; ++tt) {
              const double pr = double(p[1 + i * ps + tt]) * to_d(v[1 + tt * hd + d]);
              ref += pr;
              mag += std::abs(pr);
            }
            ASSERT_NEAR(acc[1 + i * hd + d], ref, 2.0 * (tokens + 2) * eps32 * mag + 1e-30) << "i=" << i << " d=" << d;
          }
      }
}

TEST_P(Kernels, AccumulateF16) {
  KVCACHE_SEED_TRACE();
  check_accumulate_dense<half>(*t_, rng_, true);
}
TEST_P(Kernels, AccumulateF32) {
  KVCACHE_SEED_TRACE();
  check_accumulate_dense<float>(*t_, rng_, false);
}

// The tables of this test's ISA, one per Q4 kernel set it has here, the fastest last (AVX-512:
// float, and int8 where the CPU has VNNI: without VBMI, then with it where the CPU has VBMI too;
// AVX2: float, int8 on vpmaddubsw, and int8 on vpdpbusd where the CPU has AVX-VNNI).
std::vector<const kernels::table*> q4_tables(isa i) {
  std::vector<const kernels::table*> r;
  if (const kernels::table* t = kernels::find(i, kernels::q4_arith::float32)) r.push_back(t);
  for (const kernels::table* plain : {kernels::find_without_vnni(i), kernels::find_without_vbmi(i)})
    if (plain != nullptr && plain != kernels::find(i)) r.push_back(plain);
  if (const kernels::table* t = kernels::find(i, kernels::q4_arith::int8); t != nullptr && (r.empty() || r.back() != t))
    r.push_back(t);
  return r;
}

// Error bound of the int8 keys (kernels.hpp, q4_arith::int8), per channel d of a token with code
// c_d, in units of max_d |x_d| (x_d = q_d s_d): one int8 value per channel, with the rounding
// error's share common to all tokens added back, leaves at most 1 / 254 times |c_d - 8|.
constexpr double int8_single = 1.0 / 254.0;

TEST_P(Kernels, ScoresQ4) {
  KVCACHE_SEED_TRACE();
  // Past 256 channels the int8 kernels work in chunks of 256 and re-read the scales: 300, 520.
  std::vector<std::uint32_t> dims = head_dims;
  dims.insert(dims.end(), {300u, 520u, 16400u});  // 16400: past the int8 keys' widest head (float there)
  for (const kernels::table* t : q4_tables(GetParam()))
  for (std::uint32_t hd : dims)
    for (std::uint32_t nq : {1u, 2u, 3u, 4u, 5u, 8u, 9u})
      for (std::uint32_t tokens = 1; tokens <= 32; ++tokens) {
        if (nq > 2 && tokens % 4 != 1 && tokens < 30) continue;  // keep the run time modest
        if (hd > 256 && (nq % 4 == 0 || tokens % 8 != 1)) continue;
        if (hd > 4096 && (nq != 1 || tokens != 32)) continue;
        const bool int8 = t->q4 == kernels::q4_arith::int8;
        SCOPED_TRACE(cat("head_dim=", hd, " nq=", nq, " tokens=", tokens, " int8=", int8));
        const std::vector<half> rows = make_rows(rng_, tokens, hd, hd);
        group_buf kb = key_buf(hd);
        ref_->quantize_keys(rows.data() + 1, hd, tokens, hd, kb.data());  // group misaligned too
        std::vector<float> q(nq * hd + 1);
        for (float& x : q) x = normal();
        const std::size_t os = 37;
        const float guard = -999.0f;
        std::vector<float> out(nq * os + 1, guard);
        // With a prefetch region (another group, unaligned) the scores are bit-identical.
        const group_buf next = key_buf(hd + 4);
        const kvcache::kernels::prefetch_region region{next.data() + 1, kvcache::q4_key_group_bytes(hd) + 3};
        std::vector<float> out_pf(out.size(), guard);
        t->scores_q4(q.data() + 1, nq, kb.data(), tokens, hd, out.data(), os, {});
        t->scores_q4(q.data() + 1, nq, kb.data(), tokens, hd, out_pf.data(), os, region);
        ASSERT_EQ(0, std::memcmp(out.data(), out_pf.data(), out.size() * sizeof(float))) << "prefetch changed the scores";
        for (std::uint32_t i = 0; i < nq; ++i) {
          double qmax = 0;  // max |q_d s_d|: the int8 split's operand
          for (std::uint32_t d = 0; d < hd; ++d)
            qmax = std::max(qmax, std::abs(q[1 + i * hd + d] * key_scale(kb.data(), hd, d)));
          for (std::uint32_t tt = 0; tt < os; ++tt) {
            const float got = out[i * os + tt];
            if (tt >= tokens) {
              ASSERT_EQ(got, guard) << "wrote past tokens at i=" << i << " t=" << tt;
              continue;
            }
            double ref = 0, mag = 0, centred = 0, xsum = 0;
            for (std::uint32_t d = 0; d < hd; ++d) {
              double m;
              const double kv = key_value(kb.data(), hd, d, tt, &m);
              ref += q[1 + i * hd + d] * kv;
              mag += std::abs(q[1 + i * hd + d]) * m;
              centred += std::abs(kvcache::q4_key_code(kb.data(), d, tt) - 8);
              xsum += std::abs(q[1 + i * hd + d] * key_scale(kb.data(), hd, d));
            }
            // The share added back is rounded in float too: 8 (hd + 2) eps sum |x|.
            const double int8_tol = qmax * int8_single * centred + 8.0 * (hd + 2) * eps32 * xsum;
            const double tol = 3.0 * (hd + 2) * eps32 * mag + (int8 ? int8_tol : 0.0) + 1e-30;
            ASSERT_NEAR(got, ref, tol) << "i=" << i << " t=" << tt;
          }
        }
      }
}

TEST_P(Kernels, AccumulateQ4) {
  KVCACHE_SEED_TRACE();
  for (const kernels::table* t : q4_tables(GetParam()))
  for (std::uint32_t hd : head_dims)
    for (std::uint32_t nq : {1u, 2u, 3u, 4u, 5u, 8u, 9u})
      for (std::uint32_t tokens : {0u, 1u, 2u, 3u, 4u, 7u, 8u, 15u, 16u, 17u, 31u, 32u})
        for (std::uint32_t first : {0u, 1u, 3u, 4u, 13u}) {  // tokens [first, first + tokens) of the group
          if (first + tokens > 32 || (first != 0 && nq % 4 == 0)) continue;
          SCOPED_TRACE(cat("head_dim=", hd, " nq=", nq, " tokens=", tokens, " first=", first, " q4_arith=",
                           static_cast<int>(t->q4)));
          const std::uint32_t nb = kvcache::q4_value_blocks(hd);
          // A full group; the tokens outside [first, first + tokens) get garbage scales and minimums
          // (NaN, infinities, huge values: a truncated token's may be anything), which must not
          // reach the sums, not even multiplied by a zero weight.
          const std::vector<half> rows = make_rows(rng_, 32, hd, hd);
          group_buf vb = value_buf(hd);
          ref_->quantize_values(rows.data() + 1, hd, 32, hd, vb.data());
          auto* scales = reinterpret_cast<half*>(vb.data() + kvcache::q4_value_scales_offset(hd));
          auto* mins = reinterpret_cast<half*>(vb.data() + kvcache::q4_value_mins_offset(hd));
          for (std::uint32_t tt = 0; tt < 32; ++tt)
            if (tt < first || tt >= first + tokens)
              for (std::uint32_t g = 0; g < nb; ++g) {
                const std::uint16_t garbage[] = {0x7e00, 0x7c00, 0xfc00, 0x7bff};  // NaN, +inf, -inf, 65504
                scales[g * 32 + tt] = half{garbage[(tt + g) % 4]};
                mins[g * 32 + tt] = half{garbage[(tt + g + 1) % 4]};
              }
          const std::size_t ps = tokens + 1;
          std::vector<float> p(nq * ps + 1);
          for (float& x : p) x = std::abs(normal());
          std::vector<float> acc(nq * hd + 2);
          for (float& x : acc) x = normal();
          const std::vector<float> acc0 = acc;
          const group_buf next = value_buf(hd + 32);  // prefetch region: see ScoresQ4
          const kvcache::kernels::prefetch_region region{next.data() + 1, kvcache::q4_value_group_bytes(hd) + 3};
          std::vector<float> acc_pf = acc;
          t->accumulate_q4(p.data() + 1, ps, nq, vb.data(), first, tokens, hd, acc.data() + 1, {});
          t->accumulate_q4(p.data() + 1, ps, nq, vb.data(), first, tokens, hd, acc_pf.data() + 1, region);
          ASSERT_EQ(0, std::memcmp(acc.data(), acc_pf.data(), acc.size() * sizeof(float))) << "prefetch changed the sums";
          ASSERT_EQ(acc[0], acc0[0]);
          ASSERT_EQ(acc.back(), acc0.back());
          // int8 values where the table has them (every head_dim: kernels.hpp, q4_arith::int8).
          const bool int8 = t->q4_values == kernels::q4_arith::int8;
          for (std::uint32_t i = 0; i < nq; ++i)
            for (std::uint32_t d = 0; d < hd; ++d) {
              double ref = acc0[1 + i * hd + d], mag = std::abs(ref);
              // The int8 bound: u8 weights on a grid of max p * max scale / 255, each off by at
              // most half a step (and a little float rounding), times |code - 8|.
              double pmax = 0, smax = 0, centred = 0;
              for (std::uint32_t r = 0; r < tokens; ++r) {
                const std::uint32_t tt = first + r;
                double m;
                const double vv = value_value(vb.data(), hd, tt, d, &m);
                const double pt = p[1 + i * ps + r], st = value_scale(vb.data(), hd, tt, d);
                ref += pt * vv;
                mag += pt * (m + 16.0 * st);  // int8: also |s (c - 8)| and |m + 8 s|
                pmax = std::max(pmax, pt);
                smax = std::max(smax, st);
                centred += std::abs(kvcache::q4_value_code(vb.data(), tt, d) - 8.0);
              }
              const double weights = (0.5 + 1e-4) * pmax * smax / 255.0 * centred;
              const double tol = 3.0 * (tokens + 2) * eps32 * mag + (int8 ? weights : 0.0) + 1e-30;
              ASSERT_NEAR(acc[1 + i * hd + d], ref, tol) << "i=" << i << " d=" << d;
            }
        }
}

// The fused online-softmax step (table::attend_q4, where a table has one) over a list of Q4
// groups against the same steps in float64 on the table's own scores (scores_q4 is tested above)
// and the stored values: the running max exactly, the running sum to float rounding, the
// accumulators within the int8 weights' bound (as in AccumulateQ4) of the rescaled old ones plus
// the new sums. The kernel takes the groups with tokens two at a time as one tile, whose int8
// weights share one grid: the bound is summed tile by tile, each with its own largest weight and
// value scale.
TEST_P(Kernels, AttendQ4StepMatchesItsParts) {
  KVCACHE_SEED_TRACE();
  bool any = false;
  // Token counts of the groups of one call: one group; pairs, full or ragged either side; an
  // empty group between two (skipped: the other two are one tile); a pair and a last one alone.
  std::vector<std::vector<std::uint32_t>> lists;
  for (std::uint32_t tokens : {1u, 2u, 7u, 16u, 17u, 31u, 32u}) lists.push_back({tokens});
  for (std::uint32_t tokens : {1u, 17u, 32u}) {
    lists.push_back({32, tokens});
    lists.push_back({tokens, 32});
  }
  lists.push_back({32, 0, 9});
  lists.push_back({32, 32, 32});
  lists.push_back({0});
  for (const kernels::table* t : q4_tables(GetParam())) {
    if (t->attend_q4 == nullptr) continue;
    any = true;
    std::vector<std::uint32_t> dims = head_dims;
    dims.push_back(16400);  // keys past the int8 kernel's widest head (see ScoresQ4)
    for (std::uint32_t hd : dims)
      for (std::uint32_t nq : {1u, 2u, 3u, 4u, 5u, 8u, 9u})
        for (const std::vector<std::uint32_t>& list : lists)
          for (int state = 0; state < 3; ++state) {  // first group; max grows; max stays
            const std::size_t n = list.size();
            if (hd > 4096 && (nq != 4 || list != std::vector<std::uint32_t>{32, 17} || state != 1)) continue;
            if (hd > 128 && n > 1 && nq != 4 && nq != 5) continue;
            SCOPED_TRACE(cat("head_dim=", hd, " nq=", nq, " groups=", n, " first=", list[0],
                             " last=", list.back(), " state=", state));
            std::vector<group_buf> kbs, vbs;
            kbs.reserve(n);
            vbs.reserve(n);
            std::vector<float> q(nq * hd + 1);
            for (float& x : q) x = normal();
            std::vector<std::vector<float>> s(n, std::vector<float>(nq * 32));
            std::vector<kernels::q4_group_ref> refs(n);
            for (std::size_t j = 0; j < n; ++j) {
              const std::uint32_t tokens = list[j];
              const std::vector<half> krows = make_rows(rng_, 32, hd, hd), vrows = make_rows(rng_, 32, hd, hd);
              kbs.push_back(key_buf(hd));
              vbs.push_back(value_buf(hd));
              if (tokens > 0) ref_->quantize_keys(krows.data() + 1, hd, tokens, hd, kbs[j].data());
              // Values of all 32 tokens: those past `tokens` are stale and must not count.
              ref_->quantize_values(vrows.data() + 1, hd, 32, hd, vbs[j].data());
              if (tokens > 0) t->scores_q4(q.data() + 1, nq, kbs[j].data(), tokens, hd, s[j].data(), 32, {});
              refs[j] = {kbs[j].data(), vbs[j].data(), tokens};
            }
            std::vector<float> run_max(nq + 2), run_sum(nq + 2), acc(nq * hd + 2);
            for (std::uint32_t i = 0; i < nq; ++i) {
              float top = -std::numeric_limits<float>::infinity();
              for (std::size_t j = 0; j < n; ++j)
                for (std::uint32_t tt = 0; tt < list[j]; ++tt) top = std::max(top, s[j][i * 32 + tt]);
              const bool none = top == -std::numeric_limits<float>::infinity();
              run_max[1 + i] = state == 0 ? -std::numeric_limits<float>::infinity()
                               : none     ? normal()
                               : state == 1 ? top - 3.0f
                                            : top + 2.0f;
              run_sum[1 + i] = state == 0 ? 0.0f : 1.0f + std::abs(normal());
            }
            for (std::uint32_t j = 0; j < nq * hd; ++j) acc[1 + j] = state == 0 ? 0.0f : normal();
            const std::vector<float> max0 = run_max, sum0 = run_sum, acc0 = acc;
            // Ahead groups (q4_group_ref::ahead_k, ahead_v: only prefetched). State 1: every
            // group's in one run of [key group][value group] slots, as the two-tier store lays out
            // a head's groups, which the AVX2 and NEON steps spread over their rows (builds with
            // assertions check that every row counted takes its share); state 2: the groups
            // themselves in reverse, apart. The results must be those of no ahead groups, bit
            // for bit.
            const std::size_t kgb = kvcache::q4_key_group_bytes(hd), vgb = kvcache::q4_value_group_bytes(hd);
            std::vector<std::uint8_t> run_store(n * (kgb + vgb), 0x5A);
            std::vector<kernels::q4_group_ref> plain_refs = refs;
            for (std::size_t j = 0; j < n; ++j) {
              if (state == 1) {
                refs[j].ahead_k = run_store.data() + j * (kgb + vgb);
                refs[j].ahead_v = refs[j].ahead_k + kgb;
              } else if (state == 2) {
                refs[j].ahead_k = kbs[n - 1 - j].data();
                refs[j].ahead_v = vbs[n - 1 - j].data();
              }
            }
            std::vector<float> run_max2 = run_max, run_sum2 = run_sum, acc2 = acc;
            t->attend_q4(q.data() + 1, nq, refs.data(), static_cast<std::uint32_t>(n), hd, run_max.data() + 1,
                         run_sum.data() + 1, acc.data() + 1);
            t->attend_q4(q.data() + 1, nq, plain_refs.data(), static_cast<std::uint32_t>(n), hd, run_max2.data() + 1,
                         run_sum2.data() + 1, acc2.data() + 1);
            ASSERT_EQ(run_max, run_max2) << "ahead groups changed the maxima";
            ASSERT_EQ(run_sum, run_sum2) << "ahead groups changed the sums";
            ASSERT_EQ(acc, acc2) << "ahead groups changed the value sums";
            ASSERT_EQ(run_max[0], max0[0]);
            ASSERT_EQ(run_max.back(), max0.back());
            ASSERT_EQ(acc[0], acc0[0]);
            ASSERT_EQ(acc.back(), acc0.back());
            // The tiles as the kernel takes them: groups with tokens, two at a time.
            std::vector<std::vector<std::size_t>> tiles;
            for (std::size_t j = 0; j < n; ++j) {
              if (list[j] == 0) continue;
              if (tiles.empty() || tiles.back().size() == 2) tiles.emplace_back();
              tiles.back().push_back(j);
            }
            const bool int8 = t->q4_values == kernels::q4_arith::int8;
            for (std::uint32_t i = 0; i < nq; ++i) {
              double m = max0[1 + i];
              for (std::size_t j = 0; j < n; ++j)
                for (std::uint32_t tt = 0; tt < list[j]; ++tt) m = std::max<double>(m, s[j][i * 32 + tt]);
              ASSERT_EQ(run_max[1 + i], static_cast<float>(m)) << "i=" << i;
              const double corr = state == 0 ? 0.0 : std::exp2(max0[1 + i] - m);
              double wsum = 0;
              for (std::size_t j = 0; j < n; ++j)
                for (std::uint32_t tt = 0; tt < list[j]; ++tt) wsum += std::exp2(s[j][i * 32 + tt] - m);
              const double want_sum = sum0[1 + i] * corr + wsum;
              // The step's weights are 2^x to 7.5e-5 relative (exp2_weights): float rounding aside,
              // their sum is within 7.5e-5 of it as well.
              ASSERT_NEAR(run_sum[1 + i], want_sum, 1e-4 * want_sum + 1e-30) << "i=" << i;
              for (std::uint32_t d = 0; d < hd; ++d) {
                double ref = acc0[1 + i * hd + d] * corr, mag = std::abs(ref), bound = 0;
                for (const std::vector<std::size_t>& tile : tiles) {
                  double wmax = 0, smax = 0, centred = 0;
                  for (std::size_t j : tile)
                    for (std::uint32_t tt = 0; tt < list[j]; ++tt) {
                      const double w = std::exp2(s[j][i * 32 + tt] - m);
                      double cm;
                      const double vv = value_value(vbs[j].data(), hd, tt, d, &cm);
                      const double st = value_scale(vbs[j].data(), hd, tt, d);
                      ref += w * vv;
                      mag += w * (cm + 16.0 * st);
                      wmax = std::max(wmax, w);
                      smax = std::max(smax, st);
                      centred += std::abs(kvcache::q4_value_code(vbs[j].data(), tt, d) - 8.0);
                    }
                  bound += (0.5 + 1e-4) * wmax * smax / 255.0 * centred;
                }
                // The weights carry their exp2's error (7.5e-5 relative, exp2_weights) besides
                // their rounding to the grid.
                const double tol = 1e-4 * mag + (int8 ? bound : 0.0) + 1e-30;
                ASSERT_NEAR(acc[1 + i * hd + d], ref, tol) << "i=" << i << " d=" << d;
              }
            }
          }
  }
  if (!any) GTEST_SKIP() << "no table of this ISA has a fused Q4 step on this CPU";
}

// The int8 arithmetic is chosen wherever the CPU has it, and find(isa, arith) gives both.
TEST_P(Kernels, Q4ArithmeticVariants) {
  const std::vector<const kernels::table*> ts = q4_tables(GetParam());
  ASSERT_FALSE(ts.empty());
  EXPECT_EQ(ts.back(), t_) << "find(isa) is not the fastest Q4 arithmetic";
  for (const kernels::table* t : ts) EXPECT_EQ(t->which, GetParam());
  if (GetParam() == isa::scalar) {
    EXPECT_EQ(ts.size(), 1u) << "the scalar table has only the float Q4 path";
  }
#if defined(__aarch64__)
  if (GetParam() == isa::neon) {
    // int8 (sdot, udot) where the CPU has FEAT_DotProd: HWCAP_ASIMDDP, bit 20 of AT_HWCAP.
    const bool dotprod = (getauxval(AT_HWCAP) & (1ul << 20)) != 0;
    EXPECT_EQ(t_->q4 == kernels::q4_arith::int8, dotprod);
    EXPECT_EQ(t_->q4_values == kernels::q4_arith::int8, dotprod);
    EXPECT_EQ(ts.size(), dotprod ? 2u : 1u);
  }
#endif
#if defined(__x86_64__)
  if (GetParam() == isa::avx512) {
    // int8 wherever the CPU has AVX-512 VNNI; the kernels without VBMI where it lacks VBMI.
    __builtin_cpu_init();
    const bool vnni = __builtin_cpu_supports("avx512vnni"), vbmi = __builtin_cpu_supports("avx512vbmi");
    EXPECT_EQ(t_->q4 == kernels::q4_arith::int8, vnni);
    EXPECT_EQ(t_->q4_values == kernels::q4_arith::int8, vnni);
    const kernels::table* plain = kernels::find_without_vbmi(isa::avx512);
    EXPECT_EQ(plain != nullptr, vnni);
    EXPECT_EQ(ts.size(), vnni ? (vbmi ? 3u : 2u) : 1u);  // float, without VBMI, with VBMI
    if (plain != nullptr) {
      EXPECT_EQ(plain->q4, kernels::q4_arith::int8);
      EXPECT_EQ(plain->q4_values, kernels::q4_arith::int8);
      EXPECT_EQ(plain == t_, !vbmi);
      EXPECT_EQ(t_->attend_q4 == plain->attend_q4, !vbmi);
      EXPECT_EQ(plain->scores_f16, t_->scores_f16) << "the table without VBMI differs in more than its Q4 kernels";
    }
  }
  if (GetParam() == isa::avx2) {
    // int8 on every AVX2 CPU; the kernels without VNNI where it lacks AVX-VNNI.
    unsigned a = 0, b = 0, c = 0, d = 0;
    const bool avx_vnni = __get_cpuid_count(7, 1, &a, &b, &c, &d) != 0 && (a & (1u << 4)) != 0;
    EXPECT_EQ(t_->q4, kernels::q4_arith::int8);
    EXPECT_EQ(t_->q4_values, kernels::q4_arith::int8);
    const kernels::table* plain = kernels::find_without_vnni(isa::avx2);
    ASSERT_NE(plain, nullptr);
    EXPECT_EQ(plain->q4, kernels::q4_arith::int8);
    EXPECT_EQ(plain->q4_values, kernels::q4_arith::int8);
    EXPECT_EQ(plain == t_, !avx_vnni);
    EXPECT_EQ(t_->scores_q4 == plain->scores_q4, !avx_vnni);
    EXPECT_EQ(t_->accumulate_q4 == plain->accumulate_q4, !avx_vnni);
  }
#endif
  if (GetParam() != isa::avx2) {
    EXPECT_EQ(kernels::find_without_vnni(GetParam()), nullptr);
  }
  if (GetParam() != isa::avx512) {
    EXPECT_EQ(kernels::find_without_vbmi(GetParam()), nullptr);
  }
}

// Scores, value sums and fused steps of other's Q4 kernels against t_'s, bit for bit: on fresh
// random groups, every token count and range, ragged head_dims.
void Kernels::expect_same_q4_bits(const kernels::table& other) {
  const kernels::table* plain = &other;
  for (std::uint32_t hd : {1u, 4u, 31u, 32u, 33u, 64u, 100u, 128u, 256u, 300u})
    for (std::uint32_t nq : {1u, 2u, 3u, 4u, 5u})
      for (std::uint32_t tokens : {1u, 3u, 8u, 16u, 17u, 31u, 32u}) {
        SCOPED_TRACE(cat("head_dim=", hd, " nq=", nq, " tokens=", tokens));
        const std::vector<half> rows = make_rows(rng_, 32, hd, hd);
        group_buf kb = key_buf(hd), vb = value_buf(hd);
        ref_->quantize_keys(rows.data() + 1, hd, tokens, hd, kb.data());
        ref_->quantize_values(rows.data() + 1, hd, 32, hd, vb.data());
        std::vector<float> q(nq * hd);
        for (float& x : q) x = normal();
        const std::size_t os = 33;
        std::vector<float> a(nq * os, -1.0f), b = a;
        t_->scores_q4(q.data(), nq, kb.data(), tokens, hd, a.data(), os, {});
        plain->scores_q4(q.data(), nq, kb.data(), tokens, hd, b.data(), os, {});
        ASSERT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float))) << "scores differ";
        const std::uint32_t first = tokens == 32 ? 0 : static_cast<std::uint32_t>(rng_() % (33 - tokens));
        std::vector<float> p(nq * tokens);
        for (float& x : p) x = std::abs(normal());
        std::vector<float> acc(nq * hd);
        for (float& x : acc) x = normal();
        std::vector<float> acc2 = acc;
        t_->accumulate_q4(p.data(), tokens, nq, vb.data(), first, tokens, hd, acc.data(), {});
        plain->accumulate_q4(p.data(), tokens, nq, vb.data(), first, tokens, hd, acc2.data(), {});
        ASSERT_EQ(0, std::memcmp(acc.data(), acc2.data(), acc.size() * sizeof(float))) << "value sums differ, first=" << first;
        // The fused step over this group alone and as the second of a pair (one tile, one grid):
        // the same integer sums, widened group by group without VNNI.
        if (t_->attend_q4 == nullptr || plain->attend_q4 == nullptr) continue;
        const std::vector<half> rows2 = make_rows(rng_, 32, hd, hd);
        group_buf kb2 = key_buf(hd), vb2 = value_buf(hd);
        ref_->quantize_keys(rows2.data() + 1, hd, 32, hd, kb2.data());
        ref_->quantize_values(rows2.data() + 1, hd, 32, hd, vb2.data());
        const kernels::q4_group_ref groups[2] = {{kb2.data(), vb2.data(), 32}, {kb.data(), vb.data(), tokens}};
        for (std::uint32_t count : {1u, 2u}) {
          std::vector<float> m1(nq), s1(nq), m2, s2;
          for (std::uint32_t i = 0; i < nq; ++i) {
            m1[i] = normal();
            s1[i] = 1.0f + std::abs(normal());
          }
          m2 = m1;
          s2 = s1;
          acc2 = acc;
          std::vector<float> acc1 = acc;
          const kernels::q4_group_ref* gs = count == 1 ? groups + 1 : groups;
          t_->attend_q4(q.data(), nq, gs, count, hd, m1.data(), s1.data(), acc1.data());
          plain->attend_q4(q.data(), nq, gs, count, hd, m2.data(), s2.data(), acc2.data());
          ASSERT_EQ(0, std::memcmp(m1.data(), m2.data(), nq * sizeof(float))) << "fused step maxima differ, groups=" << count;
          ASSERT_EQ(0, std::memcmp(s1.data(), s2.data(), nq * sizeof(float))) << "fused step sums differ, groups=" << count;
          ASSERT_EQ(0, std::memcmp(acc1.data(), acc2.data(), acc1.size() * sizeof(float)))
              << "fused step value sums differ, groups=" << count;
        }
      }
}

// The int8 Q4 kernels without VNNI (AVX2: vpmaddubsw, for CPUs without AVX-VNNI) sum the same
// integers as the VNNI ones (high nibbles shifted down rather than left in place, the value codes
// c - 8 rather than 16 (c - 8)), so scores and value sums are the same bit for bit.
TEST_P(Kernels, Int8WithoutVnniIsBitIdentical) {
  KVCACHE_SEED_TRACE();
  const kernels::table* plain = kernels::find_without_vnni(GetParam());
  if (plain == nullptr) GTEST_SKIP() << "this ISA has no int8 Q4 kernels without VNNI";
  if (plain == t_) GTEST_SKIP() << "this CPU lacks AVX-VNNI: its AVX2 table is the one without VNNI";
  expect_same_q4_bits(*plain);
}

// The AVX-512 int8 Q4 kernels without VBMI (two vpmovdb for one vpermt2b, for CPUs with VNNI
// alone) sum the same integers as the ones with VBMI, so their results are the same bit for bit.
TEST_P(Kernels, Int8WithoutVbmiIsBitIdentical) {
  KVCACHE_SEED_TRACE();
  const kernels::table* plain = kernels::find_without_vbmi(GetParam());
  if (plain == nullptr) GTEST_SKIP() << "this ISA or CPU has no int8 Q4 kernels without VBMI (AVX-512 VNNI)";
  if (plain == t_) GTEST_SKIP() << "this CPU lacks AVX-512 VBMI: its AVX-512 table is the one without VBMI";
  expect_same_q4_bits(*plain);
}

INSTANTIATE_TEST_SUITE_P(AllIsas, Kernels, ::testing::Values(isa::scalar, isa::avx2, isa::avx512, isa::neon),
                         [](const ::testing::TestParamInfo<isa>& p) { return std::string(kvcache::to_string(p.param)); });

// At least one SIMD ISA must be available on the platforms we build SIMD kernels for.
TEST(KernelsAvailability, SimdIsaPresentOnSimdPlatforms) {
#if defined(__x86_64__)
  EXPECT_NE(kernels::find(isa::avx2), nullptr) << "this x86-64 CPU lacks AVX2+F16C+FMA?";
#elif defined(__aarch64__)
  EXPECT_NE(kernels::find(isa::neon), nullptr);
#else
  GTEST_SKIP() << "no SIMD kernels for this architecture";
#endif
  EXPECT_NE(kernels::find(isa::scalar), nullptr);
  EXPECT_EQ(&kernels::active(), kernels::find(kvcache::active_isa()));
}

}  // namespace
