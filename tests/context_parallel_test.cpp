// Every strategy (ulysses, all_gather, ring, hybrid; ± load balance, ± remat where taken) against the
// single-device kernel and the float64 reference, the collective accounting, tile balance, negative controls,
// and errors on every rank.
#include <gtest/gtest.h>

#include <optional>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <numeric>
#include <random>
#include <tuple>

#include "cp_harness.hpp"
#include "cpattn/placement.hpp"
#include "cpattn/planner.hpp"
#include "cpattn/schedule.hpp"
#include "cpattn/sequence_layout.hpp"
#include "cpattn/shard.hpp"

namespace cpattn {
namespace {

using testing::CpCase;

using testing::expect_matches_single_device;

// A pairwise-covering set over cp, (Hq, Hkv), causal, packing, dtype, batch and head dim, each run with the
// three strategies (ulysses, all_gather, all_gather + load balance) and remat on some.
std::vector<CpCase> covering_cases() {
  struct Row {
    std::int64_t cp, hq, hkv, dim, batch;
    bool causal, packed;
    DType dtype;
    bool remat;
  };
  const Row rows[] = {
      {4, 32, 2, 64, 1, true, false, DType::f32, false},   // the seed's heads, rep 2
      {8, 32, 2, 80, 1, true, true, DType::f32, true},     // rep 4, packed
      {4, 8, 2, 128, 2, false, true, DType::bf16, false},  // rep 2, batch 2, bf16
      {2, 16, 4, 64, 2, true, true, DType::f32, false},    // no replication (Hkv > cp)
      {8, 8, 8, 64, 1, false, false, DType::f32, true},    // MHA, Hkv = cp
      {4, 4, 1, 80, 1, true, true, DType::f32, false},     // MQA, rep 4
      {2, 16, 16, 128, 1, false, false, DType::bf16, true},
      {1, 8, 2, 64, 2, true, true, DType::f32, false},      // cp = 1
      {8, 16, 4, 128, 1, true, false, DType::bf16, false},  // rep 2 at cp 8
      {2, 4, 1, 64, 1, false, true, DType::f32, true},      // MQA at cp 2
  };
  std::vector<CpCase> cases;
  for (const Row& r : rows) {
    for (int variant = 0; variant < 3; ++variant) {
      CpCase c;
      c.cp = r.cp;
      c.hq = r.hq;
      c.hkv = r.hkv;
      c.dim = r.dim;
      c.batch = r.batch;
      c.causal = r.causal;
      c.dtype = r.dtype;
      c.remat = r.remat;
      c.seq = 32 * r.cp + 64;  // S/cp not a multiple of the 64-token block
      c.seq -= c.seq % (2 * r.cp);
      if (r.packed) c.segments = {c.seq / 3, c.seq - c.seq / 3 - 5, 5};
      c.strategy = variant == 0 ? Strategy::ulysses : Strategy::all_gather;
      c.load_balance = variant == 2;
      if (!validation_errors(c.attention(), c.parallel()).empty()) continue;
      cases.push_back(c);
    }
  }
  return cases;
}

TEST(ContextParallel, StrategiesMatchTheSingleDeviceKernelOverACoveringSet) {
  const auto cases = covering_cases();
  EXPECT_GE(cases.size(), 28u);
  for (const CpCase& c : cases) expect_matches_single_device(c);
}

// bf16 on every path this CPU has (forced for the ranks and the single device alike): the forward is the same
// bits as the single-device kernel for ulysses (with replication), all_gather with and without load balance,
// at cp 2 to 8, packed, batch 2; the same bits at 1 and 2 threads per rank; ring within its bf16 bounds.
// Under TSan only the default (fastest) path and cp up to 4: what TSan checks is the group's threading, the
// same on every path, and each path's bits are checked in the other builds.
TEST(ContextParallel, Bf16OnEveryPathIsBitIdenticalAcrossStrategiesCpAndThreads) {
  auto paths = testing::bf16_paths();
#if defined(__SANITIZE_THREAD__)
  paths.resize(1);
#endif
  for (const auto& [path, kernel] : paths) {
    for (const auto& [strategy, lb, cp] :
         {std::tuple{Strategy::ulysses, false, 4}, std::tuple{Strategy::all_gather, true, 2},
          std::tuple{Strategy::all_gather, false, 8}}) {
#if defined(__SANITIZE_THREAD__)
      // Under TSan the all_gather at cp 2 alone: more ranks' threading is the group tests' (InProcessGroup),
      // the other strategies' bits are checked in the other builds.
      if (cp != 2) continue;
#endif
      CpCase c;
      c.dtype = DType::bf16;
      c.kernel = kernel;
      c.strategy = strategy;
      c.load_balance = lb;
      c.cp = cp;
      c.hq = 8;
      c.hkv = 2;
      c.dim = 80;
      c.batch = 2;
      c.seq = 320;
      c.segments = {200, 115, 5};
      expect_matches_single_device(c);
      if (strategy == Strategy::ulysses) {
        const auto in = testing::make_whole_inputs(c, 9);
        const auto one = testing::run_context_parallel(c, in, 1),
                   two = testing::run_context_parallel(c, in, 2);
        EXPECT_EQ(testing::count_bit_differences(one.o, two.o), 0) << to_string(path);
        EXPECT_EQ(testing::count_bit_differences(one.lse, two.lse), 0) << to_string(path);
      }
    }
    CpCase ring;
    ring.dtype = DType::bf16;
    ring.kernel = kernel;
    ring.strategy = Strategy::ring;
    ring.load_balance = true;
    ring.cp = 4;
    ring.hq = 8;
    ring.hkv = 2;
    ring.seq = 512;
    ring.segments = {300, 212};
    testing::expect_ring_matches_single_device(ring);
  }
}

// Sliding windows, soft-caps and sinks on every strategy, against the single-device kernel with the same
// options: ulysses and all_gather (with and without load balance) bit for bit in the forward; ring and hybrid
// within their bounds; the ranks' shares of dsinks summed against the single device's. Causal windows of 0,
// 7, 64 and 300 keys back (past a rank's chunk), a two-sided one without the causal mask, a soft-cap alone
// and with a window, sinks with some of them; a packed row whose documents are shorter and longer than the
// windows. Each setup takes every other option (the two all_gather setups, the two ring setups, and ulysses
// with hybrid between them take all, and each of the six a two-sided window or a non-causal cap, and sinks);
// under ASan every fourth, under TSan two.
TEST(ContextParallel, SlidingWindowsSoftCapsAndSinksOnEveryStrategy) {
  struct Window {
    bool causal;
    std::optional<std::int64_t> left, right;
    std::optional<double> softcap;
    bool sinks;
  };
  const Window windows[] = {{true, 0, {}, {}, false},  {true, 7, {}, {}, false},   {true, 64, {}, {}, true},
                            {false, 20, 5, {}, false}, {true, 300, {}, {}, false}, {true, {}, {}, 0.5, true},
                            {false, {}, {}, 2, true},  {true, 40, {}, 1.5, true}};
  const std::tuple<Strategy, bool, std::int64_t, std::int64_t> setups[] = {
      {Strategy::ulysses, false, 4, 0},    {Strategy::all_gather, true, 2, 0},
      {Strategy::all_gather, false, 8, 0}, {Strategy::ring, true, 4, 0},
      {Strategy::ring, false, 3, 0},       {Strategy::hybrid, true, 4, 2}};
  // The cases run: (setup s + option wi) % kEvery == 0, and under TSan only s + wi == 12 (the load-balanced
  // ring with a window, a cap and sinks; the hybrid with a non-causal cap and sinks): the group's threading
  // is the same in every case, each case's arithmetic is checked in the other builds.
#if defined(__SANITIZE_THREAD__)
  const auto runs = [](int s, int wi) { return s + wi == 12; };
#elif defined(__SANITIZE_ADDRESS__)
  const auto runs = [](int s, int wi) { return (s + wi) % 4 == 0; };
#else
  const auto runs = [](int s, int wi) { return (s + wi) % 2 == 0; };
#endif
  int i = 0, s = 0;
  for (const auto& [strategy, lb, cp, u] : setups) {
    ++s;
    for (int wi = 0; wi < static_cast<int>(std::size(windows)); ++wi) {
      if (!runs(s, wi)) continue;
      const Window& w = windows[wi];
      CpCase c;
      c.strategy = strategy;
      c.load_balance = lb;
      c.cp = cp;
      c.ulysses_degree = u;
      c.hq = 8;
      c.hkv = 2;
      c.seq = 384;
      c.segments = {30, 290, 64};
      c.causal = w.causal;
      c.window_left = w.left;
      c.window_right = w.right;
      c.softcap = w.softcap;
      c.sinks = w.sinks;
      c.dim = ++i % 2 == 0 ? 64 : 80;
      ASSERT_TRUE(validation_errors(c.attention(), c.parallel()).empty()) << c.name();
      if (strategy == Strategy::ring || strategy == Strategy::hybrid) {
        testing::expect_ring_matches_single_device(c);
      } else {
        expect_matches_single_device(c);
      }
    }
  }
}

// A window moves what it reaches: the ring sends each rank's K/V rows only to the ranks that see them (the
// contiguous ring: rank r - 1's last w rows; the zigzag: two neighbours' chunk tails), the all_gather gathers
// only the kernel blocks a rank's queries see, so the bytes fall with w, not S. Counted at cp 8 against the
// windowless count (what each rank sent, forward and backward, the largest over ranks), on both layouts and
// the hybrid's ring, with the result checked against the single device; each rank's count is its own
// schedule's.
TEST(ContextParallel, AWindowSendsOnlyTheRowsItReaches) {
  auto sent = [](const testing::CpRun& run) {
    std::int64_t most = 0;
    for (const auto& records : run.records) {
      std::int64_t bytes = 0;
      for (const CollectiveRecord& x : records) bytes += x.group == "ulysses" ? 0 : x.bytes_sent_per_rank;
      most = std::max(most, bytes);
    }
    return most;
  };
  const std::tuple<Strategy, bool, std::int64_t, double> setups[] = {
      {Strategy::ring, false, 0, 1.0 / 30},
      {Strategy::ring, true, 0, 1.0 / 15},
      {Strategy::hybrid, true, 2, 1.0 / 15},
      // the all_gather's keys in aligned pairs of 64-row blocks (all_gather_keys): contiguous, rank r - 1
      // sends rank r one pair, 128 of the 1792 rows it sends windowless
      {Strategy::all_gather, false, 0, 1.0 / 14},
      {Strategy::all_gather, true, 0, 1.0 / 7}};
  [[maybe_unused]] int i = 0;
  for (const auto& [strategy, lb, u, most] : setups) {
    // Under TSan the zigzag ring alone, under ASan every other setup: the threading and the memory are the
    // same in each, every setup's bytes are checked in the other builds.
#if defined(__SANITIZE_THREAD__)
    if (i++ != 1) continue;
#elif defined(__SANITIZE_ADDRESS__)
    if (i++ % 2 != 1) continue;
#endif
    CpCase c;
    c.strategy = strategy;
    c.load_balance = lb;
    c.ulysses_degree = u;
    c.cp = 8;
    c.hq = 4;
    c.hkv = 2;
    c.dim = 16;
    c.seq = 2048;
    c.causal = true;
    const testing::CpRun whole = testing::run_context_parallel(c, testing::make_whole_inputs(c, 5));
    c.window_left = 31;  // 32 keys: a sixteenth of the zigzag's 128-row chunk at cp 8
    SCOPED_TRACE(c.name());
    const testing::CpRun windowed = testing::run_context_parallel(c, testing::make_whole_inputs(c, 5));
    for (std::int64_t r = 0; r < c.cp; ++r) {
      EXPECT_EQ(windowed.records[r],
                scheduled_records(strategy_schedule(c.attention(), c.parallel(), {false, false, r}), c.cp))
          << "rank " << r;
    }
    const double ratio = static_cast<double>(sent(windowed)) / static_cast<double>(sent(whole));
    EXPECT_GT(ratio, 0.0);
    EXPECT_LE(ratio, most) << sent(windowed) << " of " << sent(whole) << " bytes";
#if !defined(__SANITIZE_THREAD__) && !defined(__SANITIZE_ADDRESS__)
    if (strategy == Strategy::all_gather) {
      testing::expect_matches_single_device(c);  // the forward bit for bit
    } else {
      testing::expect_ring_matches_single_device(c);
    }
#endif
  }
}

// A window past the row reaches every key the mask lets a query see: the windowed ring's every distance
// whole (the same calls in the same order as round the ring, the dK/dV summed in the same order) and the
// windowed all_gather's every row, so every output equals the windowless run's bit for bit, causal and not.
TEST(ContextParallel, AWindowPastTheRowIsNoWindowBitForBitOnEveryStrategy) {
  const std::tuple<Strategy, bool, std::int64_t> setups[] = {{Strategy::ring, false, 0},
                                                             {Strategy::ring, true, 0},
                                                             {Strategy::hybrid, true, 2},
                                                             {Strategy::all_gather, true, 0},
                                                             {Strategy::ulysses, false, 0}};
  for (const auto& [strategy, lb, u] : setups) {
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
    if (strategy != Strategy::ring) continue;  // the sanitizers' share: the windowed ring's two paths
#endif
    for (const bool causal : {true, false}) {
      CpCase c;
      c.strategy = strategy;
      c.load_balance = lb;
      c.ulysses_degree = u;
      c.cp = 4;
      c.hq = 4;
      c.hkv = 2;
      c.dim = 16;
      c.seq = 256;
      c.segments = {100, 156};
      c.causal = causal;
      const auto in = testing::make_whole_inputs(c, 13);
      const testing::CpRun plain = testing::run_context_parallel(c, in);
      c.window_left = 256;
      if (!causal) c.window_right = 1000;
      SCOPED_TRACE(c.name());
      const testing::CpRun windowed = testing::run_context_parallel(c, in);
      EXPECT_EQ(testing::count_bit_differences(windowed.o, plain.o), 0) << "o";
      EXPECT_EQ(testing::count_bit_differences(windowed.lse, plain.lse), 0) << "lse";
      EXPECT_EQ(testing::count_bit_differences(windowed.dq, plain.dq), 0) << "dq";
      EXPECT_EQ(testing::count_bit_differences(windowed.dk, plain.dk), 0) << "dk";
      EXPECT_EQ(testing::count_bit_differences(windowed.dv, plain.dv), 0) << "dv";
    }
  }
}

// The layouts cut by documents (per_document, solver) on every strategy that shards the sequence, against
// the single-device kernel: the all_gather's forward bit for bit, the ring and the hybrid within their bounds
// (each run's collectives checked against its schedule as every run is), at cp 2 to 8 on packs with a
// one-token document, documents shorter than 2cp tokens, and one spanning every rank; windowed, non-causal
// and batch 2 on some; the hybrid at U = cp (a ring of one rank holding its members' runs). Each rank holds
// its layout's positions.
TEST(ContextParallel, TheDocumentLayoutsOnEveryShardedStrategy) {
  struct Setup {
    Strategy strategy;
    ShardLayout layout;
    std::int64_t cp, u;
    std::vector<std::int64_t> docs;
    std::optional<std::int64_t> window;
    bool causal;
  };
  using L = ShardLayout;
  const Setup setups[] = {
      {Strategy::all_gather, L::per_document, 2, 0, {1, 200, 3, 180}, {}, true},
      {Strategy::all_gather, L::solver, 4, 0, {1, 5, 370, 8}, 31, true},
      {Strategy::all_gather, L::per_document, 8, 0, {5, 379}, {}, false},
      {Strategy::ring, L::per_document, 4, 0, {300, 1, 83}, {}, true},
      {Strategy::ring, L::solver, 8, 0, {7, 1, 376}, {}, true},
      {Strategy::ring, L::per_document, 3, 0, {100, 1, 2, 281}, 20, true},
      {Strategy::ring, L::solver, 6, 0, {190, 194}, {}, false},
      {Strategy::hybrid, L::per_document, 4, 2, {2, 380, 2}, {}, true},
      {Strategy::hybrid, L::solver, 8, 2, {384}, 40, true},
      {Strategy::hybrid, L::per_document, 4, 4, {3, 200, 181}, {}, true},  // a ring of one rank
  };
  [[maybe_unused]] int i = 0;
  for (const Setup& s : setups) {
#if defined(__SANITIZE_THREAD__)
    if (i++ % 3 != 1) continue;  // the threading is the same in each; every setup runs in the other builds
#elif defined(__SANITIZE_ADDRESS__)
    if (i++ % 2 != 0) continue;
#endif
    CpCase c;
    c.strategy = s.strategy;
    c.layout = s.layout;
    c.cp = s.cp;
    c.ulysses_degree = s.u;
    c.hq = 4;
    c.hkv = 2;
    c.dim = 16;
    c.seq = 384;
    c.batch = s.cp == 4 ? 2 : 1;
    c.segments = s.docs;
    c.window_left = s.window;
    c.causal = s.causal;
    SCOPED_TRACE(c.name());
    if (s.strategy == Strategy::all_gather) {
      expect_matches_single_device(c);
    } else {
      testing::expect_ring_matches_single_device(c);
    }
  }
}

// The all_gather's keys in aligned pairs of kv blocks (all_gather_keys): the bf16 kernels step over two
// blocks at a time, so a rank given blocks 3 and 4 of a window (contiguous, cp 8, S 384, a causal window of
// 7: rank 5) would pair them as the single device does not. bf16 forward bit for bit, windowed and on a pack.
TEST(ContextParallel, TheAllGathersKeysInPairsKeepBf16BitForBit) {
  for (const bool packed : {false, true}) {
    CpCase c;
    c.strategy = Strategy::all_gather;
    c.cp = 8;
    c.seq = 384;
    c.hq = 4;
    c.hkv = 2;
    c.dim = 16;
    c.dtype = DType::bf16;
    c.window_left = 7;
    if (packed) c.segments = {100, 1, 283};
    SCOPED_TRACE(c.name());
    expect_matches_single_device(c);
  }
}

TEST(ContextParallel, UlyssesMatchesReferenceWhenKvHeadsFewerThanRanks) {
  // The seed's configuration, scaled down: Hq = 32, Hkv = 2 at cp = 4 (rep 2) and cp = 8 (rep 4); under the
  // sanitizers cp = 4 alone (the group's threading and memory are the same; cp 8's replication is checked in
  // the default build).
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
  for (std::int64_t cp : {4}) {
#else
  for (std::int64_t cp : {4, 8}) {
#endif
    CpCase c;
    c.cp = cp;
    c.seq = 512;
    c.dim = 64;
    c.segments = {300, 212};
#if defined(__SANITIZE_THREAD__)
    c.seq = 256;
    c.segments = {150, 106};
#endif
    expect_matches_single_device(c);
  }
}

// Ulysses at any head counts (docs/design.md, "Head placement"): each shape of kAnyHeadCounts
// twice: on its row of a two-level orthogonal array (over the eight rows every pair of the six factors meets
// in all four combinations) and on that row's complement, so each factor takes both values on every shape.
TEST(ContextParallel, UlyssesAtAnyHeadCountsMatchesTheSingleDeviceKernelOverACoveringSet) {
  // L8: columns causal, packed, bf16, batch 2, head dim 80, remat.
  constexpr int kRows[8][6] = {{0, 0, 0, 0, 0, 0}, {0, 0, 0, 1, 1, 1}, {0, 1, 1, 0, 0, 1},
                               {0, 1, 1, 1, 1, 0}, {1, 0, 1, 0, 1, 0}, {1, 0, 1, 1, 0, 1},
                               {1, 1, 0, 0, 1, 1}, {1, 1, 0, 1, 0, 0}};
  int shape = 0;
  for (const testing::HeadCounts& h : testing::kAnyHeadCounts) {
    const int* row = kRows[shape++ % 8];
    for (const bool complement : {false, true}) {
      auto on = [&](int column) { return (row[column] != 0) != complement; };
      CpCase c;
      c.hq = h.hq;
      c.hkv = h.hkv;
      c.cp = h.cp;
      c.seq = h.cp * (150 / h.cp + 1);  // not a multiple of the 64-token block
      c.causal = on(0);
      if (on(1)) c.segments = {c.seq / 3, c.seq - c.seq / 3 - 5, 5};
      c.dtype = on(2) ? DType::bf16 : DType::f32;
      c.batch = on(3) ? 2 : 1;
      c.dim = on(4) ? 80 : 64;
      c.remat = on(5);
      c.sinks = on(0) != on(3);  // uneven head splits, several kernel calls a rank: each call's sinks
      ASSERT_TRUE(validation_errors(c.attention(), c.parallel()).empty()) << c.name();
      expect_matches_single_device(c);
    }
  }
}

// ring over cp in {2, 3, 4, 8} and (Hq, Hkv) in {(8,8), (8,2), (32,2), (4,1)}, each pair of the two once (a
// Latin square), on the rows of the two-level orthogonal array above and their complements: causal, packed
// (a document shorter than one chunk), load balance, bf16, batch 2, head dim 80.
TEST(ContextParallel, RingMatchesTheSingleDeviceKernelOverACoveringSet) {
  constexpr int kRows[8][6] = {{0, 0, 0, 0, 0, 0}, {0, 0, 0, 1, 1, 1}, {0, 1, 1, 0, 0, 1},
                               {0, 1, 1, 1, 1, 0}, {1, 0, 1, 0, 1, 0}, {1, 0, 1, 1, 0, 1},
                               {1, 1, 0, 0, 1, 1}, {1, 1, 0, 1, 0, 0}};
  const std::int64_t cps[] = {2, 3, 4, 8};
  const std::pair<std::int64_t, std::int64_t> heads[] = {{8, 8}, {8, 2}, {32, 2}, {4, 1}};
  for (int i = 0; i < 16; ++i) {
    const int* row = kRows[i % 8];
    auto on = [&](int column) { return (row[column] != 0) != (i >= 8); };
    CpCase c;
    c.strategy = Strategy::ring;
    c.cp = cps[i % 4];
    std::tie(c.hq, c.hkv) = heads[(i / 4 + i) % 4];
    c.seq = 2 * c.cp * (24 + c.cp);  // chunks of 24 + cp tokens: not a multiple of the 64-token block
    c.causal = on(0);
    if (on(1)) c.segments = {c.seq / 2 + 3, c.seq / 2 - 8, 5};
    c.load_balance = on(2);
    c.dtype = on(3) ? DType::bf16 : DType::f32;
    c.batch = on(4) ? 2 : 1;
    c.dim = on(5) ? 80 : 64;
    testing::expect_ring_matches_single_device(c);
  }
}

// Segment ids that come back to an earlier document (0, 1, 0 in thirds; ids drawn per run of 1..40 tokens
// from {0, 1, 2}) through the ring and the hybrid, contiguous and zigzag, causal, with a window and not: the
// ring sends each rank only the rows its queries see in their own documents (a direct route wherever some
// row goes unseen), within the strategies' bounds of the single device and the float64 reference.
TEST(ContextParallel, RingAndHybridOnIdsThatComeBackMatchTheSingleDevice) {
  std::mt19937 rng(7);
  int direct = 0, cases = 0;
  for (const Strategy strategy : {Strategy::ring, Strategy::hybrid}) {
    for (const bool lb : {false, true}) {
      for (const int ids : {0, 1}) {
        for (const bool causal : {true, false}) {
          CpCase c;
          c.strategy = strategy;
          c.cp = 4;
          if (strategy == Strategy::hybrid) c.ulysses_degree = 2;
          c.hq = 4;
          c.hkv = 2;
          c.dim = 32;
          c.seq = 384;
          c.load_balance = lb;
          c.causal = causal;
          if (ids == 1) c.window_left = 40;
          c.segments = {c.seq};  // packed (the ids below replace the one document's)
          auto in = testing::make_whole_inputs(c, 11);
          std::vector<std::int32_t> seg(static_cast<std::size_t>(c.seq), 0);
          if (ids == 0) {
            std::fill(seg.begin() + c.seq / 3, seg.begin() + 2 * c.seq / 3, 1);
          } else {
            for (std::size_t t = 0; t < seg.size();) {
              const auto n = std::uniform_int_distribution<std::size_t>(1, 40)(rng);
              std::fill_n(seg.begin() + static_cast<std::ptrdiff_t>(t), std::min(n, seg.size() - t),
                          std::uniform_int_distribution<std::int32_t>(0, 2)(rng));
              t += n;
            }
          }
          in.segment_ids = seg;
          const SequenceLayout ring = ring_layout_of(c.attention(), c.parallel());
          direct += ring_route(ring.rank_positions(), ring.rank_run_lengths(), c.attention().band(),
                               c.attention().windowed(), seg)
                        .direct;
          ++cases;
          testing::expect_ring_matches_single_device(c, in);
        }
      }
    }
  }
  EXPECT_GE(direct, cases / 2) << "the direct route is what the test is for";
}

// The ring's result does not depend on the kernel's thread count or on the run: the same bits.
TEST(ContextParallel, RingIsBitIdenticalRunToRunAndAcrossThreadCounts) {
  CpCase c;
  c.strategy = Strategy::ring;
  c.load_balance = true;
  c.hq = 8;
  c.hkv = 2;
  c.seq = 512;
  c.segments = {300, 212};
  const auto in = testing::make_whole_inputs(c, 4);
  const auto one = testing::run_context_parallel(c, in, 1);
  const auto again = testing::run_context_parallel(c, in, 1);
  const auto two = testing::run_context_parallel(c, in, 2);
  for (const auto* other : {&again, &two}) {
    EXPECT_EQ(testing::count_bit_differences(one.o, other->o), 0);
    EXPECT_EQ(testing::count_bit_differences(one.lse, other->lse), 0);
    EXPECT_EQ(testing::count_bit_differences(one.dq, other->dq), 0);
    EXPECT_EQ(testing::count_bit_differences(one.dk, other->dk), 0);
    EXPECT_EQ(testing::count_bit_differences(one.dv, other->dv), 0);
  }
}

// With load balance on one causal document every rank computes the same tiles when S is a multiple of
// 2 * cp * block (here 2 * 4 * 64), and the same as ulysses' per-head work; without it the causal skew shows.
TEST(ContextParallel, RingTilesAreEqualWithLoadBalanceOnOneCausalDocument) {
  CpCase c;
  c.strategy = Strategy::ring;
  c.hq = 4;
  c.hkv = 2;
  c.dim = 16;
  c.seq = 1024;
  const auto in = testing::make_whole_inputs(c, 1);
  const auto plain = testing::run_context_parallel(c, in);
  EXPECT_GT(plain.tiles_per_rank[3], plain.tiles_per_rank[0]);
  c.load_balance = true;
  const auto lb = testing::run_context_parallel(c, in);
  for (auto t : lb.tiles_per_rank) EXPECT_EQ(t, lb.tiles_per_rank[0]);
  EXPECT_EQ(lb.tiles_per_rank[0], 4 * 16 * 17 / 2 / 4);  // a quarter of every head's T(T+1)/2, T = 16
  // Chunks that are not a multiple of the block (125 and 37 tokens): the chunk-by-chunk calls keep them
  // equal.
  for (std::int64_t seq : {1000, 296}) {
    c.seq = seq;
    const auto odd = testing::run_context_parallel(c, testing::make_whole_inputs(c, 2));
    const auto [lo, hi] = std::minmax_element(odd.tiles_per_rank.begin(), odd.tiles_per_rank.end());
    EXPECT_LE(static_cast<double>(*hi) / static_cast<double>(*lo), 1.05) << seq;
    // The planner counts the same tiles on the kernel's grid.
    PlanRequest r;
    r.attention = c.attention();
    r.parallel = c.parallel();
    r.block = 64;
    r.hardware = *find_hardware("h200");
    const Plan plan = make_plan(r);
    for (const auto& sp : plan.strategies) {
      if (sp.name == "ring_load_balanced") {
        EXPECT_EQ(sp.tiles_per_rank, odd.tiles_per_rank) << seq;
      }
    }
  }
}

double max_rel(const std::vector<float>& got, const std::vector<float>& want);

// hybrid (U x R) against the single-device kernel within the ring's bounds: (cp, U) in {(4,2), (8,4), (12,3)}
// and (Hq, Hkv) in {(32,2), (6,3), (26,2)}, each pair once (a Latin square), on the rows of the two-level
// orthogonal array above and their complements: causal, packed, load balance, bf16, batch 2, head dim 80; and
// cp > Hq (Hq = 8 at cp 16, U = 8). Four of the nine pairs split the heads unevenly over a ulysses group
// (6 over 4: 2,2,1,1; 26 over 4: 7,7,6,6; 26 over 3: 9,9,8; 32 over 3: 11,11,10), so the ranks of a group
// make different kernel calls and a wrong rank decomposition gives wrong numbers, not the same ones.
TEST(ContextParallel, HybridMatchesTheSingleDeviceKernelOverACoveringSet) {
  constexpr int kRows[8][6] = {{0, 0, 0, 0, 0, 0}, {0, 0, 0, 1, 1, 1}, {0, 1, 1, 0, 0, 1},
                               {0, 1, 1, 1, 1, 0}, {1, 0, 1, 0, 1, 0}, {1, 0, 1, 1, 0, 1},
                               {1, 1, 0, 0, 1, 1}, {1, 1, 0, 1, 0, 0}};
  const std::pair<std::int64_t, std::int64_t> degrees[] = {{4, 2}, {8, 4}, {12, 3}};
  const std::pair<std::int64_t, std::int64_t> heads[] = {{32, 2}, {6, 3}, {26, 2}};
  for (int i = 0; i < 10; ++i) {
    const int* row = kRows[i % 8];
    auto on = [&](int column) { return (row[column] != 0) != (i >= 8); };
    CpCase c;
    c.strategy = Strategy::hybrid;
    if (i < 9) {
      std::tie(c.cp, c.ulysses_degree) = degrees[i % 3];
      std::tie(c.hq, c.hkv) = heads[(i / 3 + i) % 3];
    } else {
      c.cp = 16;
      c.ulysses_degree = 8;
      c.hq = 8;
      c.hkv = 2;
    }
    c.seq = 2 * c.cp * (12 + c.cp);  // chunks of 12 + cp tokens: not a multiple of the 64-token block
    c.causal = on(0);
    if (on(1)) c.segments = {c.seq / 2 + 3, c.seq / 2 - 8, 5};
    c.load_balance = on(2);
    c.dtype = on(3) ? DType::bf16 : DType::f32;
    c.batch = on(4) ? 2 : 1;
    c.dim = on(5) ? 80 : 32;
    c.sinks = on(0) != on(4);  // uneven ulysses splits inside the hybrid too
    ASSERT_TRUE(validation_errors(c.attention(), c.parallel()).empty()) << c.name();
    testing::expect_ring_matches_single_device(c);
  }
}

// A ring of one rank holds the whole row in natural order, load balance or not: one kernel call, the same
// bits as the single-device kernel (the zigzag's two chunks are one run at cp = 1).
TEST(ContextParallel, RingOfOneRankIsTheSingleDeviceKernelBitForBit) {
  for (const bool lb : {false, true}) {
    CpCase c;
    c.strategy = Strategy::ring;
    c.cp = 1;
    c.load_balance = lb;
    c.hq = 4;
    c.hkv = 2;
    c.dim = 32;
    c.seq = 200;
    c.segments = {120, 80};
    const auto in = testing::make_whole_inputs(c, 5);
    const auto got = testing::run_context_parallel(c, in);
    const auto single = testing::run_single_device(c, in);
    EXPECT_EQ(testing::count_bit_differences(got.o, single.o), 0) << c.name();
    EXPECT_EQ(testing::count_bit_differences(got.lse, single.lse), 0) << c.name();
  }
}

// A forward's kept state belongs to the object that ran it: another object's backward refuses it on every
// rank (nothing computed), and its own object runs on it.
TEST(ContextParallel, BackwardRefusesAnotherObjectsSavedState) {
  CpCase c;
  c.cp = 2;
  c.seq = 64;
  c.hq = 4;
  c.hkv = 2;
  c.dim = 16;
  const auto in = testing::make_whole_inputs(c, 9);
  std::vector<std::string> messages(2);
  InProcessGroup group(2);
  group.run([&](Communicator& comm) {
    ContextParallelAttention a(c.attention(), c.parallel(), comm), b(c.attention(), c.parallel(), comm);
    const auto shard = [&](const Tensor& t) {
      return take_tokens(t, local_positions(c.parallel().effective_layout(), c.seq, c.cp, comm.rank()));
    };
    a.forward(shard(in.q), shard(in.k), shard(in.v));
    const auto kept = a.take_saved();
    try {
      b.backward(shard(in.d_out), *kept);
    } catch (const Error& e) {
      messages[comm.rank()] = e.what();
    }
    const AttentionGradients g = a.backward(shard(in.d_out), *kept);
    EXPECT_EQ(g.dq.shape(), shard(in.q).shape());
  });
  for (const std::string& m : messages) {
    EXPECT_NE(m.find("state another ContextParallelAttention's forward kept"), std::string::npos) << m;
  }
}

// U = cp is ulysses (one ring rank: the same kernel calls on the same rows) and U = 1 is ring (a ulysses
// group of one: no swap): the same bits, forward and backward, packed, with and without load balance.
TEST(ContextParallel, HybridAtUEqualCpIsUlyssesAndAtUOneIsRingBitForBit) {
  for (const bool lb : {false, true}) {
#if defined(__SANITIZE_THREAD__)
    for (const DType dtype : {DType::f32}) {  // the threads are the same in bf16, whose bits the others check
#else
    for (const DType dtype : {DType::f32, DType::bf16}) {
#endif
      CpCase c;
      c.hq = 12;
      c.hkv = 3;
      c.seq = 192;
      c.dim = 32;
      c.dtype = dtype;
      c.segments = {100, 92};
      const auto in = testing::make_whole_inputs(c, 21);
      c.strategy = Strategy::ulysses;
      const auto ulysses = testing::run_context_parallel(c, in);
      c.strategy = Strategy::ring;
      c.load_balance = lb;
      const auto ring = testing::run_context_parallel(c, in);
      c.strategy = Strategy::hybrid;
      c.ulysses_degree = c.cp;
      const auto u_cp = testing::run_context_parallel(c, in);
      c.ulysses_degree = 1;
      const auto u_one = testing::run_context_parallel(c, in);
      const std::string name = c.name();
      for (const auto& [got, want, what] :
           {std::tuple{&u_cp, &ulysses, "U = cp vs ulysses"}, std::tuple{&u_one, &ring, "U = 1 vs ring"}}) {
        EXPECT_EQ(testing::count_bit_differences(got->o, want->o), 0) << what << " o " << name;
        EXPECT_EQ(testing::count_bit_differences(got->lse, want->lse), 0) << what << " lse " << name;
        EXPECT_EQ(testing::count_bit_differences(got->dq, want->dq), 0) << what << " dq " << name;
        EXPECT_EQ(testing::count_bit_differences(got->dk, want->dk), 0) << what << " dk " << name;
        EXPECT_EQ(testing::count_bit_differences(got->dv, want->dv), 0) << what << " dv " << name;
      }
      EXPECT_EQ(testing::count_bit_differences(u_cp.o, testing::run_single_device(c, in).o), 0) << name;
    }
  }
}

// Each rank counts its groups' calls under their names, as the schedule (the planner's source) says, rank by
// rank: at Hq = 24, Hkv = 3, U = 4 the ulysses ranks hold 1, 2, 2, 1 kv heads (q heads 6 each, groups of 8),
// so the ring of ulysses rank 1 moves twice what the ring of ulysses rank 0 moves. The packed row's segment
// ids move first, over all ranks; its two documents leave each ring rank rows the other does not see, so the
// ring sends each the rows it sees (ring_route), fewer than its whole shard.
TEST(ContextParallel, HybridCountsEachGroupAsItsSchedule) {
  CpCase c;
  c.strategy = Strategy::hybrid;
  c.cp = 8;
  c.ulysses_degree = 4;
  c.hq = 24;
  c.hkv = 3;
  c.dim = 16;
  c.seq = 256;
  c.load_balance = true;
  c.segments = {130, 126};
  const auto run = testing::run_context_parallel(c, testing::make_whole_inputs(c, 8));
  const std::vector<std::int32_t> ids = segment_ids_from_lengths(c.batch, c.segments);
  const std::int64_t kv_heads[] = {1, 2, 2, 1};
  std::vector<std::int64_t> ring_rows(static_cast<std::size_t>(c.cp));
  for (std::int64_t r = 0; r < c.cp; ++r) {
    const auto& recs = run.records[r];
    ScheduleOptions o{false, true, r};
    o.segments = &ids;
    EXPECT_EQ(recs, scheduled_records(strategy_schedule(c.attention(), c.parallel(), o), c.cp))
        << "rank " << r;
    std::int64_t ring_forward = 0, ulysses_calls = 0, everyone = 0;
    for (const CollectiveRecord& x : recs) {
      EXPECT_TRUE(x.group == "ulysses" || x.group == "ring" || x.group.empty()) << x.group;
      if (x.group == "ring" && x.kind == CollectiveKind::collective_permute && x.phase == "forward") {
        ring_forward += x.bytes_sent_per_rank;
      }
      if (x.group == "ulysses") ulysses_calls += x.count;
      if (x.group.empty()) everyone += x.count;
    }
    // One K||V message [2, B, rows, nkv_u, D] fp32 (R = 2): the rows the other ring rank sees, the same for
    // the four ulysses ranks of one ring rank whatever their kv heads, and fewer than its U*S/cp.
    ASSERT_EQ(ring_forward % (2 * kv_heads[r % 4] * 16 * 4), 0) << "rank " << r;
    ring_rows[static_cast<std::size_t>(r)] = ring_forward / (2 * kv_heads[r % 4] * 16 * 4);
    EXPECT_GT(ring_rows[static_cast<std::size_t>(r)], 0) << "rank " << r;
    EXPECT_LT(ring_rows[static_cast<std::size_t>(r)], 4 * (256 / 8)) << "rank " << r;
    EXPECT_EQ(ring_rows[static_cast<std::size_t>(r)], ring_rows[static_cast<std::size_t>(r / 4 * 4)]);
    EXPECT_EQ(ulysses_calls, 3 + 2 + 1 + 3) << "rank " << r;  // q k v, o lse; d_out, dq dk dv
    EXPECT_EQ(everyone, 1) << "rank " << r;                   // the segment ids
  }
}

// The ring's and the placement's controls run through the hybrid too, and each is caught: Hq = 26, Hkv = 2
// over U = 4 gives q heads 7, 7, 6, 6 (kv 0 on two ranks, kv 1 on three).
TEST(ContextParallel, HybridControlsAreCaught) {
  CpCase c;
  c.strategy = Strategy::hybrid;
  c.cp = 8;
  c.ulysses_degree = 4;
  c.hq = 26;
  c.hkv = 2;
  c.dim = 16;
  c.seq = 256;
  c.load_balance = true;
  const auto in = testing::make_whole_inputs(c, 14);
  const auto single = testing::run_single_device(c, in);
  EXPECT_LE(max_rel(testing::run_context_parallel(c, in).dk, single.dk), 1e-5);
  for (const NegativeControl control : {NegativeControl::shifted_kv_set, NegativeControl::ring_zigzag_swapped,
                                        NegativeControl::extra_q_heads_on_highest_ranks}) {
    c.control = control;
    EXPECT_GT(max_rel(testing::run_context_parallel(c, in).o, single.o), 1e-2) << static_cast<int>(control);
  }
  for (const NegativeControl control :
       {NegativeControl::first_kv_replica_only, NegativeControl::ring_step_lse,
        NegativeControl::ring_accumulator_one_hop_short}) {
    c.control = control;
    const auto got = testing::run_context_parallel(c, in);
    EXPECT_LE(max_rel(got.o, single.o), 5e-6) << "the forward is untouched";
    EXPECT_GT(std::max(max_rel(got.dk, single.dk), max_rel(got.dq, single.dq)), 1e-2)
        << static_cast<int>(control);
  }
}

TEST(ContextParallel, CombinationsTheValidatorRejectsAreRejected) {
  CpCase c;
  c.hq = 4;
  c.hkv = 1;
  c.cp = 8;  // ulysses: 4 q heads cannot split 8 ways
  EXPECT_FALSE(validation_errors(c.attention(), c.parallel()).empty());
  InProcessGroup group(8);
  std::atomic<int> rejected{0};
  group.run([&](Communicator& comm) {
    try {
      ContextParallelAttention attn(c.attention(), c.parallel(), comm);
    } catch (const Error& e) {
      if (e.kind() == ErrorKind::invalid_config) ++rejected;
    }
  });
  EXPECT_EQ(rejected.load(), 8);
  c = CpCase{};
  c.load_balance = true;  // with ulysses
  EXPECT_FALSE(validation_errors(c.attention(), c.parallel()).empty());
  c = CpCase{};
  c.hq = 24;
  c.hkv = 3;  // 3 neither divides nor is divided by 4: taken (kv sets shared between ranks)
  EXPECT_TRUE(validation_errors(c.attention(), c.parallel()).empty());
  c.hq = 25;  // but a q head count that is not a multiple of the kv heads is not
  EXPECT_FALSE(validation_errors(c.attention(), c.parallel()).empty());
}

// ---- Negative controls: each wrong variant must be caught where rep >= 2 (and Hkv >= 2 for the order). ----

double max_rel(const std::vector<float>& got, const std::vector<float>& want) {
  return testing::compare(got, want).max_rel;
}

TEST(ContextParallel, NegativeControlsAreCaught) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "a control's bug is in the numbers, not the threads: the other builds catch it";
#endif
  CpCase c;  // Hq = 32, Hkv = 2, cp = 4: rep = 2
  c.seq = 256;
  const auto in = testing::make_whole_inputs(c, 7);
  const auto single = testing::run_single_device(c, in);
  const auto good = testing::run_context_parallel(c, in);
  EXPECT_LE(max_rel(good.dk, single.dk), 1e-6);

  c.control = NegativeControl::tiled_kv_order;
  const auto tiled = testing::run_context_parallel(c, in);
  EXPECT_GT(max_rel(tiled.o, single.o), 1e-2) << "a tiled kv order must give a wrong output";

  c.control = NegativeControl::scaled_kv_grad_sum;
  const auto scaled = testing::run_context_parallel(c, in);
  EXPECT_EQ(testing::count_bit_differences(scaled.o, single.o), 0) << "the forward is untouched";
  EXPECT_GT(max_rel(scaled.dk, single.dk), 0.3) << "a 1/rep factor must give wrong dK";
  EXPECT_GT(max_rel(scaled.dv, single.dv), 0.3);

  c.control = NegativeControl::first_kv_replica_only;
  const auto first = testing::run_context_parallel(c, in);
  EXPECT_GT(max_rel(first.dk, single.dk), 1e-2) << "one replica instead of the sum must give wrong dK";
  EXPECT_GT(max_rel(first.dv, single.dv), 1e-2);
  EXPECT_LE(max_rel(first.dq, single.dq), 1e-6) << "dQ does not depend on the kv reduction";
}

// A layout read with rank 0's first two runs (a document's pieces) swapped, while the data hold them as the
// layout says: every sharded strategy's output is wrong, on both layouts cut by documents.
TEST(ContextParallel, ADocumentLayoutsPiecesSwappedIsCaught) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "a control's bug is in the numbers, not the threads: the other builds catch it";
#endif
  for (const auto& [strategy, layout] : {std::pair{Strategy::all_gather, ShardLayout::per_document},
                                         std::pair{Strategy::ring, ShardLayout::solver}}) {
    CpCase c;
    c.strategy = strategy;
    c.layout = layout;
    c.hq = 4;
    c.hkv = 2;
    c.dim = 16;
    c.seq = 384;
    c.segments = {100, 1, 200, 83};
    SCOPED_TRACE(c.name());
    const auto in = testing::make_whole_inputs(c, 13);
    const auto single = testing::run_single_device(c, in);
    EXPECT_LE(max_rel(testing::run_context_parallel(c, in).o, single.o), 1e-5);
    c.control = NegativeControl::layout_runs_swapped;
    EXPECT_GT(max_rel(testing::run_context_parallel(c, in).o, single.o), 1e-2)
        << "a document's pieces read at each other's positions must give a wrong output";
  }
}

// The controls of the any-head-count placement: a kv set shifted by one head where a rank starts a q group
// (Hq=24, Hkv=3, cp=4: rank 0 gets kv 1 for q heads that read kv 0), the replica gradients not summed (kv 0
// and kv 1 go to two ranks each), and the extra q heads on the highest ranks while the kv sets assume the
// lowest (Hq=28, Hkv=4, cp=8: rank 2's q heads 6..8 with kv set {1}).
TEST(ContextParallel, AnyHeadCountControlsAreCaught) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "a control's bug is in the numbers, not the threads: the other builds catch it";
#endif
  CpCase c;
  c.hq = 24;
  c.hkv = 3;
  c.seq = 128;
  const auto in = testing::make_whole_inputs(c, 11);
  const auto single = testing::run_single_device(c, in);
  EXPECT_LE(max_rel(testing::run_context_parallel(c, in).dk, single.dk), 1e-6);

