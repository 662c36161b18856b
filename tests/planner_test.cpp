// The planner against the seed's figures, hand formulas, and what the strategies really do.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <tuple>

#include "cp_harness.hpp"
#include "cpattn/placement.hpp"
#include "cpattn/planner.hpp"
#include "cpattn/schedule.hpp"
#include "harness/whole_problem.hpp"

namespace cpattn {
namespace {

// A run's counted collectives as the planner gives them (harness::largest_over_ranks), after each rank's
// against the schedule made for that rank from the row's segment ids (its own route and keys).
std::vector<CollectiveRecord> largest_over_ranks(const testing::CpCase& c, const testing::CpRun& run) {
  const std::vector<std::int32_t> ids =
      c.segments.empty() ? std::vector<std::int32_t>{} : segment_ids_from_lengths(c.batch, c.segments);
  std::vector<harness::RankReport> ranks(run.records.size());
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    ScheduleOptions o{c.remat, !c.segments.empty(), static_cast<std::int64_t>(r)};
    o.block = c.kernel.block_kv;
    o.segments = &ids;
    EXPECT_EQ(run.records[r], scheduled_records(strategy_schedule(c.attention(), c.parallel(), o), c.cp))
        << "rank " << r;
    ranks[r].collectives = run.records[r];
  }
  return harness::largest_over_ranks(ranks);
}

constexpr std::int64_t kMiB = 1 << 20;

// A preset's model at S = 65536, bf16, on h200.
PlanRequest preset_request(const std::string& preset, std::int64_t cp) {
  const ModelPreset* q = find_preset(preset);
  PlanRequest r;
  r.attention.seq_len = 65536;
  r.attention.num_q_heads = q->num_q_heads;
  r.attention.num_kv_heads = q->num_kv_heads;
  r.attention.head_dim = q->head_dim;
  r.attention.dtype = DType::bf16;
  r.parallel.cp = cp;
  r.model = q->model;
  r.hardware = *find_hardware("h200");
  return r;
}

PlanRequest seed_request(std::int64_t cp) {
  return preset_request("qwen3.5-397b-a17b", cp);
}

const StrategyPlan& by_name(const Plan& p, const std::string& name) {
  return *std::find_if(p.strategies.begin(), p.strategies.end(),
                       [&](const StrategyPlan& s) { return s.name == name; });
}

TEST(Planner, SeedAllGatherMoves64MiBPerKvTensor) {
  const Plan p = make_plan(seed_request(4));
  const auto& ag = by_name(p, "all_gather");
  ASSERT_EQ(ag.collectives.front().kind, CollectiveKind::all_gather);
  EXPECT_EQ(ag.collectives.front().count, 2);
  EXPECT_EQ(ag.collectives.front().bytes / 2, 64 * kMiB);
  EXPECT_EQ(find_preset("qwen3.5-397b-a17b")->model.attention_layers(), 15);
}

TEST(Planner, SeedPlacementAtCp4AndCp8) {
  for (std::int64_t cp : {4, 8}) {
    const PlanRequest r = seed_request(cp);
    ParallelSpec p = r.parallel;
    p.strategy = Strategy::ulysses;
    const auto ranks = head_placement(r.attention, p);
    for (std::int64_t rank = 0; rank < cp; ++rank) {
      EXPECT_EQ(ranks[rank].q_heads.begin, 32 / cp * rank);
      EXPECT_EQ(ranks[rank].kv_heads, std::vector<std::int64_t>{rank / (cp / 2)});
    }
  }
}

TEST(Planner, CausalTilesFollowTheFormulas) {
  const Plan p = make_plan(seed_request(4));
  const std::int64_t n = 65536 / 512 / 4, T = 65536 / 512;
  const auto& ag = by_name(p, "all_gather");
  for (std::int64_t r = 0; r < 4; ++r)
    EXPECT_EQ(ag.tiles_per_rank_per_q_head[r], n * n * r + n * (n + 1) / 2);
  const auto& lb = by_name(p, "all_gather_load_balanced");
  for (auto t : lb.tiles_per_rank_per_q_head) EXPECT_EQ(t, lb.tiles_per_rank_per_q_head[0]);
  EXPECT_DOUBLE_EQ(lb.tiles_skew, 1.0);
  const auto& u = by_name(p, "ulysses");
  for (auto t : u.tiles_per_rank_per_q_head) EXPECT_EQ(t, T * (T + 1) / 2);
  EXPECT_EQ(lb.tiles_per_rank, u.tiles_per_rank);
}

TEST(Planner, PackedSegmentsSkewLoadBalanceAgainButNotUlysses) {
  PlanRequest r = seed_request(4);
  r.segments = {61440, 4096};
  const Plan p = make_plan(r);
  EXPECT_GT(by_name(p, "all_gather_load_balanced").tiles_skew, 1.2);
  EXPECT_DOUBLE_EQ(by_name(p, "ulysses").tiles_skew, 1.0);
}

TEST(Planner, ReorderIsEightPermutesOf64MiBPerLayer) {
  const Plan p = make_plan(seed_request(4));
  const auto& lb = by_name(p, "all_gather_load_balanced");
  std::int64_t count = 0;
  for (const auto& c : lb.reorder) {
    EXPECT_EQ(c.kind, CollectiveKind::collective_permute);
    EXPECT_EQ(c.bytes, c.count * 64 * kMiB);
    count += c.count;
  }
  EXPECT_EQ(count, 8);
  EXPECT_TRUE(by_name(p, "all_gather").reorder.empty());
  EXPECT_TRUE(by_name(p, "ulysses").reorder.empty());
}

TEST(Planner, ImpossibleUlyssesIsExplained) {
  PlanRequest r = seed_request(4);
  r.attention.num_q_heads = 2;  // fewer q heads than ranks
  r.attention.num_kv_heads = 2;
  const Plan p = make_plan(r);
  EXPECT_FALSE(by_name(p, "ulysses").possible);
  EXPECT_NE(p.recommendation.find("ulysses is impossible"), std::string::npos) << p.recommendation;
  r.attention.seq_len = 65537;  // a general rule: an error, as validate gives
  EXPECT_THROW(make_plan(r), Error);
}

// The planner's collectives are the ones the strategies count when they run (each field the largest over the
// ranks: a packed ring's direct messages carry each rank's own rows).
TEST(Planner, PredictionsEqualWhatRunCounted) {
  auto sorted = [](std::vector<CollectiveRecord> v) {
    std::sort(v.begin(), v.end(), [](const auto& a, const auto& b) {
      return std::tie(a.kind, a.phase) < std::tie(b.kind, b.phase);
    });
    return v;
  };
  // Every strategy, with and without load balance where it is valid, both dtypes, remat, packed.
  int cases = 0;
  for (Strategy strategy : kStrategies) {
    for (bool load_balance : {false, true}) {
      for (DType dtype : {DType::f32, DType::bf16}) {
        for (bool remat : {false, true}) {
          for (bool packed : {false, true}) {
            testing::CpCase c;
            c.strategy = strategy;
            c.load_balance = load_balance;
            c.remat = remat;
            if (strategy_traits(strategy).sub_groups) c.ulysses_degree = 2;
            c.hq = 8;
            c.hkv = 2;
            c.dim = 16;
            c.seq = 128;
            c.batch = 2;
            c.dtype = dtype;
            if (packed) c.segments = {100, 28};
            if (!validation_errors(c.attention(), c.parallel()).empty()) continue;
            if (remat && !strategy_traits(strategy).remat) continue;  // refused: ring, hybrid
            SCOPED_TRACE(c.name());
            ++cases;
#if defined(__SANITIZE_THREAD__)
            // Under TSan a third of the cases (every strategy among them): the accounting is the same
            // arithmetic in every build, the threads the same in every case.
            if (cases % 3 != 0) continue;
#endif
            const auto run = testing::run_context_parallel(c, testing::make_whole_inputs(c, 3));
            const auto predicted = attention_collectives(c.attention(), c.parallel(), remat, c.segments);
            EXPECT_EQ(sorted(largest_over_ranks(c, run)), sorted(predicted));
          }
        }
      }
    }
  }
  EXPECT_EQ(cases, 40)
      << "all_gather and ulysses in 8 variants each, ring and hybrid (U = 2) 4 each (no remat), "
         "each load-balanced too but ulysses";
  // The layouts cut by documents, on the strategies that shard the sequence (a pack whose documents are not
  // multiples of 2cp tokens: uneven runs).
  for (Strategy strategy : {Strategy::all_gather, Strategy::ring, Strategy::hybrid}) {
    for (ShardLayout layout : {ShardLayout::per_document, ShardLayout::solver}) {
      testing::CpCase c;
      c.strategy = strategy;
      c.layout = layout;
      if (strategy_traits(strategy).sub_groups) c.ulysses_degree = 2;
      c.hq = 8;
      c.hkv = 2;
      c.dim = 16;
      c.seq = 128;
      c.segments = {3, 97, 28};
      SCOPED_TRACE(c.name());
      ASSERT_TRUE(validation_errors(c.attention(), c.parallel()).empty());
      const auto run = testing::run_context_parallel(c, testing::make_whole_inputs(c, 3));
      const auto predicted = attention_collectives(c.attention(), c.parallel(), false, c.segments);
      EXPECT_EQ(sorted(largest_over_ranks(c, run)), sorted(predicted));
    }
  }
}

// Sliding windows, soft-caps and sinks: every strategy's planned tiles per rank are the ones its run
// computed, and its collectives the ones it counted (the windowed ring's and all_gather's rows within reach,
// each field the largest over ranks; sinks move nothing more), on a packed row.
TEST(Planner, WindowedPlansEqualWhatRunCounted) {
  auto sorted = [](std::vector<CollectiveRecord> v) {
    std::sort(v.begin(), v.end(), [](const auto& a, const auto& b) {
      return std::tie(a.kind, a.phase, a.bytes) < std::tie(b.kind, b.phase, b.bytes);
    });
    return v;
  };
  const std::tuple<Strategy, bool, const char*> setups[] = {
      {Strategy::ulysses, false, "ulysses"},
      {Strategy::all_gather, false, "all_gather"},
      {Strategy::all_gather, true, "all_gather_load_balanced"},
      {Strategy::ring, false, "ring"},
      {Strategy::ring, true, "ring_load_balanced"},
      {Strategy::hybrid, true, "hybrid_u2_r2_load_balanced"}};
  int variant = 0;
  for (const auto& [strategy, lb, name] : setups) {
    for (const bool causal : {true, false}) {
      testing::CpCase c;
      c.strategy = strategy;
      c.load_balance = lb;
      if (strategy == Strategy::hybrid) c.ulysses_degree = 2;
      c.cp = 4;
      c.hq = 8;
      c.hkv = 2;
      c.dim = 16;
      c.seq = 512;
      c.segments = {300, 212};
      c.causal = causal;
      c.window_left = causal ? 40 : 30;
      if (!causal) c.window_right = 10;
      if (variant % 2 == 0) c.softcap = 20.0;
      c.sinks = variant++ % 3 != 0;  // each rank's share of dsinks stays on it: no collective
      SCOPED_TRACE(c.name());
      const auto run = testing::run_context_parallel(c, testing::make_whole_inputs(c, 3));
      PlanRequest r;
      r.attention = c.attention();
      r.parallel = c.parallel();
      r.block = 64;  // the kernel's block
      r.segments = c.segments;
      r.hardware = *find_hardware("h200");
      const Plan plan = make_plan(r);
      const StrategyPlan& planned = by_name(plan, name);
      ASSERT_EQ(planned.name, name);
      EXPECT_EQ(planned.tiles_per_rank, run.tiles_per_rank);
      // The windowed ring's (ring, hybrid) records differ by rank, as hybrid's do by ulysses rank: the plan
      // gives each field's largest over the ranks.
      EXPECT_EQ(sorted(largest_over_ranks(c, run)), sorted(planned.collectives));
    }
  }
}

// The windowed ring at the size the windows issue names: Qwen3.5's heads, S = 65536, cp = 8, a 1024-token
// window. Its permutes (the K/V and dK/dV shifts, forward and backward) send at most a sixth of the
// windowless ring's bytes, contiguous and zigzag alike (the plan's bytes are what a run counts:
// WindowedPlansEqualWhatRunCounted), and the plan prices fewer, smaller hops.
TEST(Planner, AWindowedRingPlansASixthOfTheBytesOrLess) {
  auto permuted = [](const StrategyPlan& s) {
    std::int64_t bytes = 0;
    for (const CollectiveRecord& x : s.collectives)
      bytes += x.kind == CollectiveKind::collective_permute ? x.bytes_sent_per_rank : 0;
    return bytes;
  };
  PlanRequest r = seed_request(8);
  r.attention.causal = true;
  const Plan whole = make_plan(r);
  r.attention.window_left = 1023;
  const Plan windowed = make_plan(r);
  for (const char* name : {"ring", "ring_load_balanced"}) {
    SCOPED_TRACE(name);
    const StrategyPlan &w = by_name(windowed, name), &full = by_name(whole, name);
    EXPECT_GT(permuted(w), 0);
    EXPECT_LE(6 * permuted(w), permuted(full)) << permuted(w) << " of " << permuted(full);
    EXPECT_LT(w.communication_seconds, full.communication_seconds);
  }
}

// Interleaved local and global layers (gemma3-27b: 52 local layers of 1024 keys, 10 global, at S = 65536):
// each strategy's local entry is the plan of a one-layer model whose attention has the local window, the
// model's time is the two kinds' layers added, and each kind gets its own recommendation (the local layers'
// among the strategies with the global recommendation's layout).
TEST(Planner, LocalLayersArePlannedAsTheirWindowAndAddedToTheModel) {
  const ModelPreset* g = find_preset("gemma3-27b");
  ASSERT_NE(g, nullptr);
  PlanRequest r = preset_request("gemma3-27b", 8);
  ASSERT_EQ(r.model.global_layers(), 10);
  ASSERT_EQ(r.model.local_layers(), 52);
  const Plan plan = make_plan(r);
  PlanRequest local = r;
  local.attention.window_left = 1023;
  local.model = {"one", g->model.emb_dim, 1, 1, {}, 1};
  const Plan alone = make_plan(local);
  ASSERT_EQ(plan.strategies.size(), alone.strategies.size());
  std::size_t best_local = plan.strategies.size();
  for (std::size_t i = 0; i < plan.strategies.size(); ++i) {
    const StrategyPlan &s = plan.strategies[i], &a = alone.strategies[i];
    SCOPED_TRACE(s.name);
    ASSERT_TRUE(s.local != nullptr);
    if (!s.possible) continue;
    EXPECT_EQ(s.local->collectives, a.collectives);
    EXPECT_EQ(s.local->tiles_per_rank, a.tiles_per_rank);
    EXPECT_DOUBLE_EQ(s.local->layer_seconds, a.layer_seconds);
    EXPECT_NEAR(s.model_seconds, 10 * s.layer_seconds + 52 * a.layer_seconds, 1e-12 * s.model_seconds);
    EXPECT_LT(a.layer_seconds, s.layer_seconds);  // a window of 1024 keys is cheaper than the whole row
    const bool same_layout = s.load_balance == plan.strategies[plan.recommended].load_balance;
    if (same_layout && (best_local == plan.strategies.size() ||
                        a.layer_seconds < alone.strategies[best_local].layer_seconds))
      best_local = i;
    EXPECT_GE(s.local->exposed_seconds, 0.0);
  }
  ASSERT_TRUE(plan.recommended_local.has_value());
  EXPECT_EQ(*plan.recommended_local, best_local);
  EXPECT_EQ(plan.strategies[plan.recommended].local->layer_seconds,
            alone.strategies[plan.recommended].layer_seconds);
  // On a profile with a memory bandwidth (the ring's merges priced), a windowed ring's rank pays for the
  // steps it runs only: its compute is within its layer (exposed >= 0).
  r.hardware = *find_hardware("a100");
  for (const StrategyPlan& s : make_plan(r).strategies) {
    SCOPED_TRACE(s.name + " on a100");
    if (!s.possible) continue;
    EXPECT_GE(s.exposed_seconds, 0.0);
    EXPECT_GE(s.local->exposed_seconds, 0.0);
  }
  // A model without local layers has no local entries.
  r.model.local_window.reset();
  for (const StrategyPlan& s : make_plan(r).strategies) EXPECT_EQ(s.local, nullptr);
}

// Ulysses at any head counts: the bytes of the variable all-to-alls (largest operand, largest sent, over
// ranks) and the tiles per rank with the head skew, predicted as counted, for every shape of kAnyHeadCounts.
TEST(Planner, PredictionsEqualWhatRunCountedAtAnyHeadCounts) {
  auto sorted = [](std::vector<CollectiveRecord> v) {
    std::sort(v.begin(), v.end(), [](const auto& a, const auto& b) {
      return std::tie(a.kind, a.phase, a.bytes) < std::tie(b.kind, b.phase, b.bytes);
    });
    return v;
  };
  int variant = 0;
  for (const testing::HeadCounts& h : testing::kAnyHeadCounts) {
    testing::CpCase c;
    c.hq = h.hq;
    c.hkv = h.hkv;
    c.cp = h.cp;
    c.dim = 16;
    c.seq = 8 * h.cp;
    c.remat = variant % 2 == 1;
    c.dtype = variant % 3 == 0 ? DType::bf16 : DType::f32;
    const bool packed = variant++ % 4 < 2;
    if (packed) c.segments = {c.seq - 5, 5};
    SCOPED_TRACE(c.name());
    const auto run = testing::run_context_parallel(c, testing::make_whole_inputs(c, 3));
    const auto predicted = attention_collectives(c.attention(), c.parallel(), c.remat, c.segments);
    for (const auto& counted : run.records) EXPECT_EQ(sorted(counted), sorted(predicted));

    PlanRequest r;
    r.attention = c.attention();
    r.parallel = c.parallel();
    r.block = 64;  // the kernel's block
    r.segments = c.segments;
    r.remat = c.remat;
    r.hardware = *find_hardware("h200");
    const Plan plan = make_plan(r);
    const StrategyPlan& u = by_name(plan, "ulysses");
    EXPECT_EQ(u.tiles_per_rank, run.tiles_per_rank);
    const UlyssesHeads heads = ulysses_heads(h.hq, h.hkv, h.cp);
    EXPECT_DOUBLE_EQ(u.tiles_skew, heads.work_skew());
  }
}

// hybrid: the planner's collectives are, field by field, the largest any rank counted (at Hq = 24, Hkv = 3,
// U = 4 the ulysses ranks' rings move 1, 2, 2, 1 kv heads), with each call's group; its tiles per rank are
// the ones the ranks computed; one entry per factorisation U x R with 1 < U < cp.
TEST(Planner, HybridPredictionsEqualWhatRunCounted) {
  for (const bool packed : {false, true}) {
    for (const bool lb : {false, true}) {
      testing::CpCase c;
      c.strategy = Strategy::hybrid;
      c.cp = 8;
      c.ulysses_degree = 4;
      c.hq = 24;
      c.hkv = 3;
      c.dim = 16;
      c.seq = 256;
      c.load_balance = lb;
      c.dtype = packed ? DType::bf16 : DType::f32;
      if (packed) c.segments = {200, 56};
      SCOPED_TRACE(c.name());
      const auto run = testing::run_context_parallel(c, testing::make_whole_inputs(c, 3));
      const auto predicted = attention_collectives(c.attention(), c.parallel(), false, c.segments);
      EXPECT_EQ(predicted, largest_over_ranks(c, run));
      EXPECT_NE(run.records[0], run.records[1])
          << "ulysses ranks 0 and 1 move different kv heads round their rings";

      PlanRequest r;
      r.attention = c.attention();
      r.parallel = c.parallel();
      r.block = 64;  // the kernel's block
      r.segments = c.segments;
      r.hardware = *find_hardware("h200");
      const Plan plan = make_plan(r);
      const StrategyPlan& h = by_name(plan, lb ? "hybrid_u4_r2_load_balanced" : "hybrid_u4_r2");
      EXPECT_EQ(h.ulysses_degree, 4);
      EXPECT_EQ(h.ring_degree, 2);
      EXPECT_EQ(h.collectives, predicted);
      EXPECT_EQ(h.tiles_per_rank, run.tiles_per_rank);
      std::vector<std::string> names;
      for (const auto& s : plan.strategies) {
        if (s.strategy == Strategy::hybrid) names.push_back(s.name);
      }
      // On the packed row, the layouts cut by its documents too.
      const std::vector<std::string> packed_names = {
          "hybrid_u2_r4", "hybrid_u2_r4_load_balanced", "hybrid_u2_r4_per_document", "hybrid_u2_r4_solver",
          "hybrid_u4_r2", "hybrid_u4_r2_load_balanced", "hybrid_u4_r2_per_document", "hybrid_u4_r2_solver"};
      EXPECT_EQ(names, packed ? packed_names
                              : (std::vector<std::string>{"hybrid_u2_r4", "hybrid_u2_r4_load_balanced",
                                                          "hybrid_u4_r2", "hybrid_u4_r2_load_balanced"}));
    }
  }
}

// Two hosts of 8 (h200: NVLink inside, 50 GB/s between): what crosses hosts, by hand. ulysses at cp 16 sends
// each peer 1/16 of a shard's heads, 8 of its 15 peers on the other host; hybrid with U = 8 keeps its
// all-to-alls inside a host and only the ring's hops cross, and of those only each host's last rank's (rank 7
// to 8 and 15 to 0 in a ring of 2: every hop); on one host nothing crosses.
TEST(Planner, BytesAcrossHostsFollowThePlacement) {
  PlanRequest r;
  r.attention.seq_len = 4096;
  r.attention.num_q_heads = 32;
  r.attention.num_kv_heads = 8;
  r.attention.head_dim = 128;
  r.attention.dtype = DType::bf16;
  r.parallel.cp = 16;
  r.block = 512;
  r.hardware = *find_hardware("h200");
  const Plan plan = make_plan(r);
  const std::int64_t sl = 4096 / 16, E = 2, D = 128;
  // ulysses: q, k, v, o in forward (k and v: 8 kv heads over 16 ranks, replicated: 1 each), lse, and d_out,
  // dq, dk, dv (fp32) in backward; to each peer on the other host: its heads of this shard.
  const std::int64_t q = sl * 2 * D * E, kv = sl * 1 * D * E, lse = 2 * sl * 4;
  const std::int64_t per_peer = q + 2 * kv + q + lse + q + q + 2 * sl * 1 * D * 4;
  EXPECT_EQ(by_name(plan, "ulysses").inter_host_bytes_sent_per_rank, 8 * per_peer);
  // hybrid U = 8, R = 2: the ring's one K||V hop forward, and backward one K||V hop and two dK||dV hops, of a
  // ulysses rank's 1 kv head for U*S/cp = 2048 tokens.
  const std::int64_t rows = 8 * sl, hop = 2 * rows * 1 * D * E, dhop = 2 * rows * 1 * D * 4;
  EXPECT_EQ(by_name(plan, "hybrid_u8_r2").inter_host_bytes_sent_per_rank, 2 * hop + 2 * dhop);
  r.hardware.ranks_per_host = 16;
  const Plan one_host = make_plan(r);
  for (const auto& s : one_host.strategies) EXPECT_EQ(s.inter_host_bytes_sent_per_rank, 0) << s.name;
}

TEST(Planner, ReorderPredictionEqualsWhatReorderCounted) {
  const std::int64_t cp = 4, S = 64, emb = 8;
  InProcessGroup group(4);
  std::vector<std::vector<CollectiveRecord>> counted(4);
  group.run([&](Communicator& comm) {
    CollectiveCounters::PhaseScope phase(comm.counters(), "forward");
    const Tensor x(DType::bf16, {1, S / cp, 1, emb});
    const Tensor y = reorder_sequence(comm, x, S, ShardLayout::contiguous, ShardLayout::dual_chunk_swap);
    reorder_sequence(comm, y, S, ShardLayout::dual_chunk_swap, ShardLayout::contiguous);
    counted[comm.rank()] = comm.counters().records();
  });
  PlanRequest r;
  r.attention.seq_len = S;
  r.attention.num_q_heads = 4;
  r.attention.num_kv_heads = 4;
  r.attention.head_dim = 8;
  r.attention.dtype = DType::bf16;
  r.parallel.cp = cp;
  r.model = {"test", emb, 2, 2, {}, 1};
  r.block = 8;
  r.hardware = *find_hardware("h100");
  const Plan plan = make_plan(r);
  const auto& lb = by_name(plan, "all_gather_load_balanced");
  std::vector<CollectiveRecord> forward;
  for (const auto& c : lb.reorder) {
    if (c.phase == "forward") forward.push_back(c);
  }
  for (const auto& c : counted) EXPECT_EQ(c, forward);
}

// Between any two layouts (those cut by documents too): each token lands at the slot the target layout gives
// it, a round trip gives the shard back bit for bit, and the contiguous <-> per_document reorder's calls are
// the ones the planner prices for the per_document all_gather.
TEST(Planner, AnyLayoutsReorderMovesEachTokenToItsSlotAsPlanned) {
  const std::int64_t cp = 4, S = 96, emb = 3, B = 2;
  const std::vector<std::int64_t> docs{5, 60, 1, 30};
  const SequenceLayout contiguous = make_layout(ShardLayout::contiguous, S, cp);
  const SequenceLayout per_document = make_layout(ShardLayout::per_document, S, cp, docs);
  const SequenceLayout solver = make_layout(ShardLayout::solver, S, cp, docs, causal_band(true));
  const auto value = [&](std::int64_t b, std::int64_t pos, std::int64_t w) {
    return static_cast<float>(b * 10000 + pos * 10 + w);
  };
  // Rank `rank`'s shard of the row in `layout`: [B, S/cp, 1, emb] of value().
  const auto shard = [&](const SequenceLayout& layout, std::int64_t rank) {
    Tensor t(DType::f32, {B, S / cp, 1, emb});
    const auto positions = layout.positions(rank);
    float* d = t.data<float>();
    for (std::int64_t b = 0; b < B; ++b) {
      for (std::int64_t i = 0; i < S / cp; ++i) {
        for (std::int64_t w = 0; w < emb; ++w) d[(b * S / cp + i) * emb + w] = value(b, positions[i], w);
      }
    }
    return t;
  };
  const auto same = [](const Tensor& a, const Tensor& b) {
    return a.shape() == b.shape() &&
           std::equal(a.data<float>(), a.data<float>() + a.numel(), b.data<float>());
  };
  InProcessGroup group(static_cast<int>(cp));
  std::vector<std::vector<CollectiveRecord>> counted(cp);
  std::vector<int> right(cp, 0);
  group.run([&](Communicator& comm) {
    const std::int64_t r = comm.rank();
    const Tensor x = shard(contiguous, r);
    {
      CollectiveCounters::PhaseScope phase(comm.counters(), "forward");
      const Tensor y = reorder_sequence(comm, x, contiguous, per_document);
      right[r] += same(y, shard(per_document, r));
      right[r] += same(reorder_sequence(comm, y, per_document, contiguous), x);
      counted[r] = comm.counters().records();
    }
    const Tensor z =
        reorder_sequence(comm, reorder_sequence(comm, x, contiguous, solver), solver, per_document);
    right[r] += same(z, shard(per_document, r));
  });
  for (std::int64_t r = 0; r < cp; ++r) EXPECT_EQ(right[r], 3) << "rank " << r;
  PlanRequest req;
  req.attention.seq_len = S;
  req.attention.batch = B;
  req.attention.num_q_heads = 4;
  req.attention.num_kv_heads = 4;
  req.attention.head_dim = 8;
  req.attention.dtype = DType::f32;
  req.parallel.cp = cp;
  req.segments = docs;
  req.model = {"test", emb, 2, 2, {}, 1};
  req.block = 8;
  req.hardware = *find_hardware("h100");
  const Plan plan = make_plan(req);
  std::vector<CollectiveRecord> forward;
  for (const auto& c : by_name(plan, "all_gather_per_document").reorder) {
    if (c.phase == "forward") forward.push_back(c);
  }
  ASSERT_FALSE(forward.empty());
  for (const auto& c : counted) EXPECT_EQ(c, forward);
  // A layout over other ranks, or one that holds a position twice, is refused.
  group.run([&](Communicator& comm) {
    const Tensor x = shard(contiguous, comm.rank());
    EXPECT_THROW(reorder_sequence(comm, x, contiguous, make_layout(ShardLayout::per_document, S, 2, docs)),
                 Error);
    SequenceLayout twice = per_document;
    twice.runs[1] = twice.runs[0];
    EXPECT_THROW(reorder_sequence(comm, x, twice, contiguous), Error);
  });
}

// ---- Prefill: a forward-only plan. ----

// What a forward-only run counts is what a forward-only plan predicts: the forward's calls alone, for every
// strategy, balanced or not, packed or not.
TEST(Planner, ForwardOnlyPredictionsEqualWhatAForwardOnlyRunCounted) {
  auto sorted = [](std::vector<CollectiveRecord> v) {
    std::sort(v.begin(), v.end(), [](const auto& a, const auto& b) {
      return std::tie(a.kind, a.phase, a.group) < std::tie(b.kind, b.phase, b.group);
    });
    return v;
  };
  int cases = 0;
  for (Strategy strategy : kStrategies) {
    for (bool load_balance : {false, true}) {
      for (bool packed : {false, true}) {
        testing::CpCase c;
        c.strategy = strategy;
        c.load_balance = load_balance;
        if (strategy_traits(strategy).sub_groups) c.ulysses_degree = 2;
        c.hq = 8;
        c.hkv = 2;
        c.dim = 16;
        c.seq = 128;
        if (packed) c.segments = {100, 28};
        if (!validation_errors(c.attention(), c.parallel()).empty()) continue;
        SCOPED_TRACE(c.name());
        harness::RunSettings settings;
        settings.forward_only = true;
        const auto run = harness::run_in_process(c.attention(), c.parallel(), settings,
                                                 harness::random_problem(c.attention(), 5, c.segments));
        const auto predicted = attention_collectives(c.attention(), c.parallel(), false, c.segments, true);
        for (const auto& p : predicted) EXPECT_EQ(p.phase, "forward");
        EXPECT_EQ(sorted(harness::largest_over_ranks(run.ranks)), sorted(predicted));
        const auto full = attention_collectives(c.attention(), c.parallel(), false, c.segments);
        EXPECT_LT(predicted.size(), full.size());  // the backward's calls are gone, and only they
        ++cases;
      }
    }
  }
  EXPECT_EQ(cases, 14) << "all_gather, ring, hybrid 4 each (balanced or not, packed or not), ulysses 2";
}

// The plan of a prefill is the forward's share of the full one: compute without the backward's 2.5 passes,
// only the forward's bytes, nothing kept for a backward; the ring's steps against their K/V hops alone.
TEST(Planner, AForwardOnlyPlanIsTheForwardsShare) {
  PlanRequest full = seed_request(8);
  full.attention.seq_len = 16384;
  PlanRequest prefill = full;
  prefill.forward_only = true;
  const Plan a = make_plan(full), b = make_plan(prefill);
  ASSERT_EQ(a.strategies.size(), b.strategies.size());
  for (std::size_t i = 0; i < a.strategies.size(); ++i) {
    const StrategyPlan &f = a.strategies[i], &p = b.strategies[i];
    SCOPED_TRACE(f.name);
    if (!f.possible) continue;
    for (std::size_t r = 0; r < f.compute_seconds_per_rank.size(); ++r) {
      EXPECT_NEAR(p.compute_seconds_per_rank[r] * (1 + kBackwardFlopsPerForward),
                  f.compute_seconds_per_rank[r], 1e-12 * f.compute_seconds_per_rank[r]);
    }
    for (const auto& c : p.collectives) EXPECT_EQ(c.phase, "forward");
    for (const auto& c : p.reorder) EXPECT_EQ(c.phase, "forward");
    EXPECT_EQ(p.memory_bytes_per_rank, 0);
    EXPECT_EQ(p.kv_buffer_bytes_per_rank, f.kv_buffer_bytes_per_rank);
    EXPECT_LT(p.layer_seconds, f.layer_seconds);
    // Every strategy's full layer has backward calls: the prefill's communication is strictly less.
    const bool backward_calls = std::any_of(f.collectives.begin(), f.collectives.end(),
                                            [](const CollectiveRecord& c) { return c.phase == "backward"; });
    EXPECT_TRUE(backward_calls);
    EXPECT_LT(p.communication_seconds, f.communication_seconds);
    EXPECT_EQ(p.tiles_per_rank, f.tiles_per_rank);
  }
  // The ring's forward: each step but the last against its K/V hop, the last alone. With a free network the
  // layer is the busiest rank's forward compute.
  PlanRequest free = prefill;
  free.hardware.bandwidth = 1e30;
  const Plan free_plan = make_plan(free);
  const StrategyPlan& ring = by_name(free_plan, "ring_load_balanced");
  const double busiest =
      *std::max_element(ring.compute_seconds_per_rank.begin(), ring.compute_seconds_per_rank.end());
  EXPECT_NEAR(ring.layer_seconds, busiest, 1e-9 * busiest);
}

TEST(Planner, ForwardOnlyWithRematIsRefused) {
  PlanRequest r = seed_request(4);
  r.forward_only = true;
  r.remat = true;
  try {
    make_plan(r);
    FAIL() << "a forward-only plan with remat was made";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::invalid_config);
    EXPECT_NE(std::string(e.what()).find("forward-only"), std::string::npos) << e.what();
  }
}

