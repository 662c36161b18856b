#include "kernels/flash_bf16.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>

#include "core/parallel_for.hpp"
#include "kernels/aligned_vector.hpp"
#include "kernels/block_grid.hpp"
#include "kernels/exp2_avx512.hpp"
#include "kernels/exp2_poly.hpp"
#include "kernels/masking.hpp"
#include "kernels/row_io.hpp"
#include "kernels/scratch.hpp"
#include "kernels/sinks.hpp"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define CPATTN_HAVE_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
// GCC 12's AVX-512 intrinsics start from a self-initialized `__Y = __Y`, which -Wuninitialized reports when
// the file is built for a target without AVX-512 and the intrinsics are inlined into target("avx512f")
// functions (the portable build). Nothing here reads an uninitialized value.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#endif

namespace cpattn::kernels {

#if defined(CPATTN_HAVE_AMX)

namespace {

#define CPATTN_AMX_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")))

constexpr int kAmxRows = 16;    // rows of every tile
constexpr int kTileDepth = 32;  // bf16 values along the reduction axis of one tdpbf16ps
constexpr int kGroupRows = 32;  // a 2x2 group of output tiles covers 32 rows...
constexpr int kGroupCols = 32;  // ...and 32 columns

struct alignas(64) TileConfig {
  std::uint8_t palette = 1;
  std::uint8_t start_row = 0;
  std::uint8_t reserved[14] = {};
  std::uint16_t colsb[16] = {};
  std::uint8_t rows[16] = {};
};

// Tiles 0-3: a 2x2 group of fp32 outputs; 4-5: two left operands (16 rows x 32 bf16); 6-7: two right operands
// in pair-interleaved ("VNNI") form (16 rows of 16 column pairs). Every tile is 16 rows of 64 bytes.
TileConfig full_tiles() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = kAmxRows;
    c.colsb[t] = 64;
  }
  return c;
}

// Token rows [begin, begin + length) of head h as the layouts the tile products read, zero-padded:
//   rows:        out[r][d]                 [rows][D32]          (a left operand: Q, dO)
//   columns:     out[d][r]                 [D32][rows]          (a left operand: Q^T, dO^T)
//   pairs_over_d: out[d/2][r][d%2]         [D32/2][rows][2]     (a right operand reduced over d: K, V)
//   pairs_over_r: out[r/2][d][r%2]         [rows/2][D32][2]     (a right operand reduced over tokens: K, V)
enum class Layout { rows, columns, pairs_over_d, pairs_over_r };
void pack_bf16(const ConstTensorRef& t, std::int64_t b, std::int64_t h, const BlockMeta& blk,
               std::int64_t rows, std::int64_t d32, Layout layout, std::uint16_t* out) {
  const std::int64_t D = t.shape.d;
  auto row = [&](std::int64_t r) {
    return static_cast<const std::uint16_t*>(t.ptr) + t.offset(b, blk.begin + r, h);
  };
  switch (layout) {
    case Layout::rows:
      for (std::int64_t r = 0; r < blk.length; ++r)
        std::memcpy(out + r * d32, row(r), D * sizeof(std::uint16_t));
      return;
    case Layout::columns:
      for (std::int64_t r = 0; r < blk.length; ++r) {
        const std::uint16_t* x = row(r);
        for (std::int64_t d = 0; d < D; ++d) out[d * rows + r] = x[d];
      }
      return;
    case Layout::pairs_over_d:
      // A token's (d, d + 1) pairs as 32-bit words, one word per pair (an odd D's last pair half zero).
      for (std::int64_t r = 0; r < blk.length; ++r) {
        const std::uint16_t* x = row(r);
        for (std::int64_t d = 0; d + 1 < D; d += 2) {
          std::uint32_t pair;
          std::memcpy(&pair, x + d, sizeof(pair));
          std::memcpy(out + ((d / 2) * rows + r) * 2, &pair, sizeof(pair));
        }
        if (D % 2 != 0) out[((D / 2) * rows + r) * 2] = x[D - 1];
      }
      return;
    case Layout::pairs_over_r:
      // Two tokens' rows interleaved value by value.
      for (std::int64_t r = 0; r < blk.length; ++r) {
        const std::uint16_t* x = row(r);
        std::uint16_t* o = out + (r / 2) * d32 * 2 + (r & 1);
        for (std::int64_t d = 0; d < D; ++d) o[2 * d] = x[d];
      }
      return;
  }
}

// out[0, rows) += left[rows][depth] * right, where right is pair-interleaved [depth/2][cols][2] and rows,
// cols are multiples of 32 and depth of 32. out: fp32 [rows][out_stride]; left: bf16 [rows][left_stride].
// `load_out` false: out starts at 0 (the tiles are zeroed instead of loaded).
CPATTN_AMX_TARGET void tile_product(const std::uint16_t* left, std::int64_t left_stride,
                                    const std::uint16_t* right, std::int64_t right_cols, std::int64_t rows,
                                    std::int64_t cols, std::int64_t depth, float* out,
                                    std::int64_t out_stride, bool load_out) {
  const std::int64_t lb = left_stride * 2, rb = right_cols * 4, ob = out_stride * 4;
  for (std::int64_t m0 = 0; m0 < rows; m0 += kGroupRows) {
    for (std::int64_t n0 = 0; n0 < cols; n0 += kGroupCols) {
      float* c = out + m0 * out_stride + n0;
      if (load_out) {
        _tile_loadd(0, c, ob);
        _tile_loadd(1, c + 16, ob);
        _tile_loadd(2, c + 16 * out_stride, ob);
        _tile_loadd(3, c + 16 * out_stride + 16, ob);
      } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      }
      for (std::int64_t k0 = 0; k0 < depth; k0 += kTileDepth) {
        _tile_loadd(4, left + m0 * left_stride + k0, lb);
        _tile_loadd(5, left + (m0 + 16) * left_stride + k0, lb);
        _tile_loadd(6, right + ((k0 / 2) * right_cols + n0) * 2, rb);
        _tile_loadd(7, right + ((k0 / 2) * right_cols + n0 + 16) * 2, rb);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(0, c, ob);
      _tile_stored(1, c + 16, ob);
      _tile_stored(2, c + 16 * out_stride, ob);
      _tile_stored(3, c + 16 * out_stride + 16, ob);
    }
  }
}

#define CPATTN_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

