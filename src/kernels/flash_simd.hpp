// The vector building blocks of the flash kernels (Highway), compiled once per SIMD target: a file that
// includes it after <hwy/foreach_target.h> gets them in cpattn::kernels::HWY_NAMESPACE for every target it is
// built for (runtime dispatch picks one; see flash_vector_target()). Every row of a tile runs the same
// instructions whatever its position, so a row's result does not depend on its lane or on which rows share
// its tile.

// Per-target include guard (Highway's convention).
#if defined(CPATTN_KERNELS_FLASH_SIMD_HPP_) == defined(HWY_TARGET_TOGGLE)
#ifdef CPATTN_KERNELS_FLASH_SIMD_HPP_
#undef CPATTN_KERNELS_FLASH_SIMD_HPP_
#else
#define CPATTN_KERNELS_FLASH_SIMD_HPP_
#endif

#include <hwy/contrib/math/math-inl.h>
#include <hwy/highway.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "kernels/block_grid.hpp"
#include "kernels/exp2_avx512.hpp"
#include "kernels/exp2_poly.hpp"
#include "kernels/packing.hpp"
#include "kernels/prefetch.hpp"

HWY_BEFORE_NAMESPACE();
namespace cpattn::kernels::HWY_NAMESPACE {

namespace hn = hwy::HWY_NAMESPACE;
using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

inline std::int64_t lanes() {
  return static_cast<std::int64_t>(hn::Lanes(DF()));
}
// Dp: the head dim padded to whole vectors and to an even count, since the register tiles cover output rows
// (the forward's O^T rows are head-dim rows) two at a time or more. With Highway's scalar target (1 lane) an
// odd D would otherwise leave its last row uncomputed.
inline std::int64_t padded_head_dim(std::int64_t d) {
  return round_up(d, std::max<std::int64_t>(2, lanes()));
}

// V vectors of floats as a stride: a compile-time constant on every target whose vector length is one (all
// but SVE and RVV), so that tile addresses fold into displacements (dot_tile).
template <int V>
inline auto vectors_stride() {
#if HWY_HAVE_SCALABLE
  return static_cast<std::int64_t>(V) * lanes();
#else
  return std::integral_constant<std::int64_t, V* static_cast<std::int64_t>(hn::MaxLanes(DF()))>();
#endif
}

// 2^x for x <= ~0 (the softmax's s - m). Inputs below -126, -inf among them, give exactly 0; x = 0 gives
// exactly 1, so a rescale by exp2(m - m) is an exact no-op; NaN (Inf - Inf: a score of +Inf) stays NaN.
// 2^x = 2^round(x) * 2^f with f in [-0.5, 0.5] and 2^f the polynomial kExp2Poly. On AVX-512 the power of two
// is applied by vscalefps (exp2_avx512.hpp), elsewhere by building its exponent bits and multiplying: both
// round the exact p * 2^round(x) once, so every target with FMA gives the same values (without FMA, MulAdd
// rounds twice and the last bits may differ; tests/exp2_test.cpp).
HWY_INLINE VF exp2_approx(VF x) {
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  return VF{exp2_avx512(x.raw)};
#else
  const DF df;
  const hn::RebindToSigned<DF> di;
  const auto tiny = hn::Lt(x, hn::Set(df, -126.0f));
  const auto nan = hn::IsNaN(x);  // NaN in, NaN out (the clamp below would turn it into 2^-126)
  const VF input = x;
  x = hn::Max(x, hn::Set(df, -126.0f));
  const VF xi = hn::Round(x);
  const VF f = hn::Sub(x, xi);
  VF p = hn::Set(df, kExp2Poly[0]);
#pragma GCC unroll 7
  for (int i = 1; i < 7; ++i) p = hn::MulAdd(p, f, hn::Set(df, kExp2Poly[i]));
  const auto exponent = hn::ShiftLeft<23>(hn::Add(hn::ConvertTo(di, xi), hn::Set(di, 127)));
  const VF scaled = hn::Mul(p, hn::BitCast(df, exponent));
  return hn::IfThenElse(nan, input, hn::IfThenZeroElse(tiny, scaled));
#endif
}

// out[r][j] = sum_{d < depth} a[r*ar + d*ad] * bt[d*bs + j] for r < R and j < C vectors of lanes: the score
// tiles (forward S^T = K Q^T with K^T's R values of one step adjacent; backward S = Q K^T, dP = dO V^T with
// rows of a). The sum over d runs in order, so an element's bits do not depend on the tile shape that
// computed it. `ar` may be a compile-time constant (kAdjacent): one pointer then addresses all R broadcasts
// (base + displacement); R separate row pointers run out of general-purpose registers at R = 12 and spill
// inside the loop.
// colmax (optional, C vectors): each column's running maximum, folded with the tile's R rows as they are
// stored (the forward's row maxima without a pass over the stored tile).
// bs and os may be compile-time constants too (vectors_stride): each of the tile's 24 output addresses is
// then a displacement from one pointer, where runtime strides left GCC 24 pointers to keep, spilled to the
// stack.
using kAdjacent = std::integral_constant<std::int64_t, 1>;
template <int R, int C, class RowStride, class BStride = std::int64_t, class OStride = std::int64_t>
HWY_INLINE void dot_tile(const float* HWY_RESTRICT a, RowStride ar, std::int64_t ad,
                         const float* HWY_RESTRICT bt, BStride bs, std::int64_t depth,
                         float* HWY_RESTRICT out, OStride os, VF* colmax = nullptr) {
  const DF df;
  const std::int64_t n = lanes();
  VF acc[R][C];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) acc[r][c] = hn::Zero(df);
  }
  for (std::int64_t d = 0; d < depth; ++d) {
    VF b[C];
    for (int c = 0; c < C; ++c) b[c] = hn::LoadU(df, bt + d * bs + c * n);
    const float* step = a + d * ad;
    for (int r = 0; r < R; ++r) {
      const VF av = hn::Set(df, step[r * static_cast<std::int64_t>(ar)]);
      for (int c = 0; c < C; ++c) acc[r][c] = hn::MulAdd(av, b[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) hn::StoreU(acc[r][c], df, out + r * os + c * n);
  }
  if (colmax != nullptr) {
    for (int c = 0; c < C; ++c) {
      for (int r = 0; r < R; ++r) colmax[c] = hn::Max(colmax[c], acc[r][c]);
    }
  }
}

// out[r][:] += sum_{t < count} coef[t*ct + r*cr] * x[t*xs + :] for r < R, over C vectors of columns:
// O^T += V^T P^T, dV += P^T dO, dK += dS^T Q, dQ += dS K. The sum over t runs in order.
// Out = float: the sum continues from out's values in fp32. Out = double (the backward's dK/dV): the tile's
// sum is formed in fp32 registers from zero and then added to out in fp64, so a running sum over tiles keeps
// fp32 rounding within a tile only.
// kGuard: a zero coefficient adds nothing even where x is Inf or NaN (0 * Inf would be NaN): the masked pairs
// of a tile then cannot reach a row that may not see them. Used only when an input holds a non-finite value.
template <int R, int C, bool kGuard = false, class Out = float>
HWY_INLINE void axpy_tile(const float* HWY_RESTRICT coef, std::int64_t ct, std::int64_t cr,
                          const float* HWY_RESTRICT x, std::int64_t xs, std::int64_t count,
                          Out* HWY_RESTRICT out, std::int64_t os) {
  const DF df;
  const std::int64_t n = lanes();
  VF acc[R][C];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      if constexpr (std::is_same_v<Out, float>) {
        acc[r][c] = hn::LoadU(df, out + r * os + c * n);
      } else {
        acc[r][c] = hn::Zero(df);
      }
    }
  }
  for (std::int64_t t = 0; t < count; ++t) {
    VF xv[C];
    for (int c = 0; c < C; ++c) xv[c] = hn::LoadU(df, x + t * xs + c * n);
    for (int r = 0; r < R; ++r) {
      const VF cv = hn::Set(df, coef[t * ct + r * cr]);
      if constexpr (kGuard) {
        const auto zero = hn::Eq(cv, hn::Zero(df));
        for (int c = 0; c < C; ++c)
          acc[r][c] = hn::IfThenElse(zero, acc[r][c], hn::MulAdd(cv, xv[c], acc[r][c]));
      } else {
        for (int c = 0; c < C; ++c) acc[r][c] = hn::MulAdd(cv, xv[c], acc[r][c]);
      }
    }
  }
  if constexpr (std::is_same_v<Out, float>) {
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < C; ++c) hn::StoreU(acc[r][c], df, out + r * os + c * n);
    }
  } else {
#if HWY_TARGET == HWY_SCALAR
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < C; ++c) out[r * os + c] += static_cast<double>(hn::GetLane(acc[r][c]));
    }
