// The collective accounting (docs/design.md, "Collective accounting"): the kinds of collective, one record
// per (kind, phase) and the cost rule of one call. The communicators count what they ran with it and the
// planner predicts with it, so a prediction and a count can be compared field by field.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cpattn/tensor.hpp"

namespace cpattn {

enum class CollectiveKind { all_to_all, all_gather, reduce_scatter, collective_permute };
const char* to_string(CollectiveKind kind);

enum class CommDType { f32, bf16, i32 };
std::size_t comm_dtype_size(CommDType t);
const char* to_string(CommDType t);
// The wire type of a tensor's elements (f32 or bf16).
CommDType comm_dtype(DType dtype);

// One line of the accounting: calls of one kind in one phase.
//   bytes: the per-device size in the seed's (HLO) convention: all_gather its output, reduce_scatter its
//   input,
//          all_to_all and collective_permute the operand (summed over the calls);
//   bytes_sent_per_rank: what one rank sent to other ranks (its own block excluded; for a permute, the
//   largest
//          over ranks), summed over the calls.
struct CollectiveRecord {
  CollectiveKind kind = CollectiveKind::all_to_all;
  std::string phase;
  std::int64_t count = 0;
  std::int64_t bytes = 0;
  std::int64_t bytes_sent_per_rank = 0;
  // What this rank sent to ranks on other hosts (0 where the communicator knows of one host only).
  std::int64_t bytes_sent_across_hosts = 0;
  // The sub-communicator the calls ran on (the hybrid strategy's `ulysses` or `ring` group); empty for the
  // single-group strategies.
  std::string group;
  bool operator==(const CollectiveRecord&) const = default;
};

// The accounting of one call that moves `count` elements per block (all_to_all, reduce_scatter: per
// destination block; all_gather: the input; permute: the operand) over `ranks` ranks. dest: a permute's
// destinations (sent is 0 when nothing changes rank).
struct CollectiveCost {
  std::int64_t bytes = 0;
  std::int64_t bytes_sent_per_rank = 0;
  std::int64_t bytes_sent_across_hosts = 0;  // this rank's, to ranks on other hosts
};
// The ring's destinations (Communicator::start_shift): dest[p] = (p + 1) mod size; those of a shift by
// `distance` (start_shift_v): dest[p] = (p + distance) mod size.
std::vector<int> ring_destinations(int size);
std::vector<int> shift_destinations(int size, std::int64_t distance);

CollectiveCost collective_cost(CollectiveKind kind, std::int64_t count, std::size_t element_size, int ranks,
                               const std::vector<int>* dest = nullptr);

// A variable all_to_all (Communicator::all_to_all_v): sent[r][p] = the elements rank r sends rank p. bytes:
// the largest operand over ranks (what one rank sends in all, its own block included); bytes_sent_per_rank:
// the largest over ranks of the operand less its own block.
CollectiveCost all_to_all_v_cost(const std::vector<std::vector<std::int64_t>>& sent,
                                 std::size_t element_size);

// Adds one call to a (kind, phase, group)-aggregated list, keeping first-seen order.
void add_to_records(std::vector<CollectiveRecord>& records, CollectiveKind kind, const std::string& phase,
                    const CollectiveCost& cost, const std::string& group = "");

// Thread-safe per-communicator counters; records stay in first-seen order of (kind, phase, group).
class CollectiveCounters {
 public:
  CollectiveCounters();
  ~CollectiveCounters();
  CollectiveCounters(const CollectiveCounters&) = delete;
  CollectiveCounters& operator=(const CollectiveCounters&) = delete;

  void record(CollectiveKind kind, const CollectiveCost& cost, const std::string& group = "");
  std::vector<CollectiveRecord> records() const;
  void reset();
  void set_phase(std::string phase);
  std::string phase() const;

  // Sets the phase for a scope and restores the previous one after.
  class PhaseScope {
   public:
    PhaseScope(CollectiveCounters& counters, std::string phase);
    ~PhaseScope();
    PhaseScope(const PhaseScope&) = delete;
    PhaseScope& operator=(const PhaseScope&) = delete;

   private:
    CollectiveCounters& counters_;
    std::string previous_;
  };

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace cpattn