// ---- Hardware profiles as data. ----

TEST(HardwareProfiles, EveryCompiledInFileParsesWithItsSource) {
  std::vector<std::string> names;
  for (const HardwareProfile& h : hardware_profiles()) {
    names.push_back(h.name);
    EXPECT_GT(h.flops, 0) << h.name;
    EXPECT_GT(h.bandwidth, 0) << h.name;
    EXPECT_FALSE(h.source.empty()) << h.name;
    if (h.ranks_per_host > 0) {
      EXPECT_GT(h.inter_bandwidth, 0) << h.name;
    }
  }
  EXPECT_EQ(names,
            (std::vector<std::string>{"a100-pcie", "a100", "h100", "h200", "h800", "l20-pcie", "tpu-v7x"}));
  // The figures docs/planner.md's table gives: flops, bandwidth, ranks per host, between hosts.
  const std::vector<std::tuple<std::string, double, double, std::int64_t, double>> figures = {
      {"a100", 312e12, 300e9, 8, 25e9},      {"h100", 989e12, 450e9, 8, 50e9},
      {"h200", 989e12, 450e9, 8, 50e9},      {"h800", 989e12, 200e9, 8, 50e9},
      {"l20-pcie", 119.5e12, 25e9, 8, 25e9}, {"tpu-v7x", 2307e12, 600e9, 0, 600e9},
      {"a100-pcie", 312e12, 4.3e9, 0, 0}};
  for (const auto& [name, flops, bandwidth, per_host, inter] : figures) {
    const HardwareProfile* h = find_hardware(name);
    ASSERT_NE(h, nullptr) << name;
    EXPECT_EQ(h->flops, flops) << name;
    EXPECT_EQ(h->bandwidth, bandwidth) << name;
    EXPECT_EQ(h->ranks_per_host, per_host) << name;
    EXPECT_EQ(h->inter_bandwidth, inter) << name;
  }
  EXPECT_EQ(find_hardware("h2000"), nullptr);
  // The PCIe machines' switches: pairs sharing an uplink; the L20 host's two sockets of four.
  for (const char* name : {"l20-pcie", "a100-pcie"}) {
    EXPECT_EQ(find_hardware(name)->ranks_per_switch, 2) << name;
    EXPECT_EQ(find_hardware(name)->switch_bandwidth, find_hardware(name)->bandwidth) << name;
  }
  EXPECT_EQ(find_hardware("l20-pcie")->ranks_per_socket, 4);
  // The ring's merges at the memory's datasheet rate where the published rings are checked.
  for (const char* name : {"a100", "a100-pcie", "l20-pcie", "h800"}) {
    EXPECT_GT(find_hardware(name)->memory_bandwidth, 0) << name;
  }
  // Measured kernel rates, each with its source.
  for (const char* name : {"a100", "a100-pcie", "l20-pcie", "h800"}) {
    EXPECT_FALSE(find_hardware(name)->kernel.empty()) << name;
    EXPECT_EQ(find_hardware(name)->block, 128) << name;
  }
}

