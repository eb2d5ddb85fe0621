// Run-time ISA selection: the best supported implementation, overridable by KVCACHE_ISA or
// force_isa().
#include "kernels_internal.hpp"

#include <atomic>
#include <cstdlib>

namespace kvcache {
namespace {

bool cpu_has(isa i) noexcept {
  switch (i) {
    case isa::scalar: return true;
#if defined(KVCACHE_HAVE_AVX2)
    case isa::avx2:
      __builtin_cpu_init();
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#endif
#if defined(KVCACHE_HAVE_AVX512)
    case isa::avx512:
      __builtin_cpu_init();
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx2") &&
             __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#endif
#if defined(KVCACHE_HAVE_NEON)
    case isa::neon: return true;  // Advanced SIMD is baseline on aarch64
#endif
    default: return false;
  }
}

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

const kernels::table* initial() noexcept {
  if (const char* env = std::getenv("KVCACHE_ISA"); env != nullptr && *env != '\0') {
    const result<isa> parsed = parse_isa(env);
    if (parsed.has_value())
      if (const kernels::table* t = table_of(parsed.value())) return t;
    // An unknown or unsupported KVCACHE_ISA falls back to the best ISA; force_isa() reports why.
  }
  return best();
}

std::atomic<const kernels::table*>& current() noexcept {
  static std::atomic<const kernels::table*> t{initial()};
  return t;
}

}  // namespace

result<isa> parse_isa(std::string_view name) {
  for (isa i : {isa::scalar, isa::avx2, isa::avx512, isa::neon})
    if (name == to_string(i)) return i;
  return unexpected(errc::invalid_argument,
                    "unknown ISA name '" + std::string(name) + "' (expected scalar, avx2, avx512 or neon)");
}

bool isa_supported(isa i) noexcept { return table_of(i) != nullptr; }

isa active_isa() noexcept { return current().load(std::memory_order_acquire)->which; }

result<void> force_isa(isa i) {
  const kernels::table* t = table_of(i);
  if (t == nullptr)
    return unexpected(errc::unsupported,
                      "ISA '" + std::string(to_string(i)) + "' is not supported by this build or CPU");
  current().store(t, std::memory_order_release);
  return {};
}

namespace kernels {
const table& active() noexcept { return *current().load(std::memory_order_acquire); }
const table* find(isa i) noexcept { return table_of(i); }
}  // namespace kernels

}  // namespace kvcache
