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

namespace tile_count_detail {

// The sum over q blocks b of #{kv blocks k : key(k) <= limit(b), and k's segment range meets b's}, without
// visiting the pairs: the kv blocks admitted in order of key as the q blocks are taken in order of limit.
// Since seg_min <= seg_max, "kv.seg_max < q.seg_min" already implies "kv.seg_min <= q.seg_max", so the
// admitted blocks whose ranges meet b's are #(seg_min <= b.seg_max) - #(seg_max < b.seg_min): two prefix
// counts over Fenwick trees of the admitted blocks' segment ids. O((nq + nk) log nk).
template <class Key, class Limit>
std::int64_t admitted_pairs(const std::vector<BlockMeta>& q, const std::vector<BlockMeta>& kv, bool segments,
                            Key key, Limit limit) {
  const auto nk = static_cast<std::int64_t>(kv.size());
  std::vector<std::int32_t> ids;  // segment ids in rank order (both bounds of every kv block)
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
  std::sort(kv_order.begin(), kv_order.end(),
            [&](std::size_t x, std::size_t y) { return key(kv[x]) < key(kv[y]); });
  std::sort(q_order.begin(), q_order.end(),
            [&](std::size_t x, std::size_t y) { return limit(q[x]) < limit(q[y]); });
  std::int64_t total = 0, admitted = 0;
  for (const std::size_t qi : q_order) {
    const BlockMeta& b = q[qi];
    while (admitted < nk && key(kv[kv_order[static_cast<std::size_t>(admitted)]]) <= limit(b)) {
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
      // kv.seg_min <= b.seg_max, less those with kv.seg_max < b.seg_min (ids below b.seg_min: rank_of(b - 1))
      total += prefix(by_min, rank_of(b.seg_max)) - (b.seg_min == std::numeric_limits<std::int32_t>::min()
                                                         ? 0
                                                         : prefix(by_max, rank_of(b.seg_min - 1)));
    }
  }
  return total;
}

}  // namespace tile_count_detail

// How many (q block, kv block) pairs classify_tile calls non-empty, without visiting the pairs: O((nq + nk)
// log nk) rather than nq * nk, so that the planner's count stays quick at any grid and any band. A pair is
// empty where its segment ranges are disjoint or where the band hides it: kv.pos_min > q.pos_max + right (the
// keys after the band; causal: right 0) or kv.pos_max < q.pos_min - left (the keys before it). With left and
// right >= 0 a kv block before the band also starts before its end, so the pairs seen are those not after
// the band, less those before it: two counts of admitted_pairs.
inline std::int64_t count_nonempty_tiles(const std::vector<BlockMeta>& q, const std::vector<BlockMeta>& kv,
                                         const PositionBand& band, bool segments) {
  if (!band.bounded() && !segments) return static_cast<std::int64_t>(q.size() * kv.size());
  const std::int64_t right = band.right;
  const std::int64_t not_after = tile_count_detail::admitted_pairs(
      q, kv, segments, [](const BlockMeta& k) { return std::int64_t{k.pos_min}; },
      [&](const BlockMeta& b) { return right < kUnboundedWindow ? b.pos_max + right : kUnboundedWindow; });
  if (!band.windowed()) return not_after;
  const std::int64_t left = band.left;
  return not_after - tile_count_detail::admitted_pairs(
                         q, kv, segments, [](const BlockMeta& k) { return std::int64_t{k.pos_max}; },
                         [&](const BlockMeta& b) { return b.pos_min - left - 1; });
}

// How many (q block, kv block) pairs classify_tile calls full (the rest of the non-empty ones are partial:
// the mask applied by selection, the planner's dearer tiles), without visiting the pairs: a full pair's
// blocks are one document each, the same one (or no segments), the kv block is whole (`kv_block` rows) and
// the band sees all of it: kv.pos_max <= q.pos_min + right and kv.pos_min >= q.pos_max - left. Per document,
// the kv blocks admitted in order of pos_max as the q blocks are taken in order of pos_min + right, each
// counting those with pos_min >= its pos_max - left (a Fenwick tree over the admitted blocks' pos_min). O((nq
// + nk) log nk).
inline std::int64_t count_full_tiles(const std::vector<BlockMeta>& q, const std::vector<BlockMeta>& kv,
                                     const PositionBand& band, bool segments, std::int64_t kv_block) {
  struct Entry {
    std::int32_t segment;
    std::int64_t key, bound;  // kv: pos_max, pos_min; q: pos_min + right, pos_max - left
  };
  constexpr std::int64_t kNone = std::numeric_limits<std::int64_t>::min();
  std::vector<Entry> ks, qs;
  for (const BlockMeta& k : kv) {
    if (k.length != kv_block || (segments && k.seg_min != k.seg_max)) continue;
    ks.push_back({segments ? k.seg_min : 0, k.pos_max, k.pos_min});
  }
  for (const BlockMeta& b : q) {
    if (segments && b.seg_min != b.seg_max) continue;
    qs.push_back(
        {segments ? b.seg_min : 0,
         band.right < kUnboundedWindow ? b.pos_min + band.right : std::numeric_limits<std::int64_t>::max(),
         band.windowed() ? b.pos_max - band.left : kNone});
  }
  const auto order = [](const Entry& x, const Entry& y) {
    return x.segment != y.segment ? x.segment < y.segment : x.key < y.key;
  };
  std::sort(ks.begin(), ks.end(), order);
  std::sort(qs.begin(), qs.end(), order);
  std::int64_t total = 0;
  std::size_t kg = 0;
  for (std::size_t qg = 0; qg < qs.size();) {
    const std::int32_t segment = qs[qg].segment;
    std::size_t q_end = qg;
    while (q_end < qs.size() && qs[q_end].segment == segment) ++q_end;
    while (kg < ks.size() && ks[kg].segment < segment) ++kg;
    std::size_t k_end = kg;
    while (k_end < ks.size() && ks[k_end].segment == segment) ++k_end;
    // The document's kv blocks' pos_min values, ranked, for the Fenwick tree.
    std::vector<std::int64_t> mins;
    for (std::size_t i = kg; i < k_end; ++i) mins.push_back(ks[i].bound);
    std::sort(mins.begin(), mins.end());
    std::vector<std::int64_t> tree(mins.size() + 1, 0);
    std::int64_t admitted = 0;
    std::size_t next = kg;
    for (std::size_t i = qg; i < q_end; ++i) {
      while (next < k_end && ks[next].key <= qs[i].key) {
        auto at = static_cast<std::int64_t>(std::lower_bound(mins.begin(), mins.end(), ks[next].bound) -
                                            mins.begin()) +
                  1;
        for (; at < static_cast<std::int64_t>(tree.size()); at += at & -at)
          ++tree[static_cast<std::size_t>(at)];
        ++admitted, ++next;
      }
      // Those with pos_min < the q block's bound are not seen whole: admitted less their prefix count.
      auto below =
          static_cast<std::int64_t>(std::lower_bound(mins.begin(), mins.end(), qs[i].bound) - mins.begin());
      std::int64_t hidden = 0;
      for (; below > 0; below -= below & -below) hidden += tree[static_cast<std::size_t>(below)];
      total += admitted - hidden;
    }
    qg = q_end;
    kg = k_end;
  }
  return total;
}

}  // namespace cpattn::kernels