// A profile file read by `plan --profile` is the compiled-in one when it holds the same text: the same plan.
TEST(HardwareProfiles, AFileWithACompiledInProfilesFiguresPlansTheSame) {
  const std::string text =
      "name: mine\nflops: 989e12\nbandwidth: 450e9\nranks_per_host: 8\ninter_bandwidth: 50e9\n"
      "source: copied from h200\n";
  const std::string path = ::testing::TempDir() + "/cpattn_profile_" + std::to_string(::getpid()) + ".yaml";
  {
    std::ofstream f(path);
    f << text;
  }
  const HardwareProfile mine = read_hardware_profile(path);
  std::remove(path.c_str());
  EXPECT_EQ(mine.name, "mine");
  PlanRequest a = seed_request(8), b = seed_request(8);
  b.hardware = mine;
  const Plan pa = make_plan(a), pb = make_plan(b);
  ASSERT_EQ(pa.strategies.size(), pb.strategies.size());
  for (std::size_t i = 0; i < pa.strategies.size(); ++i) {
    EXPECT_EQ(pa.strategies[i].layer_seconds, pb.strategies[i].layer_seconds) << pa.strategies[i].name;
  }
  EXPECT_EQ(pa.recommendation, pb.recommendation);
}

TEST(HardwareProfiles, ABadProfileNamesItsFileAndKey) {
  const std::string good = "name: x\nflops: 1e12\nbandwidth: 1e9\nsource: a test\n";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"name: x\nbandwidth: 1e9\nsource: s\n", "key 'flops' is missing"},
      {good + "flop: 3\n", "did you mean 'flops'?"},
      {"name: x\nflops: fast\nbandwidth: 1e9\nsource: s\n", "flops"},
      {"name: x\nflops: -1\nbandwidth: 1e9\nsource: s\n", "flops"},
      {"name: x\nflops: 1e12\nbandwidth: 0x10\nsource: s\n", "bandwidth"},
      {good + "ranks_per_host: 8\n", "give inter_bandwidth"},
      {good + "ranks_per_host: -2\n", "ranks_per_host"},
      {good + "flops: 2e12\n", "given twice"},
      {"name: X Y\nflops: 1e12\nbandwidth: 1e9\nsource: s\n", "not a profile name"},
      {"name: x\nflops: 1e12\nbandwidth: 1e9\nsource: ''\n", "source is empty"},
      {good + "---\nname: y\n", "one YAML mapping"},
      {"- a\n- b\n", "one YAML mapping"},
      {"name: [x]\n", "plain word or number"},
      {"name: x\nflops: [1\n", "not valid YAML"},
      {"", "one YAML mapping"},
      {"# only a comment\n", "one YAML mapping"},
      {"name: x\nflops:\nbandwidth: 1e9\nsource: s\n", "key 'flops' has no value"},
      {"name: x\nflops: .inf\nbandwidth: 1e9\nsource: s\n", "flops"},
      {"name: x\nflops: 1e31\nbandwidth: 1e9\nsource: s\n", "flops"},
      {good + "ranks_per_switch: 2\n", "give switch_bandwidth"},
      {good + "ranks_per_host: 8\ninter_bandwidth: 1e9\nranks_per_switch: 3\nswitch_bandwidth: 1e9\n",
       "must divide ranks_per_host"},
      {good + "latency: -1e-6\n", "latency"},
      {good + "ranks_per_socket: 4\n", "give socket_bandwidth"},
      {good + "ranks_per_switch: 2\nswitch_bandwidth: 1e9\nranks_per_socket: 3\nsocket_bandwidth: 1e9\n",
       "must be a multiple of ranks_per_switch"},
      {good + "ranks_per_host: 8\ninter_bandwidth: 1e9\nranks_per_socket: 3\nsocket_bandwidth: 1e9\n",
       "must divide ranks_per_host"},
      {good + "memory_bandwidth: 0\n", "memory_bandwidth"},
      {good + "merge_bytes: -3\n", "merge_bytes"},
      {good + "kernel: 3\n", "kernel is a list"},
      {good + "kernel:\n  - {dtype: fp32, head_dim: 64, q: 256, kv: 256, causal: false, forward: 1e9}\n",
       "key 'backward' is missing"},
      {good + "kernel:\n  - {dtype: fp16, head_dim: 64, q: 256, kv: 256, causal: false, forward: 1e9, "
              "backward: 1e9}\n",
       "kernel[0]"},
      {good + "kernel:\n  - {dtype: fp32, head_dim: 64, q: 256, kv: 256, causal: maybe, forward: 1e9, "
              "backward: 1e9}\n",
       "not true or false"},
      {good + "kernel:\n  - {dtype: fp32, head_dim: 0, q: 256, kv: 256, causal: false, forward: 1e9, "
              "backward: 1e9}\n",
       "head_dim"},
      {good + "kernel:\n  - {dtype: fp32, head_dim: 64, q: 256, kv: 256, causal: false, forward: 0, "
              "backward: 1e9}\n",
       "forward"},
  };
  for (const auto& [text, phrase] : cases) {
    try {
      parse_hardware_profile(text, "p.yaml");
      ADD_FAILURE() << "accepted:\n" << text;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::invalid_input) << e.what();
      EXPECT_NE(std::string(e.what()).find("p.yaml: "), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(phrase), std::string::npos) << phrase << " in: " << e.what();
      EXPECT_EQ(e.items().front().fields.front().rfind("p.yaml", 0), 0u) << e.items().front().fields.front();
    }
  }
}

