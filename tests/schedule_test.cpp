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

TEST(Schedule, UlyssesReplicatesKvSlotsAndSendsGradientsAsFp32) {
  ParallelSpec p;
  p.cp = 4;
  p.strategy = Strategy::ulysses;
  const StrategySchedule s = strategy_schedule(seed_shape(), p, {false, true});
  ASSERT_EQ(s.forward.size(), 6u);
  // q: [1, 16, 32, 8] -> 8 heads per rank: 16 * 8 * 8 per block; k: 4 slots (rep 2) -> 1 per rank.
  EXPECT_EQ(s.forward[0],
            (ScheduledCollective{CollectiveKind::all_to_all, "forward", "q", 16 * 8 * 8, CommDType::bf16}));
  EXPECT_EQ(s.forward[1].count, 16 * 1 * 8);
  EXPECT_EQ(s.forward[3],
            (ScheduledCollective{CollectiveKind::all_gather, "forward", "segment_ids", 16, CommDType::i32}));
  ASSERT_EQ(s.backward.size(), 4u);
  EXPECT_EQ(s.backward.back().dtype, CommDType::f32);
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
    scheduled.expect({{CollectiveKind::all_to_all, "forward", "q", 2, CommDType::f32}});
    scheduled.all_to_all(send.data(), recv.data(), 2, CommDType::f32);
    scheduled.finish();
    EXPECT_EQ(comm.counters().records().size(), 1u);
    // A wrong count, a wrong kind, one call too many, a call skipped: Error(internal), nothing sent.
    scheduled.expect({{CollectiveKind::all_to_all, "forward", "q", 2, CommDType::f32}});
    EXPECT_THROW(scheduled.all_to_all(send.data(), recv.data(), 1, CommDType::f32), Error);
    scheduled.expect({{CollectiveKind::all_to_all, "forward", "q", 2, CommDType::f32}});
    EXPECT_THROW(scheduled.all_gather(send.data(), recv.data(), 2, CommDType::f32), Error);
    scheduled.expect({});
    EXPECT_THROW(scheduled.all_to_all(send.data(), recv.data(), 2, CommDType::f32), Error);
    scheduled.expect({{CollectiveKind::all_to_all, "forward", "q", 2, CommDType::f32}});
    EXPECT_THROW(scheduled.finish(), Error);
    // The phase is part of the schedule.
    scheduled.expect({{CollectiveKind::all_to_all, "backward", "dq", 2, CommDType::f32}});
    EXPECT_THROW(scheduled.all_to_all(send.data(), recv.data(), 2, CommDType::f32), Error);
    EXPECT_EQ(comm.counters().records().front().count, 1);
  });
}

}  // namespace
}  // namespace cpattn
