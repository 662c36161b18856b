#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <stdexcept>

#include "collective_cases.hpp"
#include "cpattn/error.hpp"
#include "cpattn/inproc.hpp"

namespace cpattn {
namespace {

TEST(InProcessGroup, CollectivesAreExactOnEveryRank) {
#if defined(__SANITIZE_THREAD__)
  // Under TSan up to 4 ranks (their threads already interleave on 2 cores); 8 in the other builds.
  for (int n : {1, 3, 4}) {
#else
  for (int n : {1, 2, 3, 4, 8}) {
#endif
    InProcessGroup group(n);
    std::vector<std::int64_t> wrong(static_cast<std::size_t>(n), -1);
    group.run([&](Communicator& c) { wrong[c.rank()] = testing::wrong_in_all_cases(c); });
    for (int r = 0; r < n; ++r) EXPECT_EQ(wrong[r], 0) << "cp " << n << " rank " << r;
  }
}

// A deliberately broken communicator over a working one, to show that the collective cases can fail.
enum class Breakage { own_send_buffer, swapped_blocks, one_byte_off };

class BrokenCommunicator final : public Communicator {
 public:
  BrokenCommunicator(Communicator& inner, Breakage how) : inner_(inner), how_(how) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  const char* backend() const override { return "broken"; }
  void all_to_all(const void* send, void* recv, std::int64_t count, CommDType dtype) override {
    inner_.all_to_all(send, recv, count, dtype);
    if (how_ == Breakage::own_send_buffer) {
      std::memcpy(recv, send, bytes(count * size(), dtype));  // every block as this rank sent it
    }
    damage(recv, count, size(), dtype);
  }
  // Blocks 0 and 1 of the receive list trade their first elements, or one bit of block 0 flips.
  void all_to_all_v(const void* send, const BlockList& send_blocks, void* recv, const BlockList& recv_blocks,
                    CommDType dtype) override {
    inner_.all_to_all_v(send, send_blocks, recv, recv_blocks, dtype);
    auto* p = static_cast<unsigned char*>(recv);
    const std::size_t e = comm_dtype_size(dtype);
    const std::size_t a = static_cast<std::size_t>(recv_blocks.offset[0]) * e;
    if (how_ == Breakage::swapped_blocks && size() > 1 && recv_blocks.shape[0].count() > 0 &&
        recv_blocks.shape[1].count() > 0) {
      const std::size_t b = static_cast<std::size_t>(recv_blocks.offset[1]) * e;
      for (std::size_t i = 0; i < e; ++i) std::swap(p[a + i], p[b + i]);
    } else if (how_ != Breakage::swapped_blocks && recv_blocks.shape[0].count() > 0) {
      p[a] ^= 1;
    }
  }
  void all_gather(const void* send, void* recv, std::int64_t count, CommDType dtype) override {
    inner_.all_gather(send, recv, count, dtype);
    damage(recv, count, size(), dtype);
  }
  void reduce_scatter_sum(const void* send, void* recv, std::int64_t count, CommDType dtype) override {
    inner_.reduce_scatter_sum(send, recv, count, dtype);
    damage(recv, count, 1, dtype);
  }
  void collective_permute(const void* send, void* recv, std::int64_t count, CommDType dtype,
                          const std::vector<int>& dest) override {
    inner_.collective_permute(send, recv, count, dtype, dest);
    damage(recv, count, 1, dtype);
  }
  void barrier() override { inner_.barrier(); }
  void all_reduce(std::int64_t* values, int n, ReduceOp op) override { inner_.all_reduce(values, n, op); }

 private:
  static std::size_t bytes(std::int64_t elements, CommDType dtype) {
    return static_cast<std::size_t>(elements) * comm_dtype_size(dtype);
  }
  // swapped_blocks: blocks 0 and 1 of a rank-major buffer trade places; one_byte_off: one bit of the middle
  // byte flips.
  void damage(void* recv, std::int64_t count, int blocks, CommDType dtype) const {
    auto* p = static_cast<unsigned char*>(recv);
    const std::size_t block = bytes(count, dtype);
    if (how_ == Breakage::swapped_blocks && blocks > 1) {
      std::vector<unsigned char> first(p, p + block);
      std::memcpy(p, p + block, block);
      std::memcpy(p + block, first.data(), block);
    } else if (how_ == Breakage::one_byte_off && block > 0) {
      p[block * static_cast<std::size_t>(blocks) / 2] ^= 1;
    }
  }
  Communicator& inner_;
  Breakage how_;
};

TEST(InProcessGroup, TheCollectiveCasesCountWhatABrokenCommunicatorGetsWrong) {
  InProcessGroup group(4);
  // An all_to_all that hands back its own send buffer: with values rank * 1000 + index at count 1000 the
  // blocks would overlap and such a bug could look right; rank * 2^20 + index cannot.
  std::vector<std::int64_t> own(4, -1), swapped(4 * 3, -1), off(4 * 6, -1);
  group.run([&](Communicator& c) {
    BrokenCommunicator b(c, Breakage::own_send_buffer);
    own[c.rank()] = testing::wrong_all_to_all(b, 1000);
  });
  group.run([&](Communicator& c) {
    BrokenCommunicator b(c, Breakage::swapped_blocks);
    const int r = c.rank();
    swapped[3 * r] = testing::wrong_all_to_all(b, 7);
    swapped[3 * r + 1] = testing::wrong_all_gather(b, 7);
    swapped[3 * r + 2] = testing::wrong_all_to_all_strided(b, 2, 3, 5, 3);
  });
  group.run([&](Communicator& c) {
    BrokenCommunicator b(c, Breakage::one_byte_off);
    const int r = c.rank();
    off[6 * r] = testing::wrong_all_to_all(b, 7);
    off[6 * r + 1] = testing::wrong_all_gather(b, 7);
    off[6 * r + 2] = testing::wrong_reduce_scatter(b, 7, CommDType::f32);
    off[6 * r + 3] = testing::wrong_reduce_scatter_order(b, 7, CommDType::bf16);
    off[6 * r + 4] = testing::wrong_permute(b, 7, 1);
    off[6 * r + 5] = testing::wrong_in_all_cases(b);
  });
  for (int r = 0; r < 4; ++r) {
    // Every block but the rank's own is wrong: 3 of 4 blocks of 1000.
    EXPECT_EQ(own[r], 3000) << "rank " << r;
  }
  for (std::size_t i = 0; i < swapped.size(); ++i)
    EXPECT_GT(swapped[i], 0) << "swapped blocks, case " << i % 3;
  for (std::size_t i = 0; i < off.size(); ++i) EXPECT_GT(off[i], 0) << "one byte off, case " << i % 6;

  // The variable all_to_all's case (k = 1): rank r receives (p + 2r + 1) % 4 rows from rank p. A swap needs
  // blocks 0 and 1 non-empty (ranks 0 and 2), a flipped bit block 0 (every rank).
  std::vector<std::int64_t> variable(4 * 2, -1);
  group.run([&](Communicator& c) {
    BrokenCommunicator swapped_v(c, Breakage::swapped_blocks), off_v(c, Breakage::one_byte_off);
    variable[2 * c.rank()] = testing::wrong_all_to_all_v(swapped_v, 2, 1, 0);
    variable[2 * c.rank() + 1] = testing::wrong_all_to_all_v(off_v, 2, 1, 0);
  });
  for (int r = 0; r < 4; ++r) {
    const std::int64_t from0 = (2 * r + 1) % 4, from1 = (1 + 2 * r + 1) % 4;
    if (from0 > 0 && from1 > 0) {
      EXPECT_GT(variable[2 * r], 0) << "swapped, rank " << r;
    }
    if (from0 > 0) {
      EXPECT_GT(variable[2 * r + 1], 0) << "one byte off, rank " << r;
    }
  }
}

TEST(InProcessGroup, CountersFollowTheAccounting) {
  InProcessGroup group(4);
  group.run([&](Communicator& c) {
    CollectiveCounters::PhaseScope phase(c.counters(), "forward");
    std::vector<float> a(4 * 100), b(4 * 100);
    c.all_to_all(a.data(), b.data(), 100, CommDType::f32);
    c.all_to_all(a.data(), b.data(), 100, CommDType::f32);
    c.all_gather(a.data(), b.data(), 50, CommDType::bf16);
    c.reduce_scatter_sum(a.data(), b.data(), 100, CommDType::f32);
    c.collective_permute(a.data(), b.data(), 10, CommDType::f32, {1, 0, 2, 3});
    c.collective_permute(a.data(), b.data(), 10, CommDType::f32, {0, 1, 2, 3});
  });
  const auto rec = group.communicator(2).counters().records();
  ASSERT_EQ(rec.size(), 4u);
  EXPECT_EQ(rec[0], (CollectiveRecord{CollectiveKind::all_to_all, "forward", 2, 2 * 1600, 2 * 1200, 0, ""}));
  EXPECT_EQ(rec[1], (CollectiveRecord{CollectiveKind::all_gather, "forward", 1, 400, 300, 0, ""}));
  EXPECT_EQ(rec[2], (CollectiveRecord{CollectiveKind::reduce_scatter, "forward", 1, 1600, 1200, 0, ""}));
  // A permute's bytes are its operand; sent per rank is the largest over ranks (0 for the identity).
  EXPECT_EQ(rec[3], (CollectiveRecord{CollectiveKind::collective_permute, "forward", 2, 80, 40, 0, ""}));
  group.communicator(2).counters().reset();
  EXPECT_TRUE(group.communicator(2).counters().records().empty());
}

TEST(InProcessGroup, AFailedRankIsAnErrorOnEveryOtherRankAndANewGroupWorks) {
  for (int fail_at : {0, 3}) {  // fails before its first collective, or after three
    InProcessGroup group(4);
    std::vector<std::string> messages(4);
    try {
      group.run([&](Communicator& c) {
        std::vector<float> a(4 * 8), b(4 * 8);
        try {
          for (int step = 0; step < 10; ++step) {
            if (c.rank() == 2 && step == fail_at) throw std::runtime_error("injected fault in forward");
            c.all_to_all(a.data(), b.data(), 8, CommDType::f32);
          }
        } catch (const Error& e) {
          messages[c.rank()] = e.what();
          throw;
        }
      });
      FAIL() << "run() returned normally";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("injected fault"), std::string::npos) << e.what();
    }
    for (int r : {0, 1, 3}) {
      EXPECT_NE(messages[r].find("because rank 2 failed: injected fault"), std::string::npos) << messages[r];
    }
  }
  InProcessGroup fresh(4);
  std::atomic<std::int64_t> wrong{0};
  fresh.run([&](Communicator& c) { wrong += testing::wrong_all_to_all(c, 100); });
  EXPECT_EQ(wrong.load(), 0);
}

TEST(InProcessGroup, MismatchedCallsAreReportedOnEveryRank) {
  InProcessGroup group(3);
  std::atomic<int> mismatch_errors{0};
  EXPECT_THROW(group.run([&](Communicator& c) {
    std::vector<float> a(3 * 16), b(3 * 16);
    try {
      if (c.rank() == 1) {
        c.all_gather(a.data(), b.data(), 16, CommDType::f32);
      } else {
        c.all_to_all(a.data(), b.data(), c.rank() == 2 ? 8 : 16, CommDType::f32);
      }
    } catch (const Error& e) {
      if (std::string(e.what()).find("collective mismatch") != std::string::npos) ++mismatch_errors;
      throw;
    }
  }),
               Error);
  EXPECT_EQ(mismatch_errors.load(), 3);
}

TEST(InProcessGroup, StridedAllToAllWithDifferentBlockShapesIsAMismatch) {
  InProcessGroup group(2);
  std::vector<std::string> messages(2);
  EXPECT_THROW(group.run([&](Communicator& c) {
    std::vector<float> a(2 * 24), b(2 * 24);
    // The same count (24) in rows of 6 on rank 0 and rows of 4 on rank 1: the rows would not line up.
    const BlockShape shape = c.rank() == 0 ? BlockShape{1, 4, 6} : BlockShape{1, 6, 4};
    const BlockStrides st{24, 24, shape.row};
    try {
      c.all_to_all_strided(a.data(), st, b.data(), st, shape, CommDType::f32);
    } catch (const Error& e) {
      messages[c.rank()] = e.what();
      throw;
    }
  }),
               Error);
  for (const auto& m : messages) {
    EXPECT_NE(m.find("collective mismatch"), std::string::npos) << m;
    EXPECT_NE(m.find("1x4 rows of 6"), std::string::npos) << m;
  }
}

TEST(InProcessGroup, AllToAllVWithBlocksThatDisagreeIsAMismatchOnEveryRank) {
  InProcessGroup group(3);
  std::vector<std::string> messages(3);
  group.run([&](Communicator& c) {
    EXPECT_EQ(testing::all_to_all_v_error(c, false), "");
    messages[c.rank()] = testing::all_to_all_v_error(c, true);
  });
  for (const auto& m : messages) {
    EXPECT_NE(m.find("collective mismatch"), std::string::npos) << m;
    EXPECT_NE(m.find("rank 0 sends rank 1 a block of 1x1 rows of 2 but rank 1 expects 1x0 rows of 2"),
              std::string::npos)
        << m;
  }
}

// all_to_all_v counts as all_to_all: bytes = the largest operand over ranks, sent = the largest operand less
// the own block. Rank r sends every rank r + 1 rows of 2 floats: operands 8r + 8 bytes per peer.
TEST(InProcessGroup, AllToAllVCountsTheLargestOperandAndTheLargestSent) {
  InProcessGroup group(3);
  std::vector<std::vector<CollectiveRecord>> records(3);
  group.run([&](Communicator& c) {
    CollectiveCounters::PhaseScope phase(c.counters(), "forward");
    EXPECT_EQ(testing::all_to_all_v_error(c, false), "");
    records[c.rank()] = c.counters().records();
  });
  for (const auto& r : records) {
    ASSERT_EQ(r.size(), 1u);
    EXPECT_EQ(r[0], (CollectiveRecord{CollectiveKind::all_to_all, "forward", 1, 3 * 3 * 2 * 4, 2 * 3 * 2 * 4,
                                      0, ""}));
  }
}

// Shifts: counted as a collective_permute to rank + 1; a rank that fails between start and wait (its handle
// dies unwaited) makes every other rank's wait fail naming it, promptly, and a new group works; a count that
// disagrees with the neighbour's is an error on every rank naming both.
TEST(InProcessGroup, ShiftsCountAsAPermuteAndAFailureMidShiftIsAnErrorOnEveryRank) {
  {
    InProcessGroup group(3);
    std::vector<std::vector<CollectiveRecord>> records(3);
    group.run([&](Communicator& c) {
      CollectiveCounters::PhaseScope phase(c.counters(), "forward");
      EXPECT_EQ(testing::wrong_shifts(c, 10, 2), 0);
      records[c.rank()] = c.counters().records();
    });
    for (const auto& r : records) {
      ASSERT_EQ(r.size(), 1u);
      EXPECT_EQ(r[0],
                (CollectiveRecord{CollectiveKind::collective_permute, "forward", 2, 2 * 40, 2 * 40, 0, ""}));
    }
  }
  std::vector<std::string> messages(4);
  InProcessGroup group(4);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_THROW(group.run([&](Communicator& c) {
    std::vector<float> a(1000, 1.0f), b(1000);
    try {
      for (int step = 0; step < 3; ++step) {
        auto shift = c.start_shift(a.data(), b.data(), 1000, CommDType::f32);
        if (c.rank() == 2 && step == 1) throw std::runtime_error("injected fault mid-shift");
        shift->wait();
      }
      c.barrier();  // a rank whose remaining shifts did not need rank 2 learns of it here
    } catch (const std::exception& e) {
      messages[c.rank()] = e.what();
      throw;
    }
  }),
               std::exception);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 10.0);
  EXPECT_EQ(messages[2], "injected fault mid-shift");
  for (int r : {0, 1, 3}) {
    EXPECT_NE(messages[r].find("rank 2 failed: injected fault mid-shift"), std::string::npos) << messages[r];
  }
  InProcessGroup again(4);
  again.run([](Communicator& c) { EXPECT_EQ(testing::wrong_shifts(c, 100, 5), 0); });