// ---- The cost model's terms, each against a hand computation. ----

// One rank pair, ulysses at cp = 2 on a profile whose every term is off but the one under test.
PlanRequest small_request() {
  PlanRequest r;
  r.attention.seq_len = 4096;
  r.attention.num_q_heads = 4;
  r.attention.num_kv_heads = 4;
  r.attention.head_dim = 64;
  r.attention.dtype = DType::f32;
  r.attention.causal = false;
  r.parallel.cp = 2;
  r.block = 64;
  r.hardware.name = "test";
  r.hardware.flops = 1e11;
  r.hardware.bandwidth = 1e30;  // communication free unless a test prices it
  r.hardware.source = "a test";
  return r;
}

// A soft-cap multiplies each kernel call's time by the profile's factor and nothing else: a forward-only
// plan's compute per rank is the uncapped one's times softcap_forward (no launch cost here), a whole layer's
// lies between the two factors' products, and at factor 1 nothing changes.
TEST(CostModel, ASoftCapCostsTheProfilesFactor) {
  PlanRequest r = seed_request(4);
  r.forward_only = true;
  const Plan plain = make_plan(r);
  r.attention.softcap = 30.0;
  EXPECT_EQ(make_plan(r).strategies[0].compute_seconds_per_rank,
            plain.strategies[0].compute_seconds_per_rank);
  r.hardware.softcap_forward = 1.5;
  r.hardware.softcap_backward = 1.25;
  const Plan capped = make_plan(r);
  for (std::size_t i = 0; i < plain.strategies.size(); ++i) {
    const StrategyPlan &a = plain.strategies[i], &b = capped.strategies[i];
    SCOPED_TRACE(a.name);
    if (!a.possible) continue;
    for (std::size_t k = 0; k < a.compute_seconds_per_rank.size(); ++k)
      EXPECT_NEAR(b.compute_seconds_per_rank[k], 1.5 * a.compute_seconds_per_rank[k],
                  1e-12 * b.compute_seconds_per_rank[k]);
  }
  r.forward_only = false;
  r.attention.softcap.reset();
  const Plan both = make_plan(r);
  r.attention.softcap = 30.0;
  const Plan both_capped = make_plan(r);
  const double a = both.strategies[0].compute_seconds_per_rank[0],
               b = both_capped.strategies[0].compute_seconds_per_rank[0];
  EXPECT_GT(b, 1.25 * a);
  EXPECT_LT(b, 1.5 * a);
}