// tile_product's contract with AVX512-BF16 dot products instead of the tile unit: VDPBF16PS adds a pair of
// bf16 products per fp32 lane. Micro-tiles of 8 rows x 32 columns (16 registers of fp32 sums over the whole
// depth); each step multiplies a left row's broadcast pair (d, d+1) with 16 columns' pairs. A row's
// sums depend only on that row and the depth order, as on the tile unit. `in_scale` (per row, or null)
// multiplies a loaded out row first and `out_scale` the result, in the same passes.
CPATTN_BF16_TARGET void dot_product(const std::uint16_t* left, std::int64_t left_stride,
                                    const std::uint16_t* right, std::int64_t right_cols, std::int64_t rows,
                                    std::int64_t cols, std::int64_t depth, float* out,
                                    std::int64_t out_stride, bool load_out, const float* in_scale,
                                    float out_scale) {
  constexpr int kRows = 8;
  for (std::int64_t m0 = 0; m0 < rows; m0 += kRows) {
    for (std::int64_t n0 = 0; n0 < cols; n0 += 32) {
      __m512 acc[kRows][2];
#pragma GCC unroll 8
      for (int i = 0; i < kRows; ++i) {
        float* c = out + (m0 + i) * out_stride + n0;
        acc[i][0] = load_out ? _mm512_loadu_ps(c) : _mm512_setzero_ps();
        acc[i][1] = load_out ? _mm512_loadu_ps(c + 16) : _mm512_setzero_ps();
        if (in_scale != nullptr) {
          const __m512 f = _mm512_set1_ps(in_scale[m0 + i]);
          acc[i][0] = _mm512_mul_ps(acc[i][0], f);
          acc[i][1] = _mm512_mul_ps(acc[i][1], f);
        }
      }
      const std::uint16_t* l = left + m0 * left_stride;
      for (std::int64_t kp = 0; kp < depth / 2; ++kp) {
        const std::uint16_t* r = right + (kp * right_cols + n0) * 2;
        __m512bh b0 = (__m512bh)_mm512_loadu_si512(r);
        __m512bh b1 = (__m512bh)_mm512_loadu_si512(r + 32);
        asm("" : "+v"(b0), "+v"(b1));  // kept in registers (GCC would spill and reload one every step)
#pragma GCC unroll 8
        for (int i = 0; i < kRows; ++i) {
          std::int32_t pair;
          std::memcpy(&pair, l + i * left_stride + 2 * kp, sizeof(pair));
          const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
          acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, b0);
          acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, b1);
        }
      }
      const __m512 f = _mm512_set1_ps(out_scale);
#pragma GCC unroll 8
      for (int i = 0; i < kRows; ++i) {
        float* c = out + (m0 + i) * out_stride + n0;
        _mm512_storeu_ps(c, out_scale != 1.0f ? _mm512_mul_ps(acc[i][0], f) : acc[i][0]);
        _mm512_storeu_ps(c + 16, out_scale != 1.0f ? _mm512_mul_ps(acc[i][1], f) : acc[i][1]);
      }
    }
  }
}

// The word indices of _mm512_permutex2var_epi16 that interleave two rows of 16 bf16 values: 2t from the first
// (t), 2t + 1 from the second (32 + t).
alignas(64) constexpr std::uint16_t kInterleaveRows[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                           37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                           11, 43, 12, 44, 13, 45, 14, 46, 15, 47};

// P = exp2(S * factor - lse2) and dS = P (dP - delta) of 16 scores: one formula for the fused tiles and the
// separate passes, so both give the same values.
CPATTN_BF16_TARGET inline __m512 probability_and_ds(__m512 s, __m512 dp, __m512 factor, __m512 lse2,
                                                    __m512 delta, __m512& ds) {
  const __m512 p = exp2_bf16_avx512(_mm512_sub_ps(_mm512_mul_ps(s, factor), lse2));
  ds = _mm512_mul_ps(p, _mm512_sub_ps(dp, delta));
  return p;
}

// Logit soft-capping of `rows` rows of `cols` fp32 scores (a multiple of 16, rows `stride` apart), the bf16
// paths' form of flash_simd.hpp's softcap_scores: with x = s * in in base-2 units and b = cap log2 e, s
// becomes b tanh(x / b), in base-2 units (the caller's probabilities then take factor 1); t, where given
// ([rows][cols]), keeps tanh(x / b) for dS. tanh(a) = (1 - e) / (1 + e) with e = 2^(-2 a log2 e) by the
// kernels' exp2 (degree 6), the sign put back: within a few 1e-7 of tanh, far below bf16's rounding of P;
// +-Inf give +-1. No factor of scale / cap is formed: any scale and cap the rules take stay finite.
CPATTN_BF16_TARGET void softcap_rows(float* s, std::int64_t rows, std::int64_t cols, std::int64_t stride,
                                     float in, float b, float* t) {
  const __m512 to_base2 = _mm512_set1_ps(in), inv_b = _mm512_set1_ps(1.0f / b), vb = _mm512_set1_ps(b);
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 minus_two_log2e = _mm512_set1_ps(static_cast<float>(-2.0 * kLog2eDouble));
  const __m512i sign_bit = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t j = 0; j < cols; j += 16) {
      const __m512 x = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(s + r * stride + j), to_base2), inv_b);
      const __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), sign_bit);
      const __m512 a = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), sign));
      const __m512 e = exp2_avx512(_mm512_mul_ps(a, minus_two_log2e));
      const __m512 th = _mm512_castsi512_ps(_mm512_xor_si512(
          _mm512_castps_si512(_mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e))), sign));
      if (t != nullptr) _mm512_storeu_ps(t + r * cols + j, th);
      _mm512_storeu_ps(s + r * stride + j, _mm512_mul_ps(th, vb));
    }
  }
}

// ds *= 1 - t^2 over n values (a multiple of 16): dS through the soft-cap.
CPATTN_BF16_TARGET void softcap_gradient_rows(float* ds, const float* t, std::int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (std::int64_t i = 0; i < n; i += 16) {
    const __m512 th = _mm512_loadu_ps(t + i);
    _mm512_storeu_ps(ds + i, _mm512_mul_ps(_mm512_loadu_ps(ds + i), _mm512_fnmadd_ps(th, th, one)));
  }
}

