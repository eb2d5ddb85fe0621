// kvcache_cuda_bench: bandwidth of the CUDA kernels as a fraction of the device-to-device copy
// bandwidth measured in the same run (run by scripts/gpu/check.sh; figures in cuda/README.md).
//
//   BM_cuda_memcpy_d2d/<MiB>              cudaMemcpyAsync device to device; bytes = read + write
//   BM_cuda_append/<cache>/<src>/<store>  one append launch of a decode step (one new token for each
//                                         of 64 sequences); bytes = rows read + rows written
//   BM_cuda_attend/<cache>/<format>/<tokens>  decode attention, 8 KV heads x 128, 32 query heads,
//                                         batch 1 and 8; bytes = K + V bytes read
// Every timing comes from CUDA events around the launches (UseManualTime); the counter
// `of_d2d` is the benchmark's bytes/s divided by the largest BM_cuda_memcpy_d2d bandwidth, which
// is measured first. DESIGN.md's target: attention >= 0.85 of the copy bandwidth on H100/H200.
//
// Not here: the comparison with torch.nn.functional.scaled_dot_product_attention, which
// scripts/gpu/sdpa_baseline.py measures on the same shapes where python3 has torch.
#include <kvcache/cuda/kernels.hpp>
#include <kvcache/cuda/runtime.hpp>
#include <kvcache/format.hpp>
#include <kvcache/half.hpp>

#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

// l2_flush.cu: reads `bytes` at `buffer` (a kernel on the default stream).
void bench_read_flush(const void* buffer, std::size_t bytes, unsigned* sink);

namespace {

using kvcache::format;

// Where bench_read_flush may write (it never does: the flush buffers are zeroed).
unsigned* flush_sink() {
  static unsigned* sink = [] {
    void* p = nullptr;
    return cudaMalloc(&p, sizeof(unsigned)) == cudaSuccess ? static_cast<unsigned*>(p) : nullptr;
  }();
  return sink;
}

// Largest device-to-device copy bandwidth seen in this run (bytes/s, read + write).
double g_d2d_bandwidth = 0.0;

// A working set smaller than this may be served from L2 (50 MB on an H100, 60 MB on an H200)
// when the same buffers are read over and over: such benchmarks read a flush buffer of this size
// before each timed launch (outside the events), so that every launch reads device memory. A
// read (bench_read_flush, l2_flush.cu), not a memset: a memset leaves L2 full of dirty lines,
// which the timed launch then writes back to HBM as its reads evict them.
constexpr std::size_t kFlushBytes = std::size_t{256} << 20;

// Times `launch` with CUDA events for every benchmark iteration; with `flush`, reads kFlushBytes
// there before each launch, outside the timed events.
template <class F>
void time_with_events(benchmark::State& state, F&& launch, void* flush = nullptr) {
  cudaEvent_t start = nullptr, stop = nullptr;
  if (cudaEventCreate(&start) != cudaSuccess || cudaEventCreate(&stop) != cudaSuccess) {
    state.SkipWithError("cudaEventCreate failed");
    return;
  }
  if (!launch()) {  // warm-up, and a check that the launch is accepted
    state.SkipWithError("launch failed");
    return;
  }
  (void)cudaDeviceSynchronize();
  for (auto _ : state) {
    if (flush != nullptr) bench_read_flush(flush, kFlushBytes, flush_sink());
    (void)cudaEventRecord(start, nullptr);
    launch();
    (void)cudaEventRecord(stop, nullptr);
    (void)cudaEventSynchronize(stop);
    float ms = 0.0f;
    (void)cudaEventElapsedTime(&ms, start, stop);
    state.SetIterationTime(static_cast<double>(ms) * 1e-3);
  }
  (void)cudaEventDestroy(start);
  (void)cudaEventDestroy(stop);
}

void report(benchmark::State& state, double bytes_per_iteration) {
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes_per_iteration * static_cast<double>(state.iterations())));
  state.counters["of_d2d"] = benchmark::Counter(
      g_d2d_bandwidth > 0.0 ? bytes_per_iteration / g_d2d_bandwidth : 0.0,
      benchmark::Counter::kIsIterationInvariantRate);  // per second of manual (event) time
}