TEST(CostModel, ProfileRoundTripsThroughItsYaml) {
  HardwareProfile p;
  p.name = "calibrated";
  p.flops = 2.5e11;
  p.bandwidth = 1.5e10;
  p.latency = 2.25e-5;
  p.ranks_per_host = 4;
  p.inter_bandwidth = 1e9;
  p.inter_latency = 1e-4;
  p.ranks_per_switch = 2;
  p.switch_bandwidth = 3e9;
  p.ranks_per_socket = 2;
  p.socket_bandwidth = 2e9;
  p.socket_all_to_all_bandwidth = 1.5e9;
  p.socket_latency = 3e-5;
  p.ring_step_seconds = 1e-5;
  p.memory_bandwidth = 4e10;
  p.merge_bytes = 33;
  p.accumulate_bytes = 10;
  p.call_seconds = 2e-6;
  p.softcap_forward = 1.2;
  p.softcap_backward = 1.125;
  p.cores = 2;
  p.block = 64;
  p.all_to_all_bandwidth = 4e9;
  p.kernel = {{DType::f32, 64, 256, 1024, true, 1.25e11, 1.5e11},
              {DType::bf16, 128, 4096, 4096, false, 3e11, 2e11}};
  p.source = "measured: here, \"quoted\" and a: colon";
  const HardwareProfile q = parse_hardware_profile(profile_yaml(p), "round trip");
  EXPECT_EQ(q.name, p.name);
  EXPECT_EQ(q.flops, p.flops);
  EXPECT_EQ(q.bandwidth, p.bandwidth);
  EXPECT_EQ(q.latency, p.latency);
  EXPECT_EQ(q.ranks_per_host, p.ranks_per_host);
  EXPECT_EQ(q.inter_bandwidth, p.inter_bandwidth);
  EXPECT_EQ(q.inter_latency, p.inter_latency);
  EXPECT_EQ(q.ranks_per_switch, p.ranks_per_switch);
  EXPECT_EQ(q.switch_bandwidth, p.switch_bandwidth);
  EXPECT_EQ(q.all_to_all_bandwidth, p.all_to_all_bandwidth);
  EXPECT_EQ(q.ranks_per_socket, p.ranks_per_socket);
  EXPECT_EQ(q.socket_bandwidth, p.socket_bandwidth);
  EXPECT_EQ(q.socket_all_to_all_bandwidth, p.socket_all_to_all_bandwidth);
  EXPECT_EQ(q.socket_latency, p.socket_latency);
  EXPECT_EQ(q.memory_bandwidth, p.memory_bandwidth);
  EXPECT_EQ(q.merge_bytes, p.merge_bytes);
  EXPECT_EQ(q.accumulate_bytes, p.accumulate_bytes);
  EXPECT_EQ(q.softcap_forward, p.softcap_forward);
  EXPECT_EQ(q.softcap_backward, p.softcap_backward);
  EXPECT_EQ(q.ring_step_seconds, p.ring_step_seconds);
  EXPECT_EQ(q.call_seconds, p.call_seconds);
  EXPECT_EQ(q.cores, p.cores);
  EXPECT_EQ(q.block, p.block);
  EXPECT_EQ(q.source, p.source);
  ASSERT_EQ(q.kernel.size(), 2u);
  EXPECT_EQ(q.kernel[0].dtype, DType::f32);
  EXPECT_EQ(q.kernel[0].q, 256);
  EXPECT_EQ(q.kernel[0].kv, 1024);
  EXPECT_TRUE(q.kernel[0].causal);
  EXPECT_EQ(q.kernel[0].forward, 1.25e11);
  EXPECT_EQ(q.kernel[1].backward, 2e11);
}

