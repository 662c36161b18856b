// The state behind ContextParallelAttention: what every strategy reads (the specs, the communicators, the
// positions, the counters), each strategy's forward and backward (one file each: <name>_strategy.cpp), and
// what a forward keeps for its backward, a type of each strategy's own.
#pragma once

#include <memory>
#include <optional>

#include "cpattn/context_parallel.hpp"
#include "cpattn/schedule.hpp"
#include "negative_control.hpp"
#include "ring_pass.hpp"
#include "scheduled_comm.hpp"
#include "sequence_collectives.hpp"

namespace cpattn {

class ContextParallelAttention::Impl {
 public:
  Impl(const AttentionSpec& attention, const ParallelSpec& parallel, Communicator& comm,
       ContextParallelOptions options);

  AttentionOutput forward(const Tensor& q, const Tensor& k, const Tensor& v,
                          std::span<const std::int32_t> seg, bool forward_only, std::span<const float> sinks);
  AttentionGradients backward(const Tensor& d_out);

  // Shapes checked against the spec on this rank, then agreed on by every rank (all_reduce) with whether
  // segments are given and state kept, before data moves.
  void check_inputs(const Tensor& q, const Tensor& k, const Tensor& v, std::span<const std::int32_t> seg,
                    bool forward_only, std::span<const float> sinks);
  void check_grad_input(const Tensor& d_out);

  // The strategy's own forward and backward (a switch over Strategy without default).
  AttentionOutput run_forward(const Tensor& q, const Tensor& k, const Tensor& v, bool forward_only);
  AttentionGradients run_backward(const Tensor& d_out);
  AttentionOutput all_gather_forward(const Tensor& q, const Tensor& k, const Tensor& v, bool forward_only);
  AttentionGradients all_gather_backward(const Tensor& d_out);
  AttentionOutput ulysses_forward(const Tensor& q, const Tensor& k, const Tensor& v, bool forward_only);
  AttentionGradients ulysses_backward(const Tensor& d_out);
  AttentionOutput ring_forward(const Tensor& q, const Tensor& k, const Tensor& v, bool forward_only);
  AttentionGradients ring_backward(const Tensor& d_out);
  AttentionOutput hybrid_forward(const Tensor& q, const Tensor& k, const Tensor& v, bool forward_only);
  AttentionGradients hybrid_backward(const Tensor& d_out);
  // The ring's passes over `ring` (its ranks' rows at `at`, in runs of these lengths, moved by `route`)
  // with these kernel calls.
  cp::RingPass ring_pass(Communicator& ring, const RankPositions& at, const RankRuns& at_runs,
                         const RingRoute& moves, std::vector<cp::KernelCall> calls);
  cp::RingPass ring_pass(Communicator&, const RankPositions&, const RankRuns&, RingRoute&&,
                         std::vector<cp::KernelCall>) = delete;  // the pass keeps a pointer to the route
  cp::RingPass ring_pass(Communicator&, const RankPositions&, const RankRuns&, const RingRoute&&,
                         std::vector<cp::KernelCall>) = delete;

  // The calls to expect from now on on each communicator (`unchecked`: any), and the check that all were
  // made.
  void expect(const std::vector<ScheduledCollective>& calls, bool unchecked);
  void finish();
  bool unscheduled() const;

  FlashConfig kernel_config() const;
  AttentionMask mask(const std::vector<std::int32_t>& q_pos, const std::vector<std::int32_t>& kv_pos,
                     const std::vector<std::int32_t>& q_seg, const std::vector<std::int32_t>& kv_seg) const;

  AttentionSpec attention;
  ParallelSpec parallel;
  Communicator& group;             // the caller's communicator: phases are set on its counters
  cp::ScheduledCommunicator comm;  // every collective goes through it, checked against the schedule
  std::vector<ScheduledCollective> backward_calls;  // the schedule of the backward after this forward
  ContextParallelOptions options;
  NegativeControl negative_control = NegativeControl::none;
  std::int64_t cp = 1, rank = 0, local_seq = 0, hq = 0, hkv = 0;  // local heads (per tp rank)
  RankPositions positions;                                        // every rank's local positions
  RankRuns runs;                                                  // and the lengths of its runs
  TileCounts tiles;
  double comm_wait_seconds = 0;  // ring: time spent in shifts' wait() since the last forward began