void* device_alloc(std::size_t bytes) {
  void* p = nullptr;
  if (cudaMalloc(&p, bytes) != cudaSuccess) return nullptr;
  (void)cudaMemset(p, 0, bytes);
  return p;
}

// Fills device memory with valid f16 values in [-1, 1] (so attention reads finite numbers): a
// 2 MiB random pattern, copied over the whole range (fast even for 1 GiB caches). Q4 pages are
// filled the same way: every 16-bit word is a valid f16 scale or minimum, every nibble a code.
void fill_halves(void* dst, std::size_t count) {
  static const std::vector<kvcache::half> pattern = [] {
    std::vector<kvcache::half> h(std::size_t{1} << 20);
    std::mt19937 gen(1);
    std::uniform_real_distribution<float> d(-1.0f, 1.0f);
    for (auto& x : h) x = kvcache::to_half(d(gen));
    return h;
  }();
  auto* out = static_cast<kvcache::half*>(dst);
  for (std::size_t done = 0; done < count; done += pattern.size())
    (void)cudaMemcpy(out + done, pattern.data(), std::min(pattern.size(), count - done) * sizeof(kvcache::half),
                     cudaMemcpyHostToDevice);
}

void fill_floats(float* dst, std::size_t count, unsigned seed) {
  std::vector<float> h(count);
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  for (auto& x : h) x = d(gen);
  (void)cudaMemcpy(dst, h.data(), count * sizeof(float), cudaMemcpyHostToDevice);
}

void BM_cuda_memcpy_d2d(benchmark::State& state) {
  const std::size_t bytes = static_cast<std::size_t>(state.range(0)) << 20;
  void* a = device_alloc(bytes);
  void* b = device_alloc(bytes);
  if (a == nullptr || b == nullptr) {
    state.SkipWithError("cudaMalloc failed");
    return;
  }
  time_with_events(state, [&] { return cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, nullptr) == cudaSuccess; });
  const double moved = 2.0 * static_cast<double>(bytes);
  state.SetBytesProcessed(static_cast<std::int64_t>(moved * static_cast<double>(state.iterations())));
  (void)cudaFree(a);
  (void)cudaFree(b);
}

// Paged layout of `seqs` sequences of `tokens` tokens each in pages of `page` tokens (f16 or q4),
// pages shuffled across the pool, CSR table in device memory.
struct paged_fixture {
  std::uint32_t kv_heads = 8, head_dim = 128, page = 16, seqs = 1, tokens = 0;
  format fmt = format::f16;
  void* k = nullptr;
  void* v = nullptr;
  std::uint32_t* indptr = nullptr;
  std::uint32_t* indices = nullptr;
  std::uint32_t* last = nullptr;
  std::size_t k_head = 0, v_head = 0, pages = 0;
  double kv_bytes = 0.0;  // bytes attention reads

