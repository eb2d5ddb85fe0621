// Append (scatter) and Q4 migration of kvcache::cuda: launchers of append_kernels.cuh on a stream.
#include "append_kernels.cuh"
#include "detail.cuh"

#include <kvcache/cuda/kernels.hpp>

namespace kvcache {
namespace {
// `launch` for the launch_* templates: the kernel on the placement's stream.
auto on_stream(const cuda& where, const char* what) {
  return [st = detail::stream_of(where), what](auto kernel, dim3 grid, dim3 block, auto... args) -> result<void> {
    kernel<<<grid, block, 0, st>>>(args...);
    return detail::check_launch(what);
  };
}
}  // namespace

result<void> cuda_append(const cuda& where, const append_params& p) {
  KVCACHE_TRY(validate_append(p));
  if (p.max_rows == 0) return {};
  KVCACHE_CUDA_DEVICE(where, "cuda_append: cudaSetDevice");
  return launch_append(p, on_stream(where, "cuda_append: launch"));
}

result<void> cuda_migrate(const cuda& where, const migrate_params& p) {
  KVCACHE_TRY(validate_migrate(p));
  KVCACHE_CUDA_DEVICE(where, "cuda_migrate: cudaSetDevice");
  return launch_migrate(p, on_stream(where, "cuda_migrate: launch"));
}

}  // namespace kvcache
