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
// the masked path hides, so it is never full. `band`: the positions a query sees (AttentionMask::band).
inline TileKind classify_tile(const BlockMeta& q, const BlockMeta& kv, const PositionBand& band,
                              bool segments, std::int64_t kv_block) {
  if (segments && (q.seg_max < kv.seg_min || kv.seg_max < q.seg_min)) return TileKind::empty;
  if (!band.sees_any(q.pos_min, q.pos_max, kv.pos_min, kv.pos_max)) return TileKind::empty;
  const bool band_full = band.sees_all(q.pos_min, q.pos_max, kv.pos_min, kv.pos_max);
  const bool segment_full =
      !segments || (q.seg_min == q.seg_max && kv.seg_min == kv.seg_max && q.seg_min == kv.seg_min);
  return band_full && segment_full && kv.length == kv_block ? TileKind::full : TileKind::partial;
}

// With a left bound (a sliding window) each q block sees a run of kv blocks near its positions: the kv blocks
// in order of pos_min, each q block checking those whose pos_min is within its band widened by the widest kv
// block. O(nk log nk + nq log nk + the pairs checked), the pairs near the band.
inline std::int64_t count_nonempty_tiles_windowed(const std::vector<BlockMeta>& q,
                                                  const std::vector<BlockMeta>& kv, const PositionBand& band,
                                                  bool segments) {
  std::vector<std::size_t> order(kv.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](std::size_t x, std::size_t y) { return kv[x].pos_min < kv[y].pos_min; });
  std::vector<std::int64_t> starts(order.size());
  std::int64_t widest = 0;
  for (std::size_t i = 0; i < order.size(); ++i) {
    starts[i] = kv[order[i]].pos_min;
    widest = std::max<std::int64_t>(widest, std::int64_t{kv[order[i]].pos_max} - kv[order[i]].pos_min);
  }
  std::int64_t total = 0;
  for (const BlockMeta& b : q) {
    // pos_max >= b.pos_min - left needs pos_min >= b.pos_min - left - widest; pos_min <= b.pos_max + right.
    auto it = std::lower_bound(starts.begin(), starts.end(), b.pos_min - band.left - widest);
    for (; it != starts.end() && *it <= b.pos_max + band.right; ++it) {
      const BlockMeta& k = kv[order[static_cast<std::size_t>(it - starts.begin())]];
      if (segments && (b.seg_max < k.seg_min || k.seg_max < b.seg_min)) continue;
      total += band.sees_any(b.pos_min, b.pos_max, k.pos_min, k.pos_max);
    }
  }
  return total;
}

// How many (q block, kv block) pairs classify_tile calls non-empty, without visiting the pairs: O((nq + nk)
// log nk) rather than nq * nk, so that the planner's count stays quick at any grid. A pair is empty where its
// segment ranges are disjoint (kv.seg_max < q.seg_min or kv.seg_min > q.seg_max) or where the band hides it:
// with a right bound (causal: 0), kv.pos_min > q.pos_max + right; a left bound is counted by
// count_nonempty_tiles_windowed. Since seg_min <= seg_max, "kv.seg_max < q.seg_min" already implies
// "kv.seg_min <= q.seg_max", so the kv blocks a q block sees are #(pos_min <= P, seg_min <= b) - #(pos_min <=
// P, seg_max < a): two prefix counts over the kv blocks admitted so far, in order of pos_min, as the q blocks
// are taken in order of P = pos_max + right.
inline std::int64_t count_nonempty_tiles(const std::vector<BlockMeta>& q, const std::vector<BlockMeta>& kv,
                                         const PositionBand& band, bool segments) {
  if (band.windowed()) return count_nonempty_tiles_windowed(q, kv, band, segments);
  const auto nk = static_cast<std::int64_t>(kv.size());
  const bool causal = band.bounded();  // a right bound only
  if (!causal && !segments) return static_cast<std::int64_t>(q.size()) * nk;
  // Segment ids in rank order (both bounds of every kv block), for two Fenwick trees over them.
  std::vector<std::int32_t> ids;
  if (segments) {
    for (const auto& k : kv) {
      ids.push_back(k.seg_min);
      ids.push_back(k.seg_max);
    }
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  }
  const auto rank_of = [&](std::int32_t v) {  // how many ids are <= v
    return static_cast<std::int64_t>(std::upper_bound(ids.begin(), ids.end(), v) - ids.begin());
  };
  std::vector<std::int64_t> by_min(ids.size() + 1, 0), by_max(ids.size() + 1, 0);
  const auto add = [](std::vector<std::int64_t>& tree, std::int64_t i) {  // i: 1-based
    for (; i < static_cast<std::int64_t>(tree.size()); i += i & -i) ++tree[static_cast<std::size_t>(i)];
  };
  const auto prefix = [](const std::vector<std::int64_t>& tree, std::int64_t i) {  // entries 1..i
    std::int64_t n = 0;
    for (; i > 0; i -= i & -i) n += tree[static_cast<std::size_t>(i)];
    return n;
  };
  std::vector<std::size_t> kv_order(kv.size()), q_order(q.size());
  for (std::size_t i = 0; i < kv_order.size(); ++i) kv_order[i] = i;
  for (std::size_t i = 0; i < q_order.size(); ++i) q_order[i] = i;
  if (causal) {
    std::sort(kv_order.begin(), kv_order.end(),
              [&](std::size_t x, std::size_t y) { return kv[x].pos_min < kv[y].pos_min; });
    std::sort(q_order.begin(), q_order.end(),
              [&](std::size_t x, std::size_t y) { return q[x].pos_max < q[y].pos_max; });
  }
  std::int64_t total = 0, admitted = 0;
  for (const std::size_t qi : q_order) {
    const BlockMeta& b = q[qi];
    while (admitted < nk &&
           (!causal || kv[kv_order[static_cast<std::size_t>(admitted)]].pos_min <= b.pos_max + band.right)) {
      const BlockMeta& k = kv[kv_order[static_cast<std::size_t>(admitted)]];
      if (segments) {
        add(by_min, rank_of(k.seg_min));
        add(by_max, rank_of(k.seg_max));
      }
      ++admitted;
    }
    if (!segments) {
      total += admitted;
    } else {
      // kv.seg_min <= b.seg_max, less those with kv.seg_max < b.seg_min (ids below b.seg_min: rank_of(b -
      // 1)).
      total += prefix(by_min, rank_of(b.seg_max)) - (b.seg_min == std::numeric_limits<std::int32_t>::min()
                                                         ? 0
                                                         : prefix(by_max, rank_of(b.seg_min - 1)));
    }
  }
  return total;
}

}  // namespace cpattn::kernels
