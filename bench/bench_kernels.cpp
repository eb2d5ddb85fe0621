// The CPU kernels of every ISA this machine supports: BM_<op>/<format>/<isa>[/nq:N].
// Working sets are sized past the caches for the streaming kernels (conversions, scores,
// accumulate: 8 KV heads x 32k tokens x 128 channels) and to a migration batch for Q4
// quantization. Bytes = what the kernel must read + write; items = values (codecs) or tokens.
#include "bench_common.hpp"

#include <kvcache/detail/storage.hpp>
#include <kvcache/format.hpp>
#include <kvcache/kernels.hpp>
#include <kvcache/two_tier_cache.hpp>

#include <algorithm>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace {

using kvcache::half;
using kvcache::isa;
namespace kernels = kvcache::kernels;
namespace kb = kvcache::bench;

constexpr std::uint32_t head_dim = 128;
constexpr std::uint32_t heads = 8;
constexpr std::uint32_t ctx_tokens = 32768;                          // per head
constexpr std::size_t ctx_values = std::size_t{heads} * ctx_tokens * head_dim;  // 32 Mi values
constexpr std::uint32_t ctx_groups = ctx_tokens / kvcache::q4_group;  // key groups per head
constexpr std::size_t convert_n = std::size_t{16} << 20;            // 16 Mi values

// Lazily built, shared inputs. // [head][token][head_dim]
const half* f16_cache() {
  static const kb::buffer b = [] {
    kb::buffer x(ctx_values * sizeof(half));
    kb::fill_normal(x.as<half>(), ctx_values);
    return x;
  }();
  return b.as<half>();
}
const float* f32_cache() {
  static const kb::buffer b = [] {
    kb::buffer x(ctx_values * sizeof(float));
    kb::fill_normal(x.as<float>(), ctx_values);
    return x;
  }();
  return b.as<float>();
}
// Q4 groups (format.hpp), keys and values alike: [head][group] groups of key_group / value_group bytes.
constexpr std::size_t key_group = kvcache::q4_key_group_bytes(head_dim);
constexpr std::size_t value_group = kvcache::q4_value_group_bytes(head_dim);
kb::buffer make_q4_groups(bool values) {
  const std::size_t bytes = values ? value_group : key_group;
  kb::buffer x(std::size_t{heads} * ctx_groups * bytes);
  const half* src = f16_cache();
  const kernels::table& t = *kernels::find(isa::scalar);
  for (std::size_t g = 0; g < std::size_t{heads} * ctx_groups; ++g) {
    auto* dst = x.as<std::uint8_t>() + g * bytes;
    if (values) t.quantize_values(src + g * 32 * head_dim, head_dim, 32, head_dim, dst);
    else t.quantize_keys(src + g * 32 * head_dim, head_dim, 32, head_dim, dst);
  }
  return x;
}
const std::uint8_t* q4_keys() {
  static const kb::buffer b = make_q4_groups(false);
  return b.as<std::uint8_t>();
}
const std::uint8_t* q4_values() {
  static const kb::buffer b = make_q4_groups(true);
  return b.as<std::uint8_t>();
}

std::int64_t i64(std::size_t v) { return static_cast<std::int64_t>(v); }

void f32_to_f16(benchmark::State& s, const kernels::table* t) {
  const float* src = f32_cache();
  kb::buffer dst(convert_n * sizeof(half));
  for (auto _ : s) {
    t->f32_to_f16(src, dst.as<half>(), convert_n);
    benchmark::ClobberMemory();
  }
  s.SetBytesProcessed(i64(s.iterations()) * i64(convert_n * 6));
  s.SetItemsProcessed(i64(s.iterations()) * i64(convert_n));
  kb::compare_to_memcpy(s);
}

void f16_to_f32(benchmark::State& s, const kernels::table* t) {
  const half* src = f16_cache();
  kb::buffer dst(convert_n * sizeof(float));
  for (auto _ : s) {
    t->f16_to_f32(src, dst.as<float>(), convert_n);
    benchmark::ClobberMemory();
  }
  s.SetBytesProcessed(i64(s.iterations()) * i64(convert_n * 6));
  s.SetItemsProcessed(i64(s.iterations()) * i64(convert_n));
  kb::compare_to_memcpy(s);
}