  c.control = NegativeControl::shifted_kv_set;
  EXPECT_GT(max_rel(testing::run_context_parallel(c, in).o, single.o), 1e-2)
      << "a kv set shifted by one head must give a wrong output";

  c.control = NegativeControl::first_kv_replica_only;
  const auto first = testing::run_context_parallel(c, in);
  EXPECT_EQ(testing::count_bit_differences(first.o, single.o), 0) << "the forward is untouched";
  EXPECT_GT(max_rel(first.dk, single.dk), 1e-2) << "one contribution instead of the sum must give wrong dK";
  EXPECT_GT(max_rel(first.dv, single.dv), 1e-2);

  c = CpCase{};
  c.hq = 28;
  c.hkv = 4;
  c.cp = 8;
  c.seq = 128;
  const auto in28 = testing::make_whole_inputs(c, 12);
  const auto single28 = testing::run_single_device(c, in28);
  c.control = NegativeControl::extra_q_heads_on_highest_ranks;
  EXPECT_GT(max_rel(testing::run_context_parallel(c, in28).o, single28.o), 1e-2)
      << "q heads placed where the kv sets do not expect them must give a wrong output";
}

// The ring's controls: a per-step LSE in backward, the accumulators one hop short of home, and the zigzag
// chunks swapped, each caught.
TEST(ContextParallel, RingControlsAreCaught) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "a control's bug is in the numbers, not the threads: the other builds catch it";
#endif
  CpCase c;
  c.strategy = Strategy::ring;
  c.load_balance = true;
  c.hq = 8;
  c.hkv = 2;
  c.seq = 256;
  const auto in = testing::make_whole_inputs(c, 13);
  const auto single = testing::run_single_device(c, in);
  EXPECT_LE(max_rel(testing::run_context_parallel(c, in).dk, single.dk), 1e-5);