  bool make() {
    const std::uint32_t per_seq = (tokens + page - 1) / page;
    pages = static_cast<std::size_t>(per_seq) * seqs;
    if (fmt == format::q4) {  // page == 32: one key group and one value group per kv head (format.hpp)
      k_head = kvcache::q4_key_group_bytes(head_dim);
      v_head = kvcache::q4_value_group_bytes(head_dim);
    } else {
      k_head = v_head = static_cast<std::size_t>(page) * head_dim * kvcache::dense_element_bytes(fmt);
    }
    const std::size_t kb = k_head * kv_heads * pages, vb = v_head * kv_heads * pages;
    k = device_alloc(kb);
    v = device_alloc(vb);
    if (k == nullptr || v == nullptr) return false;
    fill_halves(k, kb / 2);  // f16 or q4 pages: random, valid, never zeros
    fill_halves(v, vb / 2);
    std::vector<std::uint32_t> ip{0}, ix(pages), la;
    std::iota(ix.begin(), ix.end(), 0u);
    std::shuffle(ix.begin(), ix.end(), std::mt19937(2));
    for (std::uint32_t s = 0; s < seqs; ++s) {
      ip.push_back(ip.back() + per_seq);
      la.push_back(tokens - (per_seq - 1) * page);
    }
    indptr = static_cast<std::uint32_t*>(device_alloc(ip.size() * 4));
    indices = static_cast<std::uint32_t*>(device_alloc(ix.size() * 4));
    last = static_cast<std::uint32_t*>(device_alloc(la.size() * 4));
    if (indptr == nullptr || indices == nullptr || last == nullptr) return false;
    (void)cudaMemcpy(indptr, ip.data(), ip.size() * 4, cudaMemcpyHostToDevice);
    (void)cudaMemcpy(indices, ix.data(), ix.size() * 4, cudaMemcpyHostToDevice);
    (void)cudaMemcpy(last, la.data(), la.size() * 4, cudaMemcpyHostToDevice);
    const double kv_per_token = fmt == format::q4
                                    ? static_cast<double>(kv_heads) * static_cast<double>(k_head + v_head) / 32.0
                                    : 2.0 * kv_heads * head_dim * static_cast<double>(kvcache::dense_element_bytes(fmt));
    kv_bytes = kv_per_token * tokens * seqs;
    return true;
  }
  kvcache::device_pages layout() const {
    kvcache::device_pages p;
    p.k = k;
    p.v = v;
    p.k_head_stride = k_head;
    p.v_head_stride = v_head;
    p.k_page_stride = k_head * kv_heads;
    p.v_page_stride = v_head * kv_heads;
    p.page_tokens = page;
    p.k_format = p.v_format = fmt;
    return p;
  }
  kvcache::device_table table() const { return {indptr, indices, last, seqs}; }
  ~paged_fixture() {
    for (void* p : {k, v, static_cast<void*>(indptr), static_cast<void*>(indices), static_cast<void*>(last)})
      if (p != nullptr) (void)cudaFree(p);
  }
};

// range(0): 0 contiguous (one page per sequence), 1 paged (16-token pages); range(1): source
// format 0 f32 / 1 f16. One new token for each of 64 sequences of 2048 tokens, 8 x 128 heads.
void BM_cuda_append(benchmark::State& state) {
  const bool paged = state.range(0) == 1;
  const format src = state.range(1) == 0 ? format::f32 : format::f16;
  paged_fixture f;
  f.seqs = 64;
  f.tokens = 2048;
  f.page = paged ? 16 : 2048;
  if (!f.make()) {
    state.SkipWithError("device allocation failed");
    return;
  }
  const std::size_t rows = f.seqs, tw = static_cast<std::size_t>(f.kv_heads) * f.head_dim;
  void* k = device_alloc(rows * tw * 4);
  void* v = device_alloc(rows * tw * 4);
  std::vector<std::uint32_t> si(f.seqs + 1);
  std::iota(si.begin(), si.end(), 0u);
  auto* src_indptr = static_cast<std::uint32_t*>(device_alloc(si.size() * 4));
  if (k == nullptr || v == nullptr || src_indptr == nullptr) {
    state.SkipWithError("device allocation failed");
    return;
  }
  (void)cudaMemcpy(src_indptr, si.data(), si.size() * 4, cudaMemcpyHostToDevice);
  kvcache::append_params p;
  p.dst = f.layout();
  p.table = f.table();
  p.k = k;
  p.v = v;
  p.src_format = src;
  p.src_indptr = src_indptr;
  p.max_rows = static_cast<std::uint32_t>(rows);
  p.kv_heads = f.kv_heads;
  p.head_dim = f.head_dim;
  time_with_events(state, [&] { return kvcache::cuda_append(kvcache::cuda{}, p).has_value(); });
  const double bytes = static_cast<double>(rows * tw) * 2.0 * (static_cast<double>(kvcache::dense_element_bytes(src)) + 2.0);
  report(state, bytes);
  (void)cudaFree(k);
  (void)cudaFree(v);
  (void)cudaFree(src_indptr);
}

