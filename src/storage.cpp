// detail::advise_huge_pages (detail/storage.hpp).
#include <kvcache/detail/storage.hpp>

#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace kvcache::detail {

void advise_huge_pages(void* p, std::size_t n) noexcept {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  // madvise takes page-aligned ranges: advise the huge pages that lie wholly inside the buffer.
  const auto begin = reinterpret_cast<std::uintptr_t>(p);
  const std::uintptr_t first = (begin + huge_page_bytes - 1) / huge_page_bytes * huge_page_bytes;
  const std::uintptr_t last = (begin + n) / huge_page_bytes * huge_page_bytes;
  if (last > first) (void)::madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
#else
  (void)p;
  (void)n;
#endif
}

}  // namespace kvcache::detail
