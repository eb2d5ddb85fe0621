#pragma once
/// @file placement.hpp
/// Placement policy types: where a cache's memory lives and which kernels run on it.
/// A cache is a template over its placement (`contiguous_cache<cpu>`, `paged_cache<cuda>`).

#include <kvcache/config.hpp>

#include <concepts>

/// CUDA's stream handle type (cudaStream_t is `CUstream_st*`), forward-declared so public headers
/// never include CUDA headers.
struct CUstream_st;

namespace kvcache {

/// Host memory; kernels chosen at run time among scalar / AVX2 / AVX-512 / NEON. Stateless tag.
struct cpu {
  friend constexpr bool operator==(cpu, cpu) = default;
};

/// NVIDIA GPU memory (cudaMalloc-backed pools, never managed memory); work is enqueued on
/// `stream` (nullptr: the legacy default stream) of `device`. Stateful refinement in the style
/// of Thrust's `par.on(stream)`: `kvcache::cuda{0}.on(stream)`.
struct cuda {
  int device = 0;
  CUstream_st* stream = nullptr;

  /// The same device with work enqueued on `s`.
  [[nodiscard]] constexpr cuda on(CUstream_st* s) const noexcept { return cuda{device, s}; }
  friend constexpr bool operator==(const cuda&, const cuda&) = default;
};

/// A placement policy type known to kvcache.
template <class P>
concept Placement = std::same_as<P, cpu> || std::same_as<P, cuda>;

}  // namespace kvcache
