// The weighted value sums of the int8 Q4 kernels (table::accumulate_q4) and their fused
// online-softmax step (table::attend_q4) on AVX2 (q4_int8_avx2.inl, 8 lanes) and NEON with the dot
// product (kernels_neondot.cpp, 4 lanes), written once against the vector interface `S`: included
// inside the includer's anonymous namespace after q4_int8.inl, its scores_nq and values_nq,
// exp2_simd.inl and `float_kernels()` (the includer's float Q4 table, for keys wider than
// int8_key_channels). q4_int8_avx512.inl has its own, which keep the scores and weights in
// registers (32 tokens are two of its vectors).
//
// S: vf, vm (a lane mask), W (lanes, 4 or 8: a 32-token group is 32 / W vectors), set1, zero, add,
// mul, max, hmax, hsum, first (lane 0); live(m) (the first m lanes set), select(mask, a, b) (a where
// set, b elsewhere), keep(x, mask) (x where set, 0 elsewhere); store (aligned to 4 W bytes); and
// load_count(p, m) / store_count(p, x, m), which touch the first m (<= W) floats at p only (load:
// 0 past them).

// The table entry (kernels::table::accumulate_q4): the queries two at a time.
void accumulate_int8(const float* p, std::size_t p_stride, std::uint32_t nq, const std::uint8_t* v,
                     std::uint32_t first, std::uint32_t tokens, std::uint32_t head_dim, float* acc,
                     prefetch_region region) {
  constexpr unsigned W = S::W, R = 32 / W;  // R vectors a group
  if (tokens == 0) return;
  const unsigned end = first + tokens;
  // One row per token quad of a column, in the first queries' pass.
  line_prefetch rp(region, value_blocks(head_dim) * ((end + 3) / 4 - first / 4));
  for (std::uint32_t i0 = 0; i0 < nq; i0 += 2) {
    const unsigned n = nq - i0 < 2 ? nq - i0 : 2;
    // u = p / max_t p by token (0 outside [first, end)); p below 2^-100 is scaled by 2^100 first
    // (exact), since 1 / max p overflows below ~2^-126. Queries whose weights are all 0 add nothing.
    alignas(4 * W) float u[2][32];
    float pmax[2];
    unsigned live = 0, which[2] = {0, 0};
    for (unsigned i = 0; i < n; ++i) {
      const float* pi = p + (i0 + i) * p_stride;
      float* ui = u[live];
      for (unsigned r = 0; r < R; ++r) S::store(ui + W * r, S::zero());
      S::vf mx = S::zero();
      if (first == 0) {
        for (unsigned r = 0; W * r < end; ++r) {
          const S::vf x = S::load_count(pi + W * r, end - W * r < W ? end - W * r : W);
          S::store(ui + W * r, x);
          mx = S::max(mx, x);
        }
      } else {
        for (unsigned t = first; t < end; ++t) ui[t] = pi[t - first];
        for (unsigned r = 0; r < R; ++r) mx = S::max(mx, S::load_count(ui + W * r, W));
      }
      const float pm = S::hmax(mx);
      if (!(pm > 0.0f)) continue;
      const float big = pm < 0x1p-100f ? 0x1p100f : 1.0f;
      const S::vf b = S::set1(big), k = S::set1(1.0f / (pm * big));
      for (unsigned r = 0; r < R; ++r) S::store(ui + W * r, S::mul(S::mul(S::load_count(ui + W * r, W), b), k));
      pmax[live] = pm;
      which[live++] = i0 + i;
    }
    line_prefetch* pf = i0 == 0 ? &rp : nullptr;
    const std::uint8_t* vs[1] = {v};
    const unsigned fs[1] = {first}, es[1] = {end};
    if (live == 2)
      values_nq<2, 1>(u, pmax, vs, fs, es, head_dim, acc + std::size_t{which[0]} * head_dim, pf);
    else if (live == 1)
      values_nq<1, 1>(u, pmax, vs, fs, es, head_dim, acc + std::size_t{which[0]} * head_dim, pf);
  }
}