TEST(CostModel, KernelRateIsTheEntryAtItsShapeAndBetweenEntriesInBetween) {
  HardwareProfile p;
  p.flops = 7e10;
  p.kernel = {{DType::f32, 64, 256, 256, false, 1e11, 2e11},
              {DType::f32, 64, 4096, 4096, false, 3e11, 4e11},
              {DType::f32, 64, 4096, 4096, true, 5e11, 6e11}};
  EXPECT_EQ(p.kernel_rate(DType::f32, 64, 256, 256, false, false), 1e11);
  EXPECT_EQ(p.kernel_rate(DType::f32, 64, 4096, 4096, false, true), 4e11);
  EXPECT_EQ(p.kernel_rate(DType::f32, 64, 4096, 4096, true, false), 5e11);
  // Half way in log2 between the two non-causal entries: their mean.
  EXPECT_NEAR(p.kernel_rate(DType::f32, 64, 1024, 1024, false, false), 2e11, 1e3);
  // Causal calls read the causal entries where there are any.
  EXPECT_EQ(p.kernel_rate(DType::f32, 64, 256, 256, true, false), 5e11);
  // No entry of the dtype: the profile's flops.
  EXPECT_EQ(p.kernel_rate(DType::bf16, 64, 256, 256, false, false), 7e10);
  // Another head dim is a rate of its own, however far its entry's extents: half way in log2 between head
  // dims 64 and 256 the geometric mean, beyond them the nearest head dim's rate.
  p.kernel.push_back({DType::f32, 256, 65536, 65536, false, 4e11, 8e11});
  EXPECT_NEAR(p.kernel_rate(DType::f32, 128, 4096, 4096, false, false), std::sqrt(3e11 * 4e11), 1e3);
  EXPECT_EQ(p.kernel_rate(DType::f32, 512, 256, 256, false, false), 4e11);
  EXPECT_EQ(p.kernel_rate(DType::f32, 32, 4096, 4096, false, true), 4e11);
}

