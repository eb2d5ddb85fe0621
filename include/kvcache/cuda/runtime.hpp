#pragma once
/// @file cuda/runtime.hpp
/// Tested on an H100 and an H200 against the CPU caches and float64 references (cuda/README.md).
/// The CUDA placement runtime of kvcache::cuda: device availability, cudaMalloc-backed device
/// memory (never managed memory), stream-ordered copies. Every CUDA runtime error becomes errc::device_error carrying the
/// CUDA error name and string. This header includes no CUDA header: streams are `CUstream_st*`
/// (kvcache/placement.hpp), device memory is `void*`.

#include <kvcache/error.hpp>
#include <kvcache/placement.hpp>

#include <cstddef>
#include <cstdint>

namespace kvcache {

/// Ok when `device` exists, the driver is usable and its compute capability is at least 8.0
/// (kvcache::cuda is built for sm_80 and sm_90). Otherwise errc::unsupported (no device, device
/// index out of range, capability too old) or errc::device_error (driver missing or too old),
/// with a message that says why. Cheap after the first call; never aborts.
[[nodiscard]] result<void> cuda_available(int device = 0);

/// Blocks until all work enqueued on `where.stream` has finished; errc::device_error reports any
/// asynchronous error of that work (e.g. a faulting kernel).
[[nodiscard]] result<void> cuda_synchronize(const cuda& where);

/// Enqueues a copy of `bytes` bytes from host `src` to device `dst` on `where.stream`. `src` may be
/// pageable (the call then returns once `src` has been staged, so the caller may reuse it).
[[nodiscard]] result<void> copy_to_device(const cuda& where, void* dst, const void* src, std::size_t bytes);
/// Enqueues a copy from device `src` to host `dst`; `dst` is valid after cuda_synchronize(where).
[[nodiscard]] result<void> copy_to_host(const cuda& where, void* dst, const void* src, std::size_t bytes);
/// Enqueues a device-to-device copy.
[[nodiscard]] result<void> copy_on_device(const cuda& where, void* dst, const void* src, std::size_t bytes);
/// Enqueues a fill of `bytes` bytes of device memory with byte `value`.
[[nodiscard]] result<void> fill_on_device(const cuda& where, void* dst, std::uint8_t value, std::size_t bytes);

/// One cudaMalloc'ed block of device memory of `device`, freed on destruction. Move-only.
/// Allocation happens in make() only: never in a cache's per-token path.
class device_buffer {
 public:
  device_buffer() noexcept = default;
  /// Allocates `bytes` (> 0) on `where.device`; errc::out_of_memory when cudaMalloc refuses,
  /// errc::device_error for any other CUDA error, errc::invalid_argument for 0 bytes.
  [[nodiscard]] static result<device_buffer> make(const cuda& where, std::size_t bytes);

  device_buffer(device_buffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_), device_(o.device_) {
    o.ptr_ = nullptr;
    o.bytes_ = 0;
  }
  device_buffer& operator=(device_buffer&& o) noexcept {
    if (this != &o) {
      reset();
      ptr_ = o.ptr_;
      bytes_ = o.bytes_;
      device_ = o.device_;
      o.ptr_ = nullptr;
      o.bytes_ = 0;
    }
    return *this;
  }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer() { reset(); }

  /// Device pointer (nullptr when empty).
  [[nodiscard]] void* data() const noexcept { return ptr_; }
  /// Bytes allocated.
  [[nodiscard]] std::size_t size() const noexcept { return bytes_; }
  /// Frees the memory (cudaFree synchronizes the device); the buffer becomes empty.
  void reset() noexcept;

 private:
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
  int device_ = 0;
};

/// A device arena: one cudaMalloc'ed slab carved into aligned regions by a bump pointer. Caches
/// take all their device storage from one arena at construction, so `capacity()` is exactly the
/// device memory they hold. Regions are never freed individually; reset() forgets them all.
class device_arena {
 public:
  device_arena() noexcept = default;
  /// An arena of `bytes` bytes on `where.device` (errors as device_buffer::make).
  [[nodiscard]] static result<device_arena> make(const cuda& where, std::size_t bytes);

  /// The next `bytes` bytes aligned to `align` (a power of two <= 256), or errc::out_of_memory
  /// naming the request and the bytes left. Not thread-safe.
  [[nodiscard]] result<void*> allocate(std::size_t bytes, std::size_t align = 256);
  /// Bytes handed out so far, including alignment padding.
  [[nodiscard]] std::size_t used() const noexcept { return used_; }
  /// Bytes of the slab (the device memory actually held).
  [[nodiscard]] std::size_t capacity() const noexcept { return slab_.size(); }
  /// Forgets every region (their memory may be handed out again).
  void reset() noexcept { used_ = 0; }

  /// Bytes an arena needs for regions of the given sizes allocated in order with 256-byte alignment.
  [[nodiscard]] static constexpr std::size_t padded(std::size_t bytes) noexcept {
    return (bytes + 255) / 256 * 256;
  }

 private:
  device_buffer slab_;
  std::size_t used_ = 0;
};

}  // namespace kvcache
