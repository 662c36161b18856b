#include "scheduled_comm.hpp"

#include "cpattn/error.hpp"

namespace cpattn::cp {

void ScheduledCommunicator::expect(std::vector<ScheduledCollective> calls) {
  calls_ = std::move(calls);
  next_ = 0;
}

void ScheduledCommunicator::finish() {
  if (next_ != calls_.size()) {
    throw Error(ErrorKind::internal, "schedule", calls_[next_].tensor,
                "the strategy skipped its scheduled " + std::string(to_string(calls_[next_].kind)) + " of " +
                    calls_[next_].tensor + " (" + calls_[next_].phase + ")");
  }
}

void ScheduledCommunicator::check_next(CollectiveKind kind, std::int64_t count, CommDType dtype) {
  const std::string phase = group_.counters().phase();
  const std::string issued = std::string(to_string(kind)) + " of " + std::to_string(count) + " " +
                             to_string(dtype) + " (" + phase + ")";
  if (next_ >= calls_.size()) {
    throw Error(ErrorKind::internal, "schedule", issued, "the strategy issued an unscheduled " + issued);
  }
  const ScheduledCollective& want = calls_[next_];
  if (want.kind != kind || want.count != count || want.dtype != dtype || want.phase != phase) {
    throw Error(ErrorKind::internal, "schedule", issued,
                "the strategy issued " + issued + " where its schedule has " + to_string(want.kind) + " of " +
                    want.tensor + ": " + std::to_string(want.count) + " " + to_string(want.dtype) + " (" +
                    want.phase + ")");
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

}  // namespace cpattn::cp
