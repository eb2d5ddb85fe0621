#pragma once
// Decode attention kernels of kvcache::cuda: flash-decoding over paged segments (f32, f16, q4 in place).
//
// attend_partial: one block per (sequence, kv head, group of up to kMaxG query heads, split).
// Each of its kWarps warps walks tiles of 32 tokens of the split:
//   scores  lane = token: dense keys dot the query rows held in shared memory; q4 keys (one page =
//           one key group of 32 tokens, format.hpp) use the query with the page's per-channel
//           scales folded in (qs[g][d] = q[g][d] * scale_d, once per page per warp) and one
//           constant sum_d q*min_d, so the inner loop is codes x folded query (DESIGN.md 2.5),
//           a lane reading the codes of its token four channels at a time (one 32-bit word);
//   softmax online, base 2 (scores pre-multiplied by scale * log2 e);
//   values  lane = channel (lane + 32 j): acc += p * v, for q4 values (one value group per page)
//           (p * scale) * code + p * min, a lane reading its channel's codes of four tokens at a
//           time (one 32-bit word).
// The warps' states are merged in shared memory and written as one partial state (max, sum,
// unnormalized output) per (sequence, query head, split). attend_merge combines every split of
// every segment per (sequence, query head).
//
// Internal to cuda/ (included by attend.cu, and by the CPU emulation test). Includes no CUDA
// runtime header; cuda_fp16.h only under nvcc (the emulation provides the few intrinsics used).
#include "device_math.cuh"

