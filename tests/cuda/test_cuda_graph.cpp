// A decode step (append of one token per sequence + attention) captured once in a CUDA graph and
// replayed while the sequences grow: the kernels read lengths and block tables from device
// memory, so updating the tables in place between replays is all a step needs.
#include "cuda_test_util.hpp"

#include <kvcache/cuda/kernels.hpp>
#include <kvcache/cuda/runtime.hpp>

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

namespace {

using kvcache::format;
using namespace kvcache_cuda_test;

struct stream_holder {
  cudaStream_t s = nullptr;
  ~stream_holder() {
    if (s != nullptr) (void)cudaStreamDestroy(s);
  }
};
struct graph_holder {
  cudaGraph_t g = nullptr;
  cudaGraphExec_t exec = nullptr;
  ~graph_holder() {
    if (exec != nullptr) (void)cudaGraphExecDestroy(exec);
    if (g != nullptr) (void)cudaGraphDestroy(g);
  }
};

TEST(cuda_graph, decode_step_replays_while_sequences_grow) {
  KVCACHE_REQUIRE_CUDA();
  rng r;
  SCOPED_TRACE(r.trace());
  stream_holder stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream.s, cudaStreamNonBlocking), cudaSuccess);
  const kvcache::cuda where = kvcache::cuda{0}.on(stream.s);

  const std::uint32_t batch = 3, kv_heads = 2, q_heads = 8, D = 64, page_tokens = 16;
  const std::uint32_t capacity = 256, pages_per_seq = capacity / page_tokens;
  const auto steps = static_cast<std::uint32_t>(kvcache_cuda_test::steps(40, 6));
  const std::size_t tw = static_cast<std::size_t>(kv_heads) * D;
  const std::size_t head_bytes = static_cast<std::size_t>(page_tokens) * D * 2;
  const std::size_t page_bytes = head_bytes * kv_heads;
  const std::uint32_t pool_pages = batch * pages_per_seq;

  // Every sequence owns a fixed, shuffled set of pages; its CSR entries grow with its length.
  std::vector<std::uint32_t> perm(pool_pages);
  std::iota(perm.begin(), perm.end(), 0u);
  std::shuffle(perm.begin(), perm.end(), r.gen);
  std::vector<std::uint32_t> len = {r.between(0, 40), r.between(1, 17), r.between(15, 60)};
  std::vector<std::vector<float>> hist_k(batch), hist_v(batch);  // [b] -> [token][kv_head][D] (f16-rounded)

  auto dk = zeros<std::uint8_t>(where, page_bytes * pool_pages);
  auto dv = zeros<std::uint8_t>(where, page_bytes * pool_pages);
  auto d_indptr = zeros<std::uint32_t>(where, batch + 1);
  auto d_indices = zeros<std::uint32_t>(where, pool_pages);
  auto d_last = zeros<std::uint32_t>(where, batch);
  auto d_src_indptr = upload(where, std::vector<std::uint32_t>{0, 1, 2, 3});
  auto d_krow = zeros<float>(where, batch * tw);
  auto d_vrow = zeros<float>(where, batch * tw);
  auto d_q = zeros<float>(where, static_cast<std::size_t>(batch) * q_heads * D);
  auto d_out = zeros<float>(where, static_cast<std::size_t>(batch) * q_heads * D);
  for (const auto* x : {&dk, &dv}) KVCACHE_ASSERT_OK(*x);
  for (const auto* x : {&d_indptr, &d_indices, &d_last, &d_src_indptr}) KVCACHE_ASSERT_OK(*x);
  for (const auto* x : {&d_krow, &d_vrow, &d_q, &d_out}) KVCACHE_ASSERT_OK(*x);

  kvcache::device_pages pages;
  pages.k = dk->data();
  pages.v = dv->data();
  pages.k_page_stride = pages.v_page_stride = page_bytes;
  pages.k_head_stride = pages.v_head_stride = head_bytes;
  pages.page_tokens = page_tokens;
  pages.k_format = pages.v_format = format::f16;
  const kvcache::device_table table{d_indptr->data(), d_indices->data(), d_last->data(), batch};

  // Host mirror of the tables for lengths `l`; uploaded in place before each replay.
  auto upload_tables = [&](const std::vector<std::uint32_t>& l) -> kvcache::result<void> {
    std::vector<std::uint32_t> indptr{0}, indices, last;
    for (std::uint32_t b = 0; b < batch; ++b) {
      const std::uint32_t np = (l[b] + page_tokens - 1) / page_tokens;
      for (std::uint32_t i = 0; i < np; ++i) indices.push_back(perm[b * pages_per_seq + i]);
      indptr.push_back(static_cast<std::uint32_t>(indices.size()));
      last.push_back(np == 0 ? 0 : l[b] - (np - 1) * page_tokens);
    }
    KVCACHE_TRY(kvcache::copy_to_device(where, d_indptr->data(), indptr.data(), indptr.size() * 4));
    KVCACHE_TRY(kvcache::copy_to_device(where, d_indices->data(), indices.data(), indices.size() * 4));
    KVCACHE_TRY(kvcache::copy_to_device(where, d_last->data(), last.data(), last.size() * 4));
    return {};
  };

  // Prefill: the initial tokens of each sequence through the single-sequence append.
  for (std::uint32_t b = 0; b < batch; ++b) {
    if (len[b] == 0) continue;
    std::vector<float> k = r.floats(len[b] * tw), v = r.floats(len[b] * tw);
    for (float& x : k) x = kvcache::to_float(kvcache::to_half(x));
    for (float& x : v) x = kvcache::to_float(kvcache::to_half(x));
    hist_k[b] = k;
    hist_v[b] = v;
    std::vector<std::uint32_t> own(perm.begin() + b * pages_per_seq, perm.begin() + (b + 1) * pages_per_seq);
    auto d_own = upload(where, own);
    auto d_k = upload(where, k);
    auto d_v = upload(where, v);
    KVCACHE_ASSERT_OK(d_own);
    KVCACHE_ASSERT_OK(d_k);
    KVCACHE_ASSERT_OK(d_v);
    kvcache::append_params a;
    a.dst = pages;
    a.k = d_k->data();
    a.v = d_v->data();
    a.src_format = format::f32;
    a.kv_heads = kv_heads;
    a.head_dim = D;
    a.single_pages = d_own->data();
    a.single_length = len[b];
    a.max_rows = len[b];
    KVCACHE_ASSERT_OK(kvcache::cuda_append(where, a));
    KVCACHE_ASSERT_OK(kvcache::cuda_synchronize(where));
  }

  kvcache::append_params a;
  a.dst = pages;
  a.table = table;
  a.k = d_krow->data();
  a.v = d_vrow->data();
  a.src_format = format::f32;
  a.src_indptr = d_src_indptr->data();
  a.max_rows = batch;
  a.kv_heads = kv_heads;
  a.head_dim = D;
  kvcache::attend_params at;
  at.pages[0] = pages;
  at.tables[0] = table;
  at.batch = batch;
  at.q_heads = q_heads;
  at.kv_heads = kv_heads;
  at.head_dim = D;
  at.q = d_q->data();
  at.out = d_out->data();
  at.split_tokens = 64;
  at.max_splits[0] = capacity / 64;  // fixed by the capacity: valid for every replay
  auto d_ws = zeros<float>(where, kvcache::cuda_attend_workspace_bytes(at) / sizeof(float));
  KVCACHE_ASSERT_OK(d_ws);
  at.workspace = d_ws->data();

  graph_holder graph;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  for (std::uint32_t step = 0; step < steps; ++step) {
    // Host side of the step: the new token's K/V and query, and the tables counting it.
    std::vector<float> krow = r.floats(batch * tw), vrow = r.floats(batch * tw);
    const std::vector<float> q = r.floats(static_cast<std::size_t>(batch) * q_heads * D);
    for (std::uint32_t b = 0; b < batch; ++b) {
      ++len[b];
      for (std::size_t i = 0; i < tw; ++i) {
        hist_k[b].push_back(kvcache::to_float(kvcache::to_half(krow[b * tw + i])));
        hist_v[b].push_back(kvcache::to_float(kvcache::to_half(vrow[b * tw + i])));
      }
    }
    KVCACHE_ASSERT_OK(upload_tables(len));
    KVCACHE_ASSERT_OK(kvcache::copy_to_device(where, d_krow->data(), krow.data(), krow.size() * 4));
    KVCACHE_ASSERT_OK(kvcache::copy_to_device(where, d_vrow->data(), vrow.data(), vrow.size() * 4));
    KVCACHE_ASSERT_OK(kvcache::copy_to_device(where, d_q->data(), q.data(), q.size() * 4));
    if (step == 0) {
      ASSERT_EQ(cudaStreamBeginCapture(stream.s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
      const kvcache::result<void> ra = kvcache::cuda_append(where, a);
      const kvcache::result<void> rt = kvcache::cuda_attend(where, at);
      ASSERT_EQ(cudaStreamEndCapture(stream.s, &graph.g), cudaSuccess);
      KVCACHE_ASSERT_OK(ra);
      KVCACHE_ASSERT_OK(rt);
      ASSERT_EQ(cudaGraphInstantiate(&graph.exec, graph.g, 0), cudaSuccess);
    }
    ASSERT_EQ(cudaGraphLaunch(graph.exec, stream.s), cudaSuccess);
    auto out = download(where, d_out->data(), static_cast<std::size_t>(batch) * q_heads * D);
    KVCACHE_ASSERT_OK(out);
    double worst = 0.0;
    for (std::uint32_t b = 0; b < batch; ++b)
      for (std::uint32_t qh = 0; qh < q_heads; ++qh) {
        const std::uint32_t h = qh / (q_heads / kv_heads);
        std::vector<float> k, v;
        for (std::uint32_t t = 0; t < len[b]; ++t)
          for (std::uint32_t d = 0; d < D; ++d) {
            k.push_back(hist_k[b][(t * kv_heads + h) * D + d]);
            v.push_back(hist_v[b][(t * kv_heads + h) * D + d]);
          }
        const std::size_t o = (static_cast<std::size_t>(b) * q_heads + qh) * D;
        const std::vector<double> want = reference_attention(q.data() + o, k, v, len[b], D, scale);
        for (std::uint32_t d = 0; d < D; ++d) worst = std::max(worst, std::abs(out.value()[o + d] - want[d]));
      }
    ASSERT_LT(worst, 2e-4) << "step " << step;
  }
}

}  // namespace