// The per-call rate: ulysses at cp = 2 is one call of 4096 x 4096 per rank over its 2 heads.
TEST(CostModel, KernelTimeIsTilesOverTheCallsRate) {
  PlanRequest r = small_request();
  r.forward_only = true;
  const double flops = 4.0 * 4096 * 4096 * 64 * 2;  // one rank's two heads, every tile computed
  const double before = by_name(make_plan(r), "ulysses").layer_seconds;
  EXPECT_NEAR(before, flops / 1e11, 1e-9);
  r.hardware.kernel = {{DType::f32, 64, 4096, 4096, false, 4e11, 1e11}};
  const double after = by_name(make_plan(r), "ulysses").layer_seconds;
  EXPECT_NEAR(after, flops / 4e11, 1e-9);
  r.hardware.call_seconds = 1e-3;  // one call per rank
  EXPECT_NEAR(by_name(make_plan(r), "ulysses").layer_seconds, flops / 4e11 + 1e-3, 1e-9);
  // The backward: 2.5x the FLOPs at the backward's rate.
  r.forward_only = false;
  r.hardware.call_seconds = 0;
  EXPECT_NEAR(by_name(make_plan(r), "ulysses").layer_seconds, flops / 4e11 + 2.5 * flops / 1e11, 1e-9);
}

// The latency: each all-to-all of ulysses at cp = 2 is one message per rank.
TEST(CostModel, EveryMessageCostsTheLatency) {
  PlanRequest r = small_request();
  r.forward_only = true;
  const StrategyPlan base = by_name(make_plan(r), "ulysses");
  r.hardware.latency = 1e-3;
  const StrategyPlan with = by_name(make_plan(r), "ulysses");
  std::int64_t calls = 0;
  for (const auto& c : with.collectives) calls += c.count;
  EXPECT_EQ(calls, 5);  // Q, K, V in; O and LSE back
  EXPECT_NEAR(with.communication_seconds - base.communication_seconds, 5e-3, 1e-12);
  // At cp = 4 every all-to-all is three messages per rank.
  r.parallel.cp = 4;
  const double base4 = [&] {
    PlanRequest z = r;
    z.hardware.latency = 0;
    return by_name(make_plan(z), "ulysses").communication_seconds;
  }();
  EXPECT_NEAR(by_name(make_plan(r), "ulysses").communication_seconds - base4, 15e-3, 1e-12);
}

// The overlap rule: a ring step costs max(compute, hop) plus the step's synchronisation.
TEST(CostModel, RingStepIsTheLongerOfComputeAndHopPlusItsSync) {
  PlanRequest r = small_request();
  r.forward_only = true;
  const double step_flops = 4.0 * 2048 * 2048 * 64 * 4;  // cp = 2: each step 2048 x 2048 over 4 heads
  const double compute = step_flops / 1e11;
  // Free links: two steps of compute.
  EXPECT_NEAR(by_name(make_plan(r), "ring").layer_seconds, 2 * compute, 1e-9);
  // A hop longer than a step's compute: step 0 waits for it, the last step does not hop.
  const double kv_bytes = 2.0 * 2048 * 4 * 64 * 4;  // K||V of one rank's rows, fp32
  r.hardware.bandwidth = kv_bytes / (3 * compute);
  EXPECT_NEAR(by_name(make_plan(r), "ring").layer_seconds, 3 * compute + compute, 1e-9);
  r.hardware.ring_step_seconds = 1e-3;
  EXPECT_NEAR(by_name(make_plan(r), "ring").layer_seconds, 3 * compute + compute + 2e-3, 1e-9);
}

// The topology: four ranks behind two switches of two; ulysses's all-to-all sends half of each rank's bytes
// out of its switch, and both ranks of a switch share its uplink.
TEST(CostModel, ASharedSwitchSlowsWhatCrossesIt) {
  PlanRequest r = small_request();
  r.parallel.cp = 4;
  r.forward_only = true;
  r.hardware.bandwidth = 1e9;
  const StrategyPlan flat = by_name(make_plan(r), "ulysses");
  // Every rank sends 3/4 of each operand at 1 GB/s on its own link.
  double sent = 0;
  for (const auto& c : flat.collectives) sent += static_cast<double>(c.bytes_sent_per_rank);
  EXPECT_NEAR(flat.communication_seconds, sent / 1e9, 1e-9);
  r.hardware.ranks_per_switch = 2;
  r.hardware.switch_bandwidth = 1e9;
  const StrategyPlan shared = by_name(make_plan(r), "ulysses");
  // Out of each switch: 2 ranks x 2/3 of what each sends, over one 1 GB/s uplink.
  EXPECT_NEAR(shared.communication_seconds, 2 * (2.0 / 3.0) * sent / 1e9, 1e-9);
  // A fast uplink: the device links bound it again.
  r.hardware.switch_bandwidth = 1e12;
  EXPECT_NEAR(by_name(make_plan(r), "ulysses").communication_seconds, sent / 1e9, 1e-9);
}

