#pragma once
// Internal to src/: declarations of the per-ISA tables and small helpers shared by kernels.
// ISA translation units are compiled with their own -m flags: they must not define or instantiate
// non-static inline functions shared with other translation units (ODR: the linker could keep an
// AVX-512 copy for everyone). Keep their code in their own namespace, internal linkage.
// The SIMD kernels are written once in kernels_simd.inl against a small per-ISA vector interface;
// each ISA file defines that interface and includes the .inl inside its own anonymous namespace,
// so every instantiation stays internal to that file (only <isa>::get() is exported). They must
// not call half.hpp's constexpr conversions or the helpers below (those are for scalar code).
#include <kvcache/kernels.hpp>

#include <cassert>
#include <cstdint>

namespace kvcache::kernels {

/// Smallest FP16 value >= v for v >= 0 (the Q4 scale is rounded up so the group range is covered).
[[nodiscard]] constexpr half scale_round_up(float v) noexcept {
  half h = to_half(v);
  if (to_float(h) < v) h.bits = static_cast<std::uint16_t>(h.bits + 1);
  return h;
}

[[nodiscard]] constexpr float load(float x) noexcept { return x; }
[[nodiscard]] constexpr float load(half x) noexcept { return to_float(x); }

namespace scalar { const table& get() noexcept; }

// Whether the software prefetch streams (the int8 Q4 kernels' line_prefetch, q4_int8.inl; the
// dense kernels' row_prefetch.inl; attend's early_value_scales) request their lines into L1
// (prefetcht0, locality 3) rather than L2 (prefetcht1, locality 2): true on AMD Zen 5 and later
// (CPUID family 0x1A and up), false elsewhere (Arm included); set once at start-up (dispatch.cpp;
// false until then). Declared for attend_internal.hpp's files too. Measured at 32k tokens: for
// the Q4 stream (decode attention over a two-tier cache, AVX-512, in-process alternation, medians
// of 40 rounds) on Zen 5, L1 1.09x with 1 thread and 1.15x with 2 (the AVX2 int8 kernels, which
// are compute-bound there, the same either way); on Zen 4 an earlier session measured L1 1.5x
// slower on a day of high memory latency and the same on others, so it keeps L2. For the dense
// kernels, see row_prefetch.inl.
extern const bool prefetch_to_l1;

// Whether the AVX-512 fused Q4 step, where its prefetches go to L2, also pulls each tile's key and
// value codes from L2 into L1 before its dot products read them (pull_part): true on CPUs that
// are not AMD's, false on AMD, where it measured slower (why and by how much: the header of
// q4_int8_avx512.inl). Set once at start-up (dispatch.cpp; false until then).
extern const bool pull_q4_codes;

// Prefetches the line at `at` for reading, into L1 (prefetcht0) where `l1` (prefetch_to_l1, or a
// copy a loop keeps in a register), else into L2 (prefetcht1): the one place every software
// prefetch stream picks its level. Static: ISA files include this header (see the top).
static inline void prefetch_line(std::uintptr_t at, bool l1) noexcept {
  if (l1) __builtin_prefetch(reinterpret_cast<const void*>(at), 0, 3);
  else __builtin_prefetch(reinterpret_cast<const void*>(at), 0, 2);
}

// The same prefetch, issued for the page `at` lies in rather than for the line: its address
// translation walked ahead of the stream that reads it (row_prefetch::next). A name of its own so
// that tests/test_row_prefetch.cpp can tell the two apart.
static inline void prefetch_page(std::uintptr_t at, bool l1) noexcept { prefetch_line(at, l1); }

// Whether this CPU's cores split 512-bit vector operations in two 256-bit halves: AMD Zen 4 (CPUID
// family 0x19; its Zen 3 siblings have no AVX-512). The AVX-512 table then keeps 256-bit dense
// score kernels, which measured faster there (kernels_avx512.cpp).
[[nodiscard]] bool splits_512bit_operations() noexcept;

// The x86 tables: get() has the int8 Q4 kernels where the CPU has them (AVX2: always, on
// vpdpbusd in kernels_avx2vnni.cpp with AVX-VNNI, on vpmaddubsw in kernels_avx2int8.cpp
// without; AVX-512: kernels_avx512vnni.cpp on CPUs with AVX-512 VNNI and VBMI,
// kernels_avx512vnni_novbmi.cpp on CPUs with VNNI alone), float_q4() always the float Q4 kernels,
// avx2::int8_without_vnni() the vpmaddubsw ones, avx512::int8_without_vbmi() (where the CPU has
// AVX-512 VNNI) the ones without VBMI.
using scores_q4_fn = void(const float* q, std::uint32_t nq, const std::uint8_t* k, std::uint32_t tokens,
                          std::uint32_t head_dim, float* out, std::size_t out_stride, prefetch_region pf);
using accumulate_q4_fn = void(const float* p, std::size_t p_stride, std::uint32_t nq, const std::uint8_t* v,
                              std::uint32_t first, std::uint32_t tokens, std::uint32_t head_dim, float* acc,
                              prefetch_region pf);
using attend_q4_fn = void(const float* q, std::uint32_t nq, const q4_group_ref* groups, std::uint32_t count,
                          std::uint32_t head_dim, float* run_max, float* run_sum, float* acc);
#if defined(KVCACHE_HAVE_AVX2)
namespace avx2 {
const table& get() noexcept;
const table& float_q4() noexcept;
const table& int8_without_vnni() noexcept;
}  // namespace avx2
namespace avx2vnni { scores_q4_fn scores_q4; accumulate_q4_fn accumulate_q4; attend_q4_fn attend_q4; }
namespace avx2int8 { scores_q4_fn scores_q4; accumulate_q4_fn accumulate_q4; attend_q4_fn attend_q4; }
#endif
#if defined(KVCACHE_HAVE_AVX512)
// avx512::other_score_width(): get() with the other width of dense score kernels (512-bit where
// get() has 256-bit, and the reverse), for tests and benchmarks.
namespace avx512 {
const table& get() noexcept;
const table& float_q4() noexcept;
const table& other_score_width() noexcept;
const table* int8_without_vbmi() noexcept;
}  // namespace avx512
namespace avx512vnni { scores_q4_fn scores_q4; accumulate_q4_fn accumulate_q4; attend_q4_fn attend_q4; }
namespace avx512vnni_novbmi { scores_q4_fn scores_q4; accumulate_q4_fn accumulate_q4; attend_q4_fn attend_q4; }
#endif
#if defined(KVCACHE_HAVE_NEON)
// get(): the int8 Q4 kernels of kernels_neondot.cpp where the CPU has FEAT_DotProd; float_q4():
// always the float ones.
namespace neon {
const table& get() noexcept;
const table& float_q4() noexcept;
}  // namespace neon
namespace neondot { scores_q4_fn scores_q4; accumulate_q4_fn accumulate_q4; attend_q4_fn attend_q4; }
#endif

}  // namespace kvcache::kernels
