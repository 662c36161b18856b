// Context-parallel attention: one long sequence's attention over the ranks of a Communicator.
//   all_gather: K/V all-gathered along the sequence; local queries attend the whole sequence; dK/dV partials
//               reduce-scattered back (optional dual-chunk-swap load balance: the caller's shards are already
//               in that layout).
//   ulysses:    all-to-all from sequence shards to head shards; local attention over the whole sequence;
//               all-to-all back. Any head counts; KV heads repeated in grouped order when a KV head's q heads
//               span several ranks, their gradients summed back.
//   ring:       K/V passed round the ranks, each hop overlapped with a step's compute, the steps' results
//               merged by their LSE (optional zigzag load balance: the dual-chunk-swap layout).
//   hybrid:     ulysses inside groups of ulysses_degree ranks, a ring across the groups.
// Each strategy's traits are in strategy.hpp.
// The math of each is in docs/design.md.
// Each rank passes its own shard in the layout ParallelSpec names and gets results in that same token order.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "cpattn/comm.hpp"
#include "cpattn/config.hpp"
#include "cpattn/flash.hpp"
#include "cpattn/tensor.hpp"

namespace cpattn {

struct SequenceLayout;  // cpattn/sequence_layout.hpp

// Kernel threads of one rank: `threads`, or where it is 0, max(1, hardware threads / cp).
int threads_per_rank(int threads, std::int64_t cp);

struct ContextParallelOptions {
  bool remat = false;  // all_gather: re-gather K/V in backward; ulysses: redo the Q/K/V all-to-alls
  int threads = 0;     // kernel threads per rank; 0: max(1, hardware threads / cp)
  FlashConfig kernel;  // block sizes (threads is taken from `threads`)
};

struct AttentionOutput {
  Tensor o;                // [B, S/cp, Hq, D] local shard, caller's order
  std::vector<float> lse;  // [B, Hq, S/cp] fp32, natural log
};

struct AttentionGradients {
  Tensor dq;  // [B, S/cp, Hq, D]
  Tensor dk;  // [B, S/cp, Hkv, D] (the inputs' dtype)
  Tensor dv;
  // [Hq] with AttentionSpec::sinks: this rank's share of the sinks' gradient (its rows of the heads it
  // computed; 0 for the others). The shares of the cp ranks add up to the gradient, as every parameter's
  // gradient in context parallelism does: the training's gradient all-reduce over the group sums them.
  std::vector<float> dsinks;
};

class ContextParallelAttention {
 public:
  // Validates the specs (Error(invalid_config) listing every broken rule). Heads are the ones this tp rank
  // holds: tensors carry Hq/tp and Hkv/tp heads.
  ContextParallelAttention(const AttentionSpec& attention, const ParallelSpec& parallel, Communicator& comm,
                           ContextParallelOptions options = {});
  ~ContextParallelAttention();
  ContextParallelAttention(const ContextParallelAttention&) = delete;
  ContextParallelAttention& operator=(const ContextParallelAttention&) = delete;

  // q: [B, S/cp, Hq, D]; k, v: [B, S/cp, Hkv, D]; segment_ids: [B, S/cp] or empty (one document per row).
  // Shapes that disagree with the spec, or with another rank's, are an Error on every rank before any data
  // moves. forward_only (prefill) keeps no state for a backward.
  // sinks: [Hq] (this tp rank's heads) with AttentionSpec::sinks, the same values on every rank (else an
  // Error naming them); empty without.
  AttentionOutput forward(const Tensor& q, const Tensor& k, const Tensor& v,
                          std::span<const std::int32_t> segment_ids = {}, bool forward_only = false,
                          std::span<const float> sinks = {});
  // d_out: [B, S/cp, Hq, D]. Needs a forward (not forward-only) before it.
  AttentionGradients backward(const Tensor& d_out);

  // What a forward keeps for its backward. take_saved() moves it out of the object after a forward that was
  // not forward-only; backward(d_out, saved) runs on it, and leaves it in `saved` (a second backward on it
  // gives the same gradients). Several forwards can so each keep their own until their backward: layers or
  // micro-batches sharing one object, an autograd graph. Every rank takes and passes back its own.
  class Saved;
  std::shared_ptr<Saved> take_saved();
  AttentionGradients backward(const Tensor& d_out, Saved& saved);

  // Tiles this rank's kernel computed in the last forward, per (batch row, local q head).
  const TileCounts& forward_tiles() const;
  // Seconds this rank spent waiting for its ring shifts to complete since the last forward began (its
  // forward and backward): the transfer time its compute did not hide. 0 for the other strategies.
  double comm_wait_seconds() const;
  // The bytes the last forward kept for its backward (0 after a forward-only call or a backward).
  std::int64_t saved_bytes() const;
  // The global position of each local token (the same for every batch row).
  const std::vector<std::int32_t>& local_positions() const;

  class Impl;

 private:
  friend class ContextParallelInternals;
  std::unique_ptr<Impl> impl_;
};

// The load-balance reorder for callers whose other layers need contiguous order: converts this rank's shard
// of an activation [B, S/cp, H, W] between layouts with collective permutes (one per local chunk slot).
Tensor reorder_sequence(Communicator& comm, const Tensor& x, std::int64_t seq_len, ShardLayout from,
                        ShardLayout to);
// The same between any two layouts of the row (make_layout, layout_of; the layouts cut by documents too):
// one all_to_all_v, in which rank r sends rank p the tokens r holds in `from` and p holds in `to`, each
// placed at its slot in `to`. Both layouts over comm.size() ranks and one row, each position held once and
// every rank holding seq_len / cp (layout_errors); x: [B, seq_len / cp, H, W].
Tensor reorder_sequence(Communicator& comm, const Tensor& x, const SequenceLayout& from,
                        const SequenceLayout& to);

}  // namespace cpattn
