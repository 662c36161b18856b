// The ring's two passes (ring_strategy.cpp) over any ring of ranks and any local heads: the ring strategy
// runs them over all cp ranks with every head, the hybrid over its ring group with its ulysses heads.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "cpattn/comm.hpp"
#include "cpattn/config.hpp"
#include "cpattn/context_parallel.hpp"
#include "cpattn/flash.hpp"
#include "cpattn/sequence_layout.hpp"
#include "head_parts.hpp"

namespace cpattn::cp {

struct RingPass {
  Communicator& comm;              // the ring; rank() is this rank's place in it
  const RankPositions& positions;  // each ring rank's local rows' global positions
  const RankRuns& runs;            // each ring rank's runs of consecutive positions, each on its own grid
  std::vector<KernelCall> calls;   // the local q heads onto the local kv heads
  const AttentionSpec& attention;  // batch, seq_len, causal, scale, dtype
  FlashConfig kernel;
  NegativeControl control = NegativeControl::none;
  double* waited = nullptr;                              // time spent in shifts' wait(), added to
  TileCounts* tiles = nullptr;                           // forward: the tiles computed, set
  std::vector<std::vector<float>>* step_lses = nullptr;  // negative control ring_step_lse: each step's LSE
  std::span<const float> sinks = {};  // the sinks of the pass's q heads, folded in after the last step
  // Direct (a window, or packed documents that leave rows unseen: ring_route over `positions`): only its
  // steps, each rank's rows straight to the ranks that see them. Null or not direct: round the ring.
  const RingRoute* route = nullptr;
};

// q: [B, L, n, D], k, v: [B, L, nkv, D] (L = the ring rank's rows); seg_local [B, L] and seg_full [B, S] in
// natural order (both empty when not packed). Returns O [B, L, n, D] in the inputs' dtype and LSE [B, n, L].
AttentionOutput ring_pass_forward(const RingPass& ring, const Tensor& q, const Tensor& k, const Tensor& v,
                                  const std::vector<std::int32_t>& seg_local,
                                  const std::vector<std::int32_t>& seg_full);

// The gradients of the rank's rows, fp32: dq [B, L, n, D], dk, dv [B, L, nkv, D] (each kv shard's
// accumulator home after its trip round the ring).
struct RingGradients {
  Tensor dq, dk, dv;
};
RingGradients ring_pass_backward(const RingPass& ring, const Tensor& q, const Tensor& k, const Tensor& v,
                                 const Tensor& o, const std::vector<float>& lse, const Tensor& d_out,
                                 const std::vector<std::int32_t>& seg_local,
                                 const std::vector<std::int32_t>& seg_full);

}  // namespace cpattn::cp
