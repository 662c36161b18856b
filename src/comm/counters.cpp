#include <algorithm>

#include "cpattn/comm.hpp"
#include "cpattn/error.hpp"

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

void CollectiveCounters::record(CollectiveKind kind, std::int64_t bytes, std::int64_t bytes_sent) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& r : records_) {
    if (r.kind == kind && r.phase == phase_) {
      ++r.count;
      r.bytes += bytes;
      r.bytes_sent_per_rank += bytes_sent;
      return;
    }
  }
  records_.push_back({kind, phase_, 1, bytes, bytes_sent});
}

std::vector<CollectiveRecord> CollectiveCounters::records() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return records_;
}

void CollectiveCounters::reset() {
  std::lock_guard<std::mutex> lock(mutex_);
  records_.clear();
}

void CollectiveCounters::set_phase(std::string phase) {
  std::lock_guard<std::mutex> lock(mutex_);
  phase_ = std::move(phase);
}

std::string CollectiveCounters::phase() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return phase_;
}

CollectiveCounters::PhaseScope::PhaseScope(CollectiveCounters& counters, std::string phase)
    : counters_(counters), previous_(counters.phase()) {
  counters_.set_phase(std::move(phase));
}

CollectiveCounters::PhaseScope::~PhaseScope() {
  counters_.set_phase(previous_);
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

void Communicator::count(CollectiveKind kind, std::int64_t count, CommDType dtype,
                         const std::vector<int>* dest) {
  const CollectiveCost c = collective_cost(kind, count, comm_dtype_size(dtype), size(), dest);
  counters_.record(kind, c.bytes, c.bytes_sent_per_rank);
}

void check_permutation(const std::vector<int>& dest, int size) {
  if (static_cast<int>(dest.size()) != size) {
    throw Error(ErrorKind::invalid_input, "dest", std::to_string(dest.size()),
                "collective_permute needs one destination per rank: " + std::to_string(dest.size()) +
                    " given for " + std::to_string(size) + " ranks");
  }
  std::vector<int> seen(static_cast<std::size_t>(size), 0);
  for (int p = 0; p < size; ++p) {
    if (dest[p] < -1 || dest[p] >= size) {
      throw Error(ErrorKind::invalid_input, "dest", std::to_string(dest[p]),
                  "collective_permute destination " + std::to_string(dest[p]) + " of rank " +
                      std::to_string(p) + " is not a rank (valid: -1..." + std::to_string(size - 1) + ")");
    }
    if (dest[p] >= 0 && seen[dest[p]]++ > 0) {
      throw Error(ErrorKind::invalid_input, "dest", std::to_string(dest[p]),
                  "collective_permute sends two blocks to rank " + std::to_string(dest[p]));
    }
  }
}

}  // namespace cpattn
