// Placement runtime of kvcache::cuda: availability, device memory, copies.
#include "detail.cuh"

#include <kvcache/cuda/runtime.hpp>

#include <algorithm>

namespace kvcache {

result<void> cuda_available(int device) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e == cudaErrorNoDevice) {
    (void)cudaGetLastError();
    return fail(errc::unsupported, "cudaGetDeviceCount found no CUDA device");
  }
  if (e != cudaSuccess) return detail::cuda_fail(e, "no usable CUDA driver: cudaGetDeviceCount");
  if (device < 0 || device >= count)
    return fail(errc::unsupported, "CUDA device index out of range", {{"device", device}, {"devices", count}});
  cudaDeviceProp prop{};
  KVCACHE_CUDA_TRY(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  if (prop.major < 8)
    return fail(errc::unsupported, "CUDA device too old: kvcache::cuda is built for sm_80 and sm_90",
                {{"device", device}, {"major", prop.major}, {"minor", prop.minor}});
  // Creating the context surfaces driver/runtime mismatches that the queries above do not.
  detail::device_guard guard(device);
  KVCACHE_CUDA_TRY(guard.status(), "cudaSetDevice");
  KVCACHE_CUDA_TRY(cudaFree(nullptr), "CUDA context creation (cudaFree(0))");
  return {};
}

result<void> cuda_synchronize(const cuda& where) {
  KVCACHE_CUDA_DEVICE(where, "cuda_synchronize: cudaSetDevice");
  KVCACHE_CUDA_TRY(cudaStreamSynchronize(detail::stream_of(where)), "cuda_synchronize: cudaStreamSynchronize");
  return {};
}

namespace {
result<void> copy(const cuda& where, void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind,
                  std::string_view what) {
  if (bytes == 0) return {};
  if (dst == nullptr || src == nullptr)
    return fail(errc::invalid_argument, what, {{"dst_null", dst == nullptr}, {"src_null", src == nullptr}});
  KVCACHE_CUDA_DEVICE(where, what);
  KVCACHE_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, kind, detail::stream_of(where)), what);
  return {};
}
}  // namespace

result<void> copy_to_device(const cuda& where, void* dst, const void* src, std::size_t bytes) {
  return copy(where, dst, src, bytes, cudaMemcpyHostToDevice, "copy_to_device");
}

result<void> copy_to_host(const cuda& where, void* dst, const void* src, std::size_t bytes) {
  return copy(where, dst, src, bytes, cudaMemcpyDeviceToHost, "copy_to_host");
}

result<void> copy_on_device(const cuda& where, void* dst, const void* src, std::size_t bytes) {
  return copy(where, dst, src, bytes, cudaMemcpyDeviceToDevice, "copy_on_device");
}

result<void> fill_on_device(const cuda& where, void* dst, std::uint8_t value, std::size_t bytes) {
  if (bytes == 0) return {};
  if (dst == nullptr) return fail(errc::invalid_argument, "fill_on_device: null destination");
  KVCACHE_CUDA_DEVICE(where, "fill_on_device: cudaSetDevice");
  KVCACHE_CUDA_TRY(cudaMemsetAsync(dst, value, bytes, detail::stream_of(where)), "fill_on_device: cudaMemsetAsync");
  return {};
}

result<device_buffer> device_buffer::make(const cuda& where, std::size_t bytes) {
  if (bytes == 0) return fail(errc::invalid_argument, "device_buffer: zero bytes");
  KVCACHE_CUDA_DEVICE(where, "device_buffer: cudaSetDevice");
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, bytes);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    if (e == cudaErrorMemoryAllocation)
      return fail(errc::out_of_memory, "device_buffer: cudaMalloc refused",
                  {{"bytes", static_cast<long long>(bytes)}, {"device", where.device}});
    return detail::cuda_fail(e, "device_buffer: cudaMalloc");
  }
  device_buffer b;
  b.ptr_ = p;
  b.bytes_ = bytes;
  b.device_ = where.device;
  return b;
}

void device_buffer::reset() noexcept {
  if (ptr_ != nullptr) {
    detail::device_guard guard(device_);
    (void)cudaFree(ptr_);
  }
  ptr_ = nullptr;
  bytes_ = 0;
}

result<device_arena> device_arena::make(const cuda& where, std::size_t bytes) {
  result<device_buffer> slab = device_buffer::make(where, bytes);
  KVCACHE_TRY(slab);
  device_arena a;
  a.slab_ = std::move(slab).value();
  return a;
}

result<void*> device_arena::allocate(std::size_t bytes, std::size_t align) {
  if (align == 0 || (align & (align - 1)) != 0 || align > 256)
    return fail(errc::invalid_argument, "device_arena: alignment", {{"align", static_cast<long long>(align)}});
  const std::size_t start = (used_ + align - 1) / align * align;  // the slab itself is 256-aligned
  if (start > slab_.size() || bytes > slab_.size() - start)
    return fail(errc::out_of_memory, "device_arena: request exceeds the bytes left",
                {{"bytes", static_cast<long long>(bytes)},
                 {"left", static_cast<long long>(slab_.size() - std::min(start, slab_.size()))}});
  used_ = start + bytes;
  return static_cast<void*>(static_cast<std::byte*>(slab_.data()) + start);
}

}  // namespace kvcache