  std::vector<std::string> mismatch(2);
  InProcessGroup two(2);
  EXPECT_THROW(two.run([&](Communicator& c) {
    std::vector<float> a(6), b(6);
    try {
      c.start_shift(a.data(), b.data(), c.rank() == 1 ? 5 : 6, CommDType::f32)->wait();
    } catch (const Error& e) {
      mismatch[c.rank()] = e.what();
      throw;
    }
  }),
               Error);
  // In a ring of two both neighbours disagree; whichever copier sees it first names its pair.
  for (const auto& m : mismatch) {
    EXPECT_TRUE(
        m.find("shift mismatch: rank 0 sends rank 1 24 bytes but rank 1 expects 20") != std::string::npos ||
        m.find("shift mismatch: rank 1 sends rank 0 20 bytes but rank 0 expects 24") != std::string::npos)
        << m;
  }
}

TEST(InProcessGroup, StridedAllToAllRefusesANegativeStrideAndCountsLikeAllToAll) {
  InProcessGroup group(2);
  std::string message;
  EXPECT_THROW(group.run([&](Communicator& c) {
    float x[4] = {}, y[4] = {};
    try {
      c.all_to_all_strided(x, {2, 0, 1}, y, {2, 0, c.rank() == 1 ? -1 : 1}, {1, 2, 1}, CommDType::f32);
    } catch (const Error& e) {
      if (c.rank() == 1) message = e.what();
      throw;
    }
  }),
               Error);
  EXPECT_NE(message.find("recv.inner = -1 is negative"), std::string::npos) << message;

  InProcessGroup counted(4);
  counted.run([&](Communicator& c) {
    std::vector<float> a(4 * 60), b(4 * 60);
    c.all_to_all_strided(a.data(), {15, 240, 60}, b.data(), {60, 240, 15}, {1, 4, 15}, CommDType::bf16);
  });
  const auto rec = counted.communicator(1).counters().records();
  ASSERT_EQ(rec.size(), 1u);
  EXPECT_EQ(rec[0],
            (CollectiveRecord{CollectiveKind::all_to_all, "unspecified", 1, 4 * 60 * 2, 3 * 60 * 2, 0, ""}));
}

// A communicator that only has the contiguous all_to_all, so all_to_all_strided takes the base class's
// pack / exchange / unpack path; it must land every element where the in-process direct copy does.
class PackingCommunicator final : public Communicator {
 public:
  explicit PackingCommunicator(Communicator& inner) : inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  const char* backend() const override { return "packing"; }
  void all_to_all(const void* s, void* r, std::int64_t n, CommDType t) override {
    inner_.all_to_all(s, r, n, t);
  }
  void all_to_all_v(const void* s, const BlockList& sb, void* r, const BlockList& rb, CommDType t) override {
    inner_.all_to_all_v(s, sb, r, rb, t);
  }
  void all_gather(const void* s, void* r, std::int64_t n, CommDType t) override {
    inner_.all_gather(s, r, n, t);
  }
  void reduce_scatter_sum(const void* s, void* r, std::int64_t n, CommDType t) override {
    inner_.reduce_scatter_sum(s, r, n, t);
  }
  void collective_permute(const void* s, void* r, std::int64_t n, CommDType t,
                          const std::vector<int>& dest) override {
    inner_.collective_permute(s, r, n, t, dest);
  }
  void barrier() override { inner_.barrier(); }
  void all_reduce(std::int64_t* v, int n, ReduceOp op) override { inner_.all_reduce(v, n, op); }

