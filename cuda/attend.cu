// Decode attention of kvcache::cuda: the launcher of attend_kernels.cuh on a CUDA stream.
#include "attend_kernels.cuh"
#include "detail.cuh"

#include <kvcache/cuda/kernels.hpp>

namespace kvcache {

std::size_t cuda_attend_workspace_bytes(const attend_params& p) noexcept {
  const std::size_t splits = p.max_splits[0] + (p.segments == 2 ? p.max_splits[1] : 0u);
  return static_cast<std::size_t>(p.batch) * p.q_heads * splits * (2 + static_cast<std::size_t>(p.head_dim)) * sizeof(float);
}

result<void> cuda_attend(const cuda& where, const attend_params& p) {
  KVCACHE_TRY(validate_attend(p));
  KVCACHE_CUDA_DEVICE(where, "cuda_attend: cudaSetDevice");
  const cudaStream_t st = detail::stream_of(where);
  return launch_attend(p, [st](auto kernel, dim3 grid, dim3 block, auto... args) -> result<void> {
    kernel<<<grid, block, 0, st>>>(args...);
    return detail::check_launch("cuda_attend: kernel launch");
  });
}

}  // namespace kvcache