#include <kvcache/cuda/kernels.hpp>
#include <kvcache/error.hpp>

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#endif

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace kvcache {
namespace {

constexpr std::uint32_t kWarps = 4;
constexpr std::uint32_t kThreads = kWarps * 32;
constexpr std::uint32_t kMaxG = 8;                       // query heads per block (cuda_auto_split_tokens counts groups of 8)
constexpr std::uint32_t kMaxJ = cuda_max_head_dim / 32;  // channels per lane
constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ __forceinline__ float half_bits_to_float(std::uint16_t b) { return __half2float(__ushort_as_half(b)); }

/// Token u of a segment lies in page u / page_tokens, slot u % page_tokens: a shift and a mask
/// for a power-of-two page (the common case), a division otherwise.
struct page_of_token {
  std::uint32_t pt, shift = 0;
  bool pow2;
  __device__ explicit page_of_token(std::uint32_t page_tokens) : pt(page_tokens) {
    while ((1u << shift) < pt) ++shift;
    pow2 = (1u << shift) == pt;
  }
  __device__ std::uint32_t page(std::uint32_t u) const { return pow2 ? u >> shift : u / pt; }
  __device__ std::uint32_t slot(std::uint32_t u) const { return pow2 ? u & (pt - 1) : u % pt; }
};

// Tokens of sequence b in a segment, and its page list.
struct seq_pages {
  const std::uint32_t* pages;
  std::uint32_t tokens;
};
__device__ __forceinline__ seq_pages pages_of(const device_table& t, std::uint32_t page_tokens, std::uint32_t b) {
  const std::uint32_t p0 = t.indptr[b];
  const std::uint32_t np = t.indptr[b + 1] - p0;
  return {t.indices + p0, np == 0 ? 0u : (np - 1) * page_tokens + t.last_page_len[b]};
}

// Dense key row dot products: s[g] += q_s[g][:] . k_row, for g < ng.
template <format KF>
__device__ __forceinline__ void dense_scores(const std::byte* row, const float (*q_s)[cuda_max_head_dim],
                                             std::uint32_t D, std::uint32_t ng, float (&s)[kMaxG]) {
  if constexpr (KF == format::f16) {
    const auto* k = reinterpret_cast<const std::uint16_t*>(row);
    if ((D % 8) == 0 && (reinterpret_cast<std::uintptr_t>(k) % 16) == 0) {
      for (std::uint32_t d = 0; d < D; d += 8) {
        const uint4 raw = *reinterpret_cast<const uint4*>(k + d);
        const auto* h2 = reinterpret_cast<const __half2*>(&raw);
        float kv[8];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 f = __half22float2(h2[i]);
          kv[2 * i] = f.x;
          kv[2 * i + 1] = f.y;
        }
#pragma unroll
        for (std::uint32_t g = 0; g < kMaxG; ++g)
          if (g < ng) {
#pragma unroll
            for (int i = 0; i < 8; ++i) s[g] = fmaf(q_s[g][d + i], kv[i], s[g]);
          }
      }
      return;
    }
    for (std::uint32_t d = 0; d < D; ++d) {
      const float x = half_bits_to_float(k[d]);
#pragma unroll
      for (std::uint32_t g = 0; g < kMaxG; ++g)
        if (g < ng) s[g] = fmaf(q_s[g][d], x, s[g]);
    }
  } else {
    const auto* k = reinterpret_cast<const float*>(row);
    for (std::uint32_t d = 0; d < D; ++d) {
      const float x = k[d];
#pragma unroll
      for (std::uint32_t g = 0; g < kMaxG; ++g)
        if (g < ng) s[g] = fmaf(q_s[g][d], x, s[g]);
    }
  }
}

struct partial_state_ref {
  float* base;  // [q_heads][splits][2 + D] for this sequence
  std::uint32_t splits, D;
  __device__ float* at(std::uint32_t qh, std::uint32_t split) const {
    return base + (static_cast<std::size_t>(qh) * splits + split) * (2 + D);
  }
};

/// What a block of a partial-attention kernel works on: sequence b, kv head kvh, query heads qh0
/// .. qh0 + ng - 1 (at most max_g of one group of kMaxG), tokens [t_begin, t_end) of the segment,
/// and where its partial states go (split `split_index` among all segments' splits).
struct block_work {
  std::uint32_t b, kvh, ng, qh0, split_index, t_begin, t_end;
  seq_pages sp;
  partial_state_ref out;
};
__device__ __forceinline__ block_work work_of(const attend_params& p, std::uint32_t seg, std::uint32_t split_base,
                                              std::uint32_t total_splits, std::uint32_t max_g, std::uint32_t page_tokens) {
  const std::uint32_t gqa = p.q_heads / p.kv_heads;
  const std::uint32_t groups = (gqa + kMaxG - 1) / kMaxG;
  const std::uint32_t g0 = (blockIdx.y % groups) * kMaxG;
  block_work w;
  w.b = blockIdx.x;
  w.kvh = blockIdx.y / groups;
  w.ng = min(max_g, gqa - g0);
  w.qh0 = w.kvh * gqa + g0;
  w.split_index = split_base + blockIdx.z;
  w.sp = pages_of(p.tables[seg], page_tokens, w.b);
  w.t_begin = blockIdx.z * p.split_tokens;
  w.t_end = min(w.sp.tokens, w.t_begin + p.split_tokens);
  w.out = {p.workspace + static_cast<std::size_t>(w.b) * p.q_heads * total_splits * (2 + p.head_dim), total_splits,
           p.head_dim};
  return w;
}
/// An empty split (no token of the sequence): writes the states the merge skips and says so.
__device__ __forceinline__ bool empty_split(const block_work& w) {
  if (w.t_begin < w.t_end) return false;
  for (std::uint32_t g = threadIdx.x; g < w.ng; g += blockDim.x) {
    float* st = w.out.at(w.qh0 + g, w.split_index);
    st[0] = -INFINITY;
    st[1] = 0.0f;
  }
  return true;
}
/// The block's partial state of each of its query heads: the warps' states merged. m and l are
/// [kWarps][gs], acc [kWarps][gs][ds] (unnormalized outputs) in shared memory, published by a
/// __syncthreads; a warp with l = 0 saw no token.
__device__ __forceinline__ void write_block_state(const block_work& w, std::uint32_t D, const float* m, const float* l,
                                                  std::uint32_t gs, const float* acc, std::uint32_t ds) {
  for (std::uint32_t i = threadIdx.x; i < w.ng * D; i += blockDim.x) {
    const std::uint32_t g = i / D, d = i % D;
    float mx = -INFINITY;
    for (std::uint32_t k = 0; k < kWarps; ++k)
      if (l[k * gs + g] > 0.0f) mx = fmaxf(mx, m[k * gs + g]);
    float sum = 0.0f, a = 0.0f;
    for (std::uint32_t k = 0; k < kWarps; ++k)
      if (l[k * gs + g] > 0.0f) {
        const float f = exp2f(m[k * gs + g] - mx);
        sum += l[k * gs + g] * f;
        a += acc[(k * gs + g) * ds + d] * f;
      }
    float* st = w.out.at(w.qh0 + g, w.split_index);
    if (d == 0) {
      st[0] = mx;
      st[1] = sum;
    }
    st[2 + d] = a;
  }
}

struct shared_storage {
  float q[kMaxG][cuda_max_head_dim];                    // [g][d] query rows
  union {
    float qs[kWarps][kMaxG][cuda_max_head_dim];         // per warp: query with the page's scales folded in
    float acc[kWarps][kMaxG][cuda_max_head_dim];        // per warp: final unnormalized outputs
  } u;
  float m[kWarps][kMaxG];
  float l[kWarps][kMaxG];
};

template <format KF, format VF>
__global__ void __launch_bounds__(kThreads) attend_partial(attend_params p, std::uint32_t seg, std::uint32_t split_base,
                                                           std::uint32_t total_splits, float score_scale) {
  __shared__ shared_storage sm;
  const std::uint32_t D = p.head_dim;
  const std::uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const device_pages& pg = p.pages[seg];
  const block_work bw = work_of(p, seg, split_base, total_splits, kMaxG, pg.page_tokens);
  if (empty_split(bw)) return;
  const std::uint32_t b = bw.b, kvh = bw.kvh, ng = bw.ng, qh0 = bw.qh0, t_begin = bw.t_begin, t_end = bw.t_end;
  const seq_pages sp = bw.sp;

  for (std::uint32_t i = threadIdx.x; i < ng * D; i += blockDim.x) {
    const std::uint32_t g = i / D, d = i % D;
    sm.q[g][d] = p.q[(static_cast<std::size_t>(b) * p.q_heads + qh0 + g) * D + d] * score_scale;
  }
  __syncthreads();

  float m[kMaxG], l[kMaxG], acc[kMaxG][kMaxJ];
#pragma unroll
  for (std::uint32_t g = 0; g < kMaxG; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
#pragma unroll
    for (std::uint32_t j = 0; j < kMaxJ; ++j) acc[g][j] = 0.0f;
  }
  const std::uint32_t nj = (D + 31) / 32;

  for (std::uint32_t t0 = t_begin + warp * 32; t0 < t_end; t0 += kWarps * 32) {
    const std::uint32_t nt = min(32u, t_end - t0);
    // This lane's token: page, slot and row addresses (q4 tiles are exactly one page).
    const std::uint32_t t = t0 + min(lane, nt - 1);
    const std::uint32_t page = sp.pages[t / pg.page_tokens];
    const std::uint32_t slot = t % pg.page_tokens;
    const std::byte* k_head = static_cast<const std::byte*>(pg.k) + page * pg.k_page_stride + kvh * pg.k_head_stride;
    const std::byte* v_head = static_cast<const std::byte*>(pg.v) + page * pg.v_page_stride + kvh * pg.v_head_stride;

    float s[kMaxG];
#pragma unroll
    for (std::uint32_t g = 0; g < kMaxG; ++g) s[g] = 0.0f;
    if constexpr (KF == format::q4) {
      // All lanes share one page, one key group (tile = page): fold its scales into the query once.
      const std::byte* kg = k_head;  // key group (format.hpp), 4-byte aligned (validated)
      const auto* ksc = reinterpret_cast<const std::uint16_t*>(kg + q4_key_scales_offset(D));
      const auto* kmn = reinterpret_cast<const std::uint16_t*>(kg + q4_key_mins_offset(D));
      const std::uint32_t C = q4_key_channels(D);  // <= cuda_max_head_dim (a multiple of 4)
      float cmin[kMaxG];
#pragma unroll
      for (std::uint32_t g = 0; g < kMaxG; ++g) cmin[g] = 0.0f;
      for (std::uint32_t d = lane; d < C; d += 32) {
        const bool real = d < D;  // padding channels D..C-1: folded query 0
        const float sc = real ? half_bits_to_float(ksc[d]) : 0.0f, mn = real ? half_bits_to_float(kmn[d]) : 0.0f;
#pragma unroll
        for (std::uint32_t g = 0; g < kMaxG; ++g)
          if (g < ng) {
            sm.u.qs[warp][g][d] = real ? sm.q[g][d] * sc : 0.0f;
            if (real) cmin[g] = fmaf(sm.q[g][d], mn, cmin[g]);
          }
      }
      __syncwarp();
      // Lane = token: the 32-bit word (lane % 16) of channel quad c4 holds the codes of channels
      // 4 c4 .. 4 c4 + 3 of tokens lane % 16 (low nibbles) and lane % 16 + 16 (high nibbles), so
      // a warp reads each quad's 64 bytes in one coalesced load (lanes l and l + 16 share a word).
      // (The channel loop inside stays rolled: unrolled, sm_90 needs ~160 registers instead of 128.)
      const auto* words = reinterpret_cast<const std::uint32_t*>(kg) + lane % 16;
      const std::uint32_t shift = lane < 16 ? 0 : 4;
      for (std::uint32_t c4 = 0; c4 < C / 4; ++c4) {
        std::uint32_t w = words[c4 * 16] >> shift;
#pragma unroll 1
        for (std::uint32_t i = 0; i < 4; ++i, w >>= 8) {
          const float code = static_cast<float>(w & 0x0fu);
#pragma unroll
          for (std::uint32_t g = 0; g < kMaxG; ++g)
            if (g < ng) s[g] = fmaf(sm.u.qs[warp][g][4 * c4 + i], code, s[g]);
        }
      }
#pragma unroll
      for (std::uint32_t g = 0; g < kMaxG; ++g) s[g] += warp_sum(cmin[g]);
      __syncwarp();  // qs is rewritten by the next tile
    } else {
      dense_scores<KF>(k_head + static_cast<std::size_t>(slot) * D * dense_element_bytes(KF), sm.q, D, ng, s);
    }

    // Online softmax over the tile.
    float pr[kMaxG];
#pragma unroll
    for (std::uint32_t g = 0; g < kMaxG; ++g) {
      const float sg = lane < nt ? s[g] : -INFINITY;
      const float m_new = fmaxf(m[g], warp_max(sg));
      const float alpha = exp2f(m[g] - m_new);  // m = -inf at the first tile: alpha = 0
      pr[g] = lane < nt ? exp2f(sg - m_new) : 0.0f;
      l[g] = l[g] * alpha + warp_sum(pr[g]);
      m[g] = m_new;
#pragma unroll
      for (std::uint32_t j = 0; j < kMaxJ; ++j) acc[g][j] *= alpha;
    }

    if constexpr (VF == format::q4) {
      // Values: lane = channel lane + 32 j of column j of the page's value group (tile = page,
      // token i = slot i). The 32-bit word (lane % 16) of token quad i / 4 in column j holds
      // channel 32 j + lane % 16 (low nibbles) and 32 j + lane % 16 + 16 (high) of the quad's four
      // tokens: one coalesced 64-byte load per column for a quad, which its next three tokens
      // find in L1 (keeping the four codes in registers instead costs sm_90 ~30 registers).
      // Scales and minimums of tokens past nt are never read (unspecified, possibly not finite).
      const std::byte* vg = v_head;  // the tile's page: value group (format.hpp), 4-byte aligned (validated)
      const auto* vsc = reinterpret_cast<const std::uint16_t*>(vg + q4_value_scales_offset(D));  // [j][token]
      const auto* vmn = reinterpret_cast<const std::uint16_t*>(vg + q4_value_mins_offset(D));
      const auto* words = reinterpret_cast<const std::uint32_t*>(vg) + lane % 16;
      const std::uint32_t shift = lane < 16 ? 0 : 4;
      for (std::uint32_t i = 0; i < nt; ++i) {
        float w[kMaxG];
#pragma unroll
        for (std::uint32_t g = 0; g < kMaxG; ++g) w[g] = __shfl_sync(0xffffffffu, pr[g], i);
        const std::uint32_t sh = shift + 8 * (i % 4);
#pragma unroll
        for (std::uint32_t j = 0; j < kMaxJ; ++j)
          if (j < nj) {
            const float code = static_cast<float>((words[j * 128 + i / 4 * 16] >> sh) & 0x0fu);
            const float sc = half_bits_to_float(vsc[j * q4_group + i]), mn = half_bits_to_float(vmn[j * q4_group + i]);
#pragma unroll
            for (std::uint32_t g = 0; g < kMaxG; ++g)
              if (g < ng) acc[g][j] += fmaf(w[g] * sc, code, w[g] * mn);
          }
      }
    } else {
      // Values: lanes over channels; token i's row address comes from lane i.
      const auto v_addr =
          reinterpret_cast<unsigned long long>(v_head + static_cast<std::size_t>(slot) * D * dense_element_bytes(VF));
      for (std::uint32_t i = 0; i < nt; ++i) {
        const auto* row = reinterpret_cast<const std::byte*>(__shfl_sync(0xffffffffu, v_addr, i));
        float w[kMaxG];
#pragma unroll
        for (std::uint32_t g = 0; g < kMaxG; ++g) w[g] = __shfl_sync(0xffffffffu, pr[g], i);
#pragma unroll
        for (std::uint32_t j = 0; j < kMaxJ; ++j) {
          const std::uint32_t c = lane + 32 * j;
          if (j < nj && c < D) {
            const float x = VF == format::f32 ? reinterpret_cast<const float*>(row)[c]
                                              : half_bits_to_float(reinterpret_cast<const std::uint16_t*>(row)[c]);
#pragma unroll
            for (std::uint32_t g = 0; g < kMaxG; ++g)
              if (g < ng) acc[g][j] = fmaf(w[g], x, acc[g][j]);
          }
        }
      }
    }
  }

  // Merge the warps' states.
  __syncthreads();  // every warp is done with sm.u.qs
#pragma unroll
  for (std::uint32_t g = 0; g < kMaxG; ++g)
    if (g < ng) {
#pragma unroll
      for (std::uint32_t j = 0; j < kMaxJ; ++j)
        if (j < nj && lane + 32 * j < D) sm.u.acc[warp][g][lane + 32 * j] = acc[g][j];
      if (lane == 0) {
        sm.m[warp][g] = m[g];
        sm.l[warp][g] = l[g];
      }
    }
  __syncthreads();
  write_block_state(bw, D, &sm.m[0][0], &sm.l[0][0], kMaxG, &sm.u.acc[0][0][0], cuda_max_head_dim);
}

// One block of kMergeThreads threads per (sequence, query head): combines every split's partial
// state. The splits are read in parallel: their maxima and sums one split a thread, their weights
// 2^(m - max) through shared memory kMergeThreads splits at a time, and each thread's output
// channels summed over them with the loads independent of each other (the loop unrolled). Before
// (session 34) every thread walked all the splits alone, three times, one load after the other:
// at batch 1 (8 kv heads, 32k tokens, 32 splits) that merge was a serial chain of global loads.
constexpr std::uint32_t kMergeThreads = 128;
constexpr std::uint32_t kMergeOut = (cuda_max_head_dim + kMergeThreads - 1) / kMergeThreads;  // channels a thread

/// The maximum (max) or the sum of x over the block's kMergeThreads threads, in every thread.
template <bool Max>
__device__ __forceinline__ float merge_block_reduce(float x, float (&scratch)[kMergeThreads / 32]) {
  x = Max ? warp_max(x) : warp_sum(x);
  const std::uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  float r = scratch[0];
#pragma unroll
  for (std::uint32_t w = 1; w < kMergeThreads / 32; ++w) r = Max ? fmaxf(r, scratch[w]) : r + scratch[w];
  __syncthreads();  // scratch is free again
  return r;
}

__global__ void __launch_bounds__(kMergeThreads) attend_merge(attend_params p, std::uint32_t total_splits) {
  __shared__ float weight[kMergeThreads];
  __shared__ float scratch[kMergeThreads / 32];
  const std::uint32_t b = blockIdx.x, qh = blockIdx.y, D = p.head_dim, tid = threadIdx.x;
  const partial_state_ref in{p.workspace + static_cast<std::size_t>(b) * p.q_heads * total_splits * (2 + D),
                             total_splits, D};
  float mx = -INFINITY;
  for (std::uint32_t s = tid; s < total_splits; s += kMergeThreads) {
    const float* st = in.at(qh, s);
    if (st[1] > 0.0f) mx = fmaxf(mx, st[0]);  // a split without tokens or weight has l = 0
  }
  mx = merge_block_reduce<true>(mx, scratch);
  float sum = 0.0f, a[kMergeOut];
#pragma unroll
  for (std::uint32_t k = 0; k < kMergeOut; ++k) a[k] = 0.0f;
  for (std::uint32_t s0 = 0; s0 < total_splits; s0 += kMergeThreads) {
    const std::uint32_t s = s0 + tid;
    float w = 0.0f;
    if (s < total_splits) {
      const float* st = in.at(qh, s);
      if (st[1] > 0.0f) {
        w = exp2f(st[0] - mx);
        sum = fmaf(st[1], w, sum);
      }
    }
    weight[tid] = w;
    __syncthreads();
    const std::uint32_t n = min(kMergeThreads, total_splits - s0);
    const float* first = in.at(qh, s0) + 2;
    const std::size_t step = 2 + static_cast<std::size_t>(D);
#pragma unroll
    for (std::uint32_t k = 0; k < kMergeOut; ++k) {
      const std::uint32_t d = tid + k * kMergeThreads;
      if (d < D) {
        float x = 0.0f;
#pragma unroll 8
        for (std::uint32_t i = 0; i < n; ++i) {
          const float wi = weight[i];
          if (wi > 0.0f) x = fmaf(wi, first[i * step + d], x);  // unwritten outputs of empty splits: not read
        }
        a[k] += x;
      }
    }
    __syncthreads();  // weight is rewritten by the next splits
  }
  sum = merge_block_reduce<false>(sum, scratch);
  float* o = p.out + (static_cast<std::size_t>(b) * p.q_heads + qh) * D;
#pragma unroll
  for (std::uint32_t k = 0; k < kMergeOut; ++k) {
    const std::uint32_t d = tid + k * kMergeThreads;
    if (d < D) o[d] = sum > 0.0f ? a[k] / sum : 0.0f;
  }
}

// ---- dense fast path: f16 or f32 keys and values, head_dim 64, 128 or 256 --------------------
//
// attend_dense: one block per (sequence, kv head, group of up to G query heads, split), like
// attend_partial, but laid out for memory-level parallelism rather than lane = token:
//   L = head_dim / 8 lanes share a token row, each holding 8 channels (one 16-byte load of f16,
//   two of f32), so a warp load covers R = 32 / L whole rows, coalesced; a warp step takes U
//   such loads of keys and U of values (TS = U R tokens), copied into shared memory (cp.async)
//   two steps ahead of their use, the page numbers one step before that;
//   scores: 8-channel partial dots with the query (in registers), summed over the row's L lanes
//   by xor shuffles; online softmax per step (max over the warp; row sums and outputs stay
//   partial per row and are summed over rows once, at the end);
//   values: acc[g][8 channels] += p * v, lane-parallel, no shuffle.
// Query heads past the group (G rounds gqa up to a power of two) run with a zero query and are
// never written. The warps' states merge in shared memory into the same partial state as
// attend_partial's, for attend_merge.
/// The 8 elements (f16 or f32) of a row that `lane` staged as its 16-byte pieces [piece][lane],
/// as floats. (Words go through intrinsics, not reinterpreted as halves or floats: the CPU
/// emulation compiles this with the host compiler's strict aliasing.)
template <format F, std::size_t CH>
__device__ __forceinline__ void staged_floats(const uint4 (&pieces)[CH][32], std::uint32_t lane, float (&x)[8]) {
  static_assert(CH * 16 == 8 * dense_element_bytes(F));
#pragma unroll
  for (std::size_t h = 0; h < CH; ++h) {
    const uint4 v = pieces[h][lane];
    const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (F == format::f16) {
        x[8 * h + 2 * i] = half_bits_to_float(static_cast<std::uint16_t>(w[i] & 0xffffu));
        x[8 * h + 2 * i + 1] = half_bits_to_float(static_cast<std::uint16_t>(w[i] >> 16));
      } else {
        x[4 * h + i] = __uint_as_float(w[i]);
      }
    }
  }
}

