// The transport backend (TransportCommunicator over point-to-point byte messages, as the Python module gives
// torch.distributed's) on a loopback transport between threads: every collective case exact, every strategy
// the same bits as on the in-process group, the accounting the same, and a failed or silent peer an error.
#include <gtest/gtest.h>

#include <optional>

#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>

#include "collective_cases.hpp"
#include "cp_harness.hpp"
#include "cpattn/communicators.hpp"
#include "cpattn/error.hpp"
#include "cpattn/transport_comm.hpp"

namespace cpattn {
namespace {

// Messages between threads: a send is copied into the hub when started (a buffered send), a receive takes
// the first message of its (from, to, tag) when waited for. `fail_rank`'s sends never arrive and its
// receives fail at once: a peer gone.
class LoopbackHub {
 public:
  explicit LoopbackHub(int size) : size_(size) {}
  int size() const { return size_; }
  void post(int from, int to, std::int64_t tag, const void* data, std::size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (from == silent_rank_) return;
    const auto* p = static_cast<const unsigned char*>(data);
    queues_[{from, to, tag}].emplace_back(p, p + bytes);
    cv_.notify_all();
  }
  void take(int from, int to, std::int64_t tag, void* data, std::size_t bytes,
            std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mutex_);
    auto& q = queues_[{from, to, tag}];
    if (!cv_.wait_for(lock, timeout, [&] { return !q.empty(); })) {
      throw Error(ErrorKind::communication, "rank", std::to_string(from),
                  "loopback: no message from rank " + std::to_string(from) + " to rank " +
                      std::to_string(to) + " within the timeout");
    }
    std::vector<unsigned char> m = std::move(q.front());
    q.pop_front();
    if (m.size() != bytes) {
      throw Error(ErrorKind::communication, "rank", std::to_string(from),
                  "loopback: rank " + std::to_string(from) + " sent " + std::to_string(m.size()) +
                      " bytes where rank " + std::to_string(to) + " expects " + std::to_string(bytes));
    }
    if (bytes > 0) std::memcpy(data, m.data(), bytes);
  }
  void silence(int rank) {
    std::lock_guard<std::mutex> lock(mutex_);
    silent_rank_ = rank;
  }
  std::size_t left_over() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::size_t n = 0;
    for (const auto& [key, q] : queues_) n += q.size();
    return n;
  }

 private:
  int size_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::map<std::tuple<int, int, std::int64_t>, std::deque<std::vector<unsigned char>>> queues_;
  int silent_rank_ = -1;
};

class LoopbackTransport final : public Transport {
 public:
  LoopbackTransport(LoopbackHub& hub, int rank) : hub_(hub), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return hub_.size(); }
  std::string name() const override { return "loopback"; }
  std::unique_ptr<Pending> start(const std::vector<Message>& sends, const std::vector<Message>& recvs,
                                 std::int64_t tag) override {
    EXPECT_GE(tag, 0);
    EXPECT_LT(tag, std::int64_t{1} << 31);
    for (const Message& m : sends) {
      EXPECT_NE(m.peer, rank_);
      hub_.post(rank_, m.peer, tag, m.data, m.bytes);
    }
    return std::make_unique<Receives>(hub_, rank_, recvs, tag);
  }

 private:
  struct Receives final : Pending {
    Receives(LoopbackHub& h, int r, std::vector<Message> m, std::int64_t t)
        : hub(h), rank(r), recvs(std::move(m)), tag(t) {}
    void wait(std::chrono::milliseconds timeout) override {
      for (const Message& m : recvs) hub.take(m.peer, rank, tag, m.data, m.bytes, timeout);
    }
    LoopbackHub& hub;
    int rank;
    std::vector<Message> recvs;
    std::int64_t tag;
  };
  LoopbackHub& hub_;
  int rank_;
};

