// Built with -fno-exceptions against kvcache_cpu_noexcept (tests/noexcept.cmake): the public API,
// error paths included, works without exceptions. A plain program (no GoogleTest, whose library
// is built with exceptions); every failed check is printed and makes main return 1.
#include <kvcache/attend.hpp>
#include <kvcache/contiguous_cache.hpp>
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
    std::vector<std::uint8_t> group(kvcache::q4_key_group_bytes(head_dim));  // format.hpp's key group
    k.quantize_keys(src.data(), head_dim, tokens, head_dim, group.data());
    std::vector<float> deq(src.size(), NAN);  // [token][head_dim]
    k.dequantize_keys(group.data(), tokens, head_dim, deq.data(), head_dim);
    for (std::uint32_t t = 0; t < tokens; ++t) {
      for (std::uint32_t d = 0; d < head_dim; ++d) {
        const float step = kvcache::to_float(kvcache::q4_key_scales(group.data(), head_dim)[d]);
        const float err = std::fabs(deq[t * head_dim + d] - kvcache::to_float(src[t * head_dim + d]));
        NX_CHECK(err <= 0.5f * step + 1e-2f);
      }
    }
  }
  NX_CHECK(kvcache::force_isa(original).has_value());
}

using cache_type = kvcache::contiguous_cache<kvcache::cpu>;

// Everything observable about one sequence: length, stats and the bytes of every layer view.
struct snapshot {
  std::size_t length = 0;
  std::size_t tokens = 0;
  std::size_t resident_bytes = 0;
  std::vector<std::byte> bytes;  // [layer][k|v][kv_head][token][head_dim] f16
  friend bool operator==(const snapshot&, const snapshot&) = default;
};

snapshot take(const cache_type& c, kvcache::seq_id s) {
  snapshot snap;
  snap.length = c.length(s).value_or(~std::size_t{0});
  snap.tokens = c.stats().tokens;
  snap.resident_bytes = c.stats().resident_bytes;
  const kvcache::geometry& g = c.shape();
  for (std::uint32_t layer = 0; layer < g.layers; ++layer) {
    const kvcache::result<kvcache::layer_view> v = c.view(s, layer);
    if (!v.has_value()) continue;
    for (const kvcache::chunk& ch : *v) {
      const std::size_t head_bytes = std::size_t{ch.tokens} * g.head_dim * sizeof(kvcache::half);
      for (std::uint32_t h = 0; h < g.kv_heads; ++h) {
        snap.bytes.insert(snap.bytes.end(), ch.k_head(h), ch.k_head(h) + head_bytes);
        snap.bytes.insert(snap.bytes.end(), ch.v_head(h), ch.v_head(h) + head_bytes);
      }
    }
  }
  return snap;
}

