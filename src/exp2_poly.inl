// The polynomial of exp2_nonpositive, scalar (attend_softmax.inl) and vector (exp2_simd.inl):
// included inside each includer's namespace. 2^f on |f| <= 0.5 as sum_k exp2_c<k> f^k, the
// degree-5 minimax polynomial for relative error (Remez) in f itself: relative error 1.5e-7 with
// these float coefficients, 2.4e-7 at most evaluated in float, against 2.5e-7 for the degree-6
// Taylor polynomial of e^(f ln 2) it replaced (session 14), which took one multiply and one FMA
// more.
constexpr float exp2_c0 = 1.00000012f, exp2_c1 = 0.693146944f, exp2_c2 = 0.240221202f, exp2_c3 = 0.0555071309f,
                exp2_c4 = 0.00967554096f, exp2_c5 = 0.00132764725f;

// The degree-3 minimax polynomial (relative error, Remez) of 2^f on |f| <= 0.5: relative error
// 7.5e-5 with these float coefficients. For the fused Q4 steps' weights only, which are rounded
// to 8 bits (a step of 1/255 of the tile's largest) right after (exp2_simd.inl, exp2_weights).
constexpr float exp2_d3_c0 = 0.999928057f, exp2_d3_c1 = 0.693260968f, exp2_d3_c2 = 0.242611125f,
                exp2_d3_c3 = 0.0551716685f;