 private:
  Communicator& inner_;
};

TEST(InProcessGroup, ThePackingFallbackOfStridedAllToAllIsExact) {
  for (int n : {1, 3, 4}) {
    InProcessGroup group(n);
    std::vector<std::int64_t> wrong(static_cast<std::size_t>(n), -1);
    group.run([&](Communicator& c) {
      PackingCommunicator packing(c);
      std::int64_t w = 0;
      for (std::int64_t pad : {0, 3}) {
        w += testing::wrong_all_to_all_strided(packing, 2, 3, 5, pad);
        w += testing::wrong_all_to_all_strided(packing, 1, 40, 9, pad);
        w += testing::wrong_all_to_all_strided(packing, 0, 4, 9, pad);
      }
      wrong[c.rank()] = w;
    });
    for (int r = 0; r < n; ++r) EXPECT_EQ(wrong[r], 0) << "cp " << n << " rank " << r;
  }
}

TEST(InProcessGroup, AStuckRankTimesOutInsteadOfHanging) {
  InProcessOptions options;
  options.timeout = std::chrono::milliseconds(200);
  InProcessGroup group(3, options);
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::string> messages(3);
  EXPECT_THROW(group.run([&](Communicator& c) {
    try {
      if (c.rank() == 0) {
        std::this_thread::sleep_for(
            std::chrono::milliseconds(600));  // never joins the first collective in time
      }
      c.barrier();
    } catch (const Error& e) {
      messages[c.rank()] = e.what();
      throw;
    }
  }),
               Error);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  EXPECT_NE(messages[1].find("timed out"), std::string::npos) << messages[1];
  EXPECT_NE(messages[1].find("[0]"), std::string::npos) << messages[1];
  EXPECT_NE(messages[0].find("aborted"), std::string::npos) << messages[0];
}

TEST(InProcessGroup, BadPermutationsAreRefusedBeforeWaiting) {
  InProcessGroup group(2);
  EXPECT_THROW(group.run([&](Communicator& c) {
    float x = 0, y = 0;
    c.collective_permute(&x, &y, 1, CommDType::f32, {1, 1});
  }),
               Error);
}

// Sub-communicators (the hybrid strategy's ulysses and ring groups): cp = 8 as U = 2 x R = 4, rank
// c = ring_rank * U + u_rank. Every collective is exact inside each group, ranks follow the key, each group's
// calls are counted in the parent's counters under its label, and a second split of the same colors makes
// new groups.
TEST(InProcessGroup, SplitsIntoGroupsThatWorkSideBySide) {
  constexpr int kU = 2, kR = 4;
  InProcessGroup group(kU * kR);
  std::vector<std::int64_t> wrong(kU * kR, -1);
  std::vector<std::vector<int>> members(kU * kR);
  std::vector<std::vector<CollectiveRecord>> records(kU * kR);
  group.run([&](Communicator& c) {
    const int r = c.rank();
    auto ulysses = c.split(r / kU, r % kU);
    auto ring = c.split(r % kU, kR - 1 - r / kU);  // keys reversed: ring rank R-1-(r/U)
    EXPECT_EQ(ulysses->size(), kU);
    EXPECT_EQ(ulysses->rank(), r % kU);
    EXPECT_EQ(ring->size(), kR);
    EXPECT_EQ(ring->rank(), kR - 1 - r / kU);
    wrong[r] = testing::wrong_in_all_cases(*ulysses) + testing::wrong_in_all_cases(*ring);
    // Who is in my ring group, in ring-rank order.
    std::int32_t mine = r;
    std::vector<std::int32_t> all(kR);
    ring->all_gather(&mine, all.data(), 1, CommDType::i32);
    members[r].assign(all.begin(), all.end());
    CollectiveCounters::PhaseScope phase(c.counters(), "forward");
    ulysses->report_to(c.counters(), "ulysses");
    ring->report_to(c.counters(), "ring");
    std::vector<float> a(4 * kR, 1.0f), b(4 * kR);
    ring->all_to_all(a.data(), b.data(), 4, CommDType::f32);
    ulysses->all_gather(a.data(), b.data(), 4, CommDType::f32);
    ring->all_to_all(a.data(), b.data(), 4, CommDType::f32);
    auto again = c.split(r / kU, r % kU);
    EXPECT_EQ(again->rank(), r % kU);
#if !defined(__SANITIZE_THREAD__)  // under TSan the first split's cases above suffice
    EXPECT_EQ(testing::wrong_in_all_cases(*again), 0);
#endif
    records[r] = c.counters().records();
  });
  for (int r = 0; r < kU * kR; ++r) {
    EXPECT_EQ(wrong[r], 0) << "rank " << r;
    std::vector<int> expect;
    for (int q = kR - 1; q >= 0; --q) expect.push_back(q * kU + r % kU);
    EXPECT_EQ(members[r], expect) << "rank " << r;
    ASSERT_EQ(records[r].size(), 2u) << "rank " << r;
    EXPECT_EQ(records[r][0], (CollectiveRecord{CollectiveKind::all_to_all, "forward", 2, 2 * 4 * kR * 4,
                                               2 * 4 * (kR - 1) * 4, 0, "ring"}));
    EXPECT_EQ(records[r][1],
              (CollectiveRecord{CollectiveKind::all_gather, "forward", 1, 4 * kU * 4, 4 * 4, 0, "ulysses"}));
  }
}

// A rank that fails while the others wait in different sub-groups (or in the parent) ends every wait with an
// error naming it by its rank in the whole group, promptly; a color < 0 is refused.
TEST(InProcessGroup, AFailureInOneSubGroupReachesEveryRankOfEveryGroup) {
  InProcessGroup group(6, {std::chrono::seconds(60)});
  std::vector<std::string> messages(6);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_THROW(group.run([&](Communicator& c) {
    try {
      auto sub = c.split(c.rank() / 3, c.rank());
      if (c.rank() == 4) throw std::runtime_error("injected fault");
      std::vector<float> a(3, 1.0f), b(9);
      if (c.rank() < 3) {
        for (int i = 0; i < 3; ++i) sub->all_gather(a.data(), b.data(), 1, CommDType::f32);
        c.barrier();  // waits for rank 4, which never comes
      } else {
        sub->all_gather(a.data(), b.data(), 1, CommDType::f32);  // rank 4 missing
      }
    } catch (const std::exception& e) {
      messages[c.rank()] = e.what();
      throw;
    }
  }),
               std::runtime_error);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
  for (int r : {0, 1, 2, 3, 5}) {
    EXPECT_NE(messages[r].find("rank " + std::to_string(r) +
                               ": the in-process group was aborted because rank 4 "
                               "failed: injected fault"),
              std::string::npos)
        << messages[r];
  }
  InProcessGroup two(2);
  std::vector<std::string> refused(2);
  EXPECT_THROW(two.run([&](Communicator& c) {
    try {
      c.split(c.rank() == 0 ? -1 : 0, 0);
    } catch (const Error& e) {
      refused[c.rank()] = e.what();
      throw;
    }
  }),
               Error);
  for (const std::string& m : refused) {
    EXPECT_NE(m.find("split color (-1) of rank 0 must be >= 0"), std::string::npos) << m;
  }
}

}  // namespace
}  // namespace cpattn