// probabilities_and_ds_fused's epilogue for rows [m0, m0 + 4) and keys [n0, n0 + 32): P and dS from the
// accumulators, stored as bf16 pairs over rows and dS rows. A function of its own (the accumulators pass
// through memory): inlined, its constants would stay live across the products' loop and GCC would spill the
// loop's operands instead.
__attribute__((noinline)) CPATTN_BF16_TARGET void ds_epilogue(
    const __m512 (&s)[4][2], const __m512 (&dp)[4][2], std::int64_t m0, std::int64_t n0, std::int64_t keys,
    std::int64_t live, float factor, const float* lse2, const float* delta, std::uint16_t* p_pairs,
    std::uint16_t* ds_pairs, std::uint16_t* ds_rows) {
  constexpr int kRows = 4;
  const __m512i interleave = _mm512_load_si512(kInterleaveRows);
  const __m512 f = _mm512_set1_ps(factor);
  __m256i pb[kRows][2], db[kRows][2];
#pragma GCC unroll 4
  for (int i = 0; i < kRows; ++i) {
    const std::int64_t r = m0 + i;
    for (int half = 0; half < 2; ++half) {
      __m512 p = _mm512_setzero_ps(), ds = _mm512_setzero_ps();
      if (r < live) {
        p = probability_and_ds(s[i][half], dp[i][half], f, _mm512_set1_ps(lse2[r]), _mm512_set1_ps(delta[r]),
                               ds);
      }
      const __m256bh pc = _mm512_cvtneps_pbh(p), dc = _mm512_cvtneps_pbh(ds);
      pb[i][half] = reinterpret_cast<const __m256i&>(pc);
      db[i][half] = reinterpret_cast<const __m256i&>(dc);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(ds_rows + r * keys + n0 + 16 * half), db[i][half]);
    }
  }
#pragma GCC unroll 2
  for (int i = 0; i < kRows; i += 2) {
    for (int half = 0; half < 2; ++half) {
      const std::int64_t at = (((m0 + i) / 2) * keys + n0 + 16 * half) * 2;
      _mm512_storeu_si512(p_pairs + at,
                          _mm512_permutex2var_epi16(_mm512_castsi256_si512(pb[i][half]), interleave,
                                                    _mm512_castsi256_si512(pb[i + 1][half])));
      _mm512_storeu_si512(ds_pairs + at,
                          _mm512_permutex2var_epi16(_mm512_castsi256_si512(db[i][half]), interleave,
                                                    _mm512_castsi256_si512(db[i + 1][half])));
    }
  }
}

// One full tile's S = Q K^T and dP = dO V^T in registers, 4 rows x 32 keys at a time over the whole depth,
// and from them P = exp2(S * factor - lse2) and dS = P (dP - delta), written only as bf16: P and dS in pairs
// over rows ([rows/2][keys][2], the right operands of dV^T and dK^T) and dS as rows (the left operand of dQ).
// Rows at or past `live` get P = dS = 0. Value for value the arithmetic of dot_product (the same pair order
// over the depth), probabilities_and_ds_rows and to_bf16_pairs, without the fp32 S and dP in memory.
// q, d_o: [rows][depth] bf16; k, v: [depth/2][keys][2]; rows a multiple of 4, keys of 32, depth of 2.
CPATTN_BF16_TARGET void probabilities_and_ds_fused(const std::uint16_t* q, const std::uint16_t* d_o,
                                                   const std::uint16_t* k, const std::uint16_t* v,
                                                   std::int64_t rows, std::int64_t keys, std::int64_t depth,
                                                   std::int64_t live, float factor, const float* lse2,
                                                   const float* delta, std::uint16_t* p_pairs,
                                                   std::uint16_t* ds_pairs, std::uint16_t* ds_rows) {
  constexpr int kRows = 4;
  for (std::int64_t m0 = 0; m0 < rows; m0 += kRows) {
    for (std::int64_t n0 = 0; n0 < keys; n0 += 32) {
      __m512 s[kRows][2], dp[kRows][2];
#pragma GCC unroll 4
      for (int i = 0; i < kRows; ++i) {
        s[i][0] = s[i][1] = dp[i][0] = dp[i][1] = _mm512_setzero_ps();
      }
      for (std::int64_t kp = 0; kp < depth / 2; ++kp) {
        const std::int64_t at = (kp * keys + n0) * 2;
        __m512bh k0 = (__m512bh)_mm512_loadu_si512(k + at);
        __m512bh k1 = (__m512bh)_mm512_loadu_si512(k + at + 32);
        __m512bh v0 = (__m512bh)_mm512_loadu_si512(v + at);
        __m512bh v1 = (__m512bh)_mm512_loadu_si512(v + at + 32);
        // Opaque to the register allocator, which would otherwise load them again for every row.
        asm("" : "+v"(k0), "+v"(k1), "+v"(v0), "+v"(v1));
#pragma GCC unroll 4
        for (int i = 0; i < kRows; ++i) {
          std::int32_t qp, dop;
          std::memcpy(&qp, q + (m0 + i) * depth + 2 * kp, sizeof(qp));
          std::memcpy(&dop, d_o + (m0 + i) * depth + 2 * kp, sizeof(dop));
          const __m512bh a = (__m512bh)_mm512_set1_epi32(qp), c = (__m512bh)_mm512_set1_epi32(dop);
          s[i][0] = _mm512_dpbf16_ps(s[i][0], a, k0);
          s[i][1] = _mm512_dpbf16_ps(s[i][1], a, k1);
          dp[i][0] = _mm512_dpbf16_ps(dp[i][0], c, v0);
          dp[i][1] = _mm512_dpbf16_ps(dp[i][1], c, v1);
        }
      }
      ds_epilogue(s, dp, m0, n0, keys, live, factor, lse2, delta, p_pairs, ds_pairs, ds_rows);
    }
  }
}

CPATTN_AMX_TARGET void scale_row(float* row, std::int64_t width, float factor);

// out[rows][cols] = (load_out ? out * in_scale[row] : 0) + left * right, times out_scale, on the path's unit:
// AMX tiles (the scalings as passes of their own) or AVX512-BF16 dot products (fused).
void product(bool amx, const std::uint16_t* left, std::int64_t left_stride, const std::uint16_t* right,
             std::int64_t right_cols, std::int64_t rows, std::int64_t cols, std::int64_t depth, float* out,
             std::int64_t out_stride, bool load_out, const float* in_scale = nullptr,
             float out_scale = 1.0f) {
  if (!amx) {
    dot_product(left, left_stride, right, right_cols, rows, cols, depth, out, out_stride, load_out, in_scale,
                out_scale);
    return;
  }
  if (load_out && in_scale != nullptr) {
    for (std::int64_t r = 0; r < rows; ++r) scale_row(out + r * out_stride, cols, in_scale[r]);
  }
  tile_product(left, left_stride, right, right_cols, rows, cols, depth, out, out_stride, load_out);
  if (out_scale != 1.0f) {
    for (std::int64_t r = 0; r < rows; ++r) scale_row(out + r * out_stride, cols, out_scale);
  }
}

