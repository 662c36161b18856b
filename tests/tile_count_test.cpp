// The planner's tile counts without visiting every pair (count_nonempty_tiles, count_full_tiles) against
// classify_tile pair by pair, over random blocks: contiguous, scattered (a block that straddles two chunks),
// packed or not; causal, non-causal and sliding-window bands.
#include <gtest/gtest.h>

#include <random>

#include "kernels/tile_classification.hpp"

namespace cpattn::kernels {
namespace {

std::int64_t count_by_pairs(const std::vector<BlockMeta>& q, const std::vector<BlockMeta>& kv,
                            const PositionBand& band, bool segments, TileKind kind = TileKind::empty) {
  std::int64_t n = 0;
  for (const auto& a : q) {
    for (const auto& b : kv) {
      const TileKind k = classify_tile(a, b, band, segments, 64);
      n += kind == TileKind::empty ? k != TileKind::empty : k == kind;
    }
  }
  return n;
}

std::vector<BlockMeta> random_blocks(std::mt19937& rng, int count, bool segments) {
  std::uniform_int_distribution<int> pos(0, 999), seg(0, 9), width(0, 60);
  std::vector<BlockMeta> out;
  for (int i = 0; i < count; ++i) {
    BlockMeta m;
    m.length = i % 7 == 3 ? 40 : 64;  // now and then a sequence's tail: never full
    m.pos_min = pos(rng);
    m.pos_max = m.pos_min + width(rng);
    if (segments) {
      m.seg_min = seg(rng);
      m.seg_max = m.seg_min + seg(rng) / 3;
    } else {
      m.seg_min = std::numeric_limits<std::int32_t>::max();
      m.seg_max = std::numeric_limits<std::int32_t>::min();
    }
    out.push_back(m);
  }
  return out;
}

TEST(TileCount, AgreesWithClassifyingEveryPair) {
  std::mt19937 rng(5);
  // Bands: none, causal, causal windows (left 0, 30, 200), two-sided windows, a right side only, a left side
  // only, one past every position.
  const PositionBand bands[] = {
      causal_band(false),     causal_band(true),      {0, 0},      {30, 0}, {200, 0}, {5, 17}, {90, 300},
      {kUnboundedWindow, 40}, {30, kUnboundedWindow}, {2000, 2000}};
  for (int trial = 0; trial < 1000; ++trial) {
    const PositionBand band = bands[trial % 10];
    const bool segments = trial % 20 < 10;
    const auto q = random_blocks(rng, 1 + trial % 37, segments);
    const auto kv = random_blocks(rng, 1 + trial % 53, segments);
    ASSERT_EQ(count_nonempty_tiles(q, kv, band, segments), count_by_pairs(q, kv, band, segments))
        << "trial " << trial << " band " << band.left << "," << band.right << " segments " << segments;
    ASSERT_EQ(count_full_tiles(q, kv, band, segments, 64),
              count_by_pairs(q, kv, band, segments, TileKind::full))
        << "trial " << trial << " band " << band.left << "," << band.right << " segments " << segments;
  }
  // Real layouts: a packed causal sequence, blocks from the natural order.
  std::vector<std::int32_t> positions(1000), seg(1000);
  for (int i = 0; i < 1000; ++i) {
    positions[static_cast<std::size_t>(i)] = i;
    seg[static_cast<std::size_t>(i)] = i < 300 ? 0 : (i < 310 ? 1 : 2);
  }
  const auto blocks = block_meta(positions, seg, 0, 1000, 64);
  const PositionBand causal = causal_band(true);
  EXPECT_EQ(count_nonempty_tiles(blocks, blocks, causal, true), count_by_pairs(blocks, blocks, causal, true));
  EXPECT_EQ(count_nonempty_tiles(blocks, blocks, causal, false), 16 * 17 / 2);
  EXPECT_EQ(count_full_tiles(blocks, blocks, causal, true, 64),
            count_by_pairs(blocks, blocks, causal, true, TileKind::full));
  // Causal, one document: q block i sees the i kv blocks before it whole (all 64 rows; its own diagonal
  // block is partial): 0 + 1 + ... + 15. Non-causal: every q block sees the 15 whole kv blocks whole, and
  // the short last one (40 rows) is never full.
  EXPECT_EQ(count_full_tiles(blocks, blocks, causal, false, 64), 16 * 15 / 2);
  EXPECT_EQ(count_full_tiles(blocks, blocks, causal_band(false), false, 64), 16 * 15);
  // A causal window of 100 keys (left 99) on 64-token blocks: each q block sees itself and 2 before it at
  // most (block i's first query reaches back to 64 i - 99, inside block i - 2 for i >= 2).
  EXPECT_EQ(count_nonempty_tiles(blocks, blocks, PositionBand{99, 0}, false), 1 + 2 + 14 * 3);
  // Two-sided 10 and 10: a block and its neighbours where the band crosses into them.
  EXPECT_EQ(count_nonempty_tiles(blocks, blocks, PositionBand{10, 10}, false), 16 + 2 * 15);
}

}  // namespace
}  // namespace cpattn::kernels
