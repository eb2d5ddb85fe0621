#pragma once
// Internal to src/: the per-ISA pieces of attend() (attend.cpp). ISA files follow the ODR rule of
// kernels_internal.hpp: their code stays in their own namespace with internal linkage, except the
// functions declared here.
#include <kvcache/kernels.hpp>

#include "kernels_internal.hpp"  // kernels::prefetch_to_l1, for row_prefetch.inl

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

namespace kvcache::detail {

/// A run of dense value rows of one head: `tokens` rows of head_dim elements at v, weighted by
/// p[i * p_stride + p_offset + t].
struct value_segment {
  const void* v;
  std::uint32_t tokens;
  std::uint32_t p_offset;
};

#if defined(KVCACHE_HAVE_AVX2)
namespace attend_avx2 {
/// attend_avx512::accumulate_segments with AVX2 and FMA (the accumulators of 8 lanes in registers
/// across a window of the segments' rows): head_dim % 8 != 0 or a group not 2, 4 or 8 is not
/// handled (false). One query per kv head is left to the table's kernel, which ran 1.07-1.1x
/// faster than this one there (Zen 4, 32k).
bool accumulate_segments(bool f16, const float* p, std::size_t p_stride, std::uint32_t group,
                         const value_segment* segs, std::uint32_t count, std::uint32_t head_dim, float* acc,
                         kernels::prefetch_region pf);
}  // namespace attend_avx2
#endif

#if defined(KVCACHE_HAVE_AVX512)
namespace attend_avx512 {
/// acc[i][d] += sum over segments and their tokens t of p[i][p_offset + t] * v[t][d], with the
/// accumulators in registers across all segments. f32 (f16 == false) or f16 values. False (and
/// nothing done) when the shape is not handled: group not 1, 2, 4 or 8, or head_dim % 16 != 0.
bool accumulate_segments(bool f16, const float* p, std::size_t p_stride, std::uint32_t group,
                         const value_segment* segs, std::uint32_t count, std::uint32_t head_dim, float* acc,
                         kernels::prefetch_region pf);
}  // namespace attend_avx512
#endif

}  // namespace kvcache::detail
