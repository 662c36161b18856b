// Each strategy's collective schedule as data: which collective moves which tensor, with how many elements
// per block, of which type, in which phase and order. The strategies run from it (every collective a strategy
// issues is checked against the next scheduled one) and the planner predicts from it, so a strategy is
// written once (docs/design.md, "Collective accounting").
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cpattn/collectives.hpp"
#include "cpattn/config.hpp"
#include "cpattn/sequence_layout.hpp"

namespace cpattn {

struct ScheduledCollective {
  CollectiveKind kind = CollectiveKind::all_to_all;
  std::string phase;       // forward, remat, backward
  std::string tensor;      // what moves: q, k, v, segment_ids, o, lse, d_out, dq, dk, dv
  std::int64_t count = 0;  // elements per block, as the Communicator counts the call (0 for all_to_all_v)
  CommDType dtype = CommDType::f32;
  // An all_to_all_v (blocks of per-rank sizes): blocks[r][p] = the elements rank r sends rank p. Empty for
  // every other call.
  std::vector<std::vector<std::int64_t>> blocks;
  // The hybrid strategy's sub-communicator (`ulysses` or `ring`) and its size; empty and 0 for the calls of
  // the single-group strategies (over all cp ranks).
  std::string group;
  std::int64_t ranks = 0;
  // A ring shift's distance (Communicator::start_shift_v): rank r sends rank r + distance. The direct ring
  // sends each source's rows straight to the ranks that see them; every other shift goes one place on.
  std::int64_t distance = 1;
  bool operator==(const ScheduledCollective&) const = default;
};

struct ScheduleOptions {
  bool remat = false;   // backward re-gathers (all_gather) or re-exchanges (ulysses) its inputs
  bool packed = false;  // segment ids travel too
  // Whose calls (the rank in cp): hybrid's ring moves the kv heads of the rank's ulysses rank (rank %
  // ulysses_degree), which differ between ulysses ranks when the heads do not split evenly; a direct ring
  // (ring, hybrid) sends each ring rank's own rows (ring_reach). The other calls are the same on every rank.
  std::int64_t rank = 0;
  // The ring's route (ring_route over the ring's positions: round the ring, or direct) where the caller has
  // it; null: the schedule finds it itself from the band and `segments` (the planner computes it once for
  // all ranks, a run once per forward).
  const RingRoute* route = nullptr;
  // The kernel's kv block (FlashConfig::block_kv): a windowed all_gather moves the key rows each rank sees in
  // whole blocks of it.
  std::int64_t block = 64;
  // The row's segment ids ([B, S], natural order; the sequence-sharded strategies gather them first): a
  // packed all_gather moves each rank the key blocks of its documents its queries reach (all_gather_keys), a
  // packed ring the rows of them (ring_route). Null: packed rows' keys and route are planned as the band
  // alone decides (every block without a window).
  const std::vector<std::int32_t>* segments = nullptr;
  // The all_gather's keys (all_gather_keys over the layout's ranks with `block` and `segments`; empty: the
  // whole row to every rank) where the caller has them (a run works them out once per forward, the planner
  // once per plan); null: the schedule works them out itself.
  const std::vector<std::vector<PositionRange>>* keys = nullptr;
};

// One attention layer's calls: those of a forward, and those of the backward after it (remat calls included),
// each in issue order. Heads are those of one tp rank.
struct StrategySchedule {
  std::vector<ScheduledCollective> forward, backward;
};
StrategySchedule strategy_schedule(const AttentionSpec& attention, const ParallelSpec& parallel,
                                   const ScheduleOptions& options);

// The schedule's calls in the accounting of collectives.hpp, aggregated by (kind, phase, group) in issue
// order: what a run's counters must show.
std::vector<CollectiveRecord> scheduled_records(const StrategySchedule& schedule, std::int64_t cp);

}  // namespace cpattn