// range(0): tokens per sequence; range(1): batch; range(2): 0 contiguous f16, 1 paged f16
// (16-token pages), 2 q4 (32-token pages, read in place); range(3): split_tokens (tokens per block),
// 0 for the caches' automatic choice (cuda_auto_split_tokens; the counter `split` shows it);
// range(4): attend_params::prefetch_steps (attend_tc's L2 prefetch distance, f16 only); range(5):
// attend_params::bypass_l1 (attend_tc's loads without prefetch skip L1).
void BM_cuda_attend(benchmark::State& state) {
  paged_fixture f;
  f.tokens = static_cast<std::uint32_t>(state.range(0));
  f.seqs = static_cast<std::uint32_t>(state.range(1));
  const int kind = static_cast<int>(state.range(2));
  f.page = kind == 0 ? f.tokens : kind == 1 ? 16 : 32;
  f.fmt = kind == 2 ? format::q4 : format::f16;
  if (!f.make()) {
    state.SkipWithError("device allocation failed");
    return;
  }
  const std::uint32_t q_heads = 32;
  kvcache::attend_params p;
  p.pages[0] = f.layout();
  p.tables[0] = f.table();
  p.batch = f.seqs;
  p.q_heads = q_heads;
  p.kv_heads = f.kv_heads;
  p.head_dim = f.head_dim;
  p.split_tokens = static_cast<std::uint32_t>(state.range(3));
  if (p.split_tokens == 0) {  // the caches' default: cuda_auto_split_tokens for this device
    int sms = 0;
    (void)cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    p.split_tokens = kvcache::cuda_auto_split_tokens(f.tokens, f.seqs, f.kv_heads, q_heads, sms);
  }
  state.counters["split"] = p.split_tokens;
  p.prefetch_steps = static_cast<std::uint32_t>(state.range(4));
  p.bypass_l1 = state.range(5) != 0;
  p.max_splits[0] = (f.tokens + p.split_tokens - 1) / p.split_tokens;
  const std::size_t qn = static_cast<std::size_t>(f.seqs) * q_heads * f.head_dim;
  p.q = static_cast<const float*>(device_alloc(qn * 4));
  p.out = static_cast<float*>(device_alloc(qn * 4));
  p.workspace = static_cast<float*>(device_alloc(kvcache::cuda_attend_workspace_bytes(p)));
  void* flush = f.kv_bytes < 2.0 * static_cast<double>(kFlushBytes) ? device_alloc(kFlushBytes) : nullptr;
  if (p.q == nullptr || p.out == nullptr || p.workspace == nullptr ||
      (flush == nullptr && f.kv_bytes < 2.0 * static_cast<double>(kFlushBytes))) {
    state.SkipWithError("device allocation failed");
    return;
  }
  fill_floats(const_cast<float*>(p.q), qn, 3);
  time_with_events(state, [&] { return kvcache::cuda_attend(kvcache::cuda{}, p).has_value(); }, flush);
  report(state, f.kv_bytes);
  if (flush != nullptr) (void)cudaFree(flush);
  (void)cudaFree(const_cast<float*>(p.q));
  (void)cudaFree(p.out);
  (void)cudaFree(p.workspace);
}

}  // namespace

