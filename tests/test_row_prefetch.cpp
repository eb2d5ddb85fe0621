// row_prefetch (src/row_prefetch.inl), the dense kernels' software prefetch, over regions of several
// pieces (kernels::prefetch_region::more, as attend hands a paged tile's value rows of one kv head):
// every line of every piece goes out exactly once, in the pieces' order, and all of them by the
// kernel's last row, ceil(lines / rows) a row, whichever of rows() and rows_held() issues them; and
// each 4 KiB page boundary inside a region is walked ahead once (row_prefetch::next). The prefetch
// instructions are replaced by recorders; the file is included as the kernels include it.
#include <gtest/gtest.h>
#include <kvcache/kernels.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

namespace recorded {
std::vector<std::uintptr_t> lines;  // the lines prefetched, in order
std::vector<std::uintptr_t> pages;  // the pages walked ahead (prefetch_page), in order
}  // namespace recorded

namespace kvcache::kernels::testing {
inline const bool prefetch_to_l1 = false;
inline void prefetch_line(std::uintptr_t at, bool) noexcept { recorded::lines.push_back(at); }
inline void prefetch_page(std::uintptr_t at, bool) noexcept { recorded::pages.push_back(at); }
}  // namespace kvcache::kernels::testing

namespace under_test {
namespace kernels {
using kvcache::kernels::prefetch_region;
using kvcache::kernels::testing::prefetch_line;
using kvcache::kernels::testing::prefetch_page;
using kvcache::kernels::testing::prefetch_to_l1;
}  // namespace kernels
#include "../src/row_prefetch.inl"
}  // namespace under_test

namespace {

using kvcache::kernels::prefetch_region;

// Pieces at made-up addresses (never read: only their lines are recorded), some empty, with
// unaligned starts and ends, and the lines they cover in order.
struct pieces_case {
  std::vector<prefetch_region> pieces;
  std::vector<std::uintptr_t> lines;
};

pieces_case make_case(std::mt19937& rng) {
  pieces_case c;
  const auto n = static_cast<unsigned>(1 + rng() % 9);
  std::uintptr_t at = std::uintptr_t{1} << 20;
  for (unsigned i = 0; i < n; ++i) {
    at += 64 * (rng() % 100) + rng() % 64;
    const std::size_t bytes = rng() % 5 == 0 ? 0 : rng() % 5000;
    c.pieces.push_back({reinterpret_cast<const void*>(at), bytes});
    for (std::uintptr_t l = at / 64 * 64; bytes > 0 && l < at + bytes; l += 64) c.lines.push_back(l);
    at += bytes;
  }
  return c;
}

prefetch_region as_one(const pieces_case& c) {
  prefetch_region r = c.pieces[0];
  r.more = c.pieces.data() + 1;
  r.more_count = static_cast<std::uint32_t>(c.pieces.size() - 1);
  return r;
}

TEST(row_prefetch, every_line_of_every_piece_once_in_order_by_the_last_row) {
  std::mt19937 rng(48);
  for (int trial = 0; trial < 3000; ++trial) {
    const pieces_case c = make_case(rng);
    const auto rows = static_cast<unsigned>(1 + rng() % 300);
    for (const bool held : {false, true}) {
      recorded::lines.clear();
      under_test::row_prefetch pf(as_one(c), rows);
      // ceil(lines / rows) lines a row, until they run out.
      const std::size_t per_row = (c.lines.size() + rows - 1) / rows;
      for (unsigned done = 0; done < rows;) {
        const unsigned k = std::min(static_cast<unsigned>(1 + rng() % 4), rows - done);
        held ? pf.rows_held(k) : pf.rows(k);
        done += k;
        ASSERT_EQ(recorded::lines.size(), std::min(c.lines.size(), done * per_row))
            << "trial " << trial << " pieces " << c.pieces.size() << " rows " << rows << " done " << done;
      }
      ASSERT_EQ(recorded::lines, c.lines) << "trial " << trial << (held ? " rows_held" : " rows");
      held ? pf.rows_held(5) : pf.rows(5);  // past the end: nothing more
      EXPECT_EQ(recorded::lines.size(), c.lines.size());
      // Pages walked: 16 KiB past a page boundary inside one of the pieces (a line of the piece
      // starts there), each at most once, in order.
      std::vector<std::uintptr_t> inside;
      for (const prefetch_region& p : c.pieces) {
        const auto b = reinterpret_cast<std::uintptr_t>(p.p);
        for (std::uintptr_t page = (b / 4096 + 1) * 4096; p.bytes > 0 && page < b + p.bytes; page += 4096)
          inside.push_back(page + 16384);
      }
      for (std::size_t i = 0; i < recorded::pages.size(); ++i) {
        ASSERT_NE(std::find(inside.begin(), inside.end(), recorded::pages[i]), inside.end()) << "trial " << trial;
        if (i > 0) {
          ASSERT_LT(recorded::pages[i - 1], recorded::pages[i]) << "trial " << trial;
        }
      }
      recorded::pages.clear();
    }
  }
}

// A long region (a contiguous cache's next tile of one kv head) read a few lines a row: every
// page boundary inside it is walked ahead once, by the time the first line after it goes out; a
// region of one whole page walks nothing.
TEST(row_prefetch, walks_each_page_of_a_region_ahead_once) {
  for (const bool held : {false, true}) {
    recorded::lines.clear();
    recorded::pages.clear();
    const std::uintptr_t begin = 10 * 4096 + 640;
    const std::size_t bytes = 65536 + 100;
    const unsigned rows = 256;  // 1027 lines: 5 a row
    under_test::row_prefetch pf(prefetch_region{reinterpret_cast<const void*>(begin), bytes}, rows);
    std::vector<std::uintptr_t> want;
    for (unsigned r = 0; r < rows; ++r) {
      held ? pf.rows_held(1) : pf.rows(1);
      const std::uintptr_t next_line = recorded::lines.back() + 64;
      for (std::uintptr_t page = (begin / 4096 + 1) * 4096; page < next_line; page += 4096) {
        if (std::find(want.begin(), want.end(), page + 16384) == want.end()) want.push_back(page + 16384);
      }
      ASSERT_EQ(recorded::pages, want) << "row " << r << (held ? " rows_held" : " rows");
    }
    EXPECT_EQ(want.size(), 16u);  // the boundaries at pages 11 to 26

    recorded::pages.clear();
    under_test::row_prefetch one(prefetch_region{reinterpret_cast<const void*>(std::uintptr_t{4096 * 7}), 4096}, 16);
    for (unsigned r = 0; r < 20; ++r) {
      held ? one.rows_held(1) : one.rows(1);
    }
    EXPECT_TRUE(recorded::pages.empty());
  }
}

TEST(row_prefetch, one_region_and_empty_regions) {
  recorded::lines.clear();
  under_test::row_prefetch none(prefetch_region{}, 10);
  none.rows(10);
  none.rows_held(10);
  EXPECT_TRUE(recorded::lines.empty());
  const prefetch_region one{reinterpret_cast<const void*>(std::uintptr_t{4096 + 10}), 130};  // 3 lines
  under_test::row_prefetch pf(one, 0);  // no rows: everything at the first
  pf.rows(1);
  EXPECT_EQ(recorded::lines, (std::vector<std::uintptr_t>{4096, 4160, 4224}));
}

}  // namespace