// One row of the online softmax over `keys` (a multiple of 16) base-2 scores: updates m and l, writes P as
// bf16 and returns alpha, the factor the row's O must be rescaled by. l sums the bf16-rounded P that P V
// uses.
CPATTN_AMX_TARGET float softmax_row(const float* s, std::int64_t keys, float& m, float& l,
                                    std::uint16_t* p_out) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  __m512 mx = _mm512_set1_ps(m);
  for (std::int64_t j = 0; j < keys; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + j));
  const float m_new = _mm512_reduce_max_ps(mx);
  // A row that has seen nothing yet subtracts 0: its P is exp2(-inf) = 0 and its alpha 0 (O is 0).
  const float m_use = m_new == neg_inf ? 0.0f : m_new;
  const __m512 mu = _mm512_set1_ps(m_use);
  __m512 sum = _mm512_setzero_ps();
  for (std::int64_t j = 0; j < keys; j += 16) {
    const __m512 p = exp2_bf16_avx512(_mm512_sub_ps(_mm512_loadu_ps(s + j), mu));
    const __m256bh pb = _mm512_cvtneps_pbh(p);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p_out + j), reinterpret_cast<const __m256i&>(pb));
    const __m512 rounded = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(pb)), 16));
    sum = _mm512_add_ps(sum, rounded);
  }
  const float alpha = _mm512_cvtss_f32(exp2_avx512(_mm512_set1_ps(m - m_use)));
  l = l * alpha + _mm512_reduce_add_ps(sum);
  m = m_new;
  return alpha;
}

CPATTN_AMX_TARGET void scale_row(float* row, std::int64_t width, float factor) {
  const __m512 f = _mm512_set1_ps(factor);
  for (std::int64_t d = 0; d < width; d += 16)
    _mm512_storeu_ps(row + d, _mm512_mul_ps(_mm512_loadu_ps(row + d), f));
}

// One tile's P = exp2(S * factor - lse2) and dS = P (dP - delta), row by row over `keys` (a multiple of 16).
CPATTN_AMX_TARGET void probabilities_and_ds_rows(float* s, float* dp, std::int64_t rows, std::int64_t keys,
                                                 float factor, const float* lse2, const float* delta) {
  const __m512 f = _mm512_set1_ps(factor);
  for (std::int64_t r = 0; r < rows; ++r) {
    const __m512 l2 = _mm512_set1_ps(lse2[r]), dl = _mm512_set1_ps(delta[r]);
    for (std::int64_t j = 0; j < keys; j += 16) {
      __m512 ds;
      const __m512 p = probability_and_ds(_mm512_loadu_ps(s + r * keys + j),
                                          _mm512_loadu_ps(dp + r * keys + j), f, l2, dl, ds);
      _mm512_storeu_ps(s + r * keys + j, p);
      _mm512_storeu_ps(dp + r * keys + j, ds);
    }
  }
}

// fp32 [rows][keys] (rows even, keys a multiple of 16) to bf16 pairs over rows, out[r/2][j][r%2], and, when
// `row_major` is given, to bf16 rows too.
CPATTN_AMX_TARGET void to_bf16_pairs(const float* x, std::int64_t rows, std::int64_t keys,
                                     std::uint16_t* pairs, std::uint16_t* row_major) {
  const __m512i interleave = _mm512_load_si512(kInterleaveRows);
  for (std::int64_t r = 0; r < rows; r += 2) {
    for (std::int64_t j = 0; j < keys; j += 16) {
      const __m256bh a = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + r * keys + j));
      const __m256bh b = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + (r + 1) * keys + j));
      const __m256i ai = reinterpret_cast<const __m256i&>(a), bi = reinterpret_cast<const __m256i&>(b);
      const __m512i both =
          _mm512_permutex2var_epi16(_mm512_castsi256_si512(ai), interleave, _mm512_castsi256_si512(bi));
      _mm512_storeu_si512(pairs + ((r / 2) * keys + j) * 2, both);
      if (row_major != nullptr) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(row_major + r * keys + j), ai);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(row_major + (r + 1) * keys + j), bi);
      }
    }
  }
}

CPATTN_AMX_TARGET void load_tile_config_amx() {
  static const TileConfig config = full_tiles();
  _tile_loadconfig(&config);
}

CPATTN_AMX_TARGET void release_tiles_amx() {
  _tile_release();
}

// The tile state, on the AMX path only.
void load_tile_config(bool amx) {
  if (amx) load_tile_config_amx();
}
void release_tiles(bool amx) {
  if (amx) release_tiles_amx();
}

}  // namespace

bool avx512_bf16_usable() {
  // Every instruction set of CPATTN_BF16_TARGET and of the shared softmax code (CPATTN_AMX_TARGET less AMX).
  static const bool usable = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                             __builtin_cpu_supports("avx512bf16");
  return usable;
}

bool amx_bf16_usable() {
  static const bool usable = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = (d >> 24) & 1u, bf16 = (d >> 22) & 1u;
    // Every instruction set of CPATTN_AMX_TARGET (the softmax's exp2 needs AVX512DQ's vreduceps).
    if (!tile || !bf16 || !__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
        !__builtin_cpu_supports("avx512vl") || !__builtin_cpu_supports("avx512dq") ||
        !__builtin_cpu_supports("avx512bf16")) {
      return false;
    }
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return usable;
}

