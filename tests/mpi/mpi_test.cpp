// The shared collective tests and a subset of the strategy tests on the MPI backend, run under mpirun (CTest
// starts it with 2 and 4 processes). Every rank runs every test; a failure on any rank fails the job.
#include <gtest/gtest.h>
#include <mpi.h>
#include <cstdlib>
#include <string>

#include "../collective_cases.hpp"
#include "../cp_harness.hpp"
#include "cpattn/mpi_comm.hpp"
#include "harness/check.hpp"
#include "harness/whole_problem.hpp"

namespace cpattn {
namespace {

TEST(MpiCommunicator, CollectivesAreExactOnEveryRank) {
  MpiCommunicator comm;
  std::int64_t wrong = testing::wrong_in_all_cases(comm);
  EXPECT_EQ(wrong, 0) << "rank " << comm.rank();
  comm.all_reduce(&wrong, 1, ReduceOp::sum);
  EXPECT_EQ(wrong, 0) << "wrong elements over all ranks";
}

// Initialised with MPI_THREAD_MULTIPLE (main below), a shift has a progress thread unless
// CPATTN_MPI_PROGRESS_THREAD=0 (the run that covers the polled path); and a shift's data arrives either way.
TEST(MpiCommunicator, ShiftsProgressOnAThreadUnderThreadMultiple) {
  MpiCommunicator comm;
  int level = MPI_THREAD_SINGLE;
  MPI_Query_thread(&level);
  const char* env = std::getenv("CPATTN_MPI_PROGRESS_THREAD");
  const bool off = env != nullptr && std::string(env) == "0";
  EXPECT_EQ(comm.progress_thread(), level == MPI_THREAD_MULTIPLE && !off);
  if (!off) {
    EXPECT_TRUE(comm.progress_thread()) << "Open MPI gave thread level " << level;
  }
  const int n = comm.size(), r = comm.rank();
  std::vector<float> send(1 << 20, static_cast<float>(r)), recv(send.size(), -1.0f);
  auto shift =
      comm.start_shift(send.data(), recv.data(), static_cast<std::int64_t>(send.size()), CommDType::f32);
  shift->wait();
  EXPECT_EQ(recv.front(), static_cast<float>((r + n - 1) % n));
  EXPECT_EQ(recv.back(), static_cast<float>((r + n - 1) % n));
}

// MPI_Comm_split: at np 4, two groups of two (color = rank / 2) and, crossing them, two of two (color =
// rank % 2, keys reversed); every collective is exact in each, and each counts into the parent's counters
// under its label.
TEST(MpiCommunicator, SplitsIntoGroupsThatWorkSideBySide) {
  MpiCommunicator comm;
  const int n = comm.size(), r = comm.rank();
  if (n % 2 != 0) GTEST_SKIP() << "needs an even number of processes";
  auto inner = comm.split(r / 2, r % 2);
  auto outer = comm.split(r % 2, n - r);
  EXPECT_EQ(inner->size(), 2);
  EXPECT_EQ(inner->rank(), r % 2);
  EXPECT_EQ(outer->size(), n / 2);
  EXPECT_EQ(outer->rank(), n / 2 - 1 - r / 2);
  std::int64_t wrong = testing::wrong_in_all_cases(*inner) + testing::wrong_in_all_cases(*outer);
  comm.all_reduce(&wrong, 1, ReduceOp::sum);
  EXPECT_EQ(wrong, 0) << "wrong elements over all ranks and groups";
  std::int32_t mine = r;
  std::vector<std::int32_t> all(static_cast<std::size_t>(n / 2));
  outer->all_gather(&mine, all.data(), 1, CommDType::i32);
  for (int q = 0; q < n / 2; ++q) EXPECT_EQ(all[q], (n / 2 - 1 - q) * 2 + r % 2);
  CollectiveCounters counters;
  inner->report_to(counters, "ulysses");
  {
    CollectiveCounters::PhaseScope phase(counters, "forward");
    std::vector<float> a(200), b(200);
    inner->all_to_all(a.data(), b.data(), 100, CommDType::f32);
  }
  const auto rec = counters.records();
  ASSERT_EQ(rec.size(), 1u);
  EXPECT_EQ(rec[0], (CollectiveRecord{CollectiveKind::all_to_all, "forward", 1, 800, 400, 0, "ulysses"}));
}

TEST(MpiCommunicator, CountersFollowTheAccounting) {
  MpiCommunicator comm;
  const int n = comm.size();
  std::vector<float> a(static_cast<std::size_t>(n * 100)), b(a.size());
  {
    CollectiveCounters::PhaseScope phase(comm.counters(), "forward");
    comm.all_to_all(a.data(), b.data(), 100, CommDType::f32);
    comm.reduce_scatter_sum(a.data(), b.data(), 100, CommDType::f32);
  }
  const auto rec = comm.counters().records();
  ASSERT_EQ(rec.size(), 2u);
  EXPECT_EQ(rec[0],
            (CollectiveRecord{CollectiveKind::all_to_all, "forward", 1, 400 * n, 400 * (n - 1), 0, ""}));
  EXPECT_EQ(rec[1],
            (CollectiveRecord{CollectiveKind::reduce_scatter, "forward", 1, 400 * n, 400 * (n - 1), 0, ""}));
}

// A disagreement in an all_to_all_v's block shapes is an error on every rank, naming the pair, before any
// data moves; the counters see only the good call (largest operand, largest sent).
TEST(MpiCommunicator, AllToAllVWithBlocksThatDisagreeIsAMismatchOnEveryRank) {
  MpiCommunicator comm;
  const int n = comm.size();
  {
    CollectiveCounters::PhaseScope phase(comm.counters(), "forward");
    EXPECT_EQ(testing::all_to_all_v_error(comm, false), "");
  }
  EXPECT_EQ(comm.counters().records().back(), (CollectiveRecord{CollectiveKind::all_to_all, "forward", 1,
                                                                n * n * 2 * 4, (n - 1) * n * 2 * 4, 0, ""}));
  const std::string m = testing::all_to_all_v_error(comm, true);
  EXPECT_NE(m.find("collective mismatch"), std::string::npos) << m;
  const std::string named =
      comm.rank() == 1 ? "rank 0 sends rank 1 a block of 1x1 rows of 2 but rank 1 expects 1x0 rows of 2"
                       : "the block rank 0 sends rank 1 is not the block rank 1 expects";
  EXPECT_NE(m.find(named), std::string::npos) << m;
}

void expect_strategy_matches_single_device(testing::CpCase c) {
  SCOPED_TRACE(c.name());
  MpiCommunicator comm;
  c.cp = comm.size();
  const auto in = testing::make_whole_inputs(c, 55);  // the same inputs on every rank (same seed)
  harness::RunSettings settings;
  settings.options.threads = 1;
  settings.options.remat = c.remat;
  harness::WholeResult w = harness::make_whole_result(c.attention(), c.parallel(), false);
  harness::run_rank(comm, c.attention(), c.parallel(), settings, in, w);
  harness::share_whole_result(comm, c.attention(), c.parallel(), false, w);
  const auto single = testing::run_single_device(c, in);
  const harness::Tolerances tol = harness::tolerances(c.strategy, c.dtype);
  if (tol.forward_exact) {
    EXPECT_EQ(testing::count_bit_differences(w.o.to_floats(), single.o), 0);
    EXPECT_EQ(testing::count_bit_differences(w.lse, single.lse), 0);
  } else {
    CPATTN_EXPECT_CLOSE(w.o.to_floats(), single.o, tol.o_rel, "o");
    EXPECT_LE(testing::compare(w.lse, single.lse).max_abs, tol.lse_abs) << "lse";
  }
  CPATTN_EXPECT_CLOSE(w.dq.to_floats(), single.dq, tol.grad_rel, "dq");
  CPATTN_EXPECT_CLOSE(w.dk.to_floats(), single.dk, tol.grad_rel, "dk");
  CPATTN_EXPECT_CLOSE(w.dv.to_floats(), single.dv, tol.grad_rel, "dv");
}

TEST(MpiStrategies, UlyssesWithKvReplicationMatchesTheSingleDeviceKernel) {
  testing::CpCase c;
  c.hq = 8;
  c.hkv = 2;  // rep 2 at 4 processes
  c.seq = 256;
  c.segments = {150, 106};
  expect_strategy_matches_single_device(c);
}

// Any head counts: 7 q heads split 4+3 (2 processes) or 2+2+2+1 (4), and 24 q heads on 3 kv heads, whose kv
// sets overlap between ranks (the contributions summed on arrival), in bf16 with remat.
TEST(MpiStrategies, UlyssesAnyHeadCountsMatchTheSingleDeviceKernel) {
  testing::CpCase c;
  c.hq = 7;
  c.hkv = 7;
  c.seq = 192;
  c.segments = {150, 42};
  expect_strategy_matches_single_device(c);
  c = testing::CpCase{};
  c.hq = 24;
  c.hkv = 3;
  c.seq = 128;
  c.dtype = DType::bf16;
  c.remat = true;
  c.causal = false;
  expect_strategy_matches_single_device(c);
}

// Ring over MPI's Isend/Irecv shifts: contiguous and zigzag, packed, GQA, fp32 and bf16.
TEST(MpiStrategies, RingMatchesTheSingleDeviceKernel) {
  testing::CpCase c;
  c.strategy = Strategy::ring;
  c.hq = 8;
  c.hkv = 2;
  c.seq = 256;
  c.segments = {150, 101, 5};
  expect_strategy_matches_single_device(c);
  c.load_balance = true;
  c.dtype = DType::bf16;
  expect_strategy_matches_single_device(c);
  // Windowed: K/V rows straight to the ranks that see them, dK/dV rows back (shifts by any distance).
  c.window_left = 20;
  expect_strategy_matches_single_device(c);
  c.load_balance = false;
  c.dtype = DType::f32;
  c.causal = false;
  c.window_right = 9;
  expect_strategy_matches_single_device(c);
}

TEST(MpiStrategies, AllGatherWithLoadBalanceMatchesTheSingleDeviceKernel) {
  testing::CpCase c;
  c.strategy = Strategy::all_gather;
  c.load_balance = true;
  c.remat = true;
  c.hq = 8;
  c.hkv = 2;
  c.seq = 256;
  expect_strategy_matches_single_device(c);
  // Windowed: only the key rows each rank sees (all_to_all_v both ways).
  c.window_left = 40;
  expect_strategy_matches_single_device(c);
}

}  // namespace
}  // namespace cpattn

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  ::testing::InitGoogleTest(&argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank != 0) {
    // Only rank 0 prints progress; every rank still reports its failures.
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  const int failed = RUN_ALL_TESTS();
  int any = failed;
  MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return any;
}
