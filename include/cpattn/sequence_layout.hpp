// Sequence layouts: which global token positions each rank holds, in the order it holds them, the token
// metadata the kernels' masks read (positions, segment ids), and the reorder between layouts. One source of
// truth for the strategies, the planner and the tests (docs/design.md, "Sequence layouts").
#pragma once

#include <cstdint>
#include <vector>

#include "cpattn/config.hpp"

namespace cpattn {

// Global positions in rank order (rank 0's tokens, then rank 1's, ...), for S tokens over cp ranks.
// Contiguous: the identity. Dual chunk swap: 2*cp chunks of S/(2cp); rank r holds chunks r and 2cp-1-r.
// cp=2, S=8 -> [0, 1, 6, 7, 2, 3, 4, 5].
std::vector<std::int64_t> dual_chunk_swap_order(std::int64_t seq_len, std::int64_t cp);
std::vector<std::int64_t> layout_order(ShardLayout layout, std::int64_t seq_len, std::int64_t cp);

// inverse[perm[i]] = i.
std::vector<std::int64_t> inverse_permutation(const std::vector<std::int64_t>& perm);

// The global positions of rank `rank`'s local tokens, in its local order (S/cp of them).
std::vector<std::int64_t> local_positions(ShardLayout layout, std::int64_t seq_len, std::int64_t cp,
                                          std::int64_t rank);

// A contiguous run of global positions held by one rank.
struct PositionRange {
  std::int64_t begin = 0, end = 0;
  std::int64_t size() const { return end - begin; }
};
// The runs rank `rank` holds, in local order: one for contiguous, two for dual chunk swap.
std::vector<PositionRange> local_ranges(ShardLayout layout, std::int64_t seq_len, std::int64_t cp,
                                        std::int64_t rank);

// The dual-chunk-swap rule as chunks: both layouts cut S into 2*cp chunks of S/(2cp) tokens and give each
// rank two of them, its local slots 0 and 1. Contiguous: rank r holds chunks 2r, 2r+1; dual chunk swap: r,
// 2cp-1-r.
struct ChunkPlace {
  std::int64_t rank = 0, slot = 0;
  bool operator==(const ChunkPlace&) const = default;
};
std::int64_t chunk_at(ShardLayout layout, std::int64_t cp, std::int64_t rank, std::int64_t slot);
ChunkPlace place_of_chunk(ShardLayout layout, std::int64_t cp, std::int64_t chunk);

// One of the two collective permutes that convert a shard between layouts: the local slot each rank p sends
// (sent_slot[p]), where that chunk lands (goes_to[p]) and the permute's destinations (dest[p] =
// goes_to[p].rank). Each call is a permutation: contiguous -> dual chunk swap groups the chunks by source
// slot (even chunks land on distinct ranks, so do odd ones); the way back groups them by destination slot.
struct ReorderCall {
  std::vector<std::int64_t> sent_slot;
  std::vector<ChunkPlace> goes_to;
  std::vector<int> dest;
};
ReorderCall reorder_call(std::int64_t cp, ShardLayout from, ShardLayout to, std::int64_t call);
// The destinations of the two permutes (empty when from == to).
std::vector<std::vector<int>> reorder_destinations(std::int64_t cp, ShardLayout from, ShardLayout to);

// Token metadata for the masks, [B, S] row-major, the same for every batch row.
// 0..S-1 for each of B rows.
std::vector<std::int32_t> natural_positions(std::int64_t batch, std::int64_t seq_len);
// Segment ids of documents with these lengths (summing to S): document d's tokens get id d.
std::vector<std::int32_t> segment_ids_from_lengths(std::int64_t batch,
                                                   const std::vector<std::int64_t>& lengths);
// positions (one row) -> int32, repeated for each of B rows: [B, n].
std::vector<std::int32_t> positions_as_int32(const std::vector<std::int64_t>& positions,
                                             std::int64_t batch = 1);

// positions[p][t]: the global position of rank p's local token t (the same for every batch row).
using RankPositions = std::vector<std::vector<std::int32_t>>;
RankPositions rank_positions(ShardLayout layout, std::int64_t seq_len, std::int64_t cp);

// The windowed ring's transfers (docs/design.md, "Ring"). With a sliding window a ring rank's queries see
// only the rows near the ends of a few other ranks' runs, so instead of sending every shard round the ring,
// each rank sends each other rank the rows it sees, straight there. Rows are local to one run of a ring
// rank's rows (its `parts` runs of equal length: the whole shard, or the zigzag's two chunks).
struct RowSpan {
  std::int64_t begin = 0, end = 0;
  std::int64_t size() const { return end - begin; }
  bool operator==(const RowSpan&) const = default;
};
// One step of the windowed ring: rank r receives from rank (r - distance) mod R, per run of that rank's
// rows, the hull of the rows some query of rank r sees under the band (seen[r][part]; empty: none).
struct ReachStep {
  std::int64_t distance = 0;
  std::vector<std::vector<RowSpan>> seen;
  // The rows rank r receives at this step, and those rank r sends (what rank r + distance sees of it).
  std::int64_t rows_received(std::int64_t r) const;
  std::int64_t rows_sent(std::int64_t r) const;
  bool operator==(const ReachStep&) const = default;
};
// The steps 1..R-1 (R = positions.size()) at which some rank sees some row of the rank `distance` places
// before it, in order; a step at which no rank sees anything is left out (nothing moves, nothing computes).
// The band alone decides (packed documents do not: the segment ids are data).
std::vector<ReachStep> ring_reach(const RankPositions& positions, std::int64_t parts,
                                  const PositionBand& band);

// The windowed all_gather's keys: the positions some query of a rank (its positions, in `parts` runs) sees
// under the band, widened to whole blocks of `block` positions from 0 (the kernel's kv grid over the natural
// order, so that its tiles over them are the single device's), merged, in order, within [0, seq_len).
std::vector<PositionRange> seen_positions(const std::vector<std::int32_t>& positions, std::int64_t parts,
                                          const PositionBand& band, std::int64_t seq_len, std::int64_t block);
// Every rank's (positions: rank_positions of the layout).
std::vector<std::vector<PositionRange>> seen_positions(const RankPositions& positions, std::int64_t parts,
                                                       const PositionBand& band, std::int64_t seq_len,
                                                       std::int64_t block);
// Whether position x is in sorted, disjoint ranges; how many positions two lists of disjoint ranges share
// (a rank's runs, local_ranges, against another's seen ranges: the rows it sends that rank).
bool in_ranges(const std::vector<PositionRange>& ranges, std::int64_t x);
std::int64_t overlap(const std::vector<PositionRange>& a, const std::vector<PositionRange>& b);

}  // namespace cpattn