  c.control = NegativeControl::ring_step_lse;
  const auto step = testing::run_context_parallel(c, in);
  EXPECT_LE(max_rel(step.o, single.o), 5e-6) << "the forward is untouched";
  EXPECT_GT(max_rel(step.dq, single.dq), 1e-2) << "a per-step LSE must give wrong gradients";

  c.control = NegativeControl::ring_accumulator_one_hop_short;
  const auto short_hop = testing::run_context_parallel(c, in);
  EXPECT_GT(max_rel(short_hop.dk, single.dk), 1e-2) << "accumulators one hop short must give wrong dK";
  EXPECT_LE(max_rel(short_hop.dq, single.dq), 1e-5) << "dQ does not travel";

  c.control = NegativeControl::ring_zigzag_swapped;
  EXPECT_GT(max_rel(testing::run_context_parallel(c, in).o, single.o), 1e-2)
      << "the zigzag chunks swapped must give a wrong output";
}

TEST(ContextParallel, WithOneKvHeadTheTiledOrderIsTheSame) {
  CpCase c;
  c.hq = 8;
  c.hkv = 1;
  c.seq = 128;
  c.control = NegativeControl::tiled_kv_order;
  const auto in = testing::make_whole_inputs(c, 9);
  EXPECT_EQ(testing::count_bit_differences(testing::run_context_parallel(c, in).o,
                                           testing::run_single_device(c, in).o),
            0);
}

