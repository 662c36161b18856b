// The kernels' exp2 (flash_simd.hpp exp2_approx) in AVX-512 intrinsics, for the AMX kernels and Highway's
// AVX-512 targets: one compare, the clamp, the rounding, the polynomial and one masked vscalefps.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include "flash_common.hpp"

namespace cpattn::kernels {

// 2^x for x <= ~0: exactly 0 below -126 (-inf among them), exactly 1 at 0, NaN for NaN.
__attribute__((target("avx512f"))) inline __m512 exp2_avx512(__m512 x) {
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_LT_OQ);
  // The merge-masked forms with every lane set: the plain ones pass _mm512_undefined_ps, which GCC 12 reports
  // as maybe-uninitialized once inlined into a Highway target.
  const __mmask16 all = 0xFFFF;
  const __m512 low = _mm512_set1_ps(-126.0f);
  x = _mm512_mask_max_ps(x, all, low, x);  // max returns its second operand for NaN: NaN stays NaN
  const __m512 xi = _mm512_mask_roundscale_ps(x, all, x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, xi);
  __m512 p = _mm512_set1_ps(kExp2Poly[0]);
#pragma GCC unroll 7
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Poly[i]));
  return _mm512_maskz_scalef_ps(static_cast<__mmask16>(~tiny), p, xi);
}

}  // namespace cpattn::kernels
#endif
