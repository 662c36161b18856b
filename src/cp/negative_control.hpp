// Deliberately wrong variants of the ulysses and ring strategies that exist only so that tests can show they
// are caught (docs/design.md, "Negative controls"). Not part of the library's interface: the tests and the
// harness reach them through this internal header.
#pragma once

#include "cpattn/context_parallel.hpp"

namespace cpattn {

enum class NegativeControl {
  none,
  tiled_kv_order,                  // ulysses: [kv0, kv1, kv0, kv1] instead of grouped
  scaled_kv_grad_sum,              // ulysses: a kv head's contributions summed and scaled by 1/their number
  first_kv_replica_only,           // ulysses: one rank's contribution taken instead of the sum
  shifted_kv_set,                  // ulysses: a rank starting a q group receives the kv heads one on
  extra_q_heads_on_highest_ranks,  // ulysses: the extra q heads on the highest ranks, the kv sets as if
                                   // lowest
  ring_step_lse,                   // ring: each backward step uses that step's LSE, not the final one
  ring_accumulator_one_hop_short,  // ring: the dK/dV accumulators never make their last hop home
  ring_zigzag_swapped,             // ring with load balance: a visiting shard's two chunks at each other's
                                   // positions (the step rule's cases swapped)
  layout_runs_swapped,             // any layout of two runs or more on rank 0: the strategies read its first
                                   // two runs in the other order (a document's pieces swapped), the data hold
                                   // them as the layout says
};

class ContextParallelInternals {
 public:
  // Makes `attention` run the wrong variant from its next forward on.
  static void set_negative_control(ContextParallelAttention& attention, NegativeControl control);
};

}  // namespace cpattn