// ---- The accounting: what the communicator counted is docs/design.md's table. ----

std::int64_t sum_bytes(const std::vector<CollectiveRecord>& recs, CollectiveKind kind,
                       const std::string& phase, std::int64_t* count = nullptr,
                       std::int64_t* sent = nullptr) {
  std::int64_t b = 0;
  for (const auto& r : recs) {
    if (r.kind == kind && r.phase == phase) {
      b += r.bytes;
      if (count) *count += r.count;
      if (sent) *sent += r.bytes_sent_per_rank;
    }
  }
  return b;
}

TEST(ContextParallel, CountedCollectivesFollowTheDesignTable) {
  CpCase c;  // ulysses, cp 4, Hq 32, Hkv 2 (rep 2), D 64, S 256, fp32, packed
  c.segments = {200, 56};
  const std::int64_t B = 1, S = 256, cp = 4, D = 64, E = 4;
  const auto in = testing::make_whole_inputs(c, 3);
  auto u = testing::run_context_parallel(c, in);
  for (const auto& recs : u.records) {
    std::int64_t n = 0, sent = 0;
    const std::int64_t q = B * S / cp * 32 * D * E, kv = B * S / cp * std::max<std::int64_t>(2, cp) * D * E;
    const std::int64_t lse = B * 32 * (S / cp) * 4;
    EXPECT_EQ(sum_bytes(recs, CollectiveKind::all_to_all, "forward", &n, &sent), q + 2 * kv + q + lse);
    EXPECT_EQ(n, 5);
    EXPECT_EQ(sent, (q + 2 * kv + q + lse) * (cp - 1) / cp);
    n = sent = 0;
    EXPECT_EQ(sum_bytes(recs, CollectiveKind::all_gather, "forward", &n, &sent), B * S * 4);
    EXPECT_EQ(sent, B * S / cp * 4 * (cp - 1));
    n = 0;
    EXPECT_EQ(sum_bytes(recs, CollectiveKind::all_to_all, "backward", &n), q + q + 2 * kv);
    EXPECT_EQ(n, 4);
  }
  // The all_gather on one document (on packed rows each rank receives the key blocks of its documents:
  // Layouts.AllGatherKeysAreTheBlocksOfEachRanksDocuments, Planner.PredictionsEqualWhatRunCounted).
  c.strategy = Strategy::all_gather;
  c.remat = true;
  c.segments = {};
  auto a = testing::run_context_parallel(c, testing::make_whole_inputs(c, 3));
  for (const auto& recs : a.records) {
    std::int64_t n = 0, sent = 0;
    const std::int64_t kv = B * S * 2 * D * E;
    EXPECT_EQ(sum_bytes(recs, CollectiveKind::all_gather, "forward", &n, &sent), 2 * kv);
    EXPECT_EQ(n, 2);
    EXPECT_EQ(sent, 2 * kv / cp * (cp - 1));
    n = 0;
    EXPECT_EQ(sum_bytes(recs, CollectiveKind::all_gather, "remat", &n), 2 * kv);
    EXPECT_EQ(n, 2);
    n = sent = 0;
    EXPECT_EQ(sum_bytes(recs, CollectiveKind::reduce_scatter, "backward", &n, &sent), 2 * B * S * 2 * D * 4);
    EXPECT_EQ(n, 2);
    EXPECT_EQ(sent, 2 * B * S * 2 * D * 4 * (cp - 1) / cp);
  }
}