#else
    // Each vector widened in two halves (exact) and added to out in fp64 at full vector width: the compiler's
    // own form, a store of the tile and a 4-wide loop, is far slower (docs/performance.md, decisions).
    const hn::Repartition<double, DF> dd;
    const hn::Half<DF> dh;
    const std::int64_t half = static_cast<std::int64_t>(hn::Lanes(dd));
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < C; ++c) {
        double* const o = out + r * os + c * n;
        hn::StoreU(hn::Add(hn::LoadU(dd, o), hn::PromoteTo(dd, hn::LowerHalf(dh, acc[r][c]))), dd, o);
        hn::StoreU(hn::Add(hn::LoadU(dd, o + half), hn::PromoteTo(dd, hn::UpperHalf(dh, acc[r][c]))), dd,
                   o + half);
      }
    }
#endif
  }
}

// out[r][:] = out[r][:] * scale[:] + sum_{t < count} coef[t*ct + r] * x[t*xs + :]: the forward's O^T tile,
// its rescale by alpha fused in (the same two roundings as a separate pass: a product, then the FMA chain).
// kGuard: a zero x (a masked P) adds nothing even where the coefficient (V) is Inf or NaN.
// xs and os: runtime or compile-time strides (see dot_tile). kFromZero: out is not read and the sum starts
// from +0, what out * scale gives for a zero out and a finite scale (the forward's first kv block: its O^T
// needs no zeroing).
template <int R, int C, bool kGuard = false, bool kFromZero = false, class XStride = std::int64_t,
          class OStride = std::int64_t>
