// Tile classification on the kernel's (Bq, Bk) grid from token metadata: each (q block, kv block) pair is
// empty (skipped), full (every row sees every key: no mask arithmetic) or partial (mask applied by
// selection).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "cpattn/mask.hpp"

namespace cpattn::kernels {

enum class TileKind { empty, full, partial };

// The ranges of positions and segment ids inside one block of one batch row.
struct BlockMeta {
  std::int64_t begin = 0, length = 0;  // rows [begin, begin + length)
  std::int32_t pos_min = 0, pos_max = 0;
  std::int32_t seg_min = 0, seg_max = 0;
};

inline std::vector<BlockMeta> block_meta(std::span<const std::int32_t> positions,
                                         std::span<const std::int32_t> segments, std::int64_t offset,
                                         std::int64_t length, std::int64_t block) {
  std::vector<BlockMeta> blocks;
  for (std::int64_t start = 0; start < length; start += block) {
    BlockMeta m;
    m.begin = start;
    m.length = std::min(block, length - start);
    m.pos_min = std::numeric_limits<std::int32_t>::max();
    m.pos_max = std::numeric_limits<std::int32_t>::min();
    m.seg_min = m.pos_min;
    m.seg_max = m.pos_max;
    for (std::int64_t i = start; i < start + m.length; ++i) {
      m.pos_min = std::min(m.pos_min, positions[offset + i]);
      m.pos_max = std::max(m.pos_max, positions[offset + i]);
      if (!segments.empty()) {
        m.seg_min = std::min(m.seg_min, segments[offset + i]);
        m.seg_max = std::max(m.seg_max, segments[offset + i]);
      }
    }
    blocks.push_back(m);
  }
  return blocks;
}

// `kv_block` is the kernel's Bk: a kv block shorter than that (the sequence tail) has padded keys, which only
// the masked path hides, so it is never full.
inline TileKind classify_tile(const BlockMeta& q, const BlockMeta& kv, bool causal, bool segments,
                              std::int64_t kv_block) {
  if (segments && (q.seg_max < kv.seg_min || kv.seg_max < q.seg_min)) return TileKind::empty;
  if (causal && kv.pos_min > q.pos_max) return TileKind::empty;
  const bool causal_full = !causal || kv.pos_max <= q.pos_min;
  const bool segment_full =
      !segments || (q.seg_min == q.seg_max && kv.seg_min == kv.seg_max && q.seg_min == kv.seg_min);
  return causal_full && segment_full && kv.length == kv_block ? TileKind::full : TileKind::partial;
}

}  // namespace cpattn::kernels
