// Sequence layouts: which global token positions each rank holds, in the order it holds them, the token
// metadata the kernels' masks read (positions, segment ids), and the reorder between layouts. One source of
// truth for the strategies, the planner and the tests (docs/design.md, "Sequence layouts").
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cpattn/config.hpp"

namespace cpattn {

// Global positions in rank order (rank 0's tokens, then rank 1's, ...), for S tokens over cp ranks.
// Contiguous: the identity. Dual chunk swap: 2*cp chunks of S/(2cp); rank r holds chunks r and 2cp-1-r.
// cp=2, S=8 -> [0, 1, 6, 7, 2, 3, 4, 5].
std::vector<std::int64_t> dual_chunk_swap_order(std::int64_t seq_len, std::int64_t cp);
std::vector<std::int64_t> layout_order(ShardLayout layout, std::int64_t seq_len, std::int64_t cp);

// A contiguous run of global positions held by one rank.
struct PositionRange {
  std::int64_t begin = 0, end = 0;
  std::int64_t size() const { return end - begin; }
  bool operator==(const PositionRange&) const = default;
};

// A layout as data: the runs of consecutive global positions each rank holds, in its local order. Every
// rank holds seq_len / cp tokens and every position is held once (layout_errors says where not). The named
// layouts (config.hpp, ShardLayout):
//   contiguous       rank r holds [r S/cp, (r+1) S/cp): one run.
//   dual_chunk_swap  2 cp chunks of S/(2cp); rank r holds chunks r and 2cp-1-r, two runs (kept apart where
//   they
//                    touch, so that each is a kernel grid of its own as it always was).
//   per_document     each document cut into 2 cp pieces, rank r taking pieces r and 2cp-1-r of every one: the
//                    dual chunk swap of each document. A document's 2cp pieces differ by a token or two and
//                    rank r's share of document d is floor((F_{d+1} + r)/cp) - floor((F_d + r)/cp) tokens
//                    (F_d: the tokens before d), which gives every rank S/cp tokens in all with no padding,
//                    whatever the lengths (documents shorter than 2cp tokens leave some pieces empty).
//   solver           the row cut into chunks of solver_chunk(S, cp) tokens, each costed by the tiles its
//                    queries compute under the mask (solver_chunk_costs), dealt greedily: the costliest chunk
//                    first, to the least-loaded rank that still has room (S/cp tokens each); among ranks
//                    equally loaded, one that holds a neighbouring chunk (so a document's chunks stay
//                    together where that costs nothing).
// Adjacent runs are merged (but dual_chunk_swap's two), runs are in increasing position within a rank for
// per_document and solver.
struct SequenceLayout {
  ShardLayout kind = ShardLayout::contiguous;
  std::int64_t seq_len = 0;
  std::vector<std::vector<PositionRange>> runs;  // [rank][run]

