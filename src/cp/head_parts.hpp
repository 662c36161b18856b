// What ulysses and hybrid share about head-sharded attention (ulysses_strategy.cpp): the placement a run
// uses, the kernel calls that map a rank's q heads onto its kv heads, and the sum of the kv heads' gradient
// contributions on their way back.
#pragma once

#include <cstdint>
#include <vector>

#include "cpattn/flash.hpp"
#include "cpattn/placement.hpp"
#include "cpattn/tensor.hpp"
#include "negative_control.hpp"

namespace cpattn::cp {

// The placement a run over `ranks` ranks uses: ulysses_heads, or one of the negative controls' wrong ones.
UlyssesHeads run_placement(std::int64_t hq, std::int64_t hkv, std::int64_t ranks, NegativeControl control);

// Local q heads [q0, q0 + nq) against local kv heads [kv0, kv0 + nkv) in one kernel call.
struct KernelCall {
  std::int64_t q0, nq, kv0, nkv;
};

// q head h reads local kv slot h / G - first(kv) (clamped, so that a wrong placement reads a wrong head
// rather than out of bounds). One call when the local q heads map onto the local kv heads uniformly (the
// kernel's own GQA map); otherwise one call per local kv head with the run of q heads that read it (Hq=24,
// Hkv=3, cp=4: rank 1 has q heads 6..11, two on kv 0 and four on kv 1). Either keeps each row's arithmetic.
std::vector<KernelCall> kernel_calls(const HeadRange& q, const HeadRange& kv, std::int64_t group);

// g: [B, S/cp, slots, D] fp32, slot s holding a contribution to kv head order[s] -> [B, S/cp, Hkv, D]: for
// each head the sum of its contributions in slot (= rank) order, or one of the wrong variants kept as
// negative controls.
Tensor sum_contributions(const Tensor& g, const std::vector<std::int64_t>& order, std::int64_t hkv,
                         NegativeControl control);

// Adds a call's tile counts (per_head [B, nq]) into the rank's ([B, n]).
void add_call_tiles(TileCounts& into, const TileCounts& call, std::int64_t batch, std::int64_t n,
                    const KernelCall& c);

// Whether the dK/dV slots that come back need summing (a kv head on several ranks, or out of order).
bool contributions_shared(const std::vector<std::int64_t>& order, std::int64_t hkv);

}  // namespace cpattn::cp
