// Q4 key scores and value sums of decode attention in integer arithmetic for AVX2 CPUs with
// AVX-VNNI (the VEX vpdpbusd on 256-bit vectors: Intel Alder Lake and later client cores, AMD
// Zen 5), which have no AVX-512. Compiled with -mavx2 -mfma -mf16c -mavxvnni: everything stays in
// this file's anonymous namespace (see kernels_internal.hpp) except the entry points, which
// avx2::get() installs only on CPUs that have AVX-VNNI. The kernels are q4_int8_avx2.inl's, here
// on vpdpbusd (one instruction for four products a dword, the high nibbles left in place); CPUs
// without AVX-VNNI run the same kernels on vpmaddubsw (kernels_avx2int8.cpp).
#include "kernels_internal.hpp"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

namespace kvcache::kernels::avx2vnni {
namespace {

// part += dot products of the unsigned bytes of u with the signed bytes of s, four per dword,
// in int32 (see q4_int8_avx2.inl).
inline void dot4(__m256i& part, __m256i u, __m256i s) {
#if defined(__GNUC__) && !defined(__clang__)
  __asm__("%{vex%} vpdpbusd %2, %1, %0" : "+x"(part) : "x"(u), "x"(s));
#else
  part = _mm256_dpbusd_avx_epi32(part, u, s);
#endif
}
inline __m256i widen(__m256i part) { return part; }
constexpr unsigned dot_run = 1u << 20;
constexpr bool codes_times_16 = true;

}  // namespace

#include "q4_int8_avx2.inl"

}  // namespace kvcache::kernels::avx2vnni