void flash_forward_bf16(const ConstTensorRef& q, const ConstTensorRef& k, const ConstTensorRef& v,
                        const AttentionMask& mask, double scale, const FlashConfig& config,
                        const BlockGrid& grid, const TensorRef& o, float* lse,
                        std::vector<std::int64_t>& task_tiles, std::atomic<std::int64_t>& full,
                        std::atomic<std::int64_t>& partial) {
  const std::int64_t B = q.shape.b, Sq = q.shape.s, Skv = k.shape.s, Hq = q.shape.h, Hkv = k.shape.h;
  const std::int64_t D = q.shape.d, G = Hq / Hkv;
  const std::int64_t Bq = config.block_q, Bk = config.block_kv;
  const std::int64_t D32 = round_up(D, kTileDepth);  // the head dim padded to whole tile depths (zeros)
  const std::int64_t q_blocks = (Sq + Bq - 1) / Bq, kv_blocks = (Skv + Bk - 1) / Bk;
  const std::int64_t W = 2 * Bk;  // the width of a softmax step: a pair of kv blocks
  const float factor = static_cast<float>(scale * kLog2eDouble);
  const float softcap_b = static_cast<float>(mask.softcap * kLog2eDouble);
  const bool segments = mask.has_segments();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const bool amx = flash_bf16_path(config) == Bf16Path::amx;

  // K as the right operand of S = Q K^T, [D32/2][Bk][2]; V as the right operand of O += P V, [Bk/2][D32][2];
  // both pair-interleaved, zero-padded, packed once per call.
  const std::int64_t block_elems = D32 * Bk;
  const PooledArray<std::uint16_t> kpack(static_cast<std::size_t>(B * Hkv * kv_blocks * block_elems));
  const PooledArray<std::uint16_t> vpack(kpack.size());
  parallel_for(B * Hkv * kv_blocks, config.threads, [&](std::int64_t task, int) {
    const std::int64_t b = task / (Hkv * kv_blocks), hk = (task / kv_blocks) % Hkv, kvi = task % kv_blocks;
    const BlockMeta& kb = grid.kv[b][kvi];
    pack_bf16(k, b, hk, kb, Bk, D32, Layout::pairs_over_d, kpack.data() + task * block_elems);
    pack_bf16(v, b, hk, kb, Bk, D32, Layout::pairs_over_r, vpack.data() + task * block_elems);
  });

  struct Workspace {
    AlignedVector<std::uint16_t> qb, p;
    AlignedVector<float> s, acc, m, l, alpha, row;
  };
  std::vector<Workspace> spaces(static_cast<std::size_t>(std::max(1, config.threads)));
  parallel_for(B * Hq * q_blocks, config.threads, [&](std::int64_t task, int worker) {
    const std::int64_t b = task / (Hq * q_blocks), h = (task / q_blocks) % Hq, hk = h / G;
    const BlockMeta& qb = grid.q[b][task % q_blocks];
    const std::int64_t rows = round_up(qb.length, kGroupRows);
    Workspace& w = spaces[worker];
    w.qb.assign(static_cast<std::size_t>(rows * D32), 0);
    w.p.resize(static_cast<std::size_t>(rows * W));
    w.s.resize(static_cast<std::size_t>(rows * W));
    w.acc.assign(static_cast<std::size_t>(rows * D32), 0.0f);
    w.m.assign(static_cast<std::size_t>(rows), neg_inf);
    w.l.assign(static_cast<std::size_t>(rows), 0.0f);
    w.alpha.resize(static_cast<std::size_t>(rows));
    w.row.resize(static_cast<std::size_t>(D32));
    pack_bf16(q, b, h, qb, rows, D32, Layout::rows, w.qb.data());
    load_tile_config(amx);
    std::int64_t computed = 0, computed_full = 0;
    // The kv blocks in aligned pairs (2j, 2j + 1), one softmax step over both: half the per-step costs (the
    // row statistics, the rescale). A block the q block does not see is -inf in its half and skipped in P V,
    // an exact no-op for every row, so a row's result depends only on its own keys, whichever rows share its
    // q block.
    for (std::int64_t kv0 = 0; kv0 < kv_blocks; kv0 += 2) {
      TileKind kinds[2] = {TileKind::empty, TileKind::empty};
      for (std::int64_t j = 0; j < 2 && kv0 + j < kv_blocks; ++j) {
        kinds[j] = classify_tile(qb, grid.kv[b][kv0 + j], mask.band(), segments, Bk);
      }
      if (kinds[0] == TileKind::empty && kinds[1] == TileKind::empty) continue;
      for (std::int64_t j = 0; j < 2; ++j) {
        float* s_half = w.s.data() + j * Bk;
        if (kinds[j] == TileKind::empty) {
          for (std::int64_t r = 0; r < rows; ++r) std::fill_n(s_half + r * W, Bk, neg_inf);
          continue;
        }
        ++computed;
        computed_full += kinds[j] == TileKind::full;
        const std::int64_t at = (b * Hkv + hk) * kv_blocks + kv0 + j;
        // s: [rows][W] = Q K^T in base-2 units, this block's half
        product(amx, w.qb.data(), D32, kpack.data() + at * block_elems, Bk, rows, Bk, D32, s_half, W, false,
                nullptr, factor);
        if (softcap_b > 0) softcap_rows(s_half, rows, Bk, W, 1.0f, softcap_b, nullptr);
        if (kinds[j] == TileKind::partial) {
          apply_mask(s_half, rows, Bk, W, 1, qb, grid.kv[b][kv0 + j], b, mask, Sq, Skv, neg_inf);
        }
      }
      for (std::int64_t r = 0; r < rows; ++r) {
        w.alpha[r] = softmax_row(w.s.data() + r * W, W, w.m[r], w.l[r], w.p.data() + r * W);
      }
      // acc: [rows][D32] = acc * alpha + P V. Both blocks seen: one product over the pair (their packed V
      // rows are consecutive), the same steps in the same order as a block at a time; else the one seen.
      if (kinds[0] != TileKind::empty && kinds[1] != TileKind::empty) {
        const std::int64_t at = (b * Hkv + hk) * kv_blocks + kv0;
        product(amx, w.p.data(), W, vpack.data() + at * block_elems, D32, rows, D32, W, w.acc.data(), D32,
                true, w.alpha.data());
      } else {
        const std::int64_t j = kinds[0] != TileKind::empty ? 0 : 1;
        const std::int64_t at = (b * Hkv + hk) * kv_blocks + kv0 + j;
        product(amx, w.p.data() + j * Bk, W, vpack.data() + at * block_elems, D32, rows, D32, Bk,
                w.acc.data(), D32, true, w.alpha.data());
      }
    }
    release_tiles(amx);
    task_tiles[task] = computed;
    full += computed_full;
    partial += computed - computed_full;
    const float* sink = mask.sinks.empty() ? nullptr : &mask.sinks[static_cast<std::size_t>(h)];
    for (std::int64_t r = 0; r < qb.length; ++r) {
      const std::int64_t i = qb.begin + r;
      const float l = w.l[r];
      const RowEnd end = finish_row(w.m[r], l, sink);
      for (std::int64_t d = 0; d < D; ++d) w.row[d] = l != 0.0f ? w.acc[r * D32 + d] / l : 0.0f;
      store_row(o, b, i, h, w.row.data(), end.o_factor);
      if (lse != nullptr) lse[(b * Hq + h) * Sq + i] = end.lse;
    }
  });
}

