// The L2 flush of kvcache_cuda_bench: a kernel that reads a buffer larger than L2 and writes
// nothing (bar a sink that is never hit), so that the next timed launch finds L2 holding clean
// lines of another buffer, as a decode step finds it after kernels that read weights. A memset
// flush (what the bench did before session 34) leaves L2 full of dirty lines, which the timed
// launch then has to write back to HBM as its reads evict them: up to 50 MB (an H100's L2) of
// extra traffic, a third more than attention reads at 32k tokens x 1 sequence.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace {

__global__ void read_everything(const uint4* p, std::size_t n, unsigned* sink) {
  unsigned x = 0;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const uint4 v = p[i];
    x ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (x == 0x9e3779b9u) *sink = x;  // keeps the loads; the bench's zeroed buffer never hits it
}

}  // namespace

/// Enqueues the read of `bytes` (a multiple of 16) at `buffer` on the default stream.
void bench_read_flush(const void* buffer, std::size_t bytes, unsigned* sink) {
  read_everything<<<1024, 256>>>(static_cast<const uint4*>(buffer), bytes / 16, sink);
}
