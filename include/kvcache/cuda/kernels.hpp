#pragma once
/// @file cuda/kernels.hpp
/// Tested on an H100 and an H200 against the CPU caches and float64 references (cuda/README.md).
/// The CUDA kernels behind contiguous_cache<cuda>, paged_cache<cuda> and two_tier_cache<cuda>,
/// callable directly by an engine that keeps its own tables. Each launcher validates its parameters on the host (typed
/// error, nothing enqueued), then enqueues one or two kernels on `where.stream` and returns without
/// waiting. Kernels never fail; asynchronous faults surface at the next cuda_synchronize().
///
/// Every cache's storage is described the same way, as pages (FlashInfer's paged layout): a
/// sequence is an ordered list of pages of `page_tokens` tokens, given by a CSR table whose arrays
/// live in device memory. A contiguous cache is the special case of one page per sequence of
/// `page_tokens = max_tokens`; a two-tier cache has a Q4 segment (pages of 32 tokens) followed by
/// an FP16 tail segment. Because kernels read lengths and tables from device memory, a decode step
/// captured once in a CUDA graph stays valid while sequences grow, as long as the tables are
/// updated in place (same device addresses) between replays.

#include <kvcache/error.hpp>
#include <kvcache/format.hpp>
#include <kvcache/placement.hpp>

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace kvcache {

/// Where one layer's K/V pages live in device memory. Trivially copyable; passed to kernels by value.
/// Page p of kv head h: keys at k + p * k_page_stride + h * k_head_stride, laid out as
/// - f32 / f16: [token][head_dim] dense elements (token < page_tokens);
/// - q4 (page_tokens must be 32): one Q4 key group of the page's tokens (format.hpp),
///   q4_key_group_bytes(head_dim) bytes.
/// Values likewise at v + p * v_page_stride + h * v_head_stride; q4 values are one Q4 value group
/// (format.hpp), q4_value_group_bytes(head_dim) bytes. Q4 pages (pointer and strides) must be
/// 4-byte aligned, and with more than one kv head their head stride at least the group's bytes.
struct device_pages {
  void* k = nullptr;
  void* v = nullptr;
  std::uint64_t k_page_stride = 0;  ///< bytes between consecutive pages of k
  std::uint64_t v_page_stride = 0;  ///< bytes between consecutive pages of v
  std::uint64_t k_head_stride = 0;  ///< bytes between kv heads inside a page of k
  std::uint64_t v_head_stride = 0;  ///< bytes between kv heads inside a page of v
  std::uint32_t page_tokens = 0;    ///< tokens per page (> 0)
  format k_format = format::f16;
  format v_format = format::f16;
};
static_assert(std::is_trivially_copyable_v<device_pages>);

/// A batch of sequences' page lists in CSR form; every pointer is device memory.
/// Sequence b owns pages indices[indptr[b] .. indptr[b+1]); its last page holds last_page_len[b]
/// tokens (1..page_tokens), every other page is full. A sequence with no page has 0 tokens.
struct device_table {
  const std::uint32_t* indptr = nullptr;         ///< [batch + 1]
  const std::uint32_t* indices = nullptr;        ///< [indptr[batch]] page ids
  const std::uint32_t* last_page_len = nullptr;  ///< [batch]
  std::uint32_t batch = 0;                       ///< sequences in the batch
};
static_assert(std::is_trivially_copyable_v<device_table>);

/// Scatter of new K/V rows into pages (the append of the step protocol), one launch per layer.
/// The destination table already counts the new tokens (the reservation): the n_b new rows of
/// sequence b go to its last n_b positions.
struct append_params {
  device_pages dst;           ///< f32 or f16 pages of this layer
  device_table table;         ///< table.batch sequences; ignored when `single` is set
  const void* k = nullptr;    ///< device [rows][kv_heads][head_dim] in src_format
  const void* v = nullptr;    ///< device [rows][kv_heads][head_dim] in src_format
  format src_format = format::f32;  ///< f32 or f16
  /// Device [table.batch + 1]: the new rows of sequence b are src_indptr[b] .. src_indptr[b+1].
  const std::uint32_t* src_indptr = nullptr;
  std::uint32_t max_rows = 0;  ///< grid bound: rows >= src_indptr[batch] are skipped
  std::uint32_t kv_heads = 0;
  std::uint32_t head_dim = 0;
  /// Host-side single-sequence form, so a one-sequence write needs no device table: when
  /// single_pages != nullptr, the batch is one sequence whose length after the append is
  /// single_length tokens, whose new rows are rows 0 .. max_rows - 1, and whose page i (i >=
  /// single_first_page) is the device value single_pages[i - single_first_page].
  const std::uint32_t* single_pages = nullptr;
  std::uint32_t single_length = 0;
  std::uint32_t single_first_page = 0;
};

/// Validates and enqueues the append kernel. errc::invalid_argument for a null pointer, a zero
/// dimension or a q4 destination; errc::device_error if the launch fails.
[[nodiscard]] result<void> cuda_append(const cuda& where, const append_params& p);

/// Most channels per head the attention kernel supports.
inline constexpr std::uint32_t cuda_max_head_dim = 256;

/// Decode attention (one query token per sequence) over one or two page segments, grouped-query
/// heads, flash-decoding: each (sequence, kv head, split of split_tokens tokens) block writes a
/// partial softmax state (max, sum, unnormalized output) to the workspace, and a merge kernel
/// combines the splits of all segments. Q4 pages are read in place (scales folded into the query).
struct attend_params {
  device_pages pages[2];      ///< segment s storage; segment 0's tokens come first
  device_table tables[2];     ///< segment s tables; tables[s].batch must equal `batch`
  std::uint32_t segments = 1;  ///< 1 or 2
  std::uint32_t batch = 0;
  std::uint32_t q_heads = 0;   ///< multiple of kv_heads; q head i uses kv head i / (q_heads / kv_heads)
  std::uint32_t kv_heads = 0;
  std::uint32_t head_dim = 0;  ///< 1..cuda_max_head_dim
  const float* q = nullptr;    ///< device [batch][q_heads][head_dim]
  float* out = nullptr;        ///< device [batch][q_heads][head_dim]; 0 for a sequence with no token
  float scale = 0.0f;          ///< score scale; 0 means 1 / sqrt(head_dim)
  std::uint32_t split_tokens = 512;  ///< tokens per split, multiple of 32
  /// attend_tc only (f16 keys and values, head_dim 64 or 128): how many of its 16-token steps
  /// ahead each warp asks L2 for (prefetch, no registers held), 0..4; 0: none. The caches use
  /// cuda_auto_prefetch_steps; `BM_cuda_attend/.../prefetch:N` measures it (cuda/README.md).
  std::uint32_t prefetch_steps = 0;
  /// attend_tc without prefetch (prefetch_steps 0; ignored otherwise): its key and value loads
  /// skip L1 (ld.global.L1::no_allocate). Either way, those loads ask L2 for the whole 256 bytes
  /// around each address. The caches use cuda_auto_bypass_l1; `BM_cuda_attend/.../l1:N`
  /// measures it (cuda/README.md).
  bool bypass_l1 = false;
  /// Splits per segment: grid bound, fixed so a captured graph stays valid as sequences grow;
  /// must cover the longest sequence: max_splits * split_tokens >= tokens of any segment.
  std::uint32_t max_splits[2] = {1, 1};
  float* workspace = nullptr;  ///< device, at least cuda_attend_workspace_bytes(*this) bytes
};

/// Blocks of one segment's partial kernel in an attend launch (the grid cuda_auto_prefetch_steps
/// and cuda_auto_split_tokens weigh): batch x kv_heads x groups of 8 query heads x splits.
[[nodiscard]] constexpr std::size_t cuda_attend_blocks(std::size_t batch, std::size_t kv_heads, std::size_t q_heads,
                                                       std::size_t splits) noexcept {
  const std::size_t gqa = kv_heads == 0 ? 0 : q_heads / kv_heads;
  return batch * kv_heads * ((gqa + 7) / 8) * splits;
}

/// A split for attend_params::split_tokens: the largest of 1024, 512, ..., 32 tokens whose grid
/// (batch x kv_heads x groups of 8 query heads x splits of `cover` tokens, `cover` the longest
/// sequence) still has a block for each of the device's `multiprocessors` (fewer blocks leave
/// multiprocessors idle; smaller splits add per-block work and partial states to merge). The
/// caches' attend() uses it when cuda_attend_options::split_tokens is 0 (the default).
[[nodiscard]] constexpr std::uint32_t cuda_auto_split_tokens(std::size_t cover, std::size_t batch, std::size_t kv_heads,
                                                             std::size_t q_heads, int multiprocessors) noexcept {
  std::uint32_t split = 1024;
  for (; split > 32; split /= 2)
    if (cuda_attend_blocks(batch, kv_heads, q_heads, (cover + split - 1) / split) >=
        static_cast<std::size_t>(multiprocessors < 0 ? 0 : multiprocessors))
      break;
  return split;
}

/// attend_params::prefetch_steps for a launch of `blocks` blocks (cuda_attend_blocks) of
/// `split_tokens` tokens on `multiprocessors` SMs: 1 when the splits are of 256 tokens or more and
/// the grid fits in one wave of 3 blocks per SM, else 0; what the caches' attend() uses unless
/// cuda_attend_options::prefetch_steps says otherwise. At head_dim 128 the f16 tensor-core kernel
/// with prefetch holds 3 blocks per SM (154 registers), without it 4 (compiled for 128): where the
/// grid fits in one wave of the first, prefetch hides the latency that the idle SMs cannot; past
/// that, the fourth block per SM does it better. Measured on an H200 (session 43, f16 contiguous
/// and paged, `BM_cuda_attend/.../prefetch:N`, two runs each, 1024-token splits): 256 blocks (4k x
/// 8 sequences, 32k x 1) 51.0-51.9 us with prefetch against 59.6-61.1 without; 512 blocks (32k x
/// 2) 107.8-108.1 against 83.4-83.8; 1024 (32k x 4) 171-173 against 160; 2048 (32k x 8)
/// 323-328 against 304-309. Shorter splits at 256 blocks, against the 3-block build without
/// prefetch: 512 tokens 2-10 % faster with it, 256 tokens 0-5 %, 128 tokens (a warp runs few
/// steps) 1-3 % slower. Two steps ahead was slower than none everywhere.
[[nodiscard]] constexpr std::uint32_t cuda_auto_prefetch_steps(std::uint32_t split_tokens, std::size_t blocks,
                                                               int multiprocessors) noexcept {
  const std::size_t wave = 3 * static_cast<std::size_t>(multiprocessors < 0 ? 0 : multiprocessors);
  return split_tokens >= 256 && blocks <= wave ? 1u : 0u;
}

/// Blocks of the f16 tensor-core kernel an SM holds without prefetch: the minimum its launch
/// bounds ask for there (cuda/attend_kernels.cuh, tc_min_blocks), and so one wave's blocks per SM
/// for cuda_auto_bypass_l1.
inline constexpr unsigned cuda_tc_blocks_per_sm = 4;

/// attend_params::bypass_l1 for a launch of `blocks` blocks (cuda_attend_blocks) on
/// `multiprocessors` SMs: true past one wave of cuda_tc_blocks_per_sm blocks per SM (the f16
/// tensor-core kernel's occupancy without prefetch), else false; what the caches' attend() uses.
/// Measured on an H200 (session 58, f16 contiguous and paged, prefetch 0, 1024-token splits; us,
/// four runs with it, six without): 1024 blocks (32k x 4) 148.1-150.8 with it against 152.3-155.3
/// without; 2048 (32k x 8) 289.0-290.6 against 294.2-297.6 (paged 283.7-287.6 against 291.3-294.9);
/// but 512 blocks (32k x 2) 85.5-86.5 against 80.4-80.8, and 256 of 128-token splits (4k x 1)
/// 19.6-19.8 against 19.0-19.2.
[[nodiscard]] constexpr bool cuda_auto_bypass_l1(std::size_t blocks, int multiprocessors) noexcept {
  return multiprocessors > 0 && blocks > cuda_tc_blocks_per_sm * static_cast<std::size_t>(multiprocessors);
}

/// Workspace bytes attend needs: batch * q_heads * (max_splits[0] + max_splits[1]) partial states.
[[nodiscard]] std::size_t cuda_attend_workspace_bytes(const attend_params& p) noexcept;

/// Validates and enqueues the two attention kernels (partial, merge). errc::invalid_argument for
/// inconsistent shapes or Q4 pages that are misaligned or whose head stride is below the group
/// bytes (see device_pages), errc::unsupported for head_dim > cuda_max_head_dim or q4 pages whose
/// page_tokens is not 32; errc::device_error if a launch fails. Tokens past a sequence's table
/// length are never read.
[[nodiscard]] result<void> cuda_attend(const cuda& where, const attend_params& p);

/// Most (source, destination) page pairs one migrate launch takes.
inline constexpr std::uint32_t cuda_max_migrations = 32;

/// Q4 migration: quantizes FP16 pages of up to 32 tokens into Q4 pages (one key group and one
/// value group per kv head, format.hpp: keys per channel over the tokens, values per token over
/// 32 channels), every byte of each group written bit-identical to the scalar CPU reference
/// (kernels::find(isa::scalar)->quantize_keys / quantize_values, which zero the codes, scales and
/// minimums of missing tokens and padding channels); a destination in f16 (an FP16 store group)
/// receives a plain copy of the `tokens` rows. One launch covers `count` page pairs for `layers`
/// layers: layer l's pages are at src/dst base + l * layer_stride. Q4 destinations follow
/// device_pages' rules (4-byte aligned, layer strides included; head stride >= group bytes).
struct migrate_params {
  device_pages src;            ///< f16 pages
  device_pages dst;            ///< q4 or f16 pages (page_tokens 32), formats chosen for K and V separately
  std::uint64_t src_layer_stride_k = 0;  ///< bytes between layers of src.k
  std::uint64_t src_layer_stride_v = 0;  ///< bytes between layers of src.v
  std::uint64_t dst_layer_stride_k = 0;  ///< bytes between layers of dst.k
  std::uint64_t dst_layer_stride_v = 0;  ///< bytes between layers of dst.v
  std::uint32_t layers = 1;
  std::uint32_t kv_heads = 0;
  std::uint32_t head_dim = 0;
  std::uint32_t count = 0;                          ///< pairs, 1..cuda_max_migrations
  std::uint32_t tokens = 32;                        ///< tokens per group, 1..32 (the first `tokens` of the src page)
  std::uint32_t src_page[cuda_max_migrations] = {};  ///< source page ids
  std::uint32_t dst_page[cuda_max_migrations] = {};  ///< destination page ids
};

/// Validates and enqueues the migration kernel.
[[nodiscard]] result<void> cuda_migrate(const cuda& where, const migrate_params& p);

}  // namespace kvcache