namespace {

// The backward's operands in the tile unit's layouts, packed once per call. q side, per (b, h, q block): Q
// and dO as rows (left operands of S and dP) and as columns (left operands of dK^T and dV^T), [R32][D32] and
// [D32][R32]. kv side, per (b, hk, kv block): K and V in pairs over d (right operands of S and dP), K in
// pairs over tokens (right operand of dQ).
struct AmxBackwardOperands {
  AmxBackwardOperands(std::size_t q_size, std::size_t kv_size)
      : q_rows(q_size),
        do_rows(q_size),
        q_cols(q_size),
        do_cols(q_size),
        k_pairs_d(kv_size),
        v_pairs_d(kv_size),
        k_pairs_r(kv_size) {}
  PooledArray<std::uint16_t> q_rows, do_rows, q_cols, do_cols;
  PooledArray<std::uint16_t> k_pairs_d, v_pairs_d, k_pairs_r;
};

// A worker's buffers, reused by its tasks.
struct AmxBackwardWorkspace {
  AlignedVector<float> s, dp, dkt, dvt, row, t;  // t: tanh of soft-capped scores
  AlignedVector<std::uint16_t> p_pairs, ds_pairs, ds_rows;
  AlignedVector<double> sum_k, sum_v;  // dK^T, dV^T of one kv block: [D32][Bk]
};

// What every task of a call reads and writes.
struct AmxBackwardCall {
  const AttentionMask& mask;
  const BlockGrid& grid;
  const std::vector<float>& lse2;
  const std::vector<float>& delta;
  const TensorRef& dk;
  const TensorRef& dv;
  const AmxBackwardOperands& ops;
  bool amx;  // the products on AMX tiles, else AVX512-BF16 dot products
  std::int64_t Sq, Skv, Hq, Hkv, D, G, Bk, D32, R32, q_blocks, kv_blocks, sq_padded, stripe, q_elems,
      kv_elems;
  double scale;
  float factor;
  float softcap_b;  // the soft-cap in the scores' base-2 units (cap log2 e), 0 for none; no fused tiles then
  bool segments;
  const PooledArray<double>& head_dk;  // [B][Hq][stripe][D32][Bk] when G > 1
  const PooledArray<double>& head_dv;
  const PooledArray<float>& dq_acc;  // [B][Hq][q_blocks][R32][D32]
  std::vector<std::int64_t>& task_tiles;
  std::atomic<std::int64_t>& full;
  std::atomic<std::int64_t>& partial;
};

AmxBackwardOperands pack_backward_operands(const ConstTensorRef& q, const ConstTensorRef& k,
                                           const ConstTensorRef& v, const ConstTensorRef& d_out,
                                           const BlockGrid& grid, std::int64_t q_blocks,
                                           std::int64_t kv_blocks, std::int64_t R32, std::int64_t D32,
                                           std::int64_t Bk, int threads) {
  const std::int64_t B = q.shape.b, Hq = q.shape.h, Hkv = k.shape.h;
  const std::int64_t q_elems = R32 * D32, kv_elems = Bk * D32;
  AmxBackwardOperands ops(static_cast<std::size_t>(B * Hq * q_blocks * q_elems),
                          static_cast<std::size_t>(B * Hkv * kv_blocks * kv_elems));
  parallel_for(B * Hq * q_blocks, threads, [&](std::int64_t task, int) {
    const std::int64_t b = task / (Hq * q_blocks), h = (task / q_blocks) % Hq;
    const BlockMeta& qb = grid.q[b][task % q_blocks];
    const std::size_t at = static_cast<std::size_t>(task * q_elems);
    pack_bf16(q, b, h, qb, R32, D32, Layout::rows, ops.q_rows.data() + at);
    pack_bf16(d_out, b, h, qb, R32, D32, Layout::rows, ops.do_rows.data() + at);
    pack_bf16(q, b, h, qb, R32, D32, Layout::columns, ops.q_cols.data() + at);
    pack_bf16(d_out, b, h, qb, R32, D32, Layout::columns, ops.do_cols.data() + at);
  });
  parallel_for(B * Hkv * kv_blocks, threads, [&](std::int64_t task, int) {
    const std::int64_t b = task / (Hkv * kv_blocks), hk = (task / kv_blocks) % Hkv;
    const BlockMeta& kb = grid.kv[b][task % kv_blocks];
    const std::size_t at = static_cast<std::size_t>(task * kv_elems);
    pack_bf16(k, b, hk, kb, Bk, D32, Layout::pairs_over_d, ops.k_pairs_d.data() + at);
    pack_bf16(v, b, hk, kb, Bk, D32, Layout::pairs_over_d, ops.v_pairs_d.data() + at);
    pack_bf16(k, b, hk, kb, Bk, D32, Layout::pairs_over_r, ops.k_pairs_r.data() + at);
  });
  return ops;
}

// One tile of (b, h, q block qi) against the kv block at kv_at: S = Q K^T and dP = dO V^T, P and dS, then
// dV^T = dO^T P and dK^T = Q^T dS into the kv block's fp32 run (`accumulate`: added to it, else it starts
// here) and dQ += dS K.
void amx_backward_tile(const AmxBackwardCall& call, AmxBackwardWorkspace& w, std::int64_t b, std::int64_t h,
                       std::int64_t qi, const BlockMeta& kb, std::size_t kv_at, TileKind kind,
                       bool accumulate) {
  const std::int64_t Bk = call.Bk, D32 = call.D32, R32 = call.R32;
  const AmxBackwardOperands& ops = call.ops;
  const BlockMeta& qb = call.grid.q[b][qi];
  const std::size_t q_at = static_cast<std::size_t>(((b * call.Hq + h) * call.q_blocks + qi) * call.q_elems);
  const std::int64_t row0 = (b * call.Hq + h) * call.sq_padded + qb.begin;
  // Rows past the block's length are zero rows of Q and dO; their P and dS are set to 0 (their lse2 would be
  // another block's).
  const std::int64_t live = qb.length;
  if (!call.amx && kind == TileKind::full && call.softcap_b == 0) {
    probabilities_and_ds_fused(ops.q_rows.data() + q_at, ops.do_rows.data() + q_at,
                               ops.k_pairs_d.data() + kv_at, ops.v_pairs_d.data() + kv_at, R32, Bk, D32, live,
                               call.factor, call.lse2.data() + row0, call.delta.data() + row0,
                               w.p_pairs.data(), w.ds_pairs.data(), w.ds_rows.data());
  } else {
    // S = Q K^T, dP = dO V^T: [R32][Bk]
    product(call.amx, ops.q_rows.data() + q_at, D32, ops.k_pairs_d.data() + kv_at, Bk, R32, Bk, D32,
            w.s.data(), Bk, false);
    product(call.amx, ops.do_rows.data() + q_at, D32, ops.v_pairs_d.data() + kv_at, Bk, R32, Bk, D32,
            w.dp.data(), Bk, false);
    if (call.softcap_b > 0) {  // the forward's capped scores, tanh kept for dS through the cap
      w.t.resize(static_cast<std::size_t>(R32 * Bk));
      softcap_rows(w.s.data(), live, Bk, Bk, call.factor, call.softcap_b, w.t.data());
    }
    // capped scores are in base-2 units already: factor 1
    probabilities_and_ds_rows(w.s.data(), w.dp.data(), live, Bk, call.softcap_b > 0 ? 1.0f : call.factor,
                              call.lse2.data() + row0, call.delta.data() + row0);
    if (call.softcap_b > 0) softcap_gradient_rows(w.dp.data(), w.t.data(), live * Bk);
    std::fill(w.s.begin() + live * Bk, w.s.end(), 0.0f);
    std::fill(w.dp.begin() + live * Bk, w.dp.end(), 0.0f);
    if (kind == TileKind::partial) {
      apply_mask(w.s.data(), R32, Bk, Bk, 1, qb, kb, b, call.mask, call.Sq, call.Skv, 0.0f);
      apply_mask(w.dp.data(), R32, Bk, Bk, 1, qb, kb, b, call.mask, call.Sq, call.Skv, 0.0f);
    }
    to_bf16_pairs(w.s.data(), R32, Bk, w.p_pairs.data(), nullptr);
    to_bf16_pairs(w.dp.data(), R32, Bk, w.ds_pairs.data(), w.ds_rows.data());
  }
  // dV^T = dO^T P, dK^T = Q^T dS: [D32][Bk]
  product(call.amx, ops.do_cols.data() + q_at, R32, w.p_pairs.data(), Bk, D32, Bk, R32, w.dvt.data(), Bk,
          accumulate);
  product(call.amx, ops.q_cols.data() + q_at, R32, w.ds_pairs.data(), Bk, D32, Bk, R32, w.dkt.data(), Bk,
          accumulate);
  // dQ += dS K: [R32][D32], continuing each row's sum over the kv blocks in order
  product(call.amx, w.ds_rows.data(), Bk, ops.k_pairs_r.data() + kv_at, D32, R32, D32, Bk,
          call.dq_acc.data() + q_at, D32, true);
}

// The kv block's fp32 run of dK^T, dV^T added into its fp64 sums.
void flush_kv_run(const AmxBackwardCall& call, AmxBackwardWorkspace& w) {
  for (std::int64_t i = 0; i < call.kv_elems; ++i) {
    w.sum_k[i] += w.dkt[i];
    w.sum_v[i] += w.dvt[i];
  }
}

// [D32][Bk] sums -> rows of dK (times scale) and dV.
void store_kv_rows(const AmxBackwardCall& call, AmxBackwardWorkspace& w, std::int64_t b, std::int64_t hk,
                   const BlockMeta& kb) {
  const std::int64_t Bk = call.Bk, D32 = call.D32;
  w.row.resize(static_cast<std::size_t>(2 * D32));
  for (std::int64_t j = 0; j < kb.length; ++j) {
    for (std::int64_t d = 0; d < call.D; ++d) {
      w.row[d] = static_cast<float>(w.sum_k[d * Bk + j] * call.scale);
      w.row[D32 + d] = static_cast<float>(w.sum_v[d * Bk + j]);
    }
    store_row(call.dk, b, kb.begin + j, hk, w.row.data(), 1.0f);
    store_row(call.dv, b, kb.begin + j, hk, w.row.data() + D32, 1.0f);
  }
}

// Tiles whose dK^T and dV^T sum in fp32 before they join the kv block's fp64 sums: the fp64 pass once per
// four tiles, the fp32 run's error that of a 4 * Bq-row sum (far inside bf16's).
constexpr std::int64_t kFp32RunTiles = 4;

// Task `task` of the stripe [s0, s1): one q head's tiles, each kv block against the q blocks in order, its
// dK^T and dV^T summed in fp32 runs of kFp32RunTiles tiles, the runs in fp64, and then stored (G = 1) or left
// as the head's partial.
void amx_backward_head(const AmxBackwardCall& call, std::int64_t task, std::int64_t s0, std::int64_t s1,
                       AmxBackwardWorkspace& w) {
  const std::int64_t b = task / call.Hq, h = task % call.Hq, hk = h / call.G;
  w.s.resize(static_cast<std::size_t>(call.R32 * call.Bk));
  w.dp.resize(w.s.size());
  w.dkt.resize(static_cast<std::size_t>(call.kv_elems));
  w.dvt.resize(w.dkt.size());
  w.p_pairs.resize(w.s.size());
  w.ds_pairs.resize(w.s.size());
  w.ds_rows.resize(w.s.size());
  load_tile_config(call.amx);
  std::int64_t computed = 0, computed_full = 0;
  for (std::int64_t kvi = s0; kvi < s1; ++kvi) {
    const BlockMeta& kb = call.grid.kv[b][kvi];
    const std::size_t kv_at =
        static_cast<std::size_t>(((b * call.Hkv + hk) * call.kv_blocks + kvi) * call.kv_elems);
    w.sum_k.assign(static_cast<std::size_t>(call.kv_elems), 0.0);
    w.sum_v.assign(static_cast<std::size_t>(call.kv_elems), 0.0);
    std::int64_t run = 0;  // tiles in the fp32 run of dK^T, dV^T
    for (std::int64_t qi = 0; qi < call.q_blocks; ++qi) {
      const TileKind kind = classify_tile(call.grid.q[b][qi], kb, call.mask.band(), call.segments, call.Bk);
      if (kind == TileKind::empty) continue;
      ++computed;
      computed_full += kind == TileKind::full;
      amx_backward_tile(call, w, b, h, qi, kb, kv_at, kind, run > 0);
      if (++run == kFp32RunTiles) {
        flush_kv_run(call, w);
        run = 0;
      }
    }
    if (run > 0) flush_kv_run(call, w);
    if (call.G > 1) {
      const std::size_t at = static_cast<std::size_t>((task * call.stripe + (kvi - s0)) * call.kv_elems);
      std::copy(w.sum_k.begin(), w.sum_k.end(), call.head_dk.begin() + at);
      std::copy(w.sum_v.begin(), w.sum_v.end(), call.head_dv.begin() + at);
    } else {
      store_kv_rows(call, w, b, hk, kb);
    }
  }
  release_tiles(call.amx);
  call.task_tiles[task] += computed;
  call.full += computed_full;
  call.partial += computed - computed_full;
}

// dK, dV of the stripe [s0, s1)'s kv blocks = the group's per-head partials, added in head order.
void sum_amx_partials(const AmxBackwardCall& call, std::vector<AmxBackwardWorkspace>& spaces,
                      std::int64_t batch, std::int64_t s0, std::int64_t s1, int threads) {
  const std::int64_t Hkv = call.Hkv, kv_elems = call.kv_elems;
  parallel_for(batch * Hkv * (s1 - s0), threads, [&](std::int64_t task, int worker) {
    const std::int64_t b = task / (Hkv * (s1 - s0)), hk = (task / (s1 - s0)) % Hkv,
                       kvi = s0 + task % (s1 - s0);
    AmxBackwardWorkspace& w = spaces[worker];
    w.sum_k.assign(static_cast<std::size_t>(kv_elems), 0.0);
    w.sum_v.assign(static_cast<std::size_t>(kv_elems), 0.0);
    for (std::int64_t g = 0; g < call.G; ++g) {  // the group's heads in order
      const std::size_t at =
          static_cast<std::size_t>(((b * call.Hq + hk * call.G + g) * call.stripe + (kvi - s0)) * kv_elems);
      for (std::int64_t i = 0; i < kv_elems; ++i) {
        w.sum_k[i] += call.head_dk[at + i];
        w.sum_v[i] += call.head_dv[at + i];
      }
    }
    store_kv_rows(call, w, b, hk, call.grid.kv[b][kvi]);
  });
}

}  // namespace