// Q4 migration: groups of 32 tokens x 128 channels, 4 Mi values (8 MiB of f16) per pass, the
// source streamed from memory (or the last-level cache). The .../l2 variants run 64 groups
// (512 KiB of f16), which stay in a 1 MiB L2: the kernel's own speed, without the memory's.
constexpr std::size_t migrate_groups = 1024;
constexpr std::size_t migrate_groups_l2 = 64;

void quantize_keys(benchmark::State& s, const kernels::table* t, std::size_t groups) {
  const half* src = f16_cache();
  kb::buffer dst(groups * key_group);
  for (auto _ : s) {
    for (std::size_t g = 0; g < groups; ++g)
      t->quantize_keys(src + g * 32 * head_dim, head_dim, 32, head_dim, dst.as<std::uint8_t>() + g * key_group);
    benchmark::ClobberMemory();
  }
  const std::size_t values = groups * 32 * head_dim;
  s.SetItemsProcessed(i64(s.iterations()) * i64(values));
  s.SetBytesProcessed(i64(s.iterations()) * i64(values * 2 + groups * key_group));
  kb::compare_to_memcpy(s);
}

void quantize_values(benchmark::State& s, const kernels::table* t, std::size_t groups) {
  const half* src = f16_cache();
  kb::buffer dst(groups * value_group);
  for (auto _ : s) {
    for (std::size_t g = 0; g < groups; ++g)
      t->quantize_values(src + g * 32 * head_dim, head_dim, 32, head_dim, dst.as<std::uint8_t>() + g * value_group);
    benchmark::ClobberMemory();
  }
  const std::size_t values = groups * 32 * head_dim;
  s.SetItemsProcessed(i64(s.iterations()) * i64(values));
  s.SetBytesProcessed(i64(s.iterations()) * i64(values * 2 + groups * value_group));
  kb::compare_to_memcpy(s);
}

void dequantize_keys(benchmark::State& s, const kernels::table* t) {
  const std::uint8_t* src = q4_keys();
  kb::buffer dst(std::size_t{32} * head_dim * sizeof(float));
  for (auto _ : s) {
    for (std::size_t g = 0; g < migrate_groups; ++g)
      t->dequantize_keys(src + g * key_group, 32, head_dim, dst.as<float>(), head_dim);
    benchmark::ClobberMemory();
  }
  const std::size_t values = migrate_groups * 32 * head_dim;
  s.SetItemsProcessed(i64(s.iterations()) * i64(values));
  s.SetBytesProcessed(i64(s.iterations()) * i64(migrate_groups * key_group));
}

// Decode attention inner products over one layer: 8 KV heads x 32k tokens, nq queries per head.
template <class K>
void scores_dense(benchmark::State& s, const kernels::table* t, std::uint32_t nq) {
  const K* k;
  if constexpr (std::is_same_v<K, half>) k = f16_cache();
  else k = f32_cache();
  kb::buffer q(std::size_t{nq} * head_dim * sizeof(float)), out(std::size_t{nq} * ctx_tokens * sizeof(float));
  kb::fill_normal(q.as<float>(), std::size_t{nq} * head_dim);
  for (auto _ : s) {
    for (std::uint32_t h = 0; h < heads; ++h) {
      const K* kh = k + std::size_t{h} * ctx_tokens * head_dim;
      if constexpr (std::is_same_v<K, half>)
        t->scores_f16(q.as<float>(), nq, kh, ctx_tokens, head_dim, out.as<float>(), ctx_tokens, {});
      else
        t->scores_f32(q.as<float>(), nq, kh, ctx_tokens, head_dim, out.as<float>(), ctx_tokens, {});
    }
    benchmark::ClobberMemory();
  }
  s.SetBytesProcessed(i64(s.iterations()) * i64(ctx_values * sizeof(K)));
  s.SetItemsProcessed(i64(s.iterations()) * i64(std::size_t{heads} * ctx_tokens));
}

