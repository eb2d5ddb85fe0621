// Errors and results (error.hpp), checked size arithmetic (geometry.hpp) and the generation-checked
// sequence id table (detail/id_table.hpp).
#include <kvcache/detail/id_table.hpp>
#include <kvcache/error.hpp>
#include <kvcache/format.hpp>
#include <kvcache/geometry.hpp>
#include <kvcache/isa.hpp>

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <vector>

namespace {

using kvcache::errc;
using kvcache::fail;
using kvcache::result;
using kvcache::seq_id;

TEST(error, make_error_names_every_value) {
  const kvcache::error e = kvcache::make_error(errc::bad_shape, "write: K size", {{"expected", 96}, {"got", -3}});
  EXPECT_EQ(e.code, errc::bad_shape);
  EXPECT_EQ(e.message, "write: K size (expected=96, got=-3)");
  const kvcache::error plain = kvcache::make_error(errc::overflow, "just words");
  EXPECT_EQ(plain.message, "just words");
  const kvcache::error big =
      kvcache::make_error(errc::out_of_range, "n", {{"n", std::numeric_limits<long long>::min()}});
  EXPECT_EQ(big.message, "n (n=-9223372036854775808)");
}

TEST(error, to_string_of_every_errc) {
  const std::vector<std::pair<errc, std::string_view>> all = {
      {errc::invalid_argument, "invalid_argument"},   {errc::bad_shape, "bad_shape"},
      {errc::layer_out_of_range, "layer_out_of_range"}, {errc::unknown_sequence, "unknown_sequence"},
      {errc::capacity_exceeded, "capacity_exceeded"}, {errc::pool_exhausted, "pool_exhausted"},
      {errc::not_reserved, "not_reserved"},           {errc::reservation_pending, "reservation_pending"},
      {errc::incomplete_write, "incomplete_write"},   {errc::out_of_range, "out_of_range"},
      {errc::overflow, "overflow"},                   {errc::unsupported, "unsupported"},
      {errc::out_of_memory, "out_of_memory"},         {errc::device_error, "device_error"},
  };
  std::set<std::string_view> seen;
  for (const auto& [code, name] : all) {
    EXPECT_EQ(kvcache::to_string(code), name);
    seen.insert(kvcache::to_string(code));
  }
  EXPECT_EQ(seen.size(), all.size());
  // The enumerators are dense from 1: the list above is all of them.
  EXPECT_EQ(static_cast<int>(errc::device_error), static_cast<int>(all.size()));
  EXPECT_EQ(kvcache::to_string(static_cast<errc>(0)), "unknown");
  EXPECT_EQ(kvcache::to_string(static_cast<errc>(200)), "unknown");
  static_assert(kvcache::to_string(errc::pool_exhausted) == "pool_exhausted");
}

TEST(error, to_string_of_formats_and_isas) {
  EXPECT_EQ(kvcache::to_string(kvcache::format::f32), "f32");
  EXPECT_EQ(kvcache::to_string(kvcache::format::f16), "f16");
  EXPECT_EQ(kvcache::to_string(kvcache::format::q4), "q4");
  for (kvcache::isa i : {kvcache::isa::scalar, kvcache::isa::avx2, kvcache::isa::avx512, kvcache::isa::neon}) {
    const auto parsed = kvcache::parse_isa(kvcache::to_string(i));
    ASSERT_TRUE(parsed.has_value());
    EXPECT_EQ(parsed.value(), i);
  }
  const auto bad = kvcache::parse_isa("sse9");
  ASSERT_FALSE(bad.has_value());
  EXPECT_EQ(bad.error().code, errc::invalid_argument);
  EXPECT_NE(bad.error().message.find("sse9"), std::string::npos) << bad.error().message;
}

TEST(result, value_and_error_access) {
  result<int> ok = 42;
  EXPECT_TRUE(ok.has_value());
  EXPECT_TRUE(static_cast<bool>(ok));
  EXPECT_EQ(ok.value(), 42);
  EXPECT_EQ(*ok, 42);
  EXPECT_EQ(ok.value_or(7), 42);

  result<int> bad = fail(errc::capacity_exceeded, "reserve", {{"requested", 9}, {"available", 2}});
  EXPECT_FALSE(bad.has_value());
  EXPECT_FALSE(static_cast<bool>(bad));
  EXPECT_EQ(bad.error().code, errc::capacity_exceeded);
  EXPECT_EQ(bad.error().message, "reserve (requested=9, available=2)");
  EXPECT_EQ(bad.value_or(7), 7);

  result<std::string> s = std::string("abc");
  EXPECT_EQ(s->size(), 3u);
  const result<std::string> cs = std::string("xy");
  EXPECT_EQ(cs->size(), 2u);

  result<std::unique_ptr<int>> owned = std::make_unique<int>(5);
  ASSERT_TRUE(owned.has_value());
  std::unique_ptr<int> taken = std::move(owned).value();
  EXPECT_EQ(*taken, 5);

  result<int> moved_err = kvcache::unexpected(errc::unsupported, "no avx512");
  const kvcache::error e = std::move(moved_err).error();
  EXPECT_EQ(e.code, errc::unsupported);
  EXPECT_EQ(e.message, "no avx512");
}

TEST(result, void_specialization) {
  const result<void> ok;
  EXPECT_TRUE(ok.has_value());
  EXPECT_TRUE(static_cast<bool>(ok));
  ok.value();
  const result<void> bad = fail(errc::not_reserved, "commit", {{"seq", 12}});
  EXPECT_FALSE(bad.has_value());
  EXPECT_EQ(bad.error().code, errc::not_reserved);
  EXPECT_EQ(bad.error().message, "commit (seq=12)");
}

// KVCACHE_TRY propagation through several levels and result types.
int g_reached = 0;

result<void> step(bool ok) {
  if (!ok) return fail(errc::pool_exhausted, "step", {{"free_blocks", 0}});
  return {};
}

result<int> twice(bool ok) {
  KVCACHE_TRY(step(ok));
  ++g_reached;
  return 2;
}

result<std::string> outer(bool ok) {
  const result<int> r = twice(ok);
  KVCACHE_TRY(r);  // lvalue form
  ++g_reached;
  return std::string(static_cast<std::size_t>(r.value()), 'x');
}

TEST(result, try_propagates_the_first_error) {
  g_reached = 0;
  const result<std::string> good = outer(true);
  ASSERT_TRUE(good.has_value());
  EXPECT_EQ(good.value(), "xx");
  EXPECT_EQ(g_reached, 2);

  g_reached = 0;
  const result<std::string> bad = outer(false);
  ASSERT_FALSE(bad.has_value());
  EXPECT_EQ(bad.error().code, errc::pool_exhausted);
  EXPECT_EQ(bad.error().message, "step (free_blocks=0)");
  EXPECT_EQ(g_reached, 0) << "code after a failed KVCACHE_TRY ran";
}

TEST(checked, mul_add_and_geometry) {
  const std::size_t max = std::numeric_limits<std::size_t>::max();
  EXPECT_EQ(kvcache::checked_mul(6, 7, "x").value(), 42u);
  EXPECT_EQ(kvcache::checked_mul(0, max, "x").value(), 0u);
  EXPECT_EQ(kvcache::checked_mul(max, 1, "x").value(), max);
  const auto m = kvcache::checked_mul(std::size_t{1} << 33, std::size_t{1} << 31, "block bytes");
  ASSERT_FALSE(m.has_value());
  EXPECT_EQ(m.error().code, errc::overflow);
  EXPECT_NE(m.error().message.find("block bytes"), std::string::npos);
  EXPECT_NE(m.error().message.find("a=8589934592"), std::string::npos) << m.error().message;
  EXPECT_EQ(kvcache::checked_add(max - 1, 1, "x").value(), max);
  const auto a = kvcache::checked_add(max, 1, "sum");
  ASSERT_FALSE(a.has_value());
  EXPECT_EQ(a.error().code, errc::overflow);

  EXPECT_TRUE(kvcache::validate(kvcache::geometry{1, 1, 1}).has_value());
  const auto g = kvcache::validate(kvcache::geometry{4, 0, 128});
  ASSERT_FALSE(g.has_value());
  EXPECT_EQ(g.error().code, errc::invalid_argument);
  EXPECT_NE(g.error().message.find("kv_heads=0"), std::string::npos) << g.error().message;
  EXPECT_EQ((kvcache::geometry{2, 8, 128}.token_width()), 1024u);
}

TEST(id_table, released_ids_are_rejected_and_slots_reused) {
  kvcache::detail::id_table t;
  const seq_id a = t.acquire().value();
  const seq_id b = t.acquire().value();
  EXPECT_NE(a, b);
  EXPECT_EQ(t.live(), 2u);
  const std::uint32_t sa = t.slot(a, "x").value();
  const std::uint32_t sb = t.slot(b, "x").value();
  EXPECT_NE(sa, sb);
  EXPECT_TRUE(t.is_live(sa));
  EXPECT_EQ(t.make_id(sa), a);

  t.release(sa);
  EXPECT_FALSE(t.is_live(sa));
  EXPECT_EQ(t.live(), 1u);
  const auto gone = t.slot(a, "length: unknown sequence");
  ASSERT_FALSE(gone.has_value());
  EXPECT_EQ(gone.error().code, errc::unknown_sequence);
  EXPECT_NE(gone.error().message.find("length: unknown sequence"), std::string::npos);
  EXPECT_NE(gone.error().message.find("seq=" + std::to_string(a.value)), std::string::npos) << gone.error().message;

  // The slot is reused under a new generation; the old id stays rejected.
  const seq_id c = t.acquire().value();
  EXPECT_EQ(t.slot(c, "x").value(), sa);
  EXPECT_NE(c, a);
  EXPECT_FALSE(t.slot(a, "x").has_value());
  EXPECT_EQ(t.slots(), 2u);
  // Many reuse cycles of one slot never revive an older id.
  std::vector<seq_id> old{a};
  seq_id cur = c;
  for (int i = 0; i < 1000; ++i) {
    t.release(t.slot(cur, "x").value());
    old.push_back(cur);
    cur = t.acquire().value();
  }
  EXPECT_EQ(t.slots(), 2u);
  for (seq_id o : old) EXPECT_FALSE(t.slot(o, "x").has_value());
  EXPECT_TRUE(t.slot(cur, "x").has_value());
  EXPECT_TRUE(t.slot(b, "x").has_value());
}

TEST(id_table, forged_ids_are_rejected) {
  kvcache::detail::id_table t;
  const seq_id a = t.acquire().value();
  EXPECT_FALSE(t.slot(seq_id{a.value + 1}, "x").has_value());                 // slot never used
  EXPECT_FALSE(t.slot(seq_id{a.value + (std::uint64_t{1} << 32)}, "x").has_value());  // future generation
  EXPECT_FALSE(t.slot(seq_id{~std::uint64_t{0}}, "x").has_value());
  EXPECT_TRUE(t.slot(a, "x").has_value());
}

TEST(id_table, capacity_is_enforced) {
  kvcache::detail::id_table t(3);
  std::vector<seq_id> ids;
  for (int i = 0; i < 3; ++i) ids.push_back(t.acquire().value());
  const auto full = t.acquire();
  ASSERT_FALSE(full.has_value());
  EXPECT_EQ(full.error().code, errc::capacity_exceeded);
  EXPECT_NE(full.error().message.find("max_sequences=3"), std::string::npos) << full.error().message;
  EXPECT_EQ(t.live(), 3u);
  t.release(t.slot(ids[1], "x").value());
  const auto again = t.acquire();
  ASSERT_TRUE(again.has_value());
  EXPECT_NE(again.value(), ids[1]);
  EXPECT_FALSE(t.acquire().has_value());
  EXPECT_EQ(t.slots(), 3u);

  kvcache::detail::id_table unbounded;
  std::set<std::uint64_t> distinct;
  for (int i = 0; i < 5000; ++i) distinct.insert(unbounded.acquire().value().value);
  EXPECT_EQ(distinct.size(), 5000u);
  EXPECT_EQ(unbounded.live(), 5000u);
}

}  // namespace
