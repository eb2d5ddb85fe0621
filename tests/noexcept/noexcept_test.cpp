// Built with -fno-exceptions against kvcache_cpu_noexcept (tests/noexcept.cmake): the public API,
// error paths included, works without exceptions. A plain program (no GoogleTest, whose library
// is built with exceptions); every failed check is printed and makes main return 1.
#include <kvcache/kvcache.hpp>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string_view>
#include <vector>

static_assert(KVCACHE_HAS_EXCEPTIONS == 0, "test_noexcept must be compiled with -fno-exceptions");

namespace {

int failures = 0;

#define NX_CHECK(cond)                                                          \
  do {                                                                          \
    if (!(cond)) {                                                              \
      std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                               \
    }                                                                           \
  } while (false)

bool contains(std::string_view haystack, std::string_view needle) {
  return haystack.find(needle) != std::string_view::npos;
}

// KVCACHE_TRY propagates the first failure out of a function returning result<...>.
kvcache::result<std::size_t> bytes_of(const kvcache::geometry& g, std::size_t tokens) {
  KVCACHE_TRY(kvcache::validate(g));
  const kvcache::result<std::size_t> per_layer = kvcache::checked_mul(g.token_width(), tokens, "bytes_of: tokens");
  KVCACHE_TRY(per_layer);
  return kvcache::checked_mul(per_layer.value(), g.layers, "bytes_of: layers");
}

void test_errors() {
  const kvcache::result<std::size_t> ok = bytes_of({2, 4, 64}, 10);
  NX_CHECK(ok.has_value() && ok.value() == 2u * 4u * 64u * 10u);

  const kvcache::result<std::size_t> zero = bytes_of({2, 0, 64}, 10);
  NX_CHECK(!zero.has_value());
  if (!zero.has_value()) {
    NX_CHECK(zero.error().code == kvcache::errc::invalid_argument);
    NX_CHECK(contains(zero.error().message, "kv_heads=0"));
  }

  const kvcache::result<std::size_t> huge = bytes_of({2, 1u << 20, 1u << 20}, std::size_t{1} << 40);
  NX_CHECK(!huge.has_value() && huge.error().code == kvcache::errc::overflow);
  NX_CHECK(huge.value_or(7) == 7);

  const kvcache::error e = kvcache::make_error(kvcache::errc::bad_shape, "write: K size", {{"expected", 8}, {"got", -3}});
  NX_CHECK(e.code == kvcache::errc::bad_shape);
  NX_CHECK(e.message == "write: K size (expected=8, got=-3)");
  NX_CHECK(kvcache::to_string(kvcache::errc::pool_exhausted) == "pool_exhausted");
}

void test_isa_and_kernels() {
  const kvcache::result<kvcache::isa> bad = kvcache::parse_isa("avx1024");
  NX_CHECK(!bad.has_value() && bad.error().code == kvcache::errc::invalid_argument);
  NX_CHECK(!bad.has_value() && contains(bad.error().message, "avx1024"));

  const kvcache::isa original = kvcache::active_isa();
  std::mt19937 rng(12345);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (kvcache::isa i : {kvcache::isa::scalar, kvcache::isa::avx2, kvcache::isa::avx512, kvcache::isa::neon}) {
    const kvcache::isa before = kvcache::active_isa();
    const kvcache::result<void> forced = kvcache::force_isa(i);
    if (!kvcache::isa_supported(i)) {
      // Unsupported here: a typed error naming the ISA, and the active ISA is unchanged.
      NX_CHECK(!forced.has_value() && forced.error().code == kvcache::errc::unsupported);
      NX_CHECK(!forced.has_value() && contains(forced.error().message, kvcache::to_string(i)));
      NX_CHECK(kvcache::active_isa() == before);
      continue;
    }
    NX_CHECK(forced.has_value() && kvcache::active_isa() == i);
    const kvcache::kernels::table& k = kvcache::kernels::active();
    NX_CHECK(k.which == i);

    // f16 codec against the scalar reference conversion, ragged length.
    const std::size_t n = 77;
    std::vector<float> x(n);  // [element]
    for (float& v : x) v = normal(rng) * 100.0f;
    std::vector<kvcache::half> h(n);
    k.f32_to_f16(x.data(), h.data(), n);
    for (std::size_t j = 0; j < n; ++j) NX_CHECK(h[j] == kvcache::to_half(x[j]));

    // Q4 keys of one ragged group (19 tokens, head_dim 40): dequantized values are within half a
    // quantization step (plus fp16 rounding of scale and min) of the input.
    const std::uint32_t tokens = 19, head_dim = 40;
    std::vector<kvcache::half> src(static_cast<std::size_t>(tokens) * head_dim);  // [token][head_dim]
    for (kvcache::half& v : src) v = kvcache::to_half(normal(rng));
    std::vector<kvcache::q4_block> blocks(head_dim);  // [channel]{tokens}
    k.quantize_keys(src.data(), head_dim, tokens, head_dim, blocks.data());
    std::vector<float> deq(src.size(), NAN);  // [token][head_dim]
    k.dequantize_keys(blocks.data(), tokens, head_dim, deq.data(), head_dim);
    for (std::uint32_t t = 0; t < tokens; ++t) {
      for (std::uint32_t d = 0; d < head_dim; ++d) {
        const float step = kvcache::to_float(blocks[d].scale);
        const float err = std::fabs(deq[t * head_dim + d] - kvcache::to_float(src[t * head_dim + d]));
        NX_CHECK(err <= 0.5f * step + 1e-2f);
      }
    }
  }
  NX_CHECK(kvcache::force_isa(original).has_value());
}

}  // namespace

int main() {
  test_errors();
  test_isa_and_kernels();
  if (failures != 0) {
    std::fprintf(stderr, "test_noexcept: %d check(s) failed\n", failures);
    return 1;
  }
  std::printf("test_noexcept: all checks passed (ISA %s)\n", kvcache::to_string(kvcache::active_isa()).data());
  return 0;
}
