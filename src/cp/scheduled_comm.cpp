#include "scheduled_comm.hpp"

#include "cpattn/error.hpp"

namespace cpattn::cp {

void ScheduledCommunicator::expect(std::vector<ScheduledCollective> calls) {
  calls_ = std::move(calls);
  next_ = 0;
  checking_ = true;
}

void ScheduledCommunicator::expect_anything() {
  calls_.clear();
  next_ = 0;
  checking_ = false;
}

void ScheduledCommunicator::finish() {
  if (checking_ && next_ != calls_.size()) {
    throw Error(ErrorKind::internal, "schedule", calls_[next_].tensor,
                "the strategy skipped its scheduled " + std::string(to_string(calls_[next_].kind)) + " of " +
                    calls_[next_].tensor + " (" + calls_[next_].phase +
                    (name_.empty() ? "" : ", group " + name_) + ")");
  }
}

namespace {
std::string list_text(const std::vector<std::int64_t>& v) {
  std::string t = "[";
  for (std::size_t i = 0; i < v.size(); ++i) t += (i ? ", " : "") + std::to_string(v[i]);
  return t + "]";
}
}  // namespace

void ScheduledCommunicator::check_next(CollectiveKind kind, std::int64_t count, CommDType dtype,
                                       const std::vector<std::int64_t>* sends) {
  if (!checking_) return;
  const std::string phase = group_.counters().phase();
  const std::string amount = sends ? list_text(*sends) + " per rank" : std::to_string(count);
  const std::string issued = std::string(to_string(kind)) + " of " + amount + " " + to_string(dtype) + " (" +
                             phase + (name_.empty() ? "" : ", group " + name_) + ")";
  if (next_ >= calls_.size()) {
    throw Error(ErrorKind::internal, "schedule", issued, "the strategy issued an unscheduled " + issued);
  }
  const ScheduledCollective& want = calls_[next_];
  const bool variable = !want.blocks.empty();
  const bool same_amount = sends ? variable && want.blocks[static_cast<std::size_t>(rank())] == *sends
                                 : !variable && want.count == count;
  if (want.kind != kind || !same_amount || want.dtype != dtype || want.phase != phase) {
    const std::string wanted = variable
                                   ? list_text(want.blocks[static_cast<std::size_t>(rank())]) + " per rank"
                                   : std::to_string(want.count);
    throw Error(ErrorKind::internal, "schedule", issued,
                "the strategy issued " + issued + " where its schedule has " + to_string(want.kind) + " of " +
                    want.tensor + ": " + wanted + " " + to_string(want.dtype) + " (" + want.phase + ")");
  }
  ++next_;
}

void ScheduledCommunicator::all_to_all(const void* send, void* recv, std::int64_t count, CommDType dtype) {
  check_next(CollectiveKind::all_to_all, count, dtype);
  group_.all_to_all(send, recv, count, dtype);
}

void ScheduledCommunicator::all_to_all_strided(const void* send, const BlockStrides& send_strides, void* recv,
                                               const BlockStrides& recv_strides, const BlockShape& shape,
                                               CommDType dtype) {
  check_next(CollectiveKind::all_to_all, shape.count(), dtype);
  group_.all_to_all_strided(send, send_strides, recv, recv_strides, shape, dtype);
}

void ScheduledCommunicator::all_to_all_v(const void* send, const BlockList& send_blocks, void* recv,
                                         const BlockList& recv_blocks, CommDType dtype) {
  std::vector<std::int64_t> sends;
  for (const BlockShape& s : send_blocks.shape) sends.push_back(s.count());
  check_next(CollectiveKind::all_to_all, 0, dtype, &sends);
  group_.all_to_all_v(send, send_blocks, recv, recv_blocks, dtype);
}

void ScheduledCommunicator::all_gather(const void* send, void* recv, std::int64_t count, CommDType dtype) {
  check_next(CollectiveKind::all_gather, count, dtype);
  group_.all_gather(send, recv, count, dtype);
}

void ScheduledCommunicator::reduce_scatter_sum(const void* send, void* recv, std::int64_t count,
                                               CommDType dtype) {
  check_next(CollectiveKind::reduce_scatter, count, dtype);
  group_.reduce_scatter_sum(send, recv, count, dtype);
}

void ScheduledCommunicator::collective_permute(const void* send, void* recv, std::int64_t count,
                                               CommDType dtype, const std::vector<int>& dest) {
  check_next(CollectiveKind::collective_permute, count, dtype);
  group_.collective_permute(send, recv, count, dtype, dest);
}

std::unique_ptr<PendingShift> ScheduledCommunicator::start_shift(const void* send, void* recv,
                                                                 std::int64_t count, CommDType dtype) {
  check_next(CollectiveKind::collective_permute, count, dtype);
  return group_.start_shift(send, recv, count, dtype);
}

}  // namespace cpattn::cp
