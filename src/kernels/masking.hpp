// The attention mask on a score tile (segments, and the positions' band: causal, sliding window), by
// selection: the scores of pairs a row may not see become a fill value (-inf before the softmax, 0 for P and
// dS), a visible score keeps its bits.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "cpattn/error.hpp"
#include "cpattn/mask.hpp"
#include "kernels/tile_classification.hpp"

namespace cpattn::kernels {

namespace mask_detail {
// int32 positions v with lo <= v <= hi: the band's bounds around one position, clamped to int32.
struct PosRange {
  std::int32_t lo, hi;
};
inline PosRange clamp_range(std::int64_t lo, std::int64_t hi) {
  constexpr std::int64_t kMin = std::numeric_limits<std::int32_t>::min(),
                         kMax = std::numeric_limits<std::int32_t>::max();
  return {static_cast<std::int32_t>(std::clamp(lo, kMin, kMax)),
          static_cast<std::int32_t>(std::clamp(hi, kMin, kMax))};
}

// One visible run: x[i * step] for i < n keeps its score when the pair is visible, else `fill`. The fixed
// side (a query row against n keys, or a key against n query rows) gives the segment id and the range of the
// varying side's positions its band admits.
template <bool kBand, bool kSegments>
inline void select_run(float* x, std::int64_t step, std::int64_t n, const std::int32_t* pos,
                       const std::int32_t* seg, PosRange range, std::int32_t other_seg, float fill) {
  for (std::int64_t i = 0; i < n; ++i) {
    bool seen = true;
    if constexpr (kSegments) seen = seen && seg[i] == other_seg;
    if constexpr (kBand) seen = seen && pos[i] >= range.lo && pos[i] <= range.hi;
    x[i * step] = seen ? x[i * step] : fill;
  }
}

template <bool kBand, bool kSegments>
inline void apply_mask_as(float* s, std::int64_t q_rows, std::int64_t keys, std::int64_t q_stride,
                          std::int64_t key_stride, const BlockMeta& qb, const BlockMeta& kb, std::int64_t b,
                          const AttentionMask& mask, std::int64_t sq, std::int64_t skv, float fill) {
  const std::int32_t* qpos = mask.q_positions.data() + b * sq + qb.begin;
  const std::int32_t* kpos = mask.kv_positions.data() + b * skv + kb.begin;
  const std::int32_t* qseg = kSegments ? mask.q_segments.data() + b * sq + qb.begin : nullptr;
  const std::int32_t* kseg = kSegments ? mask.kv_segments.data() + b * skv + kb.begin : nullptr;
  const PositionBand band = mask.band();
  const std::int64_t qn = std::min(q_rows, qb.length), kn = std::min(keys, kb.length);
  if (key_stride == 1) {  // S: a query row's keys are contiguous; keys p - left .. p + right
    for (std::int64_t r = 0; r < q_rows; ++r) {
      float* row = s + r * q_stride;
      const std::int64_t valid = r < qn ? kn : 0;
      const std::int64_t p = qpos[r < qn ? r : 0];
      select_run<kBand, kSegments>(row, 1, valid, kpos, kseg, clamp_range(p - band.left, p + band.right),
                                   kSegments ? qseg[r < qn ? r : 0] : 0, fill);
      std::fill(row + valid, row + keys, fill);
    }
    return;
  }
  // S^T: a key's query rows are contiguous (q_stride == 1); the key at p is seen from p - right .. p + left
  for (std::int64_t j = 0; j < keys; ++j) {
    float* col = s + j * key_stride;
    const std::int64_t valid = j < kn ? qn : 0;
    const std::int64_t p = kpos[j < kn ? j : 0];
    select_run<kBand, kSegments>(col, q_stride, valid, qpos, qseg, clamp_range(p - band.right, p + band.left),
                                 kSegments ? kseg[j < kn ? j : 0] : 0, fill);
    for (std::int64_t r = valid; r < q_rows; ++r) col[r * q_stride] = fill;
  }
}
}  // namespace mask_detail

// Scores of keys a row may not see become `fill`; padded rows and keys too. The score of query row r and key
// j is s[r * q_stride + j * key_stride] (a row-major S tile with key_stride 1, or a transposed S^T tile with
// q_stride 1). Selection only, so a visible score keeps its bits; the loops run over the block's positions
// and segments in place (branch-free, vectorized by the compiler).
inline void apply_mask(float* s, std::int64_t q_rows, std::int64_t keys, std::int64_t q_stride,
                       std::int64_t key_stride, const BlockMeta& qb, const BlockMeta& kb, std::int64_t b,
                       const AttentionMask& mask, std::int64_t sq, std::int64_t skv, float fill) {
  CPATTN_ASSERT(key_stride == 1 || q_stride == 1);
  if (qb.length == 0 || kb.length == 0) {
    for (std::int64_t r = 0; r < q_rows; ++r)
      for (std::int64_t j = 0; j < keys; ++j) s[r * q_stride + j * key_stride] = fill;
    return;
  }
  const bool segments = mask.has_segments();
  const bool banded = mask.band().bounded();
  if (banded && segments) {
    mask_detail::apply_mask_as<true, true>(s, q_rows, keys, q_stride, key_stride, qb, kb, b, mask, sq, skv,
                                           fill);
  } else if (banded) {
    mask_detail::apply_mask_as<true, false>(s, q_rows, keys, q_stride, key_stride, qb, kb, b, mask, sq, skv,
                                            fill);
  } else if (segments) {
    mask_detail::apply_mask_as<false, true>(s, q_rows, keys, q_stride, key_stride, qb, kb, b, mask, sq, skv,
                                            fill);
  } else {
    mask_detail::apply_mask_as<false, false>(s, q_rows, keys, q_stride, key_stride, qb, kb, b, mask, sq, skv,
                                             fill);
  }
}

}  // namespace cpattn::kernels