template <class V>
void accumulate_dense(benchmark::State& s, const kernels::table* t, std::uint32_t nq) {
  const V* v;
  if constexpr (std::is_same_v<V, half>) v = f16_cache();
  else v = f32_cache();
  kb::buffer p(std::size_t{nq} * ctx_tokens * sizeof(float)), acc(std::size_t{nq} * head_dim * sizeof(float));
  kb::fill_normal(p.as<float>(), std::size_t{nq} * ctx_tokens, 0.01f);
  for (auto _ : s) {
    for (std::uint32_t h = 0; h < heads; ++h) {
      const V* vh = v + std::size_t{h} * ctx_tokens * head_dim;
      if constexpr (std::is_same_v<V, half>)
        t->accumulate_f16(p.as<float>(), ctx_tokens, nq, vh, ctx_tokens, head_dim, acc.as<float>(), {});
      else
        t->accumulate_f32(p.as<float>(), ctx_tokens, nq, vh, ctx_tokens, head_dim, acc.as<float>(), {});
    }
    benchmark::ClobberMemory();
  }
  s.SetBytesProcessed(i64(s.iterations()) * i64(ctx_values * sizeof(V)));
  s.SetItemsProcessed(i64(s.iterations()) * i64(std::size_t{heads} * ctx_tokens));
}

void scores_q4(benchmark::State& s, const kernels::table* t, std::uint32_t nq) {
  const std::uint8_t* k = q4_keys();
  kb::buffer q(std::size_t{nq} * head_dim * sizeof(float)), out(std::size_t{nq} * ctx_tokens * sizeof(float));
  kb::fill_normal(q.as<float>(), std::size_t{nq} * head_dim);
  for (auto _ : s) {
    for (std::uint32_t h = 0; h < heads; ++h)
      for (std::uint32_t g = 0; g < ctx_groups; ++g)
        t->scores_q4(q.as<float>(), nq, k + (std::size_t{h} * ctx_groups + g) * key_group, 32, head_dim,
                     out.as<float>() + g * 32, ctx_tokens, {});
    benchmark::ClobberMemory();
  }
  s.SetBytesProcessed(i64(s.iterations()) * i64(std::size_t{heads} * ctx_groups * key_group));
  s.SetItemsProcessed(i64(s.iterations()) * i64(std::size_t{heads} * ctx_tokens));
}

void accumulate_q4(benchmark::State& s, const kernels::table* t, std::uint32_t nq) {
  const std::uint8_t* v = q4_values();
  kb::buffer p(std::size_t{nq} * ctx_tokens * sizeof(float)), acc(std::size_t{nq} * head_dim * sizeof(float));
  kb::fill_normal(p.as<float>(), std::size_t{nq} * ctx_tokens, 0.01f);
  for (auto _ : s) {
    for (std::uint32_t h = 0; h < heads; ++h)
      for (std::uint32_t g = 0; g < ctx_groups; ++g)
        t->accumulate_q4(p.as<float>() + g * 32, ctx_tokens, nq, v + (std::size_t{h} * ctx_groups + g) * value_group, 0,
                         32, head_dim, acc.as<float>(), {});
    benchmark::ClobberMemory();
  }
  s.SetBytesProcessed(i64(s.iterations()) * i64(std::size_t{heads} * ctx_groups * value_group));
  s.SetItemsProcessed(i64(s.iterations()) * i64(std::size_t{heads} * ctx_tokens));
}

