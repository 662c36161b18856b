// The in-process group: `size` ranks as threads of one process, exchanging through shared memory with one
// copy per byte moved. Each collective is a rendezvous: every rank publishes its buffers, then each copies
// (or sums) straight out of its peers' buffers into its own, then all leave together.
//
// Failure: when a rank throws, the group is aborted; every rank waiting in (or later entering) a collective
// gets an Error(communication) naming the failed rank. A rank that waits longer than the timeout aborts the
// group too.
#pragma once

#include <chrono>
#include <functional>
#include <memory>

#include "cpattn/comm.hpp"

namespace cpattn {

struct InProcessOptions {
  // Generous by default so that long, skewed steps do not trip it.
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};
};

class InProcessGroup {
 public:
  explicit InProcessGroup(int size, InProcessOptions options = {});
  ~InProcessGroup();
  InProcessGroup(const InProcessGroup&) = delete;
  InProcessGroup& operator=(const InProcessGroup&) = delete;

  int size() const;
  Communicator& communicator(int rank);
  // Marks the group failed because of `rank`; wakes every waiting rank.
  void abort(int rank, const std::string& reason);
  bool aborted() const;

  // Runs fn(comm) on `size` threads, one per rank, and joins them. If any rank throws, the group is aborted
  // and the first failure is rethrown here once every thread has returned.
  void run(const std::function<void(Communicator&)>& fn);

  struct State;

 private:
  std::unique_ptr<State> state_;
};

}  // namespace cpattn