// Runs fn on `n` ranks, each a thread with its transport communicator; the first exception of each rank is
// kept.
template <typename Fn>
std::vector<std::string> on_transport(LoopbackHub& hub, std::chrono::milliseconds timeout, Fn fn) {
  const int n = hub.size();
  std::vector<std::string> errors(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        CommunicatorOptions options;
        options.timeout = timeout;
        options.transport = std::make_shared<LoopbackTransport>(hub, r);
        const auto comm = make_communicator(Backend::transport, options);
        fn(*comm);
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

TEST(TransportBackend, CollectivesAreExactOnEveryRank) {
  for (const int n : {1, 2, 3, 4}) {
    LoopbackHub hub(n);
    std::vector<std::int64_t> wrong(static_cast<std::size_t>(n), -1);
    const auto errors = on_transport(hub, std::chrono::seconds(20), [&](Communicator& c) {
      EXPECT_EQ(c.size(), n);
      wrong[c.rank()] = testing::wrong_in_all_cases(c);
    });
    for (int r = 0; r < n; ++r) {
      EXPECT_EQ(errors[r], "") << "n " << n << " rank " << r;
      EXPECT_EQ(wrong[r], 0) << "n " << n << " rank " << r;
    }
    EXPECT_EQ(hub.left_over(), 0u) << "messages sent and never received at n " << n;
  }
}

// Sub-communicators (the hybrid's): both splits work at once, each on tags of its own.
TEST(TransportBackend, SplitsAreCommunicatorsOfTheirOwn) {
  LoopbackHub hub(4);
  std::vector<std::int64_t> wrong(4, -1);
  const auto errors = on_transport(hub, std::chrono::seconds(20), [&](Communicator& c) {
    const auto rows = c.split(c.rank() / 2, c.rank());
    const auto cols = c.split(c.rank() % 2, -c.rank());  // reversed by key
    EXPECT_EQ(rows->size(), 2);
    EXPECT_EQ(rows->rank(), c.rank() % 2);
    EXPECT_EQ(cols->rank(), 1 - c.rank() / 2);
    std::int64_t w = testing::wrong_in_all_cases(*rows) + testing::wrong_in_all_cases(*cols);
    // A shift in flight on one while the other exchanges.
    std::vector<float> send(64, static_cast<float>(c.rank())), recv(64, -1.0f);
    auto shift = rows->start_shift(send.data(), recv.data(), 64, CommDType::f32);
    w += testing::wrong_all_to_all(*cols, 33);
    shift->wait();
    const int prev = rows->rank() == 0 ? c.rank() + 1 : c.rank() - 1;
    for (const float x : recv) w += x != static_cast<float>(prev);
    wrong[c.rank()] = w;
  });
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(errors[r], "") << r;
    EXPECT_EQ(wrong[r], 0) << r;
  }
}

// A communicator split again and again (a hybrid object per shape, made and dropped) keeps working: the
// sub-communicators' tags are recycled once their calls are over.
TEST(TransportBackend, SplitsRecycleTheirTags) {
  LoopbackHub hub(2);
  std::vector<std::int64_t> wrong(2, -1);
  const auto errors = on_transport(hub, std::chrono::seconds(20), [&](Communicator& c) {
    std::int64_t w = 0;
    for (int i = 0; i < 200; ++i) {
      const auto sub = c.split(0, c.rank());
      w += testing::wrong_all_to_all(*sub, 3);
    }
    wrong[c.rank()] = w + testing::wrong_all_gather(c, 5);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(errors[r], "") << r;
    EXPECT_EQ(wrong[r], 0) << r;
  }
}

// Every strategy over the transport gives the bits the in-process group gives, and counts the same
// collectives.
TEST(TransportBackend, EveryStrategyIsTheInProcessGroupsBitForBit) {
  struct Row {
    Strategy strategy;
    bool load_balance;
    std::int64_t cp, ulysses_degree;
    DType dtype;
    std::optional<std::int64_t>
        window;  // the windowed ring's shifts by any distance, of rows of each rank's own
  };
  const Row rows[] = {{Strategy::ulysses, false, 4, 0, DType::f32, {}},
                      {Strategy::all_gather, false, 4, 0, DType::f32, {}},
                      {Strategy::all_gather, true, 2, 0, DType::bf16, {}},
                      {Strategy::ring, false, 3, 0, DType::f32, {}},
                      {Strategy::ring, true, 4, 0, DType::bf16, {}},
                      {Strategy::hybrid, true, 4, 2, DType::f32, {}},
                      {Strategy::ring, true, 4, 0, DType::f32, 30},
                      {Strategy::hybrid, true, 4, 2, DType::bf16, 50},
                      {Strategy::all_gather, true, 4, 0, DType::f32, 70}};
  for (const Row& row : rows) {
#if defined(__SANITIZE_THREAD__)
    if (row.window) continue;  // the windowed shifts' threading runs under TSan in the collective cases
#endif
    testing::CpCase c;
    c.cp = row.cp;
    c.hq = 8;
    c.hkv = 2;
    c.dim = 64;
    c.seq = 48 * row.cp;
    c.causal = true;
    c.dtype = row.dtype;
    c.strategy = row.strategy;
    c.load_balance = row.load_balance;
    c.ulysses_degree = row.ulysses_degree;
    c.window_left = row.window;
    c.segments = {c.seq / 2 + 3, c.seq - c.seq / 2 - 3};
    SCOPED_TRACE(c.name());
    ASSERT_TRUE(validation_errors(c.attention(), c.parallel()).empty());
    const auto in = testing::make_whole_inputs(c, 7);
    const harness::RunSettings settings;
    const harness::WholeResult want = harness::run_in_process(c.attention(), c.parallel(), settings, in);
    harness::WholeResult got = harness::make_whole_result(c.attention(), c.parallel(), false);
    LoopbackHub hub(static_cast<int>(c.cp));
    const auto errors = on_transport(hub, std::chrono::seconds(60), [&](Communicator& comm) {
      harness::run_rank(comm, c.attention(), c.parallel(), settings, in, got);
    });
    for (const auto& e : errors) EXPECT_EQ(e, "");
    EXPECT_EQ(testing::count_bit_differences(got.o.to_floats(), want.o.to_floats()), 0) << "o";
    EXPECT_EQ(testing::count_bit_differences(got.dq.to_floats(), want.dq.to_floats()), 0) << "dq";
    EXPECT_EQ(testing::count_bit_differences(got.dk.to_floats(), want.dk.to_floats()), 0) << "dk";
    EXPECT_EQ(testing::count_bit_differences(got.dv.to_floats(), want.dv.to_floats()), 0) << "dv";
    ASSERT_EQ(got.ranks.size(), want.ranks.size());
    for (std::size_t r = 0; r < got.ranks.size(); ++r) {
      EXPECT_EQ(got.ranks[r].collectives, want.ranks[r].collectives) << "rank " << r;
    }
    EXPECT_EQ(hub.left_over(), 0u);
  }
}

// A peer whose messages never come: every waiting rank's error names it within the timeout; a shape that
// disagrees in all_to_all_v is an error on every rank.
TEST(TransportBackend, ASilentPeerOrADisagreementIsAnErrorOnTheRanksThatWait) {
  LoopbackHub hub(3);
  hub.silence(2);
  std::vector<std::string> after(3);
  const auto errors = on_transport(hub, std::chrono::milliseconds(300), [&](Communicator& c) {
    if (c.rank() == 2) return;  // never takes part
    std::vector<float> send(3 * 5, 1.0f), recv(send.size());
    try {
      c.all_to_all(send.data(), recv.data(), 5, CommDType::f32);
    } catch (const Error& e) {
      // Messages of the failed call may still be in flight: the communicator takes no more calls.
      try {
        c.barrier();
      } catch (const Error& again) {
        after[c.rank()] = again.what();
      }
      throw;
    }
  });
  EXPECT_NE(errors[0].find("no message from rank 2"), std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find("no message from rank 2"), std::string::npos) << errors[1];
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(after[r].find("an earlier collective failed"), std::string::npos) << after[r];
  }

  LoopbackHub pair(2);
  const auto mismatch = on_transport(pair, std::chrono::seconds(20), [&](Communicator& c) {
    BlockList s{{{1, 1, 4}, {1, 1, 4}}, {0, 4}, 4, 4}, r = s;
    if (c.rank() == 1) r.shape[0] = {1, 1, 3};
    std::vector<float> send(8, 1.0f), recv(8);
    c.all_to_all_v(send.data(), s, recv.data(), r, CommDType::f32);
  });
  for (const auto& e : mismatch) {
    EXPECT_NE(e.find("collective mismatch in all_to_all_v"), std::string::npos) << e;
  }
  LoopbackHub three(3);
  const auto counts = on_transport(three, std::chrono::seconds(20), [&](Communicator& c) {
    std::int64_t v[3] = {1, 2, 3};
    c.all_reduce(v, c.rank() == 1 ? 2 : 3, ReduceOp::sum);
  });
  for (const auto& e : counts) {
    EXPECT_NE(e.find("collective mismatch"), std::string::npos) << e;
    EXPECT_NE(e.find("values to all_reduce"), std::string::npos) << e;
  }
}

TEST(TransportBackend, TheFactoryNeedsATransport) {
  try {
    make_communicator(Backend::transport, {});
    ADD_FAILURE() << "made a transport communicator without a transport";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::invalid_config);
    EXPECT_NE(std::string(e.what()).find("transport"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace cpattn
