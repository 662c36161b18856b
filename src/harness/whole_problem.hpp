// A whole problem run over a group: every rank cuts its shard out of whole-sequence inputs (in the layout the
// ParallelSpec names), runs forward and backward, and writes its rows of the outputs back in natural order.
// What `cpattn run`, its benches and the tests use; not part of the library's interface.
#pragma once

#include <chrono>

#include <cstdint>
#include <vector>

#include "cp/negative_control.hpp"
#include "cpattn/comm.hpp"
#include "cpattn/context_parallel.hpp"
#include "cpattn/trace.hpp"

namespace cpattn::harness {

struct WholeProblem {
  Tensor q, k, v, d_out;                  // [B, S, H, D] natural order
  std::vector<std::int32_t> segment_ids;  // [B, S] or empty
  std::vector<float> sinks = {};          // [Hq] with AttentionSpec::sinks, else empty
};

// Q, K, V, dO from the normal distribution, seeded seed, seed + 1, seed + 2, seed + 3 (heads: the spec's
// Hq, Hkv, Hkv, Hq); segment ids from document lengths (empty: one document).
WholeProblem random_problem(const AttentionSpec& attention, std::uint32_t seed,
                            const std::vector<std::int64_t>& document_lengths = {});

struct RankReport {
  std::vector<CollectiveRecord> collectives;
  std::vector<std::int64_t> tiles_per_head;  // forward tiles per (batch row, local q head)
  std::int64_t tiles = 0;
  double forward_seconds = 0, backward_seconds = 0;
  double comm_wait_seconds = 0;  // ring: waiting on shifts (ContextParallelAttention::comm_wait_seconds)
  // The CPU time of the rank's kernel calls (flash_cpu_seconds), forward and backward, each its best
  // iteration's: the rank's own work where ranks share cores.
  double forward_kernel_cpu_seconds = 0, backward_kernel_cpu_seconds = 0;
  std::int64_t saved_bytes =
      0;  // what the forward kept for the backward (ContextParallelAttention::saved_bytes)
  std::vector<float> dsinks;  // this rank's share of the sinks' gradient (AttentionGradients::dsinks)
};

struct WholeResult {
  std::vector<trace::Event> trace;  // every rank's events, where the run was traced
  Tensor o, dq, dk, dv;             // natural order (dq, dk, dv empty when forward-only)
  std::vector<float> lse;           // [B, Hq, S]
  std::vector<float> dsinks;        // [Hq] with sinks and a backward: the ranks' shares summed in rank order
  std::vector<RankReport> ranks;
  std::vector<int> hosts;  // each rank's host (Communicator::hosts(); empty: every rank on one host)
};

struct RunSettings {
  ContextParallelOptions options;
  bool forward_only = false;
  // Forward (and backward) this many times: the forward's and the backward's seconds are each their best
  // iteration's (the first pays for memory the process touches for the first time); the outputs, tiles, saved
  // bytes and counted collectives the first's, the ring's waiting the last's.
  int repeat = 1;
  bool trace = false;  // record every rank's events (cpattn/trace.hpp) into the result
  // How long a rank waits on its peers before it gives up naming them (the in-process group's timeout, the
  // MPI shifts' deadline).
  std::chrono::milliseconds comm_timeout{std::chrono::seconds(600)};
  NegativeControl negative_control = NegativeControl::none;  // tests only
};

// The ranks' collectives as the planner gives them (attention_collectives): the calls (kind, phase, group,
// count: the same on every rank) with each one's bytes the largest any rank counted (a direct ring's
// messages carry each rank's own rows; hybrid's rings differ by ulysses rank), across hosts rank 0's.
std::vector<CollectiveRecord> largest_over_ranks(const std::vector<RankReport>& ranks);

// Every rank's events on every rank (each rank passes its own): how an MPI run's trace reaches rank 0.
std::vector<trace::Event> gather_trace(Communicator& comm, const std::vector<trace::Event>& mine);

// Sized for the problem; ranks then fill disjoint rows.
WholeResult make_whole_result(const AttentionSpec& attention, const ParallelSpec& parallel,
                              bool forward_only);

// This rank's part of the run. Timings are taken between barriers, so they are the slowest rank's.
void run_rank(Communicator& comm, const AttentionSpec& attention, const ParallelSpec& parallel,
              const RunSettings& settings, const WholeProblem& problem, WholeResult& result);

// After run_rank on every rank of a group whose ranks each hold their own result (separate processes): gives
// every rank the whole outputs and every rank's tiles, timings and counted bytes (each rank's collectives:
// its own calls, which every rank makes alike, with the other ranks' bytes; across hosts its own).
void share_whole_result(Communicator& comm, const AttentionSpec& attention, const ParallelSpec& parallel,
                        bool forward_only, WholeResult& result);

// All ranks on an in-process group.
WholeResult run_in_process(const AttentionSpec& attention, const ParallelSpec& parallel,
                           const RunSettings& settings, const WholeProblem& problem);

}  // namespace cpattn::harness