  std::int64_t ranks() const { return static_cast<std::int64_t>(runs.size()); }
  // Rank r's positions in local order, and every rank's (int32, as the masks take them).
  std::vector<std::int64_t> positions(std::int64_t rank) const;
  std::vector<std::vector<std::int32_t>> rank_positions() const;
  // The lengths of rank r's runs, in local order; every rank's.
  std::vector<std::int64_t> run_lengths(std::int64_t rank) const;
  std::vector<std::vector<std::int64_t>> rank_run_lengths() const;
  // Every rank's positions, rank 0's first.
  std::vector<std::int64_t> order() const;
  bool operator==(const SequenceLayout&) const = default;
};

// The layout `kind` of a row of seq_len tokens over cp ranks; documents: the row's document lengths (sum
// seq_len; empty: one document), which per_document cuts and solver costs; band: the positions a query sees
// (solver's costs). The same arguments give the same layout on every rank.
SequenceLayout make_layout(ShardLayout kind, std::int64_t seq_len, std::int64_t cp,
                           const std::vector<std::int64_t>& documents = {}, const PositionBand& band = {});
// The caller's layout (ParallelSpec::effective_layout over cp ranks, with ParallelSpec::documents and the
// attention's band).
SequenceLayout layout_of(const AttentionSpec& attention, const ParallelSpec& parallel);
// The ring's rows (ring, hybrid) over the ring's R ranks: the caller's layout for the ring; for the hybrid,
// ring rank rr holds its ulysses group's tokens: the ring-level zigzag with dual_chunk_swap (the hybrid
// places them so), else the group's members' runs one after another (a ring of one rank too: U = cp). A ring
// of one rank in the contiguous and dual chunk swap layouts holds the whole row in natural order.
SequenceLayout ring_layout_of(const AttentionSpec& attention, const ParallelSpec& parallel);

// What is wrong with a layout (empty: nothing): a position held twice or by no rank, a run outside the row
// or empty, ranks holding different numbers of tokens.
std::vector<std::string> layout_errors(const SequenceLayout& layout);

// The tiles each chunk of `chunk` positions (in natural order) computes against the whole row, counted on a
// grid of g = gcd(chunk, 64) positions (the kernel's default block where the chunk is a multiple of it): for
// each of the chunk's query blocks, the key blocks whose document and position ranges some query of it
// sees (the kernel's tile classification over the natural row). The backward computes the same tiles, so
// one cost serves forward and backward.
std::vector<std::int64_t> solver_chunk_costs(std::int64_t seq_len, std::int64_t chunk,
                                             const std::vector<std::int64_t>& documents,
                                             const PositionBand& band);

// inverse[perm[i]] = i.
std::vector<std::int64_t> inverse_permutation(const std::vector<std::int64_t>& perm);

// The global positions of rank `rank`'s local tokens, in its local order (S/cp of them).
std::vector<std::int64_t> local_positions(ShardLayout layout, std::int64_t seq_len, std::int64_t cp,
                                          std::int64_t rank);

// The runs rank `rank` holds, in local order: one for contiguous, two for dual chunk swap. These helpers, and
// local_positions, layout_order and rank_positions by a layout's name, take those two; the layouts cut by
// documents (per_document, solver) are an Error(invalid_input) pointing to make_layout.
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
// The document lengths of one row's segment ids: the runs of equal consecutive ids (empty for no ids).
std::vector<std::int64_t> document_lengths(const std::vector<std::int32_t>& row_segment_ids);
// positions (one row) -> int32, repeated for each of B rows: [B, n].
std::vector<std::int32_t> positions_as_int32(const std::vector<std::int64_t>& positions,
                                             std::int64_t batch = 1);

// positions[p][t]: the global position of rank p's local token t (the same for every batch row).
using RankPositions = std::vector<std::vector<std::int32_t>>;
// runs[p]: the lengths of rank p's runs of consecutive positions, in local order (SequenceLayout's).
using RankRuns = std::vector<std::vector<std::int64_t>>;
RankPositions rank_positions(ShardLayout layout, std::int64_t seq_len, std::int64_t cp);

// The direct ring's transfers (docs/design.md, "Ring"). With a sliding window a ring rank's queries see
// only the rows near the ends of a few other ranks' runs, on a packed row only their own documents' rows, so
// instead of sending every shard round the ring, each rank sends each other rank the rows it sees, straight
// there. Rows are local to one run of a ring
// rank's rows (its layout's runs: the whole shard, the zigzag's two chunks, a document's pieces).
struct RowSpan {
  std::int64_t begin = 0, end = 0;
  std::int64_t size() const { return end - begin; }
  bool operator==(const RowSpan&) const = default;
};
// One step of the direct ring: rank r receives from rank (r - distance) mod R, per run of that rank's
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
// The band decides, and on packed rows (`segments` [batch, S] in natural order, S the positions' total, the
// same on every rank: the ring gathers them first) the documents too: a row is seen when some query of the
// rank in the row's document, in some batch row, sees it under the band; each run's span is the hull of the
// rows seen.
std::vector<ReachStep> ring_reach(const RankPositions& positions, const RankRuns& runs,
                                  const PositionBand& band, const std::vector<std::int32_t>& segments = {});

// How a ring moves K/V: round the ring (every shard passed one hop per step, the dK/dV accumulator with it),
// or `direct`: only the steps of ring_reach, each rank's rows straight to the ranks that see them and their
// dK/dV straight back. Direct with a window, and on packed rows where some rank does not see some row of
// another (under the band and the documents; where it sees every one, the relay moves the same bytes in
// fewer, larger messages). A packed row without a window whose route would hold more than kMostRouteSpans
// spans ((R - 1) x the ranks' runs) or compare more than kMostRunPairs pairs of runs goes round the ring: the
// same results, every row moved, so that a route (worked out by every rank, once per forward, and by the
// planner per entry) stays small and quick at many ranks and runs.
inline constexpr std::int64_t kMostRouteSpans = std::int64_t{1} << 20;
inline constexpr std::int64_t kMostRunPairs = std::int64_t{1} << 26;
struct RingRoute {
  bool direct = false;
  std::vector<ReachStep> steps;  // direct: ring_reach's; empty otherwise
  bool operator==(const RingRoute&) const = default;
};
RingRoute ring_route(const RankPositions& positions, const RankRuns& runs, const PositionBand& band,
                     bool windowed, const std::vector<std::int32_t>& segments);

// The windowed all_gather's keys: the positions some query of a rank (its positions, in runs of these
// lengths) sees
// under the band, widened to whole blocks of `block` positions from 0 (the kernel's kv grid over the natural
// order, so that its tiles over them are the single device's), merged, in order, within [0, seq_len).
std::vector<PositionRange> seen_positions(const std::vector<std::int32_t>& positions,
                                          const std::vector<std::int64_t>& runs, const PositionBand& band,
                                          std::int64_t seq_len, std::int64_t block);
// Every rank's (positions: rank_positions of the layout).
std::vector<std::vector<PositionRange>> seen_positions(const RankPositions& positions, const RankRuns& runs,
                                                       const PositionBand& band, std::int64_t seq_len,
                                                       std::int64_t block);
// The all_gather's keys: every rank's seen ranges, in aligned pairs of blocks of `block` positions from 0
// (the bf16 kernels step over the kv blocks two at a time: a pair cut apart would round otherwise): with a
// window seen_positions' blocks; on packed rows (`segments` [batch, seq_len] in natural order, the same on
// every rank) only the pairs holding a key of a document the rank has a query of, within that document's
// queries' reach (the lowest less the band's left side, the highest plus its right), in any batch row. Empty
// where the whole row moves to every rank: no window, and every rank sees every pair.
std::vector<std::vector<PositionRange>> all_gather_keys(const RankPositions& positions, const RankRuns& runs,
                                                        std::int64_t seq_len, const PositionBand& band,
                                                        bool windowed, std::int64_t block,
                                                        const std::vector<std::int32_t>& segments);
// Whether position x is in sorted, disjoint ranges; how many positions two lists of disjoint ranges share
// (a rank's runs, local_ranges, against another's seen ranges: the rows it sends that rank). Both lists in
// increasing order (every layout's runs and seen_positions' are).
bool in_ranges(const std::vector<PositionRange>& ranges, std::int64_t x);
std::int64_t overlap(const std::vector<PositionRange>& a, const std::vector<PositionRange>& b);

}  // namespace cpattn
