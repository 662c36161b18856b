// The layouts as data (sequence_layout.hpp, SequenceLayout): each holds every position once and gives every
// rank S/cp tokens; per_document is each document's dual chunk swap; the solver's costs are the kernel's
// tiles; layout_errors catches what a broken layout does; and the balance each layout gives packed rows.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>

#include "cpattn/sequence_layout.hpp"
#include "kernels/tile_classification.hpp"

namespace cpattn {
namespace {

using V = std::vector<std::int64_t>;
constexpr ShardLayout kLayouts[] = {ShardLayout::contiguous, ShardLayout::dual_chunk_swap,
                                    ShardLayout::per_document, ShardLayout::solver};

// Document lengths summing to `seq`: drawn log-normal (median `median` tokens, sigma 1.2) with at least
// `shortest` tokens each, the last one cut to fit (and at least `shortest` where the row allows: it joins
// the one before it otherwise).
V pack(std::mt19937& rng, std::int64_t seq, double median, std::int64_t shortest) {
  std::lognormal_distribution<double> length(std::log(median), 1.2);
  V docs;
  std::int64_t left = seq;
  while (left > 0) {
    std::int64_t n = std::max<std::int64_t>(shortest, static_cast<std::int64_t>(length(rng)));
    n = std::min(n, left);
    if (left - n < shortest && left - n > 0) n = left;
    docs.push_back(n);
    left -= n;
  }
  if (docs.back() < shortest && docs.size() > 1) {
    docs[docs.size() - 2] += docs.back();
    docs.pop_back();
  }
  return docs;
}

TEST(Layouts, EveryLayoutHoldsEachPositionOnceAndGivesEveryRankItsShare) {
  std::mt19937 rng(7);
  for (const std::int64_t cp : {1, 2, 3, 4, 5, 8, 16}) {
    for (const std::int64_t per_rank : {2, 6, 64, 250}) {
      const std::int64_t seq = cp * per_rank;
      const std::vector<V> packs = {{}, {seq}, {1, seq - 1}, pack(rng, seq, 20, 1), pack(rng, seq, 3, 1)};
      for (const ShardLayout kind : kLayouts) {
        if (seq % layout_chunks(kind, cp) != 0) continue;
        for (const V& docs : packs) {
          for (const PositionBand band :
               {PositionBand{kUnboundedWindow, 0}, PositionBand{}, PositionBand{5, 0}}) {
            const SequenceLayout l = make_layout(kind, seq, cp, docs, band);
            SCOPED_TRACE(std::string(to_string(kind)) + " cp " + std::to_string(cp) + " S " +
                         std::to_string(seq) + " documents " + std::to_string(docs.size()));
            EXPECT_EQ(layout_errors(l), std::vector<std::string>{});
            ASSERT_EQ(l.ranks(), cp);
            for (std::int64_t r = 0; r < cp; ++r) {
              EXPECT_EQ(static_cast<std::int64_t>(l.positions(r).size()), per_rank);
              for (const PositionRange& run : l.runs[static_cast<std::size_t>(r)]) EXPECT_GT(run.size(), 0);
            }
            EXPECT_EQ(make_layout(kind, seq, cp, docs, band), l) << "the same arguments, the same layout";
          }
        }
      }
    }
  }
}

// The named layouts of the enum keep their rules: contiguous one run, dual chunk swap the chunks r and
// 2cp-1-r as two runs (even where they touch).
TEST(Layouts, ContiguousAndDualChunkSwapAreTheirRules) {
  const SequenceLayout c = make_layout(ShardLayout::contiguous, 12, 3);
  EXPECT_EQ(c.runs, (std::vector<std::vector<PositionRange>>{{{0, 4}}, {{4, 8}}, {{8, 12}}}));
  const SequenceLayout d = make_layout(ShardLayout::dual_chunk_swap, 12, 3);
  EXPECT_EQ(d.runs, (std::vector<std::vector<PositionRange>>{
                        {{0, 2}, {10, 12}}, {{2, 4}, {8, 10}}, {{4, 6}, {6, 8}}}));
  EXPECT_EQ(d.rank_run_lengths(), (std::vector<V>{{2, 2}, {2, 2}, {2, 2}}));
  EXPECT_EQ(d.order(), layout_order(ShardLayout::dual_chunk_swap, 12, 3));
}

// Within each document rank r holds pieces r and 2cp-1-r: walking the document in order, the ranks that hold
// its tokens are 0, 1, ..., cp-1, cp-1, ..., 0 (empty pieces skipped), rank r's share of it is floor or ceil
// of its length over cp.
TEST(Layouts, PerDocumentIsEachDocumentsDualChunkSwap) {
  std::mt19937 rng(11);
  for (const std::int64_t cp : {2, 3, 4, 8}) {
    for (int trial = 0; trial < 5; ++trial) {
      const std::int64_t seq = cp * 120;
      const V docs = pack(rng, seq, trial < 2 ? 7.0 : 60.0, 1);
      const SequenceLayout l = make_layout(ShardLayout::per_document, seq, cp, docs);
      std::vector<std::int64_t> owner(static_cast<std::size_t>(seq), -1);
      for (std::int64_t r = 0; r < cp; ++r) {
        for (const std::int64_t p : l.positions(r)) owner[static_cast<std::size_t>(p)] = r;
      }
      std::int64_t start = 0;
      for (const std::int64_t n : docs) {
        V walk;  // the ranks in order of position, one entry per piece
        std::vector<V> pieces(static_cast<std::size_t>(cp));
        for (std::int64_t p = start; p < start + n; ++p) {
          const std::int64_t r = owner[static_cast<std::size_t>(p)];
          if (p == start || owner[static_cast<std::size_t>(p - 1)] != r) {
            walk.push_back(r);
            pieces[static_cast<std::size_t>(r)].push_back(0);
          }
          ++pieces[static_cast<std::size_t>(r)].back();
        }
        V want;  // 0..cp-1, cp-1..0: the one rank whose two pieces touch (cp - 1) is one entry
        for (std::int64_t r = 0; r < cp; ++r) want.push_back(r);
        for (std::int64_t r = cp - 2; r >= 0; --r) want.push_back(r);
        // walk is want with the empty pieces' ranks left out
        std::size_t at = 0;
        for (const std::int64_t r : walk) {
          while (at < want.size() && want[at] != r) ++at;
          ASSERT_LT(at, want.size()) << "document at " << start << " of length " << n;
          ++at;
        }
        for (std::int64_t r = 0; r < cp; ++r) {
          std::int64_t share = 0;
          for (const std::int64_t x : pieces[static_cast<std::size_t>(r)]) share += x;
          EXPECT_GE(share, n / cp);
          EXPECT_LE(share, (n + cp - 1) / cp);
        }
        start += n;
      }
    }
  }
}

// The solver's chunk costs against the kernel's own classification: each chunk's query blocks (a grid of
// gcd(chunk, 64)) against the row's key blocks, counted by count_nonempty_tiles, causal and not, windowed,
// packed or not.
TEST(Layouts, SolverChunkCostsAreTheKernelsTiles) {
  std::mt19937 rng(3);
  for (const std::int64_t seq : {4096, 3 * 1024, 96 * 5}) {
    for (const std::int64_t cp : {2, 4, 5}) {
      if (seq % cp != 0) continue;
      const std::int64_t chunk = solver_chunk(seq, cp);
      const std::int64_t g = std::gcd(chunk, std::int64_t{64});
      for (const V& docs : {V{}, pack(rng, seq, 300, 1), pack(rng, seq, 40, 1)}) {
        const std::vector<std::int32_t> pos = natural_positions(1, seq);
        const std::vector<std::int32_t> seg =
            docs.empty() ? std::vector<std::int32_t>{} : segment_ids_from_lengths(1, docs);
        const auto kv = kernels::block_meta(pos, seg, 0, seq, g);
        for (const PositionBand band : {PositionBand{kUnboundedWindow, 0}, PositionBand{},
                                        PositionBand{100, 0}, PositionBand{63, 0}, PositionBand{30, 200}}) {
          const V costs = solver_chunk_costs(seq, chunk, docs, band);
          ASSERT_EQ(static_cast<std::int64_t>(costs.size()), seq / chunk);
          for (std::int64_t c = 0; c < seq / chunk; ++c) {
            const auto q = kernels::block_meta(pos, seg, c * chunk, chunk, g);
            EXPECT_EQ(costs[static_cast<std::size_t>(c)],
                      kernels::count_nonempty_tiles(q, kv, band, !seg.empty()))
                << "S " << seq << " chunk " << c << " band " << band.left << "," << band.right;
          }
        }
      }
    }
  }
  EXPECT_EQ(solver_chunk(131072, 8), 512);
  EXPECT_EQ(solver_chunk(16384, 4), 256);
  EXPECT_EQ(solver_chunk(4095 * 4, 4), 195);
  EXPECT_EQ(solver_chunk(8, 8), 1);
}

// The controls: a run given to two ranks, a run dropped, ranks of unequal shares and a run out of the row
// are each caught.
TEST(Layouts, LayoutErrorsCatchAChunkTwiceADroppedChunkAndUnevenRanks) {
  const SequenceLayout good = make_layout(ShardLayout::solver, 1024, 4, {500, 24, 500});
  ASSERT_TRUE(layout_errors(good).empty());
  SequenceLayout twice = good;
  twice.runs[1].push_back(twice.runs[0].front());
  ASSERT_FALSE(layout_errors(twice).empty());
  EXPECT_NE(layout_errors(twice).front().find("held by rank 0 and rank 1"), std::string::npos)
      << layout_errors(twice).front();
  SequenceLayout dropped = good;
  dropped.runs[2].pop_back();
  const auto e = layout_errors(dropped);
  ASSERT_FALSE(e.empty());
  EXPECT_NE(e.back().find("held by no rank"), std::string::npos) << e.back();
  EXPECT_NE(e.front().find("rank 2 holds"), std::string::npos) << e.front();
  SequenceLayout outside = good;
  outside.runs[3].back().end = 1025;
  EXPECT_FALSE(layout_errors(outside).empty());
  SequenceLayout swapped = make_layout(ShardLayout::per_document, 1024, 4, {500, 24, 500});
  std::swap(swapped.runs[0][0], swapped.runs[0][1]);  // a document's pieces swapped: still a layout
  EXPECT_TRUE(layout_errors(swapped).empty());
  EXPECT_NE(swapped, make_layout(ShardLayout::per_document, 1024, 4, {500, 24, 500}));
}

// Tiles per rank as the all_gather's kernel computes them (its local rows on a grid of 64 against the whole
// row's kv blocks): the balance of each layout on packed rows.
V tiles_per_rank(const SequenceLayout& l, const V& docs, const PositionBand& band) {
  const std::int64_t seq = l.seq_len;
  const std::vector<std::int32_t> pos = natural_positions(1, seq);
  const std::vector<std::int32_t> seg = segment_ids_from_lengths(1, docs);
  const auto kv = kernels::block_meta(pos, seg, 0, seq, 64);
  V tiles;
  for (std::int64_t r = 0; r < l.ranks(); ++r) {
    const std::vector<std::int32_t> mine = positions_as_int32(l.positions(r));
    std::vector<std::int32_t> mine_seg;
    for (const std::int32_t p : mine) mine_seg.push_back(seg[static_cast<std::size_t>(p)]);
    const auto q = kernels::block_meta(mine, mine_seg, 0, static_cast<std::int64_t>(mine.size()), 64);
    tiles.push_back(kernels::count_nonempty_tiles(q, kv, band, true));
  }
  return tiles;
}

double max_over_mean(const V& x) {
  double sum = 0;
  for (const std::int64_t v : x) sum += static_cast<double>(v);
  return static_cast<double>(*std::max_element(x.begin(), x.end())) * static_cast<double>(x.size()) / sum;
}

// The balance proof (docs/performance.md, "Layouts on packed rows"): 20 packs of S = 131072 with log-normal
// document lengths (median 8192 tokens, sigma 1.2), at cp 8 and 16 with the solver's 512-token chunks,
// causal: the solver keeps max / mean tiles per rank within 1.05 (forward and backward compute the same
// tiles), also under a 4096-token window; per_document within 1.10 on packs whose every document has at
// least 2 cp blocks of 512. The worst pack of each layout is printed beside contiguous and dual chunk swap.
TEST(Layouts, TheSolverBalancesPackedRowsWithinFivePercent) {
  const std::int64_t seq = 131072;
  for (const std::int64_t cp : {8, 16}) {
    std::mt19937 rng(static_cast<std::uint32_t>(100 + cp));
    double worst[4] = {0, 0, 0, 0}, worst_windowed = 0, worst_per_document = 0;
    for (int trial = 0; trial < 20; ++trial) {
      const V docs = pack(rng, seq, 8192, 1);
      const V long_docs = pack(rng, seq, 8192, 2 * cp * 512);
      const PositionBand causal{kUnboundedWindow, 0}, window{4095, 0};
      for (std::size_t k = 0; k < 4; ++k) {
        const SequenceLayout l = make_layout(kLayouts[k], seq, cp, docs, causal);
        worst[k] = std::max(worst[k], max_over_mean(tiles_per_rank(l, docs, causal)));
      }
      const double windowed = max_over_mean(
          tiles_per_rank(make_layout(ShardLayout::solver, seq, cp, docs, window), docs, window));
      worst_windowed = std::max(worst_windowed, windowed);
      const double per_document = max_over_mean(tiles_per_rank(
          make_layout(ShardLayout::per_document, seq, cp, long_docs, causal), long_docs, causal));
      worst_per_document = std::max(worst_per_document, per_document);
      EXPECT_LE(max_over_mean(
                    tiles_per_rank(make_layout(ShardLayout::solver, seq, cp, docs, causal), docs, causal)),
                1.05)
          << "cp " << cp << " pack " << trial << " of " << docs.size() << " documents";
      EXPECT_LE(windowed, 1.05) << "cp " << cp << " pack " << trial;
      EXPECT_LE(per_document, 1.10) << "cp " << cp << " pack " << trial;
    }
    std::printf(
        "cp %lld, worst of 20 packs, max/mean tiles per rank: contiguous %.3f, dual_chunk_swap %.3f, "
        "per_document %.3f (%.3f where every document has >= 2cp blocks), solver %.3f (%.3f with a "
        "4096-token "
        "window)\n",
        static_cast<long long>(cp), worst[0], worst[1], worst[2], worst_per_document, worst[3],
        worst_windowed);
  }
}

// The all_gather's keys on packed rows: each rank gets the kv blocks (in aligned pairs) of its documents that
// its queries reach, within the band's; the whole row to every rank is no list.
TEST(Layouts, AllGatherKeysAreTheBlocksOfEachRanksDocuments) {
  using R = std::vector<PositionRange>;
  const SequenceLayout l = make_layout(ShardLayout::contiguous, 256, 4);
  const auto keys = [&](const PositionBand& band, bool windowed, const std::vector<std::int32_t>& seg) {
    return all_gather_keys(l.rank_positions(), l.rank_run_lengths(), 256, band, windowed, 64, seg);
  };
  // Causal, documents 200 and 56: rank 0's queries reach block 0 (its pair: blocks 0 and 1), rank 1's blocks
  // 0 and 1, rank 2's 0 to 2 (the pairs: all), rank 3's document 0 to 199 and document 1 whole.
  const auto pack = segment_ids_from_lengths(1, {200, 56});
  EXPECT_EQ(keys(causal_band(true), false, pack),
            (std::vector<R>{{{0, 128}}, {{0, 128}}, {{0, 256}}, {{0, 256}}}));
  // No segment ids, no window: the whole row to every rank (the band alone does not decide). One document's
  // ids: the causal reach alone; in the dual chunk swap at S = 256 every rank reaches every pair of blocks
  // (its late chunk, 2cp - 1 - r, ends in the last pair or the one before it, which with rank r's early chunk
  // covers them all): the whole row.
  EXPECT_TRUE(keys(causal_band(true), false, {}).empty());
  const auto one = segment_ids_from_lengths(1, {256});
  EXPECT_EQ(keys(causal_band(true), false, one),
            (std::vector<R>{{{0, 128}}, {{0, 128}}, {{0, 256}}, {{0, 256}}}));
  const SequenceLayout dcs = make_layout(ShardLayout::dual_chunk_swap, 256, 4);
  EXPECT_TRUE(
      all_gather_keys(dcs.rank_positions(), dcs.rank_run_lengths(), 256, causal_band(true), false, 64, one)
          .empty());
  // Non-causal, documents 64 and 192: rank 0 holds document 0 alone (blocks 0 and its pair's 1); the others
  // reach document 1 whole and block 0 only as its pair's.
  EXPECT_EQ(keys(causal_band(false), false, segment_ids_from_lengths(1, {64, 192})),
            (std::vector<R>{{{0, 128}}, {{0, 256}}, {{0, 256}}, {{0, 256}}}));
  // A causal window of 10 keys on 200 + 56: the band's pairs (rank 3: 182..255, blocks 2 and 3; rank 0:
  // block 0, its pair 0 and 1) that the documents keep.
  const auto windowed = keys(PositionBand{10, 0}, true, pack);
  EXPECT_EQ(windowed[0], (R{{0, 128}}));
  EXPECT_EQ(windowed[3], (R{{128, 256}}));
  // Without segment ids the window alone, in pairs: rank 2 (128..191) reaches 118..191, blocks 1 to 2: the
  // pairs 0-1 and 2-3.
  EXPECT_EQ(keys(PositionBand{10, 0}, true, {})[2], (R{{0, 256}}));
  // Ids that come back: document 0 at 0..63 and again at 192..255, document 1 between, blocks of 32 over
  // two ranks. Rank 1 (128..255) holds document 1's end and document 0's second run, whose queries see its
  // first run too: blocks 0 and 1 as well; rank 0 (0..127) reaches blocks 0 to 3.
  std::vector<std::int32_t> back(256, 0);
  for (int i = 64; i < 192; ++i) back[static_cast<std::size_t>(i)] = 1;
  const SequenceLayout halves = make_layout(ShardLayout::contiguous, 256, 2);
  const auto two_ranks = all_gather_keys(halves.rank_positions(), halves.rank_run_lengths(), 256,
                                         causal_band(true), false, 32, back);
  EXPECT_EQ(two_ranks, (std::vector<R>{{{0, 128}}, {{0, 256}}}));
  // Two batch rows: the union of what each row's documents reach (row 1 one document: rank 0 still block 0).
  auto two = pack;
  for (int i = 0; i < 256; ++i) two.push_back(0);
  EXPECT_EQ(keys(causal_band(true), false, two),
            (std::vector<R>{{{0, 128}}, {{0, 128}}, {{0, 256}}, {{0, 256}}}));
  // A row whose rank-0 document is short: documents 10, 246, non-causal: rank 0 (0..63) holds both, reaching
  // all; a pack where rank 0's document ends inside block 0 and rank 1 starts a new one there.
  EXPECT_TRUE(keys(causal_band(false), false, segment_ids_from_lengths(1, {10, 246})).empty());
}

// The all_gather's keys on the balance proof's packs (S = 131072, cp 8, causal, blocks of 64): every rank
// receives each block holding a key of its documents at or before its last query there (checked document by
// document), and the K/V rows the ranks receive from others are printed against the whole all_gather's
// (docs/performance.md, "Layouts on packed rows").
TEST(Layouts, AllGatherKeysOnPackedRowsCoverWhatTheQueriesSee) {
  const std::int64_t seq = 131072, cp = 8, block = 64;
  std::mt19937 rng(108);
  double received[4] = {0, 0, 0, 0};
  const PositionBand causal{kUnboundedWindow, 0};
  for (int trial = 0; trial < 20; ++trial) {
    const V docs = pack(rng, seq, 8192, 1);
    const auto seg = segment_ids_from_lengths(1, docs);
    std::vector<std::int64_t> first(docs.size(), 0);  // each document's first position
    for (std::size_t d = 1; d < docs.size(); ++d) first[d] = first[d - 1] + docs[d - 1];
    for (std::size_t k = 0; k < 4; ++k) {
      const SequenceLayout l = make_layout(kLayouts[k], seq, cp, docs, causal);
      const auto keys =
          all_gather_keys(l.rank_positions(), l.rank_run_lengths(), seq, causal, false, block, seg);
      for (std::int64_t r = 0; r < cp; ++r) {
        const auto mine = l.positions(r);
        std::vector<std::int64_t> last(docs.size(), -1);  // the rank's last query in each document
        for (const std::int64_t x : mine) {
          const auto d = static_cast<std::size_t>(seg[static_cast<std::size_t>(x)]);
          last[d] = std::max(last[d], x);
        }
        std::int64_t rows = seq, own = seq / cp;
        if (!keys.empty()) {
          const auto& ranges = keys[static_cast<std::size_t>(r)];
          for (std::size_t d = 0; d < docs.size(); ++d) {
            for (std::int64_t x = first[d]; x <= last[d]; x += block) {
              ASSERT_TRUE(in_ranges(ranges, x))
                  << to_string(kLayouts[k]) << " rank " << r << " position " << x;
            }
            if (last[d] >= 0) {
              ASSERT_TRUE(in_ranges(ranges, last[d]));
            }
          }
          rows = 0;
          for (const PositionRange& x : ranges) rows += x.size();
          own = overlap(l.runs[static_cast<std::size_t>(r)], ranges);
        }
        received[k] += static_cast<double>(rows - own) / static_cast<double>((cp - 1) * seq) / 20;
      }
    }
  }
  std::printf(
      "cp 8, 20 packs, K/V rows the ranks receive against the whole all_gather's: contiguous %.3f, "
      "dual_chunk_swap %.3f, per_document %.3f, solver %.3f\n",
      received[0], received[1], received[2], received[3]);
  for (const double x : received) EXPECT_LE(x, 1.0);
}

// The ring on the balance proof's packs (S = 131072, cp 8, causal): its direct route sends each rank, at each
// step, a span of each of its source's runs holding every row a query of it sees in its own document (a key
// at or before the rank's last query in the key's document: checked row by row), and the K/V rows the ring
// moves are printed against the relay's (every shard round the ring): in all, and at each step's slowest
// rank, which the step waits for (docs/performance.md, "Layouts on packed rows").
TEST(Layouts, TheRingOnPackedRowsMovesTheRowsItsQueriesSee) {
  const std::int64_t seq = 131072, cp = 8;
  std::mt19937 rng(108);
  double moved[4] = {0, 0, 0, 0}, slowest[4] = {0, 0, 0, 0};
  int direct[4] = {0, 0, 0, 0};
  const PositionBand causal{kUnboundedWindow, 0};
  for (int trial = 0; trial < 20; ++trial) {
    const V docs = pack(rng, seq, 8192, 1);
    const auto seg = segment_ids_from_lengths(1, docs);
    for (std::size_t k = 0; k < 4; ++k) {
      const SequenceLayout l = make_layout(kLayouts[k], seq, cp, docs, causal);
      const RankPositions positions = l.rank_positions();
      const RankRuns runs = l.rank_run_lengths();
      const RingRoute route = ring_route(positions, runs, causal, false, seg);
      direct[k] += route.direct ? 1 : 0;
      if (!route.direct) {
        moved[k] += 1.0 / 20;
        slowest[k] += 1.0 / 20;
        continue;
      }
      std::vector<const ReachStep*> at(static_cast<std::size_t>(cp), nullptr);
      for (const ReachStep& st : route.steps) at[static_cast<std::size_t>(st.distance)] = &st;
      for (std::int64_t r = 0; r < cp; ++r) {
        std::vector<std::int64_t> last(docs.size(), -1);  // the rank's last query in each document
        for (const std::int32_t x : positions[static_cast<std::size_t>(r)]) {
          const auto d = static_cast<std::size_t>(seg[static_cast<std::size_t>(x)]);
          last[d] = std::max<std::int64_t>(last[d], x);
        }
        for (std::int64_t d = 1; d < cp; ++d) {
          const auto src = static_cast<std::size_t>((r - d + cp) % cp);
          const ReachStep* st = at[static_cast<std::size_t>(d)];
          std::int64_t first = 0;
          for (std::size_t part = 0; part < runs[src].size(); ++part) {
            for (std::int64_t t = 0; t < runs[src][part]; ++t) {
              const std::int32_t x = positions[src][static_cast<std::size_t>(first + t)];
              if (x > last[static_cast<std::size_t>(seg[static_cast<std::size_t>(x)])]) continue;
              ASSERT_NE(st, nullptr) << to_string(kLayouts[k]) << " rank " << r << " distance " << d;
              const RowSpan& span = st->seen[static_cast<std::size_t>(r)][part];
              ASSERT_TRUE(t >= span.begin && t < span.end)
                  << to_string(kLayouts[k]) << " rank " << r << " distance " << d << " position " << x;
            }
            first += runs[src][part];
          }
        }
      }
      for (const ReachStep& st : route.steps) {
        std::int64_t most = 0;
        for (std::int64_t r = 0; r < cp; ++r) {
          moved[k] += static_cast<double>(st.rows_received(r)) / static_cast<double>((cp - 1) * seq) / 20;
          most = std::max(most, st.rows_received(r));
        }
        slowest[k] += static_cast<double>(most) / static_cast<double>((cp - 1) * (seq / cp)) / 20;
      }
    }
  }
  std::printf(
      "cp 8, 20 packs, the ring's K/V rows against the relay's, in all / at each step's slowest rank (direct "
      "in n of 20): contiguous %.3f / %.3f (%d), dual_chunk_swap %.3f / %.3f (%d), per_document %.3f / %.3f "
      "(%d), solver %.3f / %.3f (%d)\n",
      moved[0], slowest[0], direct[0], moved[1], slowest[1], direct[1], moved[2], slowest[2], direct[2],
      moved[3], slowest[3], direct[3]);
  for (std::size_t k = 0; k < 4; ++k) {
    EXPECT_LE(moved[k], slowest[k]);
    EXPECT_LE(slowest[k], 1.0);
  }
}

}  // namespace
}  // namespace cpattn
