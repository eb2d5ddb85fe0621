// Consumer of an installed (or add_subdirectory'd) kvcache: uses the public API through
// kvcache::cpu only, checks results, and returns non-zero on any mismatch.
#include <kvcache/attend.hpp>
#include <kvcache/contiguous_cache.hpp>
#include <kvcache/kvcache.hpp>

#include <cmath>
#include <cstdio>
#include <vector>

namespace {

int failures = 0;

void check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "consumer: FAILED: %s\n", what);
    ++failures;
  }
}

}  // namespace

int main() {
  const kvcache::kernels::table& k = kvcache::kernels::active();
  std::printf("consumer: kvcache %d.%d.%d, active ISA %s\n", KVCACHE_VERSION_MAJOR,
              KVCACHE_VERSION_MINOR, KVCACHE_VERSION_PATCH, kvcache::to_string(k.which).data());

  // Round trip through the compiled f16 codec: values exactly representable in binary16.
  std::vector<float> src(37);  // [token]
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<float>(i) * 0.25f - 4.0f;
  std::vector<kvcache::half> h(src.size());
  std::vector<float> back(src.size());
  k.f32_to_f16(src.data(), h.data(), src.size());
  k.f16_to_f32(h.data(), back.data(), back.size());
  check(back == src, "f16 round trip");

  // Scores of one query against three f16 keys of head_dim 4.
  const float q[4] = {1, 2, 3, 4};
  std::vector<kvcache::half> keys(12);  // [token][head_dim]
  for (std::size_t i = 0; i < keys.size(); ++i) keys[i] = kvcache::to_half(static_cast<float>(i % 4));
  float scores[3] = {};
  k.scores_f16(q, 1, keys.data(), 3, 4, scores, 3, {});
  for (float s : scores) check(s == 20.0f, "scores_f16");  // 0*1 + 1*2 + 2*3 + 3*4

  // Error path: typed error with the offending value in the message (formatted inside kvcache::cpu).
  const kvcache::result<kvcache::isa> bad = kvcache::parse_isa("sse9");
  check(!bad.has_value() && bad.error().code == kvcache::errc::invalid_argument, "parse_isa error code");
  check(!bad.has_value() && bad.error().message.find("sse9") != std::string::npos, "parse_isa message");
  const kvcache::result<void> zero = kvcache::validate(kvcache::geometry{2, 0, 64});
  check(!zero.has_value() && zero.error().message.find("kv_heads=0") != std::string::npos,
        "validate(geometry) message");

  // A contiguous cache: two decode steps of one sequence, a rejected write, attention over layer 1.
  const kvcache::geometry g{3, 2, 32};
  kvcache::result<kvcache::contiguous_cache<kvcache::cpu>> cache =
      kvcache::contiguous_cache<kvcache::cpu>::create({.shape = g, .storage = kvcache::format::f16,
                                                       .max_sequences = 2, .capacity_tokens = 64});
  check(cache.has_value(), "contiguous_cache::create");
  if (!cache.has_value()) return 1;
  const kvcache::result<kvcache::seq_id> seq = cache->create();
  check(seq.has_value(), "create sequence");
  if (!seq.has_value()) return 1;
  std::vector<float> kv(g.token_width());  // [token][kv_head][head_dim], one token
  for (int step = 0; step < 2; ++step) {
    for (std::size_t i = 0; i < kv.size(); ++i) kv[i] = static_cast<float>(step + 1);
    check(cache->reserve(*seq, 1).has_value(), "reserve");
    for (std::uint32_t layer = 0; layer < g.layers; ++layer)
      check(cache->write(*seq, layer, kv, kv).has_value(), "write");
    check(cache->commit(*seq).has_value(), "commit");
  }
  check(cache->reserve(*seq, 1).has_value(), "reserve 3");
  const std::vector<float> short_k(g.token_width() - 1);
  const kvcache::result<void> bad_write = cache->write(*seq, 0, short_k, kv);
  check(!bad_write.has_value() && bad_write.error().code == kvcache::errc::bad_shape, "short write rejected");
  check(cache->length(*seq).value_or(0) == 2, "length after two steps");

  const kvcache::result<kvcache::layer_view> view = cache->view(*seq, 1);
  check(view.has_value() && view->tokens == 2, "view");
  if (view.has_value()) {
    // Equal keys give equal weights: the output is the mean of the values, (1 + 2) / 2.
    const kvcache::attention_params p{.q_heads = 4, .kv_heads = 2, .head_dim = 32};
    std::vector<float> query(4 * 32, 0.0f);  // [q_head][head_dim]
    std::vector<float> out(4 * 32);      // [q_head][head_dim]
    kvcache::attention_workspace ws;
    check(kvcache::attend(p, {&view.value(), 1}, query, out, ws).has_value(), "attend");
    for (float o : out) check(o == 1.5f, "attend output");
  }

  if (failures != 0) return 1;
  std::printf("consumer: OK\n");
  return 0;
}
