#pragma once
// Internal to cuda/: device helpers shared by the kernels. Includes no CUDA header, so that the
// kernel headers (*_kernels.cuh) also compile under the CPU emulation of tests/cuda/emulator.hpp,
// which defines __device__ and friends before including them.
#include <kvcache/format.hpp>
#include <kvcache/half.hpp>

#include <cstddef>
#include <cstdint>

namespace kvcache::detail {

// ---- half conversions: exactly kvcache::f32_to_f16_bits / f16_bits_to_f32 ------------------
// The host functions in half.hpp are constexpr (callable from device code with
// --expt-relaxed-constexpr); these wrappers make the intent explicit and keep the bit patterns
// identical to the CPU reference (hardware __float2half_rn agrees on finite values, but NaN
// payloads may differ).
__device__ __forceinline__ float h2f(std::uint16_t bits) { return f16_bits_to_f32(bits); }
__device__ __forceinline__ std::uint16_t f2h(float f) { return f32_to_f16_bits(f); }

/// Loads element i of a dense row of format f (f32 or f16) as float.
__device__ __forceinline__ float load_dense(const std::byte* p, format f, std::size_t i) {
  if (f == format::f32) return reinterpret_cast<const float*>(p)[i];
  return h2f(reinterpret_cast<const std::uint16_t*>(p)[i]);
}

/// Whether Q4 groups at base + any multiple of the strides are 4-byte aligned, as the kernels
/// need them (32-bit code loads; FP16 scales and minimums). Host-side validation helper.
inline bool q4_aligned(const void* base, std::uint64_t a, std::uint64_t b, std::uint64_t c = 0) {
  return ((reinterpret_cast<std::uintptr_t>(base) | a | b | c) & 3u) == 0;
}

}  // namespace kvcache::detail
