// The kernels' exp2 (flash_simd.hpp exp2_approx) in AVX-512 intrinsics, for the AMX kernels and Highway's
// AVX-512 targets: one compare, the rounding, the polynomial and one masked vscalefps.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include "kernels/exp2_poly.hpp"

namespace cpattn::kernels {

// 2^x for x <= ~0 with the polynomial `poly` (coefficients of f^(N-1) down to f^0, f^0's being 1): exactly 0
// below -126 (-inf among them), exactly 1 at 0, NaN for NaN. f = x - round(x) in one vreduceps (AVX512DQ;
// exact) and round(x) = x - f (exact: the difference is an integer, representable): two vector uops where the
// round-to-nearest-even through + and - 1.5 * 2^23 and the subtraction take three, and no clamp: a lane below
// -126 (-inf, whose f is NaN) is zeroed by the final mask whatever its polynomial. The same bits as a clamp
// to -126 and vrndscaleps (tests/exp2_test.cpp); the tiles' softmax pass is bound by these uops.
template <int N>
__attribute__((target("avx512f,avx512dq"))) inline __m512 exp2_poly_avx512(__m512 x, const float (&poly)[N]) {
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_NLT_UQ);  // x >= -126 or NaN
  // imm8 0: round to nearest even, no fraction bits kept; exceptions suppressed (the -inf and NaN lanes)
  const __m512 f = _mm512_reduce_round_ps(x, 0, _MM_FROUND_NO_EXC);
  const __m512 xi = _mm512_sub_ps(x, f);
  __m512 p = _mm512_set1_ps(poly[0]);
#pragma GCC unroll 8
  for (int i = 1; i < N; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(poly[i]));
  return _mm512_maskz_scalef_ps(keep, p, xi);
}

// The kernels' exp2: degree 6 (kExp2Poly).
__attribute__((target("avx512f,avx512dq"))) inline __m512 exp2_avx512(__m512 x) {
  return exp2_poly_avx512(x, kExp2Poly);
}

// For probabilities rounded to bf16 next: degree 3 (kExp2PolyBf16).
__attribute__((target("avx512f,avx512dq"))) inline __m512 exp2_bf16_avx512(__m512 x) {
  return exp2_poly_avx512(x, kExp2PolyBf16);
}

}  // namespace cpattn::kernels
#endif