// table::attend_q4, nq queries of one kv head, `per_call` groups of 32 tokens a call (g:1, g:2;
// attend() takes them two at a time, one softmax tile): over every head's groups of the 32k
// context (streamed from memory), or over `cached_groups` of one head again and again (in L2: the
// kernel's compute alone). q gives base-2 logits of the spread a 1 / sqrt(head_dim) scale makes.
constexpr std::uint32_t cached_groups = 8;
void attend_step_q4(benchmark::State& s, const kernels::table* t, std::uint32_t nq, bool cached, std::uint32_t per_call) {
  const std::uint8_t* k = q4_keys();
  const std::uint8_t* v = q4_values();
  kb::buffer q(std::size_t{nq} * head_dim * sizeof(float)), acc(std::size_t{nq} * head_dim * sizeof(float)),
      run(std::size_t{2} * nq * sizeof(float));
  kb::fill_normal(q.as<float>(), std::size_t{nq} * head_dim, 1.4427f / 11.3f);
  float* run_max = run.as<float>();
  float* run_sum = run_max + nq;
  const std::uint32_t groups = cached ? cached_groups : ctx_groups, hs = cached ? 1 : heads;
  std::size_t steps = 0;
  for (auto _ : s) {
    for (std::uint32_t h = 0; h < hs; ++h) {
      for (std::uint32_t i = 0; i < nq; ++i) {
        run_max[i] = -std::numeric_limits<float>::infinity();
        run_sum[i] = 0.0f;
      }
      std::fill_n(acc.as<float>(), std::size_t{nq} * head_dim, 0.0f);
      for (std::uint32_t g = 0; g < groups; g += per_call) {
        kernels::q4_group_ref gr[2];
        for (std::uint32_t j = 0; j < per_call; ++j) {
          const std::size_t at = std::size_t{h} * ctx_groups + g + j;
          gr[j] = {k + at * key_group, v + at * value_group, 32};
        }
        t->attend_q4(q.as<float>(), nq, gr, per_call, head_dim, run_max, run_sum, acc.as<float>());
      }
      steps += groups;
    }
    benchmark::ClobberMemory();
  }
  s.SetBytesProcessed(i64(steps * (key_group + value_group)));
  s.SetItemsProcessed(i64(steps * 32));
}

