#pragma once
// A stand-in for the CUDA runtime header, for the *_emulated test builds only (tests/cuda.cmake):
// one fake device 0 (compute capability 9.0) whose memory is host memory; asynchronous operations
// are queued and run when the host synchronizes (see runtime_state), or recorded into a graph
// while a stream is captured and queued again by cudaGraphLaunch. With it, the caches' host code
// (cuda/*.cpp, cuda/runtime.cu) and the device tests run unchanged on a machine without a GPU;
// kernels run through tests/cuda/emulator.hpp (see emu_launch.cpp). Nothing here resembles the
// real runtime's concurrency, memory spaces or errors beyond what kvcache relies on.

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <vector>

struct CUstream_st;

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorNoDevice = 100,
  cudaErrorLaunchFailure = 719
};
enum cudaMemcpyKind { cudaMemcpyHostToHost = 0, cudaMemcpyHostToDevice = 1, cudaMemcpyDeviceToHost = 2, cudaMemcpyDeviceToDevice = 3 };
enum cudaStreamCaptureMode { cudaStreamCaptureModeGlobal = 0, cudaStreamCaptureModeThreadLocal = 1, cudaStreamCaptureModeRelaxed = 2 };
using cudaStream_t = CUstream_st*;
struct cudaEvent_st {};
using cudaEvent_t = cudaEvent_st*;
struct cudaGraph_st {
  std::vector<std::function<void()>> ops;
};
using cudaGraph_t = cudaGraph_st*;
using cudaGraphExec_t = cudaGraph_st*;
struct cudaDeviceProp {
  int major = 9;
  int minor = 0;
};
inline constexpr unsigned cudaStreamNonBlocking = 1;
inline constexpr unsigned cudaEventDisableTiming = 2;

namespace kvcache_emu {
/// The graph being captured (one capture at a time, any stream), or null.
inline cudaGraph_st*& capturing() {
  static thread_local cudaGraph_st* g = nullptr;
  return g;
}
/// The one emulated stream: every stream shares this queue (an order at least as strict as the
/// real streams'), run when the host synchronizes: stream/event/device synchronize, a copy to
/// pageable host memory, cudaFree/cudaFreeHost. So work really is deferred, and host code that
/// reuses memory a queued operation still reads (pinned staging, say) shows up as wrong data.
struct runtime_state {
  std::vector<std::function<void()>> queue;
  std::map<const char*, std::size_t> device;  // cudaMalloc'ed ranges
  std::map<const char*, std::size_t> pinned;  // cudaMallocHost'ed ranges
  // Fault injection for tests: the next `fail_device_copies` device-to-device cudaMemcpyAsync
  // calls fail with cudaErrorLaunchFailure and copy nothing; cudaMalloc and cudaMallocHost fail
  // with cudaErrorMemoryAllocation where `refuse_allocation` returns true.
  int fail_device_copies = 0;
  bool (*refuse_allocation)() noexcept = nullptr;
};
/// How many emulated runtime calls this thread is inside. The runtime's own host allocations
/// (its queue, graphs, staging) are not the caller's: test_cuda_oom's allocation failures, which
/// stand for the caches' host allocations failing, let them through (a real runtime has its own
/// allocator and reports its failures as errors, which refuse_allocation stands for).
inline int& runtime_depth() {
  static thread_local int depth = 0;
  return depth;
}
struct runtime_call {
  runtime_call() noexcept { ++runtime_depth(); }
  ~runtime_call() { --runtime_depth(); }
  runtime_call(const runtime_call&) = delete;
  runtime_call& operator=(const runtime_call&) = delete;
};
inline runtime_state& state() {
  static runtime_state s;
  return s;
}
/// Whether the test refuses the allocation being made (runtime_state::refuse_allocation).
inline bool refused() { return state().refuse_allocation != nullptr && state().refuse_allocation(); }
inline void drain() {
  std::vector<std::function<void()>> q;
  q.swap(state().queue);
  for (auto& op : q) op();
}
inline bool within(const std::map<const char*, std::size_t>& m, const void* p) {
  const auto* c = static_cast<const char*>(p);
  auto it = m.upper_bound(c);
  if (it == m.begin()) return false;
  --it;
  return c < it->first + it->second;
}
/// Queues `op`, or records it while a stream is captured.
inline void enqueue(std::function<void()> op) {
  if (cudaGraph_st* g = capturing()) g->ops.push_back(std::move(op));
  else state().queue.push_back(std::move(op));
}
}  // namespace kvcache_emu

