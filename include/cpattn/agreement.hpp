// The agreement of the ranks before any data moves: every rank contributes everything that must match (the
// problem, every option, the strategy and its parameters, the layout, the dtype, what it will save) and the
// ranks compare it in one collective. Ranks that disagree would otherwise compute silently wrong numbers (a
// causal mask on one rank and none on another), or fail later naming no field.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cpattn/comm.hpp"
#include "cpattn/config.hpp"

namespace cpattn {

// One rank's values, in an order every rank adds them in. Text values are compared by a 64-bit hash; the
// text itself travels only when the ranks disagree, to be named in the error.
class Agreement {
 public:
  Agreement& add(std::string field, std::int64_t value);
  Agreement& add(std::string field, bool value);
  Agreement& add(std::string field, double value);  // compared bit for bit
  Agreement& add_text(std::string field, const std::string& value);
  // Data compared by a 64-bit hash of its bytes (shown as the hash): inputs every rank reads for itself.
  Agreement& add_bytes(std::string field, const void* data, std::size_t bytes);
  // An integer shown as `shown` (an enumerator's name).
  Agreement& add_named(std::string field, std::int64_t value, std::string shown);

  struct Entry {
    std::string field;
    std::int64_t value;
    std::string shown;  // the value as the error names it
  };
  const std::vector<Entry>& entries() const { return entries_; }

 private:
  std::vector<Entry> entries_;
};

// Everything of the specs that every rank must hold alike (ParallelSpec's layout as the ranks will use it).
void add_specs(Agreement& agreement, const AttentionSpec& attention, const ParallelSpec& parallel);

// Every rank calls it with its own values: one all_reduce when they agree (and the communicator's deadline
// on it). Otherwise Error(invalid_config) on every rank alike, one item per field that differs, naming each
// value and the ranks that hold it: "the ranks disagree on causal: true on ranks 0, 2..3; false on rank 1
// (every rank must pass the same)". Ranks that add different fields (another count or other names) are a
// disagreement on "fields".
void agree(Communicator& comm, const Agreement& agreement);

}  // namespace cpattn
