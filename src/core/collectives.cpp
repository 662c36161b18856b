#include "cpattn/collectives.hpp"

#include <algorithm>
#include <mutex>

namespace cpattn {

const char* to_string(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::all_to_all:
      return "all_to_all";
    case CollectiveKind::all_gather:
      return "all_gather";
    case CollectiveKind::reduce_scatter:
      return "reduce_scatter";
    case CollectiveKind::collective_permute:
      return "collective_permute";
  }
  return "unknown";
}

std::size_t comm_dtype_size(CommDType t) {
  return t == CommDType::bf16 ? 2 : 4;
}

const char* to_string(CommDType t) {
  switch (t) {
    case CommDType::f32:
      return "f32";
    case CommDType::bf16:
      return "bf16";
    case CommDType::i32:
      return "i32";
  }
  return "unknown";
}

std::vector<int> ring_destinations(int size) {
  return shift_destinations(size, 1);
}

std::vector<int> shift_destinations(int size, std::int64_t distance) {
  std::vector<int> dest(static_cast<std::size_t>(size));
  for (int p = 0; p < size; ++p) dest[p] = static_cast<int>(((p + distance) % size + size) % size);
  return dest;
}

CommDType comm_dtype(DType dtype) {
  return dtype == DType::f32 ? CommDType::f32 : CommDType::bf16;
}

CollectiveCost collective_cost(CollectiveKind kind, std::int64_t count, std::size_t element_size, int ranks,
                               const std::vector<int>* dest) {
  const std::int64_t e = static_cast<std::int64_t>(element_size);
  if (kind != CollectiveKind::collective_permute) return {count * ranks * e, count * (ranks - 1) * e};
  const std::int64_t bytes = count * e;
  bool any_moves = false;
  for (std::size_t p = 0; dest != nullptr && p < dest->size(); ++p) {
    any_moves = any_moves || ((*dest)[p] >= 0 && (*dest)[p] != static_cast<int>(p));
  }
  return {bytes, any_moves ? bytes : 0};
}

CollectiveCost all_to_all_v_cost(const std::vector<std::vector<std::int64_t>>& sent,
                                 std::size_t element_size) {
  const std::int64_t e = static_cast<std::int64_t>(element_size);
  CollectiveCost cost;
  for (std::size_t r = 0; r < sent.size(); ++r) {
    std::int64_t operand = 0;
    for (const std::int64_t n : sent[r]) operand += n;
    const std::int64_t own = r < sent[r].size() ? sent[r][r] : 0;
    cost.bytes = std::max(cost.bytes, operand * e);
    cost.bytes_sent_per_rank = std::max(cost.bytes_sent_per_rank, (operand - own) * e);
  }
  return cost;
}

void add_to_records(std::vector<CollectiveRecord>& records, CollectiveKind kind, const std::string& phase,
                    const CollectiveCost& cost, const std::string& group) {
  for (auto& r : records) {
    if (r.kind == kind && r.phase == phase && r.group == group) {
      ++r.count;
      r.bytes += cost.bytes;
      r.bytes_sent_per_rank += cost.bytes_sent_per_rank;
      r.bytes_sent_across_hosts += cost.bytes_sent_across_hosts;
      return;
    }
  }
  records.push_back(
      {kind, phase, 1, cost.bytes, cost.bytes_sent_per_rank, cost.bytes_sent_across_hosts, group});
}

struct CollectiveCounters::State {
  mutable std::mutex mutex;
  std::string phase = "unspecified";
  std::vector<CollectiveRecord> records;
};

CollectiveCounters::CollectiveCounters() : state_(std::make_unique<State>()) {}
CollectiveCounters::~CollectiveCounters() = default;

void CollectiveCounters::record(CollectiveKind kind, const CollectiveCost& cost, const std::string& group) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  add_to_records(state_->records, kind, state_->phase, cost, group);
}

std::vector<CollectiveRecord> CollectiveCounters::records() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->records;
}

void CollectiveCounters::reset() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->records.clear();
}

void CollectiveCounters::set_phase(std::string phase) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->phase = std::move(phase);
}

std::string CollectiveCounters::phase() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->phase;
}

CollectiveCounters::PhaseScope::PhaseScope(CollectiveCounters& counters, std::string phase)
    : counters_(counters), previous_(counters.phase()) {
  counters_.set_phase(std::move(phase));
}

CollectiveCounters::PhaseScope::~PhaseScope() {
  counters_.set_phase(previous_);
}

}  // namespace cpattn