inline const char* cudaGetErrorName(cudaError_t e) { return e == cudaSuccess ? "cudaSuccess" : "cudaErrorEmulated"; }
inline const char* cudaGetErrorString(cudaError_t e) { return e == cudaSuccess ? "no error" : "emulated runtime error"; }
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline cudaError_t cudaGetDeviceCount(int* n) {
  *n = 1;
  return cudaSuccess;
}
inline cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int device) {
  if (device != 0) return cudaErrorInvalidValue;
  *p = cudaDeviceProp{};
  return cudaSuccess;
}
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16 };
/// 132 multiprocessors, like an H100 SXM: the automatic split of the caches' attend() then cuts
/// the tests' short sequences into several splits.
inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (device != 0 || attr != cudaDevAttrMultiProcessorCount) return cudaErrorInvalidValue;
  *value = 132;
  return cudaSuccess;
}
inline cudaError_t cudaGetDevice(int* d) {
  *d = 0;
  return cudaSuccess;
}
inline cudaError_t cudaSetDevice(int d) { return d == 0 ? cudaSuccess : cudaErrorInvalidValue; }
inline cudaError_t cudaMalloc(void** p, std::size_t bytes) {
  const kvcache_emu::runtime_call in_runtime;
  if (kvcache_emu::refused()) return cudaErrorMemoryAllocation;
  *p = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
  if (*p == nullptr) return cudaErrorMemoryAllocation;
  kvcache_emu::state().device[static_cast<const char*>(*p)] = bytes;
  return cudaSuccess;
}
inline cudaError_t cudaFree(void* p) {
  const kvcache_emu::runtime_call in_runtime;
  kvcache_emu::drain();  // cudaFree synchronizes
  kvcache_emu::state().device.erase(static_cast<const char*>(p));
  std::free(p);
  return cudaSuccess;
}
inline cudaError_t cudaMallocHost(void** p, std::size_t bytes) {
  const kvcache_emu::runtime_call in_runtime;
  if (kvcache_emu::refused()) return cudaErrorMemoryAllocation;
  *p = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
  if (*p == nullptr) return cudaErrorMemoryAllocation;
  kvcache_emu::state().pinned[static_cast<const char*>(*p)] = bytes;
  return cudaSuccess;
}
inline cudaError_t cudaFreeHost(void* p) {
  const kvcache_emu::runtime_call in_runtime;
  kvcache_emu::drain();
  kvcache_emu::state().pinned.erase(static_cast<const char*>(p));
  std::free(p);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind, cudaStream_t) {
  const kvcache_emu::runtime_call in_runtime;
  using namespace kvcache_emu;
  if (kind == cudaMemcpyDeviceToDevice && state().fail_device_copies > 0) {
    --state().fail_device_copies;
    return cudaErrorLaunchFailure;
  }
  const bool dst_pageable = !within(state().device, dst) && !within(state().pinned, dst);
  const bool src_pageable = !within(state().device, src) && !within(state().pinned, src);
  if (capturing() != nullptr) {  // a captured copy reads its source at replay time
    enqueue([=] { std::memmove(dst, src, bytes); });
  } else if (dst_pageable) {  // to pageable host memory: returns once the copy is done
    drain();
    std::memmove(dst, src, bytes);
  } else if (src_pageable) {  // from pageable host memory: staged before returning
    auto staged = std::make_shared<std::vector<char>>(static_cast<const char*>(src), static_cast<const char*>(src) + bytes);
    enqueue([=] { std::memcpy(dst, staged->data(), bytes); });
  } else {
    enqueue([=] { std::memmove(dst, src, bytes); });
  }
  return cudaSuccess;
}
inline cudaError_t cudaMemcpy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind) {
  const kvcache_emu::runtime_call in_runtime;
  kvcache_emu::drain();
  std::memmove(dst, src, bytes);
  return cudaSuccess;
}
inline cudaError_t cudaMemsetAsync(void* dst, int value, std::size_t bytes, cudaStream_t) {
  const kvcache_emu::runtime_call in_runtime;
  kvcache_emu::enqueue([=] { std::memset(dst, value, bytes); });
  return cudaSuccess;
}
inline cudaError_t cudaStreamSynchronize(cudaStream_t) {
  const kvcache_emu::runtime_call in_runtime;
  kvcache_emu::drain();
  return cudaSuccess;
}
inline cudaError_t cudaDeviceSynchronize() {
  const kvcache_emu::runtime_call in_runtime;
  kvcache_emu::drain();
  return cudaSuccess;
}
inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned) {
  static char fake_streams[64];
  static unsigned next = 0;
  *s = reinterpret_cast<cudaStream_t>(&fake_streams[(next++) % 64]);
  return cudaSuccess;
}
inline cudaError_t cudaStreamDestroy(cudaStream_t) { return cudaSuccess; }
inline cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned) {
  const kvcache_emu::runtime_call in_runtime;
  *e = new cudaEvent_st;
  return cudaSuccess;
}
inline cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, 0); }
inline cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete e;
  return cudaSuccess;
}
inline cudaError_t cudaEventRecord(cudaEvent_t, cudaStream_t) { return cudaSuccess; }
inline cudaError_t cudaEventSynchronize(cudaEvent_t) {
  const kvcache_emu::runtime_call in_runtime;
  kvcache_emu::drain();  // everything queued before the event (and after: stricter than needed)
  return cudaSuccess;
}
inline cudaError_t cudaStreamBeginCapture(cudaStream_t, cudaStreamCaptureMode) {
  const kvcache_emu::runtime_call in_runtime;
  if (kvcache_emu::capturing() != nullptr) return cudaErrorInvalidValue;
  kvcache_emu::capturing() = new cudaGraph_st;
  return cudaSuccess;
}
inline cudaError_t cudaStreamEndCapture(cudaStream_t, cudaGraph_t* g) {
  *g = kvcache_emu::capturing();
  kvcache_emu::capturing() = nullptr;
  return *g != nullptr ? cudaSuccess : cudaErrorInvalidValue;
}
inline cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t g, unsigned long long) {
  const kvcache_emu::runtime_call in_runtime;
  *exec = new cudaGraph_st(*g);
  return cudaSuccess;
}
inline cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t) {
  const kvcache_emu::runtime_call in_runtime;
  for (auto& op : exec->ops) kvcache_emu::enqueue(op);
  return cudaSuccess;
}
inline cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  delete exec;
  return cudaSuccess;
}
inline cudaError_t cudaGraphDestroy(cudaGraph_t g) {
  delete g;
  return cudaSuccess;
}
