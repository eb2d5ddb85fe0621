// detail::allocate_storage: the allocation behind the CPU caches' K/V storage. Large buffers are
// huge-page aligned and advised for transparent huge pages (Linux); small ones 64-byte aligned.
#include <kvcache/contiguous_cache.hpp>
#include <kvcache/detail/storage.hpp>

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <sys/stat.h>

namespace {

using kvcache::detail::allocate_storage;
using kvcache::detail::huge_page_bytes;

std::uintptr_t addr(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

TEST(storage, alignment_follows_the_size) {
  for (std::size_t n : {std::size_t{1}, std::size_t{64}, std::size_t{4096}, huge_page_bytes - 1, huge_page_bytes,
                        huge_page_bytes * 2 + 3, std::size_t{5} << 20}) {
    SCOPED_TRACE(n);
    kvcache::detail::storage s = allocate_storage(n);
    ASSERT_NE(s.get(), nullptr);
    const std::size_t want = n >= huge_page_bytes ? huge_page_bytes : 64;
    EXPECT_EQ(kvcache::detail::storage_alignment(n), want);
    EXPECT_EQ(s.get_deleter().alignment, want);
    EXPECT_EQ(addr(s.get()) % want, 0u);
    std::memset(s.get(), 0xA5, n);  // every byte is ours
    EXPECT_EQ(static_cast<unsigned char>(s[n - 1]), 0xA5u);
  }
}

// VmFlags of the mapping that holds p, from /proc/self/smaps ("" if not found).
std::string vm_flags_of(const void* p) {
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool inside = false;
  while (std::getline(smaps, line)) {
    unsigned long lo = 0, hi = 0;
    char dash = 0;
    std::istringstream head(line);
    if (head >> std::hex >> lo >> dash >> hi && dash == '-') {
      inside = addr(p) >= lo && addr(p) < hi;
    } else if (inside && line.rfind("VmFlags:", 0) == 0) {
      return line;
    }
  }
  return "";
}

TEST(storage, large_buffers_are_advised_for_huge_pages) {
#if defined(__linux__)
  if (std::getenv("KVCACHE_TEST_EMULATED") != nullptr)
    GTEST_SKIP() << "under qemu user emulation madvise is not passed to the kernel";
  struct stat st {};
  if (::stat("/sys/kernel/mm/transparent_hugepage", &st) != 0)
    GTEST_SKIP() << "this kernel has no transparent huge pages (/sys/kernel/mm/transparent_hugepage)";
  kvcache::detail::storage big = allocate_storage(std::size_t{8} << 20);
  ASSERT_NE(big.get(), nullptr);
  const std::string flags = vm_flags_of(big.get() + huge_page_bytes);
  ASSERT_FALSE(flags.empty()) << "no mapping found in /proc/self/smaps";
  EXPECT_NE(flags.find(" hg"), std::string::npos) << "MADV_HUGEPAGE not applied: " << flags;
#else
  GTEST_SKIP() << "huge-page advice is Linux only";
#endif
}

TEST(storage, contiguous_cache_storage_is_huge_page_aligned_and_stats_count_what_was_asked) {
  // 2 layers * K|V * 4 heads * 2048 tokens * 128 * 2 bytes = 8 MiB per sequence.
  auto c = kvcache::contiguous_cache<>::create({{2, 4, 128}, kvcache::format::f16, 1, 2048}).value();
  const kvcache::seq_id s = c.create().value();
  ASSERT_TRUE(c.reserve(s, 1).has_value());
  std::vector<float> k(4 * 128, 1.0f), v(k.size(), 2.0f);
  for (std::uint32_t layer = 0; layer < 2; ++layer) ASSERT_TRUE(c.write(s, layer, k, v).has_value());
  ASSERT_TRUE(c.commit(s).has_value());
  const kvcache::layer_view lv = c.view(s, 0).value();
  ASSERT_EQ(lv.count, 1u);
  EXPECT_EQ(addr(lv.chunks[0].k) % huge_page_bytes, 0u) << "layer 0 K starts the sequence's storage";
  EXPECT_EQ(c.stats().resident_bytes, c.bytes_per_sequence());
}

}  // namespace
