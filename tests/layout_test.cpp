#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <string>

#include "cpattn/placement.hpp"
#include "cpattn/sequence_layout.hpp"

namespace cpattn {
namespace {

using V = std::vector<std::int64_t>;

TEST(Placement, ReplicationIsTheMostRanksSharingAKvHead) {
  EXPECT_EQ(ulysses_heads(32, 2, 4).replication(), 2);
  EXPECT_EQ(ulysses_heads(32, 2, 8).replication(), 4);
  EXPECT_EQ(ulysses_heads(8, 1, 8).replication(), 8);
  EXPECT_EQ(ulysses_heads(32, 8, 4).replication(), 1);
  EXPECT_EQ(ulysses_heads(32, 4, 4).replication(), 1);
  EXPECT_EQ(ulysses_heads(24, 3, 4).replication(), 2);
  EXPECT_EQ(ulysses_heads(32, 2, 4).kv_head_order(), grouped_repeat_heads(2, 2));
  EXPECT_EQ(ulysses_heads(32, 2, 8).kv_head_order(), grouped_repeat_heads(2, 4));
}

// docs/design.md's example: Hq = 24, Hkv = 3, U = 4 (G = 8).
TEST(Placement, AnyHeadCountsTheDesignExample) {
  const UlyssesHeads u = ulysses_heads(24, 3, 4);
  EXPECT_EQ(u.q, (std::vector<HeadRange>{{0, 6}, {6, 12}, {12, 18}, {18, 24}}));
  EXPECT_EQ(u.kv, (std::vector<HeadRange>{{0, 1}, {0, 2}, {1, 3}, {2, 3}}));
  EXPECT_EQ(u.kv_head_order(), (V{0, 0, 1, 1, 2, 2}));
  EXPECT_DOUBLE_EQ(u.work_skew(), 1.0);
  // Qwen2.5-7B at cp = 8: 28 q heads as 4,4,4,4,3,3,3,3.
  const UlyssesHeads q7 = ulysses_heads(28, 4, 8);
  EXPECT_EQ(q7.q[3], (HeadRange{12, 16}));
  EXPECT_EQ(q7.q[4], (HeadRange{16, 19}));
  EXPECT_EQ(q7.max_q_heads(), 4);
  EXPECT_DOUBLE_EQ(q7.work_skew(), 4.0 / 3.0);
}

// Every (Hq, Hkv, U) in a range: the q ranges tile [0, Hq) in order with sizes floor(Hq/U) or one more (the
// larger first), and each rank's kv set is exactly the kv heads its q heads read.
TEST(Placement, AnyHeadCountsEveryRankReadsExactlyItsKvSet) {
  for (std::int64_t hq = 1; hq <= 40; ++hq) {
    for (std::int64_t hkv = 1; hkv <= hq; ++hkv) {
      if (hq % hkv != 0) continue;
      for (std::int64_t ranks = 1; ranks <= hq; ++ranks) {
        const UlyssesHeads u = ulysses_heads(hq, hkv, ranks);
        ASSERT_EQ(static_cast<std::int64_t>(u.q.size()), ranks);
        std::int64_t next = 0;
        for (std::int64_t r = 0; r < ranks; ++r) {
          const std::string at = std::to_string(hq) + "," + std::to_string(hkv) + "," +
                                 std::to_string(ranks) + " rank " + std::to_string(r);
          EXPECT_EQ(u.q[r].begin, next) << at;
          EXPECT_EQ(u.q[r].size(), hq / ranks + (r < hq % ranks ? 1 : 0)) << at;
          next = u.q[r].end;
          std::int64_t lo = hkv, hi = -1;
          for (std::int64_t h = u.q[r].begin; h < u.q[r].end; ++h) {
            lo = std::min(lo, kv_head_of_q_head(h, hq, hkv));
            hi = std::max(hi, kv_head_of_q_head(h, hq, hkv));
          }
          EXPECT_EQ(u.kv[r], (HeadRange{lo, hi + 1})) << at;
        }
        EXPECT_EQ(next, hq);
      }
    }
  }
}

TEST(Placement, GroupedOrderIsTheSeedsAndTiledDiffers) {
  EXPECT_EQ(grouped_repeat_heads(2, 2), (V{0, 0, 1, 1}));
  EXPECT_EQ(grouped_repeat_heads(2, 4), (V{0, 0, 0, 0, 1, 1, 1, 1}));
  EXPECT_EQ(tiled_repeat_heads(2, 2), (V{0, 1, 0, 1}));
  EXPECT_EQ(tiled_repeat_heads(2, 4), (V{0, 1, 0, 1, 0, 1, 0, 1}));
  // With one kv head both orders agree, so a tiled-order negative control needs Hkv >= 2.
  EXPECT_EQ(grouped_repeat_heads(1, 4), tiled_repeat_heads(1, 4));
}

AttentionSpec qwen() {
  AttentionSpec a;
  a.seq_len = 65536;
  a.num_q_heads = 32;
  a.num_kv_heads = 2;
  a.head_dim = 256;
  return a;
}

TEST(Placement, SeedPairingAtCp4AndCp8) {
  for (std::int64_t cp : {4, 8}) {
    ParallelSpec p;
    p.cp = cp;
    p.strategy = Strategy::ulysses;
    const auto ranks = head_placement(qwen(), p);
    ASSERT_EQ(static_cast<std::int64_t>(ranks.size()), cp);
    const std::int64_t per = 32 / cp, rep = cp / 2;
    for (std::int64_t r = 0; r < cp; ++r) {
      EXPECT_EQ(ranks[r].q_heads, (HeadRange{per * r, per * r + per})) << "cp " << cp << " rank " << r;
      EXPECT_EQ(ranks[r].kv_heads, (V{r / rep})) << "cp " << cp << " rank " << r;
      // Every q head on the rank reads exactly the kv head the rank holds.
      for (std::int64_t h = ranks[r].q_heads.begin; h < ranks[r].q_heads.end; ++h) {
        EXPECT_EQ(kv_head_of_q_head(h, 32, 2), ranks[r].kv_heads[0]);
      }
    }
  }
}

TEST(Placement, TiledOrderWouldPairRankOneWithTheWrongHead) {
  // cp=4: rank 1 holds q heads 8..15, which read kv head 0; the tiled list puts kv head 1 in slot 1.
  const V tiled = tiled_repeat_heads(2, 2);
  EXPECT_EQ(kv_head_of_q_head(8, 32, 2), 0);
  EXPECT_EQ(tiled[1], 1);
}

TEST(Placement, NoReplicationWhenKvHeadsAtLeastCp) {
  AttentionSpec a = qwen();
  a.num_kv_heads = 8;
  ParallelSpec p;
  p.cp = 4;
  p.strategy = Strategy::ulysses;
  const auto ranks = head_placement(a, p);
  EXPECT_EQ(ranks[1].q_heads, (HeadRange{8, 16}));
  EXPECT_EQ(ranks[1].kv_heads, (V{2, 3}));
  EXPECT_EQ(ranks[1].kv_slots, (HeadRange{2, 4}));
}

TEST(Placement, AllGatherRanksHoldEveryHead) {
  ParallelSpec p;
  p.cp = 4;
  const auto ranks = head_placement(qwen(), p);
  for (const auto& r : ranks) {
    EXPECT_EQ(r.q_heads, (HeadRange{0, 32}));
    EXPECT_EQ(r.kv_heads, (V{0, 1}));
  }
}

TEST(Placement, TensorParallelUsesLocalHeads) {
  AttentionSpec a = qwen();
  a.num_kv_heads = 4;
  ParallelSpec p;
  p.cp = 4;
  p.tp = 2;
  p.strategy = Strategy::ulysses;
  const auto ranks = head_placement(a, p);  // local: 16 q heads, 2 kv heads, rep 2
  EXPECT_EQ(ranks[3].q_heads, (HeadRange{12, 16}));
  EXPECT_EQ(ranks[3].kv_heads, (V{1}));
  a.num_q_heads = 28;  // local: 14 q heads on 2 kv heads over 4 ranks: 4, 4, 3, 3
  const auto uneven = head_placement(a, p);
  EXPECT_EQ(uneven[1].q_heads, (HeadRange{4, 8}));
  EXPECT_EQ(uneven[1].kv_heads, (V{0, 1}));
  EXPECT_EQ(uneven[1].kv_slots, (HeadRange{1, 3}));
  EXPECT_EQ(uneven[3].q_heads, (HeadRange{11, 14}));
  EXPECT_EQ(uneven[3].kv_heads, (V{1}));
}

TEST(SequenceLayout, DualChunkSwapAtCp2On8Tokens) {
  EXPECT_EQ(dual_chunk_swap_order(8, 2), (V{0, 1, 6, 7, 2, 3, 4, 5}));
  EXPECT_EQ(local_positions(ShardLayout::dual_chunk_swap, 8, 2, 0), (V{0, 1, 6, 7}));
  EXPECT_EQ(local_positions(ShardLayout::dual_chunk_swap, 8, 2, 1), (V{2, 3, 4, 5}));
  EXPECT_EQ(local_positions(ShardLayout::contiguous, 8, 2, 1), (V{4, 5, 6, 7}));
}

TEST(SequenceLayout, EveryPermutationRoundTrips) {
  for (std::int64_t cp : {1, 2, 3, 4, 8}) {
    for (std::int64_t s : {2 * cp, 6 * cp, 64 * cp}) {
      for (ShardLayout layout : {ShardLayout::contiguous, ShardLayout::dual_chunk_swap}) {
        const V order = layout_order(layout, s, cp);
        const V inverse = inverse_permutation(order);
        V sorted = order;
        std::sort(sorted.begin(), sorted.end());
        V iota(static_cast<std::size_t>(s));
        std::iota(iota.begin(), iota.end(), 0);
        EXPECT_EQ(sorted, iota) << "a permutation of 0..S-1";
        for (std::int64_t i = 0; i < s; ++i) {
          EXPECT_EQ(order[inverse[i]], i);
          EXPECT_EQ(inverse[order[i]], i);
        }
      }
    }
  }
  EXPECT_THROW(inverse_permutation({0, 0, 1}), Error);
}

// The ring's direct steps, against a brute force over every (query, key) pair: the span a rank receives is
// the hull of the source's rows some query of it sees, and a step is left out exactly when no rank sees
// anything at that distance. Causal and not, windows short and long, every layout (per_document and solver
// on a row of three documents); and on packed rows, a key seen only by the queries of its own document (in
// some batch row): the three documents, ids that come back to an earlier document, two batch rows.
TEST(RingReach, SpansAreTheHullOfWhatSomeQuerySees) {
  for (const ShardLayout layout : {ShardLayout::contiguous, ShardLayout::dual_chunk_swap,
                                   ShardLayout::per_document, ShardLayout::solver}) {
    for (const std::int64_t ranks : {2, 3, 4, 8}) {
      const std::int64_t seq = 96 * ranks;
      const V docs{seq / 2 - 5, 13, seq / 2 - 8};
      const SequenceLayout l = make_layout(layout, seq, ranks, docs, {kUnboundedWindow, 0});
      const RankPositions positions = l.rank_positions();
      const RankRuns runs = l.rank_run_lengths();
      // Segment ids: none; the three documents; 0, 1, 0 in thirds (document 0 comes back); two batch rows,
      // the three documents and the halves.
      std::vector<std::int32_t> back(static_cast<std::size_t>(seq), 0);
      std::fill(back.begin() + seq / 3, back.begin() + 2 * seq / 3, 1);
      std::vector<std::int32_t> two_rows = segment_ids_from_lengths(1, docs);
      for (std::int64_t t = 0; t < seq; ++t) two_rows.push_back(t < seq / 2 ? 0 : 1);
      const std::vector<std::int32_t> packs[] = {{}, segment_ids_from_lengths(1, docs), back, two_rows};
      for (int k = 0; k < 4; ++k) {
        const std::vector<std::int32_t>& seg = packs[k];
        const auto rows = static_cast<std::int64_t>(seg.size()) / seq;
        const auto same_document = [&](std::int64_t q, std::int64_t x) {
          for (std::int64_t b = 0; b < rows; ++b) {
            if (seg[static_cast<std::size_t>(b * seq + q)] == seg[static_cast<std::size_t>(b * seq + x)]) {
              return true;
            }
          }
          return seg.empty();
        };
        for (const PositionBand band :
             {PositionBand{0, 0}, PositionBand{7, 0}, PositionBand{47, 0}, PositionBand{48, 0},
              PositionBand{200, 0}, PositionBand{kUnboundedWindow, 0}, PositionBand{5, 9},
              PositionBand{0, 100}, PositionBand{60, 60}, PositionBand{kUnboundedWindow, kUnboundedWindow}}) {
          if (k > 0 && band.left < 48 && band.right == 0 && band.left > 0)
            continue;  // short: covered by none
          SCOPED_TRACE(std::to_string(static_cast<int>(layout)) + " R " + std::to_string(ranks) + " band " +
                       std::to_string(band.left) + "," + std::to_string(band.right) + " ids " +
                       std::to_string(k));
          const std::vector<ReachStep> steps = ring_reach(positions, runs, band, seg);
          std::size_t next = 0;
          for (std::int64_t d = 1; d < ranks; ++d) {
            std::vector<std::vector<RowSpan>> want;
            bool any = false;
            for (std::int64_t r = 0; r < ranks; ++r) {
              const std::size_t from = static_cast<std::size_t>((r - d + ranks) % ranks);
              const auto& src = positions[from];
              want.emplace_back();
              std::int64_t first = 0;
              for (const std::int64_t n : runs[from]) {
                std::int64_t lo = n, hi = 0;
                for (std::int64_t t = 0; t < n; ++t) {
                  for (const std::int32_t qp : positions[static_cast<std::size_t>(r)]) {
                    const std::int32_t kp = src[static_cast<std::size_t>(first + t)];
                    if (band.sees(qp, kp) && same_document(qp, kp)) {
                      lo = std::min(lo, t);
                      hi = std::max(hi, t + 1);
                    }
                  }
                }
                want.back().push_back(lo < hi ? RowSpan{lo, hi} : RowSpan{});
                any = any || lo < hi;
                first += n;
              }
            }
            if (!any) continue;
            ASSERT_LT(next, steps.size()) << "distance " << d;
            EXPECT_EQ(steps[next].distance, d);
            EXPECT_EQ(steps[next].seen, want) << "distance " << d;
            for (std::int64_t r = 0; r < ranks; ++r) {
              EXPECT_EQ(steps[next].rows_sent(r), steps[next].rows_received((r + d) % ranks));
            }
            ++next;
          }
          EXPECT_EQ(next, steps.size());
        }
      }
    }
  }
}

// A packed row without a window whose route would be too large goes round the ring: per_document at cp 64
// holds two runs per rank and document but where adjacent pieces merge: 80 documents 10081 runs (past the
// 8192 that kMostRunPairs allows), 40 documents 5041.
TEST(RingReach, APackedRouteOfTooManyRunsGoesRoundTheRing) {
  for (const std::int64_t docs : {40, 80}) {
    const std::int64_t seq = docs * 1024;
    const V lengths(static_cast<std::size_t>(docs), 1024);
    const SequenceLayout l = make_layout(ShardLayout::per_document, seq, 64, lengths, {kUnboundedWindow, 0});
    std::int64_t runs = 0;
    for (const auto& r : l.rank_run_lengths()) runs += static_cast<std::int64_t>(r.size());
    EXPECT_EQ(runs, 2 * 64 * docs - (2 * docs - 1)) << "adjacent pieces merge";
    const RingRoute route = ring_route(l.rank_positions(), l.rank_run_lengths(), {kUnboundedWindow, 0}, false,
                                       segment_ids_from_lengths(1, lengths));
    EXPECT_EQ(route.direct, runs * runs <= kMostRunPairs) << docs << " documents";
    EXPECT_EQ(route.steps.empty(), !route.direct);
  }
}

// A window shorter than a chunk: the contiguous ring's one step (rank r - 1's last w rows), the zigzag's two
// (its first chunk's predecessor on rank r - 1, its second's on rank r + 1).
TEST(RingReach, AShortWindowReachesTheNeighboursTails) {
  const PositionBand w{15, 0};
  const RankRuns one(4, V{64}), two(4, V{32, 32});
  const auto contiguous = ring_reach(rank_positions(ShardLayout::contiguous, 256, 4), one, w);
  ASSERT_EQ(contiguous.size(), 1u);
  EXPECT_EQ(contiguous[0].distance, 1);
  EXPECT_EQ(contiguous[0].seen,
            (std::vector<std::vector<RowSpan>>{{{}}, {{49, 64}}, {{49, 64}}, {{49, 64}}}));
  const auto zigzag = ring_reach(rank_positions(ShardLayout::dual_chunk_swap, 256, 4), two, w);
  ASSERT_EQ(zigzag.size(), 2u);
  EXPECT_EQ(zigzag[0].distance, 1);
  EXPECT_EQ(zigzag[1].distance, 3);
  // Rank 0 holds chunks 0 and 7 (of 32 rows); rank 1 chunks 1 and 6, ... Chunk 1 sees the tail of chunk 0
  // (rank 0's first run); chunk 7 the tail of chunk 6 (rank 1's second run), three places on round the ring.
  EXPECT_EQ(zigzag[0].seen[1], (std::vector<RowSpan>{{17, 32}, {}}));
  EXPECT_EQ(zigzag[1].seen[0], (std::vector<RowSpan>{{}, {17, 32}}));
}

}  // namespace
}  // namespace cpattn