void test_contiguous_cache() {
  const kvcache::geometry g{3, 2, 40};
  const kvcache::result<cache_type> bad = cache_type::create({.shape = {3, 2, 0}, .capacity_tokens = 16});
  NX_CHECK(!bad.has_value() && bad.error().code == kvcache::errc::invalid_argument);

  kvcache::result<cache_type> made = cache_type::create(
      {.shape = g, .storage = kvcache::format::f16, .max_sequences = 2, .capacity_tokens = 8});
  NX_CHECK(made.has_value());
  if (!made.has_value()) return;
  cache_type& c = made.value();
  const kvcache::result<kvcache::seq_id> s = c.create();
  NX_CHECK(s.has_value());
  if (!s.has_value()) return;

  std::mt19937 rng(777);
  std::uniform_real_distribution<float> uni(-2.0f, 2.0f);
  const std::uint32_t n = 5;
  std::vector<float> k(n * g.token_width()), v(n * g.token_width());  // [token][kv_head][head_dim]
  NX_CHECK(c.reserve(*s, n).has_value());
  for (std::uint32_t layer = 0; layer < g.layers; ++layer) {
    for (float& x : k) x = uni(rng);
    for (float& x : v) x = uni(rng);
    NX_CHECK(c.write(*s, layer, k, v).has_value());
  }
  NX_CHECK(c.commit(*s).has_value());
  const snapshot before = take(c, *s);
  NX_CHECK(before.length == n && before.tokens == n);

  // Failed calls: typed errors, and the sequence is exactly as before.
  const kvcache::result<void> full = c.reserve(*s, 4);
  NX_CHECK(!full.has_value() && full.error().code == kvcache::errc::capacity_exceeded);
  NX_CHECK(!full.has_value() && contains(full.error().message, "requested=4"));
  const kvcache::result<void> unreserved = c.write(*s, 0, std::span<const float>(k).first(g.token_width()),
                                                   std::span<const float>(v).first(g.token_width()));
  NX_CHECK(!unreserved.has_value() && unreserved.error().code == kvcache::errc::not_reserved);
  const kvcache::result<void> past = c.truncate(*s, n + 1);
  NX_CHECK(!past.has_value() && past.error().code == kvcache::errc::out_of_range);
  const kvcache::result<kvcache::layer_view> bad_layer = c.view(*s, g.layers);
  NX_CHECK(!bad_layer.has_value() && bad_layer.error().code == kvcache::errc::layer_out_of_range);
  NX_CHECK(take(c, *s) == before);

  NX_CHECK(c.reserve(*s, 1).has_value());
  const std::vector<float> short_k(g.token_width() - 1);
  const std::span<const float> one_v = std::span<const float>(v).first(g.token_width());
  const kvcache::result<void> shape = c.write(*s, 0, short_k, one_v);
  NX_CHECK(!shape.has_value() && shape.error().code == kvcache::errc::bad_shape);
  const kvcache::result<void> early = c.commit(*s);
  NX_CHECK(!early.has_value() && early.error().code == kvcache::errc::incomplete_write);
  const kvcache::result<void> pending = c.truncate(*s, 1);
  NX_CHECK(!pending.has_value() && pending.error().code == kvcache::errc::reservation_pending);
  NX_CHECK(take(c, *s).bytes == before.bytes && c.length(*s).value_or(0) == n);

  // Released ids are rejected for ever.
  const kvcache::result<kvcache::seq_id> other = c.create();
  NX_CHECK(other.has_value());
  if (other.has_value()) {
    NX_CHECK(c.release(*other).has_value());
    const kvcache::result<std::size_t> gone = c.length(*other);
    NX_CHECK(!gone.has_value() && gone.error().code == kvcache::errc::unknown_sequence);
    NX_CHECK(!c.release(*other).has_value());
  }

  // Attention over the last layer against a double-precision reference from the stored f16 data.
  const kvcache::result<kvcache::layer_view> view = c.view(*s, g.layers - 1);
  NX_CHECK(view.has_value() && view->tokens == n);
  if (!view.has_value()) return;
  const std::uint32_t q_heads = 4;
  std::vector<float> q(q_heads * g.head_dim);  // [q_head][head_dim]
  for (float& x : q) x = uni(rng);
  std::vector<float> out(q.size(), NAN);  // [q_head][head_dim]
  kvcache::attention_workspace ws;
  const kvcache::attention_params bad_p{.q_heads = 3, .kv_heads = g.kv_heads, .head_dim = g.head_dim};
  const kvcache::result<void> bad_attend = kvcache::attend(bad_p, {&view.value(), 1}, q, out, ws);
  NX_CHECK(!bad_attend.has_value() && bad_attend.error().code == kvcache::errc::invalid_argument);
  NX_CHECK(std::isnan(out[0]));  // nothing written on failure
  const kvcache::attention_params p{.q_heads = q_heads, .kv_heads = g.kv_heads, .head_dim = g.head_dim};
  NX_CHECK(kvcache::attend(p, {&view.value(), 1}, q, out, ws).has_value());
  const kvcache::chunk& ch = (*view)[0];
  const double scale = 1.0 / std::sqrt(static_cast<double>(g.head_dim));
  for (std::uint32_t j = 0; j < q_heads; ++j) {
    const std::uint32_t h = j / (q_heads / g.kv_heads);
    const auto* kh = reinterpret_cast<const kvcache::half*>(ch.k_head(h));  // [token][head_dim]
    const auto* vh = reinterpret_cast<const kvcache::half*>(ch.v_head(h));  // [token][head_dim]
    std::vector<double> w(n);
    double wmax = -INFINITY, wsum = 0;
    for (std::uint32_t t = 0; t < n; ++t) {
      double dot = 0;
      for (std::uint32_t d = 0; d < g.head_dim; ++d)
        dot += double{q[j * g.head_dim + d]} * kvcache::to_float(kh[t * g.head_dim + d]);
      w[t] = dot * scale;
      wmax = std::fmax(wmax, w[t]);
    }
    for (double& x : w) wsum += (x = std::exp(x - wmax));
    for (std::uint32_t d = 0; d < g.head_dim; ++d) {
      double ref = 0;
      for (std::uint32_t t = 0; t < n; ++t) ref += w[t] / wsum * kvcache::to_float(vh[t * g.head_dim + d]);
      NX_CHECK(std::fabs(out[j * g.head_dim + d] - ref) <= 1e-4 * (1.0 + std::fabs(ref)));
    }
  }
}

}  // namespace

int main() {
  test_errors();
  test_isa_and_kernels();
  test_contiguous_cache();
  if (failures != 0) {
    std::fprintf(stderr, "test_noexcept: %d check(s) failed\n", failures);
    return 1;
  }
  std::printf("test_noexcept: all checks passed (ISA %s)\n", kvcache::to_string(kvcache::active_isa()).data());
  return 0;
}