// table::attend_q4 as attend() drives it over a two-tier store at 32k (one layer a step, the layers
// in turn, as BM_attend/two_tier reads them): the store in
// slabs of slab_groups group slots, as the cache lays them out ([kv head][slab_groups]{key group,
// value group} a slab, slab_groups as the cache picks it for this shape), read head by
// head, `per_call` groups a call, each group with the next call's group in its place as its ahead
// group (q4_group_ref: of the same head; after a head's last call, the next head's first groups),
// as attend hands them over. Against /l2 (the same step on cached
// groups) this is what streaming the store costs the step, and against BM_attend/two_tier what
// attend adds to it. The store lies on huge pages as the cache's slabs do: on 4 KiB pages the
// stream ran 0.8 times as fast as /l2, on huge pages 0.96 (session 14, an older layout, one layer
// that the L3 may have kept).
void attend_step_q4_stream(benchmark::State& s, const kernels::table* t, std::uint32_t nq, std::uint32_t per_call) {
  constexpr std::size_t pair = key_group + value_group;
  // The cache's own choice for one layer of these heads (settings().slab_groups).
  static const std::size_t slab_groups = [] {
    kvcache::two_tier_config tc;
    tc.shape = {1, heads, head_dim};
    const auto c = kvcache::two_tier_cache<>::create(tc);
    return c ? std::size_t{c->settings().slab_groups} : std::size_t{16};
  }();
  const std::size_t slab_bytes = slab_groups * heads * pair;
  const std::size_t slabs = (ctx_groups + slab_groups - 1) / slab_groups;
  // Group g of head h.
  auto at = [slab_bytes](const std::uint8_t* base, std::size_t h, std::size_t g) {
    return base + g / slab_groups * slab_bytes + (h * slab_groups + g % slab_groups) * pair;
  };
  // Allocated as the two-tier cache allocates its store slabs (huge pages advised); as many
  // copies (layers) as make bench::stream_bytes(), read in turn, so that the store streams from
  // memory: one layer at 32k is 40 MiB, which session 42's Intel VM kept in its L3 (there, in
  // session 43, /stream read one layer at 112 M tokens/s, 0.94 of /l2; four in turn at 75, 0.64).
  static const std::vector<kvcache::detail::storage> stores = [&] {
    std::vector<kvcache::detail::storage> v;
    const std::size_t bytes = slabs * slab_bytes, copies = kb::layers_for_bytes(bytes);
    for (std::size_t c = 0; c < copies; ++c) {
      kvcache::detail::storage x = kvcache::detail::allocate_storage(bytes);
      if (!x) return std::vector<kvcache::detail::storage>{};
      for (std::size_t h = 0; h < heads; ++h)
        for (std::size_t g = 0; g < ctx_groups; ++g) {
          auto* dst = const_cast<std::uint8_t*>(at(reinterpret_cast<const std::uint8_t*>(x.get()), h, g));
          std::copy_n(q4_keys() + (h * ctx_groups + g) * key_group, key_group, dst);
          std::copy_n(q4_values() + (h * ctx_groups + g) * value_group, value_group, dst + key_group);
        }
      v.push_back(std::move(x));
    }
    return v;
  }();
  if (stores.empty()) return s.SkipWithError("out of memory");
  const std::size_t per_head = std::size_t{nq} * head_dim;
  kb::buffer q(heads * per_head * sizeof(float)), acc(heads * per_head * sizeof(float)),
      run(std::size_t{2} * heads * nq * sizeof(float));
  kb::fill_normal(q.as<float>(), heads * per_head, 1.4427f / 11.3f);
  std::size_t layer = 0;
  for (auto _ : s) {
    const auto* base = reinterpret_cast<const std::uint8_t*>(stores[layer++ % stores.size()].get());
    float* run_max = run.as<float>();
    float* run_sum = run_max + heads * nq;
    std::fill_n(run_max, heads * nq, -std::numeric_limits<float>::infinity());
    std::fill_n(run_sum, heads * nq, 0.0f);
    std::fill_n(acc.as<float>(), heads * per_head, 0.0f);
    for (std::size_t h = 0; h < heads; ++h)
      for (std::size_t g = 0; g < ctx_groups; g += per_call) {
        // Ahead of each group: the next call's group in its place, of this head, else the next
        // head's first ones.
        const std::size_t nh = g + per_call < ctx_groups ? h : h + 1, ng = g + per_call < ctx_groups ? g + per_call : 0;
        kernels::q4_group_ref gr[2];
        for (std::size_t j = 0; j < per_call; ++j) {
          const std::uint8_t* p = at(base, h, g + j);
          const std::uint8_t* a = nh < heads && ng + j < ctx_groups ? at(base, nh, ng + j) : nullptr;
          gr[j] = {p, p + key_group, 32, a, a == nullptr ? nullptr : a + key_group};
        }
        t->attend_q4(q.as<float>() + h * per_head, nq, gr, per_call, head_dim, run_max + h * nq, run_sum + h * nq,
                     acc.as<float>() + h * per_head);
      }
    benchmark::ClobberMemory();
  }
  s.SetBytesProcessed(i64(s.iterations()) * i64(std::size_t{ctx_groups} * heads * pair));
  s.SetItemsProcessed(i64(s.iterations()) * i64(std::size_t{ctx_groups} * heads * 32));
}

template <class F>
void add(const std::string& name, F f) {
  benchmark::RegisterBenchmark(name.c_str(), f)->UseRealTime()->Unit(benchmark::kMillisecond);
}