// The table's any-head-count rows: 7 q heads on 7 kv heads over 4 ranks (2, 2, 2, 1 heads), fp32, S = 64, D
// = 8.
TEST(ContextParallel, CountedCollectivesFollowTheDesignTableAtUnevenHeads) {
  CpCase c;
  c.hq = 7;
  c.hkv = 7;
  c.dim = 8;
  c.seq = 64;
  const std::int64_t B = 1, S = 64, cp = 4, D = 8, E = 4, n_max = 2, h_own_min = 1;
  const auto run = testing::run_context_parallel(c, testing::make_whole_inputs(c, 5));
  const std::int64_t in = B * S / cp * 7 * D * E;   // q, k, v, d_out: the whole shard
  const std::int64_t back = B * S * n_max * D * E;  // o, dq, dk, dv: the rank with the most heads
  const std::int64_t lse = B * n_max * S * 4;       // lse: likewise
  const std::int64_t in_sent = B * S / cp * (7 - h_own_min) * D * E;
  const std::int64_t back_sent = B * S / cp * n_max * (cp - 1) * D * E;
  const std::int64_t lse_sent = B * n_max * S / cp * (cp - 1) * 4;
  for (const auto& recs : run.records) {
    std::int64_t n = 0, sent = 0;
    EXPECT_EQ(sum_bytes(recs, CollectiveKind::all_to_all, "forward", &n, &sent), 3 * in + back + lse);
    EXPECT_EQ(n, 5);
    EXPECT_EQ(sent, 3 * in_sent + back_sent + lse_sent);
    n = sent = 0;
    EXPECT_EQ(sum_bytes(recs, CollectiveKind::all_to_all, "backward", &n, &sent), in + 3 * back);
    EXPECT_EQ(n, 4);
    EXPECT_EQ(sent, in_sent + 3 * back_sent);
  }
}