// Asynchronous 16-byte copies from global to shared memory (cp.async, sm_80+). The CPU emulation
// copies at once, which is one of the orders the real copies may complete in.
__device__ __forceinline__ void copy_async16(void* to_shared, const void* from_global) {
#if defined(__CUDA_ARCH__)
  const auto to = static_cast<unsigned>(__cvta_generic_to_shared(to_shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(to), "l"(from_global) : "memory");
#else
  std::memcpy(to_shared, from_global, 16);
#endif
}
__device__ __forceinline__ void copy_async_commit() {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
/// Waits until at most N of this thread's committed copy groups are still in flight.
template <int N>
__device__ __forceinline__ void copy_async_wait() {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

constexpr std::uint32_t kDenseStages = 3;  // steps a warp has in flight or in hand

template <format F, std::uint32_t L, std::uint32_t G, std::uint32_t U>
struct dense_shared {
  static constexpr std::uint32_t CH = dense_element_bytes(F) / 2;  // 16-byte pieces of a lane's 8 elements
  union {
    // Per warp and stage: the keys and values of one step, each lane's own pieces [u][piece][lane]
    // (a lane reads back only what it copied: no warp barrier between copy and use).
    uint4 stage[kWarps][kDenseStages][2][U][CH][32];
    struct {
      float acc[kWarps][G][8 * L];
      float m[kWarps][G];
      float l[kWarps][G];
    } merge;
  } u;
};

template <format F, std::uint32_t L, std::uint32_t G>
__global__ void __launch_bounds__(kThreads, G <= 4 ? 4 : 2) attend_dense(attend_params p, std::uint32_t seg, std::uint32_t split_base,
                                                         std::uint32_t total_splits, float score_scale) {
  constexpr std::uint32_t D = 8 * L;
  constexpr std::uint32_t R = 32 / L;                    // rows per warp load
  constexpr std::uint32_t U = F == format::f32 ? 2 : 4;  // rows of keys (and of values) per lane and step
  constexpr std::uint32_t TS = U * R;                    // tokens per warp step
  constexpr std::size_t EB = dense_element_bytes(F);
  constexpr std::uint32_t CH = dense_shared<F, L, G, U>::CH;
  __shared__ dense_shared<F, L, G, U> sm;
  const std::uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const std::uint32_t r = lane / L, c = lane % L;  // row of the warp load, 8-channel chunk
  const device_pages& pg = p.pages[seg];
  const block_work bw = work_of(p, seg, split_base, total_splits, G, pg.page_tokens);
  if (empty_split(bw)) return;
  const std::uint32_t b = bw.b, kvh = bw.kvh, ng = bw.ng, qh0 = bw.qh0, t_begin = bw.t_begin, t_end = bw.t_end;
  const seq_pages sp = bw.sp;

  const page_of_token pot(pg.page_tokens);
  const std::byte* k_base = static_cast<const std::byte*>(pg.k) + kvh * pg.k_head_stride + 8 * c * EB;
  const std::byte* v_base = static_cast<const std::byte*>(pg.v) + kvh * pg.v_head_stride + 8 * c * EB;
  const std::uint32_t stride = kWarps * TS;
  const std::uint32_t t_first = t_begin + warp * TS;  // this warp's steps: t_first + i * stride < t_end
  // The pipeline: step i's rows are copied into stage i % kDenseStages two steps ahead of their
  // use; the page numbers of a step are loaded one step before its copies are issued. Rows past
  // the split clamp to its last token (copied, then masked).
  std::uint32_t pages[U];
  auto fetch_pages = [&](std::uint32_t i) {
    const std::uint32_t t0 = min(t_first + i * stride, t_end - 1);
#pragma unroll
    for (std::uint32_t u = 0; u < U; ++u) {
      const std::uint32_t t = min(t0 + u * R + r, t_end - 1);
      pages[u] = sp.pages[pot.page(t)];
    }
  };
  auto issue = [&](std::uint32_t i) {
    const std::uint32_t t0 = t_first + i * stride;
    if (t0 < t_end) {
      uint4(&kst)[U][CH][32] = sm.u.stage[warp][i % kDenseStages][0];
      uint4(&vst)[U][CH][32] = sm.u.stage[warp][i % kDenseStages][1];
#pragma unroll
      for (std::uint32_t u = 0; u < U; ++u) {
        const std::uint32_t t = min(t0 + u * R + r, t_end - 1);
        const std::size_t slot = pot.slot(t);
        const std::byte* kr = k_base + pages[u] * pg.k_page_stride + slot * (D * EB);
        const std::byte* vr = v_base + pages[u] * pg.v_page_stride + slot * (D * EB);
#pragma unroll
        for (std::uint32_t h = 0; h < CH; ++h) {
          copy_async16(&kst[u][h][lane], kr + 16 * h);
          copy_async16(&vst[u][h][lane], vr + 16 * h);
        }
      }
    }
    copy_async_commit();  // an empty group past the end keeps the count of groups uniform
  };
  fetch_pages(0);
  issue(0);
  fetch_pages(1);
  issue(1);
  fetch_pages(2);

  float q[G][8], m[G], l[G], acc[G][8];
#pragma unroll
  for (std::uint32_t g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
#pragma unroll
    for (std::uint32_t i = 0; i < 8; ++i) {
      q[g][i] = g < ng ? p.q[(static_cast<std::size_t>(b) * p.q_heads + qh0 + g) * D + 8 * c + i] * score_scale : 0.0f;
      acc[g][i] = 0.0f;
    }
  }

  std::uint32_t i = 0;
  for (std::uint32_t t0 = t_first; t0 < t_end; t0 += stride, ++i) {
    issue(i + 2);
    fetch_pages(i + 3);
    copy_async_wait<2>();  // step i's group is complete
    const uint4(&kst)[U][CH][32] = sm.u.stage[warp][i % kDenseStages][0];
    const uint4(&vst)[U][CH][32] = sm.u.stage[warp][i % kDenseStages][1];

    float s[U][G];
#pragma unroll
    for (std::uint32_t u = 0; u < U; ++u) {
      float x[8];
      staged_floats<F>(kst[u], lane, x);
#pragma unroll
      for (std::uint32_t g = 0; g < G; ++g) {
        float a = q[g][0] * x[0], bb = q[g][1] * x[1];
#pragma unroll
        for (std::uint32_t e = 2; e < 8; e += 2) {
          a = fmaf(q[g][e], x[e], a);
          bb = fmaf(q[g][e + 1], x[e + 1], bb);
        }
        s[u][g] = a + bb;
      }
    }
#pragma unroll
    for (std::uint32_t o = L / 2; o > 0; o /= 2)
#pragma unroll
      for (std::uint32_t u = 0; u < U; ++u)
#pragma unroll
        for (std::uint32_t g = 0; g < G; ++g) s[u][g] += __shfl_xor_sync(0xffffffffu, s[u][g], static_cast<int>(o));
#pragma unroll
    for (std::uint32_t u = 0; u < U; ++u)
      if (t0 + u * R + r >= t_end)
#pragma unroll
        for (std::uint32_t g = 0; g < G; ++g) s[u][g] = -INFINITY;

    // Online softmax: the step's maximum over the whole warp (token t0 is always live).
#pragma unroll
    for (std::uint32_t g = 0; g < G; ++g) {
      float mx = s[0][g];
#pragma unroll
      for (std::uint32_t u = 1; u < U; ++u) mx = fmaxf(mx, s[u][g]);
#pragma unroll
      for (std::uint32_t o = L; o < 32; o *= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, static_cast<int>(o)));
      const float m_new = fmaxf(m[g], mx);
      const float alpha = exp2f(m[g] - m_new);  // m = -inf at the first step: alpha = 0
      float sum = 0.0f;
#pragma unroll
      for (std::uint32_t u = 0; u < U; ++u) {
        s[u][g] = exp2f(s[u][g] - m_new);  // masked rows: exp2(-inf) = 0
        sum += s[u][g];
      }
      l[g] = l[g] * alpha + sum;  // this row's share; rows are summed at the end
      m[g] = m_new;
#pragma unroll
      for (std::uint32_t e = 0; e < 8; ++e) acc[g][e] *= alpha;
    }
#pragma unroll
    for (std::uint32_t u = 0; u < U; ++u) {
      float x[8];
      staged_floats<F>(vst[u], lane, x);
#pragma unroll
      for (std::uint32_t g = 0; g < G; ++g)
#pragma unroll
        for (std::uint32_t e = 0; e < 8; ++e) acc[g][e] = fmaf(s[u][g], x[e], acc[g][e]);
    }
  }
  copy_async_wait<0>();  // (only empty groups are left: nothing writes the stages any more)

  // Sum the rows' shares (lanes of the same chunk), then merge the warps in shared memory.
#pragma unroll
  for (std::uint32_t o = L; o < 32; o *= 2)
#pragma unroll
    for (std::uint32_t g = 0; g < G; ++g) {
      l[g] += __shfl_xor_sync(0xffffffffu, l[g], static_cast<int>(o));
#pragma unroll
      for (std::uint32_t e = 0; e < 8; ++e) acc[g][e] += __shfl_xor_sync(0xffffffffu, acc[g][e], static_cast<int>(o));
    }
  __syncthreads();  // every warp is done with the stages (the merge area shares their memory)
  if (r == 0)
#pragma unroll
    for (std::uint32_t g = 0; g < G; ++g)
#pragma unroll
      for (std::uint32_t e = 0; e < 8; ++e) sm.u.merge.acc[warp][g][8 * c + e] = acc[g][e];
  if (lane == 0)
#pragma unroll
    for (std::uint32_t g = 0; g < G; ++g) {
      sm.u.merge.m[warp][g] = m[g];
      sm.u.merge.l[warp][g] = l[g];
    }
  __syncthreads();
  write_block_state(bw, D, &sm.u.merge.m[0][0], &sm.u.merge.l[0][0], G, &sm.u.merge.acc[0][0][0], D);
}

// ---- tensor-core path: f16 keys and values, head_dim 64 or 128 -------------------------------
//
// attend_tc: one block per (sequence, kv head, group of up to 8 query heads, split), like
// attend_dense, but the dot products run on the tensor cores (mma.sync m16n8k16, f16 inputs, f32
// accumulators), so a warp step of 16 tokens costs a few dozen instructions instead of the
// hundreds of scalar FMAs, conversions and shuffles of attend_dense. (On an H200 that made it
// only 1.00-1.06x faster: both read about 3.1 TB/s, 0.74 of the copy rate, at 32k x 8; the
// instructions were not the bound. cuda/README.md.) Each warp takes steps of 16 tokens:
//   scores S^T = K Q^T: A = the 16 key rows (m = token), B = the query heads (n = head, zero past
//     the group), k = channels in an order of our choosing (a dot product does not care), chosen
//     so that lane (g, t) = (lane / 4, lane % 4) loads its A fragments straight from memory: 16
//     bytes at channel 32 j + 8 t of rows g and g + 8, for each j < D / 32; the query's fragments
//     follow the same order and stay in registers for the whole split;
//   the query in f16 would cost 11 bits of its precision: it is split into q_hi + q_lo (both f16,
//     q_lo = q - q_hi), each a B operand, and scaled per head by a power of two so that its largest
//     element lies in [2^14, 2^15) (any f32 query fits; the scale is undone on the scores);
//   online softmax on the accumulators: lane (g, t) holds the scores of tokens g and g + 8 for
//     heads 2t and 2t + 1; the maximum over the step's tokens is three xor shuffles;
//   outputs O^T += V^T P^T: A = V^T (m = channel, k = token), B = the weights (k = token, n = head)
//     as p_hi + p_lo (two f16 each, as the query); channels in an order that lets lane (g, t) load
//     16 bytes at channel 64 h + 8 g of tokens 2t, 2t + 1, 2t + 8, 2t + 9 and pair the halves of
//     two tokens with byte permutes; the weights reach the B layout by four shuffles (each lane
//     holds two heads of two tokens; B wants four tokens of one head);
//   lane (g, t) accumulates channels 64 h + 8 g + 2 w (+ 1) of heads 2t and 2t + 1: no reduction
//     over lanes; the row sums l are per lane and summed over g at the end.
// Rows past the split clamp to its last token (loaded, then masked to weight 0). The warps merge
// in shared memory into the same partial state as attend_partial's, for attend_merge.

/// d += A B for one m16n8k16 tile: A (16 x 16, row-major) in four f16x2 registers, B (16 x 8) in
/// two, f32 accumulators (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type").
__device__ __forceinline__ void mma_f16(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1) {
#if defined(__CUDA_ARCH__)
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#elif !defined(__CUDACC__)
  kvcache_emu::mma_m16n8k16(d, a, b0, b1);  // the CPU emulation (tests/cuda/emulator.hpp)
#endif
}

/// x and y rounded to f16 (to nearest even), x in the low half; and the parts they lost.
struct f16_pair {
  std::uint32_t hi, lo;
};
__device__ __forceinline__ f16_pair split_f16x2(float x, float y) {
#if defined(__CUDA_ARCH__)
  const __half2 h = __floats2half2_rn(x, y);
  const float2 back = __half22float2(h);
  const __half2 r = __floats2half2_rn(x - back.x, y - back.y);
  return {*reinterpret_cast<const std::uint32_t*>(&h), *reinterpret_cast<const std::uint32_t*>(&r)};
#else
  const std::uint16_t hx = detail::f2h(x), hy = detail::f2h(y);
  const std::uint16_t lx = detail::f2h(x - detail::h2f(hx)), ly = detail::f2h(y - detail::h2f(hy));
  return {hx | static_cast<std::uint32_t>(hy) << 16, lx | static_cast<std::uint32_t>(ly) << 16};
#endif
}

template <std::uint32_t D>
struct tc_shared {
  float acc[kWarps][kMaxG][D];
  float m[kWarps][kMaxG];
  float l[kWarps][kMaxG];
};

/// Asks L2 for the 128-byte line at p (no register, no wait). The CPU emulation reads a byte of
/// it instead, so that the address sanitizer checks it.
__device__ __forceinline__ void prefetch_l2(const void* p) {
#if defined(__CUDA_ARCH__)
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
#elif !defined(__CUDACC__)
  (void)*static_cast<const volatile std::byte*>(p);
#endif
}

/// Blocks of attend_tc an SM must hold: cuda_tc_blocks_per_sm (4) without prefetch (128 registers
/// at head_dim 128, 52 bytes spilled; 3 blocks at its natural 154), for grids past one wave of 3
/// blocks per SM; with prefetch, the natural count, for grids within that wave
/// (cuda_auto_prefetch_steps). On an H200 (session 43) 4 blocks made 32k tokens x 8 sequences 12 %
/// faster without prefetch (304-308 against 344-353 us), slower with it (364-396 us), and the
/// one-wave shapes 2-4 % slower.
constexpr unsigned tc_min_blocks(std::uint32_t ahead) { return ahead == 0 ? cuda_tc_blocks_per_sm : 1u; }

/// attend_tc's 16-byte loads of keys and values. Without prefetch (AHEAD 0) each asks L2 for the
/// 256 bytes around it (.L2::256B): the warp's first load of a key or value row brings the bytes
/// of its later ones into L2, so that DRAM is asked for whole rows (H200, session 58: 1.01-1.07x
/// at every shape measured), and with BYPASS it skips L1 (attend_params::bypass_l1). With
/// prefetch, plain loads: the prefetch already asked for the lines, and the hint made those
/// launches 4-7 % slower (session 58).
template <std::uint32_t AHEAD, bool BYPASS>
__device__ __forceinline__ uint4 load_kv16(const std::byte* p) {
#if defined(__CUDA_ARCH__)
  uint4 r;
  if constexpr (AHEAD > 0)
    r = *reinterpret_cast<const uint4*>(p);
  else if constexpr (BYPASS)
    asm volatile("ld.global.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
  else
    asm volatile("ld.global.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
  return r;
#else
  return *reinterpret_cast<const uint4*>(p);
#endif
}

template <std::uint32_t D, std::uint32_t AHEAD, bool BYPASS = false>
__global__ void __launch_bounds__(kThreads, tc_min_blocks(AHEAD))
    attend_tc(attend_params p, std::uint32_t seg, std::uint32_t split_base, std::uint32_t total_splits, float score_scale) {
  static_assert(D == 64 || D == 128);
  static_assert(AHEAD == 0 || !BYPASS);
  constexpr std::uint32_t KJ = D / 32;  // 16-byte key loads per row and lane (two k-steps each)
  constexpr std::uint32_t VH = D / 64;  // 16-byte value loads per token and lane (four m-tiles each)
  constexpr std::uint32_t MT = D / 16;  // m-tiles of the outputs
  constexpr std::uint32_t RB = D * 2;   // bytes of a row
  __shared__ tc_shared<D> sm;
  const std::uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const std::uint32_t g = lane / 4, t = lane % 4;
  const device_pages& pg = p.pages[seg];
  const block_work bw = work_of(p, seg, split_base, total_splits, kMaxG, pg.page_tokens);
  if (empty_split(bw)) return;
  const std::uint32_t t_begin = bw.t_begin, t_end = bw.t_end;
  const seq_pages sp = bw.sp;

  // The row of token u (key or value pages).
  const page_of_token pot(pg.page_tokens);
  auto row_of = [&](const void* base, std::uint64_t page_stride, std::uint64_t head_stride, std::uint32_t u) {
    return static_cast<const std::byte*>(base) + sp.pages[pot.page(u)] * page_stride + bw.kvh * head_stride +
           static_cast<std::size_t>(pot.slot(u)) * RB;
  };

  // Prefetch (into L2) the 16 key and value rows of the warp's step at token ta: lane / 2 is the
  // row, lane % 2 its half. The first AHEAD steps go before the query's set-up.
  auto prefetch_step = [&](std::uint32_t ta) {
    if (ta >= t_end) return;
    const std::uint32_t u = min(ta + lane / 2, t_end - 1);
    prefetch_l2(row_of(pg.k, pg.k_page_stride, pg.k_head_stride, u) + (RB / 2) * (lane & 1u));
    prefetch_l2(row_of(pg.v, pg.v_page_stride, pg.v_head_stride, u) + (RB / 2) * (lane & 1u));
  };
  if constexpr (AHEAD > 0)
#pragma unroll
    for (std::uint32_t a = 0; a < AHEAD; ++a) prefetch_step(t_begin + (warp + a * kWarps) * 16);

  // Query head g of the group (zero past it): channels 32 j + 8 t .. + 7, scaled by 2^e so that
  // the head's largest |element| lies in [2^14, 2^15), as q_hi + q_lo pairs of f16.
  float qf[KJ][8];
  float big = 0.0f;
#pragma unroll
  for (std::uint32_t j = 0; j < KJ; ++j)
#pragma unroll
    for (std::uint32_t i = 0; i < 8; ++i) {
      qf[j][i] = g < bw.ng ? p.q[(static_cast<std::size_t>(bw.b) * p.q_heads + bw.qh0 + g) * D + 32 * j + 8 * t + i] * score_scale : 0.0f;
      big = fmaxf(big, fabsf(qf[j][i]));
    }
  big = fmaxf(big, __shfl_xor_sync(0xffffffffu, big, 1));
  big = fmaxf(big, __shfl_xor_sync(0xffffffffu, big, 2));
  // e = 14 - floor(log2 big), within [-126, 126] (big = 0, or not finite: e = 0, the scores keep
  // whatever the query makes of them).
  int e = 0;
  if (big > 0.0f && big <= 3.4e38f) {
    const int ex = static_cast<int>((__float_as_uint(big) >> 23) & 0xffu) - 127;
    e = 14 - ex < -126 ? -126 : 14 - ex > 126 ? 126 : 14 - ex;
  }
  const float up = __uint_as_float(static_cast<std::uint32_t>(127 + e) << 23);
  std::uint32_t qh[KJ][4], ql[KJ][4];
#pragma unroll
  for (std::uint32_t j = 0; j < KJ; ++j)
#pragma unroll
    for (std::uint32_t w = 0; w < 4; ++w) {
      const f16_pair pr = split_f16x2(qf[j][2 * w] * up, qf[j][2 * w + 1] * up);
      qh[j][w] = pr.hi;
      ql[j][w] = pr.lo;
    }
  // The scale to undo on the scores of heads 2t and 2t + 1 (held by lanes 8t and 8t + 4).
  const float down_g = __uint_as_float(static_cast<std::uint32_t>(127 - e) << 23);
  const float down[2] = {__shfl_sync(0xffffffffu, down_g, 8 * t), __shfl_sync(0xffffffffu, down_g, 8 * t + 4)};

  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}, acc[MT][4];
#pragma unroll
  for (std::uint32_t i = 0; i < MT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
  const std::uint32_t sel = (g & 1u) ? 0x7632u : 0x5410u;  // the half of head g in a shuffled pair
  const std::uint32_t src = 8 * t + g / 2;                 // lane holding token 2t of heads g & ~1, g | 1

  for (std::uint32_t t0 = t_begin + warp * 16; t0 < t_end; t0 += kWarps * 16) {
    if constexpr (AHEAD > 0) prefetch_step(t0 + AHEAD * kWarps * 16);
    uint4 kr[2][KJ], vr[4][VH];
#pragma unroll
    for (std::uint32_t r = 0; r < 2; ++r) {
      const std::byte* row = row_of(pg.k, pg.k_page_stride, pg.k_head_stride, min(t0 + g + 8 * r, t_end - 1)) + 16 * t;
#pragma unroll
      for (std::uint32_t j = 0; j < KJ; ++j) kr[r][j] = load_kv16<AHEAD, BYPASS>(row + 64 * j);
    }
#pragma unroll
    for (std::uint32_t u = 0; u < 4; ++u) {
      const std::uint32_t tok = t0 + 2 * t + (u & 1u) + 8 * (u / 2);
      const std::byte* row = row_of(pg.v, pg.v_page_stride, pg.v_head_stride, min(tok, t_end - 1)) + 16 * g;
#pragma unroll
      for (std::uint32_t h = 0; h < VH; ++h) vr[u][h] = load_kv16<AHEAD, BYPASS>(row + 128 * h);
    }

    // Scores: s[0], s[1] = token g, heads 2t, 2t + 1; s[2], s[3] = token g + 8.
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (std::uint32_t j = 0; j < KJ; ++j) {
      const std::uint32_t a0[4] = {kr[0][j].x, kr[1][j].x, kr[0][j].y, kr[1][j].y};
      mma_f16(s, a0, qh[j][0], qh[j][1]);
      mma_f16(s, a0, ql[j][0], ql[j][1]);
      const std::uint32_t a1[4] = {kr[0][j].z, kr[1][j].z, kr[0][j].w, kr[1][j].w};
      mma_f16(s, a1, qh[j][2], qh[j][3]);
      mma_f16(s, a1, ql[j][2], ql[j][3]);
    }
    const bool live0 = t0 + g < t_end, live1 = t0 + g + 8 < t_end;
    float pw[4];
#pragma unroll
    for (std::uint32_t c = 0; c < 2; ++c) {
      const float s0 = live0 ? s[c] * down[c] : -INFINITY, s1 = live1 ? s[2 + c] * down[c] : -INFINITY;
      float mx = fmaxf(s0, s1);
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
      const float m_new = fmaxf(m[c], mx);  // token t0 is live: finite
      const float alpha = exp2f(m[c] - m_new);
      pw[c] = exp2f(s0 - m_new);
      pw[2 + c] = exp2f(s1 - m_new);
      l[c] = l[c] * alpha + pw[c] + pw[2 + c];
      m[c] = m_new;
#pragma unroll
      for (std::uint32_t i = 0; i < MT; ++i) {
        acc[i][c] *= alpha;
        acc[i][2 + c] *= alpha;
      }
    }
    // The weights as B fragments: b[0] = head g, tokens 2t, 2t + 1; b[1] = tokens 2t + 8, 2t + 9.
    const f16_pair p01 = split_f16x2(pw[0], pw[1]), p23 = split_f16x2(pw[2], pw[3]);
    const std::uint32_t bh0 = __byte_perm(__shfl_sync(0xffffffffu, p01.hi, src), __shfl_sync(0xffffffffu, p01.hi, src + 4), sel);
    const std::uint32_t bh1 = __byte_perm(__shfl_sync(0xffffffffu, p23.hi, src), __shfl_sync(0xffffffffu, p23.hi, src + 4), sel);
    const std::uint32_t bl0 = __byte_perm(__shfl_sync(0xffffffffu, p01.lo, src), __shfl_sync(0xffffffffu, p01.lo, src + 4), sel);
    const std::uint32_t bl1 = __byte_perm(__shfl_sync(0xffffffffu, p23.lo, src), __shfl_sync(0xffffffffu, p23.lo, src + 4), sel);
    // Values: m-tile 4h + w holds channels 64h + 8g + 2w (row g) and that + 1 (row g + 8).
#pragma unroll
    for (std::uint32_t h = 0; h < VH; ++h) {
      const std::uint32_t w0[4] = {vr[0][h].x, vr[0][h].y, vr[0][h].z, vr[0][h].w};
      const std::uint32_t w1[4] = {vr[1][h].x, vr[1][h].y, vr[1][h].z, vr[1][h].w};
      const std::uint32_t w2[4] = {vr[2][h].x, vr[2][h].y, vr[2][h].z, vr[2][h].w};
      const std::uint32_t w3[4] = {vr[3][h].x, vr[3][h].y, vr[3][h].z, vr[3][h].w};
#pragma unroll
      for (std::uint32_t w = 0; w < 4; ++w) {
        const std::uint32_t a[4] = {__byte_perm(w0[w], w1[w], 0x5410u), __byte_perm(w0[w], w1[w], 0x7632u),
                                    __byte_perm(w2[w], w3[w], 0x5410u), __byte_perm(w2[w], w3[w], 0x7632u)};
        mma_f16(acc[4 * h + w], a, bh0, bh1);
        mma_f16(acc[4 * h + w], a, bl0, bl1);
      }
    }
  }

  // Row sums over the lanes of a head (g); then the warps merge in shared memory.
#pragma unroll
  for (std::uint32_t c = 0; c < 2; ++c)
#pragma unroll
    for (int o = 4; o < 32; o *= 2) l[c] += __shfl_xor_sync(0xffffffffu, l[c], o);
#pragma unroll
  for (std::uint32_t h = 0; h < VH; ++h)
#pragma unroll
    for (std::uint32_t w = 0; w < 4; ++w)
#pragma unroll
      for (std::uint32_t i = 0; i < 4; ++i) sm.acc[warp][2 * t + i % 2][64 * h + 8 * g + 2 * w + i / 2] = acc[4 * h + w][i];
  if (g == 0)
#pragma unroll
    for (std::uint32_t c = 0; c < 2; ++c) {
      sm.m[warp][2 * t + c] = m[c];
      sm.l[warp][2 * t + c] = l[c];
    }
  __syncthreads();
  write_block_state(bw, D, &sm.m[0][0], &sm.l[0][0], kMaxG, &sm.acc[0][0][0], D);
}

// ---- Q4 fast path: Q4 keys and values, head_dim 64, 128 or 256 (B = head_dim / 32 columns) ----
//
// attend_q4: the block layout of attend_partial (one page, 32 tokens, per warp step), but the
// codes are spread over the lanes so that every load is coalesced and issued before use:
//   keys: lane (x, h) = (lane % 16, lane / 16) reads word x of channel quads 2k + h (the codes of
//   tokens x and x + 16 for four channels), dots them with the folded query (the page's scales
//   times the query, written to shared memory by the lanes, four channels each), and the halves
//   h = 0, 1 are summed by one shuffle; lane t then owns token t (score, softmax weight);
//   values: lane (x, h) reads word x of token quads 2 m + h of every column j (channels 32 j + x
//   and 32 j + x + 16 of four tokens); each token's weight times its value scale goes through
//   shared memory, the minimum's share (weight times minimum, the same for a column's channels)
//   is summed per lane and column, and the halves h are summed at the end.
// Codes become floats exactly through the bit pattern 2^23 + code (one byte permute and one add).
// Tokens past a page's count get weight 0, their value scales and minimums are never used (they
// may be anything, format.hpp).
__device__ __forceinline__ float q4_code(unsigned codes, unsigned i) {  // byte i of four 4-bit codes
  return __uint_as_float(__byte_perm(codes, 0x4B000000u, 0x7540u + i)) - 8388608.0f;
}
/// The eight codes of a code word as floats: byte i's low nibble (a[i]) and high nibble (c[i]).
__device__ __forceinline__ void q4_word_codes(unsigned word, float (&a)[4], float (&c)[4]) {
  const unsigned lo = word & 0x0F0F0F0Fu, hi = (word >> 4) & 0x0F0F0F0Fu;
#pragma unroll
  for (std::uint32_t i = 0; i < 4; ++i) {
    a[i] = q4_code(lo, i);
    c[i] = q4_code(hi, i);
  }
}

template <std::uint32_t B, std::uint32_t G>
struct q4_shared {
  alignas(16) float q[G][32 * B];
  union {
    alignas(16) float work[kWarps][G][32 * B];  // per warp: folded query, then weight x value scale [g][j][t]
    alignas(16) float acc[kWarps][G][32 * B];   // the warps' outputs, for the merge
  } u;
  float m[kWarps][G];
  float l[kWarps][G];
};

template <std::uint32_t B, std::uint32_t G>
__global__ void __launch_bounds__(kThreads, B * G <= 8 && B <= 4 ? 4 : B * G <= 16 ? 3 : 2) attend_q4(attend_params p, std::uint32_t seg, std::uint32_t split_base,
                                                      std::uint32_t total_splits, float score_scale) {
  constexpr std::uint32_t D = 32 * B;
  constexpr std::uint32_t KW = D / 8;  // key code words per lane
  __shared__ q4_shared<B, G> sm;
  const std::uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const std::uint32_t x = lane % 16, h = lane / 16;
  const device_pages& pg = p.pages[seg];
  const block_work bw = work_of(p, seg, split_base, total_splits, G, q4_group);
  if (empty_split(bw)) return;
  // t_begin is a multiple of 32 (split_tokens is): pages start warp steps.
  const std::uint32_t b = bw.b, kvh = bw.kvh, ng = bw.ng, qh0 = bw.qh0, t_begin = bw.t_begin, t_end = bw.t_end;
  const seq_pages sp = bw.sp;
  for (std::uint32_t i = threadIdx.x; i < G * D; i += blockDim.x) {
    const std::uint32_t g = i / D, d = i % D;
    sm.q[g][d] = g < ng ? p.q[(static_cast<std::size_t>(b) * p.q_heads + qh0 + g) * D + d] * score_scale : 0.0f;
  }
  __syncthreads();

  float m[G], l[G], acc[G][B][2], bias[G][B];
#pragma unroll
  for (std::uint32_t g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
#pragma unroll
    for (std::uint32_t j = 0; j < B; ++j) acc[g][j][0] = acc[g][j][1] = bias[g][j] = 0.0f;
  }
  float(*work)[D] = sm.u.work[warp];
  const std::byte* k_heads = static_cast<const std::byte*>(pg.k) + kvh * pg.k_head_stride;
  const std::byte* v_heads = static_cast<const std::byte*>(pg.v) + kvh * pg.v_head_stride;
  const std::uint32_t stride = kWarps * q4_group;
  std::uint32_t page = sp.pages[min(t_begin + warp * q4_group, t_end - 1) / q4_group];

  for (std::uint32_t t0 = t_begin + warp * q4_group; t0 < t_end; t0 += stride) {
    const std::uint32_t nt = min(q4_group, t_end - t0);
    const bool live = lane < nt;  // lane = token of the page, for weights and value scales
    const std::byte* kg = k_heads + page * pg.k_page_stride;
    const std::byte* vg = v_heads + page * pg.v_page_stride;
    // Every load of the page first.
    unsigned kc[KW], vc[B][4];
    const auto* kwords = reinterpret_cast<const unsigned*>(kg);
    const auto* vwords = reinterpret_cast<const unsigned*>(vg);
#pragma unroll
    for (std::uint32_t k = 0; k < KW; ++k) kc[k] = kwords[(2 * k + h) * 16 + x];
#pragma unroll
    for (std::uint32_t j = 0; j < B; ++j)
#pragma unroll
      for (std::uint32_t mq = 0; mq < 4; ++mq) vc[j][mq] = vwords[j * 128 + (2 * mq + h) * 16 + x];
    std::uint16_t ks[B], km[B], vs[B], vm[B];  // key channels lane * B + i; value columns of token `lane`
    const auto* kscales = reinterpret_cast<const std::uint16_t*>(kg + q4_key_scales_offset(D)) + lane * B;
    const auto* kmins = reinterpret_cast<const std::uint16_t*>(kg + q4_key_mins_offset(D)) + lane * B;
    const auto* vscales = reinterpret_cast<const std::uint16_t*>(vg + q4_value_scales_offset(D)) + lane;
    const auto* vmins = reinterpret_cast<const std::uint16_t*>(vg + q4_value_mins_offset(D)) + lane;
#pragma unroll
    for (std::uint32_t i = 0; i < B; ++i) {
      ks[i] = kscales[i];
      km[i] = kmins[i];
      vs[i] = vscales[i * q4_group];
      vm[i] = vmins[i * q4_group];
    }
    page = sp.pages[min(t0 + stride, t_end - 1) / q4_group];  // the next step's page, ahead
    // ... and its key and value groups, asked of L2 (a line a lane): the step's loads find them
    // there (H200, session 58: 1.04x at 32k x 8, 1.02-1.03x at 32k x 1 and 4k x 8, 4k x 1 the same).
    if (t0 + stride < t_end) {
      const std::byte* kn = k_heads + page * pg.k_page_stride;
      const std::byte* vn = v_heads + page * pg.v_page_stride;
      for (std::uint32_t i = lane; i < (q4_key_group_bytes(D) + 127) / 128; i += 32) prefetch_l2(kn + 128 * i);
      for (std::uint32_t i = lane; i < (q4_value_group_bytes(D) + 127) / 128; i += 32) prefetch_l2(vn + 128 * i);
    }

    // Folded query: q * scale per channel (lane: channels lane * B ..), and sum q * min.
    float cmin[G];
#pragma unroll
    for (std::uint32_t g = 0; g < G; ++g) {
      float c = 0.0f;
#pragma unroll
      for (std::uint32_t i = 0; i < B; ++i) {
        const float qv = sm.q[g][lane * B + i];
        work[g][lane * B + i] = qv * half_bits_to_float(ks[i]);
        c = fmaf(qv, half_bits_to_float(km[i]), c);
      }
      cmin[g] = c;
    }
    __syncwarp();

    // Scores of tokens x (low nibbles) and x + 16 (high) over channel quads 2 k + h.
    float s0[G], s1[G];
#pragma unroll
    for (std::uint32_t g = 0; g < G; ++g) s0[g] = s1[g] = 0.0f;
#pragma unroll
    for (std::uint32_t k = 0; k < KW; ++k) {
      float a[4], c[4];  // tokens x (a) and x + 16 (c) of channels 4 (2 k + h) + i
      q4_word_codes(kc[k], a, c);
#pragma unroll
      for (std::uint32_t g = 0; g < G; ++g) {
        const float4 qs = *reinterpret_cast<const float4*>(&work[g][4 * (2 * k + h)]);
        s0[g] = fmaf(qs.x, a[0], fmaf(qs.y, a[1], fmaf(qs.z, a[2], fmaf(qs.w, a[3], s0[g]))));
        s1[g] = fmaf(qs.x, c[0], fmaf(qs.y, c[1], fmaf(qs.z, c[2], fmaf(qs.w, c[3], s1[g]))));
      }
    }
    float pr[G];
#pragma unroll
    for (std::uint32_t g = 0; g < G; ++g) {
      s0[g] += __shfl_xor_sync(0xffffffffu, s0[g], 16);
      s1[g] += __shfl_xor_sync(0xffffffffu, s1[g], 16);
      const float own = (h == 0 ? s0[g] : s1[g]) + warp_sum(cmin[g]);  // token `lane`
      const float sc = live ? own : -INFINITY;
      const float m_new = fmaxf(m[g], warp_max(sc));  // token t0 is live: finite
      const float alpha = exp2f(m[g] - m_new);
      pr[g] = exp2f(sc - m_new);  // dead tokens: 0
      l[g] = l[g] * alpha + pr[g];  // this lane's token; lanes are summed at the end
      m[g] = m_new;
#pragma unroll
      for (std::uint32_t j = 0; j < B; ++j) {
        acc[g][j][0] *= alpha;
        acc[g][j][1] *= alpha;
        bias[g][j] *= alpha;
      }
    }
    __syncwarp();  // the folded query is read: work now takes the weights

    // Weight x value scale of this lane's token per column; the minimums' share per column.
#pragma unroll
    for (std::uint32_t j = 0; j < B; ++j) {
      const float sc = live ? half_bits_to_float(vs[j]) : 0.0f, mn = live ? half_bits_to_float(vm[j]) : 0.0f;
#pragma unroll
      for (std::uint32_t g = 0; g < G; ++g) {
        work[g][j * q4_group + lane] = pr[g] * sc;
        bias[g][j] = fmaf(pr[g], mn, bias[g][j]);
      }
    }
    __syncwarp();
#pragma unroll
    for (std::uint32_t j = 0; j < B; ++j)
#pragma unroll
      for (std::uint32_t mq = 0; mq < 4; ++mq) {
        float a[4], c[4];  // tokens 4 (2 mq + h) + i of channels 32 j + x (a) and 32 j + x + 16 (c)
        q4_word_codes(vc[j][mq], a, c);
#pragma unroll
        for (std::uint32_t g = 0; g < G; ++g) {
          const float4 w = *reinterpret_cast<const float4*>(&work[g][j * q4_group + 4 * (2 * mq + h)]);
          acc[g][j][0] = fmaf(w.x, a[0], fmaf(w.y, a[1], fmaf(w.z, a[2], fmaf(w.w, a[3], acc[g][j][0]))));
          acc[g][j][1] = fmaf(w.x, c[0], fmaf(w.y, c[1], fmaf(w.z, c[2], fmaf(w.w, c[3], acc[g][j][1]))));
        }
      }
    __syncwarp();  // the weights are read: the next page folds its query into work
  }

  // Sum over the lanes: weights and minimum shares (one token per lane), token-quad halves h.
#pragma unroll
  for (std::uint32_t g = 0; g < G; ++g) {
    l[g] = warp_sum(l[g]);
#pragma unroll
    for (std::uint32_t j = 0; j < B; ++j) {
      bias[g][j] = warp_sum(bias[g][j]);
      acc[g][j][0] += __shfl_xor_sync(0xffffffffu, acc[g][j][0], 16);
      acc[g][j][1] += __shfl_xor_sync(0xffffffffu, acc[g][j][1], 16);
    }
  }
  __syncthreads();  // every warp is done with work (acc shares its memory)
  if (h == 0)
#pragma unroll
    for (std::uint32_t g = 0; g < G; ++g)
#pragma unroll
      for (std::uint32_t j = 0; j < B; ++j) {
        sm.u.acc[warp][g][32 * j + x] = acc[g][j][0] + bias[g][j];
        sm.u.acc[warp][g][32 * j + x + 16] = acc[g][j][1] + bias[g][j];
      }
  if (lane == 0)
#pragma unroll
    for (std::uint32_t g = 0; g < G; ++g) {
      sm.m[warp][g] = m[g];
      sm.l[warp][g] = l[g];
    }
  __syncthreads();
  write_block_state(bw, D, &sm.m[0][0], &sm.l[0][0], G, &sm.u.acc[0][0][0], D);
}

using partial_fn = void (*)(attend_params, std::uint32_t, std::uint32_t, std::uint32_t, float);

template <format KF>
partial_fn pick_v(format vf) {
  switch (vf) {
    case format::f32: return attend_partial<KF, format::f32>;
    case format::f16: return attend_partial<KF, format::f16>;
    case format::q4: return attend_partial<KF, format::q4>;
  }
  return nullptr;
}

partial_fn pick(format kf, format vf) {
  switch (kf) {
    case format::f32: return pick_v<format::f32>(vf);
    case format::f16: return pick_v<format::f16>(vf);
    case format::q4: return pick_v<format::q4>(vf);
  }
  return nullptr;
}

bool known(format f) { return f == format::f32 || f == format::f16 || f == format::q4; }

template <format F, std::uint32_t L>
partial_fn pick_dense_g(std::uint32_t gqa) {
  if (gqa == 1) return attend_dense<F, L, 1>;
  if (gqa == 2) return attend_dense<F, L, 2>;
  if (gqa <= 4) return attend_dense<F, L, 4>;
  return attend_dense<F, L, 8>;  // more than 8: kMaxG-head groups, like attend_partial
}
template <format F>
partial_fn pick_dense_l(std::uint32_t D, std::uint32_t gqa) {
  if (D == 64) return pick_dense_g<F, 8>(gqa);
  if (D == 128) return pick_dense_g<F, 16>(gqa);
  return pick_dense_g<F, 32>(gqa);
}
template <std::uint32_t D>
partial_fn pick_tc_ahead(std::uint32_t ahead, bool bypass_l1) {
  switch (ahead) {
    case 1: return attend_tc<D, 1>;
    case 2: return attend_tc<D, 2>;
    case 3: return attend_tc<D, 3>;
    case 4: return attend_tc<D, 4>;
    default: return bypass_l1 ? attend_tc<D, 0, true> : attend_tc<D, 0>;
  }
}
partial_fn pick_tc(std::uint32_t D, std::uint32_t ahead, bool bypass_l1) {
  return D == 64 ? pick_tc_ahead<64>(ahead, bypass_l1) : pick_tc_ahead<128>(ahead, bypass_l1);
}
partial_fn pick_dense(format f, std::uint32_t D, std::uint32_t gqa) {
  return f == format::f32 ? pick_dense_l<format::f32>(D, gqa) : pick_dense_l<format::f16>(D, gqa);
}

template <std::uint32_t B>
partial_fn pick_q4_g(std::uint32_t gqa) {
  if (gqa == 1) return attend_q4<B, 1>;
  if (gqa == 2) return attend_q4<B, 2>;
  if (gqa <= 4) return attend_q4<B, 4>;
  return attend_q4<B, 8>;
}
partial_fn pick_q4(std::uint32_t D, std::uint32_t gqa) {
  if (D == 64) return pick_q4_g<2>(gqa);
  if (D == 128) return pick_q4_g<4>(gqa);
  return pick_q4_g<8>(gqa);
}

/// Whether segment s takes attend_q4: Q4 keys and values, head_dim 64, 128 or 256 (the pages'
/// other conditions, 32 tokens and 4-byte alignment, are validate_attend's for every Q4 page).
bool q4_fast_path(const attend_params& p, std::uint32_t s) {
  const device_pages& pg = p.pages[s];
  return pg.k_format == format::q4 && pg.v_format == format::q4 &&
         (p.head_dim == 64 || p.head_dim == 128 || p.head_dim == 256);
}

/// Whether segment s takes attend_dense: keys and values both f16 or both f32, head_dim 64, 128
/// or 256, and every row 16-byte aligned (its 16-byte loads).
bool dense_fast_path(const attend_params& p, std::uint32_t s) {
  const device_pages& pg = p.pages[s];
  if (pg.k_format != pg.v_format || pg.k_format == format::q4) return false;
  if (p.head_dim != 64 && p.head_dim != 128 && p.head_dim != 256) return false;
  const std::uint64_t bits = reinterpret_cast<std::uintptr_t>(pg.k) | reinterpret_cast<std::uintptr_t>(pg.v) |
                             pg.k_page_stride | pg.v_page_stride | pg.k_head_stride | pg.v_head_stride;
  return (bits & 15u) == 0;
}

/// Whether segment s takes attend_tc: attend_dense's conditions, with f16 keys and values and
/// head_dim 64 or 128 (256 would need twice its registers).
bool tc_path(const attend_params& p, std::uint32_t s) {
  return dense_fast_path(p, s) && p.pages[s].k_format == format::f16 && (p.head_dim == 64 || p.head_dim == 128);
}

/// Host-side validation of cuda_attend's parameters (no CUDA call).
inline result<void> validate_attend(const attend_params& p) {
  if (p.segments != 1 && p.segments != 2)
    return fail(errc::invalid_argument, "cuda_attend: segments must be 1 or 2", {{"segments", p.segments}});
  if (p.batch == 0 || p.kv_heads == 0 || p.head_dim == 0 || p.q_heads == 0)
    return fail(errc::invalid_argument, "cuda_attend: zero dimension",
                {{"batch", p.batch}, {"q_heads", p.q_heads}, {"kv_heads", p.kv_heads}, {"head_dim", p.head_dim}});
  if (p.q_heads % p.kv_heads != 0)
    return fail(errc::invalid_argument, "cuda_attend: q_heads must be a multiple of kv_heads",
                {{"q_heads", p.q_heads}, {"kv_heads", p.kv_heads}});
  if (p.head_dim > cuda_max_head_dim)
    return fail(errc::unsupported, "cuda_attend: head_dim above the kernel's limit",
                {{"head_dim", p.head_dim}, {"max", cuda_max_head_dim}});
  if (p.split_tokens == 0 || p.split_tokens % 32 != 0)
    return fail(errc::invalid_argument, "cuda_attend: split_tokens must be a positive multiple of 32",
                {{"split_tokens", p.split_tokens}});
  if (p.prefetch_steps > 4)
    return fail(errc::invalid_argument, "cuda_attend: prefetch_steps above 4", {{"prefetch_steps", p.prefetch_steps}});
  if (p.q == nullptr || p.out == nullptr || p.workspace == nullptr)
    return fail(errc::invalid_argument, "cuda_attend: null q, out or workspace");
  const std::uint32_t gqa = p.q_heads / p.kv_heads;
  const std::size_t grid_y = static_cast<std::size_t>(p.kv_heads) * ((gqa + kMaxG - 1) / kMaxG);
  if (grid_y > 65535 || p.q_heads > 65535)
    return fail(errc::invalid_argument, "cuda_attend: too many heads for the grid", {{"q_heads", p.q_heads}});
  for (std::uint32_t s = 0; s < p.segments; ++s) {
    const device_pages& pg = p.pages[s];
    const device_table& t = p.tables[s];
    if (!known(pg.k_format) || !known(pg.v_format))
      return fail(errc::invalid_argument, "cuda_attend: unknown format", {{"segment", s}});
    if (pg.page_tokens == 0 || pg.k == nullptr || pg.v == nullptr)
      return fail(errc::invalid_argument, "cuda_attend: segment pages", {{"segment", s}, {"page_tokens", pg.page_tokens}});
    if ((pg.k_format == format::q4 || pg.v_format == format::q4) && pg.page_tokens != q4_group)
      return fail(errc::unsupported, "cuda_attend: q4 pages must hold 32 tokens", {{"segment", s}, {"page_tokens", pg.page_tokens}});
    for (const bool keys : {true, false}) {  // Q4 pages: one whole, aligned group per head
      if ((keys ? pg.k_format : pg.v_format) != format::q4) continue;
      const std::size_t group = keys ? q4_key_group_bytes(p.head_dim) : q4_value_group_bytes(p.head_dim);
      const std::uint64_t head = keys ? pg.k_head_stride : pg.v_head_stride;
      if (p.kv_heads > 1 && head < group)
        return fail(errc::invalid_argument, "cuda_attend: Q4 head stride smaller than one group",
                    {{"segment", s}, {"keys", keys ? 1 : 0}, {"head_stride", static_cast<long long>(head)},
                     {"group_bytes", static_cast<long long>(group)}});
      if (keys ? !detail::q4_aligned(pg.k, pg.k_page_stride, pg.k_head_stride)
               : !detail::q4_aligned(pg.v, pg.v_page_stride, pg.v_head_stride))
        return fail(errc::invalid_argument, "cuda_attend: Q4 pages and strides must be 4-byte aligned",
                    {{"segment", s}, {"keys", keys ? 1 : 0}});
    }
    if (t.batch != p.batch)
      return fail(errc::invalid_argument, "cuda_attend: segment table batch", {{"segment", s}, {"table_batch", t.batch}, {"batch", p.batch}});
    // A table without pages still needs its arrays (the caches' device tables always have them).
    if (t.indptr == nullptr || t.indices == nullptr || t.last_page_len == nullptr)
      return fail(errc::invalid_argument, "cuda_attend: segment table array is null",
                  {{"segment", s}, {"indptr_null", t.indptr == nullptr ? 1 : 0}, {"indices_null", t.indices == nullptr ? 1 : 0},
                   {"last_page_len_null", t.last_page_len == nullptr ? 1 : 0}});
    if (p.max_splits[s] == 0 || p.max_splits[s] > 65535)
      return fail(errc::invalid_argument, "cuda_attend: max_splits", {{"segment", s}, {"max_splits", p.max_splits[s]}});
  }
  return {};
}

/// Launches the kernels of a validated attend: `launch(kernel, grid, block, args...)` returns
/// result<void> (a CUDA launch on a stream, or the CPU emulation of the tests).
template <class Launch>
result<void> launch_attend(const attend_params& p, Launch&& launch) {
  const std::uint32_t gqa = p.q_heads / p.kv_heads;
  const auto grid_y = static_cast<unsigned>(p.kv_heads * ((gqa + kMaxG - 1) / kMaxG));
  const float scale = (p.scale != 0.0f ? p.scale : 1.0f / std::sqrt(static_cast<float>(p.head_dim))) * kLog2e;
  const std::uint32_t total = p.max_splits[0] + (p.segments == 2 ? p.max_splits[1] : 0u);
  std::uint32_t base = 0;
  for (std::uint32_t s = 0; s < p.segments; ++s) {
    const std::uint32_t gqa_s = p.q_heads / p.kv_heads;
    const partial_fn fn = tc_path(p, s)           ? pick_tc(p.head_dim, p.prefetch_steps, p.bypass_l1)
                          : dense_fast_path(p, s) ? pick_dense(p.pages[s].k_format, p.head_dim, gqa_s)
                          : q4_fast_path(p, s)  ? pick_q4(p.head_dim, gqa_s)
                                                : pick(p.pages[s].k_format, p.pages[s].v_format);
    KVCACHE_TRY(launch(fn, dim3(p.batch, grid_y, p.max_splits[s]), dim3(kThreads), p, s, base, total, scale));
    base += p.max_splits[s];
  }
  return launch(attend_merge, dim3(p.batch, p.q_heads), dim3(kMergeThreads), p, total);
}

}  // namespace
}  // namespace kvcache
