// Collectives over sequence-sharded tensors, built on the Communicator's flat ones with a pack step:
// the Ulysses head/sequence swaps, the all_gather into natural order and the reduce-scatter back to shards.
#pragma once

#include <cstdint>
#include <vector>

#include "cpattn/comm.hpp"
#include "cpattn/sequence_layout.hpp"
#include "cpattn/tensor.hpp"

namespace cpattn::cp {

// x: [B, S/cp, H, D] contiguous shard -> [B, S, H/cp, D]: this rank's heads for the whole sequence.
Tensor all_to_all_sequence_to_heads(Communicator& comm, const Tensor& x);
// y: [B, S, H/cp, D] -> [B, S/cp, H, D]: every head for this rank's tokens.
Tensor all_to_all_heads_to_sequence(Communicator& comm, const Tensor& y);
// lse: [B, H/cp, S] -> [B, H, S/cp].
std::vector<float> all_to_all_lse_heads_to_sequence(Communicator& comm, const std::vector<float>& lse,
                                                    std::int64_t batch, std::int64_t local_heads,
                                                    std::int64_t seq);

// x: [B, S/cp, H, D] -> [B, S, H, D] in natural (global position) order.
Tensor all_gather_sequence(Communicator& comm, const Tensor& x, const RankPositions& positions);
// ids: [B, S/cp] -> [B, S] natural order.
std::vector<std::int32_t> all_gather_segments(Communicator& comm, const std::vector<std::int32_t>& ids,
                                              std::int64_t batch, const RankPositions& positions);
// partial: [B, S, H, D] fp32 natural order -> [B, S/cp, H, D] fp32: the sum over ranks of this rank's tokens.
Tensor reduce_scatter_sequence(Communicator& comm, const Tensor& partial, const RankPositions& positions);

}  // namespace cpattn::cp
