// The int8 Q4 kernels of q4_int8_avx512.inl for CPUs with AVX-512 VNNI and VBMI (Intel Ice Lake
// and later, AMD Zen 4 and later): compiled with -mavx512vnni -mavx512vbmi, they take the low
// byte of each dword of two vectors with one vpermt2b. avx512::get() installs them only on CPUs
// with both extensions; kernels_avx512vnni_novbmi.cpp has the same kernels for CPUs with VNNI alone.
#include "kernels_internal.hpp"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

namespace kvcache::kernels::avx512vnni {
namespace {

// Byte 0 of each dword of a, then of b: 32 bytes to p (32-byte aligned), in lane order (order:
// q4_int8_avx512.inl's low_bytes index, loaded once per loop).
inline void store_low_bytes(void* p, __m512i a, __m512i order, __m512i b) {
  _mm256_store_si256(static_cast<__m256i*>(p), _mm512_castsi512_si256(_mm512_permutex2var_epi8(a, order, b)));
}

}  // namespace

#include "q4_int8_avx512.inl"

}  // namespace kvcache::kernels::avx512vnni