// The online-softmax step of NQ (1..4) queries over G (1, 2) Q4 groups with tokens, one tile: the
// scores to a buffer (scores_nq, or the float kernel for keys wider than int8_key_channels), then
// per query the tile's largest score, u_t = 2^(s_t - that max) (0 past each group's tokens), us =
// 2^(that max - m_new), the running max, sum and accumulators rescaled where the max grew, and the
// values weighted by u_t us: values_nq takes u and us as its p / max p and max p, so the weights
// need no pass of their own (the separate kernels' accumulate_q4 finds max p and divides by it).
// Two groups a tile put their weights on one grid, so that their integer value sums share the
// accumulators: the softmax step's reductions, the columns' weight set-up and the float epilogue
// once per 64 tokens, as on AVX-512. Measured on Zen 5 (AVX2, head_dim 128, 4 queries, cached
// groups, BM_attend_step/q4/.../l2/g:2): AVX-VNNI 1.16-1.17x, vpmaddubsw 1.09x, against one group a
// tile; streamed (/stream/g:2) 1.09x; one query 1.05-1.2x. Not timed on Arm hardware.
// These steps spread the ahead groups' lines (ahead_region, q4_int8.inl) over their dot products
// alone, none over the set-up. With AVX2 on Zen 5 (AVX-VNNI), 3 and 6 rows per pass of the scores'
// set-up, as the AVX-512 step then took, measured 0.97-0.98x (attend over a two-tier cache at 32k,
// 1 thread, in-process alternation): this step is bound by its arithmetic (about half the AVX-512
// step's speed), not by the stream; so the AVX-512 step's line-for-line prefetch
// (q4_int8_avx512.inl) was not brought here. Not timed on Arm hardware.

template <unsigned NQ, unsigned G>
void attend_nq(const float* q, const q4_group_ref* g, unsigned hd, float* run_max, float* run_sum, float* acc,
               line_prefetch& pf) {
  constexpr unsigned W = S::W, R = 32 / W;  // R vectors a group
  alignas(4 * W) float s[NQ][32 * G];
  const std::uint8_t* vs[G];
  unsigned firsts[G], ends[G];
#pragma GCC unroll 2
  for (unsigned j = 0; j < G; ++j) {
    if (hd <= int8_key_channels) scores_nq<NQ>(q, g[j].k, g[j].tokens, hd, &s[0][32 * j], 32 * G, pf);
    else float_kernels().scores_q4(q, NQ, g[j].k, g[j].tokens, hd, &s[0][32 * j], 32 * G, {});
    vs[j] = g[j].v;
    firsts[j] = 0;
    ends[j] = g[j].tokens;
  }
  alignas(4 * W) float u[NQ][32 * G];
  float us[NQ];
  const S::vf ninf = S::set1(-__builtin_inff());
  for (unsigned i = 0; i < NQ; ++i) {
    S::vf x[R * G], mx = ninf;
    S::vm live[R * G];
#pragma GCC unroll 16
    for (unsigned r = 0; r < R * G; ++r) {
      const unsigned n = g[r / R].tokens, t = W * (r % R);
      const unsigned m = n <= t ? 0u : (n - t < W ? n - t : W);
      live[r] = S::live(m);
      x[r] = S::select(live[r], S::load_count(s[i] + W * r, m), ninf);  // nothing read past the scores
      mx = S::max(mx, x[r]);
    }
    const float tmax = S::hmax(mx);
    const float m_new = tmax > run_max[i] ? tmax : run_max[i];
    S::vf sum = S::zero();
    const S::vf tv = S::set1(tmax);
#pragma GCC unroll 16
    for (unsigned r = 0; r < R * G; ++r) {
      const S::vf ur = S::keep(exp2_weights(S::sub(x[r], tv)), live[r]);
      S::store(u[i] + W * r, ur);
      sum = S::add(sum, ur);
    }
    us[i] = S::first(exp2_nonpositive(S::set1(tmax - m_new)));
    if (m_new != run_max[i]) {
      // First group: run_max is -inf and acc, run_sum are 0: the correction factor is 0.
      const float corr = run_max[i] < -3.0e38f ? 0.0f : S::first(exp2_nonpositive(S::set1(run_max[i] - m_new)));
      float* a = acc + static_cast<std::size_t>(i) * hd;
      const S::vf cv = S::set1(corr);
      for (unsigned d = 0; d < hd; d += W) {
        const unsigned m = hd - d < W ? hd - d : W;
        S::store_count(a + d, S::mul(S::load_count(a + d, m), cv), m);
      }
      run_sum[i] *= corr;
      run_max[i] = m_new;
    }
    run_sum[i] += S::hsum(sum) * us[i];
  }
  values_nq<NQ, G>(u, us, vs, firsts, ends, hd, acc, &pf);
}
