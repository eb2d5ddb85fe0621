// Q4 key scores and value sums of decode attention in integer arithmetic for every AVX2 CPU
// (vpmaddubsw + vpmaddwd in place of AVX-VNNI's vpdpbusd): AMD Zen 1 to 3, Intel Haswell to Comet
// Lake, where the float Q4 kernels made a two-tier cache's decode attention no faster than an f16
// cache's. Compiled with -mavx2 -mfma -mf16c: everything stays in this file's anonymous namespace
// (see kernels_internal.hpp) except the entry points, which avx2::get() installs on CPUs without
// AVX-VNNI. The kernels are q4_int8_avx2.inl's; their integer sums, and so their results, are
// those of kernels_avx2vnni.cpp bit for bit.
#include "kernels_internal.hpp"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

namespace kvcache::kernels::avx2int8 {
namespace {

// part += the products of the unsigned bytes of u with the signed bytes of s, summed in pairs to
// int16 by vpmaddubsw (saturating: the operands keep a pair within 4080 and eight calls' sums
// within 2^15, see q4_int8_avx2.inl); widen() sums the pairs of int16 to int32 (vpmaddwd).
inline void dot4(__m256i& part, __m256i u, __m256i s) { part = _mm256_add_epi16(part, _mm256_maddubs_epi16(u, s)); }
inline __m256i widen(__m256i part) { return _mm256_madd_epi16(part, _mm256_set1_epi16(1)); }
constexpr unsigned dot_run = 8;
constexpr bool codes_times_16 = false;

}  // namespace

#include "q4_int8_avx2.inl"

}  // namespace kvcache::kernels::avx2int8
