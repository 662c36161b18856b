// The communicator a strategy runs on: it forwards every call to the group's communicator, after checking
// that the call is the next one of the strategy's schedule (schedule.hpp) in kind, element count, type and
// phase. A strategy that issues a call its schedule does not have (or skips one) fails with Error(internal),
// so the schedule the planner predicts from is the one that runs.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "cpattn/comm.hpp"
#include "cpattn/schedule.hpp"

namespace cpattn::cp {

class ScheduledCommunicator final : public Communicator {
 public:
  // `name`: the sub-communicator's group in messages (the hybrid's ulysses or ring), empty for all ranks.
  explicit ScheduledCommunicator(Communicator& group, std::string name = "")
      : group_(group), name_(std::move(name)) {}

  // The calls to expect from now on, in order; finish() checks that all of them were made.
  void expect(std::vector<ScheduledCollective> calls);
  // Lets every call through unchecked until the next expect(): only for the negative control whose wrong
  // placement moves other amounts than the schedule's (context_parallel.cpp).
  void expect_anything();
  void finish();

  int rank() const override { return group_.rank(); }
  int size() const override { return group_.size(); }
  const char* backend() const override { return group_.backend(); }
  void all_to_all(const void* send, void* recv, std::int64_t count, CommDType dtype) override;
  void all_to_all_strided(const void* send, const BlockStrides& send_strides, void* recv,
                          const BlockStrides& recv_strides, const BlockShape& shape,
                          CommDType dtype) override;
  void all_to_all_v(const void* send, const BlockList& send_blocks, void* recv, const BlockList& recv_blocks,
                    CommDType dtype) override;
  void all_gather(const void* send, void* recv, std::int64_t count, CommDType dtype) override;
  void reduce_scatter_sum(const void* send, void* recv, std::int64_t count, CommDType dtype) override;
  void collective_permute(const void* send, void* recv, std::int64_t count, CommDType dtype,
                          const std::vector<int>& dest) override;
  std::unique_ptr<PendingShift> start_shift_v(const void* send, std::int64_t send_count, void* recv,
                                              std::int64_t recv_count, CommDType dtype,
                                              int distance) override;
  void barrier() override { group_.barrier(); }
  CollectiveCounters& counters() override { return group_.counters(); }
  void all_reduce(std::int64_t* values, int n, ReduceOp op) override { group_.all_reduce(values, n, op); }
  std::unique_ptr<Communicator> split(int color, int key) override { return group_.split(color, key); }

 private:
  // The trace event's name: the kind, the scheduled call's tensor and phase, the group.
  std::string event_name(CollectiveKind kind) const;
  // sends: an all_to_all_v's elements to each rank (then count is 0), else null. distance: a shift's (0: not
  // a shift).
  void check_next(CollectiveKind kind, std::int64_t count, CommDType dtype,
                  const std::vector<std::int64_t>* sends = nullptr, int distance = 0);

  Communicator& group_;
  std::string name_;
  std::vector<ScheduledCollective> calls_;
  std::size_t next_ = 0;
  bool checking_ = true;
};

}  // namespace cpattn::cp
