// The kvcache::cuda kernel launchers (cuda_append, cuda_attend, cuda_migrate) for the *_emulated
// test builds: the same validation and launch code as cuda/append.cu and cuda/attend.cu (the
// *_kernels.cuh headers), with kernels run on the CPU by tests/cuda/emulator.hpp, or recorded
// into the graph being captured (see cuda_runtime.h here).
#include "emulator.hpp"  // first: the CUDA keywords the kernel headers use

#include "append_kernels.cuh"
#include "attend_kernels.cuh"

#include <cuda_runtime.h>  // the emulated one

#include <kvcache/cuda/kernels.hpp>

namespace kvcache {
namespace {
// Runs (or, while capturing, records) one emulated kernel launch.
auto emulate = [](auto kernel, dim3 grid, dim3 block, auto... args) -> result<void> {
  const kvcache_emu::runtime_call in_runtime;
  kvcache_emu::enqueue([=] { (void)kvcache_emu::launch<result<void>>(kernel, grid, block, args...); });
  return {};
};
}  // namespace

std::size_t cuda_attend_workspace_bytes(const attend_params& p) noexcept {
  const std::size_t splits = p.max_splits[0] + (p.segments == 2 ? p.max_splits[1] : 0u);
  return static_cast<std::size_t>(p.batch) * p.q_heads * splits * (2 + static_cast<std::size_t>(p.head_dim)) * sizeof(float);
}

result<void> cuda_attend(const cuda&, const attend_params& p) {
  KVCACHE_TRY(validate_attend(p));
  return launch_attend(p, emulate);
}

result<void> cuda_append(const cuda&, const append_params& p) {
  KVCACHE_TRY(validate_append(p));
  return launch_append(p, emulate);
}

result<void> cuda_migrate(const cuda&, const migrate_params& p) {
  KVCACHE_TRY(validate_migrate(p));
  return launch_migrate(p, emulate);
}

}  // namespace kvcache
