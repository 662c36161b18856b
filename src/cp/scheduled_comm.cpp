#include "scheduled_comm.hpp"

#include "cpattn/error.hpp"
#include "cpattn/trace.hpp"

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
// A shift in flight whose wait is a trace event.
class TracedShift final : public PendingShift {
 public:
  explicit TracedShift(std::unique_ptr<PendingShift> inner) : inner_(std::move(inner)) {}
  void wait() override {
    const trace::Scope event("wait", "shift wait");
    inner_->wait();
  }

 private:
  std::unique_ptr<PendingShift> inner_;
};

}  // namespace

std::string ScheduledCommunicator::event_name(CollectiveKind kind) const {
  std::string name = to_string(kind);
  if (checking_ && next_ > 0 && next_ <= calls_.size()) {
    name += " " + calls_[next_ - 1].tensor + " (" + calls_[next_ - 1].phase + ")";
  }
  return name_.empty() ? name : name + " [" + name_ + "]";
}

void ScheduledCommunicator::check_next(CollectiveKind kind, std::int64_t count, CommDType dtype,
                                       const std::vector<std::int64_t>* sends, int distance) {
  if (!checking_) return;
  const std::string phase = group_.counters().phase();
  const std::string amount = sends ? list_text(*sends) + " per rank" : std::to_string(count);
  const std::string issued = std::string(to_string(kind)) + " of " + amount + " " + to_string(dtype) +
                             (distance != 0 ? " by " + std::to_string(distance) : "") + " (" + phase +
                             (name_.empty() ? "" : ", group " + name_) + ")";
  if (next_ >= calls_.size()) {
    throw Error(ErrorKind::internal, "schedule", issued, "the strategy issued an unscheduled " + issued);
  }
  const ScheduledCollective& want = calls_[next_];
  const bool variable = !want.blocks.empty();
  const bool same_amount = sends ? variable && want.blocks[static_cast<std::size_t>(rank())] == *sends
                                 : !variable && want.count == count;
  const bool same_distance = distance == 0 || want.distance == distance;
  if (want.kind != kind || !same_amount || want.dtype != dtype || want.phase != phase || !same_distance) {
    const std::string wanted = variable
                                   ? list_text(want.blocks[static_cast<std::size_t>(rank())]) + " per rank"
                                   : std::to_string(want.count);
    throw Error(ErrorKind::internal, "schedule", issued,
                "the strategy issued " + issued + " where its schedule has " + to_string(want.kind) + " of " +
                    want.tensor + ": " + wanted + " " + to_string(want.dtype) +
                    (distance != 0 ? " by " + std::to_string(want.distance) : "") + " (" + want.phase + ")");
  }
  ++next_;
}

void ScheduledCommunicator::all_to_all(const void* send, void* recv, std::int64_t count, CommDType dtype) {
  check_next(CollectiveKind::all_to_all, count, dtype);
  const trace::Scope event("collective", trace::enabled() ? event_name(CollectiveKind::all_to_all) : "");
  group_.all_to_all(send, recv, count, dtype);
}

void ScheduledCommunicator::all_to_all_strided(const void* send, const BlockStrides& send_strides, void* recv,
                                               const BlockStrides& recv_strides, const BlockShape& shape,
                                               CommDType dtype) {
  check_next(CollectiveKind::all_to_all, shape.count(), dtype);
  const trace::Scope event("collective", trace::enabled() ? event_name(CollectiveKind::all_to_all) : "");
  group_.all_to_all_strided(send, send_strides, recv, recv_strides, shape, dtype);
}

void ScheduledCommunicator::all_to_all_v(const void* send, const BlockList& send_blocks, void* recv,
                                         const BlockList& recv_blocks, CommDType dtype) {
  std::vector<std::int64_t> sends;
  for (const BlockShape& s : send_blocks.shape) sends.push_back(s.count());
  check_next(CollectiveKind::all_to_all, 0, dtype, &sends);
  const trace::Scope event("collective", trace::enabled() ? event_name(CollectiveKind::all_to_all) : "");
  group_.all_to_all_v(send, send_blocks, recv, recv_blocks, dtype);
}

void ScheduledCommunicator::all_gather(const void* send, void* recv, std::int64_t count, CommDType dtype) {
  check_next(CollectiveKind::all_gather, count, dtype);
  const trace::Scope event("collective", trace::enabled() ? event_name(CollectiveKind::all_gather) : "");
  group_.all_gather(send, recv, count, dtype);
}

void ScheduledCommunicator::reduce_scatter_sum(const void* send, void* recv, std::int64_t count,
                                               CommDType dtype) {
  check_next(CollectiveKind::reduce_scatter, count, dtype);
  const trace::Scope event("collective", trace::enabled() ? event_name(CollectiveKind::reduce_scatter) : "");
  group_.reduce_scatter_sum(send, recv, count, dtype);
}

void ScheduledCommunicator::collective_permute(const void* send, void* recv, std::int64_t count,
                                               CommDType dtype, const std::vector<int>& dest) {
  check_next(CollectiveKind::collective_permute, count, dtype);
  const trace::Scope event("collective",
                           trace::enabled() ? event_name(CollectiveKind::collective_permute) : "");
  group_.collective_permute(send, recv, count, dtype, dest);
}

std::unique_ptr<PendingShift> ScheduledCommunicator::start_shift_v(const void* send, std::int64_t send_count,
                                                                   void* recv, std::int64_t recv_count,
                                                                   CommDType dtype, int distance) {
  check_next(CollectiveKind::collective_permute, send_count, dtype, nullptr, distance);
  if (!trace::enabled()) return group_.start_shift_v(send, send_count, recv, recv_count, dtype, distance);
  const trace::Scope event("collective", event_name(CollectiveKind::collective_permute) + " start");
  return std::make_unique<TracedShift>(
      group_.start_shift_v(send, send_count, recv, recv_count, dtype, distance));
}

}  // namespace cpattn::cp