// ---- Balance: tiles per rank. ----

TEST(ContextParallel, CausalTilesAreEqualForUlyssesSkewedForAllGatherAndBalancedWithLoadBalance) {
  CpCase c;
  c.hq = 8;
  c.hkv = 2;
  c.dim = 16;
  c.seq = 1024;  // 16 blocks of 64; cp = 4: 4 blocks per rank
  const auto in = testing::make_whole_inputs(c, 1);
  const auto u = testing::run_context_parallel(c, in);
  for (auto t : u.tiles_per_rank) EXPECT_EQ(t, u.tiles_per_rank[0]);
  EXPECT_EQ(u.tiles_per_rank[0], 2 * 16 * 17 / 2);  // 2 local heads x T(T+1)/2
  c.strategy = Strategy::all_gather;
  const auto a = testing::run_context_parallel(c, in);
  // Rank r's 4 q blocks see 4r+1 .. 4r+4 kv blocks: n^2 r + n(n+1)/2 per head with n = 4.
  for (std::int64_t r = 0; r < 4; ++r) EXPECT_EQ(a.tiles_per_rank[r], 8 * (16 * r + 10)) << r;
  c.load_balance = true;
  const auto lb = testing::run_context_parallel(c, in);
  for (auto t : lb.tiles_per_rank) EXPECT_EQ(t, lb.tiles_per_rank[0]);
  EXPECT_EQ(lb.tiles_per_rank[0], u.tiles_per_rank[0]);  // the same work per rank as ulysses
}