  // hybrid: U x R ranks (parallel.head_group_size() x parallel.ring_degree()), rank = ring_rank * U +
  // ulysses_rank; the caller's communicator split into this rank's ulysses group (U ranks) and ring group (R
  // ranks, the same ulysses rank), each checked against its part of the schedule and counted in the caller's
  // counters under its group's name.
  std::unique_ptr<Communicator> ulysses_group, ring_group;
  std::unique_ptr<cp::ScheduledCommunicator> ulysses_comm, ring_comm;
  RankPositions ring_positions;  // each ring rank's rows (its ulysses group's tokens: ring_layout_of)
  RankRuns ring_runs;            // and their runs

  // What a forward keeps for its backward: each strategy derives its own (AllGatherSaved, UlyssesSaved,
  // RingSaved for ring and hybrid); saved_as checks the kind before handing it out.
  struct SavedState {
    explicit SavedState(Strategy s) : strategy(s) {}
    virtual ~SavedState() = default;
    // The bytes it holds (tensors, LSE, segment ids): what the planner's memory_bytes_per_rank predicts.
    virtual std::int64_t bytes() const = 0;
    Strategy strategy;            // the strategy that made it
    const Impl* owner = nullptr;  // the object whose forward made it
    std::vector<float> sinks;     // the forward's sinks ([hq]; empty: none)
  };
  std::unique_ptr<SavedState> saved;
  template <class T>
  T& saved_as() {
    CPATTN_ASSERT(saved && saved->owner == this && saved->strategy == parallel.strategy);
    return static_cast<T&>(*saved);
  }
  std::vector<std::int32_t> seg_local;  // this call's segment ids
  // The sequence-sharded strategies on packed rows: the row's segment ids ([B, S], natural), gathered before
  // the schedule is made (the keys each rank receives follow them: all_gather_keys, ring_route); empty
  // otherwise.
  std::vector<std::int32_t> row_segments;
  // ring, hybrid: this forward's route (ring_route over the ring's rows), shared with its saved state.
  std::shared_ptr<const RingRoute> route;
  // all_gather: this forward's keys (all_gather_keys; empty: the whole row), for its schedule and its gather.
  std::vector<std::vector<PositionRange>> gather_keys;
  std::vector<float> sinks_local;             // this call's sinks ([hq]; empty: none)
  std::vector<std::vector<float>> step_lses;  // ring's negative control ring_step_lse: each step's LSE
};

namespace cp {

// The sinks of heads [begin + q0, begin + q0 + nq) of `sinks` ([hq]), or none where there are none.
inline std::span<const float> head_sinks(const std::vector<float>& sinks, std::int64_t begin, std::int64_t q0,
                                         std::int64_t nq) {
  if (sinks.empty()) return {};
  return std::span<const float>(sinks).subspan(static_cast<std::size_t>(begin + q0),
                                               static_cast<std::size_t>(nq));
}

// This rank's part of the sinks' gradient ([hq], zero but for heads [h0, h0 + nh)): over the rows of o and
// d_out [B, rows, nh, D] and lse [B, nh, rows], -sum e^(sink - LSE) rowsum(dO * O) (sink_gradients).
std::vector<float> sink_parts(const std::vector<float>& sinks, std::int64_t h0, const Tensor& o,
                              const std::vector<float>& lse, const Tensor& d_out);

// A saved state's bytes: its tensors' and `other` (vectors).
inline std::int64_t saved_bytes(std::initializer_list<const Tensor*> tensors, std::size_t other) {
  std::int64_t total = static_cast<std::int64_t>(other);
  for (const Tensor* t : tensors) total += static_cast<std::int64_t>(t->nbytes());
  return total;
}

// What ring and hybrid keep for backward: the ring rank's rows (hybrid: of its ulysses heads, in slot order).
struct RingSaved final : ContextParallelAttention::Impl::SavedState {
  explicit RingSaved(Strategy s) : SavedState(s) {}
  Tensor q, k, v, o;                              // [B, rows, heads, D]
  std::vector<float> lse;                         // [B, heads, rows]
  std::vector<std::int32_t> seg_local, seg_full;  // the rows' ids, the whole row's natural (empty: none)
  std::shared_ptr<const RingRoute> route;         // the forward's (Impl::route: not counted in bytes())
  std::int64_t bytes() const override {
    return saved_bytes({&q, &k, &v, &o}, lse.size() * 4 + (seg_local.size() + seg_full.size()) * 4);
  }
};

}  // namespace cp
}  // namespace cpattn
