#pragma once
/// @file detail/storage.hpp
/// Internal: the allocation behind every CPU cache's K/V storage. Large buffers are aligned to a
/// huge page and the OS is asked to back them with huge pages (Linux transparent huge pages in
/// "madvise" mode, the distributions' default). Decode attention streams the whole cache every
/// step; with 4 KiB pages a 32k-token layer crosses a page (a TLB miss, and a hardware-prefetch
/// restart) every 16 tokens of a head.

#include <cstddef>
#include <memory>
#include <new>

namespace kvcache::detail {

inline constexpr std::size_t huge_page_bytes = std::size_t{2} << 20;

/// Asks the OS to back the huge pages inside [p, p + n) with huge pages. A hint: does nothing
/// where unsupported, never fails. (src/storage.cpp)
void advise_huge_pages(void* p, std::size_t n) noexcept;

/// Frees what allocate_storage returned.
struct storage_delete {
  std::size_t alignment = 64;
  void operator()(std::byte* p) const noexcept { ::operator delete(p, std::align_val_t{alignment}); }
};
/// An owned storage buffer.
using storage = std::unique_ptr<std::byte[], storage_delete>;

/// Alignment of a storage buffer of n bytes: a huge page from one huge page up, else 64 bytes.
[[nodiscard]] constexpr std::size_t storage_alignment(std::size_t n) noexcept {
  return n >= huge_page_bytes ? huge_page_bytes : 64;
}

/// n bytes (n > 0), aligned as storage_alignment(n), huge pages advised; null if the allocator
/// refuses. The bytes are not touched: stats count them as allocated all the same.
[[nodiscard]] inline storage allocate_storage(std::size_t n) noexcept {
  const std::size_t a = storage_alignment(n);
  auto* p = static_cast<std::byte*>(::operator new(n, std::align_val_t{a}, std::nothrow));
  if (p != nullptr && a == huge_page_bytes) advise_huge_pages(p, n);
  return storage(p, storage_delete{a});
}

}  // namespace kvcache::detail