// ---- Errors on every rank, before any collective that could hang. ----

TEST(ContextParallel, AShapeThatDisagreesIsAnErrorOnEveryRank) {
  CpCase c;
  c.seq = 256;
  std::vector<std::string> messages(4);
  InProcessGroup group(4);
  EXPECT_THROW(group.run([&](Communicator& comm) {
    ContextParallelAttention attn(c.attention(), c.parallel(), comm);
    const std::int64_t sl = comm.rank() == 2 ? 63 : 64;  // rank 2 passes one token too few
    try {
      attn.forward(Tensor(DType::f32, {1, sl, 32, 64}), Tensor(DType::f32, {1, 64, 2, 64}),
                   Tensor(DType::f32, {1, 64, 2, 64}));
    } catch (const Error& e) {
      messages[comm.rank()] = e.what();
      throw;
    }
  }),
               Error);
  EXPECT_NE(messages[2].find("q has shape [1, 63, 32, 64]"), std::string::npos) << messages[2];
  for (int r : {0, 1, 3})
    EXPECT_NE(messages[r].find("rank 2 passed tensors"), std::string::npos) << messages[r];
}

// A communicator that throws on its `fail_at`-th data collective (0-based): a rank that fails in the middle
// of a strategy's forward or backward.
class FailingCommunicator final : public Communicator {
 public:
  FailingCommunicator(Communicator& inner, int fail_at)
      : inner_(inner), state_(std::make_shared<State>(State{0, fail_at})) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  const char* backend() const override { return inner_.backend(); }
  void all_to_all(const void* send, void* recv, std::int64_t count, CommDType dtype) override {
    step();
    inner_.all_to_all(send, recv, count, dtype);
  }
  void all_to_all_v(const void* send, const BlockList& send_blocks, void* recv, const BlockList& recv_blocks,
                    CommDType dtype) override {
    step();
    inner_.all_to_all_v(send, send_blocks, recv, recv_blocks, dtype);
  }
  void all_gather(const void* send, void* recv, std::int64_t count, CommDType dtype) override {
    step();
    inner_.all_gather(send, recv, count, dtype);
  }
  std::unique_ptr<PendingShift> start_shift_v(const void* send, std::int64_t send_count, void* recv,
                                              std::int64_t recv_count, CommDType dtype,
                                              int distance) override {
    step();
    return inner_.start_shift_v(send, send_count, recv, recv_count, dtype, distance);
  }
  void reduce_scatter_sum(const void* send, void* recv, std::int64_t count, CommDType dtype) override {
    step();
    inner_.reduce_scatter_sum(send, recv, count, dtype);
  }
  void collective_permute(const void* send, void* recv, std::int64_t count, CommDType dtype,
                          const std::vector<int>& dest) override {
    step();
    inner_.collective_permute(send, recv, count, dtype, dest);
  }
  void barrier() override { inner_.barrier(); }
  void all_reduce(std::int64_t* values, int n, ReduceOp op) override { inner_.all_reduce(values, n, op); }
  // A sub-group (hybrid's) counts its data collectives with this one's: the fault point is over all of them.
  std::unique_ptr<Communicator> split(int color, int key) override {
    return std::unique_ptr<Communicator>(new FailingCommunicator(inner_.split(color, key), state_));
  }
  int calls() const { return state_->calls; }

