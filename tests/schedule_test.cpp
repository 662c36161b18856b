// The strategies run from their schedules: a call that is not the next scheduled one, or a scheduled call
// that never comes, is an error; and each strategy's schedule has the shapes of docs/design.md.
#include <gtest/gtest.h>

#include "cp/scheduled_comm.hpp"
#include "cpattn/inproc.hpp"
#include "cpattn/schedule.hpp"

namespace cpattn {
namespace {

AttentionSpec seed_shape() {
  AttentionSpec a;
  a.batch = 1;
  a.seq_len = 64;
  a.num_q_heads = 32;
  a.num_kv_heads = 2;
  a.head_dim = 8;
  a.dtype = DType::bf16;
  return a;
}

// blocks[r][p] = `each` for every pair of `ranks` ranks.
std::vector<std::vector<std::int64_t>> equal_blocks(int ranks, std::int64_t each) {
  return std::vector<std::vector<std::int64_t>>(
      static_cast<std::size_t>(ranks), std::vector<std::int64_t>(static_cast<std::size_t>(ranks), each));
}

TEST(Schedule, UlyssesReplicatesKvSlotsAndSendsGradientsAsFp32) {
  ParallelSpec p;
  p.cp = 4;
  p.strategy = Strategy::ulysses;
  const StrategySchedule s = strategy_schedule(seed_shape(), p, {false, true});
  ASSERT_EQ(s.forward.size(), 6u);
  // q: [1, 16, 32, 8] -> 8 heads per rank: 16 * 8 * 8 per block; k: 4 slots (rep 2) -> 1 per rank.
  EXPECT_EQ(s.forward[0], (ScheduledCollective{CollectiveKind::all_to_all, "forward", "q", 0, CommDType::bf16,
                                               equal_blocks(4, 16 * 8 * 8), "", 0}));
  EXPECT_EQ(s.forward[1].blocks, equal_blocks(4, 16 * 1 * 8));
  EXPECT_EQ(s.forward[3],
            (ScheduledCollective{
                CollectiveKind::all_gather, "forward", "segment_ids", 16, CommDType::i32, {}, "", 0}));
  ASSERT_EQ(s.backward.size(), 4u);
  EXPECT_EQ(s.backward.back().dtype, CommDType::f32);
}

TEST(Schedule, UlyssesAtUnevenHeadsSendsEachRankItsOwnHeads) {
  AttentionSpec a = seed_shape();
  a.num_q_heads = 7;
  a.num_kv_heads = 7;
  ParallelSpec p;
  p.cp = 4;
  p.strategy = Strategy::ulysses;
  // 7 heads over 4 ranks: 2, 2, 2, 1; each rank's 16 tokens of rank p's heads, and back.
  const StrategySchedule s = strategy_schedule(a, p, {false, false});
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(s.forward[0].blocks[r], (std::vector<std::int64_t>{256, 256, 256, 128})) << r;
    // o back: rank r sends rank p its n_r heads of p's 16 tokens.
    EXPECT_EQ(s.forward[3].blocks[r], std::vector<std::int64_t>(4, r < 3 ? 256 : 128)) << r;
  }
  // 24 q heads on 3 kv heads: kv sets {0}, {0,1}, {1,2}, {2}: k blocks of 1, 2, 2, 1 heads.
  a.num_q_heads = 24;
  a.num_kv_heads = 3;
  const StrategySchedule g = strategy_schedule(a, p, {false, false});
  EXPECT_EQ(g.forward[1].tensor, "k");
  EXPECT_EQ(g.forward[1].blocks[2], (std::vector<std::int64_t>{128, 256, 256, 128}));
}

TEST(Schedule, RematAddsTheRegatherBeforeTheGradientsLeave) {
  ParallelSpec p;
  p.cp = 2;
  p.strategy = Strategy::all_gather;
  const StrategySchedule plain = strategy_schedule(seed_shape(), p, {false, false});
  const StrategySchedule remat = strategy_schedule(seed_shape(), p, {true, false});
  EXPECT_EQ(plain.backward.size(), 2u);
  ASSERT_EQ(remat.backward.size(), 4u);
  EXPECT_EQ(remat.backward[0].phase, "remat");
  EXPECT_EQ(remat.backward[2].kind, CollectiveKind::reduce_scatter);
}

TEST(ScheduledCommunicator, AnUnscheduledOrMissingCallIsAnError) {
  InProcessGroup group(2);
  group.run([](Communicator& comm) {
    CollectiveCounters::PhaseScope phase(comm.counters(), "forward");
    cp::ScheduledCommunicator scheduled(comm);
    std::vector<float> send(4, 1.0f), recv(4);
    // The scheduled call passes and is counted on the group's communicator.
    scheduled.expect({{CollectiveKind::all_to_all, "forward", "q", 2, CommDType::f32, {}, "", 0}});
    scheduled.all_to_all(send.data(), recv.data(), 2, CommDType::f32);
    scheduled.finish();
    EXPECT_EQ(comm.counters().records().size(), 1u);
    // A wrong count, a wrong kind, one call too many, a call skipped: Error(internal), nothing sent.
    scheduled.expect({{CollectiveKind::all_to_all, "forward", "q", 2, CommDType::f32, {}, "", 0}});
    EXPECT_THROW(scheduled.all_to_all(send.data(), recv.data(), 1, CommDType::f32), Error);
    scheduled.expect({{CollectiveKind::all_to_all, "forward", "q", 2, CommDType::f32, {}, "", 0}});
    EXPECT_THROW(scheduled.all_gather(send.data(), recv.data(), 2, CommDType::f32), Error);
    scheduled.expect({});
    EXPECT_THROW(scheduled.all_to_all(send.data(), recv.data(), 2, CommDType::f32), Error);
    scheduled.expect({{CollectiveKind::all_to_all, "forward", "q", 2, CommDType::f32, {}, "", 0}});
    EXPECT_THROW(scheduled.finish(), Error);
    // The phase is part of the schedule.
    scheduled.expect({{CollectiveKind::all_to_all, "backward", "dq", 2, CommDType::f32, {}, "", 0}});
    EXPECT_THROW(scheduled.all_to_all(send.data(), recv.data(), 2, CommDType::f32), Error);
    EXPECT_EQ(comm.counters().records().front().count, 1);
  });
}

}  // namespace
}  // namespace cpattn
