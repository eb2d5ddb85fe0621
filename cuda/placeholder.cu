// Placeholder translation unit of the CUDA backend: proves nvcc builds kvcache::cuda in C++20.
#include <kvcache/placement.hpp>
#include <kvcache/view.hpp>

#include <cuda_runtime.h>

namespace kvcache::cuda_detail {

/// Number of CUDA devices visible, or -1 when the driver/runtime reports an error.
int device_count() noexcept {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : -1;
}

}  // namespace kvcache::cuda_detail
