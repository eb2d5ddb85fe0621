// Run-time ISA selection: the best supported implementation, chosen once at start-up,
// overridable by KVCACHE_ISA (a bad value is reported on stderr and by isa_environment_error())
// or force_isa().
#include "kernels_internal.hpp"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <string>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace kvcache {
namespace {

#if defined(KVCACHE_HAVE_AVX2) || defined(KVCACHE_HAVE_AVX512)
// CPUID.1:ECX.F16C (clang 14's __builtin_cpu_supports does not know "f16c"). The AVX checks
// beside it cover the OS enabling YMM state.
bool has_f16c() noexcept {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid(1, &a, &b, &c, &d) != 0 && (c & bit_F16C) != 0;
}
#endif

bool cpu_has(isa i) noexcept {
  switch (i) {
    case isa::scalar: return true;
#if defined(KVCACHE_HAVE_AVX2)
    case isa::avx2:
      __builtin_cpu_init();
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && has_f16c();
#endif
#if defined(KVCACHE_HAVE_AVX512)
    case isa::avx512:
      __builtin_cpu_init();
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx2") &&
             __builtin_cpu_supports("fma") && has_f16c();
#endif
#if defined(KVCACHE_HAVE_NEON)
    case isa::neon: return true;  // Advanced SIMD is baseline on aarch64
#endif
    default: return false;
  }
}

// The CPUID family (base 0xF plus extended) of an AMD CPU (vendor AuthenticAMD), 0 on others.
unsigned amd_family() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(0, &a, &b, &c, &d) == 0) return 0;
  const bool amd = b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u;  // "Auth" "enti" "cAMD"
  if (!amd || __get_cpuid(1, &a, &b, &c, &d) == 0) return 0;
  const unsigned base = (a >> 8) & 0xFu, ext = (a >> 20) & 0xFFu;
  return base == 0xFu ? base + ext : base;
#else
  return 0;
#endif
}

// AMD Zen 5 or later: CPUID family 0x1A or more.
bool zen5_or_later() noexcept { return amd_family() >= 0x1Au; }

const kernels::table* table_of(isa i) noexcept {
  if (!cpu_has(i)) return nullptr;
  switch (i) {
    case isa::scalar: return &kernels::scalar::get();
#if defined(KVCACHE_HAVE_AVX2)
    case isa::avx2: return &kernels::avx2::get();
#endif
#if defined(KVCACHE_HAVE_AVX512)
    case isa::avx512: return &kernels::avx512::get();
#endif
#if defined(KVCACHE_HAVE_NEON)
    case isa::neon: return &kernels::neon::get();
#endif
    default: return nullptr;
  }
}

const kernels::table* best() noexcept {
  for (isa i : {isa::avx512, isa::avx2, isa::neon})
    if (const kernels::table* t = table_of(i)) return t;
  return &kernels::scalar::get();
}

// The start-up state: the chosen table and, if KVCACHE_ISA was bad, why it was not used.
struct startup {
  const kernels::table* table = nullptr;
  error env_error{};
  bool has_env_error = false;
};

const startup& initial() {
  static const startup s = [] {
    startup r;
    const char* env = std::getenv("KVCACHE_ISA");
    result<isa> chosen = isa_from_environment(env != nullptr ? env : "");
    if (chosen.has_value()) {
      r.table = table_of(chosen.value());
    } else {
      r.table = best();
      r.env_error = chosen.error();
      r.has_env_error = true;
      std::fprintf(stderr, "kvcache: %s\n", r.env_error.message.c_str());
    }
    return r;
  }();
  return s;
}

std::atomic<const kernels::table*>& current() noexcept {
  static std::atomic<const kernels::table*> t{initial().table};
  return t;
}

// Choose (and report a bad KVCACHE_ISA) at start-up rather than at the first kernel call.
[[maybe_unused]] const bool chosen_at_startup = (current(), true);

}  // namespace

result<isa> parse_isa(std::string_view name) {
  for (isa i : {isa::scalar, isa::avx2, isa::avx512, isa::neon})
    if (name == to_string(i)) return i;
  return detail::fail_joined(errc::invalid_argument,
                             {"unknown ISA name '", name, "' (expected scalar, avx2, avx512 or neon)"});
}

result<isa> isa_from_environment(std::string_view value) {
  if (value.empty()) return best()->which;
  const isa fallback = best()->which;
  const result<isa> parsed = parse_isa(value);
  if (!parsed.has_value())
    return detail::fail_joined(errc::invalid_argument, {"KVCACHE_ISA='", value,
                                                        "' is not an ISA name (scalar, avx2, avx512, neon); using ",
                                                        to_string(fallback)});
  if (table_of(parsed.value()) == nullptr)
    return detail::fail_joined(errc::unsupported, {"KVCACHE_ISA='", value,
                                                   "' is not supported by this build or CPU; using ", to_string(fallback)});
  return parsed.value();
}

const error* isa_environment_error() noexcept {
  const startup& s = initial();
  return s.has_env_error ? &s.env_error : nullptr;
}

bool isa_supported(isa i) noexcept { return table_of(i) != nullptr; }

isa active_isa() noexcept { return current().load(std::memory_order_acquire)->which; }

result<void> force_isa(isa i) {
  const kernels::table* t = table_of(i);
  if (t == nullptr)
    return detail::fail_joined(errc::unsupported, {"ISA '", to_string(i), "' is not supported by this build or CPU"});
  current().store(t, std::memory_order_release);
  return {};
}

namespace kernels {
const bool prefetch_to_l1 = zen5_or_later();
const bool pull_q4_codes = amd_family() == 0u;
bool splits_512bit_operations() noexcept { return amd_family() == 0x19u; }

const table& active() noexcept { return *current().load(std::memory_order_acquire); }
const table* find(isa i) noexcept { return table_of(i); }

const table* find(isa i, q4_arith a) noexcept {
  const table* t = table_of(i);
  if (t == nullptr || t->q4 == a) return t;
#if defined(KVCACHE_HAVE_AVX2)
  if (i == isa::avx2 && a == q4_arith::float32) return &avx2::float_q4();
#endif
#if defined(KVCACHE_HAVE_AVX512)
  if (i == isa::avx512 && a == q4_arith::float32) return &avx512::float_q4();
#endif
#if defined(KVCACHE_HAVE_NEON)
  if (i == isa::neon && a == q4_arith::float32) return &neon::float_q4();
#endif
  return nullptr;
}

const table* find_without_vnni(isa i) noexcept {
#if defined(KVCACHE_HAVE_AVX2)
  if (i == isa::avx2 && table_of(i) != nullptr) return &avx2::int8_without_vnni();
#endif
  (void)i;
  return nullptr;
}

const table* find_without_vbmi(isa i) noexcept {
#if defined(KVCACHE_HAVE_AVX512)
  if (i == isa::avx512 && table_of(i) != nullptr) return avx512::int8_without_vbmi();
#endif
  (void)i;
  return nullptr;
}

const table* find_other_score_width(isa i) noexcept {
#if defined(KVCACHE_HAVE_AVX512)
  if (i == isa::avx512 && table_of(i) != nullptr) return &avx512::other_score_width();
#endif
  (void)i;
  return nullptr;
}
}  // namespace kernels

}  // namespace kvcache