 private:
  struct State {
    int calls, fail_at;
  };
  FailingCommunicator(std::unique_ptr<Communicator> owned, std::shared_ptr<State> state)
      : inner_(*owned), owned_(std::move(owned)), state_(std::move(state)) {}
  void step() {
    if (state_->calls++ == state_->fail_at)
      throw std::runtime_error("injected fault at collective " + std::to_string(state_->fail_at));
  }
  Communicator& inner_;
  std::unique_ptr<Communicator> owned_;  // a sub-group's
  std::shared_ptr<State> state_;
};

// A rank that fails mid-forward or mid-backward: every other rank gets an error naming it, promptly (not by
// the group's timeout), no thread stays blocked (run() returns), and a new group in the same process works.
TEST(ContextParallel, ARankFailingMidForwardOrBackwardIsAnErrorOnEveryRank) {
  for (const Strategy strategy : kStrategies) {
    CpCase c;
    c.strategy = strategy;
    c.load_balance = strategy_traits(strategy).load_balance;
    if (strategy_traits(strategy).sub_groups) c.ulysses_degree = 2;
    c.seq = 256;
    c.hq = 8;
    const auto in = testing::make_whole_inputs(c, 3);
    // The forward's data collectives, counted on a clean run: the fault points are the forward's second and
    // the backward's second.
    int forward_calls = 0;
    {
      InProcessGroup group(4);
      group.run([&](Communicator& comm) {
        FailingCommunicator counting(comm, -1);
        ContextParallelAttention attn(c.attention(), c.parallel(), counting);
        const auto shard = [&](const Tensor& t) {
          return take_tokens(t, local_positions(c.parallel().effective_layout(), c.seq, c.cp, comm.rank()));
        };
        attn.forward(shard(in.q), shard(in.k), shard(in.v));
        if (comm.rank() == 0) forward_calls = counting.calls();
      });
    }
    ASSERT_GE(forward_calls, 2) << to_string(strategy);
    for (const int fail_at : {1, forward_calls + 1}) {
      SCOPED_TRACE(std::string(to_string(strategy)) + " fault at collective " + std::to_string(fail_at));
      std::vector<std::string> messages(4);
      InProcessGroup group(4);
      const auto t0 = std::chrono::steady_clock::now();
      EXPECT_THROW(group.run([&](Communicator& comm) {
        FailingCommunicator faulty(comm, comm.rank() == 2 ? fail_at : -1);
        ContextParallelAttention attn(c.attention(), c.parallel(), faulty);
        const auto shard = [&](const Tensor& t) {
          return take_tokens(t, local_positions(c.parallel().effective_layout(), c.seq, c.cp, comm.rank()));
        };
        try {
          attn.forward(shard(in.q), shard(in.k), shard(in.v));
          attn.backward(shard(in.d_out));
        } catch (const std::exception& e) {
          messages[comm.rank()] = e.what();
          throw;
        }
      }),
                   std::exception);
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      EXPECT_LT(seconds, 10.0) << "the other ranks waited for a timeout instead of being told";
      EXPECT_NE(messages[2].find("injected fault"), std::string::npos) << messages[2];
      for (int r : {0, 1, 3}) {
        EXPECT_NE(messages[r].find("rank 2 failed: injected fault"), std::string::npos)
            << r << ": " << messages[r];
      }
    }
  }
  // The process goes on: a new group runs a whole forward+backward and matches the single-device kernel.
  CpCase c;
  c.seq = 128;
  expect_matches_single_device(c);
}

TEST(ContextParallel, ForwardOnlyKeepsNoStateAndBackwardSaysSo) {
  CpCase c;
  c.seq = 128;
  const auto in = testing::make_whole_inputs(c, 2);
  InProcessGroup group(4);
  std::atomic<int> errors{0};
  group.run([&](Communicator& comm) {
    ContextParallelAttention attn(c.attention(), c.parallel(), comm);
    const auto pos = local_positions(ShardLayout::contiguous, 128, 4, comm.rank());
    attn.forward(testing::take_rows(in.q, pos), testing::take_rows(in.k, pos), testing::take_rows(in.v, pos),
                 {}, true);
    try {
      attn.backward(testing::take_rows(in.d_out, pos));
    } catch (const Error& e) {
      if (std::string(e.what()).find("forward_only") != std::string::npos ||
          std::string(e.what()).find("cannot run backward") != std::string::npos) {
        ++errors;
      }
    }
  });
  EXPECT_EQ(errors.load(), 4);
}

TEST(ContextParallel, ReorderSequenceRoundTripsBetweenLayouts) {
  for (int cp : {1, 2, 4}) {
    const std::int64_t S = 16 * cp;
    InProcessGroup group(cp);
    std::atomic<int> wrong{0};
    group.run([&](Communicator& comm) {
      // Each token carries its global position.
      const auto contiguous = local_positions(ShardLayout::contiguous, S, cp, comm.rank());
      Tensor x(DType::f32, {2, S / cp, 1, 3});
      for (std::int64_t b = 0; b < 2; ++b) {
        for (std::int64_t t = 0; t < S / cp; ++t) {
          for (int d = 0; d < 3; ++d) x.set(b, t, 0, d, static_cast<float>(contiguous[t] + 1000 * b));
        }
      }
      const Tensor y = reorder_sequence(comm, x, S, ShardLayout::contiguous, ShardLayout::dual_chunk_swap);
      const auto dcs = local_positions(ShardLayout::dual_chunk_swap, S, cp, comm.rank());
      for (std::int64_t b = 0; b < 2; ++b) {
        for (std::int64_t t = 0; t < S / cp; ++t)
          wrong += y.get(b, t, 0, 2) != static_cast<float>(dcs[t] + 1000 * b);
      }
      const Tensor back = reorder_sequence(comm, y, S, ShardLayout::dual_chunk_swap, ShardLayout::contiguous);
      for (std::int64_t i = 0; i < x.numel(); ++i) wrong += back.flat(i) != x.flat(i);
    });
    EXPECT_EQ(wrong.load(), 0) << "cp " << cp;
  }
}

}  // namespace
}  // namespace cpattn
