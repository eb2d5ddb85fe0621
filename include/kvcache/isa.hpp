#pragma once
/// @file isa.hpp
/// CPU instruction-set selection. The best supported ISA is chosen once at start-up; the
/// environment variable KVCACHE_ISA=scalar|avx2|avx512|neon or force_isa() overrides it.

#include <kvcache/error.hpp>

#include <cstdint>
#include <string_view>

namespace kvcache {

/// A CPU kernel implementation.
enum class isa : std::uint8_t {
  scalar,  ///< portable reference, the oracle for every other implementation
  avx2,    ///< x86-64 AVX2 + F16C + FMA
  avx512,  ///< x86-64 AVX-512 F/BW/VL (+ F16C, FMA)
  neon,    ///< aarch64 Advanced SIMD
};

/// "scalar", "avx2", "avx512" or "neon".
[[nodiscard]] constexpr std::string_view to_string(isa i) noexcept {
  switch (i) {
    case isa::scalar: return "scalar";
    case isa::avx2: return "avx2";
    case isa::avx512: return "avx512";
    case isa::neon: return "neon";
  }
  return "unknown";
}

/// Parses an ISA name; errc::invalid_argument for an unknown name.
[[nodiscard]] result<isa> parse_isa(std::string_view name);

/// What start-up selection makes of a KVCACHE_ISA value: "" selects the best supported ISA; a
/// known, supported name selects that ISA; otherwise an error naming the value and the ISA used
/// instead: errc::invalid_argument for an unknown name, errc::unsupported for an ISA this build or
/// CPU lacks. Pure: does not read the environment or change the active ISA.
[[nodiscard]] result<isa> isa_from_environment(std::string_view value);

/// The error isa_from_environment() gave for the KVCACHE_ISA value seen at start-up, or nullptr
/// when it was unset or valid. Such an error is also printed once, as one line on stderr, and the
/// best supported ISA is used instead: a bad KVCACHE_ISA is never silent and never fatal.
[[nodiscard]] const error* isa_environment_error() noexcept;

/// Whether this build contains `i` and this CPU can run it.
[[nodiscard]] bool isa_supported(isa i) noexcept;

/// The ISA whose kernels run now.
[[nodiscard]] isa active_isa() noexcept;

/// Makes `i` the active ISA for all later kernel calls in the process. errc::unsupported (naming
/// the ISA) if it is not compiled in or the CPU lacks it; then the active ISA is unchanged.
/// Not thread-safe against concurrently running kernels: call between steps (tests, benches).
[[nodiscard]] result<void> force_isa(isa i);

}  // namespace kvcache
