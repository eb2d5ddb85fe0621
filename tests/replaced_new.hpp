#pragma once
// Every replaceable global allocation function ([new.delete]: plain, array, nothrow, aligned) and
// its deallocation functions, for the test binaries that count or refuse allocations, in terms of
// one hook the including file defines:
//   void* kvcache_test_allocate(std::size_t n, std::size_t align) noexcept;
// (align 0: the default alignment), which returns null to refuse; kvcache_test::system_allocate
// is the allocation itself. The throwing forms throw std::bad_alloc on null (abort without
// exceptions); deallocation is std::free. Include it in one file of a binary (it defines the
// functions): each tests/test_*.cpp is a binary of its own.
#if defined(__GNUC__) && !defined(__clang__)
// GCC pairs the malloc inside operator new with the free inside operator delete across inlining
// and warns, although the replacements agree with each other.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif

#include <kvcache/config.hpp>

#include <cstddef>
#include <cstdlib>
#include <new>

void* kvcache_test_allocate(std::size_t n, std::size_t align) noexcept;

namespace kvcache_test {

// n bytes (at least 1) at the alignment asked for (0: malloc's), or null.
inline void* system_allocate(std::size_t n, std::size_t align) noexcept {
  if (n == 0) n = 1;
  if (align <= alignof(std::max_align_t)) return std::malloc(n);
  return std::aligned_alloc(align, (n + align - 1) / align * align);  // a multiple, as aligned_alloc wants
}

inline void* allocate_or_throw(std::size_t n, std::size_t align) {
  if (void* p = kvcache_test_allocate(n, align)) return p;
#if KVCACHE_HAS_EXCEPTIONS
  throw std::bad_alloc();
#else
  std::abort();
#endif
}

}  // namespace kvcache_test

void* operator new(std::size_t n) { return kvcache_test::allocate_or_throw(n, 0); }
void* operator new[](std::size_t n) { return kvcache_test::allocate_or_throw(n, 0); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept { return kvcache_test_allocate(n, 0); }
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept { return kvcache_test_allocate(n, 0); }
void* operator new(std::size_t n, std::align_val_t a) {
  return kvcache_test::allocate_or_throw(n, static_cast<std::size_t>(a));
}
void* operator new[](std::size_t n, std::align_val_t a) {
  return kvcache_test::allocate_or_throw(n, static_cast<std::size_t>(a));
}
void* operator new(std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return kvcache_test_allocate(n, static_cast<std::size_t>(a));
}
void* operator new[](std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return kvcache_test_allocate(n, static_cast<std::size_t>(a));
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }
