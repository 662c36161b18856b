// The attention mask, described by token metadata rather than an S x S matrix: a query sees a key when their
// segment ids are equal (when segments are given) and, with `causal`, when the key's global position is <=
// the query's. Positions are global token indices, so a shard or a reordered sequence masks correctly.
#pragma once

#include <cstdint>
#include <span>

namespace cpattn {

struct AttentionMask {
  std::span<const std::int32_t> q_positions;   // [B, Sq]
  std::span<const std::int32_t> kv_positions;  // [B, Skv]
  std::span<const std::int32_t> q_segments;    // [B, Sq], or empty: one segment
  std::span<const std::int32_t> kv_segments;   // [B, Skv], or empty
  bool causal = true;

  bool has_segments() const { return !q_segments.empty(); }
  // Query i and key j of batch row b; sq, skv are the per-row lengths.
  bool visible(std::int64_t b, std::int64_t i, std::int64_t j, std::int64_t sq, std::int64_t skv) const {
    if (has_segments() && q_segments[b * sq + i] != kv_segments[b * skv + j]) return false;
    return !causal || kv_positions[b * skv + j] <= q_positions[b * sq + i];
  }
};

}  // namespace cpattn
