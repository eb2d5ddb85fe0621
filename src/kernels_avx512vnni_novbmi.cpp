// The int8 Q4 kernels of q4_int8_avx512.inl for CPUs with AVX-512 VNNI but no VBMI (Intel Cascade
// Lake and Cooper Lake): compiled with -mavx512vnni alone, they take the low byte of each dword
// of two vectors with two vpmovdb (AVX-512F) where kernels_avx512vnni.cpp has one vpermt2b. The
// same integers, so the same results bit for bit. Measured on a Cascade Lake VM (2 vCPUs, 2.5 GHz),
// attend over a two-tier cache at 32k tokens with 1 thread: see avx512::get().
#include "kernels_internal.hpp"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

namespace kvcache::kernels::avx512vnni_novbmi {
namespace {

// Byte 0 of each dword of a, then of b: 32 bytes to p, in lane order (vpmovdb truncates each
// dword to its low byte; order is not needed). Two vpmovdb to memory, not two into registers
// joined by a vinserti128 (one more port-5 uop on Skylake-SP cores): on the Cascade Lake VM,
// attend over a two-tier cache at 32k with 1 thread, 6 process alternations of 3 repetitions,
// best per round 6.11-8.29 (median 6.30) ms against 6.30-7.12 (median 6.46).
inline void store_low_bytes(void* p, __m512i a, __m512i /*order*/, __m512i b) {
  _mm512_mask_cvtepi32_storeu_epi8(p, 0xffff, a);
  _mm512_mask_cvtepi32_storeu_epi8(static_cast<char*>(p) + 16, 0xffff, b);
}

}  // namespace

#include "q4_int8_avx512.inl"

}  // namespace kvcache::kernels::avx512vnni_novbmi
