#pragma once
/// @file half.hpp
/// IEEE 754 binary16 storage type and exact scalar conversions (the reference every SIMD and CUDA
/// conversion is tested against).

#include <kvcache/config.hpp>

#include <bit>
#include <cstdint>

namespace kvcache {

/// IEEE binary16 value stored as its bit pattern. Trivially copyable, 2 bytes, no arithmetic:
/// convert with to_float / to_half.
struct half {
  std::uint16_t bits;
  friend constexpr bool operator==(half, half) = default;  ///< bitwise equality
};
static_assert(sizeof(half) == 2 && alignof(half) == 2);

/// Float to binary16, round-to-nearest-even. Overflow goes to ±inf, tiny values to subnormals or
/// ±0, NaN stays NaN (quietened, top payload bits kept: the same bits x86 F16C produces).
[[nodiscard]] constexpr std::uint16_t f32_to_f16_bits(float f) noexcept {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  const std::uint32_t a = x & 0x7fffffffu;
  if (a >= 0x7f800000u) {  // inf or NaN
    if (a > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    return static_cast<std::uint16_t>(sign | 0x7c00u);
  }
  if (a >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (a >= 0x38800000u) {  // normal result: rebias exponent (127 -> 15) and round the 13 dropped bits
    const std::uint32_t r = a + 0xfffu + ((a >> 13) & 1u) - (112u << 23);
    return static_cast<std::uint16_t>(sign | (r >> 13));
  }
  if (a <= 0x33000000u) return static_cast<std::uint16_t>(sign);  // <= 2^-25 rounds (ties-even) to 0
  // Subnormal result in units of 2^-24: (1.m * 2^(e-127)) / 2^-24 = mant24 >> (126 - e).
  const std::uint32_t e = a >> 23;
  const std::uint32_t m = (a & 0x7fffffu) | 0x800000u;
  const std::uint32_t shift = 126u - e;  // 14..24
  std::uint32_t q = m >> shift;
  const std::uint32_t rem = m & ((1u << shift) - 1u);
  const std::uint32_t halfway = 1u << (shift - 1u);
  if (rem > halfway || (rem == halfway && (q & 1u))) ++q;
  return static_cast<std::uint16_t>(sign | q);
}

/// Binary16 bits to float: exact for every finite value; NaN stays NaN (quietened, payload kept).
[[nodiscard]] constexpr float f16_bits_to_f32(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t e = (h >> 10) & 0x1fu;
  const std::uint32_t m = h & 0x3ffu;
  if (e == 0x1fu) {
    return std::bit_cast<float>(sign | 0x7f800000u | (m != 0 ? 0x400000u : 0u) | (m << 13));
  }
  if (e == 0) {
    if (m == 0) return std::bit_cast<float>(sign);
    // Subnormal m * 2^-24: normalise so the leading 1 becomes the implicit bit.
    const int lz = std::countl_zero(m) - 21;  // m has at most 10 bits: shift until bit 10 set
    const std::uint32_t mn = (m << lz) & 0x3ffu;
    const std::uint32_t exp = static_cast<std::uint32_t>(113 - lz);  // 2^(-14-lz) biased by 127
    return std::bit_cast<float>(sign | (exp << 23) | (mn << 13));
  }
  return std::bit_cast<float>(sign | ((e + 112u) << 23) | (m << 13));
}

/// Float to half (round-to-nearest-even).
[[nodiscard]] constexpr half to_half(float f) noexcept { return half{f32_to_f16_bits(f)}; }
/// Half to float (exact).
[[nodiscard]] constexpr float to_float(half h) noexcept { return f16_bits_to_f32(h.bits); }

}  // namespace kvcache
