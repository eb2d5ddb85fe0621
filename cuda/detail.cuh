#pragma once
// Internal to cuda/: CUDA error mapping, device guard, half conversions bit-identical to
// kvcache/half.hpp (device code only), and the pinned upload staging used by the caches. Not
// installed. Included by .cu files (nvcc) and by the host-only .cpp files of the caches (g++).
#include <kvcache/cuda/runtime.hpp>
#include <kvcache/error.hpp>
#include <kvcache/format.hpp>
#include <kvcache/half.hpp>

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace kvcache::detail {

/// The stream of a placement.
inline cudaStream_t stream_of(const cuda& where) noexcept { return static_cast<cudaStream_t>(where.stream); }

/// errc::device_error "<what>: <cudaErrorName>: <description> (cuda_error=N)". Clears the
/// (non-sticky) last-error state so one failure is reported once.
inline unexpected cuda_fail(cudaError_t e, std::string_view what) {
  (void)cudaGetLastError();
  return fail_joined(e == cudaErrorMemoryAllocation ? errc::out_of_memory : errc::device_error,
                     {what, ": ", cudaGetErrorName(e), ": ", cudaGetErrorString(e)}, {{"cuda_error", static_cast<long long>(e)}});
}

/// Checks a CUDA runtime call inside a function returning result<...>.
#define KVCACHE_CUDA_TRY(call, what)                                   \
  do {                                                                 \
    const cudaError_t kvcache_cuda_e_ = (call);                        \
    if (kvcache_cuda_e_ != cudaSuccess) return ::kvcache::detail::cuda_fail(kvcache_cuda_e_, what); \
  } while (false)

/// Makes `device` current for its lifetime and restores the previous device afterwards.
class device_guard {
 public:
  explicit device_guard(int device) noexcept {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != device) status_ = cudaSetDevice(device);
  }
  ~device_guard() {
    if (previous_ >= 0) (void)cudaSetDevice(previous_);
  }
  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;
  /// cudaSuccess when the device was made current.
  [[nodiscard]] cudaError_t status() const noexcept { return status_; }

 private:
  int previous_ = -1;
  cudaError_t status_ = cudaSuccess;
};

#define KVCACHE_CUDA_DEVICE(where, what)                                      \
  ::kvcache::detail::device_guard kvcache_guard_((where).device);             \
  KVCACHE_CUDA_TRY(kvcache_guard_.status(), what)

/// Result of a kernel launch (launch-configuration errors only; faults appear later).
inline result<void> check_launch(std::string_view what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return cuda_fail(e, what);
  return {};
}

#if defined(__CUDACC__)
#include "device_math.cuh"
#endif

/// Pinned host staging for small asynchronous uploads (tables, lengths). upload() waits for the
/// previous upload's copy to have left the staging memory before overwriting it, so the caller's
/// data may be reused immediately and the copy is ordered on the stream like a kernel.
class pinned_uploader {
 public:
  pinned_uploader() noexcept = default;
  pinned_uploader(const pinned_uploader&) = delete;
  pinned_uploader& operator=(const pinned_uploader&) = delete;
  pinned_uploader(pinned_uploader&& o) noexcept { swap(o); }
  pinned_uploader& operator=(pinned_uploader&& o) noexcept {
    if (this != &o) {
      reset();
      swap(o);
    }
    return *this;
  }
  ~pinned_uploader() { reset(); }

  /// Allocates `bytes` of pinned memory and the completion event.
  result<void> init(std::size_t bytes) {
    reset();
    KVCACHE_CUDA_TRY(cudaMallocHost(&host_, bytes), "pinned staging: cudaMallocHost");
    bytes_ = bytes;
    if (const cudaError_t e = cudaEventCreateWithFlags(&done_, cudaEventDisableTiming); e != cudaSuccess) {
      reset();
      return cuda_fail(e, "pinned staging: cudaEventCreate");
    }
    return {};
  }

  /// One host-to-device copy of an upload.
  struct part {
    void* dst;        // device
    const void* src;  // host, any memory
    std::size_t bytes;
  };

  /// Stages every part's host bytes (total <= capacity(), checked by the caller) and enqueues
  /// their copies to the device on `s`.
  result<void> upload(cudaStream_t s, const part* parts, std::size_t n) {
    KVCACHE_CUDA_TRY(cudaEventSynchronize(done_), "pinned staging: wait for previous upload");
    std::size_t off = 0;
    for (std::size_t i = 0; i < n; ++i) {
      if (parts[i].bytes == 0) continue;
      std::byte* staged = static_cast<std::byte*>(host_) + off;
      std::memcpy(staged, parts[i].src, parts[i].bytes);
      KVCACHE_CUDA_TRY(cudaMemcpyAsync(parts[i].dst, staged, parts[i].bytes, cudaMemcpyHostToDevice, s),
                       "upload: cudaMemcpyAsync");
      off += (parts[i].bytes + 15) / 16 * 16;
    }
    KVCACHE_CUDA_TRY(cudaEventRecord(done_, s), "upload: cudaEventRecord");
    return {};
  }
  /// Staging bytes needed for parts of the given sizes.
  [[nodiscard]] static constexpr std::size_t staged_bytes(std::size_t bytes) noexcept { return (bytes + 15) / 16 * 16; }
  [[nodiscard]] std::size_t capacity() const noexcept { return bytes_; }

 private:
  void swap(pinned_uploader& o) noexcept {
    std::swap(host_, o.host_);
    std::swap(bytes_, o.bytes_);
    std::swap(done_, o.done_);
  }
  void reset() noexcept {
    if (done_ != nullptr) {
      (void)cudaEventSynchronize(done_);  // the last copy may still read the pinned memory
      (void)cudaEventDestroy(done_);
    }
    if (host_ != nullptr) (void)cudaFreeHost(host_);
    done_ = nullptr;
    host_ = nullptr;
    bytes_ = 0;
  }
  void* host_ = nullptr;
  std::size_t bytes_ = 0;
  cudaEvent_t done_ = nullptr;
};

}  // namespace kvcache::detail