void flash_backward_bf16(const ConstTensorRef& q, const ConstTensorRef& k, const ConstTensorRef& v,
                         const ConstTensorRef& d_out, const AttentionMask& mask, double scale,
                         const FlashConfig& config, const BlockGrid& grid, const std::vector<float>& lse2,
                         const std::vector<float>& delta, const TensorRef& dq, const TensorRef& dk,
                         const TensorRef& dv, std::vector<std::int64_t>& task_tiles,
                         std::atomic<std::int64_t>& full, std::atomic<std::int64_t>& partial) {
  const std::int64_t B = q.shape.b, Sq = q.shape.s, Skv = k.shape.s, Hq = q.shape.h, Hkv = k.shape.h;
  const std::int64_t D = q.shape.d, G = Hq / Hkv;
  const std::int64_t Bq = config.block_q, Bk = config.block_kv;
  const std::int64_t D32 = round_up(D, kTileDepth);
  const std::int64_t R32 = round_up(Bq, kGroupRows);  // q rows of a tile, padded to whole 2x2 groups
  const std::int64_t q_blocks = (Sq + Bq - 1) / Bq, kv_blocks = (Skv + Bk - 1) / Bk;
  const std::int64_t q_elems = R32 * D32, kv_elems = Bk * D32;
  const AmxBackwardOperands ops =
      pack_backward_operands(q, k, v, d_out, grid, q_blocks, kv_blocks, R32, D32, Bk, config.threads);

  // As the vector path: stripes of kv blocks keep the per-q-head fp64 partials of dK^T, dV^T ([D32][Bk] per
  // kv block) under the budget; dQ accumulates in fp32 over every stripe.
  const std::int64_t stripe = backward_stripe_blocks(config, B, Hq, G, D32, kv_blocks);
  const PooledArray<double> head_dk(G > 1 ? static_cast<std::size_t>(B * Hq * stripe * kv_elems) : 0);
  const PooledArray<double> head_dv(head_dk.size());
  const PooledArray<float> dq_acc(static_cast<std::size_t>(B * Hq * q_blocks * q_elems));
  const AmxBackwardCall call{.mask = mask,
                             .grid = grid,
                             .lse2 = lse2,
                             .delta = delta,
                             .dk = dk,
                             .dv = dv,
                             .ops = ops,
                             .amx = flash_bf16_path(config) == Bf16Path::amx,
                             .Sq = Sq,
                             .Skv = Skv,
                             .Hq = Hq,
                             .Hkv = Hkv,
                             .D = D,
                             .G = G,
                             .Bk = Bk,
                             .D32 = D32,
                             .R32 = R32,
                             .q_blocks = q_blocks,
                             .kv_blocks = kv_blocks,
                             .sq_padded = q_blocks * Bq,
                             .stripe = stripe,
                             .q_elems = q_elems,
                             .kv_elems = kv_elems,
                             .scale = scale,
                             .factor = static_cast<float>(scale * kLog2eDouble),
                             .softcap_b = static_cast<float>(mask.softcap * kLog2eDouble),
                             .segments = mask.has_segments(),
                             .head_dk = head_dk,
                             .head_dv = head_dv,
                             .dq_acc = dq_acc,
                             .task_tiles = task_tiles,
                             .full = full,
                             .partial = partial};
  std::vector<AmxBackwardWorkspace> spaces(static_cast<std::size_t>(std::max(1, config.threads)));
  for_each_backward_stripe(
      kv_blocks, stripe, B * Hq, config.threads, G > 1,
      [&](std::int64_t task, std::int64_t s0, std::int64_t s1, int worker) {
        amx_backward_head(call, task, s0, s1, spaces[worker]);
      },
      [&](std::int64_t s0, std::int64_t s1) { sum_amx_partials(call, spaces, B, s0, s1, config.threads); });
  parallel_for(B * Hq * q_blocks, config.threads, [&](std::int64_t task, int) {
    const std::int64_t b = task / (Hq * q_blocks), h = (task / q_blocks) % Hq;
    const BlockMeta& qb = grid.q[b][task % q_blocks];
    for (std::int64_t r = 0; r < qb.length; ++r) {
      store_row(dq, b, qb.begin + r, h, dq_acc.data() + task * q_elems + r * D32, static_cast<float>(scale));
    }
  });
}