// Sockets above the switches: eight ranks, switches of two, sockets of four. ulysses's all-to-all at cp = 8
// sends 4/7 of each rank's bytes out of its socket (a socket's four ranks share its link) and 6/7 out of its
// switch; the slower of the two links bounds the call, an all-to-all at the socket's all-to-all rate, and
// each message to the other socket pays socket_latency on top.
TEST(CostModel, ASocketsLinkCarriesWhatLeavesIt) {
  PlanRequest r = small_request();
  r.attention.num_q_heads = 8;
  r.attention.num_kv_heads = 8;
  r.parallel.cp = 8;
  r.forward_only = true;
  r.hardware.bandwidth = 1e9;
  r.hardware.ranks_per_switch = 2;
  r.hardware.switch_bandwidth = 1e12;
  double sent = 0;
  const Plan flat = make_plan(r);  // kept: by_name returns a reference into it
  for (const auto& c : by_name(flat, "ulysses").collectives)
    sent += static_cast<double>(c.bytes_sent_per_rank);
  EXPECT_NEAR(by_name(flat, "ulysses").communication_seconds, sent / 1e9, 1e-9);
  r.hardware.ranks_per_socket = 4;
  r.hardware.socket_bandwidth = 1e9;
  r.hardware.socket_all_to_all_bandwidth = 5e8;
  const double socket = 4 * (4.0 / 7.0) * sent / 5e8;
  EXPECT_NEAR(by_name(make_plan(r), "ulysses").communication_seconds, socket, 1e-9);
  // The socket's latency: 4 messages of each all-to-all leave the socket, 3 stay (at `latency`, 0 here).
  r.hardware.socket_latency = 1e-3;
  EXPECT_NEAR(by_name(make_plan(r), "ulysses").communication_seconds, socket + 5 * 4e-3, 1e-9);
  r.hardware.latency = 2e-3;  // 3 x 2 ms in the socket against 4 x 1 ms out of it: the longer, per call
  EXPECT_NEAR(by_name(make_plan(r), "ulysses").communication_seconds, socket + 5 * 6e-3, 1e-9);
}

// A ring step's work outside its calls, at memory_bandwidth: the forward folds each call's output rows
// (merge_bytes per element), the backward sums dQ, dK and dV of each call and the step's dK/dV into the
// travelling accumulator (accumulate_bytes per element). Without memory_bandwidth it is not priced.
TEST(CostModel, ARingStepsMergesMoveItsOutputThroughMemory) {
  PlanRequest r = small_request();
  r.forward_only = true;
  const double compute = 4.0 * 2048 * 2048 * 64 * 4 / 1e11;  // cp = 2: each step 2048 x 2048 over 4 heads
  EXPECT_NEAR(by_name(make_plan(r), "ring").layer_seconds, 2 * compute, 1e-9);
  r.hardware.memory_bandwidth = 1e9;
  const double out = 2048.0 * 4 * 64;  // a step's output elements per rank: its rows x heads x D
  EXPECT_NEAR(by_name(make_plan(r), "ring").layer_seconds, 2 * (compute + out * 12 / 1e9), 1e-9);
  r.hardware.merge_bytes = 30;
  EXPECT_NEAR(by_name(make_plan(r), "ring").layer_seconds, 2 * (compute + out * 30 / 1e9), 1e-9);
  // Not a ring: nothing to merge.
  EXPECT_NEAR(by_name(make_plan(r), "ulysses").layer_seconds, 2 * compute, 1e-9);
  // The backward: per step the call's dQ (out) and dK, dV (2 x out, kv heads = q heads here), and the step's
  // dK/dV into the accumulator (2 x out), at accumulate_bytes.
  r.forward_only = false;
  r.hardware.accumulate_bytes = 10;
  const double fwd = compute + out * 30 / 1e9, bwd = 2.5 * compute + 5 * out * 10 / 1e9;
  EXPECT_NEAR(by_name(make_plan(r), "ring").layer_seconds, 2 * (fwd + bwd), 1e-9);
}

// The kernel's time from measured entries: entries made from known costs per tile, per query row and per key
// row (no causal entry: the diagonal term is dropped) give those costs back, for a call of another shape.
TEST(CostModel, MeasuredEntriesAreFittedAsCostsPerTileAndRow) {
  const double tile = 2e-6, q_row = 3e-7, kv_row = 5e-8;  // seconds per head
  PlanRequest r = small_request();
  r.attention.seq_len = 2048;
  r.forward_only = true;
  r.hardware.block = 64;
  for (const auto& [q, kv] : std::vector<std::pair<std::int64_t, std::int64_t>>{
           {256, 256}, {256, 1024}, {1024, 256}, {1024, 1024}, {4096, 4096}, {4096, 1024}}) {
    const double tiles = static_cast<double>((q / 64) * (kv / 64));
    const double seconds = tile * tiles + q_row * static_cast<double>(q) + kv_row * static_cast<double>(kv);
    const double rate = tiles * 4.0 * 64 * 64 * 64 / seconds;
    r.hardware.kernel.push_back({DType::f32, 64, q, kv, false, rate, rate});
  }
  // ulysses at cp = 2: one call of 2048 x 2048 per rank over its 2 heads, 32 x 32 tiles each.
  const double want = 2 * (tile * 1024 + q_row * 2048 + kv_row * 2048);
  EXPECT_NEAR(by_name(make_plan(r), "ulysses").layer_seconds, want, 1e-9 * want);
  // The same at the request's own block: the entries' seconds stay the profile's, the call's tiles change.
  r.block = 128;
  EXPECT_NEAR(by_name(make_plan(r), "ulysses").layer_seconds, want, 1e-9 * want);
  // --flops's one rate replaces them (plan_answer clears the entries): the tiles over it.
  r.hardware.kernel.clear();
  r.block = 64;
  EXPECT_NEAR(by_name(make_plan(r), "ulysses").layer_seconds, 2 * 4.0 * 2048 * 2048 * 64 / 1e11, 1e-9);
}

// Ranks whose threads fill the cores they share copy on those cores: a ring's hop adds to its step.
TEST(CostModel, OnSaturatedSharedCoresARingHopAddsToItsStep) {
  PlanRequest r = small_request();
  r.forward_only = true;
  r.hardware.cores = 2;  // cp = 2, one thread each: saturated
  const double compute = 4.0 * 2048 * 2048 * 64 * 4 / 1e11;
  const double kv_bytes = 2.0 * 2048 * 4 * 64 * 4;
  r.hardware.bandwidth = kv_bytes / (compute / 2);  // a hop of half a step
  EXPECT_NEAR(by_name(make_plan(r), "ring").layer_seconds, compute + compute / 2 + compute, 1e-9);
  r.hardware.cores = 4;  // two threads per rank: still saturated, the compute halves
  EXPECT_NEAR(by_name(make_plan(r), "ring").layer_seconds, compute / 2 + compute / 2 + compute / 2, 1e-9);
  r.hardware.cores = 0;  // a device per rank: the hop hides behind the step
  EXPECT_NEAR(by_name(make_plan(r), "ring").layer_seconds, 2 * compute, 1e-9);
}

// Ranks sharing cores: 4 ranks on 2 cores run at most 2 at a time; one rank alone still runs at one core.
TEST(CostModel, RanksSharingCoresShareTheirWork) {
  PlanRequest r = small_request();
  r.parallel.cp = 4;
  r.forward_only = true;
  const double one_core = by_name(make_plan(r), "ulysses").layer_seconds;  // a device per rank
  r.hardware.cores = 2;
  EXPECT_NEAR(by_name(make_plan(r), "ulysses").layer_seconds, 2 * one_core, 1e-9);
  r.hardware.cores = 8;  // 2 threads per rank: twice as fast as a device of one core
  EXPECT_NEAR(by_name(make_plan(r), "ulysses").layer_seconds, one_core / 2, 1e-9);
}

}  // namespace
}  // namespace cpattn
