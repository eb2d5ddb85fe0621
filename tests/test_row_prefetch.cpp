// row_prefetch (src/row_prefetch.inl), the dense kernels' software prefetch, over regions of several
// pieces (kernels::prefetch_region::more, as attend hands a paged tile's value rows of one kv head):
// every line of every piece goes out exactly once, in the pieces' order, and all of them by the
// kernel's last row, ceil(lines / rows) a row, whichever of rows() and rows_held() issues them. The prefetch instruction is
// replaced by a recorder; the file is included as the kernels include it.
#include <gtest/gtest.h>
#include <kvcache/kernels.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

namespace recorded {
std::vector<std::uintptr_t> lines;  // the lines prefetched, in order
}  // namespace recorded

namespace kvcache::kernels::testing {
inline const bool prefetch_to_l1 = false;
inline void prefetch_line(std::uintptr_t at, bool) noexcept { recorded::lines.push_back(at); }
}  // namespace kvcache::kernels::testing

namespace under_test {
namespace kernels {
using kvcache::kernels::prefetch_region;
using kvcache::kernels::testing::prefetch_line;
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
    }
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
