// The attention mask on a score tile, by selection: the scores of pairs a row may not see become a fill value
// (-inf before the softmax, 0 for P and dS), a visible score keeps its bits.
#pragma once

#include <algorithm>
#include <cstdint>

#include "cpattn/error.hpp"
#include "cpattn/mask.hpp"
#include "kernels/tile_classification.hpp"

namespace cpattn::kernels {

namespace mask_detail {
// One visible run: x[i * step] for i < n keeps its score when the pair is visible, else `fill`. `other` is
// the fixed side (a key's position and segment against n query rows, or a query row's against n keys).
template <bool kCausal, bool kSegments, bool kKeysVary>
inline void select_run(float* x, std::int64_t step, std::int64_t n, const std::int32_t* pos,
                       const std::int32_t* seg, std::int32_t other_pos, std::int32_t other_seg, float fill) {
  for (std::int64_t i = 0; i < n; ++i) {
    bool seen = true;
    if constexpr (kSegments) seen = seen && seg[i] == other_seg;
    if constexpr (kCausal) seen = seen && (kKeysVary ? pos[i] <= other_pos : other_pos <= pos[i]);
    x[i * step] = seen ? x[i * step] : fill;
  }
}

template <bool kCausal, bool kSegments>
inline void apply_mask_as(float* s, std::int64_t q_rows, std::int64_t keys, std::int64_t q_stride,
                          std::int64_t key_stride, const BlockMeta& qb, const BlockMeta& kb, std::int64_t b,
                          const AttentionMask& mask, std::int64_t sq, std::int64_t skv, float fill) {
  const std::int32_t* qpos = mask.q_positions.data() + b * sq + qb.begin;
  const std::int32_t* kpos = mask.kv_positions.data() + b * skv + kb.begin;
  const std::int32_t* qseg = kSegments ? mask.q_segments.data() + b * sq + qb.begin : nullptr;
  const std::int32_t* kseg = kSegments ? mask.kv_segments.data() + b * skv + kb.begin : nullptr;
  const std::int64_t qn = std::min(q_rows, qb.length), kn = std::min(keys, kb.length);
  if (key_stride == 1) {  // S: a query row's keys are contiguous
    for (std::int64_t r = 0; r < q_rows; ++r) {
      float* row = s + r * q_stride;
      const std::int64_t valid = r < qn ? kn : 0;
      select_run<kCausal, kSegments, true>(row, 1, valid, kpos, kseg, qpos[r < qn ? r : 0],
                                           kSegments ? qseg[r < qn ? r : 0] : 0, fill);
      std::fill(row + valid, row + keys, fill);
    }
    return;
  }
  // S^T: a key's query rows are contiguous (q_stride == 1)
  for (std::int64_t j = 0; j < keys; ++j) {
    float* col = s + j * key_stride;
    const std::int64_t valid = j < kn ? qn : 0;
    select_run<kCausal, kSegments, false>(col, q_stride, valid, qpos, qseg, kpos[j < kn ? j : 0],
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
  if (mask.causal && segments) {
    mask_detail::apply_mask_as<true, true>(s, q_rows, keys, q_stride, key_stride, qb, kb, b, mask, sq, skv,
                                           fill);
  } else if (mask.causal) {
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
