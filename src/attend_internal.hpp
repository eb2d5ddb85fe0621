#pragma once
// Internal to src/: the per-ISA pieces of attend() (attend.cpp). ISA files follow the ODR rule of
// kernels_internal.hpp: their code stays in their own namespace with internal linkage, except the
// functions declared here.
#include <cstddef>
#include <cstdint>

namespace kvcache::detail {

/// Online-softmax step over one score tile, in place. s [group][tile] holds base-2 scores of n
/// tokens (n >= 1); on return it holds the weights 2^(s - new max). For each query i the running
/// max and sum are updated and acc [group][head_dim] rescaled when the max grows.
using softmax_tile_fn = void (*)(float* s, std::uint32_t tile, std::uint32_t n, std::uint32_t group,
                                 std::uint32_t head_dim, float* run_max, float* run_sum, float* acc);

namespace attend_generic { void softmax_tile(float*, std::uint32_t, std::uint32_t, std::uint32_t, std::uint32_t, float*, float*, float*); }
#if defined(KVCACHE_HAVE_AVX2)
namespace attend_avx2 { void softmax_tile(float*, std::uint32_t, std::uint32_t, std::uint32_t, std::uint32_t, float*, float*, float*); }
#endif
#if defined(KVCACHE_HAVE_AVX512)
namespace attend_avx512 { void softmax_tile(float*, std::uint32_t, std::uint32_t, std::uint32_t, std::uint32_t, float*, float*, float*); }
#endif

}  // namespace kvcache::detail