HWY_INLINE void scale_axpy_tile_adjacent(const float* HWY_RESTRICT scale, const float* HWY_RESTRICT coef,
                                         std::int64_t ct, const float* HWY_RESTRICT x, XStride xs,
                                         std::int64_t count, float* HWY_RESTRICT out, OStride os) {
  const DF df;
  const std::int64_t n = lanes();
  VF acc[R][C];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      if constexpr (kFromZero) {
        acc[r][c] = hn::Zero(df);
      } else {
        acc[r][c] = hn::Mul(hn::LoadU(df, out + r * os + c * n), hn::LoadU(df, scale + c * n));
      }
    }
  }
  for (std::int64_t t = 0; t < count; ++t) {
    VF xv[C];
    for (int c = 0; c < C; ++c) xv[c] = hn::LoadU(df, x + t * xs + c * n);
    const float* ct_row = coef + t * ct;
    for (int r = 0; r < R; ++r) {
      const VF cv = hn::Set(df, ct_row[r]);
      for (int c = 0; c < C; ++c) {
        if constexpr (kGuard) {
          acc[r][c] =
              hn::IfThenElse(hn::Eq(xv[c], hn::Zero(df)), acc[r][c], hn::MulAdd(cv, xv[c], acc[r][c]));
        } else {
          acc[r][c] = hn::MulAdd(cv, xv[c], acc[r][c]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) hn::StoreU(acc[r][c], df, out + r * os + c * n);
  }
}

// Calls tile(R, r) for the register tiles of rows [0, rows) (a multiple of 2) in order: R = RMax while it
// fits, then 8, 4 and 2 for the rest, as row_tile_size says (packing.hpp; the forward's packed operands
// follow the same partition). RMax x C vectors is the register tile: 6 x 4, 8 x 3 or 12 x 2 leave room for
// their operands (24 accumulators + C loads + 1 broadcast of 32 zmm registers).
template <int RMax, class Tile>
HWY_INLINE void for_row_tiles(std::int64_t rows, Tile&& tile) {
  for (std::int64_t r = 0, size = 0; r < rows; r += size) {
    size = row_tile_size(rows, r, RMax);
    if (size == RMax) {
      tile(std::integral_constant<int, RMax>(), r);
    } else if (RMax > 8 && size == 8) {
      tile(std::integral_constant<int, std::min(RMax, 8)>(), r);
    } else if (RMax > 4 && size == 4) {
      tile(std::integral_constant<int, std::min(RMax, 4)>(), r);
    } else {
      tile(std::integral_constant<int, 2>(), r);
    }
  }
}

// Rows [0, rows) of a (a multiple of 2) against `cols` columns of bt (a multiple of 4 vectors). pf
// (optional): pf_lines of its lines are prefetched before each register tile.
inline void dot_rows(const float* a, std::int64_t as, const float* bt, std::int64_t bs, std::int64_t depth,
                     std::int64_t rows, std::int64_t cols, float* out, std::int64_t os,
                     PrefetchQueue* pf = nullptr, std::int64_t pf_lines = 0) {
  const std::int64_t step = 4 * lanes();
  for (std::int64_t j = 0; j < cols; j += step) {
    for_row_tiles<6>(rows, [&](auto R, std::int64_t r) {
      if (pf != nullptr) pf->issue(pf_lines);
      dot_tile<decltype(R)::value, 4>(a + r * as, as, 1, bt + j, bs, depth, out + r * os + j, os);
    });
  }
}

// axpy_tile over `rows` output rows (a multiple of 2) and `width` columns (a multiple of the lane count), 4
// vectors at a time and the remainder with fewer.
template <bool kGuard, class Out>
inline void axpy_rows_impl(const float* coef, std::int64_t ct, std::int64_t cr, const float* x,
                           std::int64_t xs, std::int64_t count, std::int64_t rows, std::int64_t width,
                           Out* out, std::int64_t os, PrefetchQueue* pf, std::int64_t pf_lines) {
  const std::int64_t n = lanes();
  for_row_tiles<6>(rows, [&](auto R, std::int64_t r) {
    if (pf != nullptr) pf->issue(pf_lines);
    constexpr int kR = decltype(R)::value;
    const float* cf = coef + r * cr;
    Out* o = out + r * os;
    std::int64_t c = 0;
    for (; c + 4 * n <= width; c += 4 * n) axpy_tile<kR, 4, kGuard>(cf, ct, cr, x + c, xs, count, o + c, os);
    switch ((width - c) / n) {
      case 3:
        axpy_tile<kR, 3, kGuard>(cf, ct, cr, x + c, xs, count, o + c, os);
        break;
      case 2:
        axpy_tile<kR, 2, kGuard>(cf, ct, cr, x + c, xs, count, o + c, os);
        break;
      case 1:
        axpy_tile<kR, 1, kGuard>(cf, ct, cr, x + c, xs, count, o + c, os);
        break;
      default:
        break;
    }
  });
}

// guard: see axpy_tile's kGuard; Out: see axpy_tile (float or double); pf, pf_lines: see dot_rows.
template <class Out>
inline void axpy_rows(const float* coef, std::int64_t ct, std::int64_t cr, const float* x, std::int64_t xs,
                      std::int64_t count, std::int64_t rows, std::int64_t width, Out* out, std::int64_t os,
                      bool guard = false, PrefetchQueue* pf = nullptr, std::int64_t pf_lines = 0) {
  if (guard) {
    axpy_rows_impl<true>(coef, ct, cr, x, xs, count, rows, width, out, os, pf, pf_lines);
  } else {
    axpy_rows_impl<false>(coef, ct, cr, x, xs, count, rows, width, out, os, pf, pf_lines);
  }
}

// Logit soft-capping on n scores in base-2 units (s = x log2 e): s = b tanh(s / b) with b = cap log2 e, which
// is cap tanh(x / cap) in natural units; n a multiple of the vector length. t, where given, keeps tanh(s / b)
// for the backward's dS (1 - t^2). Highway's tanh (within 4 ulp); +-Inf become +-b, NaN stays NaN.
inline void softcap_scores(float* s, std::int64_t n, float b, float* t) {
  const DF df;
  const VF vb = hn::Set(df, b), inv_b = hn::Set(df, 1.0f / b);
  for (std::int64_t i = 0; i < n; i += lanes()) {
    const VF th = hn::Tanh(df, hn::Mul(hn::LoadU(df, s + i), inv_b));
    if (t != nullptr) hn::StoreU(th, df, t + i);
    hn::StoreU(hn::Mul(vb, th), df, s + i);
  }
}

// dS of soft-capped scores: ds *= 1 - t^2 (t = tanh of the scores over the cap), n a multiple of the vector
// length.
inline void softcap_gradient(float* ds, const float* t, std::int64_t n) {
  const DF df;
  const VF one = hn::Set(df, 1.0f);
  for (std::int64_t i = 0; i < n; i += lanes()) {
    const VF th = hn::LoadU(df, t + i);
    hn::StoreU(hn::Mul(hn::LoadU(df, ds + i), hn::NegMulAdd(th, th, one)), df, ds + i);
  }
}

}  // namespace cpattn::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