[[maybe_unused]] const bool registered = [] {
  for (isa i : {isa::scalar, isa::avx2, isa::avx512, isa::neon}) {
    const kernels::table* t = kernels::find(i);
    if (t == nullptr) continue;
    const std::string is(kvcache::to_string(i));
    add("BM_f32_to_f16/" + is, [t](benchmark::State& s) { f32_to_f16(s, t); });
    add("BM_f16_to_f32/" + is, [t](benchmark::State& s) { f16_to_f32(s, t); });
    add("BM_quantize_keys/q4/" + is, [t](benchmark::State& s) { quantize_keys(s, t, migrate_groups); });
    add("BM_quantize_values/q4/" + is, [t](benchmark::State& s) { quantize_values(s, t, migrate_groups); });
    add("BM_quantize_keys/q4/" + is + "/l2", [t](benchmark::State& s) { quantize_keys(s, t, migrate_groups_l2); });
    add("BM_quantize_values/q4/" + is + "/l2",
        [t](benchmark::State& s) { quantize_values(s, t, migrate_groups_l2); });
    add("BM_dequantize_keys/q4/" + is, [t](benchmark::State& s) { dequantize_keys(s, t); });
    for (std::uint32_t nq : {1u, 4u, 8u}) {
      const std::string suffix = is + "/nq:" + std::to_string(nq);
      add("BM_scores/f16/" + suffix, [t, nq](benchmark::State& s) { scores_dense<half>(s, t, nq); });
      add("BM_scores/f32/" + suffix, [t, nq](benchmark::State& s) { scores_dense<float>(s, t, nq); });
      add("BM_scores/q4/" + suffix, [t, nq](benchmark::State& s) { scores_q4(s, t, nq); });
      add("BM_accumulate/f16/" + suffix, [t, nq](benchmark::State& s) { accumulate_dense<half>(s, t, nq); });
      add("BM_accumulate/f32/" + suffix, [t, nq](benchmark::State& s) { accumulate_dense<float>(s, t, nq); });
      add("BM_accumulate/q4/" + suffix, [t, nq](benchmark::State& s) { accumulate_q4(s, t, nq); });
    }
    if (t->attend_q4 != nullptr) {
      for (std::uint32_t nq : {1u, 4u}) {
        const std::string suffix = is + "/nq:" + std::to_string(nq);
        for (std::uint32_t g : {1u, 2u}) {
          const std::string gs = "/g:" + std::to_string(g);
          add("BM_attend_step/q4/" + suffix + "/l2" + gs, [t, nq, g](benchmark::State& s) { attend_step_q4(s, t, nq, true, g); });
          add("BM_attend_step/q4/" + suffix + "/dram" + gs,
              [t, nq, g](benchmark::State& s) { attend_step_q4(s, t, nq, false, g); });
          add("BM_attend_step/q4/" + suffix + "/stream" + gs,
              [t, nq, g](benchmark::State& s) { attend_step_q4_stream(s, t, nq, g); });
        }
      }
    }
    // Where the fastest table is int8 for Q4, the float Q4 kernels too, and the int8 ones without
    // VNNI (AVX2: vpmaddubsw) where the CPU has VNNI, and without VBMI (AVX-512: two vpmovdb for
    // one vpermt2b) where it has VBMI, to compare.
    const kernels::table* tf = kernels::find(i, kernels::q4_arith::float32);
    const kernels::table* tp = kernels::find_without_vnni(i);
    const kernels::table* tv = kernels::find_without_vbmi(i);
    for (const auto& variant :
         {std::pair{tf, "_float32"}, std::pair{tp, "_int8_novnni"}, std::pair{tv, "_int8_novbmi"}}) {
      const kernels::table* other = variant.first;  // a variable, not a binding: clang 14 captures no bindings
      const char* name = variant.second;
      if (other == nullptr || other == t) continue;
      for (std::uint32_t nq : {1u, 4u, 8u}) {
        const std::string suffix = is + name + "/nq:" + std::to_string(nq);
        add("BM_scores/q4/" + suffix, [other, nq](benchmark::State& s) { scores_q4(s, other, nq); });
        add("BM_accumulate/q4/" + suffix, [other, nq](benchmark::State& s) { accumulate_q4(s, other, nq); });
      }
      if (other->attend_q4 != nullptr)
        for (std::uint32_t g : {1u, 2u})
          add("BM_attend_step/q4/" + is + name + "/nq:4/l2/g:" + std::to_string(g),
              [other, g](benchmark::State& s) { attend_step_q4(s, other, 4, true, g); });
    }
  }
  return true;
}();

}  // namespace
