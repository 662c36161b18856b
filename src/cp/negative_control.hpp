// Deliberately wrong variants of the ulysses strategy that exist only so that tests can show they are caught
// (docs/design.md, "Negative controls"). Not part of the library's interface: the tests and the harness reach
// them through this internal header.
#pragma once

#include "cpattn/context_parallel.hpp"

namespace cpattn {

enum class NegativeControl {
  none,
  tiled_kv_order,         // ulysses: [kv0, kv1, kv0, kv1] instead of grouped
  scaled_kv_grad_sum,     // ulysses: replica gradients summed and scaled by 1/rep
  first_kv_replica_only,  // ulysses: one replica's gradient taken instead of the sum
};

class ContextParallelInternals {
 public:
  // Makes `attention` run the wrong variant from its next forward on.
  static void set_negative_control(ContextParallelAttention& attention, NegativeControl control);
};

}  // namespace cpattn
