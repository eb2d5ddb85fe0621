// Host-side validation of the CUDA launchers and runtime: every check here runs before any CUDA
// call, so this binary needs no device and runs (and must pass) on every machine with nvcc.
#include "cuda_test_util.hpp"

#include <kvcache/cuda/kernels.hpp>
#include <kvcache/cuda/runtime.hpp>

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <string>

namespace {

using kvcache::errc;
using kvcache::format;

// Never dereferenced: every call below fails validation before launching anything.
void* fake(std::uintptr_t i) { return reinterpret_cast<void*>(0x10000 + 0x100 * i); }
template <class T>
T* fake_as(std::uintptr_t i) { return static_cast<T*>(fake(i)); }

kvcache::device_table fake_table(std::uint32_t batch) {
  return {fake_as<const std::uint32_t>(1), fake_as<const std::uint32_t>(2), fake_as<const std::uint32_t>(3), batch};
}

kvcache::device_pages fake_pages(format f, std::uint32_t page_tokens) {
  kvcache::device_pages p;
  p.k = fake(4);
  p.v = fake(5);
  p.k_page_stride = p.v_page_stride = 1 << 20;
  p.k_head_stride = p.v_head_stride = 1 << 16;
  p.page_tokens = page_tokens;
  p.k_format = p.v_format = f;
  return p;
}

kvcache::attend_params valid_attend() {
  kvcache::attend_params p;
  p.pages[0] = fake_pages(format::f16, 16);
  p.tables[0] = fake_table(3);
  p.segments = 1;
  p.batch = 3;
  p.q_heads = 8;
  p.kv_heads = 2;
  p.head_dim = 64;
  p.q = fake_as<const float>(6);
  p.out = fake_as<float>(7);
  p.workspace = fake_as<float>(8);
  p.split_tokens = 256;
  p.max_splits[0] = 4;
  return p;
}

kvcache::append_params valid_append() {
  kvcache::append_params p;
  p.dst = fake_pages(format::f16, 16);
  p.table = fake_table(2);
  p.k = fake(9);
  p.v = fake(10);
  p.src_format = format::f32;
  p.src_indptr = fake_as<const std::uint32_t>(11);
  p.max_rows = 5;
  p.kv_heads = 2;
  p.head_dim = 64;
  return p;
}

kvcache::migrate_params valid_migrate() {
  kvcache::migrate_params p;
  p.src = fake_pages(format::f16, 32);
  p.dst = fake_pages(format::q4, 32);
  p.layers = 2;
  p.kv_heads = 2;
  p.head_dim = 64;
  p.count = 1;
  p.tokens = 32;
  return p;
}

template <class F>
void expect_error(errc code, F&& call, const char* what) {
  const kvcache::result<void> r = call();
  ASSERT_FALSE(r.has_value()) << what;
  EXPECT_EQ(r.error().code, code) << what << ": " << r.error().message;
  EXPECT_FALSE(r.error().message.empty()) << what;
}

TEST(cuda_validation, availability_is_reported_with_a_reason) {
  const kvcache::result<void> r = kvcache::cuda_available(0);
  if (r.has_value()) {
    // A usable device 0: an absurd index must still be refused, naming it.
    const kvcache::result<void> bad = kvcache::cuda_available(1 << 20);
    ASSERT_FALSE(bad.has_value());
    EXPECT_EQ(bad.error().code, errc::unsupported);
    EXPECT_NE(bad.error().message.find("device=1048576"), std::string::npos) << bad.error().message;
  } else {
    EXPECT_TRUE(r.error().code == errc::unsupported || r.error().code == errc::device_error) << r.error().message;
    EXPECT_FALSE(r.error().message.empty());
    std::printf("cuda_available(0): %s: %s\n", std::string(kvcache::to_string(r.error().code)).c_str(),
                r.error().message.c_str());
  }
  const kvcache::result<void> negative = kvcache::cuda_available(-1);
  EXPECT_FALSE(negative.has_value());
}

TEST(cuda_validation, runtime_rejects_bad_arguments_before_touching_the_device) {
  const kvcache::cuda where{};
  const kvcache::result<kvcache::device_buffer> zero = kvcache::device_buffer::make(where, 0);
  ASSERT_FALSE(zero.has_value());
  EXPECT_EQ(zero.error().code, errc::invalid_argument);
  int host = 0;
  expect_error(errc::invalid_argument, [&] { return kvcache::copy_to_device(where, nullptr, &host, 4); }, "copy_to_device null dst");
  expect_error(errc::invalid_argument, [&] { return kvcache::copy_to_host(where, &host, nullptr, 4); }, "copy_to_host null src");
  expect_error(errc::invalid_argument, [&] { return kvcache::fill_on_device(where, nullptr, 0, 4); }, "fill null");
  // Zero-byte copies are no-ops that succeed without a device.
  EXPECT_TRUE(kvcache::copy_on_device(where, nullptr, nullptr, 0).has_value());
  kvcache::device_arena empty;
  EXPECT_EQ(empty.capacity(), 0u);
  const kvcache::result<void*> none = empty.allocate(1);
  ASSERT_FALSE(none.has_value());
  EXPECT_EQ(none.error().code, errc::out_of_memory);
  const kvcache::result<void*> badalign = empty.allocate(1, 3);
  ASSERT_FALSE(badalign.has_value());
  EXPECT_EQ(badalign.error().code, errc::invalid_argument);
}

TEST(cuda_validation, append_parameters) {
  const kvcache::cuda where{};
  auto with = [&](auto mutate) {
    kvcache::append_params p = valid_append();
    mutate(p);
    return [p, where] { return kvcache::cuda_append(where, p); };
  };
  expect_error(errc::invalid_argument, with([](auto& p) { p.kv_heads = 0; }), "kv_heads 0");
  expect_error(errc::invalid_argument, with([](auto& p) { p.head_dim = 0; }), "head_dim 0");
  expect_error(errc::invalid_argument, with([](auto& p) { p.dst.k_format = format::q4; }), "q4 destination");
  expect_error(errc::invalid_argument, with([](auto& p) { p.src_format = format::q4; }), "q4 source");
  expect_error(errc::invalid_argument, with([](auto& p) { p.dst.page_tokens = 0; }), "page_tokens 0");
  expect_error(errc::invalid_argument, with([](auto& p) { p.k = nullptr; }), "null k");
  expect_error(errc::invalid_argument, with([](auto& p) { p.src_indptr = nullptr; }), "null src_indptr");
  expect_error(errc::invalid_argument, with([](auto& p) { p.table.batch = 0; }), "empty batch");
  expect_error(errc::invalid_argument, with([](auto& p) { p.kv_heads = 70000; }), "grid limit");
}

TEST(cuda_validation, attend_parameters) {
  const kvcache::cuda where{};
  auto with = [&](auto mutate) {
    kvcache::attend_params p = valid_attend();
    mutate(p);
    return [p, where] { return kvcache::cuda_attend(where, p); };
  };
  expect_error(errc::invalid_argument, with([](auto& p) { p.segments = 3; }), "segments");
  expect_error(errc::invalid_argument, with([](auto& p) { p.batch = 0; }), "batch 0");
  expect_error(errc::invalid_argument, with([](auto& p) { p.q_heads = 7; }), "q_heads not a multiple");
  expect_error(errc::unsupported, with([](auto& p) { p.head_dim = kvcache::cuda_max_head_dim + 1; }), "head_dim");
  expect_error(errc::invalid_argument, with([](auto& p) { p.split_tokens = 48; }), "split_tokens");
  expect_error(errc::invalid_argument, with([](auto& p) { p.prefetch_steps = 5; }), "prefetch_steps");
  expect_error(errc::invalid_argument, with([](auto& p) { p.workspace = nullptr; }), "workspace");
  expect_error(errc::unsupported, with([](auto& p) { p.pages[0].k_format = format::q4; }), "q4 with 16-token pages");
  expect_error(errc::invalid_argument, with([](auto& p) { p.tables[0].batch = 2; }), "table batch");
  {  // a null array of a segment table, named in the message
    kvcache::attend_params p = valid_attend();
    p.tables[0].indices = nullptr;
    const kvcache::result<void> r = kvcache::cuda_attend(where, p);
    ASSERT_FALSE(r.has_value());
    EXPECT_EQ(r.error().code, errc::invalid_argument);
    EXPECT_NE(r.error().message.find("indices_null=1"), std::string::npos) << r.error().message;
    EXPECT_NE(r.error().message.find("indptr_null=0"), std::string::npos) << r.error().message;
  }
  expect_error(errc::invalid_argument, with([](auto& p) { p.tables[0].indptr = nullptr; }), "null indptr");
  expect_error(errc::invalid_argument, with([](auto& p) { p.tables[0].last_page_len = nullptr; }), "null last_page_len");
  expect_error(errc::invalid_argument, with([](auto& p) { p.max_splits[0] = 0; }), "max_splits");
  expect_error(errc::invalid_argument, with([](auto& p) { p.segments = 2; }), "second segment missing");
  // Q4 pages: one whole group per kv head, 4-byte aligned.
  auto q4 = [](kvcache::attend_params& p) { p.pages[0] = fake_pages(format::q4, 32); };
  expect_error(errc::invalid_argument, with([&](auto& p) {
                 q4(p);
                 p.pages[0].k_head_stride = kvcache::q4_key_group_bytes(64) - 4;
               }), "q4 key head stride below one group");
  expect_error(errc::invalid_argument, with([&](auto& p) {
                 q4(p);
                 p.pages[0].v_head_stride = kvcache::q4_value_group_bytes(64) - 4;
               }), "q4 value head stride below one group");
  expect_error(errc::invalid_argument, with([&](auto& p) {
                 q4(p);
                 p.pages[0].k = static_cast<char*>(fake(4)) + 2;
               }), "misaligned q4 keys");
  expect_error(errc::invalid_argument, with([&](auto& p) {
                 q4(p);
                 p.pages[0].v_page_stride += 2;
               }), "misaligned q4 value pages");
}

TEST(cuda_validation, attend_workspace_bytes) {
  kvcache::attend_params p = valid_attend();
  EXPECT_EQ(kvcache::cuda_attend_workspace_bytes(p), 3u * 8u * 4u * (2u + 64u) * sizeof(float));
  p.segments = 2;
  p.max_splits[1] = 5;
  EXPECT_EQ(kvcache::cuda_attend_workspace_bytes(p), 3u * 8u * 9u * (2u + 64u) * sizeof(float));
}

TEST(cuda_validation, migrate_parameters) {
  const kvcache::cuda where{};
  auto with = [&](auto mutate) {
    kvcache::migrate_params p = valid_migrate();
    mutate(p);
    return [p, where] { return kvcache::cuda_migrate(where, p); };
  };
  expect_error(errc::invalid_argument, with([](auto& p) { p.count = 0; }), "count 0");
  expect_error(errc::invalid_argument, with([](auto& p) { p.count = kvcache::cuda_max_migrations + 1; }), "count");
  expect_error(errc::invalid_argument, with([](auto& p) { p.tokens = 33; }), "tokens 33");
  expect_error(errc::invalid_argument, with([](auto& p) { p.tokens = 0; }), "tokens 0");
  expect_error(errc::invalid_argument, with([](auto& p) { p.src.k_format = format::f32; }), "f32 source");
  expect_error(errc::invalid_argument, with([](auto& p) { p.dst.v_format = format::f32; }), "f32 destination");
  expect_error(errc::invalid_argument, with([](auto& p) { p.layers = 0; }), "layers 0");
  expect_error(errc::invalid_argument, with([](auto& p) { p.dst.k_head_stride = kvcache::q4_key_group_bytes(64) - 4; }),
               "q4 key head stride below one group");
  expect_error(errc::invalid_argument, with([](auto& p) { p.dst.v_head_stride = kvcache::q4_value_group_bytes(64) - 4; }),
               "q4 value head stride below one group");
  expect_error(errc::invalid_argument, with([](auto& p) { p.dst_layer_stride_v = 6; }), "misaligned q4 value layers");
  expect_error(errc::invalid_argument, with([](auto& p) { p.dst.k = static_cast<char*>(fake(4)) + 1; }), "misaligned q4 keys");
}

// The automatic split of the caches' attend(): the largest of 1024 ... 32 tokens that still gives
// every multiprocessor a block (groups of 8 query heads count as blocks too).
TEST(cuda_validation, automatic_split_fills_the_multiprocessors) {
  using kvcache::cuda_auto_split_tokens;
  // 8 sequences x 8 kv heads x 32 splits of 1024 tokens: 2048 blocks.
  EXPECT_EQ(cuda_auto_split_tokens(32768, 8, 8, 32, 132), 1024u);
  // 1 x 8 x 32 = 256 blocks >= 132 at 1024; 4096 tokens: 1024 -> 32 blocks ... 128 -> 256.
  EXPECT_EQ(cuda_auto_split_tokens(32768, 1, 8, 32, 132), 1024u);
  EXPECT_EQ(cuda_auto_split_tokens(4096, 1, 8, 32, 132), 128u);
  EXPECT_EQ(cuda_auto_split_tokens(4096, 8, 8, 32, 132), 1024u);
  // Exactly one block per multiprocessor is enough: 1 x 8 x ceil(4096 / 256) = 128 blocks.
  EXPECT_EQ(cuda_auto_split_tokens(4096, 1, 8, 32, 128), 256u);
  EXPECT_EQ(cuda_auto_split_tokens(4096, 1, 8, 32, 129), 128u);
  // gqa 12 runs in two groups of query heads: twice the blocks of gqa 8.
  EXPECT_EQ(cuda_auto_split_tokens(4096, 1, 8, 96, 132), 256u);
  EXPECT_EQ(cuda_auto_split_tokens(4096, 1, 8, 64, 132), 128u);
  // Short sequences or a huge device: never below 32 tokens; an empty cover: 32.
  EXPECT_EQ(cuda_auto_split_tokens(40, 1, 1, 1, 132), 32u);
  EXPECT_EQ(cuda_auto_split_tokens(0, 4, 8, 32, 132), 32u);
  // A small device (or none reported): the largest split.
  EXPECT_EQ(cuda_auto_split_tokens(100, 1, 1, 1, 1), 1024u);
  EXPECT_EQ(cuda_auto_split_tokens(100, 1, 1, 1, 0), 1024u);
  EXPECT_EQ(cuda_auto_split_tokens(100, 1, 1, 1, -5), 1024u);
  // One step of L2 prefetch for long splits in grids of one wave at 3 blocks per SM, none for
  // short splits or larger grids (kernels.hpp says why).
  using kvcache::cuda_attend_blocks;
  using kvcache::cuda_auto_prefetch_steps;
  EXPECT_EQ(cuda_attend_blocks(8, 8, 32, 32), 2048u);  // 32k x 8 in 1024-token splits
  EXPECT_EQ(cuda_attend_blocks(1, 8, 96, 4), 64u);     // 12 query heads a kv head: 2 groups of 8
  EXPECT_EQ(cuda_attend_blocks(3, 0, 0, 5), 0u);
  EXPECT_EQ(cuda_auto_prefetch_steps(1024, 256, 132), 1u);   // 4k x 8, 32k x 1
  EXPECT_EQ(cuda_auto_prefetch_steps(1024, 512, 132), 0u);   // 32k x 2
  EXPECT_EQ(cuda_auto_prefetch_steps(1024, 2048, 132), 0u);  // 32k x 8
  EXPECT_EQ(cuda_auto_prefetch_steps(128, 256, 132), 0u);    // 4k x 1
  EXPECT_EQ(cuda_auto_prefetch_steps(256, 396, 132), 1u);
  EXPECT_EQ(cuda_auto_prefetch_steps(256, 397, 132), 0u);
  EXPECT_EQ(cuda_auto_prefetch_steps(224, 64, 132), 0u);
  EXPECT_EQ(cuda_auto_prefetch_steps(1024, 1, 0), 0u);
  EXPECT_EQ(cuda_auto_prefetch_steps(1024, 1, -3), 0u);
  // Loads that skip L1 past one wave of 4 blocks per SM (kernels.hpp says why).
  using kvcache::cuda_auto_bypass_l1;
  EXPECT_TRUE(cuda_auto_bypass_l1(2048, 132));    // 32k x 8
  EXPECT_TRUE(cuda_auto_bypass_l1(1024, 132));    // 32k x 4
  EXPECT_TRUE(cuda_auto_bypass_l1(529, 132));
  EXPECT_FALSE(cuda_auto_bypass_l1(528, 132));
  EXPECT_FALSE(cuda_auto_bypass_l1(512, 132));    // 32k x 2
  EXPECT_FALSE(cuda_auto_bypass_l1(256, 132));    // 4k x 1, 4k x 8, 32k x 1
  EXPECT_FALSE(cuda_auto_bypass_l1(1 << 20, 0));  // no device reported
  EXPECT_FALSE(cuda_auto_bypass_l1(1 << 20, -1));
}

}  // namespace