BENCHMARK(BM_cuda_memcpy_d2d)->Arg(64)->Arg(256)->Arg(1024)->UseManualTime();
BENCHMARK(BM_cuda_append)->ArgNames({"paged", "src_f16"})->ArgsProduct({{0, 1}, {0, 1}})->UseManualTime();
BENCHMARK(BM_cuda_attend)
    ->ArgNames({"tokens", "batch", "kind", "split", "prefetch", "l1"})
    ->ArgsProduct({{4096, 32768}, {1, 8}, {0, 1, 2}, {0, 128, 256, 512, 1024}, {0}, {0}})
    ->UseManualTime();
// attend_tc's L2 prefetch distance, at the caches' split and at two shorter ones (prefetch:0 is
// in the sweep above; 3 and 4 steps were never faster than 2 on an H200, session 43).
BENCHMARK(BM_cuda_attend)
    ->ArgNames({"tokens", "batch", "kind", "split", "prefetch", "l1"})
    ->ArgsProduct({{4096, 32768}, {1, 8}, {0, 1}, {0, 256, 512}, {1, 2}, {0}})
    ->UseManualTime();
// Between the grids above (256 and 2048 blocks of 1024 tokens): where prefetch (3 blocks of the
// kernel per SM) stops paying against 4 blocks without it (cuda_auto_prefetch_steps).
BENCHMARK(BM_cuda_attend)
    ->ArgNames({"tokens", "batch", "kind", "split", "prefetch", "l1"})
    ->ArgsProduct({{32768}, {2, 4}, {0}, {0}, {0, 1}, {0}})
    ->UseManualTime();
// Loads that skip L1 (bypass_l1, without prefetch), against l1:0 above: where they start to pay
// (cuda_auto_bypass_l1).
BENCHMARK(BM_cuda_attend)
    ->ArgNames({"tokens", "batch", "kind", "split", "prefetch", "l1"})
    ->ArgsProduct({{4096, 32768}, {1, 8}, {0, 1}, {0}, {0}, {1}})
    ->UseManualTime();
BENCHMARK(BM_cuda_attend)
    ->ArgNames({"tokens", "batch", "kind", "split", "prefetch", "l1"})
    ->ArgsProduct({{32768}, {2, 4}, {0}, {0}, {0}, {1}})
    ->UseManualTime();

int main(int argc, char** argv) {
  const kvcache::result<void> ok = kvcache::cuda_available(0);
  if (!ok.has_value()) {
    std::printf("kvcache_cuda_bench: no CUDA device: %s\n", ok.error().message.c_str());
    return 0;
  }
  // The copy baseline first: every other benchmark reports a fraction of it.
  {
    void* a = device_alloc(std::size_t{1} << 30);
    void* b = device_alloc(std::size_t{1} << 30);
    if (a != nullptr && b != nullptr) {
      cudaEvent_t s = nullptr, e = nullptr;
      (void)cudaEventCreate(&s);
      (void)cudaEventCreate(&e);
      (void)cudaMemcpy(b, a, std::size_t{1} << 30, cudaMemcpyDeviceToDevice);
      for (int i = 0; i < 10; ++i) {
        (void)cudaEventRecord(s, nullptr);
        (void)cudaMemcpyAsync(b, a, std::size_t{1} << 30, cudaMemcpyDeviceToDevice, nullptr);
        (void)cudaEventRecord(e, nullptr);
        (void)cudaEventSynchronize(e);
        float ms = 0.0f;
        (void)cudaEventElapsedTime(&ms, s, e);
        if (ms > 0.0f) g_d2d_bandwidth = std::max(g_d2d_bandwidth, 2.0 * static_cast<double>(std::size_t{1} << 30) / (ms * 1e-3));
      }
      (void)cudaEventDestroy(s);
      (void)cudaEventDestroy(e);
    }
    if (a != nullptr) (void)cudaFree(a);
    if (b != nullptr) (void)cudaFree(b);
    std::printf("device-to-device copy bandwidth (read + write): %.1f GB/s\n", g_d2d_bandwidth * 1e-9);
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