#else  // no AMX on this architecture or compiler

bool avx512_bf16_usable() {
  return false;
}

bool amx_bf16_usable() {
  return false;
}

void flash_forward_bf16(const ConstTensorRef&, const ConstTensorRef&, const ConstTensorRef&,
                        const AttentionMask&, double, const FlashConfig&, const BlockGrid&, const TensorRef&,
                        float*, std::vector<std::int64_t>&, std::atomic<std::int64_t>&,
                        std::atomic<std::int64_t>&) {
  CPATTN_ASSERT(false && "flash_forward_bf16 without AMX");
}

void flash_backward_bf16(const ConstTensorRef&, const ConstTensorRef&, const ConstTensorRef&,
                         const ConstTensorRef&, const AttentionMask&, double, const FlashConfig&,
                         const BlockGrid&, const std::vector<float>&, const std::vector<float>&,
                         const TensorRef&, const TensorRef&, const TensorRef&, std::vector<std::int64_t>&,
                         std::atomic<std::int64_t>&, std::atomic<std::int64_t>&) {
  CPATTN_ASSERT(false && "flash_backward_bf16 without AMX");
}

#endif

}  // namespace cpattn::kernels

namespace cpattn {

Bf16Path flash_bf16_path(const FlashConfig& config) {
  if (config.allow_amx && kernels::amx_bf16_usable()) return Bf16Path::amx;
  if (config.allow_avx512_bf16 && kernels::avx512_bf16_usable()) return Bf16Path::avx512_bf16;
  return Bf16Path::vector;
}

bool flash_uses_amx(DType dtype, const FlashConfig& config) {
  return dtype == DType::bf16 && flash_bf16_path(config) == Bf16Path::amx;
}

const char* to_string(Bf16Path path) {
  switch (path) {
    case Bf16Path::amx:
      return "amx";
    case Bf16Path::avx512_bf16:
      return "avx512_bf16";
    case Bf16Path::vector:
      return "vector";
  }
  return "vector";
}

}  // namespace cpattn
